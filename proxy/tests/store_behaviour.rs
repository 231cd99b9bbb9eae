//! One behaviour suite for every quota store: the same tests, instantiated per store by
//! `store_suite!`, against the in-memory store, a real `redis-server` started on a free loopback
//! port (decisions batched, the default, and one script run per decision), and a real
//! three-master Redis Cluster (batched per slot). Whatever one store does, the others must too.
//!
//! The memory store runs on a hand-moved clock, so its window and ban tests step over seconds
//! instead of sleeping through them; Redis keeps its own time (`TIME`), so there they wait.
//! Every store's leases (a quota's concurrency) last [`LEASE_SECS`].

use std::sync::Arc;
use std::time::Duration;

use e2e::{fresh_minute, RedisCluster, RedisServer};
use proxy::base::clock::Clock;
use proxy::base::redis::RedisAccess;
use proxy::keys::limits::{Every, Limits, WindowLimit};
use proxy::quota::concurrency::Slots;
use proxy::quota::resilience::Resilience;
use proxy::quota::rules::{BanPolicy, Binding, Lease, Outcome, RateView};
use proxy::quota::store::memory::MemoryStore;
use proxy::quota::store::redis::RedisStore;
use proxy::quota::store::{QuotaStore, TopWindow};

/// A store under test, with whatever keeps it alive (the Redis process) and, for the memory
/// store, the clock it reads.
struct Subject {
    store: Arc<dyn QuotaStore>,
    clock: Option<Clock>,
    /// A single Redis server's address, for tests that edit its data by hand.
    redis: Option<std::net::SocketAddr>,
    _servers: Option<Box<dyn std::any::Any>>,
}

/// Where the memory store's clock starts: an hour into a UTC day, on a minute's first second.
const MANUAL_START: u64 = 20_000 * 86_400 + 3_600;
/// A UTC midnight, for the backwards-clock test.
const MIDNIGHT: u64 = 20_001 * 86_400;

impl Subject {
    /// Makes sure at least `margin` remains of the current minute window.
    fn fresh_minute(&self, margin: Duration) {
        match &self.clock {
            Some(clock) => clock.set(MANUAL_START),
            None => fresh_minute(margin),
        }
    }

    /// The store's clock steps back over midnight for `key`, by a few seconds (NTP, or a
    /// failover to a node whose clock lags): one minute window and one day window back. Redis
    /// keeps its own `TIME`, so there the key's stored windows move one ahead instead, which is
    /// the same to the script. The memory store's clock starts just after midnight for this.
    fn clock_steps_back_over_midnight(&self, key: &str) {
        match (&self.clock, self.redis) {
            (Some(clock), _) => clock.set(MIDNIGHT - 2),
            (None, Some(addr)) => {
                // Every window's instance (`w`, the 2nd of each window's three fields after the
                // nine fixed ones) and the strikes' minute (`sw`, the 1st) move one ahead
                // (store/scripts.rs).
                const STEP: &str = "local v = redis.call('GET', KEYS[1]) \
                    local n = (#v - 36) / 12 \
                    local format = '<IIIIIIIII' .. string.rep('III', n) \
                    local f = {struct.unpack(format, v)} \
                    f[1] = f[1] + 1 \
                    for j = 1, n do f[8 + 3 * j] = f[8 + 3 * j] + 1 end \
                    redis.call('SET', KEYS[1], struct.pack(format, unpack(f, 1, 9 + 3 * n)), 'KEEPTTL') \
                    return 1";
                let state = format!("test:windows:{{{key}}}");
                let out = e2e::redis_cli()
                    .args(["-p", &addr.port().to_string(), "EVAL", STEP, "1", &state])
                    .output()
                    .expect("redis-cli");
                assert!(
                    out.status.success() && out.stdout.starts_with(b"1"),
                    "{out:?}"
                );
            }
            (None, None) => panic!("this subject cannot step its clock"),
        }
    }

    /// Lets `d` pass for the store: moves its clock, or waits.
    async fn wait(&self, d: Duration) {
        match &self.clock {
            Some(clock) => clock.advance(d.as_secs() + u64::from(d.subsec_nanos() > 0)),
            None => tokio::time::sleep(d).await,
        }
    }
}

/// How long a lease lasts in these tests' stores: short, so a lease nobody gives back ends
/// within a test.
const LEASE_SECS: u64 = 3;

fn memory() -> Subject {
    let clock = Clock::manual(MANUAL_START);
    Subject {
        store: Arc::new(MemoryStore::with_clock(clock.clone()).with_lease_secs(LEASE_SECS)),
        clock: Some(clock),
        redis: None,
        _servers: None,
    }
}

fn redis() -> Subject {
    on_redis(RedisServer::start())
}

/// The store on `server`, batched as shipped.
fn on_redis(server: RedisServer) -> Subject {
    let store = RedisStore::new(&server.url(), "test", Duration::from_millis(500))
        .expect("store")
        .with_lease_secs(LEASE_SECS);
    Subject {
        store: Arc::new(store),
        clock: None,
        redis: Some(server.addr),
        _servers: Some(Box::new(server)),
    }
}

/// One script run per decision, several in flight: the store before group commit.
fn redis_unbatched() -> Subject {
    let server = RedisServer::start();
    let store = RedisStore::new(&server.url(), "test", Duration::from_millis(500))
        .expect("store")
        .with_batch_max(1)
        .with_lease_secs(LEASE_SECS);
    Subject {
        store: Arc::new(store),
        clock: None,
        redis: Some(server.addr),
        _servers: Some(Box::new(server)),
    }
}

/// A Redis whose user may not run functions (`FCALL`, `FUNCTION`: an ACL from before they were
/// used, or Redis before 7.0): decisions go by the script (`EVALSHA`), and must be the same.
fn redis_by_script() -> Subject {
    on_redis(RedisServer::start_without_functions())
}

fn cluster() -> Subject {
    let cluster = RedisCluster::start(3, 0);
    let store = RedisStore::new(&cluster.url(), "test", Duration::from_millis(500))
        .expect("store")
        .with_lease_secs(LEASE_SECS);
    Subject {
        store: Arc::new(store),
        clock: None,
        redis: None,
        _servers: Some(Box::new(cluster)),
    }
}

const NO_BANS: fn() -> BanPolicy = || BanPolicy {
    strikes: u64::MAX / 2,
    ..BanPolicy::default()
};

/// A cost no window of the tests' limits of 1 has room for: a request always refused.
const NO_ROOM: u64 = 2;

/// The minute and day windows of the first plan form.
fn md(per_minute: u64, per_day: u64) -> Limits {
    Limits::minute_day(per_minute, per_day).unwrap()
}

/// Limits of windows written as in a plan file, `("1s", 5)`; `shadow` marks the shadow ones.
fn windows(spec: &[(&str, u64)], shadow: &[&str]) -> Limits {
    let windows: Vec<WindowLimit> = spec
        .iter()
        .map(|&(every, limit)| {
            let mut w = WindowLimit::new(Every::parse(every).unwrap(), limit).unwrap();
            w.shadow = shadow.contains(&every);
            w
        })
        .collect();
    Limits::new(&windows).unwrap()
}

/// The outcome of one request, for tests that need nothing else of the verdict.
async fn outcome(store: &dyn QuotaStore, key: &str, limits: Limits, ban: &BanPolicy) -> Outcome {
    outcome_at(store, key, limits, 1, ban).await
}

/// The outcome of one request costing `cost`.
async fn outcome_at(
    store: &dyn QuotaStore,
    key: &str,
    limits: Limits,
    cost: u64,
    ban: &BanPolicy,
) -> Outcome {
    store
        .acquire(&Arc::from(key), limits, cost, ban)
        .await
        .expect("store answers")
        .outcome
}

