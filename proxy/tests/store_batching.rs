//! Group commit in the Redis store: decisions queued while a script run is in flight go to Redis
//! together in the next run, and are decided exactly as if sent one by one. Each test pauses a
//! real `redis-server` (`CLIENT PAUSE`) while it sends, so that the first decision's run is held
//! in flight and every other decision queues behind it: the batches are then known, not left to
//! the scheduler.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::{fresh_minute, RedisServer};
use proxy::keys::index::{KeyInfo, Overrides};
use proxy::keys::limits::{Every, Limits, WindowLimit};
use proxy::quota::admission::OnStoreError;
use proxy::quota::admission::{self, Admission};
use proxy::quota::resilience::Resilience;
use proxy::quota::rules::{BanPolicy, Outcome, Verdict};
use proxy::quota::store::redis::RedisStore;
use proxy::quota::store::QuotaStore;

const NO_BANS: fn() -> BanPolicy = || BanPolicy {
    strikes: u64::MAX / 2,
    ..BanPolicy::default()
};

/// Script runs Redis has executed (`EVALSHA` and `FCALL` calls that ran; a first call answered
/// `NOSCRIPT` or "Function not found", before the script or the library is loaded, counts as
/// failed).
fn script_runs(redis: &RedisServer) -> u64 {
    let stats = redis.cli(&["INFO", "commandstats"]);
    ["evalsha", "eval", "fcall"]
        .iter()
        .map(|c| {
            let (calls, failed) = e2e::command_calls(&stats, c);
            calls - failed
        })
        .sum()
}

/// Sends `keys.len()` decisions at once, in that order, while Redis is paused for `pause`, and
/// returns each one's verdict in the same order, and how many script runs Redis executed for
/// them all.
async fn burst_while_paused(
    redis: &RedisServer,
    store: &Arc<RedisStore>,
    keys: &[&str],
    limits: Limits,
    ban: BanPolicy,
    pause: Duration,
) -> (Vec<Verdict>, u64) {
    let before = script_runs(redis);
    assert_eq!(
        redis.cli(&["CLIENT", "PAUSE", &pause.as_millis().to_string(), "ALL"]),
        "OK"
    );
    let ban = Arc::new(ban);
    let mut tasks = Vec::new();
    for key in keys {
        let (store, ban, key) = (Arc::clone(store), Arc::clone(&ban), Arc::<str>::from(*key));
        tasks.push(tokio::spawn(async move {
            store.acquire(&key, limits, 1, &ban).await
        }));
        // Spawned in order, and each queued before the next is spawned: arrival order is known.
        tokio::task::yield_now().await;
    }
    let mut verdicts = Vec::new();
    for t in tasks {
        verdicts.push(t.await.unwrap().expect("the store answers"));
    }
    (verdicts, script_runs(redis) - before)
}

fn store(redis: &RedisServer, timeout: Duration) -> Arc<RedisStore> {
    Arc::new(RedisStore::new(&redis.url(), "batch", timeout).expect("store"))
}

/// Loads the script and opens the connection, so the counted runs are the test's own.
async fn warm(store: &RedisStore) {
    store
        .acquire(
            &Arc::from("warm-up"),
            Limits::minute_day(1_000, 1_000).unwrap(),
            1,
            &NO_BANS(),
        )
        .await
        .expect("the store answers");
}

