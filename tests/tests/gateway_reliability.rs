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

fn revoke(f: &Fixture, gw: &e2e::GatewayProcess, id: &str) -> std::process::Output {
    e2e::gateway_cli(&[
        "keys",
        "revoke",
        "--keys-file",
        &f.keys.to_string_lossy(),
        "--admin-listen",
        &gw.admin.to_string(),
        id,
    ])
}

/// An editor's backup, a wrongly cased copy and a broken plan file in the plans directory:
/// none holds back a revocation, which the command confirms with the running gateway.
#[tokio::test]
async fn a_stray_or_broken_plan_file_never_holds_back_a_revocation() {
    let f = Fixture::new(600, 100_000);
    let key = f.issue("free");
    let id = e2e::first_key_id(&f.keys);
    let upstream = e2e::EchoUpstream::start();
    let gw = f.gateway(&f.spec(upstream.addr));
    assert_eq!(gw.status(&key).await, 200);

    std::fs::write(f.plans.join("free.bak.toml"), "requests_per_minute = = 1").unwrap();
    std::fs::write(f.plans.join("Free.toml"), "requests_per_minute = 0").unwrap();
    // Applied by this call or by the reloader's tick just before it.
    let reload: serde_json::Value = reqwest::Client::new()
        .post(gw.admin_url("/reload"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(reload["plans"].get("refused").is_none(), "{reload}");
    let started = std::time::Instant::now();
    loop {
        let log = gw.log_text();
        if log.contains("free.bak.toml") && log.contains("Free.toml") && log.contains("ignored") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "no warning: {log}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    std::fs::write(f.plans.join("pro.toml"), "requests_per_minute = \"lots\"").unwrap();
    let out = revoke(&f, &gw, &id);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(stdout.contains("in force"), "{stdout}");
    // Confirmed means in force now, not within a reload interval.
    assert_eq!(gw.status(&key).await, 401);
    assert_eq!(
        gw.metric("pet_gateway_catalog_reload_failing{part=\"plans\"}")
            .await,
        1.0,
        "the broken pro.toml is refused, visibly"
    );
    assert_eq!(
        gw.metric("pet_gateway_catalog_reload_failing{part=\"keys\"}")
            .await,
        0.0
    );
}

/// `keys revoke` exits non-zero, saying why, whenever it cannot confirm the revocation in
/// force: the gateway it asks serves another keys file; or the gateway refuses its keys file
/// (unparseable), keeps its previous keys and shows that in its metrics. A key naming a plan
/// the gateway lacks no longer blocks the rest of the file.
#[tokio::test]
async fn a_revocation_the_gateway_does_not_apply_fails_the_command() {
    let f = Fixture::new(600, 100_000);
    let key = f.issue("free");
    let id = e2e::first_key_id(&f.keys);
    let upstream = e2e::EchoUpstream::start();
    // Reloads only when asked (revoke and POST /reload ask): a background reload must not
    // catch the keys file half-written below.
    let mut spec = f.spec(upstream.addr);
    spec.extra = "reload_interval_ms = 60000\n".into();
    let gw = f.gateway(&spec);

    // A key on a plan only another plans directory has: skipped, the revocation applies.
    let other_plans = f.dir.path().join("other-plans");
    e2e::write_plan(&other_plans, "gold", 10, 10);
    e2e::issue_key(&f.keys, &other_plans, "gold");
    let out = revoke(&f, &gw, &id);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(gw.status(&key).await, 401);
    assert_eq!(gw.metric("pet_gateway_catalog_keys_skipped").await, 1.0);

    // Another keys file than the gateway's: the command says so.
    let elsewhere = f.dir.path().join("elsewhere-keys.toml");
    e2e::issue_key(&elsewhere, &f.plans, "free");
    let other_id = e2e::first_key_id(&elsewhere);
    let out = e2e::gateway_cli(&[
        "keys",
        "revoke",
        "--keys-file",
        &elsewhere.to_string_lossy(),
        "--admin-listen",
        &gw.admin.to_string(),
        &other_id,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("NOT confirmed") && stderr.contains("serves the keys file"),
        "{stderr}"
    );

    // A keys file the gateway cannot parse: the old keys stay, visibly.
    let live = f.issue("free");
    let reload = || async {
        reqwest::Client::new()
            .post(gw.admin_url("/reload"))
            .send()
            .await
            .unwrap()
            .json::<serde_json::Value>()
            .await
            .unwrap()
    };
    reload().await;
    assert_eq!(gw.status(&live).await, 200);
    let mut text = std::fs::read_to_string(&f.keys).unwrap();
    text.push_str("\n[[key]]\nid = \"broken\"\n");
    std::fs::write(&f.keys, text).unwrap();
    let answer = reload().await;
    assert!(answer["keys_refused"].is_string(), "{answer}");
    // Asked again (nothing changed since), it still says why.
    let again = reload().await;
    assert_eq!(again["keys"], "unchanged", "{again}");
    assert!(again["keys_refused"].is_string(), "{again}");
    assert_eq!(gw.status(&live).await, 200, "the old keys stay in force");
    assert_eq!(
        gw.metric("pet_gateway_catalog_reload_failing{part=\"keys\"}")
            .await,
        1.0
    );
}

/// An edit that keeps the file's size and modification time (an in-place rewrite, then
/// `touch -r`; or only a `chown`/`chmod` that makes an unreadable file readable) is still
/// noticed: the gateway watches the inode and its change time too.
#[cfg(unix)]
#[tokio::test]
async fn an_edit_keeping_size_and_mtime_is_reloaded() {
    use std::io::Write as _;
    let f = Fixture::new(600, 100_000);
    let key = f.issue("free");
    let other = f.issue("free");
    let upstream = e2e::EchoUpstream::start();
    let gw = f.gateway(&f.spec(upstream.addr));
    assert_eq!(gw.status(&key).await, 200);

    let text = std::fs::read_to_string(&f.keys).unwrap();
    let mtime = std::fs::metadata(&f.keys).unwrap().modified().unwrap();
    let hash = |k: &str| {
        use sha2::Digest as _;
        hex::encode(sha2::Sha256::digest(k.as_bytes()))
    };
    let edited = text.replace(&hash(&key), &hash("pet_someone-else"));
    assert_eq!(edited.len(), text.len());
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&f.keys)
        .unwrap();
    (&file).write_all(edited.as_bytes()).unwrap();
    file.set_modified(mtime).unwrap();
    drop(file);
    let started = std::time::Instant::now();
    while gw.status(&key).await != 401 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "an in-place edit with the same size and mtime was never reloaded"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(gw.status(&other).await, 200);
}

/// The per-client limit on requests without a valid key: behind a trusted load balancer each
/// client (from `X-Forwarded-For`) has its own bucket, an IPv6 client cannot escape it by
/// rotating through its /64, and from an untrusted peer the header changes nothing. The
/// balancer's node takes both settings from its environment, as a container does, over a file
/// with a laxer limit that does not trust the balancer.
#[tokio::test]
async fn unauthenticated_clients_are_told_apart_behind_a_trusted_proxy_and_ipv6_by_64() {
    let f = Fixture::new(600, 100_000);
    f.issue("free");
    let upstream = e2e::EchoUpstream::start();
    let mut spec = f.spec(upstream.addr);
    spec.extra = "unauthenticated_per_minute = 5\ntrusted_proxies = [\"10.0.0.0/8\"]\n".into();
    spec.env = [
        ("PET_GATEWAY_UNAUTHENTICATED_PER_MINUTE", "2"),
        ("PET_GATEWAY_TRUSTED_PROXIES", "10.0.0.0/8, 127.0.0.1"),
    ]
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .into();
    let behind_lb = f.gateway(&spec);
    spec.extra = "unauthenticated_per_minute = 2\n".into();
    spec.env.clear();
    let direct = f.gateway(&spec);
    let client = reqwest::Client::new();
    let status = |gw: &e2e::GatewayProcess, xff: &str| {
        client
            .get(gw.url("/v1/pets"))
            .header("authorization", "Bearer pet_wrong")
            .header("x-forwarded-for", xff)
            .send()
    };
    let code = |r: reqwest::Response| r.status().as_u16();

    for _ in 0..2 {
        assert_eq!(code(status(&behind_lb, "198.51.100.1").await.unwrap()), 401);
    }
    assert_eq!(code(status(&behind_lb, "198.51.100.1").await.unwrap()), 429);
    assert_eq!(
        code(status(&behind_lb, "198.51.100.2").await.unwrap()),
        401,
        "another client behind the same balancer has its own bucket"
    );
    // A forged hop left of the real client changes nothing: the balancer appended the real one.
    assert_eq!(
        code(
            status(&behind_lb, "192.0.2.99, 198.51.100.1")
                .await
                .unwrap()
        ),
        429
    );
    for (addr, expected) in [
        ("2001:db8:7:7::1", 401),
        ("2001:db8:7:7::2", 401),
        ("2001:db8:7:7:ffff::3", 429),
    ] {
        assert_eq!(
            code(status(&behind_lb, addr).await.unwrap()),
            expected,
            "{addr}"
        );
    }

    for xff in ["198.51.100.7", "198.51.100.8"] {
        assert_eq!(code(status(&direct, xff).await.unwrap()), 401);
    }
    assert_eq!(
        code(status(&direct, "198.51.100.9").await.unwrap()),
        429,
        "an untrusted peer's X-Forwarded-For is ignored"
    );
}

/// An HTTP/2 client that stalls mid-body gets 408 after `client_read_timeout_ms`, like an
/// HTTP/1.1 one, instead of holding a backend connection until the upstream timeout (504).
#[tokio::test]
async fn a_stalled_http2_request_body_gets_408_not_504() {
    let f = Fixture::new(600, 100_000);
    let key = f.issue("free");
    let backend = f.backend();
    let cert = TestCert::generate("h2 body ca");
    let mut spec = f.tls_spec(backend.addr, &cert);
    spec.extra
        .push_str("client_read_timeout_ms = 500\nupstream_read_timeout_ms = 4000\n");
    let gw = f.gateway(&spec);
    let client = cert.client(&[b"h2"]);

    // One chunk, then nothing for longer than any timeout here.
    let chunks = futures_util::stream::unfold(0u8, |step| async move {
        match step {
            0 => Some((Ok::<_, std::io::Error>(b"{\"name\":".to_vec()), 1)),
            _ => {
                tokio::time::sleep(Duration::from_secs(30)).await;
                None
            }
        }
    });
    let started = std::time::Instant::now();
    let resp = tokio::time::timeout(
        Duration::from_secs(10),
        client
            .post(format!("https://localhost:{}/v1/pets", gw.addr.port()))
            .bearer_auth(&key)
            .header("content-type", "application/json")
            .body(reqwest::Body::wrap_stream(chunks))
            .send(),
    )
    .await
    .expect("an answer, not a hang")
    .expect("a response");
    assert_eq!(resp.version(), reqwest::Version::HTTP_2);
    assert_eq!(resp.status(), 408, "after {:?}", started.elapsed());
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["status"], 408);

    // A body that arrives is forwarded whole.
    let resp = client
        .post(format!("https://localhost:{}/v1/pets", gw.addr.port()))
        .bearer_auth(&key)
        .header("content-type", "application/json")
        .body("{\"name\":\"Rex\",\"categoryId\":1}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    assert!(resp.text().await.unwrap().contains("Rex"));
}

/// Reads one HTTP/1.1 response with a Content-Length from `s`; returns its status.
fn read_response(s: &mut TcpStream) -> u16 {
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).expect("a response");
        assert!(n > 0, "closed before a response");
        raw.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&raw).to_string();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap())
                })
                .unwrap_or(0);
            if body.len() >= length {
                return head
                    .get(9..12)
                    .and_then(|c| c.parse().ok())
                    .unwrap_or_else(|| panic!("not a status line: {text:?}"));
            }
        }
    }
}

