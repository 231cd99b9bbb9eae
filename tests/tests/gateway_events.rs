//! Usage events end to end (issue 24): real `pet-gateway`, `pet-backend` and `redis-server`
//! processes on loopback; the metering file read back as the billing job would.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use e2e::{
    burst, first_key_id, fresh_minute, Fixture, GatewayProcess, GatewaySpec, Process, RedisServer,
};
use serde_json::Value;

/// A folder of the fixture's for metering files, made.
fn metering_folder(f: &Fixture) -> PathBuf {
    let folder = f.dir.path().join("metering");
    std::fs::create_dir(&folder).unwrap();
    folder
}

/// A gateway in front of `upstream` writing its events to `folder/metering.ndjson`; `more` is
/// further TOML (top-level keys first, then tables).
fn metered(f: &Fixture, upstream: SocketAddr, folder: &Path, more: &str) -> GatewaySpec {
    let mut spec = f.spec(upstream);
    spec.extra = format!(
        "metering_file = \"{}\"\n{more}",
        folder.join("metering.ndjson").display()
    );
    spec
}

/// Three nodes n1, n2, n3 on `redis`, metering into `folder`, stopping at once, with a store
/// deadline a burst cannot miss (a node deciding without its store admits past the limit,
/// unmetered), and a ban after `strikes` refusals.
fn three_nodes(
    f: &Fixture,
    upstream: SocketAddr,
    redis: &RedisServer,
    folder: &Path,
    strikes: u64,
) -> Vec<GatewayProcess> {
    ["n1", "n2", "n3"]
        .iter()
        .map(|node| {
            let more = format!(
                "node_id = \"{node}\"\ngrace_period_secs = 0\nstore_timeout_ms = 2000\n\
                 [ban]\nstrikes = {strikes}\n"
            );
            let mut spec = metered(f, upstream, folder, &more);
            spec.redis_url = Some(redis.url());
            f.gateway(&spec)
        })
        .collect()
}

/// Every event in the metering files of `dir` (`<base>.YYYY-MM-DD`).
fn events(dir: &Path) -> Vec<Value> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("metering folder") {
        let path = entry.expect("entry").path();
        if !path.to_string_lossy().contains("metering.ndjson.") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("metering file");
        for line in text.lines() {
            out.push(serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")));
        }
    }
    out
}

/// Stops a gateway by SIGTERM and waits for it to exit 0.
fn stop(gateway: GatewayProcess) {
    let (code, text) = gateway.stop();
    assert_eq!(code, Some(0), "the gateway stops cleanly; its log:\n{text}");
}

/// The store's own count of `key`'s quota in this minute, as `GET /v1/rate_limit` reads it.
async fn minute_counted(gateway: &GatewayProcess, key: &str) -> u64 {
    let status = gateway.rate_limit(key).await;
    let minute = &status["minute"];
    minute["limit"].as_u64().unwrap() - minute["remaining"].as_u64().unwrap()
}

