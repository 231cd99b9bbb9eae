//! The backend's HTTP behaviour, in-process over real loopback sockets: every operation, every
//! decision of the design's gap table, and every bad input the foundation issue lists, each with
//! its exact status and `code`.

mod common;

use std::collections::HashSet;

use common::{expect_error, raw_exchange, read_response, TestServer};
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

async fn post_raw(s: &TestServer, content_type: Option<&str>, body: Vec<u8>) -> reqwest::Response {
    let mut req = s.client.post(s.url("/v1/pets")).body(body);
    if let Some(ct) = content_type {
        req = req.header("content-type", ct);
    }
    req.send().await.expect("send")
}

#[tokio::test]
async fn create_returns_201_the_pet_and_its_location() {
    let s = TestServer::start().await;
    let resp = post_raw(
        &s,
        Some("application/json; charset=utf-8"),
        br#"{"name":"  Rex  ","categoryId":3}"#.to_vec(),
    )
    .await;
    assert_eq!(resp.status(), 201);
    assert_eq!(resp.headers()["content-type"], "application/json");
    let location = resp.headers()["location"].to_str().unwrap().to_owned();
    let pet: Value = resp.json().await.unwrap();
    let id = pet["id"].as_i64().expect("integer id");
    assert!(id >= 1);
    assert_eq!(
        pet,
        json!({"id": id, "name": "Rex", "categoryId": 3, "status": "available"})
    );
    assert_eq!(location, format!("/v1/pets/{id}"));

    let sold = s
        .create(json!({"name": "Tom", "categoryId": 1, "status": "sold"}))
        .await;
    assert_eq!(sold["status"], "sold");
    assert!(sold["id"].as_i64().unwrap() > id);
}

