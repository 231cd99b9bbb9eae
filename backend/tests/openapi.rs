//! `openapi.yaml` is the interface as a machine-readable document. These tests keep it honest:
//! it parses as OpenAPI 3.1, every `$ref` in it resolves, and its paths and methods are exactly
//! the routes the backend serves, checked both against the route table and over HTTP.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use backend::error::ErrorCode;
use backend::routes::{BASE_PATH, ROUTES};
use common::TestServer;
use serde_json::{json, Value};

const METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

fn document() -> Value {
    // Read at run time (`env!` would compile in the path of the clone that built the test).
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("run by cargo test or nextest");
    let path = std::path::Path::new(&manifest).join("../openapi.yaml");
    let text = std::fs::read_to_string(path).expect("openapi.yaml at the repository root");
    serde_norway::from_str(&text).expect("openapi.yaml parses as YAML")
}

/// path → method (upper case) → operationId, as the document declares them.
/// The operations the backend serves: every documented one but those the gateway answers itself
/// (`x-answered-by: gateway`, such as `GET /rate_limit`).
fn documented_operations(doc: &Value) -> BTreeMap<String, BTreeMap<String, String>> {
    let paths = doc["paths"].as_object().expect("`paths` is a map");
    paths
        .iter()
        .map(|(path, item)| {
            let ops: BTreeMap<String, String> = METHODS
                .iter()
                .filter_map(|m| {
                    let op = item.get(*m)?;
                    if op["x-answered-by"] == "gateway" {
                        return None;
                    }
                    let id = op["operationId"]
                        .as_str()
                        .expect("every operation has an operationId");
                    Some((m.to_uppercase(), id.to_owned()))
                })
                .collect();
            (path.clone(), ops)
        })
        .filter(|(_, ops)| !ops.is_empty())
        .collect()
}

#[test]
fn it_is_openapi_3_1_with_v1_servers_and_bearer_security() {
    let doc = document();
    assert!(
        doc["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.1.")),
        "{}",
        doc["openapi"]
    );
    assert_eq!(doc["info"]["version"], "1.0.0");
    let servers = doc["servers"].as_array().expect("servers");
    assert!(!servers.is_empty());
    for server in servers {
        let mut url = server["url"].as_str().expect("server url").to_owned();
        if let Some(vars) = server["variables"].as_object() {
            for (name, var) in vars {
                url = url.replace(
                    &format!("{{{name}}}"),
                    var["default"].as_str().expect("default"),
                );
            }
        }
        assert!(
            url.ends_with(BASE_PATH),
            "server {url} includes the version segment"
        );
    }
    assert_eq!(
        doc["components"]["securitySchemes"]["bearerAuth"]["scheme"],
        "bearer"
    );
    assert_eq!(doc["security"], json!([{"bearerAuth": []}]));
}

#[test]
fn every_ref_resolves() {
    fn walk(node: &Value, refs: &mut Vec<String>) {
        match node {
            Value::Object(map) => {
                if let Some(Value::String(r)) = map.get("$ref") {
                    refs.push(r.clone());
                }
                map.values().for_each(|v| walk(v, refs));
            }
            Value::Array(items) => items.iter().for_each(|v| walk(v, refs)),
            _ => {}
        }
    }
    let doc = document();
    let mut refs = Vec::new();
    walk(&doc, &mut refs);
    assert!(
        refs.len() > 20,
        "the document shares its parts through $ref"
    );
    for r in refs {
        let pointer = r
            .strip_prefix('#')
            .unwrap_or_else(|| panic!("{r} is not local"));
        assert!(doc.pointer(pointer).is_some(), "{r} does not resolve");
    }
}

#[test]
fn paths_methods_and_operation_ids_are_exactly_the_route_table() {
    let documented = documented_operations(&document());
    let served: BTreeMap<String, BTreeMap<String, String>> = ROUTES
        .iter()
        .map(|r| {
            let ops = r
                .methods
                .iter()
                .map(|(m, op)| (m.as_str().to_owned(), op.id().to_owned()))
                .collect();
            (r.path.to_owned(), ops)
        })
        .collect();
    assert_eq!(documented, served);
}

#[test]
fn the_documented_error_codes_include_every_code_the_backend_emits() {
    let doc = document();
    let documented: BTreeSet<&str> = doc["components"]["schemas"]["Error"]["properties"]["code"]
        ["enum"]
        .as_array()
        .expect("Error.code enum")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for code in ErrorCode::ALL {
        assert!(
            documented.contains(code.as_str()),
            "{} is not documented",
            code.as_str()
        );
    }
}

/// Over HTTP: each documented method of each documented path is served (neither 404 for the
/// route nor 405), and every other method on that path gets 405 with exactly the documented
/// methods in `Allow`.
#[tokio::test]
async fn the_running_backend_serves_exactly_the_documented_operations() {
    let s = TestServer::start().await;
    let pet = s.create(json!({"name": "Doc", "categoryId": 1})).await;
    let documented = documented_operations(&document());
    for (path, ops) in &documented {
        let concrete = path.replace("{petId}", &pet["id"].to_string());
        let url = s.url(&format!("{BASE_PATH}{concrete}"));
        for method in ["GET", "POST", "PUT", "PATCH", "DELETE"] {
            let mut req = s.client.request(method.parse().expect("method"), &url);
            if method == "POST" {
                req = req.json(&json!({"name": "Doc", "categoryId": 1}));
            }
            let resp = req.send().await.expect("send");
            let status = resp.status().as_u16();
            if ops.contains_key(method) {
                assert!(
                    status != 404 && status != 405,
                    "{method} {path} is documented but answered {status}"
                );
            } else {
                assert_eq!(status, 405, "{method} {path} is not documented");
                let allow: BTreeSet<String> = resp.headers()["allow"]
                    .to_str()
                    .expect("ascii")
                    .split(", ")
                    .map(str::to_owned)
                    .collect();
                assert_eq!(allow, ops.keys().cloned().collect(), "Allow of {path}");
            }
        }
    }
}