fn sum(events: &[Value], key_id: &str, field: &str) -> u64 {
    events
        .iter()
        .filter(|e| e["type"] == "pet.usage.v1" && e["data"]["key_id"] == key_id)
        .map(|e| e["data"][field].as_u64().expect("a count"))
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_events_carry_what_was_admitted_and_refused_and_a_stop_writes_them() {
    let f = Fixture::new(5, 1_000);
    let key = f.issue("free");
    let key_id = first_key_id(&f.keys);
    let backend = f.backend();
    let metering = metering_folder(&f);
    let spec = metered(
        &f,
        backend.addr,
        &metering,
        "node_id = \"node-a\"\ngrace_period_secs = 0\n",
    );
    let gateway = f.gateway(&spec);
    fresh_minute(Duration::from_secs(10));
    let mut statuses = Vec::new();
    for _ in 0..8 {
        statuses.push(gateway.status(&key).await);
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        5,
        "{statuses:?}"
    );
    assert!(events(&metering).is_empty(), "the minute is still open");
    stop(gateway);

    let got = events(&metering);
    assert!(!got.is_empty(), "a stop writes the open minute");
    assert_eq!(sum(&got, &key_id, "admitted"), 5);
    assert_eq!(sum(&got, &key_id, "cost"), 5);
    assert_eq!(sum(&got, &key_id, "refused"), 3);
    let e = &got[0];
    assert_eq!(e["specversion"], "1.0");
    assert_eq!(e["source"], "pet-gateway/test/node-a");
    assert_eq!(e["datacontenttype"], "application/json");
    assert_eq!(e["data"]["plan"], "free");
    assert_eq!(e["data"]["operation"], "listPets");
    assert!(e["data"]["minute"].as_str().unwrap().ends_with(":00Z"));
    let mut ids: Vec<&str> = got.iter().map(|e| e["id"].as_str().unwrap()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), got.len(), "every event has its own id");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_usage_adds_up_to_the_stores_count() {
    let f = Fixture::new(40, 1_000);
    let key = f.issue("free");
    let key_id = first_key_id(&f.keys);
    let backend = f.backend();
    let redis = RedisServer::start();
    let metering = metering_folder(&f);
    let gateways = three_nodes(&f, backend.addr, &redis, &metering, 1_000_000);
    fresh_minute(Duration::from_secs(15));
    let counts = burst(&gateways, &key, 120).await;
    if counts.get(&200).copied() != Some(40) {
        let logs: Vec<String> = gateways.iter().map(|g| g.log_text()).collect();
        panic!(
            "{counts:?} with a limit of 40; the nodes' logs:\n{}",
            logs.join("\n---\n")
        );
    }
    let counted = minute_counted(&gateways[0], &key).await;
    for g in gateways {
        stop(g);
    }
    let got = events(&metering);
    let sources: std::collections::HashSet<&str> =
        got.iter().map(|e| e["source"].as_str().unwrap()).collect();
    assert!(
        sources.len() >= 2,
        "events from the nodes that served: {sources:?}"
    );
    assert_eq!(sum(&got, &key_id, "cost"), counted);
    assert_eq!(sum(&got, &key_id, "admitted"), 40);
    assert_eq!(sum(&got, &key_id, "refused"), 80);
}

/// Two keys of one customer, driven at once from three nodes: they spend one quota, and the
/// sum of every node's events for the customer is the store's count of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_usage_of_a_customer_adds_up_to_the_stores_count() {
    let f = Fixture::new(40, 1_000);
    let issue = || f.issue_with("free", &["--customer", "acme"]).1;
    let (one, two) = (issue(), issue());
    let backend = f.backend();
    let redis = RedisServer::start();
    let metering = metering_folder(&f);
    let gateways = three_nodes(&f, backend.addr, &redis, &metering, 1_000_000);
    fresh_minute(Duration::from_secs(15));
    let (a, b) = tokio::join!(burst(&gateways, &one, 60), burst(&gateways, &two, 60));
    let admitted = a.get(&200).copied().unwrap_or(0) + b.get(&200).copied().unwrap_or(0);
    assert_eq!(admitted, 40, "one quota of 40 for both keys: {a:?} {b:?}");
    let counted = minute_counted(&gateways[1], &two).await;
    for g in gateways {
        stop(g);
    }
    let got = events(&metering);
    let of_acme = |field: &str| -> u64 {
        got.iter()
            .filter(|e| e["type"] == "pet.usage.v1" && e["data"]["customer"] == "acme")
            .map(|e| e["data"][field].as_u64().expect("a count"))
            .sum()
    };
    assert_eq!(
        of_acme("cost"),
        counted,
        "the store's count of the customer's minute"
    );
    assert_eq!(of_acme("admitted"), 40);
    assert_eq!(of_acme("refused"), 80);
    let keys: std::collections::HashSet<&str> = got
        .iter()
        .filter(|e| e["data"]["customer"] == "acme")
        .map(|e| e["data"]["key_id"].as_str().unwrap())
        .collect();
    assert_eq!(keys.len(), 2, "each key's own events: {keys:?}");
}