#[tokio::test(flavor = "current_thread")]
async fn mixed_keys_in_batches_are_each_counted_exactly() {
    let redis = RedisServer::start();
    let store = store(&redis, Duration::from_secs(2));
    warm(&store).await;
    fresh_minute(Duration::from_secs(10));
    let limits = Limits::minute_day(40, 1_000).unwrap();
    let keys: Vec<&str> = (0..300).map(|i| ["a", "b", "c"][i % 3]).collect();
    let (verdicts, runs) = burst_while_paused(
        &redis,
        &store,
        &keys,
        limits,
        NO_BANS(),
        Duration::from_millis(300),
    )
    .await;
    // One run held by the pause, then the 299 queued behind it in runs of at most 128.
    assert!(runs <= 4, "{runs} script runs for 300 decisions");

    let mut admitted: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for (key, v) in keys.iter().zip(&verdicts) {
        match v.outcome {
            Outcome::Admitted => admitted.entry(key).or_default().push(v.counts[0]),
            Outcome::Limited => assert_eq!(v.counts[0], 40, "{key}: {v:?}"),
            Outcome::Banned | Outcome::ConcurrencyLimited | Outcome::Unleased => {
                panic!("no ban policy, concurrency or region here: {v:?}")
            }
        }
    }
    for key in ["a", "b", "c"] {
        // In arrival order: the first 40 of each key admitted, counted 1 to 40.
        assert_eq!(admitted[key], (1..=40).collect::<Vec<_>>(), "{key}");
    }
    let first_refused = keys
        .iter()
        .zip(&verdicts)
        .position(|(k, v)| *k == "a" && v.outcome == Outcome::Limited);
    assert_eq!(
        first_refused,
        Some(120),
        "key a's 41st request is the first refused"
    );
}

/// One batch carrying decisions under several sets of limits (plans of other windows, a cost):
/// each is decided under its own, exactly. A review found the script misreading every set after
/// the first, which failed such a batch whole.
#[tokio::test(flavor = "current_thread")]
async fn a_batch_of_several_plans_decides_each_under_its_own_limits() {
    let redis = RedisServer::start();
    let store = store(&redis, Duration::from_secs(2));
    warm(&store).await;
    fresh_minute(Duration::from_secs(10));
    let window =
        |every: &str, limit: u64| WindowLimit::new(Every::parse(every).unwrap(), limit).unwrap();
    let plans = [
        ("a", Limits::minute_day(40, 1_000).unwrap(), 1),
        (
            "b",
            Limits::new(&[window("1m", 5), window("month", 100)]).unwrap(),
            2,
        ),
        ("c", Limits::new(&[window("1h", 100)]).unwrap(), 1),
    ];
    let ban = Arc::new(NO_BANS());
    assert_eq!(redis.cli(&["CLIENT", "PAUSE", "300", "ALL"]), "OK");
    let mut tasks = Vec::new();
    for i in 0..150 {
        let (key, limits, cost) = plans[i % 3];
        let (store, ban) = (Arc::clone(&store), Arc::clone(&ban));
        tasks.push((
            key,
            tokio::spawn(async move { store.acquire(&Arc::from(key), limits, cost, &ban).await }),
        ));
        tokio::task::yield_now().await;
    }
    let mut admitted: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for (key, t) in tasks {
        let v = t
            .await
            .unwrap()
            .expect("every decision of a mixed batch is answered");
        if v.outcome == Outcome::Admitted {
            admitted.entry(key).or_default().push(v.counts[0]);
        }
    }
    assert_eq!(admitted["a"], (1..=40).collect::<Vec<_>>());
    assert_eq!(
        admitted["b"],
        [2, 4],
        "5 units at 2 a request: two pass, the third would pass 5"
    );
    assert_eq!(admitted["c"], (1..=50).collect::<Vec<_>>());
}

