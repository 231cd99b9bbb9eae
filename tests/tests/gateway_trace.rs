//! W3C trace context through the real gateway and the real backend: the gateway joins a valid
//! `traceparent` or starts a trace, sends the backend one naming the gateway's own span as the
//! parent, and both access logs carry the trace id. `X-Request-Id` is untouched by any of it.

use std::time::{Duration, Instant};

use e2e::{Backend, Fixture, GatewayProcess};

/// The value of `name` in a log line (`name=value` or `name="value"`), when it is hex.
fn field(line: &str, name: &str) -> Option<String> {
    let at = line.find(&format!(" {name}="))? + name.len() + 2;
    let rest = line[at..].trim_start_matches('"');
    let value: String = rest.chars().take_while(char::is_ascii_hexdigit).collect();
    (!value.is_empty()).then_some(value)
}

/// The access-log line of the request with `request_id`, waiting for it to be written.
fn line_of(read: impl Fn() -> String, request_id: &str) -> String {
    let started = Instant::now();
    loop {
        if let Some(line) = read()
            .lines()
            .find(|l| l.contains(request_id) && l.contains("status"))
        {
            return line.to_owned();
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "no access line for {request_id}:\n{}",
            read()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test]
async fn the_trace_runs_from_the_client_through_the_gateway_to_the_backend() {
    let s = Fixture::new(60, 1_000);
    let key = s.issue("free");
    let backend = Backend::start_logged(
        &s.dir.path().join("pets.db"),
        &s.dir.path().join("backend.log"),
    );
    let gw = GatewayProcess::start(s.dir.path(), &s.spec(backend.addr));
    let client = reqwest::Client::new();
    let send = |request_id: &'static str, traceparent: Option<&'static str>| {
        let mut req = client
            .get(gw.url("/v1/pets"))
            .bearer_auth(&key)
            .header("x-request-id", request_id);
        if let Some(tp) = traceparent {
            req = req.header("traceparent", tp);
        }
        async move {
            let resp = req.send().await.unwrap();
            assert_eq!(resp.status(), 200);
            assert_eq!(
                resp.headers()["x-request-id"],
                request_id,
                "X-Request-Id stays"
            );
        }
    };

    // A client in a trace: the gateway joins it, as a span whose parent is the client's.
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    send(
        "req-joined",
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    )
    .await;
    let g = line_of(|| gw.log_text(), "req-joined");
    let b = line_of(|| backend.log_text(), "req-joined");
    assert_eq!(field(&g, "trace_id").as_deref(), Some(trace), "{g}");
    assert_eq!(
        field(&g, "parent_span_id").as_deref(),
        Some(client_span),
        "{g}"
    );
    let gateway_span = field(&g, "span_id").expect("the gateway's span");
    assert_eq!(gateway_span.len(), 16);
    assert_ne!(gateway_span, client_span);
    assert_eq!(field(&b, "trace_id").as_deref(), Some(trace), "{b}");
    assert_eq!(
        field(&b, "parent_span_id"),
        Some(gateway_span),
        "the backend's parent is the gateway's span: {b}"
    );

    // No trace context, or an invalid one (uppercase hex): the gateway starts a trace, and the
    // backend is in it.
    for (request_id, tp) in [
        ("req-started", None),
        (
            "req-invalid",
            Some("00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01"),
        ),
    ] {
        send(request_id, tp).await;
        let g = line_of(|| gw.log_text(), request_id);
        let b = line_of(|| backend.log_text(), request_id);
        let started = field(&g, "trace_id").expect("a trace started");
        assert_eq!(started.len(), 32);
        assert_ne!(
            started.to_ascii_lowercase(),
            trace,
            "{request_id}: a new trace"
        );
        assert_eq!(field(&g, "parent_span_id"), None, "{request_id}: {g}");
        assert_eq!(field(&b, "trace_id"), Some(started), "{request_id}: {b}");
        assert_eq!(
            field(&b, "parent_span_id"),
            field(&g, "span_id"),
            "{request_id}"
        );
    }
}

/// What the backend is sent: a client's `tracestate` travels with a trace the gateway joins and
/// is dropped with one it replaces; flag bits other than `sampled` are not passed on.
#[tokio::test]
async fn tracestate_follows_only_a_joined_trace_and_unknown_flags_stop_at_the_edge() {
    let s = Fixture::new(60, 1_000);
    let key = s.issue("free");
    let echo = e2e::EchoUpstream::start();
    let gw = GatewayProcess::start(s.dir.path(), &s.spec(echo.addr));
    let client = reqwest::Client::new();
    let forwarded = |traceparent: &'static str| {
        let req = client
            .get(gw.url("/v1/pets"))
            .bearer_auth(&key)
            .header("traceparent", traceparent)
            .header("tracestate", "vendor=opaque");
        async move {
            let resp = req.send().await.unwrap();
            assert_eq!(resp.status(), 200);
            resp.text().await.unwrap().to_ascii_lowercase()
        }
    };
    let joined = forwarded("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-ff").await;
    assert!(joined.contains("tracestate: vendor=opaque"), "{joined}");
    let tp = joined
        .lines()
        .find_map(|l| l.strip_prefix("traceparent: "))
        .expect("a traceparent is forwarded");
    assert!(
        tp.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"),
        "{tp}"
    );
    assert!(
        tp.trim_end().ends_with("-01"),
        "only `sampled` passes: {tp}"
    );
    let replaced = forwarded("00-00000000000000000000000000000000-00f067aa0ba902b7-01").await;
    assert!(!replaced.contains("tracestate"), "{replaced}");
    assert!(replaced.contains("traceparent: 00-"), "{replaced}");
}
