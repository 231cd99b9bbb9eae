//! The gateway's route labels are `openapi.yaml`'s operations: the same paths, methods and
//! operation ids, and every documented operation is recognised on a concrete request. A new
//! operation in the document without a route here (or the reverse) fails this test.

use std::collections::BTreeSet;

use proxy::http::routes::Route;
use serde_json::Value;

const METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

/// (METHOD, path, operationId) for every operation the document declares.
fn documented() -> BTreeSet<(String, String, String)> {
    // Read at run time (`env!` would compile in the path of the clone that built the test).
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("run by cargo test or nextest");
    let path = std::path::Path::new(&manifest).join("../openapi.yaml");
    let text = std::fs::read_to_string(path).expect("openapi.yaml at the repository root");
    let doc: Value = serde_norway::from_str(&text).expect("openapi.yaml parses as YAML");
    let mut ops = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().expect("`paths` is a map") {
        for m in METHODS {
            if let Some(op) = item.get(m) {
                let id = op["operationId"].as_str().expect("an operationId");
                ops.insert((m.to_uppercase(), path.clone(), id.to_owned()));
            }
        }
    }
    ops
}

#[test]
fn the_route_table_is_exactly_the_documented_operations() {
    let table: BTreeSet<_> = Route::OPERATIONS
        .iter()
        .map(|(route, method, path)| {
            (
                method.as_str().to_owned(),
                (*path).to_owned(),
                route.as_str().to_owned(),
            )
        })
        .collect();
    assert_eq!(table, documented());
}

#[test]
fn every_documented_operation_is_recognised_on_a_concrete_request() {
    for (method, path, id) in documented() {
        let concrete = format!("/v1{}", path.replace("{petId}", "42"));
        let method: http::Method = method.parse().expect("an HTTP method");
        assert_eq!(
            Route::of(&method, &concrete).as_str(),
            id,
            "{method} {concrete}"
        );
    }
}
