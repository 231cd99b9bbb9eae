//! `pet-client` and `pet` against the real gateway and backend: paging, the commands, and the
//! retry behaviour the interface asks of clients, measured on the gateway's own metrics (a
//! client that waits as it should never collects the strikes that earn a ban; one that does not
//! wait does).

use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use e2e::{write_plan, Backend, Fixture, GatewayProcess};
use pet_client::{Client, NewPet, RetryPolicy};
use serde_json::Value;

/// Sleeps until the wall clock is at least `second` seconds into a minute (and not past 57), so
/// that a wait for the next minute is short.
fn late_in_a_minute(second: u64) {
    loop {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let into = now.as_secs() % 60;
        if (second..=57).contains(&into) {
            return;
        }
        let to = if into < second {
            second - into
        } else {
            60 - into + second
        };
        std::thread::sleep(
            Duration::from_secs(to) - Duration::from_millis(u64::from(now.subsec_millis())),
        );
    }
}

fn gateway(s: &Fixture, extra: &str) -> (Backend, GatewayProcess) {
    let backend = Backend::start(&s.dir.path().join("pets.db"));
    let mut spec = s.spec(backend.addr);
    spec.extra = extra.into();
    let gw = GatewayProcess::start(s.dir.path(), &spec);
    (backend, gw)
}

fn pet_cli(gw: &GatewayProcess, key: &str, args: &[&str]) -> Value {
    let out = Command::new(e2e::bin_path("pet"))
        .args(args)
        .env("PET_API_KEY", key)
        .env("PET_API_URL", gw.url("/v1"))
        .output()
        .expect("run pet");
    assert!(
        out.status.success(),
        "pet {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("pet prints JSON")
}

#[tokio::test]
async fn paging_through_250_pets_and_the_pet_command() {
    let s = Fixture::with_plan("unlimited", 1_000_000, 10_000_000);
    let key = s.issue("unlimited");
    let (_backend, gw) = gateway(&s, "");
    let client = Client::new(&gw.url(""), &key).unwrap();
    for i in 0..250 {
        let status = (i % 5 == 0).then(|| "sold".into());
        let pet = client
            .create_pet(&NewPet {
                name: format!("pet {i}"),
                category_id: 1 + i % 3,
                status,
            })
            .await
            .unwrap();
        assert_eq!(pet.name, format!("pet {i}"));
    }
    let all = client.list_all(None).await.unwrap();
    assert_eq!(all.len(), 250);
    assert!(
        all.windows(2).all(|w| w[0].id < w[1].id),
        "ascending ids, no repeats"
    );
    let sold = client.list_all(Some("sold")).await.unwrap();
    assert_eq!(sold.len(), 50);
    assert!(sold.iter().all(|p| p.status == "sold"));
    let page = client.list_pets(None, Some(7)).await.unwrap();
    assert_eq!(page.pets.len(), 7);
    assert!(page.next.is_some());
    assert_eq!(client.get_pet(all[3].id).await.unwrap(), all[3]);
    let e = client.get_pet(999_999).await.unwrap_err();
    assert_eq!(e.code(), Some("not_found"), "{e}");
    assert_eq!(client.rate_state().limit, Some(1_000_000));

    // The command, with its key and URL from the environment.
    let listed = pet_cli(&gw, &key, &["pets", "list", "--all"]);
    assert_eq!(listed.as_array().unwrap().len(), 250);
    let page = pet_cli(&gw, &key, &["pets", "list", "--status", "sold"]);
    assert_eq!(
        page.as_array().unwrap().len(),
        20,
        "one page of the default size"
    );
    let created = pet_cli(
        &gw,
        &key,
        &["pets", "create", "--name", "Rex", "--category", "2"],
    );
    assert_eq!(
        (created["name"].as_str(), created["categoryId"].as_i64()),
        (Some("Rex"), Some(2))
    );
    let id = created["id"].as_i64().unwrap().to_string();
    assert_eq!(pet_cli(&gw, &key, &["pets", "get", &id]), created);
    let quota = pet_cli(&gw, &key, &["quota", "--json"]);
    assert_eq!(quota["plan"], "unlimited");
    assert_eq!(quota["ban"], Value::Null);
    let names: Vec<&str> = quota["windows"]
        .as_array()
        .expect("the gateway lists its windows")
        .iter()
        .filter_map(|w| w["name"].as_str())
        .collect();
    assert_eq!(names, ["minute", "day"]);
    assert_eq!(quota["minute"]["limit"], 1_000_000);
    // Without --json: a line per window.
    let out = Command::new(e2e::bin_path("pet"))
        .arg("quota")
        .env("PET_API_KEY", &key)
        .env("PET_API_URL", gw.url(""))
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.first(), Some(&"plan unlimited"), "{text}");
    assert!(
        lines[1].starts_with("minute ") && lines[1].contains(" of 1000000 left, resets "),
        "{text}"
    );
    assert!(
        lines[2].starts_with("day ") && lines[2].contains(" of 10000000 left"),
        "{text}"
    );
    assert_eq!(lines.last(), Some(&"ban    none"), "{text}");
    let out = Command::new(e2e::bin_path("pet"))
        .args(["pets", "get", "999999"])
        .env("PET_API_KEY", &key)
        .env("PET_API_URL", gw.url(""))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not_found"));
}

