//! The gateway's quotas end to end: real `pet-gateway`, `pet-backend` and `redis-server`
//! processes on loopback, driven over HTTP.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use e2e::{burst, fresh_minute, Fixture, RedisServer};
use serde_json::Value;

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A header every response of these tests carries.
fn header(resp: &reqwest::Response, name: &str) -> String {
    e2e::header(resp, name).unwrap_or_else(|| panic!("response {} has no {name}", resp.status()))
}

fn num(resp: &reqwest::Response, name: &str) -> u64 {
    header(resp, name)
        .parse()
        .unwrap_or_else(|_| panic!("{name} is a number"))
}

async fn get(client: &reqwest::Client, url: &str, key: &str) -> reqwest::Response {
    client
        .get(url)
        .bearer_auth(key)
        .send()
        .await
        .expect("request")
}

async fn expect_429(resp: reqwest::Response, code: &str) -> (u64, u64, String) {
    assert_eq!(resp.status(), 429);
    assert_eq!(header(&resp, "content-type"), "application/json");
    let retry_after = num(&resp, "retry-after");
    let reset = num(&resp, "x-ratelimit-reset");
    let ratelimit = header(&resp, "ratelimit");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["code"], code, "{body}");
    assert_eq!(body["status"], 429);
    (retry_after, reset, ratelimit)
}

/// Free key: requests 1..60 are admitted with Remaining 59..0; the 61st gets 429 with
/// Retry-After = the seconds left in the minute and Reset = the minute's end; the refusal does
/// not consume the day quota.
async fn free_key_minute_window(redis: Option<&RedisServer>) {
    let f = Fixture::new(60, 1000);
    let key = f.issue("free");
    let backend = f.backend();
    let mut spec = f.spec(backend.addr);
    spec.redis_url = redis.map(RedisServer::url);
    // Exact counts are the subject, not the store's deadline: a slow first call on a loaded
    // machine must not be decided locally.
    spec.extra = "store_timeout_ms = 2000\n".into();
    let gw = f.gateway(&spec);
    let client = reqwest::Client::new();

    fresh_minute(Duration::from_secs(20));
    let minute_end = (unix_now() / 60 + 1) * 60;
    for i in 1..=60u64 {
        let resp = get(&client, &gw.url("/v1/pets"), &key).await;
        assert_eq!(resp.status(), 200, "request {i}");
        assert_eq!(num(&resp, "x-ratelimit-limit"), 60);
        assert_eq!(num(&resp, "x-ratelimit-remaining"), 60 - i, "request {i}");
        assert_eq!(num(&resp, "x-ratelimit-reset"), minute_end);
        assert_eq!(
            header(&resp, "ratelimit-policy"),
            "\"minute\";q=60;w=60, \"day\";q=1000;w=86400"
        );
    }
    let resp = get(&client, &gw.url("/v1/pets"), &key).await;
    let now = unix_now();
    assert_eq!(num(&resp, "x-ratelimit-remaining"), 0);
    let (retry_after, reset, ratelimit) = expect_429(resp, "rate_limited").await;
    assert_eq!(reset, minute_end);
    assert!(
        retry_after >= 1 && retry_after.abs_diff(minute_end - now) <= 1,
        "Retry-After {retry_after}, {} s left",
        minute_end - now
    );
    // 60 admitted, one refused: the day window still has 940.
    assert!(ratelimit.contains("\"day\";r=940;"), "{ratelimit}");
    let again = get(&client, &gw.url("/v1/pets"), &key).await;
    let (_, _, ratelimit) = expect_429(again, "rate_limited").await;
    assert!(ratelimit.contains("\"day\";r=940;"), "{ratelimit}");
}

#[tokio::test]
async fn free_key_minute_window_embedded() {
    free_key_minute_window(None).await;
}

#[tokio::test]
async fn free_key_minute_window_redis() {
    let redis = RedisServer::start();
    free_key_minute_window(Some(&redis)).await;
}

