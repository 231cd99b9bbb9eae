//! Concurrent requests per quota holder (a plan's `concurrency`, a key's own, a customer's keys
//! together), through the real gateway: past it a 429 `concurrency_limited` that spends nothing
//! and strikes nothing; and no place ever leaks: not through client aborts, backend errors and
//! timeouts (10,000 requests, on memory, Redis and a Redis Cluster), not through a node killed
//! while holding places, not through a Redis restart while requests are in flight.

use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::{
    gateway_cli, ChaosUpstream, EchoUpstream, Fixture, GatewayProcess, RedisCluster, RedisServer,
    ShippedRedis,
};
use serde_json::Value;

/// A plan file `<name>.toml` with roomy windows and `extra` lines (`concurrency = 2`).
fn plan(f: &Fixture, name: &str, extra: &str) {
    std::fs::write(
        f.plans.join(format!("{name}.toml")),
        format!("requests_per_minute = 100000\nrequests_per_day = 1000000\n{extra}"),
    )
    .unwrap();
}

fn get(client: &reqwest::Client, gw: &GatewayProcess, key: &str) -> reqwest::RequestBuilder {
    client.get(gw.url("/v1/pets")).bearer_auth(key)
}

/// `key`'s requests in flight as `GET /v1/rate_limit` reports them (the store's count).
async fn in_flight(gw: &GatewayProcess, key: &str) -> u64 {
    let body = gw.rate_limit(key).await;
    body["concurrency"]["in_flight"]
        .as_u64()
        .unwrap_or_else(|| panic!("no concurrency in {body}"))
}

