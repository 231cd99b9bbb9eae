//! The gateway at its edges, end to end with real processes: who gets in (401 and the per-IP
//! limit), what reaches the backend, hot reload of keys and plans, a lost backend, and the
//! `check` command on the shipped configs.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use e2e::{
    fresh_minute, gateway_cli, header, issue_key, write_plan, Backend, EchoUpstream, Fixture,
    GatewayProcess, GatewaySpec, SilentUpstream,
};
use serde_json::Value;

fn repo_root() -> PathBuf {
    e2e::repo_root()
}

fn setup() -> Fixture {
    Fixture::new(60, 1000)
}

async fn expect_401(resp: reqwest::Response) {
    assert_eq!(resp.status(), 401);
    assert_eq!(header(&resp, "www-authenticate").as_deref(), Some("Bearer"));
    assert_eq!(
        header(&resp, "content-type").as_deref(),
        Some("application/json")
    );
    for h in [
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
    ] {
        assert!(header(&resp, h).is_some(), "401 carries {h}");
    }
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["code"], "unauthorized");
    assert_eq!(body["status"], 401);
}

#[tokio::test]
async fn missing_malformed_unknown_and_revoked_keys_get_401_and_are_never_forwarded() {
    let s = setup();
    let key = issue_key(&s.keys, &s.plans, "free");
    let revoked = issue_key(&s.keys, &s.plans, "free");
    let list = gateway_cli(&["keys", "list", "--keys-file", &s.keys.to_string_lossy()]);
    let listing = String::from_utf8_lossy(&list.stdout).to_string();
    assert!(
        !listing.contains(&key[4..]) && !listing.contains(&revoked[4..]),
        "keys list never shows keys"
    );
    // With no gateway to ask about bans, the note comes after the whole table, on a line of
    // its own, even when both streams go to one terminal.
    let both = std::process::Command::new("sh")
        .arg("-c")
        .arg("\"$0\" keys list --keys-file \"$1\" --admin-listen 127.0.0.1:1 2>&1")
        .arg(e2e::bin_path("pet-gateway"))
        .arg(&s.keys)
        .output()
        .unwrap();
    let both = String::from_utf8_lossy(&both.stdout).to_string();
    let lines: Vec<&str> = both.lines().collect();
    assert_eq!(lines.len(), 5, "{both}");
    assert!(
        lines[0].starts_with("ID ") && lines[2].starts_with("key_"),
        "{both}"
    );
    assert_eq!(lines[3], "", "{both}");
    assert!(lines[4].starts_with("note: ban status unknown"), "{both}");
    let revoked_id = listing
        .lines()
        .nth(2)
        .and_then(|l| l.split_whitespace().next())
        .unwrap()
        .to_owned();
    // No gateway runs yet: the file records the revocation, and the command says it could
    // not confirm it in force rather than pretending.
    let nobody = e2e::free_addr().to_string();
    let out = gateway_cli(&[
        "keys",
        "revoke",
        "--keys-file",
        &s.keys.to_string_lossy(),
        "--admin-listen",
        &nobody,
        &revoked_id,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("NOT confirmed"), "{stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("revoked"));

    // Nothing listens upstream: a forwarded request would be a 502, not a 401.
    let nowhere = e2e::free_addr();
    let gw = GatewayProcess::start(s.dir.path(), &GatewaySpec::new(nowhere, &s.keys, &s.plans));
    let client = reqwest::Client::new();
    let url = gw.url("/v1/pets");
    expect_401(client.get(&url).send().await.unwrap()).await;
    for value in ["Basic dXNlcjpwYXNz", "Bearer", "Bearer a b", "Token abc"] {
        expect_401(
            client
                .get(&url)
                .header("authorization", value)
                .send()
                .await
                .unwrap(),
        )
        .await;
    }
    expect_401(
        client
            .get(&url)
            .bearer_auth("pet_0000")
            .send()
            .await
            .unwrap(),
    )
    .await;
    expect_401(client.get(&url).bearer_auth(&revoked).send().await.unwrap()).await;
    // The valid key does get forwarded (and fails upstream).
    assert_eq!(
        client
            .get(&url)
            .bearer_auth(&key)
            .send()
            .await
            .unwrap()
            .status(),
        502
    );
    // No key material in the log.
    let log = gw.log_text();
    assert!(
        !log.contains(&key[4..]) && !log.contains(&revoked[4..]),
        "the log never holds a key"
    );
}

#[tokio::test]
async fn unauthenticated_requests_are_limited_per_address() {
    let s = setup();
    let mut spec = GatewaySpec::new(e2e::free_addr(), &s.keys, &s.plans);
    spec.extra = "unauthenticated_per_minute = 3\n".into();
    let gw = GatewayProcess::start(s.dir.path(), &spec);
    let client = reqwest::Client::new();
    for remaining in [2, 1, 0] {
        let resp = client
            .get(gw.url("/v1/pets"))
            .bearer_auth("pet_guess")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 401);
        assert_eq!(header(&resp, "x-ratelimit-limit").as_deref(), Some("3"));
        assert_eq!(
            header(&resp, "x-ratelimit-remaining"),
            Some(remaining.to_string())
        );
    }
    let resp = client
        .get(gw.url("/v1/pets"))
        .bearer_auth("pet_guess")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429);
    let retry: u64 = header(&resp, "retry-after").unwrap().parse().unwrap();
    assert!((1..=20).contains(&retry), "{retry}");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["code"], "rate_limited");
}

