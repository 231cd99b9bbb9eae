//! Redis as production runs it, end to end with real processes: TLS with a CA made by the
//! `openssl` command (and client certificates), ACL users and passwords (in the URL, in a
//! variable, in a file rotated while the gateway runs), a primary with a replica behind
//! `redis-sentinel` failing over while requests flow, and the settings that cannot work
//! refused at start-up, naming the setting and never the secret.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::{
    bin_path, free_addr, gateway_cli, tls_settings, write_gateway_config, EchoUpstream, Fixture,
    GatewayProcess, GatewaySpec, OpensslCa, RedisSentinel, RedisServer,
};

const GW_PASSWORD: &str = "gw-Secret-4711";
const ADMIN_PASSWORD: &str = "admin-Secret-0815";
const SENTINEL_PASSWORD: &str = "sentinel-Secret-2342";
/// The users every data node of these tests has: `default` (the tests' own `redis-cli`, and
/// replication) and `gateway`.
const USERS: &[&str] = &[
    "--user",
    "default",
    "on",
    ">admin-Secret-0815",
    "~*",
    "&*",
    "+@all",
    "--user",
    "gateway",
    "on",
    ">gw-Secret-4711",
    "~*",
    "&*",
    "+@all",
];
const ADMIN_CLI: &[&str] = &["--user", "default", "--pass", ADMIN_PASSWORD];

/// Script runs this Redis has served (the gateway's decisions and probes): how a test sees that
/// decisions reach it, and not the local fallback.
fn script_calls(r: &RedisServer) -> u64 {
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
}

