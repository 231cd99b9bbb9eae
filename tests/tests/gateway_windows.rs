//! Quotas as data, end to end: plans of any windows and a cost per operation, across five
//! gateway nodes on one Redis (exactly the limit, per second and per cost), shadow windows that
//! count but never refuse, and plan edits that apply to the current windows at once, embedded
//! and in Redis, without resetting any count.

use std::collections::HashMap;
use std::time::Duration;

use e2e::{
    eventually, fresh_minute, header, Backend, Fixture, GatewayProcess, GatewaySpec, RedisServer,
};
use serde_json::Value;

/// Five nodes on one Redis, one worker thread each, deciding exactly even when loaded.
fn five_nodes(f: &Fixture, backend: &Backend, redis: &RedisServer) -> Vec<GatewayProcess> {
    let mut spec: GatewaySpec = f.spec(backend.addr);
    spec.redis_url = Some(redis.url());
    // No bans: a burst is meant to go on sending after its 429s.
    spec.extra = "threads = 1\nstore_timeout_ms = 3000\non_store_error = \"closed\"\n\
                  [ban]\nstrikes = 1000000000\n"
        .into();
    (0..5).map(|_| f.gateway(&spec)).collect()
}

/// One response of a burst: its status and the headers that say which window it counted in.
struct Answer {
    status: u16,
    reset: Option<String>,
    policy: Option<String>,
}

