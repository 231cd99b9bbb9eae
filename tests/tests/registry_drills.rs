//! Fault drills on the key registry (`keys_source = "store"`), with real `redis-server` and
//! gateway processes: Redis restarted without persistence or flushed (the nodes heal it), a
//! forged record and a replayed older one written with `redis-cli` (refused on every node, also
//! by a node restarted afterwards), and Redis unreachable for 30 s.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use e2e::{
    all_reach, eventually, gateway_cli, keys_cli, EchoUpstream, Fixture, GatewayProcess,
    GatewaySpec, RedisServer,
};
use serde_json::Value;

const RECORDS: &str = "pet:test:{registry}:keys";
const FEED: &str = "pet:test:{registry}:changes";
const META: &str = "pet:test:{registry}:meta";

/// A node on `redis`'s registry; `trust` is more TOML (verify keys, signing key).
fn node_spec(
    f: &Fixture,
    upstream: &EchoUpstream,
    redis: &RedisServer,
    n: usize,
    trust: &str,
) -> GatewaySpec {
    let mut spec = f.spec(upstream.addr);
    spec.redis_url = Some(redis.url());
    spec.keys_file = f.dir.path().join(format!("node-{n}-keys.toml"));
    spec.extra = format!("keys_source = \"store\"\nstore_timeout_ms = 500\n{trust}");
    spec
}

/// Issues a key on `plan`; its id and the key.
fn issue(config: &Path, plan: &str) -> (String, String) {
    let out = keys_cli(config, &["issue", "--plan", plan]);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let id = stdout
        .split_whitespace()
        .nth(1)
        .expect("issued <id>")
        .to_owned();
    (id, stdout.lines().last().unwrap().trim().to_owned())
}

/// A fleet signing key: its private key file, and the TOML that makes a node verify with its
/// public key and sign with it.
fn signing_key(f: &Fixture) -> (PathBuf, String) {
    let path = f.dir.path().join("fleet.key");
    let out = gateway_cli(&["registry", "keygen", "--out", path.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let public = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(public.starts_with("ed25519:"), "{public}");
    let again = gateway_cli(&["registry", "keygen", "--out", path.to_str().unwrap()]);
    assert!(!again.status.success(), "keygen never overwrites a key");
    let trust = format!(
        "registry_verify_keys = [\"{public}\"]\nregistry_signing_key_file = \"{}\"\n",
        path.display()
    );
    (path, trust)
}

/// Writes `json` as `id`'s record and announces it on the feed, as anyone with write access to
/// Redis could.
fn write_record(redis: &RedisServer, id: &str, json: &str) {
    redis.cli(&["HSET", RECORDS, id, json]);
    redis.cli(&["XADD", FEED, "*", "id", id]);
}

/// A key of a forger's own making: a valid key and its record (from a keys file of their own),
/// written into the registry unsigned, on plan `enterprise`. Returns its id and the key.
fn mint_into(f: &Fixture, redis: &RedisServer) -> (String, String) {
    let mint = f.dir.path().join("minted.toml");
    let minted = e2e::issue_key(&mint, &f.plans, "enterprise");
    let text = std::fs::read_to_string(&mint).unwrap();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} = \"")))
            .map(|v| v.trim_end_matches('"').to_owned())
            .unwrap()
    };
    let forged = serde_json::json!({
        "id": field("id"), "plan": "enterprise", "sha256": field("sha256"),
        "created_at": field("created_at"), "version": 1,
    });
    write_record(redis, &field("id"), &forged.to_string());
    (field("id"), minted)
}

