//! The real `pet-backend` binary as an operator runs it: durability across SIGKILL, and a
//! clean exit on SIGTERM that lets in-flight requests finish.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use e2e::{Backend, Process};
use serde_json::{json, Value};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

#[test]
fn a_201_survives_sigkill_right_after_the_response() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("pets.db");
    let rt = runtime();
    let client = reqwest::Client::new();

    let mut created = Vec::new();
    for round in 0..3 {
        let backend = Backend::start(&db);
        // Several creates, the last answered immediately before the kill: no time to flush.
        for i in 0..5 {
            let pet: Value = rt.block_on(async {
                let resp = client
                    .post(backend.url("/v1/pets"))
                    .json(&json!({"name": format!("r{round}p{i}"), "categoryId": 1}))
                    .send()
                    .await
                    .expect("create");
                assert_eq!(resp.status(), 201);
                resp.json().await.expect("pet")
            });
            created.push(pet);
        }
        backend.process.kill_hard();
    }

    let backend = Backend::start(&db);
    for pet in &created {
        let found: Value = rt.block_on(async {
            let resp = client
                .get(backend.url(&format!("/v1/pets/{}", pet["id"])))
                .send()
                .await
                .expect("get");
            assert_eq!(resp.status(), 200, "pet {pet} lost after SIGKILL");
            resp.json().await.expect("pet")
        });
        assert_eq!(&found, pet);
    }
}

#[test]
fn sigterm_finishes_the_in_flight_request_then_exits_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let backend = Backend::start(&dir.path().join("pets.db"));
    let body = br#"{"name":"Drain","categoryId":1}"#;

    let mut stream = TcpStream::connect(backend.addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "POST /v1/pets HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    stream.write_all(&body[..4]).unwrap();
    std::thread::sleep(Duration::from_millis(200));

    backend.process.signal(15);
    std::thread::sleep(Duration::from_millis(200));
    stream.write_all(&body[4..]).unwrap();

    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");

    let code = Process::wait_exit(backend.process, Duration::from_secs(10));
    assert_eq!(code, Some(0), "pet-backend exits 0 after draining");
}

/// The getPet sunset, moved by `--get-pet-sunset`, as a client sees it through the gateway: 410
/// `gone` with the deprecation headers dated by the flag and the gateway's rate-limit headers;
/// the successor still serves. A value that is not an instant stops the backend with a message
/// naming it.
#[test]
fn get_pet_answers_410_through_the_gateway_after_a_moved_sunset() {
    let s = e2e::Fixture::new(60, 1_000);
    let key = s.issue("free");
    let db = s.dir.path().join("pets.db");
    let backend = Backend::start_with(
        e2e::free_addr(),
        &db,
        &["--get-pet-sunset", "2021-03-04T05:06:07+01:00"],
    );
    let gw = e2e::GatewayProcess::start(s.dir.path(), &s.spec(backend.addr));
    let rt = runtime();
    let client = reqwest::Client::new();
    rt.block_on(async {
        let created = client
            .post(gw.url("/v1/pets"))
            .bearer_auth(&key)
            .json(&json!({"name": "Rex", "categoryId": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(created.status(), 201);
        let resp = client
            .get(gw.url("/v1/pets/1"))
            .bearer_auth(&key)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 410);
        let h = resp.headers().clone();
        assert_eq!(h["sunset"], "Thu, 04 Mar 2021 04:06:07 GMT");
        assert_eq!(h["deprecation"], "@1767225600");
        assert_eq!(h["link"], "</v1/pets>; rel=\"successor-version\"");
        assert!(h.contains_key("x-ratelimit-remaining"), "{h:?}");
        let body: Value = resp.json().await.unwrap();
        assert_eq!(
            (body["code"].as_str(), body["status"].as_u64()),
            (Some("gone"), Some(410))
        );
        assert!(
            body["message"].as_str().unwrap().contains("GET /v1/pets"),
            "{body}"
        );
        let list = client
            .get(gw.url("/v1/pets"))
            .bearer_auth(&key)
            .send()
            .await
            .unwrap();
        assert_eq!(list.status(), 200);
    });

    let out = std::process::Command::new(e2e::bin_path("pet-backend"))
        .args(["--listen", "127.0.0.1:0", "--db"])
        .arg(s.dir.path().join("other.db"))
        .args(["--get-pet-sunset", "next tuesday"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("next tuesday") && stderr.contains("RFC 3339"),
        "{stderr}"
    );
    // Past what an HTTP date can say: refused at start-up, not a panic on the first request.
    let out = std::process::Command::new(e2e::bin_path("pet-backend"))
        .args(["--listen", "127.0.0.1:0", "--db"])
        .arg(s.dir.path().join("other.db"))
        .args(["--get-pet-sunset", "9999-12-31T23:59:59-23:59"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("past the year 9999"));
}