/// `notify_at` outside 1-100, or a percentage given twice, stops `check` and `serve`, naming
/// the plan file and the field.
#[test]
fn bad_notify_at_values_are_refused_by_check_and_at_start_naming_the_field() {
    let f = Fixture::new(5, 1_000);
    let metering = metering_folder(&f);
    let spec = metered(&f, "127.0.0.1:9".parse().unwrap(), &metering, "");
    let config = e2e::write_gateway_config(f.dir.path(), &spec);
    for (list, why) in [
        ("[80, 80]", "80 is given twice"),
        ("[0, 100]", "0 is not a whole percentage from 1 to 100"),
        ("[101]", "101 is not a whole percentage from 1 to 100"),
        ("[\"80\"]", "is not a whole percentage"),
    ] {
        std::fs::write(
            f.plans.join("free.toml"),
            format!("requests_per_minute = 5\nrequests_per_day = 1000\nnotify_at = {list}\n"),
        )
        .unwrap();
        let out = e2e::gateway_cli(&["check", "--config", &config.to_string_lossy()]);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!out.status.success(), "check, {list}: {text}");
        for part in ["free.toml", "notify_at", why] {
            assert!(text.contains(part), "check, {list}: {part}: {text}");
        }
        let (code, log) = GatewayProcess::start_refused(f.dir.path(), &spec);
        assert_ne!(code, Some(0), "serve, {list}: {log}");
        assert!(
            log.contains("notify_at") && log.contains(why),
            "serve, {list}: {log}"
        );
    }
}

#[test]
fn a_metering_file_in_a_missing_folder_is_refused_at_start_naming_the_setting() {
    let f = Fixture::new(5, 1_000);
    let nowhere = f.dir.path().join("nowhere");
    let spec = metered(&f, "127.0.0.1:9".parse().unwrap(), &nowhere, "");
    let (code, log) = GatewayProcess::start_refused(f.dir.path(), &spec);
    assert_ne!(code, Some(0));
    assert!(log.contains("metering_file"), "{log}");
    assert!(log.contains("no such folder"), "{log}");
}

/// A full disk under the metering file at a stop: the last round's write fails, is cut back
/// (no half line), and is tried again; once there is room the events go in whole, with the
/// counts the gateway decided.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_under_the_metering_file_holds_the_events_until_there_is_room() {
    let f = Fixture::new(5, 1_000);
    let key = f.issue("free");
    let key_id = first_key_id(&f.keys);
    let backend = f.backend();
    let disk = e2e::SmallDisk::mount(&f.dir.path().join("disk"), 1 << 20);
    let spec = metered(&f, backend.addr, &disk.path, "grace_period_secs = 0\n");
    let gateway = f.gateway(&spec);
    fresh_minute(Duration::from_secs(10));
    for _ in 0..7 {
        gateway.status(&key).await;
    }
    disk.fill();
    let log = gateway.log.clone();
    gateway.process.signal(15); // SIGTERM: the last round writes the open minute
                                // Room comes back only once the gateway has said that the file could not be written.
    let said = tokio::task::spawn_blocking(move || {
        for _ in 0..200 {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains("cannot write events to the metering file") {
                return true;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        false
    })
    .await
    .unwrap();
    assert!(said, "the failed write is logged");
    disk.free();
    let code = Process::wait_exit(gateway.process, Duration::from_secs(30));
    assert_eq!(code, Some(0));
    let got = events(&disk.path);
    assert_eq!(sum(&got, &key_id, "admitted"), 5);
    assert_eq!(sum(&got, &key_id, "refused"), 2);
}

/// A ban is started by the store's decision, once, whichever node made it: three nodes on one
/// Redis under a burst report exactly one `pet.key.banned.v1` for it, with a derived id.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_report_one_ban_once() {
    let f = Fixture::new(2, 1_000);
    let key = f.issue("free");
    let key_id = first_key_id(&f.keys);
    let backend = f.backend();
    let redis = RedisServer::start();
    let metering = metering_folder(&f);
    let gateways = three_nodes(&f, backend.addr, &redis, &metering, 1);
    fresh_minute(Duration::from_secs(15));
    let counts = burst(&gateways, &key, 60).await;
    assert_eq!(counts.get(&200).copied(), Some(2), "{counts:?}");
    for g in gateways {
        stop(g);
    }
    let bans: Vec<Value> = events(&metering)
        .into_iter()
        .filter(|e| e["type"] == "pet.key.banned.v1")
        .collect();
    assert_eq!(bans.len(), 1, "{bans:?}");
    let ban = &bans[0];
    assert_eq!(ban["data"]["key_id"], key_id.as_str());
    assert_eq!(ban["data"]["plan"], "free");
    assert!(ban["id"]
        .as_str()
        .unwrap()
        .starts_with("pet.key.banned.v1:"));
    assert!(ban["data"]["banned_until"].as_str().unwrap().ends_with('Z'));
}