/// Redis restarted without persistence under a running fleet: within 2 s of it accepting
/// connections every record is back (written back by the nodes), a key issued before can be
/// revoked and its revocation applies on every node within 1 s, and a node started afterwards
/// knows the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_without_persistence_is_healed_by_the_nodes() {
    let f = Fixture::new(600, 100_000);
    let redis = RedisServer::start();
    let upstream = EchoUpstream::start();
    let a = f.gateway(&node_spec(&f, &upstream, &redis, 0, ""));
    let b = f.gateway(&node_spec(&f, &upstream, &redis, 1, ""));
    let (a_id, key_a) = issue(&a.config, "free");
    let (_, key_b) = issue(&a.config, "free");
    all_reach([&a, &b], &key_b, 200, Duration::from_secs(2)).await;
    // The nodes name the registry once they hold records of it.
    eventually(Duration::from_secs(1), "an identity", || {
        redis.cli(&["HGET", META, "id"]).len() == 32
    })
    .await;
    let identity = redis.cli(&["HGET", META, "id"]);
    // Every node remembers it, in its snapshot.
    eventually(
        Duration::from_secs(2),
        "both nodes remember the identity",
        || {
            (0..2).all(|n| {
                std::fs::read_to_string(f.dir.path().join(format!("node-{n}-keys.toml")))
                    .unwrap_or_default()
                    .contains(&identity)
            })
        },
    )
    .await;
    assert_eq!(
        identity.len(),
        32,
        "the registry has an identity: {identity}"
    );

    let addr = redis.addr;
    drop(redis);
    let redis = RedisServer::start_at(addr);
    // A key issued at once, before the nodes noticed: the writer gives the empty registry no
    // identity of its own, so the nodes still heal it, under the one they remember.
    let (_, key_c) = issue(&a.config, "free");
    eventually(Duration::from_secs(2), "every record back", || {
        redis.cli(&["HLEN", RECORDS]) == "3"
    })
    .await;
    all_reach([&a, &b], &key_c, 200, Duration::from_secs(2)).await;
    assert_eq!(
        redis.cli(&["HGET", META, "id"]),
        identity,
        "the same registry"
    );
    let repairs = a.metric("pet_gateway_registry_repairs_total").await
        + b.metric("pet_gateway_registry_repairs_total").await;
    assert!(repairs >= 2.0, "{repairs}");
    assert!(
        a.log_text().contains("wrote back") || b.log_text().contains("wrote back"),
        "the repair is logged"
    );

    let later = f.gateway(&node_spec(&f, &upstream, &redis, 2, ""));
    all_reach([&later], &key_a, 200, Duration::from_secs(2)).await;
    let out = keys_cli(&a.config, &["revoke", &a_id]);
    assert!(out.status.success(), "A can be revoked: {out:?}");
    all_reach([&a, &b, &later], &key_a, 401, Duration::from_secs(1)).await;
    assert_eq!(later.status(&key_b).await, 200);
}

/// Signed records: a replayed older record (A before its revocation) is refused by every node
/// and by a node restarted afterwards, and the nodes put the newer one back; `FLUSHALL` is
/// healed like a restart, signatures and all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_older_record_is_refused_and_a_flush_is_healed() {
    let f = Fixture::new(600, 100_000);
    let (_, trust) = signing_key(&f);
    let redis = RedisServer::start();
    let upstream = EchoUpstream::start();
    let specs: Vec<GatewaySpec> = (0..2)
        .map(|n| node_spec(&f, &upstream, &redis, n, &trust))
        .collect();
    let a = f.gateway(&specs[0]);
    let b = f.gateway(&specs[1]);
    let (a_id, key_a) = issue(&a.config, "free");
    all_reach([&a, &b], &key_a, 200, Duration::from_secs(2)).await;
    let before_revocation = redis.cli(&["HGET", RECORDS, &a_id]);
    assert!(
        before_revocation.contains("\"signature\":\"ed25519:"),
        "{before_revocation}"
    );
    let out = keys_cli(&a.config, &["revoke", &a_id]);
    assert!(out.status.success(), "{out:?}");
    all_reach([&a, &b], &key_a, 401, Duration::from_secs(1)).await;

    write_record(&redis, &a_id, &before_revocation);
    eventually(
        Duration::from_secs(2),
        "the newer record written back",
        || redis.cli(&["HGET", RECORDS, &a_id]).contains("revoked_at"),
    )
    .await;
    let older = "pet_gateway_registry_rejected_records_total{reason=\"older\"}";
    // The first node to read the replay refuses it and writes the newer one back; a node that
    // reads the feed after that finds the newer one already.
    assert!(a.metric(older).await + b.metric(older).await >= 1.0);
    for gw in [&a, &b] {
        assert_eq!(
            gw.status(&key_a).await,
            401,
            "the replay undid no revocation"
        );
    }
    // Replayed again while a node is down: the restarted node remembers the version it held.
    drop(b);
    write_record(&redis, &a_id, &before_revocation);
    let b = f.gateway(&specs[1]);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(b.status(&key_a).await, 401, "refused after a restart too");

    let identity = redis.cli(&["HGET", META, "id"]);
    redis.cli(&["FLUSHALL"]);
    eventually(Duration::from_secs(2), "healed after FLUSHALL", || {
        redis.cli(&["HGET", RECORDS, &a_id]).contains("revoked_at")
            && redis.cli(&["HGET", META, "id"]) == identity
    })
    .await;
    let (_, key_c) = issue(&a.config, "free");
    all_reach([&a, &b], &key_c, 200, Duration::from_secs(2)).await;
}