/// One quota under two sets of limits by turns in one run (a customer's keys on plans of other
/// windows): each decision exactly as if sent alone. The script carries a decision's finding
/// about the state's windows over to the next decision of the same quota and limits; a finding
/// carried over wrongly would show here as other counts.
#[tokio::test(flavor = "current_thread")]
async fn one_quota_under_two_plans_by_turns_in_one_run_counts_as_one_by_one() {
    let redis = RedisServer::start();
    let store = store(&redis, Duration::from_secs(2));
    warm(&store).await;
    fresh_minute(Duration::from_secs(10));
    let window =
        |every: &str, limit: u64| WindowLimit::new(Every::parse(every).unwrap(), limit).unwrap();
    let monthly = Limits::new(&[window("1m", 100), window("month", 5)]).unwrap();
    let daily = Limits::new(&[window("1m", 100), window("1d", 8)]).unwrap();
    let turns: Vec<Limits> = (0..24)
        .map(|i| if i % 3 == 2 { daily } else { monthly })
        .collect();
    let ban = Arc::new(NO_BANS());
    let before = script_runs(&redis);
    assert_eq!(redis.cli(&["CLIENT", "PAUSE", "300", "ALL"]), "OK");
    let mut tasks = Vec::new();
    for limits in turns.clone() {
        let (store, ban) = (Arc::clone(&store), Arc::clone(&ban));
        tasks.push(tokio::spawn(async move {
            store.acquire(&Arc::from("together"), limits, 1, &ban).await
        }));
        tokio::task::yield_now().await;
    }
    let mut together = Vec::new();
    for t in tasks {
        together.push(t.await.unwrap().expect("the store answers"));
    }
    assert!(script_runs(&redis) - before <= 2, "the turns share a run");
    for (i, (limits, v)) in turns.iter().zip(&together).enumerate() {
        let alone = store
            .acquire(&Arc::from("alone"), *limits, 1, &ban)
            .await
            .expect("the store answers");
        assert_eq!(
            (v.outcome, v.counts),
            (alone.outcome, alone.counts),
            "decision {i}"
        );
    }
    assert!(
        together.iter().any(|v| v.outcome == Outcome::Limited),
        "the month's 5 fill within the 24 turns"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn one_hot_key_admits_exactly_the_limit_in_arrival_order() {
    let redis = RedisServer::start();
    let store = store(&redis, Duration::from_secs(2));
    warm(&store).await;
    fresh_minute(Duration::from_secs(10));
    let limits = Limits::minute_day(60, 1_000).unwrap();
    let keys = vec!["hot"; 500];
    let (verdicts, runs) = burst_while_paused(
        &redis,
        &store,
        &keys,
        limits,
        NO_BANS(),
        Duration::from_millis(300),
    )
    .await;
    assert!(runs <= 5, "{runs} script runs for 500 decisions");
    let outcomes: Vec<Outcome> = verdicts.iter().map(|v| v.outcome).collect();
    assert_eq!(outcomes[..60], [Outcome::Admitted; 60]);
    assert_eq!(outcomes[60..], [Outcome::Limited; 440]);
    let counts: Vec<u64> = verdicts[..60].iter().map(|v| v.counts[0]).collect();
    assert_eq!(counts, (1..=60).collect::<Vec<_>>());
    let usage = store.usage("hot").await.unwrap();
    assert_eq!(
        (
            usage.count(Every::MINUTE),
            usage.count(Every::DAY),
            usage.refused_today
        ),
        (60, 60, 440)
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_ban_starting_inside_a_batch_refuses_the_rest_of_it() {
    let redis = RedisServer::start();
    let store = store(&redis, Duration::from_secs(2));
    warm(&store).await;
    fresh_minute(Duration::from_secs(10));
    let limits = Limits::minute_day(5, 1_000).unwrap();
    let ban = BanPolicy {
        strikes: 3,
        durations: vec![600],
        ..BanPolicy::default()
    };
    // Two keys interleaved: the ban of one must not touch the other.
    let keys: Vec<&str> = (0..100)
        .map(|i| if i % 12 == 11 { "calm" } else { "loud" })
        .collect();
    let (verdicts, runs) = burst_while_paused(
        &redis,
        &store,
        &keys,
        limits,
        ban,
        Duration::from_millis(300),
    )
    .await;
    // Two batches, and the ban index's own call when the ban starts.
    assert!(runs <= 3, "{runs} script runs for 100 decisions");
    let loud: Vec<&Verdict> = keys
        .iter()
        .zip(&verdicts)
        .filter(|(k, _)| **k == "loud")
        .map(|(_, v)| v)
        .collect();
    let outcomes: Vec<Outcome> = loud.iter().map(|v| v.outcome).collect();
    // 5 admitted, 3 strikes refused, the 4th refusal starts the ban, the rest are banned.
    assert_eq!(outcomes[..5], [Outcome::Admitted; 5]);
    assert_eq!(outcomes[5..8], [Outcome::Limited; 3]);
    assert_eq!(outcomes[8..], vec![Outcome::Banned; 84][..]);
    let started: Vec<usize> = (0..loud.len()).filter(|&i| loud[i].ban_started).collect();
    assert_eq!(started, [8], "exactly one request starts the ban");
    let until = loud[8].ban_until;
    assert!(until >= loud[8].now + 599, "{:?}", loud[8]);
    assert!(loud[9..].iter().all(|v| v.ban_until == until));

    let calm: Vec<Outcome> = keys
        .iter()
        .zip(&verdicts)
        .filter(|(k, _)| **k == "calm")
        .map(|(_, v)| v.outcome)
        .collect();
    assert_eq!(calm[..5], [Outcome::Admitted; 5]);
    assert_eq!(calm[5..], [Outcome::Limited; 3], "3 strikes: no ban yet");

    assert_eq!(
        store.ban_of("loud").await.unwrap().map(|b| b.until),
        Some(until)
    );
    assert_eq!(store.ban_of("calm").await.unwrap(), None);
    let listed: Vec<String> = store
        .bans()
        .await
        .unwrap()
        .into_iter()
        .map(|b| b.key_id)
        .collect();
    assert_eq!(
        listed,
        ["loud"],
        "the ban index has the ban started inside the batch"
    );
}

/// A batch whose run misses the deadline fails every decision in it, each within the deadline
/// of its own request, and admission then decides each by `on_store_error`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_times_out_falls_back_for_every_request_in_it() {
    let redis = RedisServer::start();
    let timeout = Duration::from_millis(200);
    let store = store(&redis, timeout);
    warm(&store).await;
    let admission = Arc::new(Admission::new(
        store.clone(),
        Resilience::default(),
        OnStoreError::Local,
        NO_BANS(),
    ));
    let limits = Limits::minute_day(1_000, 10_000).unwrap();
    let before = script_runs(&redis);
    assert_eq!(redis.cli(&["CLIENT", "PAUSE", "1500", "ALL"]), "OK");
    let started = Instant::now();
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let admission = Arc::clone(&admission);
            let key = KeyInfo {
                id: Arc::from(format!("k{}", i % 5)),
                plan: Arc::from("free"),
                overrides: Overrides::default(),
                quota: None,
            };
            tokio::spawn(async move {
                let decided = admission.decide(&key, limits, 1).await;
                (decided, started.elapsed())
            })
        })
        .collect();
    for t in tasks {
        let (decision, took) = t.await.unwrap();
        assert!(decision.degraded, "{decision:?}");
        assert_eq!(
            decision.outcome,
            admission::Outcome::Admitted,
            "counted locally"
        );
        assert!(
            took < timeout + Duration::from_millis(400),
            "waited {took:?}"
        );
    }
    // Once Redis is back the store decides again, exactly. A command of our own waits out the
    // pause (Redis lifts it on its own timer, which may run late on a loaded machine).
    paused_until_lifted(&redis).await;
    let v = store
        .acquire(&Arc::from("after"), limits, 1, &NO_BANS())
        .await
        .unwrap();
    assert_eq!((v.outcome, v.counts[0]), (Outcome::Admitted, 1));
    // The held run (and, at most, one more already sent) reached Redis; the decisions whose
    // requests had given up by then were never sent.
    let runs = script_runs(&redis) - before;
    assert!(runs <= 3, "{runs} script runs");
}

/// When a run misses its deadline, the decisions queued behind it fail with it at once: an
/// outage costs the requests of one run a deadline, not every queued request a run of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_queued_behind_a_failed_run_fail_with_it() {
    let redis = RedisServer::start();
    let timeout = Duration::from_millis(400);
    let store = store(&redis, timeout);
    warm(&store).await;
    let limits = Limits::minute_day(1_000, 10_000).unwrap();
    let before = script_runs(&redis);
    assert_eq!(redis.cli(&["CLIENT", "PAUSE", "1500", "ALL"]), "OK");
    let started = Instant::now();
    let first = {
        let store = Arc::clone(&store);
        tokio::spawn(async move { store.acquire(&Arc::from("a"), limits, 1, &NO_BANS()).await })
    };
    // Queued behind the first run (well inside a quarter of the deadline, so no run of its own).
    tokio::time::sleep(Duration::from_millis(20)).await;
    let second = store.acquire(&Arc::from("b"), limits, 1, &NO_BANS()).await;
    assert!(second.is_err(), "{second:?}");
    assert!(first.await.unwrap().is_err());
    let waited = started.elapsed();
    assert!(waited < timeout + Duration::from_millis(300), "{waited:?}");
    paused_until_lifted(&redis).await;
    // Once Redis runs again it has seen one run only: the queued decision was never sent.
    let runs = script_runs(&redis) - before;
    assert_eq!(runs, 1, "{runs} script runs reached Redis");
}

