//! OpenTelemetry traces over OTLP, end to end: the real gateway exporting to a receiver that
//! decodes with the `opentelemetry-proto` package (`tests/otlp_receiver.py`). The spans of a
//! request and their parentage, the attributes (never the bearer token), the `traceparent` the
//! backend gets, the sampling ratio's exact decisions over 10,000 requests, a trusted caller's
//! sampled flag, and a collector down or slow, which costs requests nothing.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use e2e::{first_key_id, EchoUpstream, Fixture, GatewayProcess, PythonServer};
use serde_json::Value;

/// The OTLP receiver: its traces URL, its process and where it records each span.
fn collector(dir: &Path, delay_secs: f64) -> (String, PythonServer, PathBuf) {
    collector_with(dir, delay_secs, &[])
}

fn collector_with(dir: &Path, delay_secs: f64, more: &[String]) -> (String, PythonServer, PathBuf) {
    let record = dir.join("spans.ndjson");
    let mut args = vec![
        "--record".to_owned(),
        record.display().to_string(),
        "--delay".to_owned(),
        delay_secs.to_string(),
    ];
    args.extend_from_slice(more);
    let server = PythonServer::start(
        dir,
        "otlp_receiver.py",
        "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
        &args,
    );
    let scheme = if more.is_empty() { "http" } else { "https" };
    (
        format!("{scheme}://127.0.0.1:{}/v1/traces", server.port),
        server,
        record,
    )
}

