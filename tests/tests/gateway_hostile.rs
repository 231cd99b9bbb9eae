//! Hostile input through the real gateway: oversized and malformed headers, smuggling
//! attempts, paths not in canonical form, old and pipelined HTTP, slow and vanishing clients.
//! Each gets a clear 4xx or a closed connection, the gateway keeps serving everyone else, and no
//! key material reaches a log line or a metric.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use e2e::{Backend, EchoUpstream, Fixture, GatewayProcess};

struct Stack {
    gw: GatewayProcess,
    key: String,
    _backend: Backend,
    _fixture: Fixture,
}

fn stack() -> Stack {
    let f = Fixture::with_plan("big", 1_000_000, 10_000_000);
    let key = f.issue("big");
    let backend = f.backend();
    let mut spec = f.spec(backend.addr);
    spec.extra = "client_read_timeout_ms = 1000\n".into();
    let gw = f.gateway(&spec);
    Stack {
        gw,
        key,
        _backend: backend,
        _fixture: f,
    }
}

/// Sends `raw` and returns everything the gateway answers until it closes the connection or
/// stays quiet for `quiet`. A write the gateway refuses mid-way (it closed) is not an error.
fn exchange(addr: SocketAddr, raw: &[u8], quiet: Duration) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(quiet)).unwrap();
    let _ = s.write_all(raw);
    let mut out = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn status_of(answer: &str) -> u16 {
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// A 4xx, or nothing at all (the connection was closed).
fn assert_refused(what: &str, answer: &str) {
    let status = status_of(answer);
    assert!(
        answer.is_empty() || (400..500).contains(&status),
        "{what}: expected a 4xx or a closed connection, got: {}",
        &answer[..answer.len().min(300)]
    );
}

fn get(key: &str) -> String {
    format!("GET /v1/pets HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {key}\r\n")
}

/// A normal request still works.
fn still_serving(stack: &Stack) {
    let answer = exchange(
        stack.gw.addr,
        format!("{}Connection: close\r\n\r\n", get(&stack.key)).as_bytes(),
        Duration::from_secs(5),
    );
    assert_eq!(status_of(&answer), 200, "{answer}");
}

#[test]
fn oversized_and_malformed_headers_are_refused() {
    let s = stack();
    let quiet = Duration::from_secs(3);
    let big = format!("{}X-Big: {}\r\n\r\n", get(&s.key), "a".repeat(70 * 1024));
    let answer = exchange(s.gw.addr, big.as_bytes(), quiet);
    assert_eq!(
        status_of(&answer),
        431,
        "headers over 64 KiB: {}",
        &answer[..answer.len().min(200)]
    );

    let many: String = (0..10_000).map(|i| format!("X-H{i}: v\r\n")).collect();
    assert_refused(
        "10,000 headers",
        &exchange(
            s.gw.addr,
            format!("{}{many}\r\n", get(&s.key)).as_bytes(),
            quiet,
        ),
    );

    let huge_token = format!(
        "GET /v1/pets HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {}\r\n\r\n",
        "a".repeat(1 << 20)
    );
    assert_refused(
        "a 1 MiB bearer token",
        &exchange(s.gw.addr, huge_token.as_bytes(), quiet),
    );

    for auth in [
        &b"Bearer ab\x01cd"[..],
        b"Bearer \xc3\xa9t\xff",
        b"Bearer \x7f",
        b"B\xe9arer abc",
    ] {
        let mut raw = b"GET /v1/pets HTTP/1.1\r\nHost: t\r\nAuthorization: ".to_vec();
        raw.extend_from_slice(auth);
        raw.extend_from_slice(b"\r\n\r\n");
        let answer = exchange(s.gw.addr, &raw, quiet);
        assert_refused(&format!("Authorization {auth:?}"), &answer);
        assert_ne!(status_of(&answer), 200);
    }
    still_serving(&s);
}

#[test]
fn smuggling_attempts_are_refused() {
    let s = stack();
    let quiet = Duration::from_secs(3);
    let cl_te = format!(
        "POST /v1/pets HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\n\
         Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /v1/pets HTTP/1.1\r\nHost: t\r\n\r\n",
        s.key
    );
    let answer = exchange(s.gw.addr, cl_te.as_bytes(), quiet);
    assert_eq!(status_of(&answer), 400, "CL + TE: {answer}");
    assert_eq!(
        answer.matches("HTTP/1.1").count(),
        1,
        "the smuggled request is not answered: {answer}"
    );

    let two_cl = format!(
        "{}Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
        get(&s.key)
    );
    assert_refused(
        "two Content-Lengths",
        &exchange(s.gw.addr, two_cl.as_bytes(), quiet),
    );
    let bad_te = format!(
        "{}Transfer-Encoding: gzip, chunked, identity\r\n\r\n0\r\n\r\n",
        get(&s.key)
    );
    let answer = exchange(s.gw.addr, bad_te.as_bytes(), quiet);
    assert_ne!(status_of(&answer), 200, "{answer}");
    still_serving(&s);
}

#[test]
fn http_1_0_and_pipelined_requests_are_answered_in_order() {
    let s = stack();
    let answer = exchange(
        s.gw.addr,
        format!(
            "GET /v1/pets HTTP/1.0\r\nAuthorization: Bearer {}\r\n\r\n",
            s.key
        )
        .as_bytes(),
        Duration::from_secs(3),
    );
    assert_eq!(status_of(&answer), 200, "{answer}");

    // Pipelining: the first request is answered, then the connection is closed (pingora does
    // not pipeline); a client resends the rest, nothing is answered out of order or twice.
    let three = format!(
        "{}X-Request-Id: one\r\n\r\n{}X-Request-Id: two\r\n\r\n{}X-Request-Id: three\r\n\r\n",
        get(&s.key),
        get(&s.key),
        get(&s.key)
    );
    let mut c = TcpStream::connect(s.gw.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    c.write_all(three.as_bytes()).unwrap();
    let mut answer = Vec::new();
    let closed = c.read_to_end(&mut answer).is_ok();
    let answer = String::from_utf8_lossy(&answer);
    assert!(closed, "the connection is closed rather than left hanging");
    let ids: Vec<&str> = answer
        .lines()
        .filter_map(|l| l.strip_prefix("x-request-id: "))
        .map(str::trim)
        .collect();
    assert!(
        !ids.is_empty()
            && ids
                .iter()
                .zip(["one", "two", "three"])
                .all(|(a, b)| *a == b),
        "{answer}"
    );
    assert_eq!(answer.matches("HTTP/1.1 200").count(), ids.len());
    still_serving(&s);
}

#[test]
fn slow_and_vanishing_clients_do_not_hold_up_anyone_else() {
    let s = stack();
    // Slowloris: many connections trickling their headers.
    let mut slow: Vec<TcpStream> = (0..200)
        .map(|_| {
            let mut c = TcpStream::connect(s.gw.addr).unwrap();
            c.write_all(b"GET /v1/pets HTTP/1.1\r\nHost: t\r\n")
                .unwrap();
            c
        })
        .collect();
    for round in 0..3 {
        for c in &mut slow {
            let _ = c.write_all(format!("X-Slow-{round}: 1\r\n").as_bytes());
        }
        let started = Instant::now();
        still_serving(&s);
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "others are served promptly"
        );
        std::thread::sleep(Duration::from_millis(300));
    }

    // A body that never ends: cut off after the client read timeout (1 s here).
    let mut stall = TcpStream::connect(s.gw.addr).unwrap();
    stall
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stall,
        "POST /v1/pets HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"name\":",
        s.key
    )
    .unwrap();
    let started = Instant::now();
    let mut answer = Vec::new();
    let _ = stall.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "stalled body cut off in {:?}",
        started.elapsed()
    );
    assert_refused("a body that never ends", &answer);

    // Clients that vanish mid-request.
    for _ in 0..20 {
        let mut c = TcpStream::connect(s.gw.addr).unwrap();
        let _ = c.write_all(format!("POST /v1/pets HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {}\r\nContent-Length: 100\r\n\r\n{{", s.key).as_bytes());
        drop(c);
        let mut c = TcpStream::connect(s.gw.addr).unwrap();
        let _ = c.write_all(b"GET /v1/pe");
        drop(c);
    }
    still_serving(&s);
    drop(slow);
}