/// Key changes made at the command line are reported in the metering file, once each, with
/// ids derived from the key and the change.
#[test]
fn key_changes_from_the_command_line_are_events() {
    let f = Fixture::new(5, 1_000);
    let metering = metering_folder(&f);
    let spec = metered(
        &f,
        "127.0.0.1:9".parse().unwrap(),
        &metering,
        "node_id = \"ops\"\n",
    );
    let config = e2e::write_gateway_config(f.dir.path(), &spec);
    let out = e2e::keys_cli(&config, &["issue", "--plan", "free"]);
    assert!(out.status.success(), "{out:?}");
    let id = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .nth(1)
        .expect("issued <id>")
        .to_owned();
    let out = e2e::keys_cli(&config, &["rotate", "--overlap", "1h", &id]);
    assert!(out.status.success(), "{out:?}");
    // Revoked in the file; the command then fails only to confirm it with a gateway, of which
    // none runs here.
    let out = e2e::keys_cli(&config, &["revoke", &id]);
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("revoked"),
        "{out:?}"
    );

    let got = events(&metering);
    let kinds: Vec<&str> = got.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "pet.key.issued.v1",
            "pet.key.rotated.v1",
            "pet.key.revoked.v1"
        ]
    );
    for e in &got {
        assert_eq!(e["data"]["key_id"], id.as_str());
        assert_eq!(e["source"], "pet-gateway/test/ops");
        let prefix = format!("{}:{id}:", e["type"].as_str().unwrap());
        assert!(e["id"].as_str().unwrap().starts_with(&prefix), "{e}");
    }
    assert!(got[1]["data"]["successor_key_id"].as_str().is_some());
}

