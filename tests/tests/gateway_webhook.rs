//! The webhook sink end to end (issue 24): real `pet-gateway` and `pet-backend` processes and a
//! receiver in this harness that checks every signature. Delivery is at least once: the tests
//! count events by their `id`, as a receiver dedupes them.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::time::Duration;

use e2e::{
    first_key_id, fresh_minute, gateway_cli, Fixture, GatewayProcess, GatewaySpec, Process,
    Received, WebhookReceiver,
};
use serde_json::Value;

const SECRET: &[u8] = b"whsec-test-0123456789abcdef0123456789";

/// The spool folder and the secret file, made in the fixture's folder.
fn spool_and_secret(f: &Fixture) -> (PathBuf, PathBuf) {
    let spool = f.dir.path().join("spool");
    std::fs::create_dir(&spool).unwrap();
    let secret = f.dir.path().join("webhook.secret");
    std::fs::write(&secret, [SECRET, b"\n"].concat()).unwrap();
    (spool, secret)
}

/// A gateway in front of `upstream` posting its events to `url`.
fn hooked(
    f: &Fixture,
    upstream: SocketAddr,
    url: &str,
    spool: &Path,
    secret: &Path,
) -> GatewaySpec {
    let mut spec = f.spec(upstream);
    spec.extra = format!(
        "node_id = \"node-a\"\ngrace_period_secs = 0\nevents_webhook_url = \"{url}\"\n\
         events_webhook_secret_file = \"{}\"\nevents_spool_dir = \"{}\"\n",
        secret.display(),
        spool.display()
    );
    spec
}

/// `pet-gateway check` on `spec`'s config: whether it passed, and what it said.
fn check(f: &Fixture, spec: &GatewaySpec) -> (bool, String) {
    let config = e2e::write_gateway_config(f.dir.path(), spec);
    let out = gateway_cli(&["check", "--config", &config.to_string_lossy()]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn stop(gateway: GatewayProcess) {
    let (code, text) = gateway.stop();
    assert_eq!(code, Some(0), "the gateway stops cleanly; its log:\n{text}");
}

/// The segments waiting in the spool.
fn spooled(spool: &Path) -> usize {
    std::fs::read_dir(spool)
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            let name = name.to_string_lossy();
            name.ends_with(".events") && !name.starts_with("tmp-")
        })
        .count()
}

/// Events received, one an id.
fn by_id(r: &Received) -> BTreeMap<String, Value> {
    r.events
        .iter()
        .map(|e| (e["id"].as_str().unwrap().to_owned(), e.clone()))
        .collect()
}

fn usage_sum(events: &BTreeMap<String, Value>, key_id: &str, field: &str) -> u64 {
    events
        .values()
        .filter(|e| e["type"] == "pet.usage.v1" && e["data"]["key_id"] == key_id)
        .map(|e| e["data"][field].as_u64().unwrap())
        .sum()
}

/// A key issued at the command line on the gateway's config: its event goes to the spool.
fn issue_by_cli(spec: &GatewaySpec, dir: &Path) -> String {
    let config = e2e::write_gateway_config(dir, spec);
    let out = e2e::keys_cli(&config, &["issue", "--plan", "free"]);
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .nth(1)
        .expect("issued <id>")
        .to_owned()
}

/// The receiver fails its first three batches (500); the gateway retries with backoff until it
/// accepts. Usage spooled at a stop is delivered by the next process. Every request carried a
/// valid signature, and every event arrived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_down_for_a_while_and_a_restart_lose_nothing_and_every_batch_is_signed() {
    let f = Fixture::new(5, 1_000);
    let key = f.issue("free");
    let key_id = first_key_id(&f.keys);
    let backend = f.backend();
    let receiver = WebhookReceiver::start(SECRET, 3, 500);
    let (spool, secret) = spool_and_secret(&f);
    let spec = hooked(&f, backend.addr, &receiver.url(), &spool, &secret);
    let gateway = f.gateway(&spec);
    let issued = issue_by_cli(&spec, f.dir.path());
    let arrived = receiver.wait_for(Duration::from_secs(30), |r| {
        by_id(r)
            .values()
            .any(|e| e["data"]["key_id"] == issued.as_str())
    });
    assert!(
        arrived,
        "the issued event arrives after the receiver's failures"
    );
    assert!(receiver.received.lock().unwrap().requests >= 4);

    fresh_minute(Duration::from_secs(10));
    let client = reqwest::Client::new();
    for _ in 0..8 {
        client
            .get(gateway.url("/v1/pets"))
            .bearer_auth(&key)
            .send()
            .await
            .unwrap();
    }
    stop(gateway);
    assert!(spooled(&spool) >= 1, "the stop spools the open minute");

    let again = f.gateway(&spec);
    let delivered = receiver.wait_for(Duration::from_secs(30), |r| {
        usage_sum(&by_id(r), &key_id, "admitted") == 5
    });
    assert!(delivered, "the next process delivers the spooled usage");
    let r = receiver.received.lock().unwrap();
    let events = by_id(&r);
    assert_eq!(usage_sum(&events, &key_id, "refused"), 3);
    assert_eq!(usage_sum(&events, &key_id, "cost"), 5);
    assert_eq!(r.bad_signatures, 0, "every batch is signed with the secret");
    assert_eq!(r.malformed, 0);
    let issued_event = events
        .values()
        .find(|e| e["type"] == "pet.key.issued.v1")
        .expect("the issued event");
    let id = issued_event["id"].as_str().unwrap();
    assert!(
        id.starts_with(&format!("pet.key.issued.v1:{issued}:")),
        "{id}"
    );
    assert_eq!(issued_event["specversion"], "1.0");
    drop(r);
    let emptied = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(50));
        spooled(&spool) == 0
    });
    assert!(emptied, "a delivered batch leaves the spool");
    stop(again);
}