async fn admits_exactly_the_minute_limit_and_refusals_do_not_count(subject: &Subject) {
    let store = &*subject.store;
    subject.fresh_minute(Duration::from_secs(10));
    let limits = md(5, 100);
    for i in 1..=5 {
        let v = store
            .acquire(&Arc::from("k1"), limits, 1, &NO_BANS())
            .await
            .unwrap();
        assert_eq!(v.outcome, Outcome::Admitted, "request {i}");
        assert_eq!((v.counts[0], v.counts[1]), (i, i));
        assert_eq!(RateView::new(&v, limits, 1).remaining, 5 - i);
    }
    for _ in 0..3 {
        let v = store
            .acquire(&Arc::from("k1"), limits, 1, &NO_BANS())
            .await
            .unwrap();
        assert_eq!(v.outcome, Outcome::Limited);
        assert_eq!(
            (v.counts[0], v.counts[1]),
            (5, 5),
            "a refusal counts in neither window"
        );
        let view = RateView::new(&v, limits, 1);
        assert_eq!(view.reset, (v.now / 60 + 1) * 60);
        assert_eq!(view.retry_after, Some(view.reset - v.now));
        assert!(view.retry_after.unwrap() >= 1);
    }
}

async fn the_day_window_binds_when_it_is_smaller(subject: &Subject) {
    let store = &*subject.store;
    let limits = md(100, 3);
    for _ in 0..3 {
        assert_eq!(
            outcome(store, "k2", limits, &NO_BANS()).await,
            Outcome::Admitted
        );
    }
    let v = store
        .acquire(&Arc::from("k2"), limits, 1, &NO_BANS())
        .await
        .unwrap();
    assert_eq!(v.outcome, Outcome::Limited);
    let view = RateView::new(&v, limits, 1);
    assert_eq!(
        (view.limit, view.remaining, view.reset),
        (3, 0, (v.now / 86_400 + 1) * 86_400)
    );
}

