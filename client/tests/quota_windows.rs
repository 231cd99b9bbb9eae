//! Quotas of any windows (`1s` … `400d`, the UTC month): the client reads `GET /v1/rate_limit`
//! in its current form (`windows`, with `minute` and `day` only when the plan has them) and in
//! the form of a gateway from before windows (`minute` and `day` alone); its limiter holds back
//! what any spent window would refuse, whatever the window's name; and `pet quota` prints every
//! window. Against a scripted server on loopback, so that any body can be answered.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::scripted;
use pet_client::{unix_now, Client, NamedWindow, Quota, RetryPolicy, Window};
use serde_json::{json, Value};

/// A whole 200 response with `headers` (each `name: value\r\n`) and a JSON `body`.
fn ok(headers: &str, body: &Value) -> String {
    let body = body.to_string();
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n{headers}content-length: {}\r\n\r\n{body}",
        body.len()
    )
}

fn policy(deadline: Duration) -> RetryPolicy {
    RetryPolicy {
        base: Duration::from_millis(50),
        cap: Duration::from_millis(400),
        deadline,
        ..RetryPolicy::default()
    }
}

/// A body of a plan with a `1s` and a `month` window, neither a minute nor a day.
fn second_and_month(now: u64, month_left: u64) -> Value {
    json!({
        "plan": "pro",
        "windows": [
            {"name": "second", "every": 1, "limit": 5, "remaining": 4, "reset": now + 1},
            {"name": "month", "every": 2_678_400, "limit": 9000, "remaining": month_left,
             "reset": now + 40 * 86_400 + 30},
        ],
        "ban": null,
    })
}

/// The body of a gateway from before windows.
fn first_form(now: u64, minute_left: u64) -> Value {
    json!({
        "plan": "free",
        "minute": {"limit": 60, "remaining": minute_left, "reset": now + 30},
        "day": {"limit": 1000, "remaining": 940, "reset": now + 3_630},
        "ban": null,
    })
}

#[test]
fn a_body_with_only_windows_parses() {
    let quota: Quota = serde_json::from_value(second_and_month(1_000, 8_000)).unwrap();
    assert_eq!((quota.minute, quota.day), (None, None));
    assert_eq!(quota.plan, "pro");
    assert_eq!(
        quota.windows,
        [
            NamedWindow {
                name: "second".into(),
                every: 1,
                limit: 5,
                remaining: 4,
                reset: 1_001,
            },
            NamedWindow {
                name: "month".into(),
                every: 2_678_400,
                limit: 9000,
                remaining: 8_000,
                reset: 1_000 + 40 * 86_400 + 30,
            },
        ]
    );
    assert_eq!(quota.all_windows(), quota.windows);
    // Written back as it came: no minute or day invented.
    let again = serde_json::to_value(&quota).unwrap();
    assert!(
        again.get("minute").is_none() && again.get("day").is_none(),
        "{again}"
    );
    assert_eq!(again["windows"][1]["name"], "month");
}

#[test]
fn a_body_of_the_first_form_parses_and_gives_its_two_windows() {
    let quota: Quota = serde_json::from_value(first_form(1_000, 58)).unwrap();
    assert!(quota.windows.is_empty());
    assert_eq!(
        quota.minute,
        Some(Window {
            limit: 60,
            remaining: 58,
            reset: 1_030
        })
    );
    let all = quota.all_windows();
    let summary: Vec<(&str, u64, u64)> = all
        .iter()
        .map(|w| (w.name.as_str(), w.every, w.remaining))
        .collect();
    assert_eq!(summary, [("minute", 60, 58), ("day", 86_400, 940)]);
}

#[test]
fn the_current_body_of_a_minute_and_day_plan_parses_with_both_forms() {
    let body = json!({
        "plan": "free",
        "minute": {"limit": 60, "remaining": 50, "reset": 1_060},
        "day": {"limit": 1000, "remaining": 600, "reset": 86_400},
        "windows": [
            {"name": "minute", "every": 60, "limit": 60, "remaining": 50, "reset": 1_060},
            {"name": "day", "every": 86_400, "limit": 1000, "remaining": 600, "reset": 86_400},
        ],
        "ban": {"until": 1_600},
    });
    let quota: Quota = serde_json::from_value(body.clone()).unwrap();
    assert_eq!(quota.windows.len(), 2);
    assert_eq!(quota.day.map(|d| d.remaining), Some(600));
    assert_eq!(quota.ban.map(|b| b.until), Some(1_600));
    assert_eq!(serde_json::to_value(&quota).unwrap(), body);
}