/// A key driven past its minute limit: with the retry policy the client waits for the next
/// minute instead of sending what would be refused, so the key collects no strike and no ban;
/// the same loop without the policy is refused and then banned.
#[tokio::test]
async fn a_client_that_waits_is_never_banned_and_one_that_does_not_is() {
    let s = Fixture::new(5, 1_000);
    let patient = s.issue("free");
    let hasty = s.issue("free");
    let (_backend, gw) = gateway(&s, "[ban]\nstrikes = 2\ndurations_secs = [600]\n");
    let policy = RetryPolicy {
        deadline: Duration::from_secs(40),
        ..RetryPolicy::default()
    };
    late_in_a_minute(48);
    let started = Instant::now();
    let client = Client::with_policy(&gw.url(""), &patient, policy).unwrap();
    for i in 0..8 {
        client
            .list_pets(None, None)
            .await
            .unwrap_or_else(|e| panic!("request {i}: {e}"));
    }
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "the client waited for the next minute ({:?})",
        started.elapsed()
    );
    assert_eq!(
        gw.metric("pet_gateway_rate_limited_total{plan=\"free\",window=\"minute\"}")
            .await,
        0.0,
        "nothing it knew would be refused was sent"
    );
    assert_eq!(
        gw.metric("pet_gateway_bans_total{plan=\"free\"}").await,
        0.0
    );

    let client = Client::with_policy(&gw.url(""), &hasty, RetryPolicy::none()).unwrap();
    let mut codes = Vec::new();
    for _ in 0..8 {
        codes.push(match client.list_pets(None, None).await {
            Ok(_) => "ok".to_owned(),
            Err(e) => e.code().unwrap_or("other").to_owned(),
        });
    }
    assert_eq!(&codes[..5], ["ok"; 5]);
    assert!(codes.iter().any(|c| c == "api_key_banned"), "{codes:?}");
    assert_eq!(
        gw.metric("pet_gateway_bans_total{plan=\"free\"}").await,
        1.0
    );
}