/// A plan's `notify_at` thresholds of the day, crossed under a burst from three nodes on one
/// Redis: each is reported exactly once, by the node whose decision crossed it, with the count
/// and limit of that decision.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_report_each_threshold_of_the_day_once() {
    let f = Fixture::new(1_000, 40);
    let plan = f.plans.join("free.toml");
    let text = std::fs::read_to_string(&plan).unwrap();
    std::fs::write(&plan, format!("notify_at = [80, 100]\n{text}")).unwrap();
    let key = f.issue("free");
    let key_id = first_key_id(&f.keys);
    let backend = f.backend();
    let redis = RedisServer::start();
    let metering = metering_folder(&f);
    let gateways = three_nodes(&f, backend.addr, &redis, &metering, 100);
    // The day's 40 are the subject: not across midnight UTC.
    e2e::fresh_day(Duration::from_secs(30));
    let counts = burst(&gateways, &key, 60).await;
    assert_eq!(counts.get(&200).copied(), Some(40), "{counts:?}");
    for g in gateways {
        stop(g);
    }
    let mut crossed: Vec<Value> = events(&metering)
        .into_iter()
        .filter(|e| e["type"] == "pet.quota.threshold.v1")
        .collect();
    crossed.sort_by_key(|e| e["data"]["threshold"].as_u64());
    let got: Vec<(u64, u64)> = crossed
        .iter()
        .map(|e| {
            (
                e["data"]["threshold"].as_u64().unwrap(),
                e["data"]["used"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(got, [(80, 32), (100, 40)], "{crossed:?}");
    for e in &crossed {
        assert_eq!(e["data"]["key_id"], key_id.as_str());
        assert_eq!(e["data"]["limit"], 40);
        assert_eq!(e["data"]["window"], "1d");
        assert_eq!(e["data"]["customer"], Value::Null);
        assert!(e["data"]["reset"].as_str().unwrap().ends_with("T00:00:00Z"));
    }
}

/// Keys that end in six and a half days, in three days and in twelve hours (rotations'
/// predecessors): three nodes on one Redis report the seven-day notice of the first and the
/// one-day notice of the last, each once, with ids derived from the key, the notice and the
/// end; the key with three days left is not told "seven days" (its one-day notice is ahead).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_report_each_keys_expiry_notice_once() {
    let f = Fixture::new(1_000, 10_000);
    let rotate = |overlap: &str| {
        f.issue("free");
        let id = last_key_id(&f.keys);
        let out = e2e::gateway_cli(&[
            "keys",
            "rotate",
            "--keys-file",
            &f.keys.to_string_lossy(),
            "--plans-dir",
            &f.plans.to_string_lossy(),
            "--overlap",
            overlap,
            &id,
        ]);
        assert!(out.status.success(), "{out:?}");
        id
    };
    let in_a_week = rotate("156h");
    let in_three_days = rotate("3d");
    let in_twelve_hours = rotate("12h");
    let backend = f.backend();
    let redis = RedisServer::start();
    let metering = metering_folder(&f);
    let gateways = three_nodes(&f, backend.addr, &redis, &metering, 100);
    // Each node looks through its keys as it starts; the notices are written within a round.
    let written = (0..300).any(|_| {
        std::thread::sleep(Duration::from_millis(50));
        events(&metering)
            .iter()
            .filter(|e| e["type"] == "pet.key.expiring.v1")
            .count()
            >= 2
    });
    assert!(written, "the two notices are written");
    // Every node has looked (a second look would be the one to report twice).
    std::thread::sleep(Duration::from_secs(1));
    for g in gateways {
        stop(g);
    }
    let mut notices: Vec<(String, u64, String)> = events(&metering)
        .into_iter()
        .filter(|e| e["type"] == "pet.key.expiring.v1")
        .map(|e| {
            (
                e["data"]["key_id"].as_str().unwrap().to_owned(),
                e["data"]["days_before"].as_u64().unwrap(),
                e["id"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    notices.sort();
    assert!(
        notices.iter().all(|(k, _, _)| *k != in_three_days),
        "{notices:?}"
    );
    let mut want = vec![(in_a_week.clone(), 7), (in_twelve_hours.clone(), 1)];
    want.sort();
    let got: Vec<(String, u64)> = notices.iter().map(|(k, d, _)| (k.clone(), *d)).collect();
    assert_eq!(got, want, "{notices:?}");
    for (key, days, id) in &notices {
        assert!(
            id.starts_with(&format!("pet.key.expiring.v1:{key}:{days}d:")),
            "{id}"
        );
    }
}

/// The id of the last key in a keys file.
fn last_key_id(keys: &Path) -> String {
    let text = std::fs::read_to_string(keys).unwrap();
    text.lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("id = "))
        .unwrap()
        .trim_matches('"')
        .to_owned()
}

/// Key changes made through the admin API are events too, with the same derived ids as the
/// command line's: issue, rotate and revoke of one key, once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_changes_through_the_admin_api_are_events() {
    let f = Fixture::new(5, 1_000);
    f.issue("free"); // the keys file exists
    let backend = f.backend();
    let metering = metering_folder(&f);
    let spec = metered(&f, backend.addr, &metering, "node_id = \"admin-node\"\n");
    let gateway = f.gateway(&spec);
    let client = reqwest::Client::new();
    let issued = client
        .post(gateway.admin_url("/keys"))
        .json(&serde_json::json!({"plan": "free"}))
        .send()
        .await
        .unwrap();
    assert_eq!(issued.status(), 201);
    let body: Value = issued.json().await.unwrap();
    let id = body["id"].as_str().expect("the key's id").to_owned();
    for action in ["rotate", "revoke"] {
        let resp = client
            .post(gateway.admin_url(&format!("/keys/{id}/{action}")))
            .json(&serde_json::json!({}))
            .send()
            .await
            .unwrap();
        assert!(resp.status().is_success(), "{action}: {}", resp.status());
    }
    stop(gateway);
    let got: Vec<Value> = events(&metering)
        .into_iter()
        .filter(|e| e["data"]["key_id"] == id.as_str())
        .collect();
    let kinds: Vec<&str> = got.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "pet.key.issued.v1",
            "pet.key.rotated.v1",
            "pet.key.revoked.v1"
        ]
    );
    for e in &got {
        let prefix = format!("{}:{id}:", e["type"].as_str().unwrap());
        assert!(e["id"].as_str().unwrap().starts_with(&prefix), "{e}");
        assert_eq!(e["source"], "pet-gateway/test/admin-node");
    }
}

/// Metering through a Redis restart (a persisted Redis shut down and started again under
/// load): decisions the node makes on its own while the store is away are neither counted by
/// the store nor metered, and once the store is back metering goes on. Nothing is metered that
/// the store did not count, and what the store counted beyond the events is at most the
/// decisions whose answer was lost (store errors).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_events_follow_the_stores_count_through_a_redis_restart() {
    let f = Fixture::new(100_000, 1_000_000);
    let key = f.issue("free");
    let key_id = first_key_id(&f.keys);
    let backend = f.backend();
    let data = f.dir.path().join("redis-data");
    std::fs::create_dir(&data).unwrap();
    let addr = e2e::free_addr();
    let persisted = [
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        "--dir",
        data.to_str().unwrap(),
    ];
    let redis = RedisServer::start_with(addr, &persisted);
    let metering = metering_folder(&f);
    let mut spec = metered(&f, backend.addr, &metering, "grace_period_secs = 0\n");
    spec.redis_url = Some(redis.url());
    let gateway = f.gateway(&spec);
    // The store's day count is compared with every event metered: not across midnight UTC.
    // (Minutes may turn meanwhile: the events of each are summed. The test can outlast 20 s
    // on a loaded machine, a Redis shutdown alone may take 10.)
    e2e::fresh_day(Duration::from_secs(90));
    let client = reqwest::Client::new();
    let load = {
        let (client, url, key) = (client.clone(), gateway.url("/v1/pets"), key.clone());
        tokio::spawn(async move {
            let until = std::time::Instant::now() + Duration::from_secs(4);
            let mut ok = 0u64;
            while std::time::Instant::now() < until {
                let resp = client.get(&url).bearer_auth(&key).send().await.unwrap();
                ok += u64::from(resp.status() == 200);
            }
            ok
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    redis.cli(&["SHUTDOWN"]);
    let _ = Process::wait_exit(redis.process, Duration::from_secs(10));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let redis = RedisServer::start_with(addr, &persisted);
    let served = load.await.unwrap();
    // Once the store is back, decisions are the store's again, and metered.
    let mut after = 0;
    for _ in 0..200 {
        after += u64::from(gateway.status(&key).await == 200);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(after, 200);
    let shown: Value = client
        .get(gateway.admin_url(&format!("/keys/{key_id}")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let counted = shown["usage"]["day"]
        .as_u64()
        .expect("the store's day count");
    let metrics = client
        .get(gateway.admin_url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let errors: u64 = metrics
        .lines()
        .filter(|l| l.starts_with("pet_gateway_store_errors_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum();
    stop(gateway);
    let metered_count = sum(&events(&metering), &key_id, "cost");
    assert!(
        metered_count >= after,
        "metering went on after the restart: {metered_count}"
    );
    assert!(
        metered_count <= counted && counted <= metered_count + errors,
        "metered {metered_count}, store {counted}, store errors {errors}, served {}",
        served + after
    );
    drop(redis);
}

/// The check's nodes on a loaded machine: a threshold's round went into a write that did not
/// come back before the stop (here another process holds the day's file's lock; a stalled
/// sync does the same), and the stop gave the thread 10 s and exited 0 with the open minute
/// still in memory: in neither the file nor the spool. The stop now takes the minute itself,
/// writes each sink on its own, and says what a stalled one did not take.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_writes_the_open_minute_while_the_events_thread_is_held_in_a_write() {
    e2e::fresh_day(Duration::from_secs(120));
    let f = Fixture::new(1_000, 5);
    let plan = f.plans.join("free.toml");
    let text = std::fs::read_to_string(&plan).unwrap();
    std::fs::write(&plan, format!("notify_at = [80]\n{text}")).unwrap();
    let key = f.issue("free");
    let key_id = first_key_id(&f.keys);
    let backend = f.backend();
    let metering = metering_folder(&f);
    let spool = f.dir.path().join("spool");
    std::fs::create_dir(&spool).unwrap();
    let secret = f.dir.path().join("secret");
    std::fs::write(&secret, "a-secret-of-the-test-0123456789abcdef").unwrap();
    // Nobody listens there: the batches stay in the spool, where the test reads them.
    let url = format!("http://{}/events", e2e::free_addr());
    let more = format!(
        "node_id = \"node-a\"\ngrace_period_secs = 0\nevents_webhook_url = \"{url}\"\n\
         events_webhook_secret_file = \"{}\"\nevents_spool_dir = \"{}\"\n",
        secret.display(),
        spool.display()
    );
    let gateway = f.gateway(&metered(&f, backend.addr, &metering, &more));
    let day = std::process::Command::new("date")
        .args(["-u", "+%F"])
        .output()
        .unwrap();
    let day_file = metering.join(format!(
        "metering.ndjson.{}",
        String::from_utf8_lossy(&day.stdout).trim()
    ));
    std::fs::write(&day_file, "").unwrap();
    let _holder = Process::spawn(
        "flock",
        std::process::Command::new("flock")
            .arg("-x")
            .arg(&day_file)
            .args(["sleep", "60"]),
    );
    while std::process::Command::new("flock")
        .args(["-n", "-x"])
        .arg(&day_file)
        .arg("true")
        .status()
        .unwrap()
        .success()
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    let statuses: Vec<u16> =
        futures_util::future::join_all((0..5).map(|_| gateway.status(&key))).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    // The 80 % notice's round is now waiting for the lock (up to 30 s).
    std::thread::sleep(Duration::from_secs(2));
    let (code, log) = gateway.stop();
    assert_eq!(code, Some(0), "{log}");
    let mut spooled = Vec::new();
    for entry in std::fs::read_dir(&spool).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "events") {
            let text = std::fs::read_to_string(&path).unwrap();
            spooled.extend(
                text.lines()
                    .map(|l| serde_json::from_str::<Value>(l).unwrap()),
            );
        }
    }
    assert_eq!(
        sum(&spooled, &key_id, "admitted"),
        5,
        "the open minute, spooled: {spooled:?}\n{log}"
    );
    assert!(
        log.contains("events lost at stop"),
        "the file's share is reported:\n{log}"
    );
}