/// Returns once Redis answers again after a `CLIENT PAUSE ... ALL`: the `PING` is held like every
/// other command until the pause ends.
async fn paused_until_lifted(redis: &RedisServer) {
    let redis_cli_answer = tokio::task::block_in_place(|| redis.cli(&["PING"]));
    assert_eq!(redis_cli_answer, "PONG");
}

/// The script's numbers travel packed (issue 33), and one `struct.unpack` call returns at most
/// some 8,000 of them: a ban ladder (or a run's sets of limits) longer than that is read in parts,
/// not refused with "too many results" (which failed every decision of the run), and a ban
/// policy's "never" past `i64::MAX` stays "never" rather than wrapping to a negative number that
/// bans on the first refusal.
#[tokio::test(flavor = "current_thread")]
async fn a_ban_ladder_past_luas_stack_and_a_never_past_i64_still_decide() {
    let redis = RedisServer::start();
    let store = store(&redis, Duration::from_secs(2));
    warm(&store).await;
    fresh_minute(Duration::from_secs(10));
    let limits = Limits::minute_day(1, 1_000).unwrap();
    let ladder = BanPolicy {
        strikes: 0,
        durations: (1..=9_000).map(|i| 60 + i).collect(),
        decay_secs: 600,
    };
    let key = Arc::<str>::from("ladder");
    let first = store.acquire(&key, limits, 1, &ladder).await.unwrap();
    assert_eq!(first.outcome, Outcome::Admitted);
    let banned = store.acquire(&key, limits, 1, &ladder).await.unwrap();
    assert_eq!(
        banned.outcome,
        Outcome::Banned,
        "strikes 0: the first refusal bans"
    );
    assert_eq!(
        banned.ban_until,
        banned.now + 61,
        "the first rung of the ladder"
    );

    let never = BanPolicy {
        strikes: u64::MAX,
        durations: vec![u64::MAX],
        decay_secs: u64::MAX,
    };
    let key = Arc::<str>::from("never");
    for i in 0..5 {
        let v = store.acquire(&key, limits, 1, &never).await.unwrap();
        let expected = if i == 0 {
            Outcome::Admitted
        } else {
            Outcome::Limited
        };
        assert_eq!(v.outcome, expected, "request {i}: {v:?}");
    }
}