/// A 4xx other than 408/429 is the receiver's final word: the batch goes to the dead-letter
/// file, counted, and is not posted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_the_receiver_refuses_for_good_goes_to_the_dead_letters() {
    let f = Fixture::new(5, 1_000);
    let backend = f.backend();
    let receiver = WebhookReceiver::start(SECRET, usize::MAX, 422);
    let (spool, secret) = spool_and_secret(&f);
    let spec = hooked(&f, backend.addr, &receiver.url(), &spool, &secret);
    let gateway = f.gateway(&spec);
    let issued = issue_by_cli(&spec, f.dir.path());
    let dead = spool.join("dead-letter.ndjson");
    let moved = (0..200).any(|_| {
        std::thread::sleep(Duration::from_millis(50));
        std::fs::read_to_string(&dead).is_ok_and(|t| t.contains(&issued)) && spooled(&spool) == 0
    });
    assert!(
        moved,
        "the refused batch is in the dead-letter file, out of the spool"
    );
    let requests = receiver.received.lock().unwrap().requests;
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        receiver.received.lock().unwrap().requests,
        requests,
        "not posted again"
    );
    let metrics = reqwest::get(gateway.admin_url("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("pet_gateway_events_dead_lettered_total{reason=\"rejected\"} 1"),
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("dead_lettered"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    stop(gateway);
}

/// A receiver that holds the connection without answering, and one that answers garbage: no
/// request waits for either, and the events stay spooled (not lost, not dead-lettered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_or_garbage_receiver_never_slows_a_request_and_loses_nothing() {
    for garbage in [false, true] {
        let f = Fixture::new(1_000, 10_000);
        let key = f.issue("free");
        let backend = f.backend();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            for mut conn in listener.incoming().flatten() {
                let mut buf = [0u8; 4096];
                let _ = conn.read(&mut buf);
                if garbage {
                    let _ = conn.write_all(b"\x00\x01 not http at all\r\n");
                } else {
                    std::thread::sleep(Duration::from_secs(60));
                }
            }
        });
        let (spool, secret) = spool_and_secret(&f);
        let spec = hooked(&f, backend.addr, &url, &spool, &secret);
        let gateway = f.gateway(&spec);
        issue_by_cli(&spec, f.dir.path());
        std::thread::sleep(Duration::from_secs(2)); // the first POST is in flight or failed
        let client = reqwest::Client::new();
        for _ in 0..20 {
            let started = std::time::Instant::now();
            let resp = client
                .get(gateway.url("/v1/pets"))
                .bearer_auth(&key)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "garbage={garbage}"
            );
        }
        assert_eq!(
            spooled(&spool),
            1,
            "garbage={garbage}: the batch waits in the spool"
        );
        assert!(!spool.join("dead-letter.ndjson").exists());
        stop(gateway);
    }
}