#[test]
fn no_key_material_in_logs_or_metrics() {
    let s = stack();
    let quiet = Duration::from_secs(2);
    let secret = &s.key[4..];
    // The valid key, a wrong key that looks like one, and a huge one, every way.
    let wrong = format!("pet_{}", "f".repeat(64));
    for key in [s.key.as_str(), wrong.as_str()] {
        exchange(
            s.gw.addr,
            format!("{}Connection: close\r\n\r\n", get(key)).as_bytes(),
            quiet,
        );
        exchange(s.gw.addr, format!("GET /v1/pets/{key} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n\r\n").as_bytes(), quiet);
        exchange(s.gw.addr, format!("GET /v1/pets?k={key} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n\r\n").as_bytes(), quiet);
    }
    let metrics = exchange(
        s.gw.admin,
        b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        quiet,
    );
    assert!(metrics.contains("pet_gateway_requests_total"));
    std::thread::sleep(Duration::from_millis(300));
    let log = s.gw.log_text();
    assert!(log.contains("access"));
    for material in [secret, &wrong[4..], &s.key[..20]] {
        assert!(!log.contains(material), "key material in the log");
        assert!(!metrics.contains(material), "key material in the metrics");
    }
}

/// Every spelling of a path that a normalising backend could read as another operation: the
/// four tried in the review, their encoded variants, and the other separators. Sent as raw
/// bytes: an HTTP client library would normalise some of them itself.
const NON_CANONICAL: &[&[u8]] = &[
    b"/v1//pets",
    b"/v1/./pets",
    b"/v1/x/../pets",
    b"/v1/%2e%2e/v1/pets",
    b"/v1/%2E%2E/v1/pets",
    b"/v1/.%2e/v1/pets",
    b"/v1/%2e/pets",
    b"/v1/pets/",
    b"/v1/pets/..",
    b"/v1/%70ets",
    b"/v1%2fpets",
    b"/v1/pets%2F42",
    b"/v1/pets%5c42",
    b"/v1\\pets",
    b"/v1/pets;x=1",
    b"/v1/x/..;/pets",
    b"/v1/pets%00",
    b"/v1/pets/%zz",
    b"/v1/pets/\xc3\xa9",
    b"/v1/%252e%252e/v1/pets",
    b"/v1/pets%3Bx=1",
    b"/v1/%C0%AE%C0%AE/v1/pets",
    // Targets in neither origin- nor absolute-form: parsed as `/`, sent on as they came.
    b"v1/pets",
    b"x:/v1//pets",
    b"?a",
];

