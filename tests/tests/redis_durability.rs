//! The fleet's Redis as `deploy/redis/redis.conf` ships it, restarted under a running fleet: a
//! restart by SIGTERM keeps every count and every key record; a crash (SIGKILL) loses at most the
//! last second of counts and no record written more than a second before. The gateway nodes
//! connect as the `gateway` ACL user and the `keys` commands as `admin`, with the users
//! `deploy/redis/acl-users` writes, so the shipped permissions are what these tests run on.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use e2e::{gateway_cli, EchoUpstream, Fixture, GatewayProcess, GatewaySpec, ShippedRedis};
use serde_json::Value;

const PREFIX: &str = "pet:test";

/// A node of the fleet: the registry and the quota store in `redis`, as the `gateway` user.
fn node(f: &Fixture, upstream: &EchoUpstream, redis: &ShippedRedis, n: usize) -> GatewayProcess {
    let mut spec = GatewaySpec::new(upstream.addr, &f.dir.path().join("unused.toml"), &f.plans);
    spec.key_prefix = PREFIX.to_owned();
    spec.redis_url = Some(redis.url("gateway"));
    spec.keys_file = f.dir.path().join(format!("node-{n}-keys.toml"));
    spec.extra = "keys_source = \"store\"\nstore_timeout_ms = 500\n".into();
    f.gateway(&spec)
}

/// The operator's config for the `keys` commands: the same registry, as the `admin` user, and
/// `gw`'s admin listener to confirm changes with.
fn operator_config(f: &Fixture, redis: &ShippedRedis, gw: &GatewayProcess) -> PathBuf {
    let path = f.dir.path().join("operator.toml");
    std::fs::write(
        &path,
        format!(
            "environment = \"test\"\nkey_prefix = \"{PREFIX}\"\nkeys_source = \"store\"\n\
             redis_url = \"{}\"\nkeys_file = \"{}\"\nplans_dir = \"{}\"\nadmin_listen = \"{}\"\n",
            redis.url("admin"),
            f.dir.path().join("operator-keys.toml").display(),
            f.plans.display(),
            gw.admin,
        ),
    )
    .unwrap();
    path
}

fn keys(config: &Path, args: &[&str]) -> std::process::Output {
    let mut all = vec!["keys"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--config", config.to_str().unwrap()]);
    gateway_cli(&all)
}

/// Issues a key; returns its id and the key.
fn issue(config: &Path) -> (String, String) {
    let out = keys(config, &["issue", "--plan", "free"]);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let id = stdout
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("issued "))
        .and_then(|l| l.split_whitespace().next())
        .expect("issued <id>")
        .to_owned();
    let key = stdout.lines().last().unwrap().trim().to_owned();
    (id, key)
}

