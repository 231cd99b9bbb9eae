//! API keys at the gateway: their format (environment prefix, checksum), expiry, per-key
//! limits and the audit log of changes, with the real CLI and gateway.

use std::time::{Duration, Instant};

use e2e::{fresh_minute, gateway_cli, header, EchoUpstream, Fixture, GatewayProcess};
use serde_json::Value;

async fn get(gw: &GatewayProcess, key: &str) -> reqwest::Response {
    reqwest::Client::new()
        .get(gw.url("/v1/pets"))
        .bearer_auth(key)
        .send()
        .await
        .unwrap()
}

/// New keys start with the environment's prefix and end with a checksum; a mistyped one is
/// refused as malformed (no lookup), and keys of the old format keep working.
#[tokio::test]
async fn keys_carry_the_environment_prefix_and_a_checksum_and_a_typo_is_malformed() {
    let f = Fixture::new(600, 100_000);
    let key = f.issue("free");
    assert!(key.starts_with("pet_test_") && key.len() == 39, "{key}");
    assert!(key["pet_test_".len()..]
        .bytes()
        .all(|b| b.is_ascii_alphanumeric()));
    // A key of the old format, written as an earlier version did.
    let legacy = format!("pet_{}", "ab".repeat(32));
    let hash = {
        use sha2::Digest as _;
        hex::encode(sha2::Sha256::digest(legacy.as_bytes()))
    };
    let mut text = std::fs::read_to_string(&f.keys).unwrap();
    text.push_str(&format!(
        "\n[[key]]\nid = \"key_legacy\"\nplan = \"free\"\nsha256 = \"{hash}\"\n\
         created_at = \"2025-01-01T00:00:00Z\"\n"
    ));
    std::fs::write(&f.keys, text).unwrap();
    let upstream = EchoUpstream::start();
    let gw = f.gateway(&f.spec(upstream.addr));

    assert_eq!(get(&gw, &key).await.status(), 200);
    assert_eq!(
        get(&gw, &legacy).await.status(),
        200,
        "old keys keep working"
    );
    let mut typo = key.clone().into_bytes();
    let i = "pet_test_".len() + 5;
    typo[i] = if typo[i] == b'x' { b'y' } else { b'x' };
    let resp = get(&gw, &String::from_utf8(typo).unwrap()).await;
    assert_eq!(resp.status(), 401);
    let body: Value = resp.json().await.unwrap();
    assert!(
        body["message"].as_str().unwrap().contains("checksum"),
        "{body}"
    );
    assert_eq!(
        gw.metric("pet_gateway_auth_failures_total{reason=\"malformed\"}")
            .await,
        1.0
    );
    assert_eq!(
        gw.metric("pet_gateway_auth_failures_total{reason=\"unknown\"}")
            .await,
        0.0
    );

    // Production keys say so.
    let config = f.dir.path().join("production.toml");
    std::fs::write(
        &config,
        format!(
            "environment = \"production\"\nkeys_file = \"{}\"\nplans_dir = \"{}\"\n",
            f.dir.path().join("live-keys.toml").display(),
            f.plans.display()
        ),
    )
    .unwrap();
    let out = gateway_cli(&[
        "keys",
        "issue",
        "--config",
        &config.to_string_lossy(),
        "--plan",
        "free",
    ]);
    assert!(out.status.success(), "{out:?}");
    let live = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap()
        .to_owned();
    assert!(live.starts_with("pet_live_") && live.len() == 39, "{live}");
}