/// A backend that sends its own request id and rate-limit fields: the client gets the
/// gateway's, each once (the gateway adds its own beside the head's maps, where they replace
/// nothing by themselves).
#[tokio::test]
async fn the_backends_own_request_id_and_rate_limit_fields_are_replaced() {
    let s = setup();
    let key = issue_key(&s.keys, &s.plans, "free");
    let echo = EchoUpstream::start_answering_with(
        "X-Request-Id: backend-id\r\nX-RateLimit-Limit: 999\r\nratelimit: \"x\";r=1\r\n\
         X-RateLimit-Remaining: 998\r\nX-Backend: kept\r\n",
    );
    let gw = GatewayProcess::start(
        s.dir.path(),
        &GatewaySpec::new(echo.addr, &s.keys, &s.plans),
    );
    let resp = reqwest::Client::new()
        .get(gw.url("/v1/pets"))
        .bearer_auth(&key)
        .header("x-request-id", "client-id")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let all = |name: &str| -> Vec<String> {
        resp.headers()
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(all("x-request-id"), ["client-id"]);
    assert_eq!(all("x-ratelimit-limit"), ["60"]);
    assert_eq!(all("x-ratelimit-remaining"), ["59"]);
    assert_eq!(all("ratelimit").len(), 1);
    assert!(
        !all("ratelimit")[0].contains("\"x\""),
        "{:?}",
        all("ratelimit")
    );
    assert_eq!(all("x-ratelimit-reset").len(), 1);
    assert_eq!(all("ratelimit-policy").len(), 1);
    assert_eq!(all("x-backend"), ["kept"]);
}

/// The gateway keeps backend connections open for reuse; a backend that closes an idle one
/// (a short keep-alive timeout) must never cost a client an error, not even on a `POST`, which
/// is not retried: a connection its backend closed is found closed before it is used.
#[tokio::test]
async fn a_backend_closing_idle_connections_costs_no_request_an_error() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let s = setup();
    let key = issue_key(&s.keys, &s.plans, "free");
    let accepted = std::sync::Arc::new(AtomicUsize::new(0));
    let echo = EchoUpstream::start_closing_idle_after(Duration::from_millis(100), accepted.clone());
    let gw = GatewayProcess::start(
        s.dir.path(),
        &GatewaySpec::new(echo.addr, &s.keys, &s.plans),
    );
    let client = reqwest::Client::new();
    for i in 0..6 {
        let resp = client
            .post(gw.url("/v1/pets"))
            .bearer_auth(&key)
            .json(&serde_json::json!({"name": format!("rex{i}"), "species": "dog"}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "request {i}: {:?}", resp.text().await);
        // Past the backend's idle timeout: the connection just used is closed meanwhile.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        6,
        "each request needed a new connection"
    );
}

#[tokio::test]
async fn the_backend_gets_identity_headers_instead_of_the_key() {
    let s = setup();
    let key = issue_key(&s.keys, &s.plans, "free");
    let echo = EchoUpstream::start();
    let gw = GatewayProcess::start(
        s.dir.path(),
        &GatewaySpec::new(echo.addr, &s.keys, &s.plans),
    );
    let client = reqwest::Client::new();
    let resp = client
        .get(gw.url("/v1/pets"))
        .bearer_auth(&key)
        .header("x-request-id", "trace-123")
        .header("x-api-key-id", "forged")
        .header("x-plan", "enterprise")
        .header("X-Plan", "business") // a second field of the name: both go
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(header(&resp, "x-request-id").as_deref(), Some("trace-123"));
    let seen = resp.text().await.unwrap().to_ascii_lowercase();
    assert!(!seen.contains("authorization"), "{seen}");
    assert!(!seen.contains(&key[4..]), "{seen}");
    assert!(seen.contains("x-api-key-id: key_"), "{seen}");
    assert!(
        !seen.contains("forged")
            && !seen.contains("x-plan: enterprise")
            && !seen.contains("x-plan: business"),
        "{seen}"
    );
    assert!(seen.contains("x-plan: free"), "{seen}");
    assert!(seen.contains("x-request-id: trace-123"), "{seen}");
    // Each once: the client's own are removed, not sent beside the gateway's.
    for name in ["x-request-id:", "x-api-key-id:", "x-plan:"] {
        assert_eq!(seen.matches(name).count(), 1, "{name} in {seen}");
    }

    // Without a client id the gateway makes one, sends it upstream and echoes it.
    let resp = client
        .get(gw.url("/v1/pets"))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    let id = header(&resp, "x-request-id").expect("generated request id");
    assert!(id.len() >= 16);
    assert!(resp
        .text()
        .await
        .unwrap()
        .contains(&format!("x-request-id: {id}")));
}

/// Polls until `check` holds or `within` passes; returns how long it took.
async fn eventually<F, Fut>(within: Duration, mut check: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    loop {
        if check().await {
            return started.elapsed();
        }
        assert!(started.elapsed() < within, "not within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn limit_of(client: &reqwest::Client, gw: &GatewayProcess, key: &str) -> Option<String> {
    let resp = client
        .get(gw.url("/v1/pets"))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    header(&resp, "x-ratelimit-limit").filter(|_| resp.status() != 401)
}

#[tokio::test]
async fn revocations_and_plan_edits_apply_within_two_seconds_and_bad_edits_are_refused() {
    let s = setup();
    let key = issue_key(&s.keys, &s.plans, "free");
    let other = issue_key(&s.keys, &s.plans, "free");
    let backend = Backend::start(&s.dir.path().join("pets.db"));
    let gw = GatewayProcess::start(
        s.dir.path(),
        &GatewaySpec::new(backend.addr, &s.keys, &s.plans),
    );
    let client = reqwest::Client::new();
    fresh_minute(Duration::from_secs(15));
    assert_eq!(limit_of(&client, &gw, &key).await.as_deref(), Some("60"));

    // Revoke: 401 within 2 s, no restart.
    let file = std::fs::read_to_string(&s.keys).unwrap();
    let id = file
        .lines()
        .find_map(|l| l.strip_prefix("id = \""))
        .map(|l| l.trim_end_matches('"').to_owned())
        .unwrap();
    let admin = gw.admin.to_string();
    let out = gateway_cli(&[
        "keys",
        "revoke",
        "--keys-file",
        &s.keys.to_string_lossy(),
        "--admin-listen",
        &admin,
        &id,
    ]);
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("in force"));
    let took = eventually(Duration::from_secs(2), || async {
        client
            .get(gw.url("/v1/pets"))
            .bearer_auth(&key)
            .send()
            .await
            .unwrap()
            .status()
            == 401
    })
    .await;
    println!("revocation applied after {took:?}");

    // Edit a limit: the next requests see it within 2 s.
    write_plan(&s.plans, "free", 30, 1000);
    eventually(Duration::from_secs(2), || async {
        limit_of(&client, &gw, &other).await.as_deref() == Some("30")
    })
    .await;

    // A broken edit is refused, logged naming file and field; the last good limits stay.
    std::fs::write(
        s.plans.join("free.toml"),
        "requests_per_minute = \"lots\"\nrequests_per_day = 1000\n",
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    assert_eq!(limit_of(&client, &gw, &other).await.as_deref(), Some("30"));
    let log = gw.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("free.toml") && l.contains("requests_per_minute")),
        "the refusal names the file and the field:\n{log}"
    );
    assert!(gw.process.pid() > 0);
}

#[tokio::test]
async fn sighup_reloads_at_once() {
    let s = setup();
    let key = issue_key(&s.keys, &s.plans, "free");
    let backend = Backend::start(&s.dir.path().join("pets.db"));
    let mut spec = GatewaySpec::new(backend.addr, &s.keys, &s.plans);
    // Polling is slowed to a minute, so only the signal can explain a prompt reload.
    spec.extra = "reload_interval_ms = 60000\n".into();
    let gw = GatewayProcess::start(s.dir.path(), &spec);
    let client = reqwest::Client::new();
    assert_eq!(limit_of(&client, &gw, &key).await.as_deref(), Some("60"));
    write_plan(&s.plans, "free", 42, 1000);
    gw.process.signal(1);
    eventually(Duration::from_secs(2), || async {
        limit_of(&client, &gw, &key).await.as_deref() == Some("42")
    })
    .await;
}

#[tokio::test]
async fn a_stopped_backend_gives_a_fast_502_and_traffic_resumes_when_it_returns() {
    let s = setup();
    let key = issue_key(&s.keys, &s.plans, "free");
    let db = s.dir.path().join("pets.db");
    let backend = Backend::start(&db);
    let addr = backend.addr;
    let gw = GatewayProcess::start(s.dir.path(), &GatewaySpec::new(addr, &s.keys, &s.plans));
    let client = reqwest::Client::new();
    assert_eq!(
        client
            .get(gw.url("/v1/pets"))
            .bearer_auth(&key)
            .send()
            .await
            .unwrap()
            .status(),
        200
    );

    backend.process.kill_hard();
    let started = Instant::now();
    let resp = client
        .get(gw.url("/v1/pets"))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(resp.status(), 502);
    assert_eq!(
        header(&resp, "connection").as_deref(),
        Some("close"),
        "the gateway closes after a 502 and says so"
    );
    assert!(header(&resp, "x-ratelimit-remaining").is_some());
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["code"], "bad_gateway");
    assert_eq!(body["status"], 502);

    let _back = Backend::start_at(addr, &db);
    eventually(Duration::from_secs(5), || async {
        client
            .get(gw.url("/v1/pets"))
            .bearer_auth(&key)
            .send()
            .await
            .unwrap()
            .status()
            == 200
    })
    .await;
}