/// Each bad webhook setting is refused by `check`, naming it.
#[test]
fn bad_webhook_settings_are_refused_by_check_naming_the_setting() {
    let f = Fixture::new(5, 1_000);
    let (spool, secret) = spool_and_secret(&f);
    let empty = f.dir.path().join("empty.secret");
    std::fs::write(&empty, "\n").unwrap();
    let short = f.dir.path().join("short.secret");
    std::fs::write(&short, "a-secret-of-20-bytes\n").unwrap();
    let upstream: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let ok_url = "http://127.0.0.1:9/hooks";
    let cases: Vec<(GatewaySpec, &str, &str)> = vec![
        (
            hooked(&f, upstream, "ftp://example.com/x", &spool, &secret),
            "events_webhook_url",
            "http://",
        ),
        (
            hooked(&f, upstream, "not a url", &spool, &secret),
            "events_webhook_url",
            "not a URL",
        ),
        (
            hooked(&f, upstream, ok_url, &spool, &empty),
            "events_webhook_secret_file",
            "is empty",
        ),
        (
            hooked(&f, upstream, ok_url, &spool, &short),
            "events_webhook_signature",
            "is 20 bytes; it must be at least 32",
        ),
        (
            hooked(&f, upstream, ok_url, &spool, &f.dir.path().join("missing")),
            "events_webhook_secret_file",
            "cannot read",
        ),
        (
            hooked(
                &f,
                upstream,
                ok_url,
                &f.dir.path().join("no-spool"),
                &secret,
            ),
            "events_spool_dir",
            "no such folder",
        ),
    ];
    for (spec, setting, why) in cases {
        let (passed, text) = check(&f, &spec);
        assert!(!passed, "{setting}: {text}");
        assert!(text.contains(setting), "{setting}: {text}");
        assert!(text.contains(why), "{setting}: {text}");
    }
    let mut no_secret = f.spec(upstream);
    no_secret.extra = format!(
        "events_webhook_url = \"{ok_url}\"\nevents_spool_dir = \"{}\"\n",
        spool.display()
    );
    let (passed, text) = check(&f, &no_secret);
    assert!(!passed);
    assert!(text.contains("PET_GATEWAY_EVENTS_WEBHOOK_SECRET"), "{text}");
}

/// A full disk under the spool at a stop: the last round cannot spool the open minute, says so,
/// keeps it and tries again; once there is room it is spooled whole, and the next process
/// delivers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_under_the_spool_holds_the_events_until_there_is_room() {
    let f = Fixture::new(5, 1_000);
    let key = f.issue("free");
    let key_id = first_key_id(&f.keys);
    let backend = f.backend();
    let receiver = WebhookReceiver::start(SECRET, 0, 200);
    let (_, secret) = spool_and_secret(&f);
    let disk = e2e::SmallDisk::mount(&f.dir.path().join("disk"), 1 << 20);
    let spec = hooked(&f, backend.addr, &receiver.url(), &disk.path, &secret);
    let gateway = f.gateway(&spec);
    fresh_minute(Duration::from_secs(10));
    let client = reqwest::Client::new();
    for _ in 0..7 {
        client
            .get(gateway.url("/v1/pets"))
            .bearer_auth(&key)
            .send()
            .await
            .unwrap();
    }
    disk.fill();
    let log = gateway.log.clone();
    gateway.process.signal(15);
    let said = tokio::task::spawn_blocking(move || {
        (0..200).any(|_| {
            std::thread::sleep(Duration::from_millis(25));
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            text.contains("cannot write events to the webhook's spool")
        })
    })
    .await
    .unwrap();
    assert!(said, "the failed spool write is logged");
    assert_eq!(spooled(&disk.path), 0, "nothing half-written is visible");
    disk.free();
    assert_eq!(
        Process::wait_exit(gateway.process, Duration::from_secs(30)),
        Some(0)
    );
    assert_eq!(spooled(&disk.path), 1, "spooled once there was room");
    let again = f.gateway(&spec);
    let delivered = receiver.wait_for(Duration::from_secs(20), |r| {
        usage_sum(&by_id(r), &key_id, "admitted") == 5
    });
    assert!(delivered, "the next process delivers it");
    assert_eq!(
        usage_sum(
            &by_id(&receiver.received.lock().unwrap()),
            &key_id,
            "refused"
        ),
        2
    );
    stop(again);
}

/// A receiver that is not there at all (connection refused) and then comes up where the
/// gateway was told to post: the batch waits in the spool and arrives, signed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_is_down_gets_the_batch_once_it_is_up() {
    let f = Fixture::new(5, 1_000);
    let backend = f.backend();
    let addr = e2e::free_addr();
    let url = format!("http://{addr}/hooks/pet");
    let (spool, secret) = spool_and_secret(&f);
    let spec = hooked(&f, backend.addr, &url, &spool, &secret);
    let gateway = f.gateway(&spec);
    let issued = issue_by_cli(&spec, f.dir.path());
    let failing = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(50));
        gateway.log_text().contains("cannot deliver events")
    });
    assert!(failing, "the refused connection is logged");
    assert_eq!(spooled(&spool), 1, "the batch waits in the spool");
    let receiver = WebhookReceiver::start_at(addr, SECRET);
    let arrived = receiver.wait_for(Duration::from_secs(30), |r| {
        by_id(r)
            .values()
            .any(|e| e["data"]["key_id"] == issued.as_str())
    });
    assert!(arrived, "delivered once the receiver is up");
    assert_eq!(receiver.received.lock().unwrap().bad_signatures, 0);
    stop(gateway);
}

