//! Regions end to end (issue 48): two regions, each a gateway node and a Redis of its own, one
//! global store, the real binary and CLI. What crosses regions: a key issued or revoked in one
//! region is in force in the other within a second (the registry lives in the global store); a
//! ban started in one region holds in the other within a second, and a lift by the other
//! region's admin API ends it in both; `GET /v1/rate_limit` shows the global store's grants
//! beside the region's counts.

use std::time::{Duration, Instant};

use e2e::{
    all_reach, fresh_minute, issued, keys_cli, EchoUpstream, Fixture, GatewayProcess, GatewaySpec,
    RedisServer,
};
use serde_json::Value;

fn region_spec(
    f: &Fixture,
    upstream: std::net::SocketAddr,
    local: &RedisServer,
    global: &RedisServer,
    region: &str,
) -> GatewaySpec {
    let mut spec = f.spec(upstream);
    spec.redis_url = Some(local.url());
    spec.keys_file = f.dir.path().join(format!("region-{region}-keys.toml"));
    spec.extra = format!(
        "keys_source = \"store\"\nstore_timeout_ms = 1000\nregion = \"{region}\"\n\
         global_store_url = \"{}\"\non_store_error = \"closed\"\n\
         [ban]\nstrikes = 2\ndurations_secs = [60]\n",
        global.url()
    );
    spec
}

/// The id of the key named `name`, as `keys list` in `config`'s region shows it.
fn key_id(config: &std::path::Path, name: &str) -> String {
    let out = keys_cli(config, &["list", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    list.as_array()
        .unwrap()
        .iter()
        .find(|k| k["name"] == name)
        .map(|k| k["id"].as_str().unwrap().to_owned())
        .unwrap_or_else(|| panic!("{name} not in {list}"))
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// The error code of `node`'s answer to `key`, or `ok`.
async fn answer(node: &GatewayProcess, key: &str) -> String {
    let resp = reqwest::Client::new()
        .get(node.url("/v1/pets"))
        .bearer_auth(key)
        .send()
        .await
        .expect("the gateway answers");
    if resp.status().is_success() {
        return "ok".into();
    }
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    body["code"].as_str().unwrap_or("?").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_bans_and_the_global_figures_cross_regions() {
    let f = Fixture::with_plan("small", 4, 1000);
    // Room for both regions: a region's first ask covers a minute at its rate (its first
    // request early in a minute asks some 75 units), and the budget goes to who asks first.
    e2e::write_plan(&f.plans, "roomy", 100, 10_000);
    let global = RedisServer::start();
    let (ra, rb) = (RedisServer::start(), RedisServer::start());
    let upstream = EchoUpstream::start();
    let a = f.gateway(&region_spec(&f, upstream.addr, &ra, &global, "a"));
    let b = f.gateway(&region_spec(&f, upstream.addr, &rb, &global, "b"));
    let (config_a, config_b) = (a.config.clone(), b.config.clone());

    // Issued in region a: in force in b within a second.
    let key = issued(&keys_cli(
        &config_a,
        &["issue", "--plan", "roomy", "--name", "first"],
    ));
    let took = all_reach([&a, &b], &key, 200, Duration::from_secs(1)).await;
    println!("issue in force in both regions after {took:?}");
    // Revoked in region b: refused in a within a second.
    let id = key_id(&config_b, "first");
    let out = keys_cli(&config_b, &["revoke", &id]);
    assert!(out.status.success(), "{out:?}");
    let took = all_reach([&a, &b], &key, 401, Duration::from_secs(1)).await;
    println!("revocation in force in both regions after {took:?}");

    // The global figures: 2 admitted in a, 1 in b, seen from b.
    fresh_minute(Duration::from_secs(20));
    let key = issued(&keys_cli(&config_a, &["issue", "--plan", "roomy"]));
    // Once admitted in each region (401 answers count nothing), then once more in a.
    all_reach([&a, &b], &key, 200, Duration::from_secs(1)).await;
    assert_eq!(answer(&a, &key).await, "ok");
    let status: Value = reqwest::Client::new()
        .get(b.url("/v1/rate_limit"))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let minute = &status["global"]["windows"][0];
    assert_eq!(minute["name"], "minute", "{status}");
    let (granted, here) = (
        minute["granted"].as_u64().unwrap(),
        minute["granted_here"].as_u64().unwrap(),
    );
    assert!(
        (3..=100).contains(&granted) && (1..granted).contains(&here),
        "granted {granted} in all, {here} to b: {status}"
    );
    assert_eq!(status["minute"]["remaining"], 99, "b's own count: {status}");
    let as_of = status["global"]["as_of"].as_u64().unwrap();
    assert!(as_of.abs_diff(unix_now()) <= 2, "{status}");

    // Banned in region a (the limit of 4 spent, then 3 refusals past 2 strikes): refused as
    // banned in b within a second, though b never decided the key.
    let key = issued(&keys_cli(
        &config_a,
        &["issue", "--plan", "small", "--name", "banned"],
    ));
    all_reach([&a], &key, 200, Duration::from_secs(1)).await;
    let mut started = None;
    for _ in 0..20 {
        if answer(&a, &key).await == "api_key_banned" {
            started = Some(Instant::now());
            break;
        }
    }
    let started = started.expect("region a never banned the key");
    loop {
        let code = answer(&b, &key).await;
        if code == "api_key_banned" {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "region b still answers {code} {:?} after the ban in a",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("ban in force in region b after {:?}", started.elapsed());

    // Lifted by region b's admin API: gone from region a's bans within a second or so (read
    // from a's admin API: a request to a would strike again, its minute being full).
    let id = key_id(&config_a, "banned");
    let lift = reqwest::Client::new()
        .post(b.admin_url(&format!("/bans/{id}/lift")))
        .send()
        .await
        .unwrap();
    assert_eq!(lift.status(), 200, "{:?}", lift.text().await);
    let lifted = Instant::now();
    loop {
        let bans = reqwest::get(a.admin_url("/bans"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if !bans.contains(&id) {
            break;
        }
        assert!(
            lifted.elapsed() < Duration::from_millis(1_500),
            "region a still lists the ban lifted in b: {bans}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("lift in force in region a after {:?}", lifted.elapsed());
}