#[tokio::test]
async fn the_day_quota_binds_with_the_days_reset() {
    let f = Fixture::with_plan("tiny-day", 100, 5);
    let key = f.issue("tiny-day");
    let backend = f.backend();
    let gw = f.gateway(&f.spec(backend.addr));
    let client = reqwest::Client::new();
    // The day's count and reset are the subject: not across midnight UTC.
    e2e::fresh_day(Duration::from_secs(30));
    let day_end = (unix_now() / 86_400 + 1) * 86_400;
    for i in 1..=5u64 {
        let resp = get(&client, &gw.url("/v1/pets"), &key).await;
        assert_eq!(resp.status(), 200);
        // The day binds from the start: it has fewer requests remaining than the minute.
        assert_eq!(
            (
                num(&resp, "x-ratelimit-limit"),
                num(&resp, "x-ratelimit-remaining")
            ),
            (5, 5 - i)
        );
        assert_eq!(num(&resp, "x-ratelimit-reset"), day_end);
    }
    let resp = get(&client, &gw.url("/v1/pets"), &key).await;
    let now = unix_now();
    assert_eq!(num(&resp, "x-ratelimit-limit"), 5);
    let (retry_after, reset, _) = expect_429(resp, "rate_limited").await;
    assert_eq!(reset, day_end);
    assert!(retry_after.abs_diff(day_end - now) <= 1, "{retry_after}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_sharing_redis_admit_exactly_the_limit() {
    let f = Fixture::new(60, 1000);
    let key = f.issue("free");
    let redis = RedisServer::start();
    let backend = f.backend();
    let mut spec = f.spec(backend.addr);
    spec.redis_url = Some(redis.url());
    // Generous deadline: this test is about exactness on a loaded 2-core machine, not latency.
    spec.extra = "threads = 1\nstore_timeout_ms = 2000\non_store_error = \"closed\"\n".into();
    let gateways: Vec<_> = (0..3).map(|_| f.gateway(&spec)).collect();
    fresh_minute(Duration::from_secs(25));
    let counts = burst(&gateways, &key, 300).await;
    assert_eq!(counts.get(&200), Some(&60), "{counts:?}");
    assert_eq!(counts.get(&429), Some(&240), "{counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_gateway_with_the_embedded_store_admits_exactly_the_limit() {
    let f = Fixture::new(60, 1000);
    let key = f.issue("free");
    let backend = f.backend();
    let gw = f.gateway(&f.spec(backend.addr));
    fresh_minute(Duration::from_secs(25));
    let counts = burst(std::slice::from_ref(&gw), &key, 300).await;
    assert_eq!(counts.get(&200), Some(&60), "{counts:?}");
    assert_eq!(counts.get(&429), Some(&240), "{counts:?}");
}

#[tokio::test]
async fn a_key_that_keeps_sending_is_banned_on_every_node_until_the_ban_ends() {
    let f = Fixture::with_plan("small", 2, 1000);
    let key = f.issue("small");
    let redis = RedisServer::start();
    let backend = f.backend();
    let mut spec = f.spec(backend.addr);
    spec.redis_url = Some(redis.url());
    // Exact counts are the subject, not the store's deadline: a slow first call on a loaded
    // machine must not be decided locally.
    spec.extra = "store_timeout_ms = 2000\n[ban]\nstrikes = 3\ndurations_secs = [3, 600]\n".into();
    let a = f.gateway(&spec);
    let b = f.gateway(&spec);
    let client = reqwest::Client::new();
    fresh_minute(Duration::from_secs(20));

    for _ in 0..2 {
        assert_eq!(get(&client, &a.url("/v1/pets"), &key).await.status(), 200);
    }
    for _ in 0..3 {
        expect_429(get(&client, &a.url("/v1/pets"), &key).await, "rate_limited").await;
    }
    // The fourth refusal in the minute passes the 3 strikes: banned for 3 s.
    let resp = get(&client, &a.url("/v1/pets"), &key).await;
    let now = unix_now();
    let (retry_after, reset, _) = expect_429(resp, "api_key_banned").await;
    assert!((2..=3).contains(&retry_after), "{retry_after}");
    assert!(reset.abs_diff(now + 3) <= 1);
    // The other node enforces the same ban.
    let (retry_b, _, _) = expect_429(
        get(&client, &b.url("/v1/pets"), &key).await,
        "api_key_banned",
    )
    .await;
    assert!(retry_b <= retry_after);
    // It lifts when it ends: the key is back to plain rate limiting (the minute is still full).
    tokio::time::sleep(Duration::from_millis(retry_after * 1000 + 300)).await;
    let resp = get(&client, &b.url("/v1/pets"), &key).await;
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["code"], "rate_limited", "{body}");
}

#[tokio::test]
async fn staging_and_production_on_one_redis_count_apart() {
    // The same key registered in both environments, so only the prefix keeps them apart.
    let f = Fixture::with_plan("small", 3, 1000);
    let key = f.issue("small");
    let redis = RedisServer::start();
    let backend = f.backend();
    let mut spec = f.spec(backend.addr);
    spec.redis_url = Some(redis.url());
    // Exact counts are the subject, not the store's deadline: a slow first call on a loaded
    // machine must not be decided locally.
    spec.extra = "store_timeout_ms = 2000\n".into();
    spec.environment = "staging".into();
    spec.key_prefix = "pet:staging".into();
    let staging = f.gateway(&spec);
    spec.environment = "production".into();
    spec.key_prefix = "pet:production".into();
    let production = f.gateway(&spec);
    let client = reqwest::Client::new();
    fresh_minute(Duration::from_secs(15));

    for _ in 0..3 {
        assert_eq!(
            get(&client, &staging.url("/v1/pets"), &key).await.status(),
            200
        );
    }
    expect_429(
        get(&client, &staging.url("/v1/pets"), &key).await,
        "rate_limited",
    )
    .await;
    let resp = get(&client, &production.url("/v1/pets"), &key).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        num(&resp, "x-ratelimit-remaining"),
        2,
        "production's quota is untouched"
    );
}