/// With verify keys, write access to Redis alone mints no key and upgrades no plan: a record of
/// the writer's own making (unsigned) and a signed record with its plan changed are refused on
/// every node, also after a restart; the version in force stays. A node that can verify but not
/// sign answers the admin API's key changes with 409 naming the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_records_are_refused_on_every_node() {
    let f = Fixture::new(50, 100_000);
    e2e::write_plan(&f.plans, "enterprise", 1_000, 1_000_000);
    let (_, trust) = signing_key(&f);
    let redis = RedisServer::start();
    let upstream = EchoUpstream::start();
    let verify_only: String = trust.lines().next().unwrap().to_owned() + "\n";
    let a = f.gateway(&node_spec(&f, &upstream, &redis, 0, &trust));
    let b = f.gateway(&node_spec(&f, &upstream, &redis, 1, &verify_only));
    let (a_id, key_a) = issue(&a.config, "free");
    all_reach([&a, &b], &key_a, 200, Duration::from_secs(2)).await;

    // A key of the forger's own making: a valid key and its record, from a keys file.
    let (_, minted) = mint_into(&f, &redis);
    // A's record with its plan raised and its version too, signature kept.
    let mut upgraded: Value = serde_json::from_str(&redis.cli(&["HGET", RECORDS, &a_id])).unwrap();
    upgraded["plan"] = "enterprise".into();
    upgraded["version"] = (upgraded["version"].as_u64().unwrap() + 1).into();
    write_record(&redis, &a_id, &upgraded.to_string());

    for gw in [&a, &b] {
        let unsigned = "pet_gateway_registry_rejected_records_total{reason=\"unsigned\"}";
        let started = Instant::now();
        while gw.metric(unsigned).await < 1.0 {
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "the minted record taken"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(gw.status(&minted).await, 401, "no key minted");
        let resp = reqwest::Client::new()
            .get(gw.url("/v1/pets"))
            .bearer_auth(&key_a)
            .send()
            .await
            .unwrap();
        assert_eq!(
            resp.headers()["x-ratelimit-limit"],
            "50",
            "A is still on its plan"
        );
    }
    // The first node to read the raised record refuses it and writes the signed one back.
    let bad = "pet_gateway_registry_rejected_records_total{reason=\"bad_signature\"}";
    assert!(a.metric(bad).await + b.metric(bad).await >= 1.0);
    eventually(
        Duration::from_secs(2),
        "A's signed record written back",
        || {
            redis
                .cli(&["HGET", RECORDS, &a_id])
                .contains("\"plan\":\"free\"")
        },
    )
    .await;
    drop(b);
    let b = f.gateway(&node_spec(&f, &upstream, &redis, 1, &verify_only));
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(b.status(&minted).await, 401, "refused after a restart too");

    let refused = reqwest::Client::new()
        .post(b.admin_url("/keys"))
        .json(&serde_json::json!({"plan": "free"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 409);
    let body: Value = refused.json().await.unwrap();
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("registry_signing_key_file"),
        "{body}"
    );
    assert_eq!(redis.cli(&["HLEN", RECORDS]), "2", "no half-done change");
}

/// Redis unreachable (stopped) for 30 s under traffic: requests go on (`on_store_error`), and
/// once it answers again counting resumes from where it was and a key change reaches every node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_unreachable_for_30_seconds_and_back() {
    let f = Fixture::new(600, 100_000);
    let redis = RedisServer::start();
    let upstream = EchoUpstream::start();
    let a = f.gateway(&node_spec(&f, &upstream, &redis, 0, ""));
    let b = f.gateway(&node_spec(&f, &upstream, &redis, 1, ""));
    let (_, key) = issue(&a.config, "free");
    // The day's count is compared before and after 30 s of outage: not across midnight UTC.
    e2e::fresh_day(Duration::from_secs(90));
    all_reach([&a, &b], &key, 200, Duration::from_secs(2)).await;
    for _ in 0..9 {
        assert_eq!(a.status(&key).await, 200);
    }
    let day = |gw: &GatewayProcess| {
        let (gw, key) = (gw.url("/v1/rate_limit"), key.clone());
        async move {
            let resp = reqwest::Client::new()
                .get(gw)
                .bearer_auth(key)
                .send()
                .await
                .unwrap();
            let body: Value = resp.json().await.unwrap();
            body["day"]["remaining"].as_u64().unwrap()
        }
    };
    let before = day(&a).await;
    assert!(before <= 99_991, "{before}");

    redis.process.signal(19); // SIGSTOP: connections hang, as behind a dead network
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_secs(30) {
        for gw in [&a, &b] {
            assert_eq!(gw.status(&key).await, 200, "requests go on");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    redis.process.signal(18); // SIGCONT
    let started = Instant::now();
    while a.metric("pet_gateway_store_fallback").await != 0.0 {
        assert_eq!(a.status(&key).await, 200);
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the store never came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let remaining = day(&a).await;
    assert!(
        remaining <= 99_990,
        "counting went on from where it was, not from zero: {remaining}"
    );
    let (_, fresh) = issue(&a.config, "free");
    all_reach([&a, &b], &fresh, 200, Duration::from_secs(2)).await;
}

/// Review findings, as drills with verify keys: a record rolled back by hand (without a feed
/// entry) before a revocation cannot make the revocation reuse a version the nodes hold; a
/// spoofed registry identity does not stop a signed revocation from applying; `registry sign`
/// signs no record that fails verification.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollbacks_spoofed_identities_and_forged_records_do_not_stop_a_revocation() {
    let f = Fixture::new(600, 100_000);
    e2e::write_plan(&f.plans, "enterprise", 1_000, 1_000_000);
    let (_, trust) = signing_key(&f);
    let redis = RedisServer::start();
    let upstream = EchoUpstream::start();
    let a = f.gateway(&node_spec(&f, &upstream, &redis, 0, &trust));
    let (id, key) = issue(&a.config, "free");
    all_reach([&a], &key, 200, Duration::from_secs(2)).await;
    let first = redis.cli(&["HGET", RECORDS, &id]);
    let out = keys_cli(&a.config, &["rotate", &id, "--overlap", "1h"]);
    assert!(out.status.success(), "{out:?}");
    let snapshot = f.dir.path().join("node-0-keys.toml");
    eventually(
        Duration::from_secs(2),
        "the node holds the rotation",
        || {
            std::fs::read_to_string(&snapshot)
                .unwrap_or_default()
                .contains("rotated_to")
        },
    )
    .await;
    // Rolled back by hand, no feed entry: the next change must still be newer than the
    // rotation every node holds.
    redis.cli(&["HSET", RECORDS, &id, &first]);
    let out = keys_cli(&a.config, &["revoke", &id]);
    assert!(out.status.success(), "{out:?}");
    all_reach([&a], &key, 401, Duration::from_secs(1)).await;

    // Another identity, written by hand: a later signed change still applies.
    let (id2, key2) = issue(&a.config, "free");
    all_reach([&a], &key2, 200, Duration::from_secs(2)).await;
    redis.cli(&["HSET", META, "id", "0123456789abcdef0123456789abcdef"]);
    let out = keys_cli(&a.config, &["revoke", &id2]);
    assert!(out.status.success(), "{out:?}");
    all_reach([&a], &key2, 401, Duration::from_secs(2)).await;

    // A minted record is never signed by `registry sign` once the fleet verifies.
    let (minted_id, minted) = mint_into(&f, &redis);
    let out = gateway_cli(&["registry", "sign", "--config", a.config.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains(&minted_id),
        "{out:?}"
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(a.status(&minted).await, 401);
}

/// A feed whose last id was exhausted by hand (`XADD` with the largest id): the nodes do not
/// reload over and over, key changes fail loudly, and once the operator deletes the feed they
/// work again and reach the nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_feed_neither_spins_the_nodes_nor_hides_a_change() {
    let f = Fixture::new(600, 100_000);
    let redis = RedisServer::start();
    let upstream = EchoUpstream::start();
    let a = f.gateway(&node_spec(&f, &upstream, &redis, 0, ""));
    let (id, key) = issue(&a.config, "free");
    all_reach([&a], &key, 200, Duration::from_secs(2)).await;
    redis.cli(&[
        "XADD",
        FEED,
        "18446744073709551615-18446744073709551615",
        "id",
        "x",
    ]);
    tokio::time::sleep(Duration::from_millis(600)).await;
    let reloads = |gw: &GatewayProcess| gw.log_text().matches("reloaded part=\"keys\"").count();
    let before = reloads(&a);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(reloads(&a) <= before + 1, "the node reloads over and over");
    let out = keys_cli(&a.config, &["revoke", &id]);
    assert!(!out.status.success(), "{out:?}");
    assert_eq!(a.status(&key).await, 200, "no half-done change");
    redis.cli(&["DEL", FEED]);
    let out = keys_cli(&a.config, &["revoke", &id]);
    assert!(out.status.success(), "{out:?}");
    all_reach([&a], &key, 401, Duration::from_secs(2)).await;
}

/// The readiness check of a node's keys (`/readyz` → `checks.keys`).
/// How many records `gw` refused for `reason`; 0 before the first (a labelled counter appears
/// only once counted).
async fn refused(gw: &GatewayProcess, reason: &str) -> f64 {
    let series = format!("pet_gateway_registry_rejected_records_total{{reason=\"{reason}\"}} ");
    let text = reqwest::get(gw.admin_url("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(&series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

async fn keys_check(gw: &GatewayProcess) -> String {
    let ready: Value = reqwest::get(gw.admin_url("/readyz"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    ready["checks"]["keys"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// `POST /reload` on a node: what it answers.
async fn reload(gw: &GatewayProcess) -> Value {
    reqwest::Client::new()
        .post(gw.admin_url("/reload"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// A full disk under a node's snapshot: a revocation and a new key still apply (served from
/// memory), the node says so (`/readyz`, a metric, the log); once there is room again the
/// snapshot is written with them, so the node restarted with Redis gone serves them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_under_the_snapshot_holds_back_no_change() {
    let f = Fixture::new(600, 100_000);
    let disk = e2e::SmallDisk::mount(&f.dir.path().join("disk"), 1 << 20);
    let redis = RedisServer::start();
    let upstream = EchoUpstream::start();
    let mut spec = node_spec(&f, &upstream, &redis, 0, "");
    spec.keys_file = disk.path.join("keys.toml");
    let snapshot = || std::fs::read_to_string(disk.path.join("keys.toml")).unwrap_or_default();
    let a = f.gateway(&spec);
    let (a_id, key_a) = issue(&a.config, "free");
    all_reach([&a], &key_a, 200, Duration::from_secs(2)).await;
    eventually(Duration::from_secs(2), "A in the snapshot", || {
        snapshot().contains(&a_id)
    })
    .await;

    disk.fill();
    let out = keys_cli(&a.config, &["revoke", &a_id]);
    assert!(out.status.success(), "{out:?}");
    let (b_id, key_b) = issue(&a.config, "free");
    all_reach([&a], &key_a, 401, Duration::from_secs(2)).await;
    all_reach([&a], &key_b, 200, Duration::from_secs(2)).await;
    assert!(!snapshot().contains(&b_id), "the disk really is full");
    assert_eq!(a.metric("pet_gateway_registry_snapshot_unsaved").await, 1.0);
    let check = keys_check(&a).await;
    assert!(check.contains("cannot be written"), "{check}");
    assert!(a.log_text().contains("cannot write this node's snapshot"));
    // A forced reload (what SIGHUP does) reads no stale file meanwhile.
    let reloaded = reload(&a).await;
    assert_eq!(reloaded["keys_unsaved"], true, "{reloaded}");
    assert_eq!(a.status(&key_a).await, 401, "still revoked after a reload");

    disk.free();
    // Tried again after 1, 2, 4, 8 s...: well within 20 s of the room coming back.
    eventually(
        Duration::from_secs(20),
        "the snapshot written again",
        || snapshot().contains(&b_id),
    )
    .await;
    let started = Instant::now();
    while a.metric("pet_gateway_registry_snapshot_unsaved").await != 0.0 {
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the metric clears"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let check = keys_check(&a).await;
    assert!(!check.contains("cannot be written"), "{check}");
    // Served from the file again: a reload says so, and the file holds what memory held.
    let reloaded = reload(&a).await;
    assert_eq!(reloaded["keys_unsaved"], false, "{reloaded}");
    assert_eq!(a.status(&key_a).await, 401, "still revoked, from the file");
    assert_eq!(a.status(&key_b).await, 200);

    drop(a);
    drop(redis);
    let again = f.gateway(&spec);
    all_reach([&again], &key_a, 401, Duration::from_secs(2)).await;
    all_reach([&again], &key_b, 200, Duration::from_secs(2)).await;
}

/// A revoked key's older signed record put back into the hash without a feed entry (a Redis
/// writer's replay, invisible to the feed, the identity and the record count): the running
/// nodes, comparing the whole registry every `registry_compare_interval_secs`, refuse it and
/// write the revocation back within the period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_without_a_feed_entry_is_caught_by_the_running_nodes_within_a_period() {
    let f = Fixture::new(600, 100_000);
    let (_, trust) = signing_key(&f);
    let trust = format!("{trust}registry_compare_interval_secs = 1\n");
    let redis = RedisServer::start();
    let upstream = EchoUpstream::start();
    let a = f.gateway(&node_spec(&f, &upstream, &redis, 0, &trust));
    let b = f.gateway(&node_spec(&f, &upstream, &redis, 1, &trust));
    let (a_id, key_a) = issue(&a.config, "free");
    all_reach([&a, &b], &key_a, 200, Duration::from_secs(2)).await;
    let before_revocation = redis.cli(&["HGET", RECORDS, &a_id]);
    let out = keys_cli(&a.config, &["revoke", &a_id]);
    assert!(out.status.success(), "{out:?}");
    // Set-up, not the promise under test (gateway_registry holds the second a change takes):
    // with a comparison every second beside three other tests, a node took longer than 1 s.
    all_reach([&a, &b], &key_a, 401, Duration::from_secs(3)).await;

    let feed = redis.cli(&["XLEN", FEED]);
    redis.cli(&["HSET", RECORDS, &a_id, &before_revocation]);
    eventually(
        Duration::from_secs(3),
        "the revocation written back within the comparison period",
        || redis.cli(&["HGET", RECORDS, &a_id]).contains("revoked_at"),
    )
    .await;
    assert_ne!(
        redis.cli(&["XLEN", FEED]),
        feed,
        "the write-back is on the feed"
    );
    // The first node to compare refuses the replay and writes the revocation back; the other
    // may find it written back already.
    assert!(refused(&a, "replayed").await + refused(&b, "replayed").await >= 1.0);
    for gw in [&a, &b] {
        assert_eq!(
            gw.status(&key_a).await,
            401,
            "the replay undid no revocation"
        );
    }
}

/// The same replay, with no node running to write the revocation back: a node started later
/// without a snapshot refuses the replayed record (401, not 200), because the change feed
/// names a newer version of it, and counts it; another key is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_started_without_a_snapshot_refuses_a_record_put_back_older() {
    replayed_to_a_fresh_node(false).await;
}

/// The same, with the feed emptied first (`XADD … MAXLEN 0`, which the `gateway` ACL user may
/// send, as it may write the record back): the floors the registry's writer keeps still name
/// the revocation's version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_behind_an_emptied_feed_is_refused_by_the_writers_floors() {
    replayed_to_a_fresh_node(true).await;
}

async fn replayed_to_a_fresh_node(empty_the_feed: bool) {
    let f = Fixture::new(600, 100_000);
    let (_, trust) = signing_key(&f);
    let redis = RedisServer::start();
    let upstream = EchoUpstream::start();
    let a = f.gateway(&node_spec(&f, &upstream, &redis, 0, &trust));
    let (a_id, key_a) = issue(&a.config, "free");
    let (_, key_b) = issue(&a.config, "free");
    all_reach([&a], &key_a, 200, Duration::from_secs(2)).await;
    let before_revocation = redis.cli(&["HGET", RECORDS, &a_id]);
    let out = keys_cli(&a.config, &["revoke", &a_id]);
    assert!(out.status.success(), "{out:?}");
    all_reach([&a], &key_a, 401, Duration::from_secs(1)).await;
    drop(a);

    if empty_the_feed {
        redis.cli(&["XADD", FEED, "MAXLEN", "0", "*", "id", "emptied"]);
        assert_eq!(redis.cli(&["XLEN", FEED]).trim(), "0");
    }
    redis.cli(&["HSET", RECORDS, &a_id, &before_revocation]);
    let fresh = f.gateway(&node_spec(&f, &upstream, &redis, 1, &trust));
    all_reach([&fresh], &key_b, 200, Duration::from_secs(2)).await;
    assert_eq!(
        fresh.status(&key_a).await,
        401,
        "a fresh node took the replayed record"
    );
    let replayed = "pet_gateway_registry_rejected_records_total{reason=\"replayed\"}";
    assert!(fresh.metric(replayed).await >= 1.0);
}

/// A feed entry naming a version far above a key's (the `gateway` ACL user may append to the
/// feed, within the day's horizon) denies nothing: the writer's floor, which only `admin`
/// writes, says which version the registry held, and a node started without a snapshot serves
/// the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_feed_entry_planted_above_the_writers_floor_denies_no_fresh_node() {
    let f = Fixture::new(600, 100_000);
    let (_, trust) = signing_key(&f);
    let redis = RedisServer::start();
    let upstream = EchoUpstream::start();
    let a = f.gateway(&node_spec(&f, &upstream, &redis, 0, &trust));
    let (a_id, key_a) = issue(&a.config, "free");
    all_reach([&a], &key_a, 200, Duration::from_secs(2)).await;
    drop(a);

    let record: Value = serde_json::from_str(&redis.cli(&["HGET", RECORDS, &a_id])).unwrap();
    let planted = record["version"].as_u64().unwrap() + 3_600_000;
    redis.cli(&[
        "XADD",
        FEED,
        "*",
        "id",
        &a_id,
        "version",
        &planted.to_string(),
    ]);
    let fresh = f.gateway(&node_spec(&f, &upstream, &redis, 1, &trust));
    all_reach([&fresh], &key_a, 200, Duration::from_secs(2)).await;
    let replayed = "pet_gateway_registry_rejected_records_total{reason=\"replayed\"}";
    assert_eq!(fresh.metric(replayed).await, 0.0);
}

/// A comparison that keeps failing (here `HSCAN` refused, as an ACL file from before the paged
/// read refuses it) stops no revocation: the node goes on following the feed from where it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_comparison_leaves_the_feed_followed() {
    let f = Fixture::new(600, 100_000);
    let (_, trust) = signing_key(&f);
    let trust = format!("{trust}registry_compare_interval_secs = 1\n");
    let redis = RedisServer::start();
    let upstream = EchoUpstream::start();
    let user = [
        "ACL",
        "SETUSER",
        "node",
        "on",
        ">node-password",
        "~*",
        "&*",
        "+@all",
    ];
    assert_eq!(redis.cli(&user), "OK");
    let mut spec = node_spec(&f, &upstream, &redis, 0, &trust);
    spec.redis_url = Some(format!("redis://node:node-password@{}/", redis.addr));
    // The operator's commands log in as the default user, which keeps HSCAN; the key (and the
    // registry's identity) come before the node, so the node is in step before HSCAN goes.
    let operator =
        e2e::write_gateway_config(f.dir.path(), &node_spec(&f, &upstream, &redis, 1, &trust));
    let (a_id, key_a) = issue(&operator, "free");
    let a = f.gateway(&spec);
    all_reach([&a], &key_a, 200, Duration::from_secs(2)).await;
    let (_, key_b) = issue(&operator, "free");
    all_reach([&a], &key_b, 200, Duration::from_secs(2)).await;

    assert_eq!(redis.cli(&["ACL", "SETUSER", "node", "-hscan"]), "OK");
    // Two periods: at least one comparison has failed.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let out = keys_cli(&operator, &["revoke", &a_id]);
    assert!(out.status.success(), "{out:?}");
    all_reach([&a], &key_a, 401, Duration::from_secs(2)).await;
}

/// Signatures bound to the environment: with one signing key for staging and production, a
/// record signed for staging and copied into production's registry is refused there. An
/// unbound (older) record is served while `registry_signature_binding` is `sign`, refused once
/// it is `require` (by the node restarted from its snapshot too), and served again after
/// `registry sign` re-signs it bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_signed_for_staging_is_refused_in_production_and_unbound_ones_until_required() {
    let f = Fixture::new(600, 100_000);
    let (_, trust) = signing_key(&f);
    let redis = RedisServer::start();
    let upstream = EchoUpstream::start();
    let mut staging = node_spec(
        &f,
        &upstream,
        &redis,
        0,
        &format!("{trust}registry_signature_binding = \"sign\"\n"),
    );
    staging.environment = "staging".into();
    staging.key_prefix = "pet:staging".into();
    let mut production = node_spec(
        &f,
        &upstream,
        &redis,
        1,
        &format!("{trust}registry_signature_binding = \"sign\"\n"),
    );
    production.environment = "prod".into();
    let s = f.gateway(&staging);
    let p = f.gateway(&production);

    // A staging key, its record copied into production's registry (with a feed entry).
    let (s_id, key_s) = issue(&s.config, "free");
    all_reach([&s], &key_s, 200, Duration::from_secs(2)).await;
    let copied = redis.cli(&["HGET", "pet:staging:{registry}:keys", &s_id]);
    assert!(
        copied.contains("\"signature\":\"ed25519-bound:"),
        "{copied}"
    );
    write_record(&redis, &s_id, &copied);
    let bad = "pet_gateway_registry_rejected_records_total{reason=\"bad_signature\"}";
    let started = Instant::now();
    while p.metric(bad).await < 1.0 {
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the copy refused"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        p.status(&key_s).await,
        401,
        "a staging record in production"
    );

    // An unbound record, as a writer from before binding signs it: served during the roll.
    let out = keys_cli(
        &p.config,
        &[
            "issue",
            "--plan",
            "free",
            "--registry-signature-binding",
            "off",
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let old_id = stdout.split_whitespace().nth(1).unwrap().to_owned();
    let key_old = stdout.lines().last().unwrap().trim().to_owned();
    assert!(redis
        .cli(&["HGET", RECORDS, &old_id])
        .contains("\"signature\":\"ed25519:"));
    all_reach([&p], &key_old, 200, Duration::from_secs(2)).await;

    // Binding required: refused, by the node restarted from its own snapshot too.
    drop(p);
    let mut required = production.clone();
    required.extra = required
        .extra
        .replace("binding = \"sign\"", "binding = \"require\"");
    let p = f.gateway(&required);
    all_reach([&p], &key_old, 401, Duration::from_secs(2)).await;
    let unbound = "pet_gateway_registry_rejected_records_total{reason=\"unbound\"}";
    assert!(p.metric(unbound).await >= 1.0);

    // Re-signed bound: served again.
    let out = gateway_cli(&["registry", "sign", "--config", p.config.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains(&old_id));
    assert!(redis
        .cli(&["HGET", RECORDS, &old_id])
        .contains("\"signature\":\"ed25519-bound:"));
    all_reach([&p], &key_old, 200, Duration::from_secs(2)).await;
    assert_eq!(p.status(&key_s).await, 401, "re-signing took no copy");
}