/// A banned key: the client waits until the ban ends (one refused request, then quiet), and
/// then its request is served.
#[tokio::test]
async fn a_banned_key_waits_for_its_ban_to_end() {
    let s = Fixture::new(60, 1_000);
    write_plan(&s.plans, "tiny", 1, 1_000);
    let key = s.issue("tiny");
    let (_backend, gw) = gateway(&s, "[ban]\nstrikes = 0\ndurations_secs = [12]\n");
    // Banned near the end of a minute, so that the ban ends in the next one, with room again.
    late_in_a_minute(50);
    let hasty = Client::with_policy(&gw.url(""), &key, RetryPolicy::none()).unwrap();
    hasty.list_pets(None, None).await.unwrap();
    // The first refusal starts the ban (no strikes allowed).
    let banned_at = Instant::now();
    for _ in 0..2 {
        let e = hasty.list_pets(None, None).await.unwrap_err();
        assert_eq!(e.code(), Some("api_key_banned"), "{e}");
    }
    let before = gw
        .metric("pet_gateway_rate_limited_total{plan=\"tiny\",window=\"ban\"}")
        .await;

    let patient = Client::with_policy(
        &gw.url(""),
        &key,
        RetryPolicy {
            deadline: Duration::from_secs(30),
            ..RetryPolicy::default()
        },
    )
    .unwrap();
    let quota = patient.quota().await.unwrap();
    let until = quota.ban.expect("the key is banned").until;
    patient
        .list_pets(None, None)
        .await
        .expect("served once the ban is over");
    assert!(
        pet_client::unix_now() >= until,
        "not served before the ban's end"
    );
    assert!(
        banned_at.elapsed() >= Duration::from_secs(10),
        "{:?}",
        banned_at.elapsed()
    );
    let during = gw
        .metric("pet_gateway_rate_limited_total{plan=\"tiny\",window=\"ban\"}")
        .await
        - before;
    assert_eq!(
        during, 0.0,
        "the client sent nothing while it knew the key was banned"
    );
}

/// A plan of a `1s` and a `month` window, creating an animal costing 2 units: the client reads
/// both windows (and no minute or day), `pet quota` prints them, and a client driving the key
/// past its second waits for the next one instead of being refused.
#[tokio::test]
async fn a_plan_of_any_windows_and_costs_is_read_and_respected() {
    let s = Fixture::new(60, 1_000);
    std::fs::write(
        s.plans.join("metered.toml"),
        "[[window]]\nevery = \"1s\"\nlimit = 4\n\
         [[window]]\nevery = \"month\"\nlimit = 100000\n\
         [cost]\ncreatePet = 2\n",
    )
    .unwrap();
    let key = s.issue("metered");
    let (_backend, gw) = gateway(&s, "[ban]\nstrikes = 0\ndurations_secs = [600]\n");
    let client = Client::with_policy(
        &gw.url(""),
        &key,
        RetryPolicy {
            deadline: Duration::from_secs(20),
            ..RetryPolicy::default()
        },
    )
    .unwrap();
    let quota = client.quota().await.unwrap();
    assert_eq!((quota.minute, quota.day), (None, None), "{quota:?}");
    let names: Vec<&str> = quota.windows.iter().map(|w| w.name.as_str()).collect();
    assert_eq!(names, ["second", "month"]);
    assert_eq!((quota.windows[0].every, quota.windows[0].limit), (1, 4));
    assert!((28 * 86_400..=31 * 86_400).contains(&quota.windows[1].every));

    // Eight creations at 2 units, 4 units a second: four seconds' worth, every one admitted.
    // The month's count is read after them: not across a UTC midnight, which ends a month too.
    e2e::fresh_day(Duration::from_secs(30));
    let started = Instant::now();
    for i in 0..8 {
        client
            .create_pet(&NewPet {
                name: format!("metered {i}"),
                category_id: 1,
                status: None,
            })
            .await
            .unwrap_or_else(|e| panic!("creation {i}: {e}"));
    }
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "the client waited for the next seconds ({:?})",
        started.elapsed()
    );
    assert_eq!(
        gw.metric("pet_gateway_bans_total{plan=\"metered\"}").await,
        0.0,
        "nothing it knew would be refused was sent (one refusal would have banned the key)"
    );
    let quota = client.quota().await.unwrap();
    assert_eq!(quota.windows[1].remaining, 100_000 - 16, "{quota:?}");

    let out = Command::new(e2e::bin_path("pet"))
        .arg("quota")
        .env("PET_API_KEY", &key)
        .env("PET_API_URL", gw.url(""))
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    assert_eq!(lines[0], "plan metered");
    assert!(lines[1].starts_with("second "), "{text}");
    assert!(
        lines[2].starts_with("month  99984 of 100000 left, resets "),
        "{text}"
    );
}