/// `GET /v1/rate_limit`: the quota as it stands, answered by the gateway from the shared store,
/// never forwarded and never counted; limited on its own; a ban shows with its end; only GET.
#[tokio::test]
async fn rate_limit_tells_the_quota_without_spending_it() {
    let s = Fixture::new(60, 1_000);
    e2e::write_plan(&s.plans, "tiny", 2, 1_000);
    let key = s.issue("free");
    let tiny = s.issue("tiny");
    let redis = RedisServer::start();
    let backend = e2e::Backend::start_logged(
        &s.dir.path().join("pets.db"),
        &s.dir.path().join("backend.log"),
    );
    let mut spec = s.spec(backend.addr);
    spec.redis_url = Some(redis.url());
    spec.extra = "store_timeout_ms = 1000\n[ban]\nstrikes = 0\ndurations_secs = [600]\n".into();
    let gw = e2e::GatewayProcess::start(s.dir.path(), &spec);
    let client = reqwest::Client::new();
    fresh_minute(Duration::from_secs(15));
    for _ in 0..5 {
        assert_eq!(get(&client, &gw.url("/v1/pets"), &key).await.status(), 200);
    }
    let status_url = gw.url("/v1/rate_limit");
    for _ in 0..3 {
        let resp = get(&client, &status_url, &key).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(header(&resp, "content-type"), "application/json");
        assert_eq!(num(&resp, "x-ratelimit-limit"), 60);
        assert_eq!(
            num(&resp, "x-ratelimit-remaining"),
            55,
            "asking spends nothing"
        );
        assert!(e2e::header(&resp, "ratelimit-policy").is_some());
        let body: Value = resp.json().await.unwrap();
        let now = unix_now();
        assert_eq!(body["plan"], "free");
        assert_eq!(body["minute"]["limit"], 60);
        assert_eq!(body["minute"]["remaining"], 55);
        assert_eq!(body["day"]["limit"], 1_000);
        assert_eq!(body["day"]["remaining"], 995);
        let reset = body["minute"]["reset"].as_u64().unwrap();
        assert!(reset > now && reset <= now + 60, "{body}");
        assert_eq!(body["ban"], Value::Null);
    }
    // The next request of the plan is the sixth: nothing was counted for the questions.
    let resp = get(&client, &gw.url("/v1/pets"), &key).await;
    assert_eq!(num(&resp, "x-ratelimit-remaining"), 54);

    // Its own limit: 10 at once, then 429 with Retry-After, still without touching the plan.
    let mut limited = None;
    for _ in 0..15 {
        let resp = get(&client, &status_url, &key).await;
        if resp.status() == 429 {
            limited = Some(resp);
            break;
        }
    }
    let limited = limited.expect("the endpoint is limited per key");
    assert!(num(&limited, "retry-after") >= 1);
    let body: Value = limited.json().await.unwrap();
    assert_eq!(body["code"], "rate_limited");
    let resp = get(&client, &gw.url("/v1/pets"), &key).await;
    assert_eq!(num(&resp, "x-ratelimit-remaining"), 53);

    // A banned key is told when its ban ends.
    for _ in 0..3 {
        get(&client, &gw.url("/v1/pets"), &tiny).await;
    }
    let resp = get(&client, &status_url, &tiny).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(num(&resp, "x-ratelimit-remaining"), 0);
    let body: Value = resp.json().await.unwrap();
    let until = body["ban"]["until"].as_u64().expect("a ban");
    assert!(until >= unix_now() + 590, "{body}");
    assert_eq!(body["minute"]["remaining"], 0);
    assert_eq!(body["plan"], "tiny");

    // Only GET; and the backend never saw any of it.
    let resp = client
        .post(&status_url)
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 405);
    assert_eq!(header(&resp, "allow"), "GET");
    assert!(
        backend.log_text().contains("/v1/pets"),
        "the backend logs requests"
    );
    assert!(
        !backend.log_text().contains("rate_limit"),
        "{}",
        backend.log_text()
    );
}