async fn concurrent_requests_never_exceed_the_limit(subject: &Subject) {
    let store = Arc::clone(&subject.store);
    subject.fresh_minute(Duration::from_secs(15));
    let limits = md(50, 1_000);
    let tasks: Vec<_> = (0..300)
        .map(|_| {
            let store = Arc::clone(&store);
            tokio::spawn(async move { outcome(&*store, "hot", limits, &NO_BANS()).await })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        if t.await.unwrap() == Outcome::Admitted {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 50);
}

async fn keys_are_counted_apart(subject: &Subject) {
    let store = &*subject.store;
    subject.fresh_minute(Duration::from_secs(10));
    let limits = md(1, 10);
    assert_eq!(
        outcome(store, "a", limits, &NO_BANS()).await,
        Outcome::Admitted
    );
    assert_eq!(
        outcome(store, "a", limits, &NO_BANS()).await,
        Outcome::Limited
    );
    assert_eq!(
        outcome(store, "b", limits, &NO_BANS()).await,
        Outcome::Admitted
    );
}

async fn an_edited_limit_applies_to_the_next_request(subject: &Subject) {
    let store = &*subject.store;
    subject.fresh_minute(Duration::from_secs(10));
    let small = md(2, 100);
    let large = md(4, 100);
    for _ in 0..2 {
        store
            .acquire(&Arc::from("edit"), small, 1, &NO_BANS())
            .await
            .unwrap();
    }
    assert_eq!(
        outcome(store, "edit", small, &NO_BANS()).await,
        Outcome::Limited
    );
    let v = store
        .acquire(&Arc::from("edit"), large, 1, &NO_BANS())
        .await
        .unwrap();
    assert_eq!((v.outcome, v.counts[0]), (Outcome::Admitted, 3));
}

async fn strikes_past_the_threshold_ban_until_the_ban_ends(subject: &Subject) {
    let store = &*subject.store;
    subject.fresh_minute(Duration::from_secs(15));
    let limits = md(1, 100);
    let ban = BanPolicy {
        strikes: 3,
        durations: vec![2, 30],
        decay_secs: 3_600,
    };
    assert_eq!(outcome(store, "bad", limits, &ban).await, Outcome::Admitted);
    for _ in 0..3 {
        assert_eq!(outcome(store, "bad", limits, &ban).await, Outcome::Limited);
    }
    assert_eq!(store.ban_of("bad").await.unwrap(), None);
    let v = store
        .acquire(&Arc::from("bad"), limits, 1, &ban)
        .await
        .unwrap();
    assert_eq!((v.outcome, v.ban_started), (Outcome::Banned, true));
    assert_eq!(v.ban_until, v.now + 2);
    let view = RateView::new(&v, limits, 1);
    assert_eq!(
        (view.remaining, view.reset, view.retry_after),
        (0, v.now + 2, Some(2))
    );
    let banned = store.ban_of("bad").await.unwrap().expect("ban visible");
    assert_eq!(banned.until, v.ban_until);
    // Still banned, whatever the request.
    let again = store
        .acquire(&Arc::from("bad"), limits, 1, &ban)
        .await
        .unwrap();
    assert_eq!(
        (again.outcome, again.ban_until, again.ban_started),
        (Outcome::Banned, v.ban_until, false)
    );
    // The ban ends by itself.
    subject.wait(Duration::from_millis(2_100)).await;
    assert_eq!(store.ban_of("bad").await.unwrap(), None);
    assert!(
        store.bans().await.unwrap().is_empty(),
        "an ended ban is not listed"
    );
    assert_ne!(outcome(store, "bad", limits, &ban).await, Outcome::Banned);
}

async fn the_second_ban_is_longer(subject: &Subject) {
    let store = &*subject.store;
    subject.fresh_minute(Duration::from_secs(10));
    let limits = md(1, 100);
    let ban = BanPolicy {
        strikes: 1,
        durations: vec![1, 40],
        decay_secs: 3_600,
    };
    store
        .acquire(&Arc::from("esc"), limits, NO_ROOM, &ban)
        .await
        .unwrap();
    let first = store
        .acquire(&Arc::from("esc"), limits, NO_ROOM, &ban)
        .await
        .unwrap();
    assert_eq!(first.ban_until - first.now, 1);
    subject.wait(Duration::from_millis(1_100)).await;
    store
        .acquire(&Arc::from("esc"), limits, NO_ROOM, &ban)
        .await
        .unwrap();
    let second = store
        .acquire(&Arc::from("esc"), limits, NO_ROOM, &ban)
        .await
        .unwrap();
    assert_eq!(second.outcome, Outcome::Banned);
    assert_eq!(second.ban_until - second.now, 40);
    let listed: Vec<(String, u64)> = store
        .bans()
        .await
        .unwrap()
        .into_iter()
        .map(|b| (b.key_id, b.until))
        .collect();
    assert_eq!(
        listed,
        [("esc".to_owned(), second.ban_until)],
        "the list has the new end"
    );
}

async fn lifting_a_ban_ends_it_now(subject: &Subject) {
    let store = &*subject.store;
    let limits = md(1, 100);
    let ban = BanPolicy {
        strikes: 0,
        durations: vec![600],
        decay_secs: 3_600,
    };
    assert_eq!(
        outcome_at(store, "lift", limits, NO_ROOM, &ban).await,
        Outcome::Banned
    );
    assert_eq!(
        outcome_at(store, "other", limits, NO_ROOM, &ban).await,
        Outcome::Banned
    );
    let listed = |bans: Vec<proxy::quota::store::Ban>| {
        let mut ids: Vec<String> = bans.into_iter().map(|b| b.key_id).collect();
        ids.sort();
        ids
    };
    assert_eq!(listed(store.bans().await.unwrap()), ["lift", "other"]);
    assert!(store.lift_ban("lift").await.unwrap());
    assert_eq!(store.ban_of("lift").await.unwrap(), None);
    assert_eq!(
        listed(store.bans().await.unwrap()),
        ["other"],
        "one call lists the bans"
    );
    assert!(
        !store.lift_ban("lift").await.unwrap(),
        "nothing left to lift"
    );
    assert!(!store.lift_ban("never-seen").await.unwrap());
}

async fn a_clock_stepping_back_keeps_the_counts(subject: &Subject) {
    let store = &*subject.store;
    match &subject.clock {
        Some(clock) => clock.set(MIDNIGHT + 3),
        None => subject.fresh_minute(Duration::from_secs(10)),
    }
    let limits = md(100, 3);
    for _ in 0..3 {
        assert_eq!(
            outcome(store, "back", limits, &NO_BANS()).await,
            Outcome::Admitted
        );
    }
    subject.clock_steps_back_over_midnight("back");
    let v = store
        .acquire(&Arc::from("back"), limits, 1, &NO_BANS())
        .await
        .unwrap();
    assert_eq!(
        (v.outcome, v.counts[0], v.counts[1]),
        (Outcome::Limited, 3, 3),
        "an older window must not reset a newer one"
    );
}

async fn usage_is_read_and_reset_without_touching_bans(subject: &Subject) {
    let store = &*subject.store;
    subject.fresh_minute(Duration::from_secs(10));
    let limits = md(3, 100);
    let ban = BanPolicy {
        strikes: 0,
        durations: vec![600],
        decay_secs: 3_600,
    };
    assert_eq!(
        store.usage("u").await.unwrap().count(Every::MINUTE),
        0,
        "never seen"
    );
    for _ in 0..3 {
        assert_eq!(outcome(store, "u", limits, &ban).await, Outcome::Admitted);
    }
    let used = store.usage("u").await.unwrap();
    assert_eq!((used.count(Every::MINUTE), used.count(Every::DAY)), (3, 3));
    assert_eq!(outcome(store, "u", limits, &ban).await, Outcome::Banned);
    let used = store.usage("u").await.unwrap();
    assert_eq!(used.refused_today, 1, "the refusal that started the ban");
    assert!(used.last_admitted > 0 && used.last_admitted <= used.now);
    assert!(used.now - used.last_admitted <= 2);
    store.reset_usage("u").await.unwrap();
    let used = store.usage("u").await.unwrap();
    assert_eq!((used.count(Every::MINUTE), used.count(Every::DAY)), (0, 0));
    assert!(store.ban_of("u").await.unwrap().is_some(), "the ban stays");
    store.lift_ban("u").await.unwrap();
    let v = store
        .acquire(&Arc::from("u"), limits, 1, &ban)
        .await
        .unwrap();
    assert_eq!(
        (v.outcome, v.counts[0], v.counts[1]),
        (Outcome::Admitted, 1, 1)
    );
    store.reset_usage("never-seen").await.unwrap();
}

async fn a_cost_is_spent_in_every_window_or_not_at_all(subject: &Subject) {
    let store = &*subject.store;
    subject.fresh_minute(Duration::from_secs(10));
    let limits = md(12, 100);
    let spend = |cost| async move {
        store
            .acquire(&Arc::from("cost"), limits, cost, &NO_BANS())
            .await
            .unwrap()
    };
    for expected in [5, 10] {
        let v = spend(5).await;
        assert_eq!(
            (v.outcome, v.counts[0], v.counts[1]),
            (Outcome::Admitted, expected, expected)
        );
    }
    let v = spend(5).await;
    assert_eq!(
        (v.outcome, v.counts[0], v.counts[1]),
        (Outcome::Limited, 10, 10),
        "refused whole: nothing of its cost is counted"
    );
    let view = RateView::new(&v, limits, 5);
    assert_eq!(
        (view.remaining, view.retry_after),
        (2, Some(view.reset - v.now))
    );
    assert_eq!(spend(2).await.counts[0], 12, "the 2 left are still there");
    assert_eq!(spend(1).await.outcome, Outcome::Limited);
}

async fn a_one_second_window_refuses_until_the_next_second(subject: &Subject) {
    let store = &*subject.store;
    subject.fresh_minute(Duration::from_secs(10));
    let limits = windows(&[("1s", 2), ("1m", 100)], &[]);
    // Two in one second: start right after a second begins, so the three requests share it.
    if subject.clock.is_none() {
        let into = proxy::base::clock::unix_now_ms() % 1_000;
        tokio::time::sleep(Duration::from_millis(1_000 - into + 20)).await;
    }
    let mut last = None;
    for _ in 0..3 {
        last = Some(
            store
                .acquire(&Arc::from("sec"), limits, 1, &NO_BANS())
                .await
                .unwrap(),
        );
        if last.unwrap().outcome != Outcome::Admitted {
            break;
        }
    }
    let v = last.unwrap();
    assert_eq!(
        (v.outcome, v.counts[0], v.counts[1]),
        (Outcome::Limited, 2, 2)
    );
    let view = RateView::new(&v, limits, 1);
    assert_eq!(view.binding, Binding::Window(Every::Secs(1)));
    assert_eq!((view.reset, view.retry_after), (v.now + 1, Some(1)));
    subject.wait(Duration::from_millis(1_050)).await;
    let v = store
        .acquire(&Arc::from("sec"), limits, 1, &NO_BANS())
        .await
        .unwrap();
    assert_eq!(
        (v.outcome, v.counts[0], v.counts[1]),
        (Outcome::Admitted, 1, 3)
    );
}

async fn a_shadow_window_counts_but_never_refuses(subject: &Subject) {
    let store = &*subject.store;
    subject.fresh_minute(Duration::from_secs(10));
    let limits = windows(&[("1m", 2), ("1d", 100)], &["1m"]);
    for i in 1..=3 {
        let v = store
            .acquire(&Arc::from("shadow"), limits, 1, &NO_BANS())
            .await
            .unwrap();
        assert_eq!((v.outcome, v.counts[0]), (Outcome::Admitted, i));
        let view = RateView::new(&v, limits, 1);
        assert_eq!(
            view.shadow_over & 1 != 0,
            i > 2,
            "request {i} went past the shadow limit"
        );
        assert_eq!(
            view.binding,
            Binding::Window(Every::DAY),
            "a shadow window never binds"
        );
    }
}

async fn a_month_window_counts_until_the_month_ends(subject: &Subject) {
    let store = &*subject.store;
    subject.fresh_minute(Duration::from_secs(10));
    let limits = windows(&[("1m", 100), ("month", 3)], &[]);
    for _ in 0..3 {
        assert_eq!(
            outcome(store, "month", limits, &NO_BANS()).await,
            Outcome::Admitted
        );
    }
    let v = store
        .acquire(&Arc::from("month"), limits, 1, &NO_BANS())
        .await
        .unwrap();
    assert_eq!((v.outcome, v.counts[1]), (Outcome::Limited, 3));
    let view = RateView::new(&v, limits, 1);
    assert_eq!(view.binding, Binding::Window(Every::Month));
    assert_eq!(view.reset, Every::Month.reset(v.now));
    assert_eq!(view.retry_after, Some(view.reset - v.now));
    let used = store.usage("month").await.unwrap();
    assert_eq!(
        (used.count(Every::Month), used.count(Every::MINUTE)),
        (3, 3)
    );
}

async fn a_plan_edit_adding_or_dropping_windows_keeps_every_count(subject: &Subject) {
    let store = &*subject.store;
    subject.fresh_minute(Duration::from_secs(10));
    let before = md(100, 1_000);
    for _ in 0..3 {
        assert_eq!(
            outcome(store, "grow", before, &NO_BANS()).await,
            Outcome::Admitted
        );
    }
    let after = windows(&[("1s", 50), ("1m", 100), ("1h", 500), ("1d", 1_000)], &[]);
    let v = store
        .acquire(&Arc::from("grow"), after, 1, &NO_BANS())
        .await
        .unwrap();
    assert_eq!(v.outcome, Outcome::Admitted);
    assert_eq!(
        &v.counts[..4],
        &[1, 4, 1, 4],
        "the minute and day went on; the new ones start"
    );
    let only_day = windows(&[("1d", 1_000)], &[]);
    let v = store
        .acquire(&Arc::from("grow"), only_day, 1, &NO_BANS())
        .await
        .unwrap();
    assert_eq!(v.counts[0], 5);
    let v = store
        .acquire(&Arc::from("grow"), before, 1, &NO_BANS())
        .await
        .unwrap();
    assert_eq!(
        (v.counts[0], v.counts[1]),
        (6, 6),
        "the minute was kept, and went on counting while no window of its length was in force"
    );
}

async fn a_refusal_binds_the_refusing_window_that_resets_last(subject: &Subject) {
    let store = &*subject.store;
    subject.fresh_minute(Duration::from_secs(10));
    let limits = md(2, 2);
    for _ in 0..2 {
        assert_eq!(
            outcome(store, "both", limits, &NO_BANS()).await,
            Outcome::Admitted
        );
    }
    let v = store
        .acquire(&Arc::from("both"), limits, 1, &NO_BANS())
        .await
        .unwrap();
    let view = RateView::new(&v, limits, 1);
    assert_eq!(view.binding, Binding::Window(Every::DAY));
    assert_eq!(view.reset, (v.now / 86_400 + 1) * 86_400);
    assert_eq!(
        view.retry_after,
        Some(view.reset - v.now),
        "until both have room"
    );
}

async fn limits_of_other_lengths_on_one_quota_keep_each_others_counts(subject: &Subject) {
    let store = &*subject.store;
    subject.fresh_minute(Duration::from_secs(10));
    let monthly = windows(&[("1m", 100), ("month", 5)], &[]);
    let daily = windows(&[("1m", 100), ("1d", 50)], &[]);
    for _ in 0..2 {
        outcome(store, "shared", monthly, &NO_BANS()).await;
        outcome(store, "shared", daily, &NO_BANS()).await;
    }
    let v = store
        .acquire(&Arc::from("shared"), monthly, 1, &NO_BANS())
        .await
        .unwrap();
    assert_eq!(
        (v.counts[0], v.counts[1]),
        (5, 5),
        "the month counts every request of the quota, whatever plan asked"
    );
    let v = store
        .acquire(&Arc::from("shared"), daily, 1, &NO_BANS())
        .await
        .unwrap();
    assert_eq!(
        (v.counts[0], v.counts[1]),
        (6, 5),
        "the day counts from its first request on"
    );
}

async fn more_lengths_than_slots_never_lose_the_asking_plans_counts(subject: &Subject) {
    let store = &*subject.store;
    subject.fresh_minute(Duration::from_secs(10));
    let six = windows(
        &[
            ("1s", 100),
            ("1m", 100),
            ("1h", 100),
            ("1d", 100),
            ("7d", 100),
            ("month", 10),
        ],
        &[],
    );
    let other = windows(&[("10s", 1_000)], &[]);
    let mut admitted = 0;
    for _ in 0..15 {
        if outcome(store, "seven", six, &NO_BANS()).await == Outcome::Admitted {
            admitted += 1;
        }
        assert_eq!(
            outcome(store, "seven", other, &NO_BANS()).await,
            Outcome::Admitted
        );
    }
    // Each request of either plan spends the month: six's five fill it with the other's five.
    assert_eq!(
        admitted, 5,
        "a length evicted to make room must not be the asking plan's"
    );
}

/// The top consumers' index: what two flushes add up to, heaviest first, and a flush of
/// another day counts in its own day's ranking and in the month's, not in today's.
async fn two_flushes_rank_heaviest_first_and_periods_apart(subject: &Subject) {
    let store = &*subject.store;
    let now = subject
        .clock
        .as_ref()
        .map_or_else(proxy::base::clock::unix_now, Clock::now);
    let (day, month) = (now / 86_400, Every::Month.index(now));
    let of = |list: &[(&str, u64)]| -> Vec<(Arc<str>, u64)> {
        list.iter().map(|&(h, u)| (Arc::from(h), u)).collect()
    };
    let owned = |list: &[(&str, u64)]| -> Vec<(String, u64)> {
        list.iter().map(|&(h, u)| (h.to_owned(), u)).collect()
    };
    store
        .add_top(day, month, &of(&[("k1", 3), ("customer:acme", 5)]))
        .await
        .expect("store answers");
    store
        .add_top(day, month, &of(&[("k1", 4)]))
        .await
        .expect("store answers");
    store
        .add_top(day - 1, month, &of(&[("k0", 100)]))
        .await
        .expect("store answers");
    let today = store.top(TopWindow::Day, 10).await.expect("store answers");
    assert_eq!(today, (day, owned(&[("k1", 7), ("customer:acme", 5)])));
    let first = store.top(TopWindow::Day, 1).await.expect("store answers");
    assert_eq!(first.1, owned(&[("k1", 7)]));
    let this_month = store
        .top(TopWindow::Month, 10)
        .await
        .expect("store answers");
    assert_eq!(
        this_month,
        (
            month,
            owned(&[("k0", 100), ("k1", 7), ("customer:acme", 5)])
        )
    );
}

/// A name is claimed once, by the first of many claimants at once, until its end; its
/// claimant may ask again (an answer lost to a timeout), no other can.
async fn a_name_is_claimed_once_until_it_ends(subject: &Subject) {
    let store = Arc::clone(&subject.store);
    let now = subject
        .clock
        .as_ref()
        .map_or_else(proxy::base::clock::unix_now, Clock::now);
    let claims: Vec<_> = (0..8)
        .map(|i| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                let me = format!("node-{i}");
                (
                    me.clone(),
                    store.claim_once("expiring:k1:7", &me, now + 60).await,
                )
            })
        })
        .collect();
    let mut winners = Vec::new();
    for c in claims {
        let (me, won) = c.await.expect("task");
        if won.expect("store answers") {
            winners.push(me);
        }
    }
    assert_eq!(winners.len(), 1, "exactly one claimant: {winners:?}");
    let first = &winners[0];
    let again = store.claim_once("expiring:k1:7", first, now + 60).await;
    assert!(
        again.expect("store answers"),
        "the first claimant, asking again"
    );
    let other = store.claim_once("expiring:k1:7", "node-x", now + 60).await;
    assert!(!other.expect("store answers"));
    assert!(store
        .claim_once("expiring:k2:7", "a", now + 2)
        .await
        .expect("store answers"));
    assert!(!store
        .claim_once("expiring:k2:7", "b", now + 2)
        .await
        .expect("store answers"));
    subject.wait(Duration::from_secs(3)).await;
    assert!(
        store
            .claim_once("expiring:k2:7", "b", now + 60)
            .await
            .expect("store answers"),
        "a claim that ended can be made again"
    );
}