/// `total` requests at once, spread over `gateways`: `GET /v1/pets`, or `POST` a pet.
async fn burst(gateways: &[GatewayProcess], key: &str, total: usize, post: bool) -> Vec<Answer> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let tasks: Vec<_> = (0..total)
        .map(|i| {
            let url = gateways[i % gateways.len()].url("/v1/pets");
            let (client, key) = (client.clone(), key.to_owned());
            tokio::spawn(async move {
                let request = if post {
                    client
                        .post(url)
                        .json(&serde_json::json!({"name": format!("p{i}"), "categoryId": 1}))
                } else {
                    client.get(url)
                };
                let resp = request.bearer_auth(key).send().await.expect("an answer");
                Answer {
                    status: resp.status().as_u16(),
                    reset: header(&resp, "x-ratelimit-reset"),
                    policy: header(&resp, "ratelimit-policy"),
                }
            })
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    answers
}

fn statuses(answers: &[Answer]) -> HashMap<u16, usize> {
    let mut counts = HashMap::new();
    for a in answers {
        *counts.entry(a.status).or_insert(0) += 1;
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_nodes_admit_exactly_a_one_second_windows_limit_in_each_second() {
    let f = Fixture::new(1, 1);
    std::fs::write(
        f.plans.join("free.toml"),
        "[[window]]\nevery = \"1s\"\nlimit = 20\n[[window]]\nevery = \"1h\"\nlimit = 100000\n",
    )
    .unwrap();
    let key = f.issue("free");
    let (redis, backend) = (RedisServer::start(), f.backend());
    let nodes = five_nodes(&f, &backend, &redis);
    let answers = burst(&nodes, &key, 600, false).await;
    let mut admitted_by_second: HashMap<String, usize> = HashMap::new();
    for a in answers.iter().filter(|a| a.status == 200) {
        // An admitted request's binding window is the one with least room: the second's.
        let reset = a.reset.clone().expect("X-RateLimit-Reset");
        *admitted_by_second.entry(reset).or_insert(0) += 1;
    }
    assert!(!admitted_by_second.is_empty(), "{:?}", statuses(&answers));
    assert!(
        admitted_by_second.values().all(|&n| n <= 20),
        "never more than 20 in one second: {admitted_by_second:?}"
    );
    assert_eq!(
        admitted_by_second.values().max(),
        Some(&20),
        "a second the burst filled admitted exactly 20: {admitted_by_second:?}"
    );
    let policy = answers[0].policy.clone().unwrap_or_default();
    assert_eq!(policy, "\"second\";q=20;w=1, \"hour\";q=100000;w=3600");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_nodes_admit_exactly_the_limit_of_a_cost_five_operation() {
    let f = Fixture::new(1, 1);
    std::fs::write(
        f.plans.join("free.toml"),
        "requests_per_minute = 60\nrequests_per_day = 100000\n[cost]\ncreatePet = 5\n",
    )
    .unwrap();
    let key = f.issue("free");
    let (redis, backend) = (RedisServer::start(), f.backend());
    let nodes = five_nodes(&f, &backend, &redis);
    fresh_minute(Duration::from_secs(25));
    let counts = statuses(&burst(&nodes, &key, 100, true).await);
    assert_eq!(
        counts.get(&201),
        Some(&12),
        "60 units at 5 each: {counts:?}"
    );
    assert_eq!(counts.get(&429), Some(&88), "{counts:?}");
    // Nothing of a refused request was counted: the minute holds exactly 60 units.
    let body = nodes[0].rate_limit(&key).await;
    assert_eq!(body["minute"]["remaining"], 0, "{body}");
    assert_eq!(body["day"]["remaining"], 100_000 - 60, "{body}");
}

/// What `GET /v1/rate_limit` says is left of the minute.
async fn minute_left(gw: &GatewayProcess, key: &str) -> u64 {
    let body = gw.rate_limit(key).await;
    body["minute"]["remaining"]
        .as_u64()
        .expect("a minute window")
}

/// Reloads the plans now (what the file watcher does within its interval).
async fn reload(gw: &GatewayProcess) {
    let resp = reqwest::Client::new()
        .post(gw.admin_url("/reload"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_edit_raises_and_lowers_limits_at_once_and_resets_no_count() {
    for redis in [false, true] {
        let f = Fixture::new(5, 1_000);
        let key = f.issue("free");
        let backend = f.backend();
        let server = redis.then(RedisServer::start);
        let mut spec = f.spec(backend.addr);
        spec.redis_url = server.as_ref().map(RedisServer::url);
        let gw = f.gateway(&spec);
        fresh_minute(Duration::from_secs(20));
        for _ in 0..5 {
            assert_eq!(gw.status(&key).await, 200);
        }
        assert_eq!(
            gw.status(&key).await,
            429,
            "redis {redis}: the minute is full"
        );

        e2e::write_plan(&f.plans, "free", 8, 1_000);
        reload(&gw).await;
        assert_eq!(
            gw.status(&key).await,
            200,
            "redis {redis}: a raise gives room at once"
        );
        assert_eq!(
            minute_left(&gw, &key).await,
            2,
            "redis {redis}: 6 of 8 counted, none reset"
        );

        e2e::write_plan(&f.plans, "free", 3, 1_000);
        reload(&gw).await;
        assert_eq!(
            gw.status(&key).await,
            429,
            "redis {redis}: a cut refuses at once"
        );
        assert_eq!(minute_left(&gw, &key).await, 0);

        // A window added by the edit starts counting; the minute keeps its 6.
        std::fs::write(
            f.plans.join("free.toml"),
            "requests_per_minute = 10\nrequests_per_day = 1000\n\
             [[window]]\nevery = \"1h\"\nlimit = 500\n",
        )
        .unwrap();
        reload(&gw).await;
        assert_eq!(gw.status(&key).await, 200);
        assert_eq!(minute_left(&gw, &key).await, 3, "redis {redis}: 7 of 10");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_window_is_counted_and_reported_but_never_refuses_or_shows() {
    let f = Fixture::new(1, 1);
    std::fs::write(
        f.plans.join("free.toml"),
        "requests_per_minute = 100\nrequests_per_day = 1000\n\
         [[window]]\nevery = \"10s\"\nlimit = 2\nshadow = true\n",
    )
    .unwrap();
    let key = f.issue("free");
    let backend = f.backend();
    let gw = f.gateway(&f.spec(backend.addr));
    // All four in one 10 s window: split 2 + 2 by its turn, none would pass its limit of 2.
    e2e::fresh_window(Duration::from_secs(10), Duration::from_secs(5));
    for _ in 0..4 {
        let resp = reqwest::Client::new()
            .get(gw.url("/v1/pets"))
            .bearer_auth(&key)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "a shadow window never refuses");
        let policy = header(&resp, "ratelimit-policy").unwrap();
        assert!(!policy.contains("10s"), "never in the headers: {policy}");
    }
    let body = gw.rate_limit(&key).await;
    assert!(
        !body.to_string().contains("10s"),
        "never to clients: {body}"
    );
    let metrics = reqwest::get(gw.admin_url("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let line = metrics
        .lines()
        .find(|l| l.starts_with("pet_gateway_shadow_refusals_total{plan=\"free\",window=\"10s\"}"))
        .unwrap_or_else(|| panic!("no shadow refusals counted:\n{metrics}"));
    let n: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    // The third and fourth of one 10 s window went past its limit of 2.
    assert_eq!(n, 2.0, "{line}");
    eventually(Duration::from_secs(5), "the access log says so", || {
        gw.log_text().contains("shadow")
    })
    .await;
    // The operator sees it, marked shadow.
    let id = e2e::first_key_id(&f.keys);
    let shown: Value = reqwest::get(gw.admin_url(&format!("/keys/{id}")))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let windows = shown["usage"]["windows"].as_array().unwrap();
    let shadow = windows.iter().find(|w| w["every"] == "10s").unwrap();
    assert_eq!(shadow["shadow"], true, "{shown}");
}

/// `keys issue` with more flags, through the real CLI on the fixture's files.
fn issue_with(f: &Fixture, args: &[&str]) -> std::process::Output {
    let (keys, plans) = (f.keys.to_string_lossy(), f.plans.to_string_lossy());
    let mut all = vec!["keys", "issue", "--keys-file", &keys, "--plans-dir", &plans];
    all.extend_from_slice(args);
    e2e::gateway_cli(&all)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_customers_keys_share_every_window_and_ban() {
    let f = Fixture::new(5, 1_000);
    let a = e2e::issued(&issue_with(&f, &["--plan", "free", "--customer", "acme"]));
    let b = e2e::issued(&issue_with(&f, &["--plan", "free", "--customer", "acme"]));
    let other = f.issue("free");
    let backend = f.backend();
    let gw = f.gateway(&f.spec(backend.addr));
    fresh_minute(Duration::from_secs(20));
    for _ in 0..3 {
        assert_eq!(gw.status(&a).await, 200);
    }
    assert_eq!(gw.status(&b).await, 200);
    assert_eq!(gw.status(&b).await, 200);
    assert_eq!(
        gw.status(&b).await,
        429,
        "5 in all across the customer's keys"
    );
    assert_eq!(minute_left(&gw, &a).await, 0, "A sees the shared figure");
    assert_eq!(
        gw.status(&other).await,
        200,
        "another customer's quota is its own"
    );
    // Strikes on one key ban the customer: the default policy bans after 10.
    for _ in 0..11 {
        gw.status(&b).await;
    }
    let resp = reqwest::Client::new()
        .get(gw.url("/v1/pets"))
        .bearer_auth(&a)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(
        body["code"], "api_key_banned",
        "the ban is the customer's: {body}"
    );
    // `keys show` says whose it is and the shared figures.
    let id = e2e::first_key_id(&f.keys);
    let admin = gw.admin.to_string();
    let out = e2e::gateway_cli(&[
        "keys",
        "show",
        &id,
        "--keys-file",
        &f.keys.to_string_lossy(),
        "--admin-listen",
        &admin,
        "--json",
    ]);
    assert!(out.status.success(), "{out:?}");
    let shown: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["customer"], "acme");
    assert_eq!(shown["usage"]["minute"], 5, "{shown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_own_windows_apply_and_bad_ones_are_refused_naming_the_flag() {
    let f = Fixture::new(60, 1_000);
    let key = e2e::issued(&issue_with(
        &f,
        &[
            "--plan",
            "free",
            "--limit",
            "1s=2",
            "--limit",
            "month=1000",
            "--per-minute",
            "30",
        ],
    ));
    let backend = f.backend();
    let gw = f.gateway(&f.spec(backend.addr));
    let resp = reqwest::Client::new()
        .get(gw.url("/v1/pets"))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    let policy = header(&resp, "ratelimit-policy").unwrap();
    let expected =
        "\"second\";q=2;w=1, \"minute\";q=30;w=60, \"day\";q=1000;w=86400, \"month\";q=1000;w=";
    assert!(policy.starts_with(expected), "{policy}");
    let month: u64 = policy[expected.len()..].parse().unwrap();
    assert!((28 * 86_400..=31 * 86_400).contains(&month), "{policy}");

    std::fs::write(
        f.plans.join("pro.toml"),
        "requests_per_minute = 60\nrequests_per_day = 1000\n[cost]\ncreatePet = 5\n",
    )
    .unwrap();
    let refused = [
        (vec!["--limit", "7x=1"], "--limit"),
        (vec!["--limit", "1s=0"], "--limit"),
        (vec!["--limit", "1s"], "--limit"),
        (vec!["--limit", "1s=1", "--limit", "1s=2"], "twice"),
        (
            vec![
                "--limit", "1s=9", "--limit", "2s=9", "--limit", "3s=9", "--limit", "4s=9",
                "--limit", "5s=9",
            ],
            "at most 6",
        ),
        (vec!["--plan", "pro", "--limit", "1m=3"], "could never pass"),
        (vec!["--customer", "not a name"], "customer"),
    ];
    for (args, expected) in refused {
        let mut all = args.clone();
        if !all.contains(&"--plan") {
            all.extend(["--plan", "free"]);
        }
        let out = issue_with(&f, &all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_issues_with_a_customer_and_own_windows() {
    let f = Fixture::new(60, 1_000);
    f.issue("free");
    let backend = f.backend();
    let gw = f.gateway(&f.spec(backend.addr));
    let post = |body: Value| {
        let url = gw.admin_url("/keys");
        async move {
            let resp = reqwest::Client::new()
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap();
            (resp.status().as_u16(), resp.json::<Value>().await.unwrap())
        }
    };
    let (status, made) = post(serde_json::json!({
        "plan": "free", "customer": "acme", "limits": {"1s": 50, "month": 1_000_000}
    }))
    .await;
    assert_eq!(status, 201, "{made}");
    assert_eq!(made["customer"], "acme");
    assert_eq!(
        made["limits"],
        serde_json::json!({"1s": 50, "month": 1_000_000})
    );
    let (status, refused) = post(serde_json::json!({"plan": "free", "limits": {"5x": 1}})).await;
    assert_eq!(status, 400, "{refused}");
    assert!(
        refused["message"].as_str().unwrap().contains("limits"),
        "{refused}"
    );
}
