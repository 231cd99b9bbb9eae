//! Bad days, end to end with real processes: Redis killed, paused or failing over, a backend
//! restarted, and a fleet of gateways sharing one count.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::{
    burst, first_key_id, fresh_minute, write_plan, Backend, ClosingUpstream, Fixture,
    GatewayProcess, GatewaySpec, Process, RedisCluster, RedisServer,
};
use serde_json::Value;

/// The store deadline the fault tests run with (the default).
const DEADLINE: Duration = Duration::from_millis(50);
/// What a request may take beyond it.
const SLACK: Duration = Duration::from_millis(100);

struct Setup {
    fixture: Fixture,
    key: String,
}

impl std::ops::Deref for Setup {
    type Target = Fixture;
    fn deref(&self) -> &Fixture {
        &self.fixture
    }
}

/// A `free` plan at `per_minute` (and a day quota that never binds) with one key on it.
fn setup(per_minute: u64) -> Setup {
    let fixture = Fixture::new(per_minute, 10_000_000);
    let key = fixture.issue("free");
    Setup { fixture, key }
}

/// One finished request of a [`Stream`].
#[derive(Debug)]
struct Outcome {
    status: Result<u16, String>,
    took: Duration,
}

/// Steady traffic: `workers` loops, each sending one request after another until stopped.
struct Stream {
    stop: Arc<AtomicBool>,
    workers: Vec<tokio::task::JoinHandle<Vec<Outcome>>>,
}