/// A spool folder that cannot be written (a read-only disk: file modes do not stop root, who
/// runs the tests) is refused by `check` and at start-up, naming the setting; so is a bad
/// webhook URL at start-up, before anything is served.
#[test]
fn an_unwritable_spool_and_a_bad_url_are_refused_by_check_and_at_start() {
    let f = Fixture::new(5, 1_000);
    let (spool, secret) = spool_and_secret(&f);
    let upstream: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let read_only = e2e::SmallDisk::mount_read_only(&f.dir.path().join("ro"));
    let cases = [
        (
            hooked(
                &f,
                upstream,
                "http://127.0.0.1:9/hooks",
                &read_only.path,
                &secret,
            ),
            "events_spool_dir",
            "cannot be written",
        ),
        (
            hooked(&f, upstream, "not a url", &spool, &secret),
            "events_webhook_url",
            "not a URL",
        ),
    ];
    for (spec, setting, why) in cases {
        let (passed, text) = check(&f, &spec);
        assert!(!passed, "check, {setting}: {text}");
        assert!(
            text.contains(setting) && text.contains(why),
            "check: {text}"
        );
        let (code, log) = GatewayProcess::start_refused(f.dir.path(), &spec);
        assert_ne!(code, Some(0), "serve, {setting}: {log}");
        assert!(log.contains(setting) && log.contains(why), "serve: {log}");
    }
}

/// `serve --upgrade`: the old process delivers the spool while it runs; at its stop it spools
/// the minute in progress, and the new process, which waited for the spool's lock, takes over
/// and delivers it once the old one has exited. Nothing is lost or posted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_hands_the_spool_to_the_new_process_once_the_old_one_exits() {
    let f = Fixture::new(5, 1_000);
    let key = f.issue("free");
    let key_id = first_key_id(&f.keys);
    let backend = f.backend();
    let receiver = WebhookReceiver::start(SECRET, 0, 200);
    let (spool, secret) = spool_and_secret(&f);
    let spec = hooked(&f, backend.addr, &receiver.url(), &spool, &secret);
    let old = f.gateway(&spec);
    let old_pid = old.process.pid();
    // Within one minute, so the old process writes its usage only at its stop (to the spool,
    // after its own delivery has ended): only the new process can deliver it.
    fresh_minute(Duration::from_secs(20));
    for _ in 0..3 {
        assert_eq!(old.status(&key).await, 200);
    }
    let new = old.start_upgrade();
    assert!(
        !new.log_text().contains("delivering the spool's events"),
        "the new process waits while the old one holds the spool"
    );
    old.process.signal(3); // SIGQUIT: hand the sockets over, then stop
    let old_log = old.log.clone();
    let code = tokio::task::spawn_blocking(move || {
        Process::wait_exit(old.process, Duration::from_secs(30))
    })
    .await
    .unwrap();
    let text = std::fs::read_to_string(&old_log).unwrap_or_default();
    assert_eq!(code, Some(0), "the old process exits cleanly: {text}");
    let delivered = receiver.wait_for(Duration::from_secs(30), |r| {
        usage_sum(&by_id(r), &key_id, "admitted") == 3
    });
    assert!(
        delivered,
        "the old process's last minute arrives; new: {}",
        new.log_text()
    );
    {
        let got = receiver.received.lock().unwrap();
        let usage: Vec<&Value> = got
            .events
            .iter()
            .filter(|e| e["type"] == "pet.usage.v1" && e["data"]["key_id"] == key_id.as_str())
            .collect();
        assert!(
            usage.iter().all(|e| e["id"]
                .as_str()
                .unwrap()
                .starts_with(&format!("node-a.{old_pid}."))),
            "the events are the old process's: {usage:?}"
        );
        assert_eq!(
            usage.len(),
            by_id(&got)
                .values()
                .filter(|e| e["type"] == "pet.usage.v1")
                .count()
        );
        assert_eq!(got.bad_signatures, 0);
    }
    // Its log line may reach the file a moment after the delivery itself.
    e2e::eventually(
        Duration::from_secs(10),
        "the new process took the spool over",
        || new.log_text().contains("delivering the spool's events"),
    )
    .await;
    stop(new);
}