/// A spent month window, told by `GET /v1/rate_limit`, holds the client back: nothing is sent
/// that it knows would be refused, and a deadline shorter than the month's reset gives up at
/// once.
#[tokio::test]
async fn a_spent_window_of_any_length_in_the_quota_body_blocks() {
    let now = unix_now();
    let (url, count) = scripted(ok("", &second_and_month(now, 0))).await;
    let client = Client::with_policy(&url, "k", policy(Duration::from_secs(2))).unwrap();
    let quota = client.quota().await.unwrap();
    assert_eq!(quota.windows[1].remaining, 0);
    let started = Instant::now();
    let e = client.list_pets(None, None).await.unwrap_err();
    assert!(matches!(e, pet_client::Error::Deadline { .. }), "{e}");
    assert!(started.elapsed() < Duration::from_millis(500));
    assert_eq!(count.load(Ordering::SeqCst), 1, "only the quota was asked");

    // The same from a gateway of the first form: its spent minute blocks.
    let (url, count) = scripted(ok("", &first_form(now, 0))).await;
    let client = Client::with_policy(&url, "k", policy(Duration::from_secs(1))).unwrap();
    assert!(client.quota().await.unwrap().windows.is_empty());
    let e = client.list_pets(None, None).await.unwrap_err();
    assert!(matches!(e, pet_client::Error::Deadline { .. }), "{e}");
    assert_eq!(count.load(Ordering::SeqCst), 1);
}

/// Two windows spent by one request: `X-RateLimit-*` name the shortest (the least room, ties
/// to the shortest), which resets in a second; `RateLimit` says the month is spent too. The
/// client waits for both rather than send when the second turns.
#[tokio::test]
async fn every_spent_window_of_the_ratelimit_header_blocks_not_only_the_binding_one() {
    let reset = unix_now() + 1;
    let headers = format!(
        "ratelimit-policy: \"second\";q=5;w=1, \"month\";q=9000;w=2678400\r\n\
         ratelimit: \"second\";r=0;t=1, \"month\";r=0;t=3456000\r\n\
         x-ratelimit-limit: 5\r\nx-ratelimit-remaining: 0\r\nx-ratelimit-reset: {reset}\r\n"
    );
    let (url, count) = scripted(ok(&headers, &json!([]))).await;
    let client = Client::with_policy(&url, "k", policy(Duration::from_secs(3))).unwrap();
    client.list_pets(None, None).await.unwrap();
    let started = Instant::now();
    let e = client.list_pets(None, None).await.unwrap_err();
    assert!(matches!(e, pet_client::Error::Deadline { .. }), "{e}");
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "gave up at once: {:?}",
        started.elapsed()
    );
    assert_eq!(count.load(Ordering::SeqCst), 1);
    assert_eq!(client.rate_state().spent_for, Some(3_456_000));
}

/// Runs `pet quota [extra]` against `url`; its stdout.
async fn pet_quota(url: &str, extra: &[&str]) -> String {
    let mut command = std::process::Command::new(e2e::bin_path("pet"));
    command
        .arg("quota")
        .args(extra)
        .env("PET_API_KEY", "k")
        .env("PET_API_URL", url);
    let out = tokio::task::spawn_blocking(move || command.output().expect("run pet"))
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "pet quota: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pet_quota_prints_every_window_of_either_form() {
    let now = unix_now();
    let (url, _) = scripted(ok("", &second_and_month(now, 8_000))).await;
    let text = pet_quota(&url, &[]).await;
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    assert_eq!(lines[0], "plan pro");
    assert!(
        lines[1].starts_with("second 4 of 5 left, resets ")
            && (lines[1].ends_with(" UTC (in 1s)") || lines[1].ends_with(" UTC (in 0s)")),
        "{text}"
    );
    assert!(
        lines[2].starts_with("month  8000 of 9000 left, resets ") && lines[2].ends_with("(in 40d)"),
        "{text}"
    );
    assert_eq!(lines[3], "ban    none");
    let json: Value = serde_json::from_str(&pet_quota(&url, &["--json"]).await).unwrap();
    assert_eq!(json["windows"].as_array().map(Vec::len), Some(2), "{json}");

    let (url, _) = scripted(ok("", &first_form(now, 58))).await;
    let text = pet_quota(&url, &[]).await;
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    assert!(lines[1].starts_with("minute 58 of 60 left"), "{text}");
    assert!(
        lines[2].starts_with("day    940 of 1000 left") && lines[2].ends_with("(in 1h)"),
        "{text}"
    );
}