fn spans(record: &Path) -> Vec<Value> {
    std::fs::read_to_string(record)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

/// Waits up to `timeout` for `done` to hold of the spans recorded.
fn wait_spans(record: &Path, timeout: Duration, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let until = Instant::now() + timeout;
    loop {
        let all = spans(record);
        if done(&all) || Instant::now() > until {
            return all;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn traced(f: &Fixture, upstream: std::net::SocketAddr, url: &str, more: &str) -> GatewayProcess {
    let mut spec = f.spec(upstream);
    spec.extra = format!("tracing_otlp_endpoint = \"{url}\"\n{more}");
    f.gateway(&spec)
}

fn servers(all: &[Value]) -> Vec<&Value> {
    all.iter()
        .filter(|s| s["kind"] == "SPAN_KIND_SERVER")
        .collect()
}

fn forwarded_traceparent(echo_body: &str) -> String {
    echo_body
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("traceparent: ")
                .map(str::to_owned)
        })
        .expect("a traceparent is forwarded")
        .trim()
        .to_owned()
}

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER: &str = "00f067aa0ba902b7";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sampled_request_exports_its_spans_with_their_parentage_and_attributes() {
    let f = Fixture::new(1_000, 100_000);
    let key = f.issue("free");
    let key_id = first_key_id(&f.keys);
    let echo = EchoUpstream::start();
    let (url, _collector, record) = collector(f.dir.path(), 0.0);
    // Ratio 1: sampled by the ratio; the caller's flag (00, and not trusted) decides nothing.
    let gw = traced(&f, echo.addr, &url, "tracing_sample_ratio = 1.0\n");
    let resp = reqwest::Client::new()
        .get(gw.url("/v1/pets?limit=2"))
        .bearer_auth(&key)
        .header("traceparent", format!("00-{TRACE}-{CALLER}-00"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let forwarded = forwarded_traceparent(&resp.text().await.unwrap());

    let all = wait_spans(&record, Duration::from_secs(10), |s| {
        s.iter().any(|s| s["name"] == "upstream attempt")
    });
    let named = |name: &str| {
        all.iter()
            .find(|s| s["name"] == name)
            .unwrap_or_else(|| panic!("no `{name}` span: {all:#?}"))
    };
    let server = named("GET /v1/pets");
    assert_eq!(server["kind"], "SPAN_KIND_SERVER");
    assert_eq!(server["trace_id"], TRACE);
    assert_eq!(
        server["parent_span_id"], CALLER,
        "the caller's span is the parent"
    );
    let a = &server["attributes"];
    assert_eq!(a["http.request.method"], "GET");
    assert_eq!(a["http.route"], "/v1/pets");
    assert_eq!(a["url.path"], "/v1/pets");
    assert_eq!(a["url.scheme"], "http");
    assert_eq!(a["http.response.status_code"], 200);
    assert_eq!(a["pet.key_id"], key_id.as_str());
    assert_eq!(a["pet.plan"], "free");
    assert_eq!(a["pet.decision"], "admitted");
    assert_eq!(a["client.address"], "127.0.0.1");
    assert_eq!(server["resource"]["service.name"], "pet-gateway");
    assert_eq!(server["scope"], "pet-gateway");

    let server_id = server["span_id"].as_str().unwrap();
    for child in ["authenticate", "quota decision", "upstream attempt"] {
        assert_eq!(named(child)["parent_span_id"], server_id, "{child}");
    }
    let decision = named("quota decision");
    assert_eq!(decision["attributes"]["pet.quota.decided_locally"], false);
    let store = named("quota store");
    assert_eq!(store["parent_span_id"], decision["span_id"]);
    assert_eq!(store["kind"], "SPAN_KIND_CLIENT");
    assert_eq!(store["attributes"]["db.system.name"], "memory");
    let attempt = named("upstream attempt");
    assert_eq!(attempt["kind"], "SPAN_KIND_CLIENT");
    assert_eq!(
        attempt["attributes"]["server.port"],
        i64::from(echo.addr.port())
    );
    assert_eq!(attempt["attributes"]["http.response.status_code"], 200);
    assert_eq!(
        forwarded,
        format!("00-{TRACE}-{}-01", attempt["span_id"].as_str().unwrap()),
        "the backend's parent is the attempt's span, sampled"
    );
    for s in &all {
        assert_eq!(s["trace_id"], TRACE);
        let (start, end) = (
            s["start_ns"].as_u64().unwrap(),
            s["end_ns"].as_u64().unwrap(),
        );
        assert!(start <= end, "{s}");
        assert!(
            start >= server["start_ns"].as_u64().unwrap()
                && end <= server["end_ns"].as_u64().unwrap(),
            "inside the server span: {s}"
        );
        assert!(
            !s.to_string().contains(&key[4..]),
            "key material in a span: {s}"
        );
    }
}

/// The trace-id ratio's decision as the OpenTelemetry specification's SDKs make it: the id's
/// low 64 bits, halved, below the ratio of 2^63.
fn ratio_samples(id: &[u8; 16], ratio: f64) -> bool {
    let low = u64::from_be_bytes(id[8..].try_into().unwrap());
    (low >> 1) < (ratio * (1u64 << 63) as f64) as u64
}

/// `n` requests through the gateway from 8 tasks, each with `traceparent` when given: the
/// trace id and sampled flag of the `traceparent` the backend got, request by request.
async fn forwarded(
    gw: &GatewayProcess,
    key: &str,
    n: usize,
    traceparent: Option<String>,
) -> Vec<([u8; 16], bool)> {
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (client, key, url, tp) = (
            client.clone(),
            key.to_owned(),
            gw.url("/v1/pets?limit=1"),
            traceparent.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            for _ in 0..n / 8 {
                let mut req = client.get(&url).bearer_auth(&key);
                if let Some(tp) = &tp {
                    req = req.header("traceparent", tp);
                }
                let resp = req.send().await.unwrap();
                assert_eq!(resp.status(), 200);
                let tp = forwarded_traceparent(&resp.text().await.unwrap());
                let mut id = [0u8; 16];
                hex::decode_to_slice(&tp[3..35], &mut id).unwrap();
                seen.push((id, tp.ends_with("-01")));
            }
            seen
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

/// Where the gateway starts the trace, the ratio decides exactly as the SDKs' `TraceIdRatioBased`
/// does, for every one of 5,000 requests, and exactly those are exported. Where a public client
/// chose the trace id (5,000 ids the ratio would always take, sent with the sampled flag), a
/// draw of the gateway's own decides: about a quarter, within 6 standard deviations (±184 of
/// 1,250), never all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ratio_decides_exactly_by_the_gateways_trace_ids_and_a_client_cannot_choose_its_way_in()
{
    let f = Fixture::new(1_000_000, 10_000_000);
    let key = f.issue("free");
    let echo = EchoUpstream::start();
    let (url, _collector, record) = collector(f.dir.path(), 0.0);
    let gw = traced(&f, echo.addr, &url, "tracing_sample_ratio = 0.25\n");

    let started = forwarded(&gw, &key, 5_000, None).await;
    for (id, sampled) in &started {
        assert_eq!(*sampled, ratio_samples(id, 0.25), "{}", hex::encode(id));
    }
    let expected: std::collections::BTreeSet<String> = started
        .iter()
        .filter(|(_, sampled)| *sampled)
        .map(|(id, _)| hex::encode(id))
        .collect();
    assert!(
        (1_000..1_500).contains(&expected.len()),
        "{}",
        expected.len()
    );
    let all = wait_spans(&record, Duration::from_secs(30), |s| {
        servers(s).len() >= expected.len()
    });
    let got: std::collections::BTreeSet<String> = servers(&all)
        .iter()
        .map(|s| s["trace_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        servers(&all).len(),
        got.len(),
        "one server span a sampled request"
    );
    assert_eq!(got, expected, "exactly the ratio's trace ids are exported");

    let chosen = "7e57000000000000".to_owned() + "0000000000000000";
    let tp = format!("00-{chosen}-{CALLER}-01");
    let pushed = forwarded(&gw, &key, 5_000, Some(tp)).await;
    assert!(
        pushed.iter().all(|(id, _)| hex::encode(id) == chosen),
        "the client's trace is joined"
    );
    let sampled = pushed.iter().filter(|(_, s)| *s).count();
    assert!(
        (1_250 - 184..=1_250 + 184).contains(&sampled),
        "a client's chosen ids are sampled at the ratio, not always: {sampled} of 5,000"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trusted_callers_sampled_flag_decides_and_the_backend_hears_the_decision() {
    let f = Fixture::new(1_000, 100_000);
    let key = f.issue("free");
    let echo = EchoUpstream::start();
    let (url, _collector, record) = collector(f.dir.path(), 0.0);
    let gw = traced(
        &f,
        echo.addr,
        &url,
        "tracing_sample_ratio = 0.0\ntrusted_proxies = [\"127.0.0.1/32\"]\n",
    );
    let client = reqwest::Client::new();
    let send = |trace: &'static str, flag: &'static str| {
        let req = client
            .get(gw.url("/v1/pets"))
            .bearer_auth(&key)
            .header("traceparent", format!("00-{trace}-{CALLER}-{flag}"));
        async move { forwarded_traceparent(&req.send().await.unwrap().text().await.unwrap()) }
    };
    let yes = "11111111111111111111111111111111";
    let no = "22222222222222222222222222222222";
    assert!(send(yes, "01").await.ends_with("-01"));
    assert!(send(no, "00").await.ends_with("-00"));
    wait_spans(&record, Duration::from_secs(10), |s| !servers(s).is_empty());
    // Time for a span of the other request, had it been sampled, to arrive too.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let all = spans(&record);
    let traces: Vec<&str> = servers(&all)
        .iter()
        .map(|s| s["trace_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        traces,
        [yes],
        "the trusted caller's flag, and the ratio 0 for the rest"
    );
}

async fn metric(gw: &GatewayProcess, name: &str) -> u64 {
    let text = reqwest::get(gw.admin_url("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Waits up to 20 s for the gateway's metric `name` (summed over its labels) to pass 0.
async fn counted(gw: &GatewayProcess, name: &str) -> bool {
    for _ in 0..200 {
        if metric(gw, name).await > 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// 200 requests, each answered 200 within 2 s (the collector holds each export 5 s).
async fn answered_promptly(gw: &GatewayProcess, key: &str) {
    let client = reqwest::Client::new();
    for _ in 0..200 {
        let started = Instant::now();
        let resp = client
            .get(gw.url("/v1/pets?limit=1"))
            .bearer_auth(key)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "a request waited on the collector: {:?}",
            started.elapsed()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_down_or_slow_costs_requests_nothing_and_its_losses_are_counted() {
    let f = Fixture::new(100_000, 1_000_000);
    let key = f.issue("free");
    let echo = EchoUpstream::start();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let down = format!("http://{}/v1/traces", closed.local_addr().unwrap());
    drop(closed);
    let gw = traced(&f, echo.addr, &down, "tracing_sample_ratio = 1.0\n");
    answered_promptly(&gw, &key).await;
    assert!(
        counted(
            &gw,
            "pet_gateway_trace_spans_dropped_total{reason=\"export_failed\"}"
        )
        .await,
        "spans the collector never took are counted"
    );
    drop(gw);

    let (slow, _collector, record) = collector(f.dir.path(), 5.0);
    let gw = traced(&f, echo.addr, &slow, "tracing_sample_ratio = 1.0\n");
    answered_promptly(&gw, &key).await;
    assert!(
        counted(&gw, "pet_gateway_trace_spans_exported_total").await,
        "a slow collector gets the spans in the end"
    );
    assert!(!spans(&record).is_empty());
}

/// An `https://` collector, trusted through the system's roots (here `SSL_CERT_FILE`, as an
/// operator points them at a private CA): the spans arrive over TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_collector_gets_the_spans_over_tls() {
    use base64::Engine;
    let f = Fixture::new(1_000, 100_000);
    let key = f.issue("free");
    let echo = EchoUpstream::start();
    let cert = e2e::TestCert::generate("otlp test CA");
    let (pem, key_pem, ca) = (
        f.dir.path().join("collector.pem"),
        f.dir.path().join("collector.key"),
        f.dir.path().join("ca.pem"),
    );
    cert.write(&pem, &key_pem);
    let b64 = base64::engine::general_purpose::STANDARD.encode(&cert.ca_der);
    let lines: Vec<&str> = b64
        .as_bytes()
        .chunks(64)
        .map(|c| std::str::from_utf8(c).unwrap())
        .collect();
    std::fs::write(
        &ca,
        format!(
            "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
            lines.join("\n")
        ),
    )
    .unwrap();
    let tls = [
        "--tls-cert".to_owned(),
        pem.display().to_string(),
        "--tls-key".to_owned(),
        key_pem.display().to_string(),
    ];
    let (url, _collector, record) = collector_with(f.dir.path(), 0.0, &tls);
    let mut spec = f.spec(echo.addr);
    spec.extra = format!("tracing_otlp_endpoint = \"{url}\"\ntracing_sample_ratio = 1.0\n");
    spec.env
        .push(("SSL_CERT_FILE".to_owned(), ca.display().to_string()));
    let gw = f.gateway(&spec);
    let resp = reqwest::Client::new()
        .get(gw.url("/v1/pets"))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let all = wait_spans(&record, Duration::from_secs(15), |s| !servers(s).is_empty());
    assert_eq!(
        servers(&all).len(),
        1,
        "the span came over TLS: {all:#?}\n{}",
        gw.log_text()
    );
}