/// A key's own limits replace its plan's in the headers and the decision; at its expiry it
/// gets 401 saying it expired (within a second), and `keys list` shows it expired.
#[tokio::test]
async fn per_key_limits_apply_and_an_expired_key_is_refused_on_time() {
    let f = Fixture::new(600, 100_000);
    // Before issuing: waiting for a fresh minute must not eat into the key's 5 s (4 to 5 s of life).
    fresh_minute(Duration::from_secs(15));
    // Taken before the command, which sets the end from its own clock (its whole second + 5 s):
    // the key then has at least 4 s of life counted from here, however long the command takes to
    // save and exit.
    let issued = Instant::now();
    let out = gateway_cli(&[
        "keys",
        "issue",
        "--keys-file",
        &f.keys.to_string_lossy(),
        "--plans-dir",
        &f.plans.to_string_lossy(),
        "--plan",
        "free",
        "--per-minute",
        "2",
        "--expires-in",
        "5s",
    ]);
    assert!(out.status.success(), "{out:?}");
    let key = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap()
        .to_owned();
    let upstream = EchoUpstream::start();
    let gw = f.gateway(&f.spec(upstream.addr));

    let first = get(&gw, &key).await;
    assert_eq!(first.status(), 200);
    assert_eq!(header(&first, "x-ratelimit-limit").as_deref(), Some("2"));
    let policy = header(&first, "ratelimit-policy").unwrap();
    assert!(policy.contains("\"minute\";q=2;"), "{policy}");
    assert_eq!(get(&gw, &key).await.status(), 200);
    assert_eq!(
        get(&gw, &key).await.status(),
        429,
        "the key's own limit binds"
    );

    // Expiry: 401 from the expiry time on (checked on every request, so within a second).
    let mut status = 0;
    while issued.elapsed() < Duration::from_secs(10) {
        let resp = get(&gw, &key).await;
        status = resp.status().as_u16();
        if status == 401 {
            let body: Value = resp.json().await.unwrap();
            assert!(
                body["message"].as_str().unwrap().contains("expired"),
                "{body}"
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(status, 401, "never expired");
    assert!(issued.elapsed() >= Duration::from_secs(4), "expired early");
    let listing = gateway_cli(&["keys", "list", "--keys-file", &f.keys.to_string_lossy()]);
    assert!(String::from_utf8_lossy(&listing.stdout).contains("expired"));
    assert!(
        gw.metric("pet_gateway_auth_failures_total{reason=\"expired\"}")
            .await
            >= 1.0
    );
}

/// Every key change is one JSON line in the audit log (standard error by default): time,
/// action, key id, plan, who; never the key.
#[test]
fn every_key_change_is_audited_without_the_key() {
    let f = Fixture::new(60, 1000);
    let audit = f.dir.path().join("audit.log");
    let files = [
        "--keys-file",
        &*f.keys.to_string_lossy(),
        "--audit-log",
        &*audit.to_string_lossy(),
    ]
    .map(str::to_owned);
    let run = |args: &[&str]| {
        let mut all: Vec<&str> = args.to_vec();
        all.extend(files.iter().map(String::as_str));
        gateway_cli(&all)
    };
    let plans = f.plans.to_string_lossy().to_string();
    let out = run(&["keys", "issue", "--plan", "free", "--plans-dir", &plans]);
    assert!(out.status.success(), "{out:?}");
    let key = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap()
        .to_owned();
    let id = e2e::first_key_id(&f.keys);
    // No gateway runs: the revocation is in the file (and audited), unconfirmed.
    let nobody = e2e::free_addr().to_string();
    let out = run(&["keys", "revoke", &id, "--admin-listen", &nobody]);
    assert!(!out.status.success());

    let log = std::fs::read_to_string(&audit).unwrap();
    let lines: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{log}");
    for (line, action) in lines.iter().zip(["issue", "revoke"]) {
        assert_eq!(line["action"], action);
        assert_eq!(line["key_id"], id.as_str());
        assert_eq!(line["plan"], "free");
        assert!(!line["who"].as_str().unwrap().is_empty());
        assert!(line["time"].as_str().unwrap().ends_with('Z'));
    }
    assert!(!log.contains(&key["pet_test_".len()..]), "never the key");

    // Without --audit-log: standard error.
    let out = gateway_cli(&[
        "keys",
        "issue",
        "--plan",
        "free",
        "--keys-file",
        &f.keys.to_string_lossy(),
        "--plans-dir",
        &plans,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("\"action\":\"issue\""), "{stderr}");
}

/// With `admin_token`, every admin request must carry it (the CLI sends it from the config);
/// `check` refuses an admin listener reachable from other hosts without one.
#[tokio::test]
async fn the_admin_listener_requires_its_token_when_one_is_set() {
    let f = Fixture::new(60, 1000);
    f.issue("free");
    let upstream = EchoUpstream::start();
    let mut spec = f.spec(upstream.addr);
    let token = "s3cret-admin-token-0123456789ABCDEFG";
    spec.extra = format!("admin_token = \"{token}\"\n");
    let gw = f.gateway(&spec);
    let client = reqwest::Client::new();
    let metrics = |auth: Option<&str>| {
        let mut req = client.get(gw.admin_url("/metrics"));
        if let Some(auth) = auth {
            req = req.bearer_auth(auth);
        }
        req.send()
    };
    let refused = metrics(None).await.unwrap();
    assert_eq!(refused.status(), 401);
    assert_eq!(
        header(&refused, "www-authenticate").as_deref(),
        Some("Bearer")
    );
    assert_eq!(
        metrics(Some("s3cret-admin-token-0123456789ABCDEFH"))
            .await
            .unwrap()
            .status(),
        401
    );
    assert_eq!(metrics(Some(token)).await.unwrap().status(), 200);

    let config = gw.config.to_string_lossy().to_string();
    let out = gateway_cli(&["bans", "list", "--config", &config]);
    assert!(
        out.status.success(),
        "the CLI sends the config's token: {out:?}"
    );
    let admin = gw.admin.to_string();
    let out = gateway_cli(&["bans", "list", "--admin-listen", &admin]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("401"),
        "{out:?}"
    );
    // `health`, the probes' command, says that it lacks the token, and sends it from the
    // variable a container's environment sets.
    let out = gateway_cli(&["health", "--admin-listen", &admin]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("wants the admin token"),
        "{out:?}"
    );
    let probe = |token: &str| {
        std::process::Command::new(e2e::bin_path("pet-gateway"))
            .args(["health", "--ready", "--admin-listen", &admin])
            .env("PET_GATEWAY_ADMIN_TOKEN", token)
            .output()
            .unwrap()
    };
    assert!(probe(token).status.success());
    assert_eq!(
        probe("s3cret-admin-token-0123456789ABCDEFH").status.code(),
        Some(1)
    );
    drop(gw);
    let out = gateway_cli(&["health", "--config", &config]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("does not answer"),
        "{out:?}"
    );

    let open = f.dir.path().join("open-admin.toml");
    let base = format!(
        "admin_listen = \"0.0.0.0:{}\"\nkeys_file = \"{}\"\nplans_dir = \"{}\"\n",
        e2e::free_addr().port(),
        f.keys.display(),
        f.plans.display()
    );
    std::fs::write(&open, &base).unwrap();
    let out = gateway_cli(&["check", "--config", &open.to_string_lossy()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("admin_token"),
        "{stderr}"
    );
    std::fs::write(&open, format!("{base}admin_token = \"{token}\"\n")).unwrap();
    let out = gateway_cli(&["check", "--config", &open.to_string_lossy()]);
    assert!(out.status.success(), "{out:?}");
}

/// `keys rotate`: the successor shares the old key's plan, limits and quota (rotating cannot
/// double a quota), both work during the overlap, and the old one stops when it ends.
#[tokio::test]
async fn a_rotated_key_shares_its_quota_with_its_successor_and_stops_after_the_overlap() {
    let f = Fixture::new(600, 100_000);
    let keys = f.keys.to_string_lossy().to_string();
    let plans = f.plans.to_string_lossy().to_string();
    let out = gateway_cli(&[
        "keys",
        "issue",
        "--keys-file",
        &keys,
        "--plans-dir",
        &plans,
        "--plan",
        "free",
        "--per-minute",
        "5",
    ]);
    assert!(out.status.success(), "{out:?}");
    let old = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap()
        .to_owned();
    let old_id = e2e::first_key_id(&f.keys);
    let upstream = EchoUpstream::start();
    let gw = f.gateway(&f.spec(upstream.addr));
    // 5 a minute for both keys, counted through a rotation and the successor's load (two
    // commands, up to 2 s): within one minute, measured once the gateway is up.
    fresh_minute(Duration::from_secs(20));
    for _ in 0..3 {
        assert_eq!(get(&gw, &old).await.status(), 200);
    }

    let out = gateway_cli(&[
        "keys",
        "rotate",
        "--keys-file",
        &keys,
        "--overlap",
        "5s",
        &old_id,
    ]);
    assert!(out.status.success(), "{out:?}");
    let rotated = Instant::now();
    let new = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap()
        .to_owned();
    assert!(new.starts_with("pet_test_") && new != old);
    // Shared quota: 5 per minute for both together, 3 used already.
    let mut first = None;
    let started = Instant::now();
    while first.is_none() {
        let resp = get(&gw, &new).await;
        if resp.status() == 200 {
            first = Some(resp);
        } else {
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "the successor never loaded"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let first = first.unwrap();
    assert_eq!(
        header(&first, "x-ratelimit-limit").as_deref(),
        Some("5"),
        "same limits"
    );
    assert_eq!(
        header(&first, "x-ratelimit-remaining").as_deref(),
        Some("1"),
        "same quota"
    );
    assert_eq!(
        get(&gw, &old).await.status(),
        200,
        "the old key works during the overlap"
    );
    assert_eq!(get(&gw, &new).await.status(), 429, "5 in all, not 10");
    let listing = gateway_cli(&["keys", "list", "--keys-file", &keys]);
    assert!(String::from_utf8_lossy(&listing.stdout).contains("rotated until"));

    // After the overlap the old key is refused; the new one is not.
    while rotated.elapsed() < Duration::from_secs(6) {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(get(&gw, &old).await.status(), 401);
    assert_ne!(get(&gw, &new).await.status(), 401);
}

/// `keys show` reports a key's usage this minute and today, equal to the requests sent;
/// `keys reset-usage` zeroes it; `keys list --json` is one JSON array and nothing else.
#[tokio::test]
async fn show_reports_usage_reset_usage_zeroes_it_and_list_json_is_pure_json() {
    let f = Fixture::new(600, 100_000);
    let key = f.issue("free");
    let id = e2e::first_key_id(&f.keys);
    let upstream = EchoUpstream::start();
    let gw = f.gateway(&f.spec(upstream.addr));
    // The minute's usage is read back by two `keys show` commands: within one minute, measured
    // once the gateway is up.
    fresh_minute(Duration::from_secs(15));
    for _ in 0..4 {
        assert_eq!(get(&gw, &key).await.status(), 200);
    }
    let keys = f.keys.to_string_lossy().to_string();
    let admin = gw.admin.to_string();
    let show = |json: bool| {
        let mut args = vec![
            "keys",
            "show",
            "--keys-file",
            &keys,
            "--admin-listen",
            &admin,
        ];
        if json {
            args.push("--json");
        }
        args.push(&id);
        gateway_cli(&args)
    };
    let out = show(true);
    assert!(out.status.success(), "{out:?}");
    let shown: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["status"], "active");
    assert_eq!(shown["plan"], "free");
    assert_eq!(shown["limits"]["per_minute"], 600);
    assert_eq!(
        (
            shown["usage"]["minute"].as_u64(),
            shown["usage"]["day"].as_u64()
        ),
        (Some(4), Some(4))
    );
    assert_eq!(shown["usage"]["refused_today"], 0);
    assert!(
        shown["usage"]["last_used"]
            .as_str()
            .unwrap()
            .ends_with(":00Z"),
        "to the minute"
    );
    let text = String::from_utf8_lossy(&show(false).stdout).to_string();
    assert!(
        text.contains("4 of 600 this minute, 4 of 100000 today"),
        "{text}"
    );
    assert!(
        text.contains("last used:") && text.contains("429s today:"),
        "{text}"
    );

    let out = gateway_cli(&[
        "keys",
        "reset-usage",
        "--keys-file",
        &keys,
        "--admin-listen",
        &admin,
        &id,
    ]);
    assert!(out.status.success(), "{out:?}");
    let shown: Value = serde_json::from_slice(&show(true).stdout).unwrap();
    assert_eq!(shown["usage"]["minute"], 0);
    assert_eq!(shown["usage"]["day"], 0);
    let next = get(&gw, &key).await;
    assert_eq!(
        header(&next, "x-ratelimit-remaining").as_deref(),
        Some("599")
    );

    f.issue("free");
    let out = gateway_cli(&[
        "keys",
        "list",
        "--json",
        "--keys-file",
        &keys,
        "--admin-listen",
        &admin,
    ]);
    assert!(out.status.success(), "{out:?}");
    let list: Value = serde_json::from_slice(&out.stdout).expect("only JSON on stdout");
    assert_eq!(list.as_array().unwrap().len(), 2);
    let first = list
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["id"] == id.as_str())
        .unwrap();
    assert_eq!(first["usage"]["day"], 1, "usage per key in the JSON list");
    assert!(list[0].get("sha256").is_none(), "never the hash");
}

/// The admin API does what the `keys` commands do, in force when it answers, audited as
/// `admin`, behind the admin token.
#[tokio::test]
async fn the_admin_key_api_issues_rotates_and_revokes_in_force_at_once() {
    let f = Fixture::new(600, 100_000);
    let upstream = EchoUpstream::start();
    let mut spec = f.spec(upstream.addr);
    let token = "another-admin-token-0123456789ABCDEF42";
    let audit = f.dir.path().join("audit.log");
    spec.extra = format!(
        "admin_token = \"{token}\"\naudit_log = \"{}\"\nreload_interval_ms = 60000\n",
        audit.display()
    );
    let gw = f.gateway(&spec);
    fresh_minute(Duration::from_secs(15));
    let client = reqwest::Client::new();
    let call = |method: reqwest::Method, path: &str, body: Option<Value>| {
        let mut req = client
            .request(method, gw.admin_url(path))
            .bearer_auth(token);
        if let Some(body) = body {
            req = req.json(&body);
        }
        req.send()
    };

    let resp = call(
        reqwest::Method::POST,
        "/keys",
        Some(serde_json::json!({"plan": "free", "name": "acme", "per_minute": 3})),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 201);
    let issued: Value = resp.json().await.unwrap();
    let (id, key) = (
        issued["id"].as_str().unwrap().to_owned(),
        issued["key"].as_str().unwrap().to_owned(),
    );
    assert_eq!(issued["per_minute"], 3);
    // In force at once (the background reload is a minute away).
    let first = get(&gw, &key).await;
    assert_eq!(first.status(), 200);
    assert_eq!(header(&first, "x-ratelimit-limit").as_deref(), Some("3"));

    let listed: Value = call(reqwest::Method::GET, "/keys", None)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 1);
    assert!(!listed.to_string().contains(&key[9..]), "never the key");

    for (body, status) in [
        (serde_json::json!({"name": "no plan"}), 400),
        (serde_json::json!({"plan": "gold"}), 400),
        (
            serde_json::json!({"plan": "free", "per_minute": "many"}),
            400,
        ),
        (
            serde_json::json!({"plan": "free", "expires_in": "yesterday"}),
            400,
        ),
        (serde_json::json!({"plan": "free", "expires_in": 3600}), 400),
        (
            serde_json::json!({"plan": "free", "expires_in": "1h", "expires_at": "2099-01-01T00:00:00Z"}),
            400,
        ),
        (serde_json::json!({"plan": "free", "typo": 1}), 400),
    ] {
        let resp = call(reqwest::Method::POST, "/keys", Some(body.clone()))
            .await
            .unwrap();
        assert_eq!(resp.status(), status, "{body}");
    }
    let resp = call(reqwest::Method::POST, "/keys/key_nope/revoke", None)
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);

    let rotated: Value = call(
        reqwest::Method::POST,
        &format!("/keys/{id}/rotate"),
        Some(serde_json::json!({"overlap": "0s"})),
    )
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    let new_key = rotated["new"]["key"].as_str().unwrap().to_owned();
    let new_id = rotated["new"]["id"].as_str().unwrap().to_owned();
    assert_eq!(
        get(&gw, &key).await.status(),
        401,
        "no overlap: the old key stops now"
    );
    let next = get(&gw, &new_key).await;
    assert_eq!(
        header(&next, "x-ratelimit-remaining").as_deref(),
        Some("1"),
        "one quota"
    );

    let resp = call(
        reqwest::Method::POST,
        &format!("/keys/{new_id}/revoke"),
        None,
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    let revoked: Value = resp.json().await.unwrap();
    assert_eq!(revoked["in_force"], true);
    assert_eq!(get(&gw, &new_key).await.status(), 401);

    let log = std::fs::read_to_string(&audit).unwrap();
    let actions: Vec<String> = log
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .inspect(|v| assert_eq!(v["who"], "admin"))
        .map(|v| v["action"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(actions, ["issue", "rotate", "revoke"]);
    assert!(!log.contains(&key[9..]) && !log.contains(&new_key[9..]));
    let refused = client.get(gw.admin_url("/keys")).send().await.unwrap();
    assert_eq!(refused.status(), 401, "the token guards the key API");
}