/// One request to `target` with `auth` (or none), answered on a connection of its own.
fn request_to(addr: SocketAddr, method: &str, target: &[u8], auth: Option<&str>) -> String {
    let mut raw = format!("{method} ").into_bytes();
    raw.extend_from_slice(target);
    raw.extend_from_slice(b" HTTP/1.1\r\nHost: t\r\nConnection: close\r\n");
    if let Some(key) = auth {
        raw.extend_from_slice(format!("Authorization: Bearer {key}\r\n").as_bytes());
    }
    if method == "POST" {
        raw.extend_from_slice(b"Content-Type: application/json\r\nContent-Length: 14\r\n\r\n");
        raw.extend_from_slice(br#"{"name":"rex"}"#);
    } else {
        raw.extend_from_slice(b"\r\n");
    }
    exchange(addr, &raw, Duration::from_secs(3))
}

/// The JSON body of a whole answer.
fn body_of(answer: &str) -> serde_json::Value {
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or(serde_json::Value::Null)
}

/// A path a backend might normalise into another operation is refused with 400
/// `invalid_request` before its key is looked at: it costs no quota, needs no key, and never
/// reaches the backend. Canonical paths, with `..` and `//` in their query, go on as sent.
#[test]
fn non_canonical_paths_are_refused_before_the_key_and_never_forwarded() {
    let f = Fixture::new(60, 1_000);
    let key = f.issue("free");
    let (echo, reached) = EchoUpstream::start_recording();
    let gw = f.gateway(&f.spec(echo.addr));
    for target in NON_CANONICAL {
        let shown = String::from_utf8_lossy(target);
        for (method, auth) in [
            ("GET", Some(key.as_str())),
            ("GET", None),
            ("POST", Some(&key)),
        ] {
            let answer = request_to(gw.addr, method, target, auth);
            assert_eq!(status_of(&answer), 400, "{method} {shown}: {answer}");
            let body = body_of(&answer);
            assert_eq!(
                body["code"], "invalid_request",
                "{method} {shown}: {answer}"
            );
            assert!(
                body["message"].as_str().is_some_and(|m| m.contains("path")),
                "{method} {shown}: {answer}"
            );
        }
    }
    let canonical: [&[u8]; 5] = [
        b"/v1/pets",
        b"/v1/pets/42",
        b"/v1/pets?next=../../admin",
        b"/v1/pets?a=//b&c=%2e%2e%2f",
        b"/v1/store/orders",
    ];
    for target in canonical {
        let answer = request_to(gw.addr, "GET", target, Some(&key));
        assert_eq!(status_of(&answer), 200, "{answer}");
    }
    let sent: Vec<String> = canonical
        .iter()
        .map(|t| format!("GET {} HTTP/1.1", String::from_utf8_lossy(t)))
        .collect();
    assert_eq!(reached.taken(), sent, "only the canonical paths, as sent");
    let quota = body_of(&request_to(gw.addr, "GET", b"/v1/rate_limit", Some(&key)));
    assert_eq!(
        quota["day"]["remaining"],
        1_000 - canonical.len(),
        "the refused cost nothing: {quota}"
    );
}
