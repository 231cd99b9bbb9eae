//! The fleet-wide key registry (`keys_source = "store"`), end to end: three gateway nodes on
//! one Redis, the real CLI, Redis stopped, a node restarted from its snapshot.

use std::time::{Duration, Instant};

use e2e::{
    all_reach, eventually, issued, keys_cli, EchoUpstream, Fixture, GatewayProcess, GatewaySpec,
    RedisServer,
};
use serde_json::Value;

fn node_spec(
    f: &Fixture,
    upstream: std::net::SocketAddr,
    redis: &RedisServer,
    n: usize,
) -> GatewaySpec {
    let mut spec = f.spec(upstream);
    spec.redis_url = Some(redis.url());
    spec.keys_file = f.dir.path().join(format!("node-{n}-keys.toml"));
    spec.extra = "keys_source = \"store\"\nstore_timeout_ms = 500\n".into();
    spec
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_apply_issues_and_revocations_within_a_second_and_survive_redis_down() {
    let f = Fixture::new(600, 100_000);
    let redis = RedisServer::start();
    let upstream = EchoUpstream::start();
    let specs: Vec<GatewaySpec> = (0..3)
        .map(|n| node_spec(&f, upstream.addr, &redis, n))
        .collect();
    let nodes: Vec<GatewayProcess> = specs.iter().map(|s| f.gateway(s)).collect();
    let config = nodes[0].config.clone();

    let key = issued(&keys_cli(&config, &["issue", "--plan", "free"]));
    let took = all_reach(&nodes, &key, 200, Duration::from_secs(1)).await;
    println!("issue applied on all three nodes after {took:?}");
    let id = {
        let out = keys_cli(&config, &["list", "--json"]);
        assert!(out.status.success(), "{out:?}");
        let list: Value = serde_json::from_slice(&out.stdout).unwrap();
        list[0]["id"].as_str().unwrap().to_owned()
    };
    let keeper = issued(&keys_cli(&config, &["issue", "--plan", "free"]));
    all_reach(&nodes, &keeper, 200, Duration::from_secs(1)).await;

    // The fleet's history: a change made at one node's command line shows on every node.
    let history: Value = reqwest::get(nodes[2].admin_url(&format!("/keys/{id}/audit")))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let actions: Vec<&str> = history["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    assert_eq!(actions, ["issue"], "{history}");
    assert_eq!(history["entries"][0]["key_id"], id.as_str());

    // A token whose checksum fails is refused before any lookup, and costs the store nothing.
    let scripts = |r: &RedisServer| -> u64 {
        r.cli(&["INFO", "commandstats"])
            .lines()
            .filter(|l| {
                ["cmdstat_evalsha:", "cmdstat_eval:", "cmdstat_fcall:"]
                    .iter()
                    .any(|c| l.starts_with(c))
            })
            .filter_map(|l| {
                l.split("calls=")
                    .nth(1)?
                    .split(',')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .sum()
    };
    let before = scripts(&redis);
    let mut typo = keeper.clone().into_bytes();
    let i = "pet_test_".len() + 2;
    typo[i] = if typo[i] == b'q' { b'r' } else { b'q' };
    let resp = reqwest::Client::new()
        .get(nodes[0].url("/v1/pets"))
        .bearer_auth(String::from_utf8(typo).unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    let body: Value = resp.json().await.unwrap();
    assert!(
        body["message"].as_str().unwrap().contains("checksum"),
        "{body}"
    );
    assert_eq!(scripts(&redis), before, "no store call for a malformed key");

    let out = keys_cli(&config, &["revoke", &id]);
    assert!(out.status.success(), "{out:?}");
    let took = all_reach(&nodes, &key, 401, Duration::from_secs(1)).await;
    println!("revocation applied on all three nodes after {took:?}");
    // Each node's snapshot holds the registry's records.
    for spec in &specs {
        let snapshot = std::fs::read_to_string(&spec.keys_file).unwrap();
        assert!(
            snapshot.contains(&id) && snapshot.contains("revoked_at"),
            "{snapshot}"
        );
    }

    // Redis down: authentication never waited on it, the replica answers.
    let mut nodes = nodes;
    redis.process.kill_hard();
    for gw in &nodes {
        assert_eq!(gw.status(&keeper).await, 200);
        assert_eq!(gw.status(&key).await, 401);
    }
    // A node restarted while Redis is down starts from its snapshot, and says so.
    let restarted = nodes.pop().unwrap();
    drop(restarted);
    let again = f.gateway(&specs[2]);
    assert_eq!(again.status(&keeper).await, 200);
    assert_eq!(again.status(&key).await, 401);
    let ready: Value = reqwest::get(again.admin_url("/readyz"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        ready["checks"]["keys"]
            .as_str()
            .unwrap()
            .starts_with("snapshot"),
        "{ready}"
    );
}

/// No snapshot and no Redis: the node does not become ready. A keys file imports into the
/// registry idempotently.
#[tokio::test]
async fn import_round_trips_a_keys_file_and_a_node_without_snapshot_or_redis_is_not_ready() {
    let f = Fixture::new(600, 100_000);
    let a = f.issue("free");
    f.issue("free");
    let redis = RedisServer::start();
    let upstream = EchoUpstream::start();
    let spec = node_spec(&f, upstream.addr, &redis, 0);
    let gw = f.gateway(&spec);
    let config = gw.config.clone();
    for _ in 0..2 {
        let out = keys_cli(&config, &["import", "--from", f.keys.to_str().unwrap()]);
        assert!(out.status.success(), "{out:?}");
    }
    let out = keys_cli(&config, &["list", "--json"]);
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        list.as_array().unwrap().len(),
        2,
        "imported once, whatever the runs"
    );
    let mut file: Vec<String> = std::fs::read_to_string(&f.keys)
        .unwrap()
        .lines()
        .filter_map(|l| {
            l.strip_prefix("id = \"")
                .map(|v| v.trim_end_matches('"').to_owned())
        })
        .collect();
    let mut imported: Vec<String> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["id"].as_str().unwrap().to_owned())
        .collect();
    file.sort();
    imported.sort();
    assert_eq!(file, imported, "the same records");
    let started = Instant::now();
    while gw.status(&a).await != 200 {
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "imported keys never applied"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    drop(redis);
    let mut lonely = node_spec(&f, upstream.addr, &RedisServer::start(), 9);
    lonely.redis_url = Some(format!("redis://{}/", e2e::free_addr()));
    let node = f.gateway(&lonely);
    let resp = reqwest::get(node.admin_url("/readyz")).await.unwrap();
    assert_eq!(resp.status(), 503);
    let ready: Value = resp.json().await.unwrap();
    assert!(
        ready["checks"]["keys"]
            .as_str()
            .unwrap()
            .contains("no snapshot"),
        "{ready}"
    );
}

/// A registry that holds fewer records than a node already has (never imported, flushed,
/// evicted, another prefix) never wipes the node's keys: records are never deleted, so that is
/// data loss, and the node writes the records it holds back into the registry (counted and
/// logged), from where a node without them takes them.
#[tokio::test]
async fn an_empty_registry_never_wipes_a_nodes_keys_and_is_healed_from_them() {
    let f = Fixture::new(600, 100_000);
    let key = f.issue("free");
    let redis = RedisServer::start();
    let upstream = EchoUpstream::start();
    // The node's snapshot is the old keys file; nothing was imported into the registry.
    let mut spec = node_spec(&f, upstream.addr, &redis, 0);
    spec.keys_file = f.keys.clone();
    let gw = f.gateway(&spec);
    let started = Instant::now();
    while redis.cli(&["HLEN", "pet:test:{registry}:keys"]) != "1" {
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "never written back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(gw.status(&key).await, 200, "the keys were kept");
    // Counted and logged after the write-back, once the node's snapshot is saved and reloaded.
    gw.metric_reaches(
        "pet_gateway_registry_repairs_total",
        1.0,
        Duration::from_secs(5),
    )
    .await;
    eventually(Duration::from_secs(5), "the write-back logged", || {
        gw.log_text().contains("wrote back")
    })
    .await;
    assert!(
        std::fs::read_to_string(&f.keys).unwrap().contains("sha256"),
        "snapshot intact"
    );
    // A node that never had the key takes it from the healed registry.
    let fresh = f.gateway(&node_spec(&f, upstream.addr, &redis, 1));
    all_reach([&fresh], &key, 200, Duration::from_secs(2)).await;
    // Ready all along ("repairing: …" while it wrote back), in step once the registry is whole.
    let started = Instant::now();
    loop {
        let resp = reqwest::get(gw.admin_url("/readyz")).await.unwrap();
        assert_eq!(resp.status(), 200);
        let ready: Value = resp.json().await.unwrap();
        if ready["checks"]["keys"] == "registry" {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(1), "{ready}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(gw.metric("pet_gateway_registry_in_step").await, 1.0);
}

/// The key lifecycle on a fleet: a key's own limits and expiry, a rotation sharing one quota
/// across nodes, usage as `keys show` reports it, and reset-usage, on three nodes sharing one
/// registry and one quota store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_lifecycle_holds_across_three_nodes() {
    let f = Fixture::new(600, 100_000);
    let redis = RedisServer::start();
    let upstream = EchoUpstream::start();
    let specs: Vec<GatewaySpec> = (0..3)
        .map(|n| node_spec(&f, upstream.addr, &redis, n))
        .collect();
    let nodes: Vec<GatewayProcess> = specs.iter().map(|s| f.gateway(s)).collect();
    let config = nodes[0].config.clone();
    e2e::fresh_minute(Duration::from_secs(20));

    let key = issued(&keys_cli(
        &config,
        &[
            "issue",
            "--plan",
            "free",
            "--per-minute",
            "5",
            "--expires-in",
            "8s",
        ],
    ));
    let issued_at = Instant::now();
    all_reach(&nodes, &key, 200, Duration::from_secs(1)).await;
    // One quota for the fleet, with the key's own limit: 5, one used by all_reach per node.
    let resp = reqwest::Client::new()
        .get(nodes[1].url("/v1/pets"))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-ratelimit-limit"], "5");
    assert_eq!(resp.headers()["x-ratelimit-remaining"], "1");
    let id = {
        let out = keys_cli(&config, &["list", "--json"]);
        let list: Value = serde_json::from_slice(&out.stdout).unwrap();
        list[0]["id"].as_str().unwrap().to_owned()
    };
    // keys show, asked of node 0, counts the requests sent to all three.
    let out = keys_cli(&config, &["show", "--json", &id]);
    let shown: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["usage"]["minute"], 4, "{shown}");

    // reset-usage frees the quota; a rotation's successor shares it on every node.
    let out = keys_cli(&config, &["reset-usage", &id]);
    assert!(out.status.success(), "{out:?}");
    let successor = issued(&keys_cli(&config, &["rotate", "--overlap", "1h", &id]));
    all_reach(&nodes, &successor, 200, Duration::from_secs(1)).await; // 3 of 5
    assert_eq!(nodes[2].status(&successor).await, 200); // 4
    assert_eq!(
        nodes[1].status(&key).await,
        200,
        "the old key, in its overlap"
    ); // 5
    assert_eq!(
        nodes[0].status(&successor).await,
        429,
        "5 in all, across keys and nodes"
    );

    // Expiry: the first key stops on every node at its expiry (its successor inherits it too).
    while issued_at.elapsed() < Duration::from_secs(9) {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for gw in &nodes {
        assert_eq!(gw.status(&key).await, 401);
    }
}

/// A node that follows the registry stops at once with no grace period: the sync's worker
/// thread is stopped when the runtime drops its service, which the runtime's end does before
/// it waits for blocking threads (up to `shutdown_timeout_secs`). With the stop left to the
/// service's own code, which that drop can cut short, the node waited out the whole timeout.
#[test]
fn a_node_following_the_registry_stops_at_once_with_no_grace_period() {
    let f = Fixture::new(600, 100_000);
    let redis = RedisServer::start();
    let upstream = EchoUpstream::start();
    let mut spec = node_spec(&f, upstream.addr, &redis, 0);
    spec.extra += "grace_period_secs = 0\nshutdown_timeout_secs = 30\n";
    let node = f.gateway(&spec);
    let started = Instant::now();
    let (code, log) = node.stop();
    assert_eq!(code, Some(0), "{log}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "stopped after {:?}, not at once:\n{log}",
        started.elapsed()
    );
}