impl Stream {
    fn start(urls: Vec<String>, key: &str, workers: usize) -> Stream {
        let stop = Arc::new(AtomicBool::new(false));
        let workers = (0..workers)
            .map(|w| {
                let (urls, key, stop) = (urls.clone(), key.to_owned(), Arc::clone(&stop));
                tokio::spawn(async move {
                    let client = reqwest::Client::new();
                    let mut seen = Vec::new();
                    let mut i = w;
                    while !stop.load(Ordering::Relaxed) && seen.len() < 50_000 {
                        let started = Instant::now();
                        let status = client
                            .get(&urls[i % urls.len()])
                            .bearer_auth(&key)
                            .send()
                            .await
                            .map(|r| r.status().as_u16())
                            .map_err(|e| format!("{e:?}"));
                        seen.push(Outcome {
                            status,
                            took: started.elapsed(),
                        });
                        i += 1;
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                    seen
                })
            })
            .collect();
        Stream { stop, workers }
    }

    async fn finish(self) -> Vec<Outcome> {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        for w in self.workers {
            all.extend(w.await.unwrap());
        }
        all
    }
}

fn assert_all(outcomes: &[Outcome], status: u16, max: Duration) {
    assert!(
        outcomes.len() > 20,
        "traffic flowed: {} requests",
        outcomes.len()
    );
    let bad: Vec<_> = outcomes.iter().filter(|o| o.status != Ok(status)).collect();
    assert!(
        bad.is_empty(),
        "{} of {} requests did not get {status}: {:?}",
        bad.len(),
        outcomes.len(),
        &bad[..bad.len().min(5)]
    );
    let slowest = outcomes.iter().map(|o| o.took).max().unwrap();
    assert!(
        slowest <= max,
        "slowest request took {slowest:?} (allowed {max:?})"
    );
}

async fn fallback_gauge(gw: &GatewayProcess) -> f64 {
    gw.metric("pet_gateway_store_fallback").await
}

async fn gauge_reaches(gw: &GatewayProcess, value: f64, within: Duration) -> Duration {
    let started = Instant::now();
    loop {
        if fallback_gauge(gw).await == value {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < within,
            "fallback gauge not {value} within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn remaining(client: &reqwest::Client, gw: &GatewayProcess, key: &str) -> u64 {
    let resp = client
        .get(gw.url("/v1/pets"))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.headers()["x-ratelimit-remaining"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// The first `X-RateLimit-Remaining` of a 200, within 50 tries a tenth of a second apart.
async fn first_remaining(client: &reqwest::Client, gw: &GatewayProcess, key: &str) -> u64 {
    for _ in 0..50 {
        let resp = client
            .get(gw.url("/v1/pets"))
            .bearer_auth(key)
            .send()
            .await
            .unwrap();
        if resp.status() == 200 {
            return resp.headers()["x-ratelimit-remaining"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no 200 within 50 tries");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_mid_stream_costs_no_request_in_local_mode_and_sharing_resumes() {
    let s = setup(1_000_000);
    let redis = RedisServer::start();
    let redis_addr = redis.addr;
    let backend = Backend::start(&s.dir.path().join("pets.db"));
    let mut spec = GatewaySpec::new(backend.addr, &s.keys, &s.plans);
    spec.redis_url = Some(redis.url());
    let a = GatewayProcess::start(s.dir.path(), &spec);
    let b = GatewayProcess::start(s.dir.path(), &spec);

    let stream = Stream::start(vec![a.url("/v1/pets")], &s.key, 2);
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    redis.process.kill_hard();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(
        fallback_gauge(&a).await,
        1.0,
        "degraded while Redis is gone"
    );
    let _redis = RedisServer::start_at(redis_addr);
    let back = gauge_reaches(&a, 0.0, Duration::from_secs(2)).await;
    println!("exact counting resumed {back:?} after Redis returned");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let outcomes = stream.finish().await;
    assert_all(&outcomes, 200, DEADLINE + SLACK);

    // Shared again: B continues A's count (both reads in one minute).
    fresh_minute(Duration::from_secs(5));
    let client = reqwest::Client::new();
    let after_a = remaining(&client, &a, &s.key).await;
    let after_b = remaining(&client, &b, &s.key).await;
    assert_eq!(
        after_b,
        after_a - 1,
        "both nodes count in the one Redis again"
    );
}

#[tokio::test]
async fn redis_killed_in_closed_mode_gives_503s_not_hangs() {
    let s = setup(1_000_000);
    let redis = RedisServer::start();
    let backend = Backend::start(&s.dir.path().join("pets.db"));
    let mut spec = GatewaySpec::new(backend.addr, &s.keys, &s.plans);
    spec.redis_url = Some(redis.url());
    spec.extra = "on_store_error = \"closed\"\n".into();
    let gw = GatewayProcess::start(s.dir.path(), &spec);
    let client = reqwest::Client::new();
    assert_eq!(
        client
            .get(gw.url("/v1/pets"))
            .bearer_auth(&s.key)
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    redis.process.kill_hard();
    for _ in 0..10 {
        let started = Instant::now();
        let resp = client
            .get(gw.url("/v1/pets"))
            .bearer_auth(&s.key)
            .send()
            .await
            .unwrap();
        assert!(
            started.elapsed() <= DEADLINE + SLACK,
            "took {:?}",
            started.elapsed()
        );
        assert_eq!(resp.status(), 503);
        assert_eq!(resp.headers()["content-type"], "application/json");
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["status"], 503);
        assert!(body["message"].as_str().unwrap().contains("store"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_redis_is_treated_like_a_dead_one() {
    let s = setup(1_000_000);
    let redis = RedisServer::start();
    let backend = Backend::start(&s.dir.path().join("pets.db"));
    let mut spec = GatewaySpec::new(backend.addr, &s.keys, &s.plans);
    spec.redis_url = Some(redis.url());
    let gw = GatewayProcess::start(s.dir.path(), &spec);

    let stream = Stream::start(vec![gw.url("/v1/pets")], &s.key, 2);
    tokio::time::sleep(Duration::from_millis(800)).await;
    redis.process.signal(19); // SIGSTOP: connections stay open, nothing answers
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(fallback_gauge(&gw).await, 1.0);
    redis.process.signal(18); // SIGCONT
    gauge_reaches(&gw, 0.0, Duration::from_secs(2)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let outcomes = stream.finish().await;
    assert_all(&outcomes, 200, DEADLINE + SLACK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_master_failover_under_load_fails_no_request() {
    let s = setup(1_000_000);
    let mut cluster = RedisCluster::start(3, 1);
    let backend = Backend::start(&s.dir.path().join("pets.db"));
    let mut spec = GatewaySpec::new(backend.addr, &s.keys, &s.plans);
    spec.redis_url = Some(cluster.url());
    let gw = GatewayProcess::start(s.dir.path(), &spec);
    let client = reqwest::Client::new();
    let before = remaining(&client, &gw, &s.key).await;

    let redis_key = format!("{}:windows:{{{}}}", spec.key_prefix, first_key_id(&s.keys));
    let master = cluster
        .master_of(&redis_key)
        .expect("a master serves the key");
    let stream = Stream::start(vec![gw.url("/v1/pets")], &s.key, 2);
    tokio::time::sleep(Duration::from_millis(800)).await;
    cluster.kill(master);
    // The replica takes over after the node timeout (2 s) and an election: a few seconds, or
    // longer on a loaded machine when a first election round fails and is retried.
    let redis_key_for_wait = redis_key.clone();
    let waited = tokio::task::spawn_blocking(move || {
        cluster.wait_failover(&redis_key_for_wait, master, Duration::from_secs(45));
        cluster
    })
    .await
    .unwrap();
    // The gateway learns the new layout on its next refresh: allow a loaded machine its time.
    gauge_reaches(&gw, 0.0, Duration::from_secs(15)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let outcomes = stream.finish().await;
    let failed: Vec<_> = outcomes.iter().filter(|o| o.status != Ok(200)).collect();
    assert!(
        failed.is_empty(),
        "{} failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    // Counting goes on in the promoted replica (a request decided locally would show the
    // untouched local allowance instead).
    let started = Instant::now();
    loop {
        let after = remaining(&client, &gw, &s.key).await;
        if after < before - 1 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the shared count did not resume ({before} → {after})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(waited);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_two_backends_restarted_under_a_steady_stream_fails_no_request() {
    let s = setup(1_000_000);
    let db1 = s.dir.path().join("one.db");
    let b1 = Backend::start(&db1);
    let b1_addr = b1.addr;
    let b2 = Backend::start(&s.dir.path().join("two.db"));
    let mut spec = GatewaySpec::new(b1.addr, &s.keys, &s.plans);
    spec.upstreams.push(b2.addr);
    let gw = GatewayProcess::start(s.dir.path(), &spec);

    let stream = Stream::start(vec![gw.url("/v1/pets")], &s.key, 2);
    tokio::time::sleep(Duration::from_millis(800)).await;
    b1.process.signal(15);
    let exited = tokio::task::spawn_blocking(move || {
        Process::wait_exit(b1.process, Duration::from_secs(10))
    });
    assert_eq!(exited.await.unwrap(), Some(0));
    tokio::time::sleep(Duration::from_millis(800)).await;
    let _b1 = Backend::start_at(b1_addr, &db1);
    tokio::time::sleep(Duration::from_millis(800)).await;
    let outcomes = stream.finish().await;
    let failed: Vec<_> = outcomes.iter().filter(|o| o.status != Ok(200)).collect();
    assert!(
        failed.is_empty(),
        "{} of {} failed: {:?}",
        failed.len(),
        outcomes.len(),
        &failed[..failed.len().min(5)]
    );
    drop(b2);
}

/// A backend that closes new connections unanswered (as one shutting down does to those it had
/// just accepted) costs no idempotent request: each that meets it goes to the other backend.
/// Pingora alone retries this only on a reused connection. A POST is not sent twice: the
/// backend may have acted on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_closing_new_connections_unanswered_costs_no_get_and_repeats_no_post() {
    let s = setup(1_000_000);
    let closing = ClosingUpstream::start();
    let backend = Backend::start(&s.dir.path().join("pets.db"));
    let mut spec = GatewaySpec::new(closing.addr, &s.keys, &s.plans);
    spec.upstreams.push(backend.addr);
    let gw = GatewayProcess::start(s.dir.path(), &spec);
    for i in 0..20 {
        assert_eq!(gw.status(&s.key).await, 200, "GET {i}");
    }
    let client = reqwest::Client::new();
    let gets_dropped = closing.dropped();
    assert!(gets_dropped >= 1, "the closing backend was never tried");
    // Two POSTs in a row take the two backends in turn: one is created, one meets the closing
    // backend and is answered 502, not sent on.
    let mut statuses = Vec::new();
    for _ in 0..2 {
        let resp = client
            .post(gw.url("/v1/pets"))
            .bearer_auth(&s.key)
            .json(&serde_json::json!({"name": "Rex", "categoryId": 1}))
            .send()
            .await
            .unwrap();
        statuses.push(resp.status().as_u16());
    }
    statuses.sort_unstable();
    assert_eq!(statuses, [201, 502]);
    assert_eq!(closing.dropped(), gets_dropped + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_gateways_one_free_key_200_concurrent_requests_each_exactly_60_admitted() {
    let s = setup(60);
    write_plan(&s.plans, "free", 60, 1_000);
    let redis = RedisServer::start();
    let backend = Backend::start(&s.dir.path().join("pets.db"));
    let mut spec = GatewaySpec::new(backend.addr, &s.keys, &s.plans);
    spec.redis_url = Some(redis.url());
    // Exactness on a loaded 2-core machine, not latency: a deadline that a burst cannot miss.
    spec.extra = "threads = 1\nstore_timeout_ms = 3000\non_store_error = \"closed\"\n".into();
    let gateways: Vec<_> = (0..5)
        .map(|_| GatewayProcess::start(s.dir.path(), &spec))
        .collect();
    fresh_minute(Duration::from_secs(25));
    let counts = burst(&gateways, &s.key, 1_000).await;
    assert_eq!(counts.get(&200), Some(&60), "{counts:?}");
    assert_eq!(counts.get(&429), Some(&940), "{counts:?}");
    // The decisions went to Redis in batches (group commit), not one script run each.
    let (mut decisions, mut runs) = (0.0, 0.0);
    for gw in &gateways {
        decisions += gw.metric("pet_gateway_store_batch_size_sum").await;
        runs += gw.metric("pet_gateway_store_batch_size_count").await;
    }
    // Requests of a key a node knows to be banned never reach the store.
    assert!(decisions > 60.0, "{decisions}");
    assert!(
        runs < decisions,
        "{runs} script runs for {decisions} decisions"
    );
    println!("{decisions} decisions in {runs} script runs");
}

/// A Redis that answers `PING` but takes no writes (here paused for writes; the same holds out
/// of memory or as a read-only replica): the breaker's probe runs a script like a request does,
/// so the breaker stays open for the whole pause instead of closing every 250 ms and costing
/// requests a deadline each time, and it closes within 2 s of the pause ending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_paused_for_writes_keeps_the_breaker_open_without_flapping() {
    let s = setup(1_000_000);
    let redis = RedisServer::start();
    let backend = Backend::start(&s.dir.path().join("pets.db"));
    let mut spec = GatewaySpec::new(backend.addr, &s.keys, &s.plans);
    spec.redis_url = Some(redis.url());
    let gw = GatewayProcess::start(s.dir.path(), &spec);

    let workers = 2;
    let stream = Stream::start(vec![gw.url("/v1/pets")], &s.key, workers);
    tokio::time::sleep(Duration::from_millis(800)).await;
    let failed_before = gw.metric_sum("pet_gateway_store_errors_total").await;
    assert_eq!(redis.cli(&["CLIENT", "PAUSE", "30000", "WRITE"]), "OK");
    gauge_reaches(&gw, 1.0, Duration::from_secs(2)).await;
    // The old probe (PING) closed the breaker within 250 ms of opening it, again and again.
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_secs(4) {
        assert_eq!(
            fallback_gauge(&gw).await,
            1.0,
            "the fallback gauge flapped {:?} into the pause",
            watched.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(redis.cli(&["CLIENT", "UNPAUSE"]), "OK");
    let back = gauge_reaches(&gw, 0.0, Duration::from_secs(2)).await;
    println!("exact counting resumed {back:?} after the pause ended");
    let outcomes = stream.finish().await;
    // Only the calls that opened the breaker (three failures in a row, and those in flight
    // beside the third) went to the paused Redis and waited for the deadline: a breaker that
    // closed again while the pause lasted would send more at each close. Counted by the
    // gateway, not timed here, where a loaded machine can make any request slow.
    let failed = gw.metric_sum("pet_gateway_store_errors_total").await - failed_before;
    assert!(
        (3.0..=(3 + workers - 1) as f64).contains(&failed),
        "{failed} store calls failed during the pause: the breaker opened at three and let \
         no more through"
    );
    // And none waited for the pause: a loaded machine's second is far below its 30 s.
    assert_all(&outcomes, 200, DEADLINE + Duration::from_secs(1));
}

/// A ban lifted on node A must not come back on node B during a later outage: B's ban cache
/// follows the store's list of bans, and a store answer of "not banned" drops its entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ban_lifted_on_one_node_does_not_return_on_another_during_an_outage() {
    let s = setup(1);
    let id = first_key_id(&s.keys);
    let redis = RedisServer::start();
    let backend = Backend::start(&s.dir.path().join("pets.db"));
    let mut spec = GatewaySpec::new(backend.addr, &s.keys, &s.plans);
    spec.redis_url = Some(redis.url());
    // A generous deadline: on a busy CI machine a missed 50 ms one would decide by the local
    // fallback, which this test is not about.
    spec.extra = "store_timeout_ms = 500\n[ban]\nstrikes = 0\ndurations_secs = [600]\n".into();
    let a = GatewayProcess::start(s.dir.path(), &spec);
    let b = GatewayProcess::start(s.dir.path(), &spec);
    let client = reqwest::Client::new();
    let code = |gw: &GatewayProcess| {
        let (client, url, key) = (client.clone(), gw.url("/v1/pets"), s.key.clone());
        async move {
            let resp = client.get(url).bearer_auth(key).send().await.unwrap();
            if resp.status() == 200 {
                return "ok".to_owned();
            }
            let body: Value = resp.json().await.unwrap();
            body["code"].as_str().unwrap().to_owned()
        }
    };
    fresh_minute(Duration::from_secs(15));
    assert_eq!(code(&a).await, "ok");
    assert_eq!(code(&a).await, "api_key_banned", "the first refusal bans");
    assert_eq!(code(&b).await, "api_key_banned", "B learns the ban");

    let lift = client
        .post(a.admin_url(&format!("/bans/{id}/lift")))
        .send()
        .await
        .unwrap();
    assert_eq!(lift.status(), 200);
    // B's probe compares its ban cache with the store's list once a second.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    redis.process.kill_hard();
    for _ in 0..8 {
        let c = code(&b).await;
        assert_ne!(c, "api_key_banned", "the lifted ban came back on B");
    }
    assert_eq!(fallback_gauge(&b).await, 1.0, "B decided without Redis");
}

/// Redis full: with the shipped `maxmemory-policy`, live counters are never evicted. Requests
/// fail visibly while it is full (503 in closed mode), and once memory is freed the count goes
/// on from where it was, never from zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_refuses_visibly_and_never_resets_a_count() {
    let conf = std::fs::read_to_string(e2e::repo_root().join("deploy/redis/redis.conf")).unwrap();
    let policy = conf
        .lines()
        .find_map(|l| l.strip_prefix("maxmemory-policy "))
        .expect("the shipped redis.conf sets maxmemory-policy")
        .trim()
        .to_owned();
    let s = setup(1_000);
    let redis = RedisServer::start_with(
        e2e::free_addr(),
        &["--maxmemory", "4mb", "--maxmemory-policy", &policy],
    );
    let backend = Backend::start(&s.dir.path().join("pets.db"));
    let mut spec = GatewaySpec::new(backend.addr, &s.keys, &s.plans);
    spec.redis_url = Some(redis.url());
    spec.extra = "on_store_error = \"closed\"\n".into();
    let gw = GatewayProcess::start(s.dir.path(), &spec);
    let client = reqwest::Client::new();
    fresh_minute(Duration::from_secs(20));
    // The first decisions load the quota function into this fresh Redis: beside a loaded
    // machine they can pass `store_timeout_ms`, which closed mode answers 503 (and a call past
    // its deadline may still have counted). Counted from the first 200 on, not from the plan.
    let first = first_remaining(&client, &gw, &s.key).await;
    for _ in 0..3 {
        remaining(&client, &gw, &s.key).await;
    }
    let before = remaining(&client, &gw, &s.key).await;
    assert_eq!(before, first - 4);

    // 8 MiB of data without a TTL, in one script (checked against maxmemory only at its start).
    redis.cli(&[
        "EVAL",
        "redis.call('SET', 'junk', string.rep('x', 8 * 1024 * 1024)) return 1",
        "0",
    ]);
    for _ in 0..5 {
        assert_eq!(gw.status(&s.key).await, 503, "a full store refuses visibly");
    }
    assert!(
        gw.metric("pet_gateway_store_errors_total{kind=\"protocol\"}")
            .await
            >= 3.0
    );
    redis.cli(&["DEL", "junk"]);
    gauge_reaches(&gw, 0.0, Duration::from_secs(3)).await;
    assert_eq!(
        remaining(&client, &gw, &s.key).await,
        before - 1,
        "the count went on from where it was (policy {policy})"
    );
}

/// A gateway whose backend is given by host name, in a mount namespace of its own where
/// `hosts` is `/etc/hosts`; `interval` is `upstream_resolve_interval_secs`.
fn named_backend_gateway(
    f: &Fixture,
    hosts: &std::path::Path,
    port: u16,
    interval: u64,
) -> GatewayProcess {
    let mut spec = f.spec("127.0.0.1:1".parse().unwrap());
    spec.upstream_names = vec![format!("backend.test:{port}")];
    spec.hosts_file = Some(hosts.to_owned());
    spec.extra = format!("upstream_resolve_interval_secs = {interval}\n");
    f.gateway(&spec)
}

/// What `GET /v1/pets` through `gw` answers: the status and the body.
async fn list_pets(gw: &GatewayProcess, key: &str) -> (u16, String) {
    let resp = reqwest::Client::new()
        .get(gw.url("/v1/pets"))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

/// A backend at `ip` on `port`, holding one pet named `name` (to tell the backends apart).
async fn backend_holding(f: &Fixture, ip: &str, port: u16, name: &str) -> Backend {
    let addr = format!("{ip}:{port}").parse().unwrap();
    let backend = Backend::start_at(addr, &f.dir.path().join(format!("{name}.db")));
    let created = reqwest::Client::new()
        .post(backend.url("/v1/pets"))
        .json(&serde_json::json!({"name": name, "categoryId": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201, "{name}");
    backend
}

/// A backend given by host name that comes back at another address (a restarted container)
/// is followed: the first request after the move fails to connect, the name is looked up
/// again, and that same request is answered at the new address, not 502 (the name was looked
/// up once at start before). A backend that is down and has not moved still gives 502.
#[tokio::test]
async fn a_backend_given_by_name_is_followed_when_a_connection_to_it_fails() {
    let f = Fixture::new(600, 10_000);
    let key = f.issue("free");
    let port = e2e::free_addr().port();
    let hosts = f.dir.path().join("hosts");
    std::fs::write(&hosts, "127.0.0.2 backend.test\n").unwrap();
    let old = backend_holding(&f, "127.0.0.2", port, "at-old").await;
    let gw = named_backend_gateway(&f, &hosts, port, 0);
    let (status, body) = list_pets(&gw, &key).await;
    assert!(status == 200 && body.contains("at-old"), "{status} {body}");

    old.process.kill_hard();
    let (status, _) = list_pets(&gw, &key).await;
    assert_eq!(status, 502, "down and not moved: the failure stands");

    let _new = backend_holding(&f, "127.0.0.3", port, "at-new").await;
    // Rewritten in place: the bind mount shows the file, not a name for it.
    std::fs::write(&hosts, "127.0.0.3 backend.test\n").unwrap();
    // Past the lookup's gap since the 502's lookup.
    tokio::time::sleep(e2e_gap()).await;
    let (status, body) = list_pets(&gw, &key).await;
    assert!(status == 200 && body.contains("at-new"), "{status} {body}");
    e2e::eventually(Duration::from_secs(2), "the move is logged", || {
        gw.log_text().contains("resolves to a new address")
    })
    .await;
}

/// With no failure at all (the old address still answers), the timer moves the gateway to
/// the name's new address within `upstream_resolve_interval_secs`.
#[tokio::test]
async fn a_backend_given_by_name_is_looked_up_again_on_a_timer() {
    let f = Fixture::new(600, 10_000);
    let key = f.issue("free");
    let port = e2e::free_addr().port();
    let hosts = f.dir.path().join("hosts");
    std::fs::write(&hosts, "127.0.0.4 backend.test\n").unwrap();
    let _old = backend_holding(&f, "127.0.0.4", port, "at-old").await;
    let _new = backend_holding(&f, "127.0.0.5", port, "at-new").await;
    let gw = named_backend_gateway(&f, &hosts, port, 1);
    let (status, body) = list_pets(&gw, &key).await;
    assert!(status == 200 && body.contains("at-old"), "{status} {body}");
    std::fs::write(&hosts, "127.0.0.5 backend.test\n").unwrap();
    let started = Instant::now();
    loop {
        let (status, body) = list_pets(&gw, &key).await;
        assert_eq!(status, 200, "{body}");
        if body.contains("at-new") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "still at the old address"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A little more than the gateway's gap between two lookups of one name.
fn e2e_gap() -> Duration {
    Duration::from_millis(1_100)
}
