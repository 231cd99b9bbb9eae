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
    let record = dir.join("spans.ndjson");
    let server = PythonServer::start(
        dir,
        "otlp_receiver.py",
        "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
        &[
            "--record".to_owned(),
            record.display().to_string(),
            "--delay".to_owned(),
            delay_secs.to_string(),
        ],
    );
    (
        format!("http://127.0.0.1:{}/v1/traces", server.port),
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

/// splitmix64: the test's own trace ids, the same every run.
fn ids(n: usize) -> Vec<[u8; 16]> {
    let mut state = 0x5eed_u64;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    (0..n)
        .map(|_| {
            let mut id = [0u8; 16];
            id[..8].copy_from_slice(&next().to_be_bytes());
            id[8..].copy_from_slice(&next().to_be_bytes());
            id
        })
        .collect()
}

/// The trace-id ratio's decision as the OpenTelemetry specification's SDKs make it: the id's
/// low 64 bits, halved, below the ratio of 2^63.
fn ratio_samples(id: &[u8; 16], ratio: f64) -> bool {
    let low = u64::from_be_bytes(id[8..].try_into().unwrap());
    (low >> 1) < (ratio * (1u64 << 63) as f64) as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ratio_samples_exactly_the_trace_ids_it_should_over_10_000_requests() {
    let f = Fixture::new(1_000_000, 10_000_000);
    let key = f.issue("free");
    let echo = EchoUpstream::start();
    let (url, _collector, record) = collector(f.dir.path(), 0.0);
    let gw = traced(&f, echo.addr, &url, "tracing_sample_ratio = 0.25\n");
    let ids = ids(10_000);
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for chunk in ids.chunks(1_250) {
        let (client, key, url, chunk) = (
            client.clone(),
            key.clone(),
            gw.url("/v1/pets?limit=1"),
            chunk.to_vec(),
        );
        tasks.push(tokio::spawn(async move {
            for id in chunk {
                // The caller asks for every trace (flag 01); untrusted, it is not heard.
                let resp = client
                    .get(&url)
                    .bearer_auth(&key)
                    .header("traceparent", format!("00-{}-{CALLER}-01", hex::encode(id)))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 200);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let expected: std::collections::BTreeSet<String> = ids
        .iter()
        .filter(|id| ratio_samples(id, 0.25))
        .map(hex::encode)
        .collect();
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
    assert!(
        (2_300..2_700).contains(&expected.len()),
        "the test's ids give about a quarter: {}",
        expected.len()
    );
    assert_eq!(got, expected, "exactly the ratio's trace ids are exported");
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