#[tokio::test]
async fn memory_a_clock_stepping_back_keeps_the_counts() {
    a_clock_stepping_back_keeps_the_counts(&memory()).await
}

#[tokio::test]
async fn redis_a_clock_stepping_back_keeps_the_counts() {
    a_clock_stepping_back_keeps_the_counts(&redis()).await
}

/// Waits until `quota`'s requests in flight, as the store counts them, are `want` (a release
/// rides the lane's next run: it is not there the moment it is queued), asking again through
/// a store that does not answer for a while (paused).
async fn in_flight_reaches(store: &dyn QuotaStore, quota: &str, want: u64, within: Duration) {
    let started = std::time::Instant::now();
    loop {
        let now = store.usage(quota).await.map(|u| u.in_flight);
        if matches!(now, Ok(n) if n == want) {
            return;
        }
        assert!(
            started.elapsed() < within,
            "{quota}: {now:?} in flight, not {want}, after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Leases ending in the same second, given back at once (one batch on Redis, where they travel
/// as one entry with their number): each one frees its place.
async fn releases_of_one_second_given_back_together_each_count(subject: &Subject) {
    let store = &*subject.store;
    let limits = md(100, 1_000).with_concurrency(6);
    let quota: Arc<str> = Arc::from("together");
    let mut leases = Vec::new();
    for _ in 0..6 {
        let v = store.acquire(&quota, limits, 1, &NO_BANS()).await.unwrap();
        assert_eq!(v.outcome, Outcome::Admitted);
        leases.push(v.lease);
    }
    let ends: std::collections::BTreeSet<u64> = leases.iter().map(|l| l.end).collect();
    assert!(ends.len() <= 2, "taken within a second or two: {ends:?}");
    // Five go back together; the sixth is still held.
    for lease in &leases[..5] {
        store.release(&quota, *lease);
    }
    in_flight_reaches(store, &quota, 1, Duration::from_secs(2)).await;
    for _ in 0..5 {
        let v = store.acquire(&quota, limits, 1, &NO_BANS()).await.unwrap();
        assert_eq!(v.outcome, Outcome::Admitted);
    }
    let full = store.acquire(&quota, limits, 1, &NO_BANS()).await.unwrap();
    assert_eq!(full.outcome, Outcome::ConcurrencyLimited);
}

async fn a_concurrency_admits_that_many_at_once_and_a_release_makes_room(subject: &Subject) {
    let store = &*subject.store;
    subject.fresh_minute(Duration::from_secs(15));
    let limits = md(100, 1_000).with_concurrency(2);
    let quota: Arc<str> = Arc::from("c1");
    let first = store.acquire(&quota, limits, 1, &NO_BANS()).await.unwrap();
    let second = store.acquire(&quota, limits, 1, &NO_BANS()).await.unwrap();
    assert_eq!(
        (first.outcome, second.outcome),
        (Outcome::Admitted, Outcome::Admitted)
    );
    assert_eq!((first.lease.in_flight, second.lease.in_flight), (1, 2));
    assert!(first.lease.end >= first.now + LEASE_SECS - 1);
    let refused = store.acquire(&quota, limits, 1, &NO_BANS()).await.unwrap();
    assert_eq!(refused.outcome, Outcome::ConcurrencyLimited);
    assert_eq!(
        refused.lease,
        Lease {
            end: 0,
            in_flight: 2
        }
    );
    assert_eq!(
        (refused.counts[0], refused.counts[1]),
        (2, 2),
        "the refusal spent nothing"
    );
    let view = RateView::new(&refused, limits, 1);
    assert_eq!((view.remaining, view.retry_after), (98, Some(1)));
    assert_eq!(store.usage(&quota).await.unwrap().in_flight, 2);
    store.release(&quota, first.lease);
    in_flight_reaches(store, &quota, 1, Duration::from_secs(2)).await;
    let third = store.acquire(&quota, limits, 1, &NO_BANS()).await.unwrap();
    assert_eq!(third.outcome, Outcome::Admitted);
    // A quota without a concurrency takes no lease.
    let plain = store
        .acquire(&Arc::from("c1-plain"), md(100, 1_000), 1, &NO_BANS())
        .await;
    assert_eq!(plain.unwrap().lease, Lease::default());
}

async fn a_concurrency_refusal_strikes_nothing_and_a_full_window_wins(subject: &Subject) {
    let store = &*subject.store;
    subject.fresh_minute(Duration::from_secs(15));
    // One strike would ban: concurrency refusals are no strikes.
    let strict = BanPolicy {
        strikes: 0,
        ..BanPolicy::default()
    };
    let quota: Arc<str> = Arc::from("c2");
    let limits = md(3, 1_000).with_concurrency(1);
    assert_eq!(
        store
            .acquire(&quota, limits, 1, &strict)
            .await
            .unwrap()
            .outcome,
        Outcome::Admitted
    );
    for _ in 0..5 {
        let v = store.acquire(&quota, limits, 1, &strict).await.unwrap();
        assert_eq!((v.outcome, v.ban_until), (Outcome::ConcurrencyLimited, 0));
    }
    assert_eq!(store.ban_of(&quota).await.unwrap(), None);
    // The window full as well: `rate_limited` (and its strike) wins over the concurrency.
    let tight = md(1, 1_000).with_concurrency(1);
    let v = store.acquire(&quota, tight, 1, &strict).await.unwrap();
    assert_eq!(
        v.outcome,
        Outcome::Banned,
        "the window's refusal strikes: {v:?}"
    );
}

async fn concurrent_decisions_never_exceed_the_concurrency(subject: &Subject) {
    let store = Arc::clone(&subject.store);
    subject.fresh_minute(Duration::from_secs(15));
    let limits = md(1_000, 10_000).with_concurrency(5);
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                store
                    .acquire(&Arc::from("c3"), limits, 1, &NO_BANS())
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        let v = t.await.unwrap();
        if v.outcome == Outcome::Admitted {
            admitted += 1;
            assert!(v.lease.taken() && v.lease.in_flight <= 5, "{v:?}");
        }
    }
    assert_eq!(admitted, 5);
}

async fn a_lease_nobody_gives_back_ends_by_itself_and_a_renewal_outlives_it(subject: &Subject) {
    let store = &*subject.store;
    let limits = md(1_000, 10_000).with_concurrency(1);
    let (kept, lost): (Arc<str>, Arc<str>) = (Arc::from("c4-kept"), Arc::from("c4-lost"));
    let held = store.acquire(&kept, limits, 1, &NO_BANS()).await.unwrap();
    let abandoned = store.acquire(&lost, limits, 1, &NO_BANS()).await.unwrap();
    assert!(held.lease.taken() && abandoned.lease.taken());
    subject.wait(Duration::from_secs(LEASE_SECS - 1)).await;
    let renewed = store.renew(&kept, held.lease).await.unwrap();
    assert!(
        renewed.end > held.lease.end,
        "{renewed:?} after {:?}",
        held.lease
    );
    assert_eq!(renewed.in_flight, 1);
    // Past the first end by at least half a second, before the renewed one's by as much (the
    // store's clock counts whole seconds).
    subject.wait(Duration::from_millis(1_500)).await;
    // The lease nobody renewed (its node died) has ended; the renewed one holds its place.
    assert_eq!(
        store
            .acquire(&lost, limits, 1, &NO_BANS())
            .await
            .unwrap()
            .outcome,
        Outcome::Admitted
    );
    assert_eq!(
        store
            .acquire(&kept, limits, 1, &NO_BANS())
            .await
            .unwrap()
            .outcome,
        Outcome::ConcurrencyLimited
    );
    store.release(&kept, renewed);
    in_flight_reaches(store, &kept, 0, Duration::from_secs(2)).await;
    // A renewal of a lease that is gone takes one again: its request is still in flight.
    let back = store.renew(&kept, held.lease).await.unwrap();
    assert_eq!(back.in_flight, 1);
    assert_eq!(store.usage(&kept).await.unwrap().in_flight, 1);
}

macro_rules! store_suite {
    ($($store:ident),*) => {$(
        mod $store {
            use super::*;

            #[tokio::test]
            async fn admits_exactly_the_minute_limit_and_refusals_do_not_count() {
                super::admits_exactly_the_minute_limit_and_refusals_do_not_count(&$store()).await
            }
            #[tokio::test]
            async fn the_day_window_binds_when_it_is_smaller() {
                super::the_day_window_binds_when_it_is_smaller(&$store()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_requests_never_exceed_the_limit() {
                super::concurrent_requests_never_exceed_the_limit(&$store()).await
            }
            #[tokio::test]
            async fn keys_are_counted_apart() {
                super::keys_are_counted_apart(&$store()).await
            }
            #[tokio::test]
            async fn an_edited_limit_applies_to_the_next_request() {
                super::an_edited_limit_applies_to_the_next_request(&$store()).await
            }
            #[tokio::test]
            async fn strikes_past_the_threshold_ban_until_the_ban_ends() {
                super::strikes_past_the_threshold_ban_until_the_ban_ends(&$store()).await
            }
            #[tokio::test]
            async fn the_second_ban_is_longer() {
                super::the_second_ban_is_longer(&$store()).await
            }
            #[tokio::test]
            async fn usage_is_read_and_reset_without_touching_bans() {
                super::usage_is_read_and_reset_without_touching_bans(&$store()).await
            }
            #[tokio::test]
            async fn lifting_a_ban_ends_it_now() {
                super::lifting_a_ban_ends_it_now(&$store()).await
            }
            #[tokio::test]
            async fn a_cost_is_spent_in_every_window_or_not_at_all() {
                super::a_cost_is_spent_in_every_window_or_not_at_all(&$store()).await
            }
            #[tokio::test]
            async fn a_one_second_window_refuses_until_the_next_second() {
                super::a_one_second_window_refuses_until_the_next_second(&$store()).await
            }
            #[tokio::test]
            async fn a_shadow_window_counts_but_never_refuses() {
                super::a_shadow_window_counts_but_never_refuses(&$store()).await
            }
            #[tokio::test]
            async fn a_month_window_counts_until_the_month_ends() {
                super::a_month_window_counts_until_the_month_ends(&$store()).await
            }
            #[tokio::test]
            async fn a_plan_edit_adding_or_dropping_windows_keeps_every_count() {
                super::a_plan_edit_adding_or_dropping_windows_keeps_every_count(&$store()).await
            }
            #[tokio::test]
            async fn a_refusal_binds_the_refusing_window_that_resets_last() {
                super::a_refusal_binds_the_refusing_window_that_resets_last(&$store()).await
            }
            #[tokio::test]
            async fn more_lengths_than_slots_never_lose_the_asking_plans_counts() {
                super::more_lengths_than_slots_never_lose_the_asking_plans_counts(&$store()).await
            }
            #[tokio::test]
            async fn two_flushes_rank_heaviest_first_and_periods_apart() {
                super::two_flushes_rank_heaviest_first_and_periods_apart(&$store()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_name_is_claimed_once_until_it_ends() {
                super::a_name_is_claimed_once_until_it_ends(&$store()).await
            }
            #[tokio::test]
            async fn limits_of_other_lengths_on_one_quota_keep_each_others_counts() {
                super::limits_of_other_lengths_on_one_quota_keep_each_others_counts(&$store()).await
            }
            #[tokio::test]
            async fn a_concurrency_admits_that_many_at_once_and_a_release_makes_room() {
                super::a_concurrency_admits_that_many_at_once_and_a_release_makes_room(&$store()).await
            }
            #[tokio::test]
            async fn releases_of_one_second_given_back_together_each_count() {
                super::releases_of_one_second_given_back_together_each_count(&$store()).await
            }
            #[tokio::test]
            async fn a_concurrency_refusal_strikes_nothing_and_a_full_window_wins() {
                super::a_concurrency_refusal_strikes_nothing_and_a_full_window_wins(&$store()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_decisions_never_exceed_the_concurrency() {
                super::concurrent_decisions_never_exceed_the_concurrency(&$store()).await
            }
            #[tokio::test]
            async fn a_lease_nobody_gives_back_ends_by_itself_and_a_renewal_outlives_it() {
                super::a_lease_nobody_gives_back_ends_by_itself_and_a_renewal_outlives_it(&$store()).await
            }
        }
    )*};
}

store_suite!(memory, redis, redis_unbatched, redis_by_script, cluster);

/// Redis only: environments sharing one Redis never share counts, every key expires, and all
/// of a key's state sits under its hash tag.
#[tokio::test]
async fn redis_prefixes_keep_environments_apart_and_keys_expire() {
    fresh_minute(Duration::from_secs(10));
    let server = RedisServer::start();
    let production =
        RedisStore::new(&server.url(), "pet:production", Duration::from_millis(500)).unwrap();
    let staging =
        RedisStore::new(&server.url(), "pet:staging", Duration::from_millis(500)).unwrap();
    let limits = md(2, 100);
    for _ in 0..2 {
        staging
            .acquire(&Arc::from("k"), limits, 1, &NO_BANS())
            .await
            .unwrap();
    }
    assert_eq!(
        outcome(&staging, "k", limits, &NO_BANS()).await,
        Outcome::Limited
    );
    let v = production
        .acquire(&Arc::from("k"), limits, 1, &NO_BANS())
        .await
        .unwrap();
    assert_eq!((v.outcome, v.counts[0]), (Outcome::Admitted, 1));
    // A concurrency keeps its leases beside the state, under the same hash tag.
    let v = production
        .acquire(&Arc::from("k"), limits.with_concurrency(3), 1, &NO_BANS())
        .await
        .unwrap();
    assert_eq!((v.outcome, v.lease.in_flight), (Outcome::Admitted, 1));

    let client = ::redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let mut keys: Vec<String> = ::redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .unwrap();
    keys.sort();
    assert_eq!(
        keys,
        [
            "pet:production:leases:{k}",
            "pet:production:windows:{k}",
            "pet:staging:windows:{k}"
        ]
    );
    for key in keys {
        let ttl: i64 = ::redis::cmd("TTL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        let most = if key.contains(":leases:") {
            proxy::quota::store::memory::DEFAULT_LEASE_SECS as i64
        } else {
            86_400
        };
        assert!(ttl > 0 && ttl <= most, "{key} expires (ttl {ttl})");
    }
    // Given back, the last lease takes its key with it.
    production.release(&Arc::from("k"), v.lease);
    let started = std::time::Instant::now();
    loop {
        let exists: i64 = ::redis::cmd("EXISTS")
            .arg("pet:production:leases:{k}")
            .query_async(&mut conn)
            .await
            .unwrap();
        if exists == 0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the leases stay"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Redis only: a decision whose caller stopped waiting (its request ended, its task dropped)
/// while Redis held the script may still take a lease when Redis gets to it; that answer, come
/// to nobody, gives the lease back at once, batched or not, rather than holding the place for
/// the lease's whole length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_decision_nobody_waits_for_gives_back_the_lease_its_answer_took() {
    for batch_max in [128, 1] {
        let server = RedisServer::start();
        let store = Arc::new(
            RedisStore::new(&server.url(), "t", Duration::from_millis(2_000))
                .unwrap()
                .with_batch_max(batch_max)
                .with_lease_secs(120),
        );
        let limits = md(1_000, 10_000).with_concurrency(1);
        let quota: Arc<str> = Arc::from("late");
        // Connected, and the scripts loaded (a `NOSCRIPT` answered after the pause would send
        // the script again, after the usage asked below), so the pause holds the decision and
        // Redis runs it first.
        let warm = store
            .acquire(&Arc::from("warm"), limits, 1, &NO_BANS())
            .await;
        assert!(warm.unwrap().lease.taken());
        assert_eq!(store.usage(&quota).await.unwrap().in_flight, 0);
        let client = ::redis::Client::open(server.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let _: () = ::redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(300)
            .arg("WRITE")
            .query_async(&mut conn)
            .await
            .unwrap();
        let asking = {
            let (store, quota) = (Arc::clone(&store), Arc::clone(&quota));
            tokio::spawn(async move { store.acquire(&quota, limits, 1, &NO_BANS()).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        asking.abort();
        assert!(asking.await.unwrap_err().is_cancelled());
        // Redis runs it once the pause ends, and the answer nobody waits for gives its lease
        // back: the place is free long before the lease would end.
        in_flight_reaches(&*store, &quota, 0, Duration::from_secs(3)).await;
        let v = store.acquire(&quota, limits, 1, &NO_BANS()).await.unwrap();
        assert_eq!(v.outcome, Outcome::Admitted, "batch_max {batch_max}");
        assert_eq!(
            v.lease.in_flight, 1,
            "batch_max {batch_max}: it ran, then gave it back"
        );
    }
}

/// Redis only: a renewal that timed out but ran moved its lease to an end the node never learnt
/// (its late answer gives that one back); the node must then neither give back nor renew the
/// old end, which another request's lease of the same second holds: it takes a fresh lease.
#[tokio::test]
async fn redis_a_renewal_in_doubt_never_takes_another_requests_place() {
    let server = RedisServer::start();
    let open = |timeout_ms| {
        Arc::new(
            RedisStore::new(&server.url(), "t", Duration::from_millis(timeout_ms))
                .unwrap()
                .with_lease_secs(9),
        )
    };
    let (store_a, store_b) = (open(200), open(2_000));
    let limits = md(1_000, 10_000).with_concurrency(5);
    let quota: Arc<str> = Arc::from("doubt");
    // Two requests (two nodes) whose leases end in the same second.
    let (a, b) = loop {
        let a = store_a
            .acquire(&quota, limits, 1, &NO_BANS())
            .await
            .unwrap();
        let b = store_b
            .acquire(&quota, limits, 1, &NO_BANS())
            .await
            .unwrap();
        if a.lease.end == b.lease.end {
            break (a, b);
        }
        store_a.release(&quota, a.lease);
        store_b.release(&quota, b.lease);
        in_flight_reaches(&*store_b, &quota, 0, Duration::from_secs(2)).await;
    };
    let slots = Arc::new(Slots::new(
        Arc::clone(&store_a) as Arc<dyn QuotaStore>,
        &Resilience::default(),
        9,
    ));
    // Held as if a second were left of it: its renewal is due now, and both leases still
    // have seconds to run.
    let slot = slots.hold(&quota, a.lease, false, a.lease.end - 1);
    let client = ::redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = ::redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(500)
        .arg("WRITE")
        .query_async(&mut conn)
        .await
        .unwrap();
    // Times out at 200 ms; Redis runs it when the pause ends, moving a's lease to a new end
    // (which stays, or is given back by a late answer: either way, not by a's node).
    slots.renew_due().await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    let before = store_b.usage(&quota).await.unwrap().in_flight;
    assert!(
        (1..=2).contains(&before),
        "{before}: b's, and a's moved one if kept"
    );
    // The next pass takes a fresh lease beside b's, and does not take b's for the one in
    // doubt.
    slots.renew_due().await;
    let after = store_b.usage(&quota).await.unwrap().in_flight;
    assert_eq!(after, before + 1, "b's lease kept, a fresh one for a");
    drop(slot);
    in_flight_reaches(&*store_b, &quota, before, Duration::from_secs(2)).await;
    store_b.release(&quota, b.lease);
    in_flight_reaches(&*store_b, &quota, before - 1, Duration::from_secs(2)).await;
}

/// Redis only: leases no gateway writes (one ending past the longest lease, as a clock that went
/// back leaves; more pairs than a lease has seconds) are dropped, so they never hold a quota's
/// places for good.
#[tokio::test]
async fn redis_leases_ending_too_far_off_or_too_many_are_dropped() {
    let server = RedisServer::start();
    let store = RedisStore::new(&server.url(), "t", Duration::from_millis(2_000)).unwrap();
    let limits = md(1_000, 10_000).with_concurrency(2);
    let client = ::redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as u32;
    let pair = |end: u32, count: u32| [end.to_le_bytes(), count.to_le_bytes()].concat();
    // Two places held until an hour from now, one until 60 s from now: only the last holds.
    let ahead = [pair(now + 3_600, 2), pair(now + 60, 1)].concat();
    let _: () = ::redis::cmd("SET")
        .arg("t:leases:{ahead}")
        .arg(ahead)
        .query_async(&mut conn)
        .await
        .unwrap();
    let v = store
        .acquire(&Arc::from("ahead"), limits, 1, &NO_BANS())
        .await
        .unwrap();
    assert_eq!(v.outcome, Outcome::Admitted);
    assert_eq!(v.lease.in_flight, 2, "the one held and this one");
    // 2,000 pairs, each a place held for a minute: not a gateway's, dropped whole.
    let many: Vec<u8> = (0..2_000u32)
        .flat_map(|i| pair(now + 60, 1 + i % 2))
        .collect();
    let _: () = ::redis::cmd("SET")
        .arg("t:leases:{many}")
        .arg(many)
        .query_async(&mut conn)
        .await
        .unwrap();
    let v = store
        .acquire(&Arc::from("many"), limits, 1, &NO_BANS())
        .await
        .unwrap();
    assert_eq!(v.outcome, Outcome::Admitted);
    assert_eq!(v.lease.in_flight, 1);
}

/// A loopback relay to `to` whose server side is slow to speak first: the first bytes each
/// connection's server sends reach the client `delay` late (a TLS handshake or `HELLO` on a
/// loaded host), everything after at once.
fn slow_to_open(to: std::net::SocketAddr, delay: Duration) -> std::net::SocketAddr {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let Ok(server) = TcpStream::connect(to) else {
                continue;
            };
            let (mut c_in, mut s_out) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || std::io::copy(&mut c_in, &mut s_out));
            let (mut s_in, mut c_out) = (server, client);
            std::thread::spawn(move || {
                let mut buf = [0u8; 16 * 1024];
                let mut first = true;
                while let Ok(n) = s_in.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    if std::mem::take(&mut first) {
                        std::thread::sleep(delay);
                    }
                    if c_out.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = c_out.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    addr
}

/// Redis only: a connection that takes longer to open than a call's deadline (a TLS handshake
/// on a loaded host: CI saw one never made) is still made. Calls keep failing at their
/// deadline meanwhile; the connection's own attempt is not cut off at a call's deadline, or
/// every attempt would fail the same way and the store would stay unreachable.
#[tokio::test]
async fn redis_a_connection_slower_to_open_than_a_call_is_still_made() {
    let server = RedisServer::start();
    let relay = slow_to_open(server.addr, Duration::from_millis(150));
    let store =
        RedisStore::new(&format!("redis://{relay}/"), "t", Duration::from_millis(50)).unwrap();
    let started = std::time::Instant::now();
    let mut failed = 0;
    loop {
        let call = std::time::Instant::now();
        match store
            .acquire(&Arc::from("k"), md(100, 1_000), 1, &NO_BANS())
            .await
        {
            Ok(v) => {
                assert_eq!(v.outcome, Outcome::Admitted);
                break;
            }
            Err(e) => {
                failed += 1;
                assert!(
                    call.elapsed() < Duration::from_millis(500),
                    "a call waited past its deadline: {e}"
                );
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "no connection within 5 s ({failed} calls failed)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        failed > 0,
        "the first call should have met the slow opening"
    );
}

/// Redis only, over TLS: a store's first connection is opened in the background, not only while
/// a call waits on it. A handshake of several round trips (TLS, then `HELLO`) whose server is
/// slow, met by one call and then by none for a while (the breaker open, its probe every 250
/// ms), must be done when the next call comes, not cut off by its bound then.
#[tokio::test]
async fn redis_tls_a_first_connection_opens_between_calls() {
    let dir = tempfile::tempdir().unwrap();
    let ca = e2e::OpensslCa::new(dir.path(), "relay");
    let (cert, key) = ca.issue("redis-node");
    let addr = e2e::free_addr();
    let settings = e2e::tls_settings(addr, &ca.cert, &cert, &key, "no");
    let settings: Vec<&str> = settings.iter().map(String::as_str).collect();
    let ca_path = ca.cert.to_string_lossy().into_owned();
    let server = RedisServer::start_custom(addr, &settings, &["--tls", "--cacert", &ca_path]);
    let relay = slow_to_open(server.addr, Duration::from_millis(150));
    let mut access = RedisAccess::from_url(&format!("rediss://{relay}/")).unwrap();
    access.tls_files.ca = Some(ca.cert.clone());
    let store = RedisStore::connecting(access, "t", Duration::from_millis(50)).unwrap();
    let (quota, limits): (Arc<str>, _) = (Arc::from("k"), md(100, 1_000));
    let first = store.acquire(&quota, limits, 1, &NO_BANS()).await;
    assert!(first.is_err(), "the server's first bytes come 150 ms late");
    // With no call made, the server sees the store's connection done with its handshake (TLS,
    // then `HELLO`: a command, where one still opening shows `cmd=NULL`), beside redis-cli's
    // own: it was opened in the background. Read from the server, not timed, so a loaded
    // machine that takes longer over the handshake cannot fail it.
    let opened = std::time::Instant::now();
    let ready = |list: String| {
        list.lines()
            .any(|l| !l.contains("cmd=NULL") && !l.contains("cmd=client|list"))
    };
    while !ready(server.cli(&["CLIENT", "LIST"])) {
        assert!(
            opened.elapsed() < Duration::from_secs(10),
            "no connection opened without a call waiting on it"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The call then finds it open. Its own bound is 50 ms, which a loaded machine's scheduler
    // alone can pass: a few tries, none of which opens anything.
    let mut outcome = None;
    for _ in 0..5 {
        if let Ok(v) = store.acquire(&quota, limits, 1, &NO_BANS()).await {
            outcome = Some(v.outcome);
            break;
        }
    }
    assert_eq!(outcome, Some(Outcome::Admitted), "connected meanwhile");
}

/// Redis only: a dead Redis is an error within the deadline, never a hang.
#[tokio::test]
async fn redis_unreachable_fails_within_the_deadline() {
    let addr = e2e::free_addr();
    let store =
        RedisStore::new(&format!("redis://{addr}/"), "t", Duration::from_millis(100)).unwrap();
    let started = std::time::Instant::now();
    let result = store
        .acquire(&Arc::from("k"), md(1, 1), 1, &NO_BANS())
        .await;
    assert!(result.is_err(), "{result:?}");
    assert!(
        started.elapsed() < Duration::from_millis(600),
        "took {:?}",
        started.elapsed()
    );
}

/// Redis only: state written by the version before windows as data (twelve fields, minute and
/// day, 48 bytes under `<prefix>:state:{id}`) is carried over on the first decision, so an
/// upgrade keeps every count and ban, and the new state expires like any other.
#[tokio::test]
async fn redis_state_of_the_previous_version_is_carried_over() {
    fresh_minute(Duration::from_secs(10));
    let server = RedisServer::start();
    let store = RedisStore::new(&server.url(), "pet:prod", Duration::from_millis(500)).unwrap();
    let now = proxy::base::clock::unix_now();
    let (mw, dw) = (now / 60, now / 86_400);
    // mw, mc, dw, dc, sw, sc, bu, lv, lu, rd, rc, la
    let old = |key: &str, fields: [u64; 12]| {
        let args: Vec<String> = fields.iter().map(u64::to_string).collect();
        let mut cli = vec![
            "EVAL",
            "return redis.call('SET', KEYS[1], struct.pack('<IIIIIIIIIIII', unpack(ARGV)), 'EX', 86400)",
            "1",
            key,
        ];
        cli.extend(args.iter().map(String::as_str));
        assert_eq!(server.cli(&cli).trim(), "OK");
    };
    old(
        "pet:prod:state:{counted}",
        [mw, 5, dw, 7, 0, 0, 0, 0, 0, dw, 2, 1],
    );
    old(
        "pet:prod:state:{banned}",
        [0, 0, dw, 0, 0, 0, now + 600, 1, now + 4_000, 0, 0, 0],
    );
    let limits = md(100, 1_000);
    let v = store
        .acquire(&Arc::from("counted"), limits, 1, &NO_BANS())
        .await
        .unwrap();
    assert_eq!(
        (v.outcome, v.counts[0], v.counts[1]),
        (Outcome::Admitted, 6, 8)
    );
    let v = store
        .acquire(&Arc::from("banned"), limits, 1, &NO_BANS())
        .await
        .unwrap();
    assert_eq!((v.outcome, v.ban_until), (Outcome::Banned, now + 600));
    assert_eq!(
        store.ban_of("banned").await.unwrap().map(|b| b.until),
        Some(now + 600)
    );
    let ttl: i64 = server
        .cli(&["TTL", "pet:prod:windows:{counted}"])
        .trim()
        .parse()
        .unwrap();
    assert!(ttl > 0 && ttl <= 86_400, "ttl {ttl}");
    // From now on the new state counts, and the carried-over string is gone, so it cannot
    // come back when the new state expires.
    let usage = store.usage("counted").await.unwrap();
    assert_eq!(
        (
            usage.count(Every::MINUTE),
            usage.count(Every::DAY),
            usage.refused_today
        ),
        (6, 8, 2)
    );
    assert_eq!(
        server.cli(&["EXISTS", "pet:prod:state:{counted}"]).trim(),
        "0"
    );
}

/// Redis only: a state key holding another type (a stray write) starts again, logged, rather than
/// fail the script, which in a batch would fail every other quota's decision sent with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_state_key_of_another_type_starts_again_and_fails_nothing_beside_it() {
    fresh_minute(Duration::from_secs(10));
    let server = RedisServer::start();
    let store =
        Arc::new(RedisStore::new(&server.url(), "pet:prod", Duration::from_millis(500)).unwrap());
    assert_eq!(
        server
            .cli(&["RPUSH", "pet:prod:windows:{stray}", "x"])
            .trim(),
        "1"
    );
    assert_eq!(
        server
            .cli(&["HSET", "pet:prod:state:{old}", "f", "v"])
            .trim(),
        "1"
    );
    let limits = md(100, 1_000);
    // Sent together, so that the batch carries the stray key's decision beside the others.
    let decisions: Vec<_> = ["stray", "fine", "old", "stray"]
        .into_iter()
        .map(|id| {
            let store = Arc::clone(&store);
            tokio::spawn(async move { store.acquire(&Arc::from(id), limits, 1, &NO_BANS()).await })
        })
        .collect();
    let mut counts = Vec::new();
    for d in decisions {
        let v = d.await.unwrap().expect("decided");
        assert_eq!(v.outcome, Outcome::Admitted);
        counts.push(v.counts[0]);
    }
    counts.sort_unstable();
    assert_eq!(
        counts,
        [1, 1, 1, 2],
        "each quota counted from zero, the stray one twice"
    );
    assert_eq!(
        server.cli(&["TYPE", "pet:prod:windows:{stray}"]).trim(),
        "string"
    );
    assert_eq!(store.usage("old").await.unwrap().count(Every::MINUTE), 1);
}

/// Redis only: a ban longer than the state's 32-bit times can hold ends where the state says, in
/// the answer as in storage (never a ban that looks ended, or a different end on the next call).
#[tokio::test]
async fn redis_a_ban_past_2106_is_held_at_the_last_second_it_can_store() {
    let server = RedisServer::start();
    let store = RedisStore::new(&server.url(), "t", Duration::from_millis(500)).unwrap();
    let limits = md(1, 1);
    let ban = BanPolicy {
        strikes: 0,
        durations: vec![1 << 40],
        decay_secs: 1 << 40,
    };
    let v = store
        .acquire(&Arc::from("k"), limits, NO_ROOM, &ban)
        .await
        .unwrap();
    assert_eq!(
        (v.outcome, v.ban_until),
        (Outcome::Banned, u64::from(u32::MAX))
    );
    let again = store
        .acquire(&Arc::from("k"), limits, NO_ROOM, &ban)
        .await
        .unwrap();
    assert_eq!(again.ban_until, u64::from(u32::MAX));
    assert_eq!(
        store.ban_of("k").await.unwrap().map(|b| b.until),
        Some(u64::from(u32::MAX))
    );
}
