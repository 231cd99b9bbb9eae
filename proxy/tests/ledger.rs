//! The global store's ledger of grants (regions, issue 48) on a real `redis-server`: regions
//! asking at once never get more than the limit between them, a retry after a lost answer is
//! counted once, units given back go back at most once and never more than were granted, a
//! lowered limit grants nothing past it, a grant counts as durable only once the replica has
//! it, and nothing is granted while no replica is online.

use std::time::{Duration, Instant};

use e2e::RedisServer;
use proxy::base::redis::RedisAccess;
use proxy::keys::limits::Every;
use proxy::quota::store::redis::ledger::{Ask, Instance, Ledger, KEEP_AFTER_END};

fn ledger(redis: &RedisServer, replicas: u32) -> Ledger {
    let access = RedisAccess::from_url(&redis.url()).unwrap();
    Ledger::new(access, "pet:test", Duration::from_millis(500), replicas).unwrap()
}

/// An ask of `want` units, none of them headroom (`need` the same).
fn ask(at: Instance, limit: u64, want: u64) -> Ask {
    Ask {
        at,
        limit,
        want,
        need: want,
    }
}

/// This minute and this day (the ledger keeps no clock of its own: an instance is whatever the
/// region names; a past one would expire at once).
fn minute_and_day() -> (Instance, Instance) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    (
        Instance::at(Every::MINUTE, now),
        Instance::at(Every::DAY, now),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regions_asking_at_once_never_get_more_than_the_limit_between_them() {
    let redis = RedisServer::start();
    let l = std::sync::Arc::new(ledger(&redis, 0));
    let (minute, day) = minute_and_day();
    let mut tasks = Vec::new();
    for region in ["eu", "us", "ap"] {
        let l = l.clone();
        tasks.push(tokio::spawn(async move {
            let (mut got, mut wanted) = ((0, 0), 0);
            for i in 0..40u64 {
                let want = 1 + (i * 7 + region.len() as u64) % 9;
                let g = l
                    .grant(
                        "key_a",
                        region,
                        &format!("{region}-{i}"),
                        &[ask(minute, 60, want), ask(day, 10_000, want * 3)],
                    )
                    .await
                    .unwrap();
                assert!(g.durable);
                got.0 += g.units[0];
                got.1 += g.units[1];
                wanted += want * 3;
            }
            (region, got, wanted)
        }));
    }
    let (mut minute_sum, mut day_sum, mut day_wanted) = (0, 0, 0);
    let mut by_region = Vec::new();
    for t in tasks {
        let (region, (m, d), wanted) = t.await.unwrap();
        minute_sum += m;
        day_sum += d;
        day_wanted += wanted;
        by_region.push((region.to_owned(), m));
    }
    // 120 asks of 1 to 9 units: the minute's 60 run out, the day's 10,000 do not.
    assert_eq!(
        minute_sum, 60,
        "every unit of the minute granted, none twice"
    );
    assert_eq!(day_sum, day_wanted, "the day had room for every ask");
    let (total, regions) = l.granted("key_a", &minute).await.unwrap();
    assert_eq!(total, 60);
    // A region granted nothing has no count of its own.
    by_region.retain(|(_, m)| *m > 0);
    by_region.sort();
    assert_eq!(
        regions, by_region,
        "the ledger's count per region is what each was told"
    );
    assert_eq!(l.granted("key_a", &day).await.unwrap().0, day_sum);
}

#[tokio::test]
async fn a_retry_after_a_lost_answer_is_counted_once() {
    let redis = RedisServer::start();
    let l = ledger(&redis, 0);
    let (minute, _) = minute_and_day();
    let first = l
        .grant("key_a", "eu", "req-1", &[ask(minute, 60, 25)])
        .await;
    let again = l
        .grant("key_a", "eu", "req-1", &[ask(minute, 60, 25)])
        .await;
    assert_eq!(first.unwrap().units, vec![25]);
    assert_eq!(again.unwrap().units, vec![25], "the same answer");
    assert_eq!(
        l.granted("key_a", &minute).await.unwrap().0,
        25,
        "counted once"
    );
    let next = l
        .grant("key_a", "eu", "req-2", &[ask(minute, 60, 25)])
        .await;
    assert_eq!(next.unwrap().units, vec![25]);
    let last = l
        .grant("key_a", "us", "req-1", &[ask(minute, 60, 25)])
        .await;
    assert_eq!(
        last.unwrap().units,
        vec![10],
        "another region's id is its own"
    );
    assert_eq!(l.granted("key_a", &minute).await.unwrap().0, 60);
}

#[tokio::test]
async fn units_given_back_go_back_once_and_never_more_than_granted() {
    let redis = RedisServer::start();
    let l = ledger(&redis, 0);
    let (minute, _) = minute_and_day();
    l.grant("key_a", "eu", "g1", &[ask(minute, 60, 40)])
        .await
        .unwrap();
    l.grant("key_a", "us", "g1", &[ask(minute, 60, 40)])
        .await
        .unwrap();
    assert_eq!(l.granted("key_a", &minute).await.unwrap().0, 60);

    let back = l
        .give_back("key_a", "eu", "b1", &[(minute, 15)])
        .await
        .unwrap();
    assert_eq!(back, vec![15]);
    let again = l
        .give_back("key_a", "eu", "b1", &[(minute, 15)])
        .await
        .unwrap();
    assert_eq!(again, vec![15], "a retry takes nothing again");
    let other = l
        .give_back("key_a", "eu", "b2", &[(minute, 1)])
        .await
        .unwrap();
    assert_eq!(other, vec![1]);
    let late = l
        .give_back("key_a", "eu", "b1", &[(minute, 15)])
        .await
        .unwrap();
    assert_eq!(
        late,
        vec![15],
        "a retry after another give-back takes nothing again either"
    );
    l.grant("key_a", "eu", "g1b", &[ask(minute, 60, 1)])
        .await
        .unwrap();
    assert_eq!(l.granted("key_a", &minute).await.unwrap().0, 45);
    // The units given back go to whoever asks next.
    let more = l
        .grant("key_a", "us", "g2", &[ask(minute, 60, 40)])
        .await
        .unwrap();
    assert_eq!(more.units, vec![15]);
    // A region gives back at most what it was granted (us holds 35).
    let over = l
        .give_back("key_a", "us", "b1", &[(minute, 100)])
        .await
        .unwrap();
    assert_eq!(over, vec![35]);
    let (total, regions) = l.granted("key_a", &minute).await.unwrap();
    assert_eq!(total, 25);
    assert_eq!(regions, vec![("eu".into(), 25), ("us".into(), 0)]);
    // Nothing granted for, nor given back to, an instance past its keeping.
    let gone = Instance::at(Every::MINUTE, 1_000);
    let past = l
        .grant("key_a", "eu", "g9", &[ask(gone, 60, 5)])
        .await
        .unwrap();
    assert_eq!(past.units, vec![0], "its grants would be forgotten at once");
    let none = l
        .give_back("key_a", "eu", "b2", &[(gone, 5)])
        .await
        .unwrap();
    assert_eq!(none, vec![0]);
    assert_eq!(redis.cli(&["EXISTS", "pet:test:grants:{key_a}:60:16"]), "0");
}

/// An instance whose budget fell short of an ask is contested, and so is the one after it:
/// there a region gets what it needs, not the quarter more it wants, which would stay unspent
/// with it while another region is refused (the harness's 53 of 60). An instance that was never
/// short, and whose predecessor was not, grants what is wanted.
#[tokio::test]
async fn a_contested_instance_and_its_successor_grant_what_is_needed_not_the_headroom() {
    let redis = RedisServer::start();
    let l = ledger(&redis, 0);
    let (minute, _) = minute_and_day();
    let next = Instance::new(Every::MINUTE, minute.index + 1);
    let after = Instance::new(Every::MINUTE, minute.index + 2);
    let asked = |at, want, need| Ask {
        at,
        limit: 60,
        want,
        need,
    };
    let units = |g: proxy::quota::store::redis::ledger::Grant| g.units;
    let g = l.grant("key_a", "eu", "g1", &[asked(minute, 31, 25)]).await;
    assert_eq!(units(g.unwrap()), [31], "never short: what is wanted");
    let g = l.grant("key_a", "us", "g1", &[asked(minute, 40, 32)]).await;
    assert_eq!(
        units(g.unwrap()),
        [29],
        "short: the minute is contested now"
    );
    let g = l.grant("key_a", "eu", "g2", &[asked(next, 31, 25)]).await;
    assert_eq!(
        units(g.unwrap()),
        [25],
        "the successor of a contested minute"
    );
    let g = l.grant("key_a", "us", "g2", &[asked(after, 31, 25)]).await;
    assert_eq!(units(g.unwrap()), [31], "its predecessor was never short");
    // Units given back in the contested minute go out without the headroom too.
    let back = l.give_back("key_a", "eu", "b1", &[(minute, 10)]).await;
    assert_eq!(back.unwrap(), [10]);
    let g = l.grant("key_a", "ap", "g1", &[asked(minute, 9, 6)]).await;
    assert_eq!(units(g.unwrap()), [6]);
    // Two instances in one call, each judged by its own predecessor: the day (never short)
    // keeps the quarter, the next minute (its predecessor short) does not.
    let day = Instance::at(Every::DAY, minute.end - 1);
    let both = [asked(day, 31, 25), asked(next, 20, 12)];
    let g = l.grant("key_a", "ap", "g2", &both).await;
    assert_eq!(units(g.unwrap()), [31, 12]);
    // Another quota in the same minute is not contested by this one.
    let g = l.grant("key_b", "eu", "g1", &[asked(minute, 31, 25)]).await;
    assert_eq!(units(g.unwrap()), [31]);
}

#[tokio::test]
async fn a_lowered_limit_grants_nothing_past_it_and_a_raised_one_grants_the_rest() {
    let redis = RedisServer::start();
    let l = ledger(&redis, 0);
    let (minute, _) = minute_and_day();
    l.grant("key_a", "eu", "g1", &[ask(minute, 60, 50)])
        .await
        .unwrap();
    let lowered = l
        .grant("key_a", "us", "g1", &[ask(minute, 30, 10)])
        .await
        .unwrap();
    assert_eq!(
        lowered.units,
        vec![0],
        "50 granted already, the limit now 30"
    );
    let raised = l
        .grant("key_a", "us", "g2", &[ask(minute, 100, 80)])
        .await
        .unwrap();
    assert_eq!(raised.units, vec![50]);
    assert_eq!(l.granted("key_a", &minute).await.unwrap().0, 100);
}

#[tokio::test]
async fn each_instance_is_counted_apart_and_kept_past_its_end() {
    let redis = RedisServer::start();
    let l = ledger(&redis, 0);
    let (minute, _) = minute_and_day();
    let next = Instance::at(Every::MINUTE, minute.end);
    assert_eq!(next.index, minute.index + 1);
    l.grant("key_a", "eu", "g1", &[ask(minute, 60, 60)])
        .await
        .unwrap();
    let g = l
        .grant("key_a", "eu", "g2", &[ask(next, 60, 60)])
        .await
        .unwrap();
    assert_eq!(g.units, vec![60], "the next minute starts whole");
    let other = l
        .grant("key_b", "eu", "g1", &[ask(minute, 60, 60)])
        .await
        .unwrap();
    assert_eq!(other.units, vec![60], "another quota is its own");
    let key = format!("pet:test:grants:{{key_a}}:60:{}", minute.index);
    let expires: u64 = redis.cli(&["EXPIRETIME", &key]).parse().unwrap();
    assert_eq!(expires, minute.end + KEEP_AFTER_END);
}

/// With one replica to wait for: durable only while the replica acknowledges; a grant it did
/// not acknowledge is still counted (never granted again).
#[tokio::test]
async fn a_grant_is_durable_only_once_the_replica_has_it() {
    // No wait before the primary sends a new replica its copy.
    let primary = RedisServer::start_with(e2e::free_addr(), &["--repl-diskless-sync-delay", "0"]);
    let l = ledger(&primary, 1);
    let (minute, _) = minute_and_day();
    let key = format!("pet:test:grants:{{key_a}}:60:{}", minute.index);
    // No replica online (as after a failover): nothing granted, nothing counted, rather than
    // units counted as granted that nobody may spend.
    let lonely = l.grant("key_a", "eu", "g1", &[ask(minute, 60, 20)]).await;
    assert!(
        matches!(&lonely, Err(proxy::quota::store::StoreError::Unavailable(e)) if e.contains("NOREPLICAS")),
        "{lonely:?}"
    );
    assert_eq!(primary.cli(&["EXISTS", &key]), "0", "nothing counted");

    // Its own folder for the copy it takes of the primary (not the test's working folder).
    let dir = tempfile::tempdir().unwrap();
    let replica =
        RedisServer::start_with(e2e::free_addr(), &["--dir", dir.path().to_str().unwrap()]);
    let port = primary.addr.port().to_string();
    assert_eq!(replica.cli(&["REPLICAOF", "127.0.0.1", &port]), "OK");
    let started = Instant::now();
    // Asked again with the same id until the replica acknowledges it (refused while it loads
    // its copy of the primary): the same units every time, counted once.
    loop {
        if let Ok(g) = l.grant("key_a", "eu", "g2", &[ask(minute, 60, 20)]).await {
            assert_eq!(g.units, vec![20]);
            if g.durable {
                break;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the replica never acknowledged a grant"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(replica.cli(&["HGET", &key, "t"]), "20", "counted once");
}

/// A retry on another connection (a reconnect, another node of the region) of a grant the
/// replica has not acknowledged is not durable either. (Redis 7.0.15 already waits for the
/// latest offset on a connection that wrote nothing; the retry writes its record again all the
/// same, so this holds on a Redis that counts only the connection's own writes.)
#[tokio::test]
async fn a_retry_on_a_new_connection_is_not_durable_before_the_replica_has_it() {
    let primary = RedisServer::start_with(e2e::free_addr(), &["--repl-diskless-sync-delay", "0"]);
    let dir = tempfile::tempdir().unwrap();
    let replica = RedisServer::start_with(
        e2e::free_addr(),
        &[
            "--dir",
            dir.path().to_str().unwrap(),
            "--enable-debug-command",
            "yes",
        ],
    );
    let port = primary.addr.port().to_string();
    assert_eq!(replica.cli(&["REPLICAOF", "127.0.0.1", &port]), "OK");
    let (minute, _) = minute_and_day();
    let first = ledger(&primary, 1);
    let started = Instant::now();
    while !first
        .grant("key_a", "eu", "warm", &[ask(minute, 60, 1)])
        .await
        .unwrap()
        .durable
    {
        assert!(started.elapsed() < Duration::from_secs(15), "never synced");
    }
    // The replica stops answering (and acknowledging) for two seconds.
    let sleeper = std::thread::spawn({
        let addr = replica.addr;
        move || {
            e2e::redis_cli()
                .args(["-p", &addr.port().to_string(), "DEBUG", "SLEEP", "2"])
                .output()
                .unwrap()
        }
    });
    std::thread::sleep(Duration::from_millis(200));
    let g = first
        .grant("key_a", "eu", "g1", &[ask(minute, 60, 10)])
        .await
        .unwrap();
    assert_eq!(g.units, vec![10]);
    assert!(!g.durable, "the replica is asleep");
    let retry = ledger(&primary, 1)
        .grant("key_a", "eu", "g1", &[ask(minute, 60, 10)])
        .await
        .unwrap();
    assert_eq!(retry.units, vec![10], "the same answer");
    assert!(
        !retry.durable,
        "a new connection's WAIT covers the first write"
    );
    sleeper.join().unwrap();
}
