//! Reliability defects that used to lose correctness silently, each reproduced with real
//! processes: the gateway, and a real or fake backend.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use e2e::{Fixture, TestCert, TruncatingUpstream};

/// A backend that dies after sending the head and part of a 200's body: over HTTP/1.1 the
/// client gets the head, the partial body and a closed connection (never a JSON error spliced
/// into the body, never a complete-looking response).
#[tokio::test]
async fn a_backend_failing_mid_body_aborts_an_http1_response_instead_of_splicing_an_error() {
    let f = Fixture::new(600, 100_000);
    let key = f.issue("free");
    let upstream = TruncatingUpstream::start();
    let gw = f.gateway(&f.spec(upstream.addr));

    let mut s = TcpStream::connect(gw.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET /v1/pets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    // Ends with the connection closed (Ok) or reset (Err); a timeout would mean a hang.
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                panic!("the gateway neither finished nor closed the response")
            }
            Err(_) => break,
        }
    }
    let answer = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = answer.split_once("\r\n\r\n").expect("a response head");
    assert!(head.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        head.to_ascii_lowercase().contains("content-length: 29"),
        "{answer}"
    );
    assert!(body.len() < 29, "the body is incomplete: {answer}");
    assert!(
        !body.contains("bad_gateway"),
        "no error spliced in: {answer}"
    );
    assert_eq!(body, TruncatingUpstream::PARTIAL_BODY);
    assert_eq!(gw.metric("pet_gateway_responses_aborted_total").await, 1.0);
}

/// The same over TLS and HTTP/2: the stream is reset, so the client's body read fails.
#[tokio::test]
async fn a_backend_failing_mid_body_resets_the_http2_stream() {
    let f = Fixture::new(600, 100_000);
    let key = f.issue("free");
    let upstream = TruncatingUpstream::start();
    let cert = TestCert::generate("reliability ca");
    let gw = f.gateway(&f.tls_spec(upstream.addr, &cert));
    let client = cert.client(&[b"h2"]);

    let resp = client
        .get(format!("https://localhost:{}/v1/pets", gw.addr.port()))
        .bearer_auth(&key)
        .send()
        .await
        .expect("the head arrives");
    assert_eq!(resp.version(), reqwest::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    let body = tokio::time::timeout(Duration::from_secs(5), resp.bytes())
        .await
        .expect("no hang");
    match body {
        Err(_) => {}
        Ok(b) => panic!(
            "an incomplete body was delivered as complete: {:?}",
            String::from_utf8_lossy(&b)
        ),
    }
    assert_eq!(gw.metric("pet_gateway_responses_aborted_total").await, 1.0);
}

/// `POST /bans/lift` (no key id) used to panic the admin handler; it is a 404 like any other
/// unknown admin path, and the admin listener keeps answering.
#[tokio::test]
async fn a_lift_without_a_key_id_is_404_not_a_panic() {
    let f = Fixture::new(60, 1000);
    let upstream = e2e::EchoUpstream::start();
    let gw = f.gateway(&f.spec(upstream.addr));
    let client = reqwest::Client::new();
    for path in [
        "/bans/lift",
        "/bans//lift",
        "/bans/a%20b/lift",
        "/bans/x}/lift",
    ] {
        let resp = client.post(gw.admin_url(path)).send().await.unwrap();
        assert_eq!(resp.status(), 404, "{path}");
    }
    let health = client.get(gw.admin_url("/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    assert!(!gw.log_text().contains("panicked"), "{}", gw.log_text());
}

/// A banned key is told 0 remaining by every header: `X-RateLimit-Remaining` and both windows
/// of `RateLimit`, whether the ban is decided by the store or found in the node's ban cache.
#[tokio::test]
async fn every_rate_limit_header_of_a_banned_key_says_zero_remaining() {
    let f = Fixture::new(1, 1000);
    let key = f.issue("free");
    let upstream = e2e::EchoUpstream::start();
    let mut spec = f.spec(upstream.addr);
    // The first refusal bans.
    spec.extra = "[ban]\nstrikes = 0\ndurations_secs = [600]\n".into();
    let gw = f.gateway(&spec);
    e2e::fresh_minute(Duration::from_secs(5));
    let client = reqwest::Client::new();
    let send = || client.get(gw.url("/v1/pets")).bearer_auth(&key).send();
    assert_eq!(send().await.unwrap().status(), 200);
    // The store bans (this request), then the ban cache answers (the next ones).
    for _ in 0..3 {
        let resp = send().await.unwrap();
        assert_eq!(resp.status(), 429);
        let h = |n| e2e::header(&resp, n).unwrap_or_default();
        assert_eq!(h("x-ratelimit-remaining"), "0");
        let ratelimit = h("ratelimit");
        assert!(
            ratelimit.contains("\"minute\";r=0;") && ratelimit.contains("\"day\";r=0;"),
            "{ratelimit}"
        );
        let body: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(body["code"], "api_key_banned");
    }
}
