//! Top consumers end to end (issue 24 item 5): real `pet-gateway`, `pet-backend` and
//! `redis-server` processes; keys driven with different request counts, then `pet-gateway usage
//! top` (the real binary, at the gateway's admin listener) ranks their holders.

use std::time::{Duration, Instant};

use e2e::{gateway_cli, Fixture, GatewayProcess, RedisServer};
use serde_json::Value;

/// Issues a key on the fixture's `free` plan with `more` flags: its id and the key.
fn issue(f: &Fixture, more: &[&str]) -> (String, String) {
    f.issue_with("free", more)
}

/// Sends `n` requests with `key`; each must be admitted.
async fn drive(gw: &GatewayProcess, key: &str, n: usize) {
    for _ in 0..n {
        assert_eq!(gw.status(key).await, 200);
    }
}

/// `pet-gateway usage top ARGS --admin-listen <gw's>`.
fn usage_top(gw: &GatewayProcess, args: &[&str]) -> std::process::Output {
    let admin = gw.admin.to_string();
    let mut all = vec!["usage", "top", "--admin-listen", &admin];
    all.extend_from_slice(args);
    gateway_cli(&all)
}

/// `usage top --json ARGS`, asked again until `done` holds of its body (the nodes flush once a
/// second), for at most 5 s.
async fn top_until(gw: &GatewayProcess, args: &[&str], done: impl Fn(&Value) -> bool) -> Value {
    let started = Instant::now();
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    loop {
        let out = usage_top(gw, &all);
        assert!(out.status.success(), "{out:?}");
        let body: Value = serde_json::from_slice(&out.stdout).expect("one JSON body");
        if done(&body) {
            return body;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "not within 5 s: {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn used_of(body: &Value, i: usize) -> u64 {
    body["entries"][i]["used"].as_u64().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_the_heaviest_holders_come_first_and_a_customer_is_one_entry() {
    let f = Fixture::new(1_000, 100_000);
    let (heavy_id, heavy) = issue(&f, &[]);
    let (light_id, light) = issue(&f, &[]);
    let (_, acme1) = issue(&f, &["--customer", "acme"]);
    let (_, acme2) = issue(&f, &["--customer", "acme"]);
    let backend = f.backend();
    let redis = RedisServer::start();
    let mut spec = f.spec(backend.addr);
    spec.redis_url = Some(redis.url());
    // Exact counts are the subject, not the store's deadline: a slow first call on a loaded
    // machine must not be decided locally.
    spec.extra = "store_timeout_ms = 2000\n".into();
    let gw = f.gateway(&spec);
    // The day's and the month's tops are the subject: not across midnight UTC.
    e2e::fresh_day(Duration::from_secs(30));
    drive(&gw, &heavy, 12).await;
    drive(&gw, &acme1, 4).await;
    drive(&gw, &acme2, 5).await;
    drive(&gw, &light, 2).await;

    let day = top_until(&gw, &[], |b| used_of(b, 2) == 2).await;
    assert_eq!(day["window"], "day");
    let first = &day["entries"][0];
    assert_eq!(first["key_id"], heavy_id.as_str(), "{day}");
    assert_eq!(
        (first["used"].as_u64(), first["plan"].as_str()),
        (Some(12), Some("free"))
    );
    assert_eq!(first["limit"], 100_000, "the plan's day limit");
    assert!(first["customer"].is_null());
    let acme = &day["entries"][1];
    assert_eq!(acme["customer"], "acme", "{day}");
    assert_eq!(acme["used"], 9, "both keys of the customer");
    for field in ["key_id", "plan", "limit"] {
        assert!(acme[field].is_null(), "{field}: {day}");
    }
    assert_eq!(day["entries"][2]["key_id"], light_id.as_str());
    assert_eq!(day["entries"].as_array().map(Vec::len), Some(3));

    let month = top_until(&gw, &["--window", "month", "--limit", "1"], |b| {
        used_of(b, 0) == 12
    })
    .await;
    assert_eq!(month["window"], "month");
    assert_eq!(month["entries"].as_array().map(Vec::len), Some(1));
    assert_eq!(month["entries"][0]["key_id"], heavy_id.as_str());
    assert!(
        month["entries"][0]["limit"].is_null(),
        "the plan has no month window"
    );
    let keys: Vec<String> = redis
        .cli(&["KEYS", "{pet:test:top:*"])
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(keys.len(), 2, "one set per period: {keys:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_the_table_ranks_keys_and_bad_asks_are_refused() {
    let f = Fixture::new(1_000, 100_000);
    let (a_id, a) = issue(&f, &[]);
    let (b_id, b) = issue(&f, &[]);
    let backend = f.backend();
    let gw = f.gateway(&f.spec(backend.addr));
    // The day's top is the subject: not across midnight UTC.
    e2e::fresh_day(Duration::from_secs(30));
    drive(&gw, &b, 2).await;
    drive(&gw, &a, 5).await;

    let day = top_until(&gw, &[], |body| {
        used_of(body, 0) == 5 && used_of(body, 1) == 2
    })
    .await;
    assert_eq!(day["entries"][0]["key_id"], a_id.as_str());
    assert_eq!(day["entries"][0]["used"], 5);
    assert_eq!(day["entries"][1]["key_id"], b_id.as_str());

    let out = usage_top(&gw, &[]);
    assert!(out.status.success(), "{out:?}");
    let table = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("RANK") && lines[0].contains("HOLDER"));
    let row: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(row, ["1", a_id.as_str(), "free", "5", "100000"], "{table}");

    let out = usage_top(&gw, &["--limit", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--limit"));
    let out = usage_top(&gw, &["--window", "week"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--window"));
    for (query, names) in [("limit=1001", "limit"), ("window=week", "window")] {
        let resp = reqwest::get(gw.admin_url(&format!("/usage/top?{query}")))
            .await
            .expect("admin answers");
        assert_eq!(resp.status().as_u16(), 400, "{query}");
        let body: Value = resp.json().await.expect("an Error body");
        assert!(body.to_string().contains(names), "{body}");
    }
}