async fn reaches(gw: &GatewayProcess, key: &str, want: u16, within: Duration) {
    let started = Instant::now();
    while gw.status(key).await != want {
        assert!(started.elapsed() < within, "never {want} within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The day's remaining requests of `key`, as `/v1/rate_limit` reads them from Redis; waits
/// while the node's store is still reconnecting (its answer then is not the store's).
async fn day_remaining(gw: &GatewayProcess, key: &str) -> u64 {
    let started = Instant::now();
    loop {
        let resp = reqwest::Client::new()
            .get(gw.url("/v1/rate_limit"))
            .bearer_auth(key)
            .send()
            .await
            .unwrap();
        if resp.status() == 200 && gw.metric("pet_gateway_store_fallback").await == 0.0 {
            let body: Value = resp.json().await.unwrap();
            return body["day"]["remaining"].as_u64().expect("day.remaining");
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no answer from the store"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Decisions Redis ran as the quota function (`FCALL` calls that did not fail): under the
/// shipped ACL the gateway decides by the function, not by the script it falls back to.
fn function_calls(redis: &ShippedRedis) -> u64 {
    let (calls, failed) = e2e::command_calls(&redis.cli(&["INFO", "commandstats"]), "fcall");
    calls - failed
}

fn no_noperm(redis: &ShippedRedis) {
    // The gateway's background writes (the top consumers' flush, once a second) come after
    // the requests: give them a round.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let log = redis.log();
    assert!(
        !log.contains("NOPERM"),
        "Redis refused a command of the shipped users:\n{log}"
    );
    // Refused commands and keys; failed logins are some tests' point.
    let refused = redis.cli(&["ACL", "LOG"]);
    let lines: Vec<&str> = refused.lines().collect();
    let denied = lines
        .windows(2)
        .any(|w| w[0] == "reason" && matches!(w[1], "command" | "key" | "channel"));
    assert!(
        !denied,
        "Redis refused commands of the shipped users (ACL LOG):\n{refused}"
    );
}

/// The reproduction of issue 21: issue A, spend 12, restart Redis, issue B. With the shipped
/// configuration A's day count is still 988, A is still in the registry (so it can be revoked,
/// and the revocation applies), and a node started afterwards knows A and B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_of_the_shipped_redis_keeps_every_count_and_record() {
    let f = Fixture::new(600, 1_000);
    let mut redis = ShippedRedis::start(PREFIX);
    let upstream = EchoUpstream::start();
    let gw = node(&f, &upstream, &redis, 0);
    let operator = operator_config(&f, &redis, &gw);
    let (a_id, a) = issue(&operator);
    // The day's count is compared across the restart: not across midnight UTC.
    e2e::fresh_day(Duration::from_secs(60));
    reaches(&gw, &a, 200, Duration::from_secs(2)).await;
    for _ in 0..11 {
        assert_eq!(gw.status(&a).await, 200);
    }
    assert_eq!(day_remaining(&gw, &a).await, 988);
    assert!(
        function_calls(&redis) >= 11,
        "decided by the function: {} FCALLs",
        function_calls(&redis)
    );

    redis.terminate();
    redis.restart();
    let (_, b) = issue(&operator);
    assert_eq!(day_remaining(&gw, &a).await, 988, "the day count survived");
    assert_eq!(
        redis.cli(&["HEXISTS", &redis.registry_records(), &a_id]),
        "1",
        "A's record survived"
    );

    let out = keys(&operator, &["revoke", &a_id]);
    assert!(out.status.success(), "A can be revoked: {out:?}");
    reaches(&gw, &a, 401, Duration::from_secs(1)).await;
    let later = node(&f, &upstream, &redis, 1);
    reaches(&later, &b, 200, Duration::from_secs(2)).await;
    assert!(
        function_calls(&redis) >= 1,
        "decided by the function after the restart"
    );
    assert_eq!(
        later.status(&a).await,
        401,
        "A is revoked on a new node too"
    );
    assert_eq!(
        gw.metric("pet_gateway_store_errors_total{kind=\"protocol\"}")
            .await,
        0.0,
        "the gateway user may run every command the gateway runs"
    );
    no_noperm(&redis);
}

/// A crash: counts made more than a second before the SIGKILL are kept (the AOF is flushed every
/// second), and so is every record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_of_the_shipped_redis_loses_at_most_the_last_second() {
    let f = Fixture::new(600, 1_000);
    let mut redis = ShippedRedis::start(PREFIX);
    let upstream = EchoUpstream::start();
    let gw = node(&f, &upstream, &redis, 0);
    let operator = operator_config(&f, &redis, &gw);
    let (a_id, a) = issue(&operator);
    // The day's count is compared across the crash: not across midnight UTC.
    e2e::fresh_day(Duration::from_secs(60));
    reaches(&gw, &a, 200, Duration::from_secs(2)).await;
    for _ in 0..19 {
        assert_eq!(gw.status(&a).await, 200);
    }
    assert_eq!(day_remaining(&gw, &a).await, 980);
    // Past the next once-a-second flush, then five more that may be lost.
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    for _ in 0..5 {
        assert_eq!(gw.status(&a).await, 200);
    }
    redis.kill();
    redis.restart();
    let remaining = day_remaining(&gw, &a).await;
    assert!(
        (975..=980).contains(&remaining),
        "at most the last second's 5 lost: {remaining} remaining"
    );
    assert_eq!(
        redis.cli(&["HEXISTS", &redis.registry_records(), &a_id]),
        "1"
    );
    no_noperm(&redis);
}

/// What the shipped ACL users may do: the gateway user runs the fleet's commands on its own
/// prefix and nothing else; it can delete no registry record and flush nothing.
#[test]
fn the_gateway_user_is_confined_to_its_prefix_and_cannot_delete_records() {
    let redis = ShippedRedis::start(PREFIX);
    let records = redis.registry_records();
    redis.cli_as("admin", &["HSET", &records, "k1", "{}"]);
    let gateway = |args: &[&str]| redis.cli_as("gateway", args);
    assert_eq!(
        gateway(&["HGET", &records, "k1"]),
        "{}",
        "reads the registry"
    );
    assert_eq!(gateway(&["SET", "pet:test:windows:{k1}", "x"]), "OK");
    assert_eq!(gateway(&["SET", "pet:test:state:{k1}", "x"]), "OK");
    for refused in [
        vec!["DEL", records.as_str()],
        vec!["HDEL", records.as_str(), "k1"],
        vec!["UNLINK", records.as_str()],
        vec!["FLUSHALL"],
        vec!["KEYS", "*"],
        vec!["CONFIG", "SET", "appendonly", "no"],
        vec!["GET", "pet:other:windows:{k1}"],
        vec!["SET", "pet:test:anything", "x"],
        vec!["HSET", "pet:test:{registry}:meta", "id", "another"],
        vec!["HSET", "pet:test:{registry}:changes", "a", "b"],
        vec![
            "EVAL",
            "return redis.call('DEL', KEYS[1])",
            "1",
            records.as_str(),
        ],
    ] {
        assert!(gateway(&refused).starts_with("NOPERM"), "{refused:?}");
    }
    assert_eq!(redis.cli(&["HEXISTS", &records, "k1"]), "1");
    assert!(redis.cli_as("admin", &["FLUSHALL"]).starts_with("NOPERM"));
}

/// A node that holds the registry's admin credentials changes keys (its admin key API) as that
/// user, apart from its own `gateway` login: with the admin password wrong, changes fail while
/// the node goes on serving; with it right again (read at each connection), they succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_changes_go_through_the_registry_admin_user() {
    let f = Fixture::new(600, 1_000);
    let redis = ShippedRedis::start(PREFIX);
    let upstream = EchoUpstream::start();
    let password_file = f.dir.path().join("registry-admin.password");
    std::fs::write(&password_file, "not-the-password\n").unwrap();
    let mut spec = GatewaySpec::new(upstream.addr, &f.dir.path().join("unused.toml"), &f.plans);
    spec.key_prefix = PREFIX.to_owned();
    spec.redis_url = Some(redis.url("gateway"));
    spec.keys_file = f.dir.path().join("node-keys.toml");
    spec.extra = format!(
        "keys_source = \"store\"\nstore_timeout_ms = 500\nregistry_admin_username = \"admin\"\n\
         registry_admin_password_file = \"{}\"\n",
        password_file.display()
    );
    let gw = f.gateway(&spec);
    let issue = || async {
        reqwest::Client::new()
            .post(gw.admin_url("/keys"))
            .json(&serde_json::json!({"plan": "free"}))
            .send()
            .await
            .unwrap()
    };
    let refused = issue().await;
    assert!(refused.status().is_server_error(), "{}", refused.status());
    assert_eq!(redis.cli(&["HLEN", &redis.registry_records()]), "0");

    std::fs::write(&password_file, format!("{}\n", redis.password("admin"))).unwrap();
    let issued = issue().await;
    assert_eq!(issued.status(), 201);
    let body: Value = issued.json().await.unwrap();
    let key = body["key"].as_str().unwrap().to_owned();
    reaches(&gw, &key, 200, Duration::from_secs(2)).await;
    no_noperm(&redis);
}