async fn get(gw: &GatewayProcess, key: &str) -> u16 {
    reqwest::Client::new()
        .get(gw.url("/v1/pets"))
        .bearer_auth(key)
        .send()
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

/// Sends requests (each must be admitted) until `redis` has run more scripts than `before`,
/// within `within`; returns how long that took.
async fn decisions_reach(
    gw: &GatewayProcess,
    key: &str,
    redis: &RedisServer,
    before: u64,
    within: Duration,
) -> Duration {
    let started = Instant::now();
    loop {
        assert_eq!(get(gw, key).await, 200, "a request failed");
        if script_calls(redis) > before {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < within,
            "decisions did not reach Redis {} within {within:?}; the gateway's log:\n{}",
            redis.addr,
            gw.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// No password of these tests in `text` (a log, an error).
fn assert_no_secret(text: &str) {
    for secret in [
        GW_PASSWORD,
        ADMIN_PASSWORD,
        SENTINEL_PASSWORD,
        "wrong-Secret-1234",
    ] {
        assert!(!text.contains(secret), "a password is printed:\n{text}");
    }
}

fn refused(f: &Fixture, spec: &GatewaySpec, names: &[&str]) -> String {
    let (code, log) = GatewayProcess::start_refused(f.dir.path(), spec);
    assert!(code.is_some_and(|c| c != 0), "exit {code:?}: {log}");
    for name in names {
        assert!(log.contains(name), "the error does not name {name}:\n{log}");
    }
    assert_no_secret(&log);
    log
}

/// `pet-gateway ARGS --config CONFIG` with `env`, to completion.
fn gateway_with_env(
    args: &[&str],
    config: &Path,
    env: &[(String, String)],
) -> std::process::Output {
    Command::new(bin_path("pet-gateway"))
        .args(args)
        .arg("--config")
        .arg(config)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null())
        .output()
        .expect("run pet-gateway")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_a_test_ca_and_a_client_certificate_decides_in_redis() {
    let f = Fixture::new(1000, 100_000);
    let key = f.issue("free");
    let upstream = EchoUpstream::start();
    let ca = OpensslCa::new(f.dir.path(), "redis");
    let (server_cert, server_key) = ca.issue("redis-server");
    let (client_cert, client_key) = ca.issue("gateway");
    let addr = free_addr();
    let tls = tls_settings(addr, &ca.cert, &server_cert, &server_key, "yes");
    let cli = [
        "--tls",
        "--cacert",
        &path(&ca.cert),
        "--cert",
        &path(&client_cert),
        "--key",
        &path(&client_key),
    ];
    let redis = RedisServer::start_custom(addr, &refs(&tls), &cli);

    let mut spec = f.spec(upstream.addr);
    spec.redis_url = Some(format!("rediss://127.0.0.1:{}/0", addr.port()));
    let ca_line = format!("redis_tls_ca_file = \"{}\"\n", path(&ca.cert));
    spec.extra = format!(
        "{ca_line}redis_tls_cert_file = \"{}\"\nredis_tls_key_file = \"{}\"\n",
        path(&client_cert),
        path(&client_key)
    );
    let gw = f.gateway(&spec);
    let took = decisions_reach(&gw, &key, &redis, 0, Duration::from_secs(5)).await;
    println!("decisions reach the TLS Redis after {took:?}");
    assert!(gw.log_text().contains("Redis answers"), "{}", gw.log_text());
    drop(gw);

    // Redis wants a client certificate and the gateway has none: no start.
    spec.extra = ca_line;
    refused(&f, &spec, &["TLS", "redis_tls_cert_file"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_or_missing_ca_stops_the_start_and_check_naming_the_setting() {
    let f = Fixture::new(1000, 100_000);
    let upstream = EchoUpstream::start();
    let ca = OpensslCa::new(f.dir.path(), "redis");
    let other = OpensslCa::new(f.dir.path(), "other");
    let (server_cert, server_key) = ca.issue("redis-server");
    let addr = free_addr();
    let tls = tls_settings(addr, &ca.cert, &server_cert, &server_key, "no");
    let _redis =
        RedisServer::start_custom(addr, &refs(&tls), &["--tls", "--cacert", &path(&ca.cert)]);

    let mut spec = f.spec(upstream.addr);
    spec.redis_url = Some(format!("rediss://127.0.0.1:{}/0", addr.port()));
    spec.extra = format!("redis_tls_ca_file = \"{}\"\n", path(&other.cert));
    refused(&f, &spec, &["redis_tls_ca_file", "does not verify"]);
    let config = write_gateway_config(f.dir.path(), &spec);
    let out = gateway_cli(&["check", "--config", &path(&config)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("redis_tls_ca_file"),
        "{out:?}"
    );

    // Without a CA the system's roots are asked, and they do not know the test CA.
    spec.extra = String::new();
    refused(&f, &spec, &["redis_tls_ca_file", "system"]);
    // A CA file that is not there is named before anything is sent.
    spec.extra = "redis_tls_ca_file = \"/nonexistent/ca.pem\"\n".to_owned();
    refused(
        &f,
        &spec,
        &["redis_tls_ca_file", "/nonexistent/ca.pem", "cannot read"],
    );
    // A plain URL to the TLS port: the TLS settings do not apply to it.
    spec.redis_url = Some(format!("redis://127.0.0.1:{}/0", addr.port()));
    spec.extra = format!("redis_tls_ca_file = \"{}\"\n", path(&ca.cert));
    refused(&f, &spec, &["redis_tls_ca_file", "rediss://"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acl_user_logs_in_by_url_variable_or_file_and_a_wrong_password_is_refused_unprinted() {
    let f = Fixture::new(1000, 100_000);
    let key = f.issue("free");
    let upstream = EchoUpstream::start();
    let redis = RedisServer::start_custom(free_addr(), USERS, ADMIN_CLI);
    let port = redis.addr.port();
    let password_file = f.dir.path().join("redis-password");
    std::fs::write(&password_file, format!("{GW_PASSWORD}\n")).unwrap();

    let mut by_url = f.spec(upstream.addr);
    by_url.redis_url = Some(format!("redis://gateway:{GW_PASSWORD}@127.0.0.1:{port}/0"));
    let mut by_file = f.spec(upstream.addr);
    by_file.redis_url = Some(format!("redis://127.0.0.1:{port}/0"));
    by_file.extra = format!(
        "redis_username = \"gateway\"\nredis_password_file = \"{}\"\n",
        path(&password_file)
    );
    let mut by_env = f.spec(upstream.addr);
    by_env.redis_url = by_file.redis_url.clone();
    by_env.extra = "redis_username = \"gateway\"\n".to_owned();
    by_env.env = vec![("PET_GATEWAY_REDIS_PASSWORD".into(), GW_PASSWORD.into())];
    for spec in [&by_url, &by_file, &by_env] {
        let gw = f.gateway(spec);
        let before = script_calls(&redis);
        decisions_reach(&gw, &key, &redis, before, Duration::from_secs(5)).await;
        let clients = redis.cli(&["CLIENT", "LIST"]);
        assert!(clients.contains("user=gateway"), "{clients}");
        assert_no_secret(&gw.log_text());
        // `check` logs in the same way, and its report shows no password.
        let out = gateway_with_env(&["check"], &gw.config, &spec.env);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("redis: redis://127.0.0.1"),
            "{out:?}"
        );
        assert!(stdout.contains(" answers"), "{stdout}");
        assert_no_secret(&stdout);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_missing_or_flag_given_redis_password_stops_the_start_unprinted() {
    let f = Fixture::new(1000, 100_000);
    let upstream = EchoUpstream::start();
    let redis = RedisServer::start_custom(free_addr(), USERS, ADMIN_CLI);
    let port = redis.addr.port();
    let mut by_file = f.spec(upstream.addr);
    by_file.redis_url = Some(format!("redis://127.0.0.1:{port}/0"));

    // A wrong password: no start, naming where the password came from, printing neither.
    let wrong = f.dir.path().join("wrong-password");
    std::fs::write(&wrong, "wrong-Secret-1234\n").unwrap();
    let mut spec = by_file.clone();
    spec.extra = format!(
        "redis_username = \"gateway\"\nredis_password_file = \"{}\"\n",
        path(&wrong)
    );
    refused(
        &f,
        &spec,
        &["authentication failed", "redis_password_file", "gateway"],
    );
    let config = write_gateway_config(f.dir.path(), &spec);
    let out = gateway_cli(&["check", "--config", &path(&config)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("redis_password_file"),
        "{out:?}"
    );
    assert_no_secret(&stderr);
    // No password at all, while Redis wants one.
    let mut spec = by_file.clone();
    spec.extra = String::new();
    refused(
        &f,
        &spec,
        &["authentication failed", "PET_GATEWAY_REDIS_PASSWORD"],
    );

    // A password on the command line shows in `ps`: refused before anything else.
    let url = format!("redis://gateway:{GW_PASSWORD}@127.0.0.1:{port}/0");
    let out = gateway_cli(&["serve", "--redis-url", &url]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("--redis-url") && stderr.contains("`ps`"),
        "{out:?}"
    );
    assert_no_secret(&stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_rotated_in_its_file_and_in_redis_is_taken_at_the_next_reconnect() {
    let f = Fixture::new(100_000, 10_000_000);
    let key = f.issue("free");
    let upstream = EchoUpstream::start();
    let redis = RedisServer::start_custom(free_addr(), USERS, ADMIN_CLI);
    let password_file = f.dir.path().join("redis-password");
    std::fs::write(&password_file, GW_PASSWORD).unwrap();
    let mut spec = f.spec(upstream.addr);
    spec.redis_url = Some(format!("redis://127.0.0.1:{}/0", redis.addr.port()));
    spec.extra = format!(
        "redis_username = \"gateway\"\nredis_password_file = \"{}\"\n",
        path(&password_file)
    );
    let gw = f.gateway(&spec);
    decisions_reach(&gw, &key, &redis, 0, Duration::from_secs(5)).await;

    // The operator's rotation: the new password in the file, then in Redis; existing
    // connections end (as at a Redis restart or a network blip).
    let rotated = "gw-Rotated-9999";
    std::fs::write(&password_file, format!("{rotated}\n")).unwrap();
    redis.cli(&[
        "ACL",
        "SETUSER",
        "gateway",
        "resetpass",
        &format!(">{rotated}"),
    ]);
    redis.cli(&["CLIENT", "KILL", "USER", "gateway"]);
    let before = script_calls(&redis);
    let took = decisions_reach(&gw, &key, &redis, before, Duration::from_secs(10)).await;
    println!("decisions reach Redis again {took:?} after the rotation");
    let log = gw.log_text();
    assert_no_secret(&log);
    assert!(!log.contains(rotated), "{log}");
}

/// A primary and its replica (both with the `USERS`), and one Sentinel with a password of its
/// own and a `gateway` user allowed only the lookup; quick failure detection.
struct SentinelSetup {
    primary: RedisServer,
    replica: RedisServer,
    sentinel: RedisSentinel,
}

const SENTINEL_USER: &str =
    "user gateway on >sentinel-Secret-2342 -@all +auth +sentinel|get-master-addr-by-name";

fn sentinel_setup(dir: &Path) -> SentinelSetup {
    let primary_addr = free_addr();
    // Each in a directory of the test's: a replica writes the primary's snapshot to disk.
    let (primary_dir, replica_dir) = (dir.join("primary"), dir.join("replica"));
    std::fs::create_dir_all(&primary_dir).unwrap();
    std::fs::create_dir_all(&replica_dir).unwrap();
    let (primary_dir, replica_dir) = (path(&primary_dir), path(&replica_dir));
    let mut primary_args = USERS.to_vec();
    primary_args.extend(["--repl-diskless-sync-delay", "0"]);
    primary_args.extend(["--masterauth", ADMIN_PASSWORD, "--dir", &primary_dir]);
    let primary = RedisServer::start_custom(primary_addr, &primary_args, ADMIN_CLI);
    let port = primary_addr.port().to_string();
    let mut replica_args = USERS.to_vec();
    replica_args.extend(["--replicaof", "127.0.0.1", &port]);
    replica_args.extend(["--masterauth", ADMIN_PASSWORD, "--dir", &replica_dir]);
    let replica = RedisServer::start_custom(free_addr(), &replica_args, ADMIN_CLI);
    let started = Instant::now();
    while !replica
        .cli(&["INFO", "replication"])
        .contains("master_link_status:up")
    {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the replica never synced"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let config = format!(
        "sentinel monitor mymaster 127.0.0.1 {port} 1\n\
         sentinel auth-pass mymaster {ADMIN_PASSWORD}\n\
         sentinel down-after-milliseconds mymaster 1000\n\
         sentinel failover-timeout mymaster 10000\n\
         requirepass {SENTINEL_PASSWORD}\n{SENTINEL_USER}\n"
    );
    let sentinel = RedisSentinel::start(dir, free_addr(), &config, &["-a", SENTINEL_PASSWORD]);
    // The Sentinel learns of the replica from the primary's INFO.
    let started = Instant::now();
    while !sentinel
        .cli(&["SENTINEL", "REPLICAS", "mymaster"])
        .contains(&replica.addr.port().to_string())
    {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the Sentinel never saw the replica"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    SentinelSetup {
        primary,
        replica,
        sentinel,
    }
}

/// A gateway spec on `s`'s Sentinels (a dead one listed first), as the `gateway` users of the
/// data nodes and of the Sentinel, with the registry in Redis.
fn sentinel_spec(f: &Fixture, upstream: SocketAddr, sentinel: &RedisSentinel) -> GatewaySpec {
    let password_file = f.dir.path().join("redis-password");
    std::fs::write(&password_file, GW_PASSWORD).unwrap();
    let mut spec = f.spec(upstream);
    spec.redis_url = Some(format!(
        "redis+sentinel://{},{}/mymaster",
        free_addr(),
        sentinel.addr
    ));
    spec.keys_file = f.dir.path().join("node-keys.toml");
    spec.extra = format!(
        "keys_source = \"store\"\nredis_username = \"gateway\"\nredis_password_file = \"{}\"\n\
         redis_sentinel_username = \"gateway\"\n",
        path(&password_file)
    );
    spec.env = vec![(
        "PET_GATEWAY_REDIS_SENTINEL_PASSWORD".into(),
        SENTINEL_PASSWORD.into(),
    )];
    spec
}

fn issue_through(config: &Path, spec: &GatewaySpec) -> String {
    let out = gateway_with_env(&["keys", "issue", "--plan", "free"], config, &spec.env);
    assert!(out.status.success(), "{out:?}");
    assert_no_secret(&String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap()
        .trim()
        .to_owned()
}

async fn accepted_within(gw: &GatewayProcess, key: &str, within: Duration) -> Duration {
    let started = Instant::now();
    while get(gw, key).await != 200 {
        assert!(
            started.elapsed() < within,
            "the key was not accepted within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    started.elapsed()
}

/// Requests in a loop on two workers until stopped; returns every status.
fn stream(
    gw: &GatewayProcess,
    key: &str,
) -> (Arc<AtomicBool>, Vec<tokio::task::JoinHandle<Vec<u16>>>) {
    let stop = Arc::new(AtomicBool::new(false));
    let workers = (0..2)
        .map(|_| {
            let (url, key, stop) = (gw.url("/v1/pets"), key.to_owned(), Arc::clone(&stop));
            tokio::spawn(async move {
                let client = reqwest::Client::new();
                let mut seen = Vec::new();
                while !stop.load(Ordering::Relaxed) && seen.len() < 50_000 {
                    let status = client.get(&url).bearer_auth(&key).send().await;
                    seen.push(status.map(|r| r.status().as_u16()).unwrap_or(0));
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                seen
            })
        })
        .collect();
    (stop, workers)
}

async fn all_admitted(stop: Arc<AtomicBool>, workers: Vec<tokio::task::JoinHandle<Vec<u16>>>) {
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.unwrap());
    }
    let failed = all.iter().filter(|s| **s != 200).count();
    assert!(all.len() > 50, "traffic flowed: {} requests", all.len());
    assert_eq!(failed, 0, "{failed} of {} requests failed", all.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_under_load_fails_no_request_and_decisions_and_the_registry_follow() {
    let f = Fixture::new(100_000, 10_000_000);
    let upstream = EchoUpstream::start();
    let SentinelSetup {
        primary,
        replica,
        sentinel,
    } = sentinel_setup(f.dir.path());
    let spec = sentinel_spec(&f, upstream.addr, &sentinel);
    let gw = f.gateway(&spec);
    let key = issue_through(&gw.config, &spec);
    accepted_within(&gw, &key, Duration::from_secs(3)).await;
    decisions_reach(&gw, &key, &primary, 0, Duration::from_secs(5)).await;

    let (stop, workers) = stream(&gw, &key);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let killed = Instant::now();
    primary.process.kill_hard();
    let replica_addr = replica.addr;
    let sentinel = tokio::task::spawn_blocking(move || {
        sentinel.wait_master("mymaster", replica_addr, Duration::from_secs(20));
        sentinel
    })
    .await
    .unwrap();
    let promoted = Instant::now();
    println!(
        "the Sentinel promoted the replica {:?} after the kill",
        killed.elapsed()
    );
    let before = script_calls(&replica);
    let took = decisions_reach(&gw, &key, &replica, before, Duration::from_secs(10)).await;
    println!("decisions reach the promoted replica {took:?} after its promotion");
    assert!(promoted.elapsed() < Duration::from_secs(10));
    all_admitted(stop, workers).await;

    // The registry follows too: a key issued now (through the Sentinels, on the new primary)
    // reaches the node.
    let second = issue_through(&gw.config, &spec);
    let took = accepted_within(&gw, &second, Duration::from_secs(5)).await;
    println!("a key issued after the failover applies after {took:?}");
    assert_no_secret(&gw.log_text());
    drop(sentinel);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_that_leaves_the_old_primary_up_is_followed_within_seconds() {
    let f = Fixture::new(100_000, 10_000_000);
    let key = f.issue("free");
    let upstream = EchoUpstream::start();
    let s = sentinel_setup(f.dir.path());
    let mut spec = sentinel_spec(&f, upstream.addr, &s.sentinel);
    spec.keys_file = f.keys.clone();
    spec.extra = spec.extra.replace("keys_source = \"store\"\n", "");
    let gw = f.gateway(&spec);
    decisions_reach(&gw, &key, &s.primary, 0, Duration::from_secs(5)).await;

    let (stop, workers) = stream(&gw, &key);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The old primary stays up, taking writes until the Sentinel demotes it (seconds later):
    // the gateway must not wait for that, whatever it counts there is lost.
    s.sentinel.cli(&["SENTINEL", "FAILOVER", "mymaster"]);
    let replica = s.replica.addr;
    let sentinel = s.sentinel;
    let sentinel = tokio::task::spawn_blocking(move || {
        sentinel.wait_master("mymaster", replica, Duration::from_secs(20));
        sentinel
    })
    .await
    .unwrap();
    let before = script_calls(&s.replica);
    let took = decisions_reach(&gw, &key, &s.replica, before, Duration::from_secs(10)).await;
    println!("decisions reach the promoted replica {took:?} after its promotion");
    assert!(took < Duration::from_secs(3), "{took:?}");
    // And no longer the old primary.
    let on_old = script_calls(&s.primary);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        script_calls(&s.primary),
        on_old,
        "decisions still go to the old primary"
    );
    all_admitted(stop, workers).await;
    drop(sentinel);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_sentinel_finds_a_tls_primary_through_a_tls_sentinel() {
    let f = Fixture::new(1000, 100_000);
    let key = f.issue("free");
    let upstream = EchoUpstream::start();
    let ca = OpensslCa::new(f.dir.path(), "redis");
    let (cert, cert_key) = ca.issue("redis-node");
    let addr = free_addr();
    let tls = tls_settings(addr, &ca.cert, &cert, &cert_key, "no");
    let tls_cli = ["--tls", "--cacert", &path(&ca.cert)];
    let primary = RedisServer::start_custom(addr, &refs(&tls), &tls_cli);
    let sentinel_addr = free_addr();
    let config = format!(
        "port 0\ntls-port {}\ntls-cert-file {}\ntls-key-file {}\ntls-ca-cert-file {}\n\
         tls-auth-clients no\ntls-replication yes\nsentinel monitor tlsmaster 127.0.0.1 {} 1\n",
        sentinel_addr.port(),
        path(&cert),
        path(&cert_key),
        path(&ca.cert),
        addr.port()
    );
    let sentinel = RedisSentinel::start(f.dir.path(), sentinel_addr, &config, &tls_cli);
    assert_eq!(sentinel.master_addr("tlsmaster"), Some(addr));

    let mut spec = f.spec(upstream.addr);
    spec.redis_url = Some(format!("rediss+sentinel://{sentinel_addr}/tlsmaster"));
    spec.extra = format!("redis_tls_ca_file = \"{}\"\n", path(&ca.cert));
    let gw = f.gateway(&spec);
    decisions_reach(&gw, &key, &primary, 0, Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_no_sentinel_knows_or_a_wrong_sentinel_password_stops_the_start() {
    let f = Fixture::new(1000, 100_000);
    let upstream = EchoUpstream::start();
    let s = sentinel_setup(f.dir.path());
    let good = sentinel_spec(&f, upstream.addr, &s.sentinel);

    let mut spec = good.clone();
    spec.redis_url = Some(format!("redis+sentinel://{}/nosuchmaster", s.sentinel.addr));
    refused(&f, &spec, &["redis_url", "nosuchmaster", "no Sentinel"]);
    let config = write_gateway_config(f.dir.path(), &spec);
    let out = gateway_with_env(&["check"], &config, &spec.env);
    assert!(!out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("nosuchmaster"),
        "{out:?}"
    );

    let mut spec = good.clone();
    spec.env = vec![(
        "PET_GATEWAY_REDIS_SENTINEL_PASSWORD".into(),
        "wrong-Secret-1234".into(),
    )];
    refused(
        &f,
        &spec,
        &[
            "Sentinel",
            "authentication failed",
            "PET_GATEWAY_REDIS_SENTINEL_PASSWORD",
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_or_sentinels_merely_unreachable_at_start_up_do_not_stop_the_gateway() {
    let f = Fixture::new(1000, 100_000);
    let key = f.issue("free");
    let upstream = EchoUpstream::start();
    for url in [
        format!("redis://{}/0", free_addr()),
        format!("redis+sentinel://{},{}/mymaster", free_addr(), free_addr()),
    ] {
        let mut spec = f.spec(upstream.addr);
        spec.redis_url = Some(url.clone());
        let gw = f.gateway(&spec);
        // on_store_error = local decides meanwhile.
        assert_eq!(get(&gw, &key).await, 200, "{url}");
        let log = gw.log_text();
        assert!(log.contains("unreachable at start-up"), "{url}: {log}");
        let out = gateway_cli(&["check", "--config", &path(&gw.config)]);
        assert!(out.status.success(), "{url}: {out:?}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains("redis: does not answer from here"),
            "{out:?}"
        );
    }
}

#[test]
fn the_shipped_sentinel_conf_runs_and_lets_the_gateway_user_only_ask_for_the_primary() {
    let shipped =
        std::fs::read_to_string(e2e::repo_root().join("deploy/redis/sentinel.conf")).unwrap();
    // Where it listens and keeps its state are the host's; the rest is as shipped.
    let config: Vec<&str> = shipped
        .lines()
        .filter(|l| !["port ", "bind ", "dir "].iter().any(|p| l.starts_with(p)))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let gateway = ["--user", "gateway", "--pass", "CHANGE-ME-gateway"];
    let sentinel = RedisSentinel::start(dir.path(), free_addr(), &config.join("\n"), &gateway);
    assert_eq!(
        sentinel.cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", "pet-redis"]),
        "10.0.0.11\n6379"
    );
    let masters = sentinel.cli(&["SENTINEL", "MASTERS"]);
    assert!(masters.contains("NOPERM"), "{masters}");
    let out = e2e::redis_cli()
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &sentinel.addr.port().to_string(),
            "PING",
        ])
        .output()
        .unwrap();
    let anonymous = String::from_utf8_lossy(&out.stdout);
    assert!(
        anonymous.contains("NOAUTH"),
        "the default user is off: {anonymous}"
    );
}