/// A client trickling its request head a byte at a time is closed once the whole head has
/// taken `request_header_timeout_ms`, while other clients are served; a keep-alive connection
/// idle between requests is not (the deadline starts with a head's first byte).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_trickling_its_request_head_is_closed_while_others_are_served() {
    let f = Fixture::new(600, 100_000);
    let key = f.issue("free");
    let upstream = e2e::EchoUpstream::start();
    let mut spec = f.spec(upstream.addr);
    spec.extra = "request_header_timeout_ms = 1000\n".into();
    let gw = f.gateway(&spec);
    let addr = gw.addr;

    let trickler = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let started = std::time::Instant::now();
        let head = b"GET /v1/pets HTTP/1.1\r\nHost: x\r\nX-Slow: abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnop\r\n\r\n";
        let mut buf = [0u8; 256];
        for byte in head {
            if s.write_all(std::slice::from_ref(byte)).is_err() {
                return Some(started.elapsed());
            }
            match s.read(&mut buf) {
                Ok(0) => return Some(started.elapsed()),
                Ok(_) => panic!("the gateway answered a head that never completed in time"),
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut => {}
                Err(_) => return Some(started.elapsed()),
            }
        }
        None
    });

    // Meanwhile, on a keep-alive connection: a request, 1.5 s idle, another request.
    let keepalive = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let request =
            format!("GET /v1/pets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n");
        s.write_all(request.as_bytes()).unwrap();
        let first = read_response(&mut s);
        std::thread::sleep(Duration::from_millis(1_500));
        s.write_all(request.as_bytes()).unwrap();
        (first, read_response(&mut s))
    });

    let closed_after = tokio::task::spawn_blocking(move || trickler.join().unwrap())
        .await
        .unwrap()
        .expect("the trickling client was never cut off");
    assert!(
        closed_after >= Duration::from_millis(900) && closed_after < Duration::from_millis(2_500),
        "closed after {closed_after:?}"
    );
    let (first, second) = tokio::task::spawn_blocking(move || keepalive.join().unwrap())
        .await
        .unwrap();
    assert_eq!(
        (first, second),
        (200, 200),
        "the idle keep-alive connection was served"
    );
    assert_eq!(gw.metric("pet_gateway_slow_request_heads_total").await, 1.0);
}