#[tokio::test]
async fn bad_bodies_get_400_invalid_request() {
    let s = TestServer::start().await;
    let long_name = "x".repeat(101);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("missing body", Vec::new()),
        ("not JSON", b"name=Rex".to_vec()),
        ("truncated JSON", br#"{"name":"Rex","#.to_vec()),
        ("JSON array", br#"[{"name":"Rex","categoryId":1}]"#.to_vec()),
        ("fields spelled as an array", br#"["Rex",1]"#.to_vec()),
        ("JSON string", br#""Rex""#.to_vec()),
        ("JSON number", b"42".to_vec()),
        ("JSON null", b"null".to_vec()),
        ("name missing", br#"{"categoryId":1}"#.to_vec()),
        ("categoryId missing", br#"{"name":"Rex"}"#.to_vec()),
        ("name a number", br#"{"name":5,"categoryId":1}"#.to_vec()),
        (
            "categoryId a string",
            br#"{"name":"Rex","categoryId":"7"}"#.to_vec(),
        ),
        ("categoryId 0", br#"{"name":"Rex","categoryId":0}"#.to_vec()),
        (
            "categoryId -1",
            br#"{"name":"Rex","categoryId":-1}"#.to_vec(),
        ),
        (
            "categoryId 1.5",
            br#"{"name":"Rex","categoryId":1.5}"#.to_vec(),
        ),
        (
            "categoryId 2^63",
            br#"{"name":"Rex","categoryId":9223372036854775808}"#.to_vec(),
        ),
        (
            "status unknown",
            br#"{"name":"Rex","categoryId":1,"status":"adopted"}"#.to_vec(),
        ),
        (
            "status a number",
            br#"{"name":"Rex","categoryId":1,"status":1}"#.to_vec(),
        ),
        (
            "name only spaces",
            br#"{"name":"    ","categoryId":1}"#.to_vec(),
        ),
        ("name empty", br#"{"name":"","categoryId":1}"#.to_vec()),
        (
            "name 101 characters",
            format!(r#"{{"name":"{long_name}","categoryId":1}}"#).into_bytes(),
        ),
        (
            "name with a control character",
            br#"{"name":"Re\u0000x","categoryId":1}"#.to_vec(),
        ),
        (
            "name with a newline inside",
            br#"{"name":"Re\nx","categoryId":1}"#.to_vec(),
        ),
        (
            "read-only id",
            br#"{"id":7,"name":"Rex","categoryId":1}"#.to_vec(),
        ),
        (
            "unknown field",
            br#"{"name":"Rex","categoryId":1,"colour":"red"}"#.to_vec(),
        ),
        (
            "invalid UTF-8",
            b"{\"name\":\"R\xffx\",\"categoryId\":1}".to_vec(),
        ),
    ];
    for (what, body) in cases {
        let resp = post_raw(&s, Some("application/json"), body).await;
        let err = expect_error(resp, 400, "invalid_request").await;
        println!("{what}: {}", err["message"]);
    }
    // The messages name the field at fault.
    let resp = post_raw(
        &s,
        Some("application/json"),
        br#"{"id":7,"name":"Rex","categoryId":1}"#.to_vec(),
    )
    .await;
    assert!(expect_error(resp, 400, "invalid_request").await["message"]
        .as_str()
        .unwrap()
        .contains("`id`"));
    let resp = post_raw(
        &s,
        Some("application/json"),
        br#"{"name":"Rex","categoryId":0}"#.to_vec(),
    )
    .await;
    assert!(expect_error(resp, 400, "invalid_request").await["message"]
        .as_str()
        .unwrap()
        .contains("`categoryId`"));
    // Nothing was created by any of them.
    let list: Value = s
        .client
        .get(s.url("/v1/pets"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list, json!([]));
}

#[tokio::test]
async fn a_missing_body_is_400_even_without_content_type() {
    let s = TestServer::start().await;
    expect_error(post_raw(&s, None, Vec::new()).await, 400, "invalid_request").await;
}

#[tokio::test]
async fn content_types_other_than_json_get_415() {
    let s = TestServer::start().await;
    let body = br#"{"name":"Rex","categoryId":1}"#.to_vec();
    for ct in [
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        Some("application/jsonx"),
        None,
    ] {
        let resp = post_raw(&s, ct, body.clone()).await;
        expect_error(resp, 415, "unsupported_media_type").await;
    }
}

#[tokio::test]
async fn bodies_over_64_kib_get_413_and_64_kib_exactly_is_accepted() {
    let s = TestServer::start().await;
    let pet = br#"{"name":"Rex","categoryId":1}"#;
    let mut exact = pet.to_vec();
    exact.resize(64 * 1024, b' ');
    assert_eq!(
        post_raw(&s, Some("application/json"), exact).await.status(),
        201
    );

    let mut over = pet.to_vec();
    over.resize(64 * 1024 + 1, b' ');
    expect_error(
        post_raw(&s, Some("application/json"), over).await,
        413,
        "payload_too_large",
    )
    .await;

    // Without a Content-Length the limit still holds while the body streams in.
    let chunk = vec![b' '; 40 * 1024];
    let mut req = b"POST /v1/pets HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
                    Transfer-Encoding: chunked\r\n\r\n"
        .to_vec();
    for _ in 0..2 {
        req.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        req.extend_from_slice(&chunk);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"0\r\n\r\n");
    let answer = raw_exchange(s.addr, &req).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains(r#""code":"payload_too_large""#), "{answer}");
}

#[tokio::test]
async fn get_pet_found_missing_and_bad_ids_all_carry_deprecation_headers() {
    let s = TestServer::start().await;
    let pet = s
        .create(json!({"name": "Rex", "categoryId": 2, "status": "pending"}))
        .await;
    let id = pet["id"].as_i64().unwrap();

    let check_headers = |resp: &reqwest::Response| {
        let h = resp.headers();
        assert_eq!(h["deprecation"], "@1767225600");
        assert_eq!(h["sunset"], "Thu, 05 Dec 2030 00:00:00 GMT");
        assert_eq!(h["link"], "</v1/pets>; rel=\"successor-version\"");
    };

    let resp = s
        .client
        .get(s.url(&format!("/v1/pets/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    check_headers(&resp);
    assert_eq!(resp.json::<Value>().await.unwrap(), pet);

    let resp = s
        .client
        .get(s.url(&format!("/v1/pets/{}", id + 1000)))
        .send()
        .await
        .unwrap();
    check_headers(&resp);
    expect_error(resp, 404, "not_found").await;

    for bad in ["abc", "0", "-3", "9223372036854775808", "1.0", "%31"] {
        let resp = s
            .client
            .get(s.url(&format!("/v1/pets/{bad}")))
            .send()
            .await
            .unwrap();
        check_headers(&resp);
        let err = expect_error(resp, 400, "invalid_parameter").await;
        assert!(
            err["message"].as_str().unwrap().contains("`petId`"),
            "{bad}: {err}"
        );
    }
}

#[tokio::test]
async fn list_defaults_filters_and_pages_with_a_next_link() {
    let s = TestServer::start().await;
    let empty = s.client.get(s.url("/v1/pets")).send().await.unwrap();
    assert_eq!(empty.status(), 200);
    assert!(empty.headers().get("link").is_none());
    assert_eq!(empty.json::<Value>().await.unwrap(), json!([]));

    let mut ids = Vec::new();
    for i in 0..25 {
        let status = ["available", "pending", "sold"][i % 3];
        let pet = s
            .create(json!({"name": format!("pet{i}"), "categoryId": 1, "status": status}))
            .await;
        ids.push(pet["id"].as_i64().unwrap());
    }

    // Default page size 20, ascending id, a next link.
    let resp = s.client.get(s.url("/v1/pets")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let link = resp.headers()["link"].to_str().unwrap().to_owned();
    let page: Vec<Value> = resp.json().await.unwrap();
    let got: Vec<i64> = page.iter().map(|p| p["id"].as_i64().unwrap()).collect();
    assert_eq!(got, ids[..20]);
    assert_eq!(
        link,
        format!("</v1/pets?limit=20&after={}>; rel=\"next\"", ids[19])
    );

    // Following the link yields the rest, and no further link.
    let next = link.trim_start_matches('<').split('>').next().unwrap();
    let resp = s.client.get(s.url(next)).send().await.unwrap();
    assert!(resp.headers().get("link").is_none());
    let page: Vec<Value> = resp.json().await.unwrap();
    let got: Vec<i64> = page.iter().map(|p| p["id"].as_i64().unwrap()).collect();
    assert_eq!(got, ids[20..]);

    // Status filter keeps only that status, and the link keeps the filter.
    let resp = s
        .client
        .get(s.url("/v1/pets?status=sold&limit=3"))
        .send()
        .await
        .unwrap();
    let link = resp.headers()["link"].to_str().unwrap().to_owned();
    let page: Vec<Value> = resp.json().await.unwrap();
    assert_eq!(page.len(), 3);
    assert!(page.iter().all(|p| p["status"] == "sold"));
    let sold_ids: Vec<i64> = ids.iter().copied().skip(2).step_by(3).collect();
    assert_eq!(
        link,
        format!(
            "</v1/pets?limit=3&after={}&status=sold>; rel=\"next\"",
            sold_ids[2]
        )
    );

    // Limits 1 and 100 are both in range.
    let one: Vec<Value> = s
        .client
        .get(s.url("/v1/pets?limit=1"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(one.len(), 1);
    let all: Vec<Value> = s
        .client
        .get(s.url("/v1/pets?limit=100"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(all.len(), 25);
}

#[tokio::test]
async fn bad_query_values_get_400_invalid_parameter_naming_the_parameter() {
    let s = TestServer::start().await;
    let cases = [
        ("limit=0", "`limit`"),
        ("limit=101", "`limit`"),
        ("limit=abc", "`limit`"),
        ("limit=-5", "`limit`"),
        ("status=adopted", "`status`"),
        ("status=AVAILABLE", "`status`"),
        ("after=-1", "`after`"),
        ("after=x", "`after`"),
        ("limit=5&limit=6", "`limit`"),
        ("colour=red", "`colour`"),
    ];
    for (query, name) in cases {
        let resp = s
            .client
            .get(s.url(&format!("/v1/pets?{query}")))
            .send()
            .await
            .unwrap();
        let err = expect_error(resp, 400, "invalid_parameter").await;
        assert!(
            err["message"].as_str().unwrap().contains(name),
            "{query}: {err}"
        );
    }
}

#[tokio::test]
async fn orders_are_501_unknown_paths_404_wrong_methods_405_with_allow() {
    let s = TestServer::start().await;
    expect_error(
        s.client
            .get(s.url("/v1/store/orders"))
            .send()
            .await
            .unwrap(),
        501,
        "not_implemented",
    )
    .await;
    for path in [
        "/",
        "/v1",
        "/v1/pet",
        "/v2/pets",
        "/v1/pets/1/owner",
        "/v1/pets/",
    ] {
        expect_error(
            s.client.get(s.url(path)).send().await.unwrap(),
            404,
            "not_found",
        )
        .await;
    }
    let cases = [
        (reqwest::Method::PUT, "/v1/pets", "GET, POST"),
        (reqwest::Method::DELETE, "/v1/pets", "GET, POST"),
        (reqwest::Method::DELETE, "/v1/pets/1", "GET"),
        (reqwest::Method::POST, "/v1/pets/1", "GET"),
        (reqwest::Method::POST, "/v1/store/orders", "GET"),
    ];
    for (method, path, allow) in cases {
        let resp = s
            .client
            .request(method.clone(), s.url(path))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.headers()["allow"], allow, "{method} {path}");
        expect_error(resp, 405, "method_not_allowed").await;
    }
}

#[tokio::test]
async fn two_hundred_concurrent_creates_all_get_distinct_ids_and_none_is_lost() {
    let s = TestServer::start().await;
    let creates = (0..200).map(|i| {
        let client = s.client.clone();
        let url = s.url("/v1/pets");
        tokio::spawn(async move {
            let resp = client
                .post(url)
                .json(&json!({"name": format!("c{i}"), "categoryId": 1 + i % 7}))
                .send()
                .await
                .expect("send");
            assert_eq!(resp.status(), 201);
            let pet: Value = resp.json().await.expect("json");
            (
                pet["id"].as_i64().expect("id"),
                pet["name"].as_str().expect("name").to_owned(),
            )
        })
    });
    let mut created = Vec::new();
    for task in creates.collect::<Vec<_>>() {
        created.push(task.await.expect("create task"));
    }
    let ids: HashSet<i64> = created.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids.len(), 200, "ids are distinct");

    // List them all back, page by page through the cursor.
    let mut listed = Vec::new();
    let mut after = 0;
    loop {
        let page: Vec<Value> = s
            .client
            .get(s.url(&format!("/v1/pets?limit=100&after={after}")))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let Some(last) = page.last() else { break };
        after = last["id"].as_i64().unwrap();
        listed.extend(page.iter().map(|p| {
            (
                p["id"].as_i64().unwrap(),
                p["name"].as_str().unwrap().to_owned(),
            )
        }));
    }
    created.sort();
    assert_eq!(
        listed, created,
        "every created pet is listed, once, in id order"
    );
}

#[tokio::test]
async fn shutdown_lets_an_in_flight_request_finish() {
    let mut s = TestServer::start().await;
    let body = br#"{"name":"Late","categoryId":1}"#;
    let mut stream = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let head = format!(
        "POST /v1/pets HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&body[..5]).await.unwrap();
    // Give the server time to start on the request, then ask it to stop.
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let server = s.shutdown();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert!(
        !server.is_finished(),
        "server waits for the in-flight request"
    );
    stream.write_all(&body[5..]).await.unwrap();
    let answer = read_response(&mut stream).await;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    tokio::time::timeout(std::time::Duration::from_secs(5), server)
        .await
        .expect("server stops once drained")
        .expect("server task");
    // And it no longer accepts new connections.
    assert!(tokio::net::TcpStream::connect(s.addr).await.is_err());
}

#[tokio::test]
async fn keep_alive_serves_many_requests_on_one_connection() {
    let s = TestServer::start().await;
    let mut stream = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    for _ in 0..3 {
        stream
            .write_all(b"GET /v1/pets HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let answer = read_response(&mut stream).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
}

/// From the sunset instant on, getPet answers 410 `gone` naming its successor, with the same
/// deprecation headers (the `Sunset` date being the instant configured); until then it serves.
#[tokio::test]
async fn get_pet_is_gone_from_its_sunset_on() {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};
    let past = UNIX_EPOCH + Duration::from_secs(1_700_000_000); // 2023-11-14T22:13:20Z
    let s = TestServer::start_with(backend::Settings::new(past)).await;
    let pet = s.create(json!({"name": "Rex", "categoryId": 1})).await;
    for path in [
        format!("/v1/pets/{}", pet["id"]),
        "/v1/pets/999".into(),
        "/v1/pets/abc".into(),
    ] {
        let resp = s.client.get(s.url(&path)).send().await.unwrap();
        let h = resp.headers().clone();
        let body = expect_error(resp, 410, "gone").await;
        let message = body["message"].as_str().unwrap();
        assert!(message.contains("GET /v1/pets"), "{message}");
        assert!(
            message.contains("Tue, 14 Nov 2023 22:13:20 GMT"),
            "{message}"
        );
        assert_eq!(h["deprecation"], "@1767225600");
        assert_eq!(h["sunset"], "Tue, 14 Nov 2023 22:13:20 GMT");
        assert_eq!(h["link"], "</v1/pets>; rel=\"successor-version\"");
        assert_eq!(h["cache-control"], "no-store");
    }
    // The successor still serves.
    let resp = s.client.get(s.url("/v1/pets")).send().await.unwrap();
    assert_eq!(resp.status(), 200);

    let soon = SystemTime::now() + Duration::from_secs(3_600);
    let s = TestServer::start_with(backend::Settings::new(soon)).await;
    let pet = s.create(json!({"name": "Rex", "categoryId": 1})).await;
    let resp = s
        .client
        .get(s.url(&format!("/v1/pets/{}", pet["id"])))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "before the sunset it serves");
}