async fn in_flight_reaches(gw: &GatewayProcess, key: &str, want: u64, within: Duration) {
    let started = Instant::now();
    loop {
        let now = in_flight(gw, key).await;
        if now == want {
            return;
        }
        assert!(
            started.elapsed() < within,
            "{now} in flight, not {want}, after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends `n` requests of `key` that the slow backend holds; returns them once the store counts
/// them in flight.
async fn hold(
    gw: &GatewayProcess,
    key: &str,
    n: usize,
) -> Vec<tokio::task::JoinHandle<reqwest::Result<reqwest::Response>>> {
    let client = reqwest::Client::new();
    let held: Vec<_> = (0..n)
        .map(|_| tokio::spawn(get(&client, gw, key).send()))
        .collect();
    in_flight_reaches(gw, key, n as u64, Duration::from_secs(5)).await;
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_concurrency_a_key_gets_429_concurrency_limited_spending_and_striking_nothing() {
    let f = Fixture::new(100, 1_000);
    plan(&f, "free", "concurrency = 2\n");
    let key = f.issue("free");
    let upstream = EchoUpstream::start_with_delay(Duration::from_millis(1_500));
    let gw = f.gateway(&f.spec(upstream.addr));
    // The minute's `remaining` is compared from start to end (about 4 s): within one minute,
    // measured from here, not before the gateway's start.
    e2e::fresh_minute(Duration::from_secs(15));
    let held = hold(&gw, &key, 2).await;
    let status = gw.rate_limit(&key).await;
    assert_eq!(
        status["concurrency"],
        serde_json::json!({"limit": 2, "in_flight": 2})
    );
    let remaining = status["minute"]["remaining"].as_u64().unwrap();
    let client = reqwest::Client::new();
    // More than `ban.strikes` (10) in a minute: parallel clients are not abusive, no ban.
    for _ in 0..15 {
        let resp = get(&client, &gw, &key).send().await.unwrap();
        assert_eq!(resp.status(), 429);
        assert_eq!(e2e::header(&resp, "retry-after").as_deref(), Some("1"));
        assert_eq!(
            e2e::header(&resp, "x-ratelimit-remaining"),
            Some(remaining.to_string()),
            "the windows' headers, untouched"
        );
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["code"], "concurrency_limited");
        assert_eq!(body["status"], 429);
    }
    let after = gw.rate_limit(&key).await;
    assert_eq!(after["minute"]["remaining"], remaining, "nothing spent");
    assert_eq!(after["ban"], Value::Null);
    assert_eq!(
        gw.metric_sum_where(
            "pet_gateway_overload_refusals_total",
            "reason=\"concurrency\""
        )
        .await,
        15.0
    );
    for h in held {
        assert_eq!(h.await.unwrap().unwrap().status(), 200);
    }
    in_flight_reaches(&gw, &key, 0, Duration::from_secs(2)).await;
    gw.metric_reaches(
        "pet_gateway_concurrency_slots_held",
        0.0,
        Duration::from_secs(2),
    )
    .await;
    let resp = get(&client, &gw, &key).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        e2e::header(&resp, "x-ratelimit-remaining"),
        Some((remaining - 1).to_string())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_customers_keys_share_one_concurrency_and_a_key_may_have_its_own() {
    let f = Fixture::new(100, 1_000);
    plan(&f, "pro", "concurrency = 3\n");
    let (_, a) = f.issue_with("pro", &["--customer", "acme"]);
    let (_, b) = f.issue_with("pro", &["--customer", "acme"]);
    let (_, own) = f.issue_with("pro", &["--limit", "concurrency=1"]);
    let refused = gateway_cli(&[
        "keys",
        "issue",
        "--keys-file",
        f.keys.to_str().unwrap(),
        "--plans-dir",
        f.plans.to_str().unwrap(),
        "--plan",
        "pro",
        "--limit",
        "concurrency=0",
    ]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains("--limit concurrency"),
        "{stderr}"
    );
    let upstream = EchoUpstream::start_with_delay(Duration::from_millis(1_500));
    let gw = f.gateway(&f.spec(upstream.addr));
    let client = reqwest::Client::new();
    let mut held = hold(&gw, &a, 2).await;
    held.push(tokio::spawn(get(&client, &gw, &b).send()));
    in_flight_reaches(&gw, &a, 3, Duration::from_secs(5)).await;
    assert_eq!(in_flight(&gw, &b).await, 3, "one count for the customer");
    for key in [&a, &b] {
        assert_eq!(get(&client, &gw, key).send().await.unwrap().status(), 429);
    }
    held.extend(hold(&gw, &own, 1).await);
    let own_status = gw.rate_limit(&own).await;
    assert_eq!(own_status["concurrency"]["limit"], 1, "{own_status}");
    assert_eq!(get(&client, &gw, &own).send().await.unwrap().status(), 429);
    for h in held {
        assert_eq!(h.await.unwrap().unwrap().status(), 200);
    }
    // The admin API's `limits` take it too, checked like the flag.
    let issue = |limits: Value| {
        let url = gw.admin_url("/keys");
        async move {
            reqwest::Client::new()
                .post(url)
                .json(&serde_json::json!({"plan": "pro", "limits": limits}))
                .send()
                .await
                .unwrap()
        }
    };
    let made = issue(serde_json::json!({"concurrency": 5, "1s": 50})).await;
    assert_eq!(made.status(), 201);
    let made: Value = made.json().await.unwrap();
    assert_eq!(made["concurrency"], 5, "{made}");
    let bad = issue(serde_json::json!({"concurrency": 0})).await;
    assert_eq!(bad.status(), 400);
    assert!(bad.text().await.unwrap().contains("concurrency"));
}

/// Sends `total` requests, `workers` at a time, of `keys` in turn: one in ten gives up after
/// 30 ms (the client gone mid-request), one in ten is a `createPet`; returns the count of each
/// status (0: given up).
async fn storm(gw: &GatewayProcess, keys: &[String], total: usize, workers: usize) -> [usize; 600] {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counts = Arc::new(std::sync::Mutex::new([0usize; 600]));
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(workers)
        .build()
        .unwrap();
    let tasks: Vec<_> = (0..workers)
        .map(|_| {
            let (next, counts, client) = (Arc::clone(&next), Arc::clone(&counts), client.clone());
            let keys = keys.to_vec();
            let (pets, url) = (gw.url("/v1/pets"), gw.url("/v1/pets"));
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= total {
                        return;
                    }
                    let key = &keys[i % keys.len()];
                    let request = if i % 10 == 3 {
                        client
                            .post(&pets)
                            .header("content-type", "application/json")
                            .body(r#"{"name":"Rex","categoryId":1}"#)
                    } else {
                        client.get(&url)
                    };
                    let timeout = if i % 10 == 5 {
                        Duration::from_millis(30)
                    } else {
                        Duration::from_secs(10)
                    };
                    let status = match request.bearer_auth(key).timeout(timeout).send().await {
                        Ok(resp) => usize::from(resp.status().as_u16()),
                        Err(_) => 0,
                    };
                    counts.lock().unwrap()[status.min(599)] += 1;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let counts = *counts.lock().unwrap();
    counts
}

/// The drill of issue 32: 10,000 requests of 20 keys, with client aborts, backend errors (500,
/// a connection closed unanswered: 502), backend timeouts (504) and refusals (429 for the
/// concurrency, 503 shed), end with no place held: the node's gauge, the places at the
/// backend, and every key's count in the store, within moments (well inside a lease: given
/// back, not expired).
async fn no_place_leaks_through_aborts_errors_and_timeouts(redis_url: Option<String>) {
    let f = Fixture::new(100, 1_000);
    plan(&f, "free", "concurrency = 3\n");
    let keys: Vec<String> = (0..20).map(|_| f.issue("free")).collect();
    let upstream = ChaosUpstream::start(Duration::from_millis(400));
    let mut spec = f.spec(upstream.addr);
    spec.redis_url = redis_url;
    spec.extra = "upstream_read_timeout_ms = 200\nupstream_queue_timeout_ms = 100\n\
                  upstream_max_in_flight = 16\nstore_timeout_ms = 500\n\
                  concurrency_lease_secs = 60\n"
        .to_owned();
    let gw = f.gateway(&spec);
    let started = Instant::now();
    let counts = storm(&gw, &keys, 10_000, 48).await;
    let seen: Vec<(usize, usize)> = counts
        .iter()
        .enumerate()
        .filter(|(_, &n)| n > 0)
        .map(|(s, &n)| (s, n))
        .collect();
    eprintln!("10,000 requests in {:?}: {seen:?}", started.elapsed());
    for status in [0, 200, 429, 500, 502, 504] {
        assert!(counts[status] > 0, "no {status} among {seen:?}");
    }
    assert_eq!(counts.iter().sum::<usize>(), 10_000);
    gw.metric_reaches(
        "pet_gateway_concurrency_slots_held",
        0.0,
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(gw.metric_sum("pet_gateway_upstream_in_flight").await, 0.0);
    assert_eq!(gw.metric_sum("pet_gateway_upstream_queue").await, 0.0);
    for key in &keys {
        in_flight_reaches(&gw, key, 0, Duration::from_secs(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_no_place_leaks_through_aborts_errors_and_timeouts() {
    no_place_leaks_through_aborts_errors_and_timeouts(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_no_place_leaks_through_aborts_errors_and_timeouts() {
    let redis = RedisServer::start();
    no_place_leaks_through_aborts_errors_and_timeouts(Some(redis.url())).await;
    let leases = redis.cli(&["--scan", "--pattern", "*:leases:*"]);
    assert!(leases.is_empty(), "lease keys left: {leases}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_no_place_leaks_through_aborts_errors_and_timeouts() {
    let cluster = RedisCluster::start(3, 0);
    no_place_leaks_through_aborts_errors_and_timeouts(Some(cluster.url())).await;
}

/// A node killed (SIGKILL) while holding places frees them within `concurrency_lease_secs`:
/// another node of the fleet admits the key's requests again by then, and not before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_holding_places_frees_them_within_the_lease() {
    let f = Fixture::new(100, 1_000);
    plan(&f, "free", "concurrency = 2\n");
    let key = f.issue("free");
    let redis = RedisServer::start();
    let hung = EchoUpstream::start_with_delay(Duration::from_secs(60));
    let fast = EchoUpstream::start();
    let node = |upstream| {
        let mut spec = f.spec(upstream);
        spec.redis_url = Some(redis.url());
        spec.extra = "concurrency_lease_secs = 3\nupstream_read_timeout_ms = 60000\n\
                      store_timeout_ms = 500\n"
            .into();
        f.gateway(&spec)
    };
    let doomed = node(hung.addr);
    let survivor = node(fast.addr);
    let _held = hold(&doomed, &key, 2).await;
    assert_eq!(survivor.status(&key).await, 429, "the fleet counts both");
    doomed.process.kill_hard();
    let killed = Instant::now();
    let mut refused_after = Duration::ZERO;
    loop {
        match survivor.status(&key).await {
            200 => break,
            429 => refused_after = killed.elapsed(),
            other => panic!("{other}"),
        }
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "still refused {:?} after the kill",
            killed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "whole again {:?} after the kill (last refusal at {refused_after:?})",
        killed.elapsed()
    );
    assert!(
        refused_after > Duration::from_millis(500),
        "freed too soon for a lease of 3 s"
    );
    assert!(killed.elapsed() <= Duration::from_millis(4_500));
}

/// Redis restarted (the shipped config: AOF, the `gateway` ACL user) while requests are in
/// flight: the leases come back with the data, and the requests' releases reach the restarted
/// Redis, so the key is whole as soon as they end, not a lease later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_with_requests_in_flight_leaves_no_place_held() {
    let f = Fixture::new(100, 1_000);
    plan(&f, "free", "concurrency = 2\n");
    let key = f.issue("free");
    let mut redis = ShippedRedis::start("pet:test");
    let upstream = EchoUpstream::start_with_delay(Duration::from_millis(2_500));
    let mut spec = f.spec(upstream.addr);
    spec.redis_url = Some(redis.url("gateway"));
    spec.extra = "concurrency_lease_secs = 60\nstore_timeout_ms = 500\n".into();
    let gw = f.gateway(&spec);
    let held = hold(&gw, &key, 2).await;
    redis.terminate();
    redis.restart();
    let ended = {
        for h in held {
            assert_eq!(h.await.unwrap().unwrap().status(), 200);
        }
        Instant::now()
    };
    // The store's own count (it answers through the reconnected link).
    let started = Instant::now();
    loop {
        let resp = reqwest::Client::new()
            .get(gw.url("/v1/rate_limit"))
            .bearer_auth(&key)
            .send()
            .await
            .unwrap();
        if resp.status() == 200 {
            let body: Value = resp.json().await.unwrap();
            if body["concurrency"]["in_flight"] == 0 {
                break;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "places still held 10 s after the requests ended (lease 60 s); log:\n{}",
            gw.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("whole {:?} after the requests ended", ended.elapsed());
    assert_eq!(gw.status(&key).await, 200);
    let acl = redis.cli(&["ACL", "LOG"]);
    assert!(
        !acl.contains("leases"),
        "the gateway user may use its leases: {acl}"
    );
}