/// An upstream that answers `Expect: 100-continue` with `100 Continue`, reads the body, then
/// takes `delay` before its 200.
fn continue_upstream(delay: Duration) -> std::net::SocketAddr {
    use std::io::{BufRead, BufReader};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut writer = stream;
                let (mut length, mut expect) = (0usize, false);
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    let lower = line.to_ascii_lowercase();
                    if let Some(v) = lower.strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap_or(0);
                    }
                    expect |= lower.starts_with("expect: 100-continue");
                    if line == "\r\n" {
                        break;
                    }
                }
                if expect {
                    writer.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").unwrap();
                }
                let mut body = vec![0u8; length];
                reader.read_exact(&mut body).unwrap();
                std::thread::sleep(delay);
                let _ = writer.write_all(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok",
                );
            });
        }
    });
    addr
}

/// `Expect: 100-continue`: the interim `100 Continue` does not re-arm the head deadline, so a
/// body followed by a slow answer is not mistaken for a trickling head (the connection used to
/// be closed with no response).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_continue_request_with_a_slow_answer_is_not_cut_off() {
    let f = Fixture::new(600, 100_000);
    let key = f.issue("free");
    let upstream = continue_upstream(Duration::from_millis(1_500));
    let mut spec = f.spec(upstream);
    spec.extra = "request_header_timeout_ms = 1000\n".into();
    let gw = f.gateway(&spec);
    let addr = gw.addr;
    let status = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let body = "{\"name\":\"Rex\"}";
        write!(
            s,
            "POST /v1/pets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\nExpect: 100-continue\r\n\r\n",
            body.len()
        )
        .unwrap();
        // The interim response, whole (it carries the rate-limit headers too).
        let mut interim = Vec::new();
        let mut byte = [0u8; 1];
        while !interim.ends_with(b"\r\n\r\n") {
            assert_eq!(s.read(&mut byte).unwrap(), 1, "closed before 100 Continue");
            interim.push(byte[0]);
        }
        let interim = String::from_utf8_lossy(&interim).to_string();
        assert!(interim.starts_with("HTTP/1.1 100"), "{interim}");
        s.write_all(body.as_bytes()).unwrap();
        read_response(&mut s)
    })
    .await
    .unwrap();
    assert_eq!(status, 200);
    assert_eq!(gw.metric("pet_gateway_slow_request_heads_total").await, 0.0);
}