/// Calls of `command` Redis has served, `(calls, failed)`.
fn command_calls(redis: &RedisServer, command: &str) -> (u64, u64) {
    e2e::command_calls(&redis.cli(&["INFO", "commandstats"]), command)
}

/// Decisions go by the function (`FCALL`), not the script; a server that lost the library (a
/// restart without persistence, `FUNCTION FLUSH`, a promoted replica that never had it) gets it
/// again within the same call, and the counts go on where they were.
#[tokio::test(flavor = "current_thread")]
async fn decisions_go_by_the_function_and_a_lost_library_is_loaded_again() {
    let redis = RedisServer::start();
    let store = store(&redis, Duration::from_secs(2));
    warm(&store).await;
    fresh_minute(Duration::from_secs(10));
    let limits = Limits::minute_day(5, 1_000).unwrap();
    let key: Arc<str> = Arc::from("k");
    let (fcalls, evalshas) = (
        command_calls(&redis, "fcall").0,
        command_calls(&redis, "evalsha").0,
    );
    for n in 1..=3 {
        let v = store.acquire(&key, limits, 1, &NO_BANS()).await.unwrap();
        assert_eq!((v.outcome, v.counts[0]), (Outcome::Admitted, n));
    }
    assert_eq!(command_calls(&redis, "fcall").0 - fcalls, 3);
    assert_eq!(
        command_calls(&redis, "evalsha").0,
        evalshas,
        "no script run"
    );
    assert!(redis.cli(&["FUNCTION", "LIST"]).contains("pet_gateway_"));

    assert_eq!(redis.cli(&["FUNCTION", "FLUSH"]), "OK");
    let outcomes: Vec<(Outcome, u64)> = {
        let mut out = Vec::new();
        for _ in 0..3 {
            let v = store.acquire(&key, limits, 1, &NO_BANS()).await.unwrap();
            out.push((v.outcome, v.counts[0]));
        }
        out
    };
    assert_eq!(
        outcomes,
        [
            (Outcome::Admitted, 4),
            (Outcome::Admitted, 5),
            (Outcome::Limited, 5)
        ]
    );
    assert!(redis.cli(&["FUNCTION", "LIST"]).contains("pet_gateway_"));
    assert_eq!(
        command_calls(&redis, "evalsha").0,
        evalshas,
        "no script run"
    );
}