/// A `whsec_` secret of 32 random bytes, as Standard Webhooks makes them.
fn standard_secret() -> String {
    use base64::Engine;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .expect("random bytes");
    format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

/// The receiver of `tests/standard_webhooks_receiver.py`, verifying with the `standardwebhooks`
/// package: its URL, its process and where it records each delivery.
fn standard_receiver(
    dir: &Path,
    secrets: &[&str],
    fail_first: usize,
) -> (String, Process, PathBuf) {
    let record = dir.join("deliveries.ndjson");
    let mut args = vec![
        "--record".to_owned(),
        record.display().to_string(),
        "--fail-first".to_owned(),
        fail_first.to_string(),
    ];
    for s in secrets {
        args.extend(["--secret".to_owned(), (*s).to_owned()]);
    }
    let server = e2e::PythonServer::start(
        dir,
        "standard_webhooks_receiver.py",
        "standardwebhooks",
        &args,
    );
    (
        format!("http://127.0.0.1:{}/hooks/pet", server.port),
        server.process,
        record,
    )
}

fn deliveries(record: &Path) -> Vec<Value> {
    std::fs::read_to_string(record)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

/// `events_webhook_signature = "standard"` during a secret rotation: the `standardwebhooks`
/// package verifies every delivery with the new secret and with the old one, and refuses the
/// same delivery with its body changed, with a secret not ours and read 10 minutes later. A
/// batch the receiver failed comes again under the same `webhook-id`. A secret that is not a
/// `whsec_` value is refused by `check`, naming the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standard_webhooks_verifies_every_delivery_with_either_secret_of_a_rotation() {
    let f = Fixture::new(5, 1_000);
    let backend = f.backend();
    let (new, old) = (standard_secret(), standard_secret());
    let (url, _receiver, record) = standard_receiver(f.dir.path(), &[&new, &old], 2);
    let (spool, secret) = spool_and_secret(&f);
    std::fs::write(&secret, format!("{new}\n")).unwrap();
    let previous = f.dir.path().join("webhook.previous");
    std::fs::write(&previous, &old).unwrap();
    let mut spec = hooked(&f, backend.addr, &url, &spool, &secret);
    spec.extra += &format!(
        "events_webhook_signature = \"standard\"\nevents_webhook_previous_secret_file = \"{}\"\n",
        previous.display()
    );
    let gateway = f.gateway(&spec);
    let issued: Vec<String> = (0..3).map(|_| issue_by_cli(&spec, f.dir.path())).collect();
    let accepted = |all: &[Value]| all.iter().filter(|d| d["status"] == 200).count();
    let done = (0..600).any(|_| {
        std::thread::sleep(Duration::from_millis(50));
        let all = deliveries(&record);
        let events: u64 = all
            .iter()
            .filter(|d| d["status"] == 200)
            .map(|d| d["events"].as_u64().unwrap_or(0))
            .sum();
        accepted(&all) >= 1 && events >= issued.len() as u64
    });
    let all = deliveries(&record);
    assert!(done, "every issued key's event is delivered: {all:#?}");
    for d in &all {
        assert_ne!(
            d["status"], 401,
            "a delivery the package did not verify: {d}"
        );
        // Every delivery verifies, those answered 503 too: a retry is no excuse.
        assert_eq!(
            d["verified"],
            serde_json::json!({"0": true, "1": true}),
            "{d}"
        );
        for check in ["tampered_body", "wrong_secret", "old_timestamp"] {
            assert_eq!(d["refused"][check], true, "{check} was not refused: {d}");
        }
        let id = d["id"].as_str().expect("webhook-id");
        let spool_id = std::fs::read_to_string(spool.join("spool-id")).unwrap();
        assert!(id.starts_with(&format!("{spool_id}/")), "{id}");
    }
    let failed: Vec<&Value> = all.iter().filter(|d| d["status"] == 503).collect();
    assert_eq!(failed.len(), 2, "{all:#?}");
    for d in failed {
        assert!(
            all.iter().any(|a| a["status"] == 200 && a["id"] == d["id"]),
            "the failed batch {} came again under its id: {all:#?}",
            d["id"]
        );
    }
    stop(gateway);

    std::fs::write(&secret, "plain-secret\n").unwrap();
    let (ok, said) = check(&f, &spec);
    assert!(!ok, "a plain secret passes check for the standard scheme");
    assert!(
        said.contains("events_webhook_signature") && said.contains("whsec_"),
        "{said}"
    );
    assert!(!said.contains("plain-secret"), "{said}");
}