#[tokio::test]
async fn a_backend_that_does_not_answer_gives_504_after_the_read_timeout() {
    let s = setup();
    let key = issue_key(&s.keys, &s.plans, "free");
    let hung = SilentUpstream::start();
    let mut spec = GatewaySpec::new(hung.addr, &s.keys, &s.plans);
    spec.extra = "upstream_read_timeout_ms = 500\n".into();
    let gw = GatewayProcess::start(s.dir.path(), &spec);
    let client = reqwest::Client::new();
    let started = Instant::now();
    let resp = client
        .get(gw.url("/v1/pets"))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    let took = started.elapsed();
    assert_eq!(resp.status(), 504);
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(3),
        "took {took:?}"
    );
    assert!(header(&resp, "x-ratelimit-limit").is_some());
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["code"], "gateway_timeout");
    assert_eq!(body["status"], 504);
}

#[test]
fn check_passes_on_every_shipped_config_and_names_the_field_of_a_broken_one() {
    let deploy = repo_root().join("deploy");
    // The hosts' secrets the production and staging configs name (/etc/pet-gateway/secrets/,
    // made by "To production"), here files of this test's, by the variables a host could use.
    let secrets = tempfile::tempdir().unwrap();
    let password = secrets.path().join("password");
    std::fs::write(&password, "a-password-of-this-test").unwrap();
    let ca = secrets.path().join("ca.crt");
    std::fs::write(&ca, e2e::tls::TestCert::generate("test-ca").cert_pem).unwrap();
    let mut checked = 0;
    for entry in std::fs::read_dir(&deploy).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let out = std::process::Command::new(e2e::bin_path("pet-gateway"))
                .args(["check", "--config", &path.to_string_lossy()])
                .env("PET_GATEWAY_REDIS_PASSWORD_FILE", &password)
                .env("PET_GATEWAY_REDIS_SENTINEL_PASSWORD_FILE", &password)
                .env("PET_GATEWAY_REDIS_TLS_CA_FILE", &ca)
                .stdin(std::process::Stdio::null())
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{}: {err}", path.display());
            // The one warning a shipped config may give: production's registry has no verify
            // keys yet (the fleet's own key is made at deployment, `registry keygen`).
            let unsigned = "takes the key registry's records unsigned";
            let others = err
                .lines()
                .filter(|l| l.contains("warning") && !l.contains(unsigned));
            assert_eq!(others.count(), 0, "{}: {err}", path.display());
            if path.ends_with("production.toml") {
                assert!(err.contains(unsigned), "{err}");
            }
            checked += 1;
        }
    }
    assert!(
        checked >= 3,
        "production, staging and local configs are shipped"
    );

    // A production config pointing every node at its own loopback Redis loads, with a warning.
    let dir = tempfile::tempdir().unwrap();
    let fleet = dir.path().join("fleet.toml");
    std::fs::write(
        &fleet,
        format!(
            "environment = \"production\"\nredis_url = \"redis://127.0.0.1:6379/0\"\n\
             plans_dir = \"{}\"\n",
            repo_root().join("plans").display()
        ),
    )
    .unwrap();
    let out = gateway_cli(&["check", "--config", &fleet.to_string_lossy()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("warning") && err.contains("loopback"), "{err}");

    let broken = dir.path().join("broken.toml");
    std::fs::write(
        &broken,
        "listen = \"127.0.0.1:8080\"\nstore_timeout_ms = 0\n",
    )
    .unwrap();
    let out = gateway_cli(&["check", "--config", &broken.to_string_lossy()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("broken.toml") && err.contains("store_timeout_ms"),
        "{err}"
    );

    // A broken plan is reported with its file and field.
    let plans = dir.path().join("plans");
    std::fs::create_dir_all(&plans).unwrap();
    std::fs::write(plans.join("pro.toml"), "requests_per_minute = 300\n").unwrap();
    let cfg = dir.path().join("gw.toml");
    std::fs::write(&cfg, "plans_dir = \"plans\"\n").unwrap();
    let out = gateway_cli(&["check", "--config", &cfg.to_string_lossy()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("pro.toml") && err.contains("requests_per_day"),
        "{err}"
    );
}

#[test]
fn keys_issue_refuses_a_plan_without_a_file() {
    let s = setup();
    let out = gateway_cli(&[
        "keys",
        "issue",
        "--keys-file",
        &s.keys.to_string_lossy(),
        "--plans-dir",
        &s.plans.to_string_lossy(),
        "--plan",
        "platinum",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("platinum"));
    assert!(!s.keys.exists());
}

/// A hand-edited key id that would break the identity header, the Redis hash tag or the lift
/// URL is refused on load, naming the file and the field.
#[test]
fn key_ids_that_are_not_safe_everywhere_are_refused() {
    let s = setup();
    std::fs::write(
        &s.keys,
        format!(
            "[[key]]\nid = \"acme key}}\"\nplan = \"free\"\nsha256 = \"{}\"\n\
             created_at = \"2026-01-01T00:00:00Z\"\n",
            "ab".repeat(32)
        ),
    )
    .unwrap();
    let out = gateway_cli(&[
        "check",
        "--keys-file",
        &s.keys.to_string_lossy(),
        "--plans-dir",
        &s.plans.to_string_lossy(),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("keys.toml") && err.contains("field `id`"),
        "{err}"
    );
}