/// A user not allowed functions (an ACL from before this version; Redis before 7.0 answers
/// "unknown command" alike) gets the script, and the same decisions.
#[tokio::test(flavor = "current_thread")]
async fn a_user_not_allowed_functions_is_decided_by_the_script() {
    let redis = RedisServer::start_without_functions();
    let store = store(&redis, Duration::from_secs(2));
    fresh_minute(Duration::from_secs(10));
    let limits = Limits::minute_day(2, 1_000).unwrap();
    let key: Arc<str> = Arc::from("k");
    let mut seen = Vec::new();
    for _ in 0..3 {
        let v = store.acquire(&key, limits, 1, &NO_BANS()).await.unwrap();
        seen.push((v.outcome, v.counts[0]));
    }
    assert_eq!(
        seen,
        [
            (Outcome::Admitted, 1),
            (Outcome::Admitted, 2),
            (Outcome::Limited, 2)
        ]
    );
    let (evalshas, failed) = command_calls(&redis, "evalsha");
    assert!(
        evalshas - failed >= 3,
        "{evalshas} EVALSHA, {failed} failed"
    );
}

/// A command the function runs that the ACL refuses (here `SET`, the state's write) fails the
/// run, and the run is not sent again by the script: it reached the function, which may have
/// written part of its keys before the refusal (a second run would count them twice). Redis 7.0
/// says so with `ERR`, 7.2 and later with `NOPERM` (the unit tests of `function.rs` read both).
#[tokio::test(flavor = "current_thread")]
async fn a_refusal_inside_the_function_is_an_error_not_a_second_run_by_the_script() {
    let redis = RedisServer::start_with(
        e2e::free_addr(),
        &[
            "--user", "default", "on", "nopass", "~*", "&*", "+@all", "-set",
        ],
    );
    let store = store(&redis, Duration::from_secs(2));
    let limits = Limits::minute_day(2, 1_000).unwrap();
    let decided = store.acquire(&Arc::from("k"), limits, 1, &NO_BANS()).await;
    assert!(decided.is_err(), "{decided:?}");
    let (evalshas, _) = command_calls(&redis, "evalsha");
    assert_eq!(
        evalshas, 0,
        "the script was not sent after the function ran"
    );
    assert!(command_calls(&redis, "fcall").0 >= 1);
}
