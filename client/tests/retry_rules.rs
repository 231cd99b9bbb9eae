//! The retry rules against a scripted server on loopback (for answers the real gateway never
//! gives: a 429 without `Retry-After`, a 502, absurd headers): the client never retries quickly,
//! never retries a POST after a 5xx but a 503 `overloaded` (shed unsent), and never waits past
//! its deadline.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::scripted;
use pet_client::{Client, NewPet, RetryPolicy};

const BODY_429: &str = "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: 58\r\n\r\n{\"code\":\"rate_limited\",\"message\":\"slow down\",\"status\":429}";
const BODY_502: &str = "HTTP/1.1 502 Bad Gateway\r\ncontent-type: application/json\r\ncontent-length: 58\r\n\r\n{\"code\":\"bad_gateway\",\"message\":\"no backend\",\"status\":502}";

fn policy(deadline: Duration) -> RetryPolicy {
    RetryPolicy {
        base: Duration::from_millis(50),
        cap: Duration::from_millis(400),
        deadline,
        ..RetryPolicy::default()
    }
}

#[tokio::test]
async fn a_429_without_retry_after_is_not_retried_quickly() {
    let (url, count) = scripted(BODY_429).await;
    let client = Client::with_policy(&url, "k", policy(Duration::from_secs(3))).unwrap();
    let started = Instant::now();
    let e = client.list_pets(None, None).await.unwrap_err();
    assert_eq!(e.code(), Some("rate_limited"), "{e}");
    assert!(
        started.elapsed() <= Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    let n = count.load(Ordering::SeqCst);
    // At least a second between attempts: within 3 s, 3 requests at most.
    assert!((1..=3).contains(&n), "{n} requests in 3 s");
}

#[tokio::test]
async fn a_5xx_is_retried_for_get_with_backoff_and_never_for_post() {
    let (url, count) = scripted(BODY_502).await;
    let client = Client::with_policy(&url, "k", policy(Duration::from_secs(2))).unwrap();
    let e = client
        .create_pet(&NewPet {
            name: "Rex".into(),
            category_id: 1,
            status: None,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some("bad_gateway"));
    assert_eq!(count.load(Ordering::SeqCst), 1, "a POST is sent once");

    let started = Instant::now();
    let e = client.list_pets(None, None).await.unwrap_err();
    assert_eq!(e.code(), Some("bad_gateway"), "{e}");
    assert!(
        started.elapsed() <= Duration::from_millis(2_500),
        "{:?}",
        started.elapsed()
    );
    let gets = count.load(Ordering::SeqCst) - 1;
    // Backoff with a 400 ms cap over 2 s: several tries, but far from a busy loop.
    assert!((2..=60).contains(&gets), "{gets} GETs");
}

#[tokio::test]
async fn absurd_rate_limit_headers_neither_crash_nor_block_past_the_deadline() {
    const ABSURD: &str = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nratelimit-policy: \"minute\";q=1;w=60\r\nx-ratelimit-limit: 1\r\nx-ratelimit-remaining: 0\r\nx-ratelimit-reset: 18446744073709551615\r\ncontent-length: 2\r\n\r\n[]";
    let (url, count) = scripted(ABSURD).await;
    let client = Client::with_policy(&url, "k", policy(Duration::from_secs(1))).unwrap();
    client.list_pets(None, None).await.unwrap();
    let started = Instant::now();
    let e = client.list_pets(None, None).await.unwrap_err();
    assert!(matches!(e, pet_client::Error::Deadline { .. }), "{e}");
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "gave up at once: {:?}",
        started.elapsed()
    );
    assert_eq!(
        count.load(Ordering::SeqCst),
        1,
        "nothing sent it knew would be refused"
    );
    // A deadline too large to add to the clock is no deadline, not a crash.
    let patient = Client::with_policy(&url, "k", policy(Duration::MAX)).unwrap();
    patient.list_pets(None, None).await.unwrap();
}

const BODY_503_OVERLOADED: &str = "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\ncontent-length: 58\r\n\r\n{\"code\":\"overloaded\",\"message\":\"at capacity\",\"status\":503}";
const BODY_503_STORE: &str = "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\ncontent-length: 55\r\n\r\n{\"code\":\"internal\",\"message\":\"store away\",\"status\":503}";

#[tokio::test]
async fn a_post_shed_as_overloaded_is_sent_again_after_retry_after_but_not_another_503() {
    let new_pet = NewPet {
        name: "Rex".into(),
        category_id: 1,
        status: None,
    };
    // Shed before the backend saw it: sent again, a second apart, until the deadline.
    let (url, count) = scripted(BODY_503_OVERLOADED).await;
    let client = Client::with_policy(&url, "k", policy(Duration::from_millis(2_500))).unwrap();
    let started = Instant::now();
    let e = client.create_pet(&new_pet).await.unwrap_err();
    assert!(format!("{e}").contains("overloaded"), "{e}");
    let n = count.load(Ordering::SeqCst);
    assert!(
        (2..=3).contains(&n),
        "{n} attempts in {:?}",
        started.elapsed()
    );
    // Any other 503 may have reached the backend: a POST is sent once.
    let (url, count) = scripted(BODY_503_STORE).await;
    let client = Client::with_policy(&url, "k", policy(Duration::from_millis(2_500))).unwrap();
    let e = client.create_pet(&new_pet).await.unwrap_err();
    assert_eq!(e.code(), Some("internal"), "{e}");
    assert_eq!(count.load(Ordering::SeqCst), 1);
}
