//! One quota across regions (issue 48), on real `redis-server`s: a Redis per region and one
//! global store, each region's store built as its nodes build it. Regions deciding at once never
//! admit more than the limit between them; a region short of units refuses without a strike and,
//! cut off from the global store, with `Unleased`; a region's Redis restarted forfeits what it
//! held; units a quiet region held go back to the global store for another region to spend; a
//! ban started in one region holds in the others within a second, and a lift lifts it there.

use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::{free_addr, RedisServer};
use proxy::base::redis::RedisAccess;
use proxy::keys::limits::{Every, Limits, WindowLimit};
use proxy::quota::regions::{RegionalStore, RegionalStoreHandle};
use proxy::quota::rules::{BanPolicy, Outcome};
use proxy::quota::store::redis::ban_feed::BanFeed;
use proxy::quota::store::redis::ledger::{Instance, Ledger};
use proxy::quota::store::redis::RedisStore;
use proxy::quota::store::QuotaStore;

const PREFIX: &str = "pet:test";

fn region(local: &RedisServer, global_url: &str, name: &str) -> Arc<RegionalStore> {
    let store = RedisStore::new(&local.url(), PREFIX, Duration::from_millis(500))
        .unwrap()
        .regional();
    let ledger = Ledger::new(
        RedisAccess::from_url(global_url).unwrap(),
        PREFIX,
        Duration::from_millis(500),
        0,
    )
    .unwrap();
    RegionalStore::new(Arc::new(store), Arc::new(ledger), feed(global_url), name)
}

fn feed(global_url: &str) -> Arc<BanFeed> {
    let access = RedisAccess::from_url(global_url).unwrap();
    Arc::new(BanFeed::new(access, PREFIX, Duration::from_millis(500), 0).unwrap())
}

fn per_minute(n: u64) -> Limits {
    Limits::new(&[WindowLimit::new(Every::MINUTE, n).unwrap()]).unwrap()
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// Waits out the end of a minute, so a test's requests fall in one minute.
async fn whole_minute_ahead(secs: u64) {
    let into = now() % 60;
    if into + secs >= 58 {
        tokio::time::sleep(Duration::from_secs(61 - into)).await;
    }
}

async fn decide(
    store: &RegionalStoreHandle,
    key: &Arc<str>,
    limits: Limits,
    ban: &BanPolicy,
) -> Outcome {
    store.acquire(key, limits, 1, ban).await.unwrap().outcome
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regions_deciding_at_once_never_admit_more_than_the_limit_between_them() {
    let global = RedisServer::start();
    let (ra, rb, rc) = (
        RedisServer::start(),
        RedisServer::start(),
        RedisServer::start(),
    );
    let regions: Vec<Arc<RegionalStoreHandle>> = [(&ra, "eu"), (&rb, "us"), (&rc, "ap")]
        .into_iter()
        .map(|(r, name)| Arc::new(RegionalStoreHandle(region(r, &global.url(), name))))
        .collect();
    let key: Arc<str> = Arc::from("key_spread");
    let limits = per_minute(30);
    let lenient = BanPolicy {
        strikes: 1_000,
        ..BanPolicy::default()
    };
    whole_minute_ahead(15).await;
    let mut tasks = Vec::new();
    for (i, r) in regions.iter().enumerate() {
        let (r, key, ban) = (Arc::clone(r), Arc::clone(&key), lenient.clone());
        tasks.push(tokio::spawn(async move {
            let mut admitted = 0;
            for n in 0..(20 + 5 * i) {
                if decide(&r, &key, limits, &ban).await == Outcome::Admitted {
                    admitted += 1;
                }
                if n % 4 == 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            admitted
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    // 75 requests in three regions, a limit of 30: each region alone would admit 30.
    assert!(
        total <= 30,
        "{total} admitted across regions, over the limit of 30"
    );
    assert!(
        total >= 20,
        "only {total} of 30 admitted: the budget was stranded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_cut_off_from_the_global_store_spends_what_it_holds_then_refuses_without_a_strike()
{
    let global_addr = free_addr();
    let global = RedisServer::start_at(global_addr);
    let local = RedisServer::start();
    let r = RegionalStoreHandle(region(&local, &global.url(), "eu"));
    let key: Arc<str> = Arc::from("key_cut");
    let limits = per_minute(1_000);
    // One strike bans: a refusal that counted one would show.
    let strict = BanPolicy {
        strikes: 0,
        ..BanPolicy::default()
    };
    whole_minute_ahead(10).await;
    assert_eq!(decide(&r, &key, limits, &strict).await, Outcome::Admitted);
    drop(global);
    // What the first ask held (its cost and a minute at the rate it saw), spent, then refused.
    let mut outcomes = Vec::new();
    for _ in 0..200 {
        let o = decide(&r, &key, limits, &strict).await;
        outcomes.push(o);
        if o != Outcome::Admitted {
            break;
        }
    }
    assert_eq!(outcomes.last(), Some(&Outcome::Unleased), "{outcomes:?}");
    assert!(outcomes.len() < 200, "the region spent more than it held");
    assert_eq!(decide(&r, &key, limits, &strict).await, Outcome::Unleased);
    assert_eq!(
        r.ban_of("key_cut").await.unwrap(),
        None,
        "a short refusal struck"
    );
    // The global store back: the next request is granted and admitted.
    let _global = RedisServer::start_at(global_addr);
    let deadline = Instant::now() + Duration::from_secs(10);
    while decide(&r, &key, limits, &strict).await != Outcome::Admitted {
        assert!(
            Instant::now() < deadline,
            "not admitted again once the global store was back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_regions_redis_restarted_forfeits_the_units_it_held() {
    let dir = tempfile::tempdir().unwrap();
    let dir_arg = dir.path().to_str().unwrap().to_owned();
    let durable = [
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        "--dir",
        dir_arg.as_str(),
    ];
    let global_addr = free_addr();
    let global = RedisServer::start_at(global_addr);
    let local_addr = free_addr();
    let local = RedisServer::start_with(local_addr, &durable);
    let r = RegionalStoreHandle(region(&local, &global.url(), "eu"));
    let key: Arc<str> = Arc::from("key_restart");
    let limits = per_minute(1_000);
    let ban = BanPolicy::default();
    whole_minute_ahead(15).await;
    assert_eq!(decide(&r, &key, limits, &ban).await, Outcome::Admitted);
    assert!(
        local.cli(&["EXISTS", "pet:test:held:{key_restart}"]).trim() == "1",
        "the region holds units"
    );
    // Cut off from the global store: only held units could be spent now.
    drop(global);
    local.process.kill_hard();
    let _local = RedisServer::start_with(local_addr, &durable);
    let deadline = Instant::now() + Duration::from_secs(10);
    let outcome = loop {
        match r.acquire(&key, limits, 1, &ban).await {
            Ok(v) => break v.outcome,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("the region's Redis did not come back: {e}"),
        }
    };
    // Held units survived on disk but were written by the server's last life: forfeited.
    assert_eq!(outcome, Outcome::Unleased);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn units_a_quiet_region_held_go_back_for_another_region_to_spend() {
    let global = RedisServer::start();
    let (ra, rb) = (RedisServer::start(), RedisServer::start());
    let a = region(&ra, &global.url(), "eu");
    let b = region(&rb, &global.url(), "us");
    let (ha, hb) = (
        RegionalStoreHandle(Arc::clone(&a)),
        RegionalStoreHandle(Arc::clone(&b)),
    );
    let key: Arc<str> = Arc::from("key_moves");
    let limits = per_minute(10);
    let ban = BanPolicy {
        strikes: 1_000,
        ..BanPolicy::default()
    };
    // Early in a minute, so that eu's share is worth giving back (`sweep::worth_giving`).
    whole_minute_ahead(45).await;
    // Region eu is granted a share of the minute (its cost and what its rate would spend).
    assert_eq!(decide(&ha, &key, limits, &ban).await, Outcome::Admitted);
    let minute = Instance::at(Every::MINUTE, now());
    let ledger = Ledger::new(
        RedisAccess::from_url(&global.url()).unwrap(),
        PREFIX,
        Duration::from_millis(500),
        0,
    )
    .unwrap();
    let (total, by_region) = ledger.granted("key_moves", &minute).await.unwrap();
    assert!(total >= 2, "{by_region:?}");
    // A node of eu started after the grant (a restart, a rolling upgrade) decides one request:
    // it finds the region holding spare units and tracks them too.
    let later = region(&ra, &global.url(), "eu");
    let later_handle = RegionalStoreHandle(Arc::clone(&later));
    assert_eq!(
        decide(&later_handle, &key, limits, &ban).await,
        Outcome::Admitted
    );
    // Quiet for long enough, that node's sweep gives back what eu did not spend; us spends it.
    tokio::time::sleep(Duration::from_secs(4)).await;
    later.sweep().await;
    let (total, _) = ledger.granted("key_moves", &minute).await.unwrap();
    assert_eq!(total, 2, "eu keeps only the units it spent");
    let mut admitted = 0;
    for _ in 0..15 {
        if decide(&hb, &key, limits, &ban).await == Outcome::Admitted {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 8, "us spends what eu gave back, and no more");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_the_global_stores_replicas_did_not_acknowledge_is_never_spent() {
    // The global store's replica is online but stops acknowledging (asleep, as a replica a
    // failover would leave behind): each grant counts as granted, none is held.
    let global = RedisServer::start_with(free_addr(), &["--repl-diskless-sync-delay", "0"]);
    let dir = tempfile::tempdir().unwrap();
    let replica = RedisServer::start_with(
        free_addr(),
        &[
            "--dir",
            dir.path().to_str().unwrap(),
            "--enable-debug-command",
            "yes",
        ],
    );
    let primary_port = global.addr.port().to_string();
    assert_eq!(
        replica.cli(&["REPLICAOF", "127.0.0.1", &primary_port]),
        "OK"
    );
    let started = Instant::now();
    while !global
        .cli(&["INFO", "replication"])
        .contains("state=online")
    {
        assert!(started.elapsed() < Duration::from_secs(15), "never synced");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let local = RedisServer::start();
    let r = RegionalStoreHandle(region_waiting_for(&local, &global, 1));
    let key: Arc<str> = Arc::from("key_unacked");
    let limits = per_minute(100);
    let ban = BanPolicy::default();
    whole_minute_ahead(10).await;
    let sleeper = std::thread::spawn({
        let port = replica.addr.port().to_string();
        move || {
            e2e::redis_cli()
                .args(["-p", &port, "DEBUG", "SLEEP", "3"])
                .output()
                .unwrap()
        }
    });
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(decide(&r, &key, limits, &ban).await, Outcome::Unleased);
    assert_eq!(
        local.cli(&["EXISTS", "pet:test:held:{key_unacked}"]).trim(),
        "0"
    );
    let (total, _) = plain_ledger(&global)
        .granted("key_unacked", &Instance::at(Every::MINUTE, now()))
        .await
        .unwrap();
    assert!(total >= 1, "the grant stays counted at the global store");
    sleeper.join().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_replica_online_the_global_store_grants_nothing_and_counts_nothing() {
    // A global store whose replica is gone (a failover's primary, until the old one comes back
    // as a replica): a region's asks are refused, not counted as granted and lost.
    let global = RedisServer::start();
    let local = RedisServer::start();
    let r = RegionalStoreHandle(region_waiting_for(&local, &global, 1));
    let key: Arc<str> = Arc::from("key_lonely");
    whole_minute_ahead(10).await;
    for _ in 0..3 {
        let outcome = decide(&r, &key, per_minute(100), &BanPolicy::default()).await;
        assert_eq!(outcome, Outcome::Unleased);
    }
    let (total, _) = plain_ledger(&global)
        .granted("key_lonely", &Instance::at(Every::MINUTE, now()))
        .await
        .unwrap();
    assert_eq!(
        total, 0,
        "units burnt: counted as granted, never to be spent"
    );
}

/// A region whose grants must be acknowledged by `replicas` of the global store.
fn region_waiting_for(
    local: &RedisServer,
    global: &RedisServer,
    replicas: u32,
) -> Arc<RegionalStore> {
    let store = RedisStore::new(&local.url(), PREFIX, Duration::from_millis(500))
        .unwrap()
        .regional();
    let access = RedisAccess::from_url(&global.url()).unwrap();
    let ledger = Ledger::new(access, PREFIX, Duration::from_millis(400), replicas).unwrap();
    RegionalStore::new(Arc::new(store), Arc::new(ledger), feed(&global.url()), "eu")
}

/// The ledger as the harness reads it (no replicas waited for).
fn plain_ledger(global: &RedisServer) -> Ledger {
    let access = RedisAccess::from_url(&global.url()).unwrap();
    Ledger::new(access, PREFIX, Duration::from_millis(500), 0).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_acl_lets_a_regions_nodes_grant_hold_give_back_and_reset() {
    // Every Redis as deploy/redis/acl-users makes it, the nodes logged in as `gateway`.
    let global = e2e::ShippedRedis::start(PREFIX);
    let local = e2e::ShippedRedis::start(PREFIX);
    let store = RedisStore::new(&local.url("gateway"), PREFIX, Duration::from_millis(500))
        .unwrap()
        .regional();
    let store = Arc::new(store);
    let ledger = Ledger::new(
        RedisAccess::from_url(&global.url("gateway")).unwrap(),
        PREFIX,
        Duration::from_millis(500),
        0,
    )
    .unwrap();
    let global_url = global.url("gateway");
    let regional = RegionalStore::new(
        Arc::clone(&store),
        Arc::new(ledger),
        feed(&global_url),
        "eu",
    );
    let r = RegionalStoreHandle(Arc::clone(&regional));
    let key: Arc<str> = Arc::from("key_acl");
    let ban = BanPolicy::default();
    whole_minute_ahead(10).await;
    assert_eq!(
        decide(&r, &key, per_minute(60), &ban).await,
        Outcome::Admitted
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    regional.sweep().await;
    assert_eq!(regional.tracking(), 0, "given back and no longer tracked");
    r.reset_usage("key_acl").await.unwrap();
    // A store of a fleet without regions resets too (it deletes no units held).
    let plain = RedisStore::new(&local.url("gateway"), PREFIX, Duration::from_millis(500)).unwrap();
    plain.reset_usage("key_acl").await.unwrap();
    // A ban of another region: published, read and imported, then lifted everywhere.
    feed(&global_url)
        .publish("key_acl", (now(), now() + 60, now()))
        .await
        .unwrap();
    regional.follow_bans().await;
    assert!(
        r.ban_of("key_acl").await.unwrap().is_some(),
        "the ban was imported"
    );
    assert!(r.lift_ban("key_acl").await.unwrap(), "the ban was lifted");
}

/// Reads the feed of bans every `bans::EVERY`, as a node's background service does.
fn following(region: &Arc<RegionalStore>) -> tokio::task::JoinHandle<()> {
    let region = Arc::clone(region);
    tokio::spawn(async move {
        loop {
            region.follow_bans().await;
            tokio::time::sleep(proxy::quota::regions::bans::EVERY).await;
        }
    })
}

/// Waits until `region` holds a ban of `key` (`banned`) or none, for at most `within`; how
/// long it took.
async fn until_ban(
    region: &RegionalStoreHandle,
    key: &str,
    banned: bool,
    within: Duration,
) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < within {
        if region.ban_of(key).await.unwrap().is_some() == banned {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ban_started_in_one_region_holds_in_the_others_within_a_second_and_a_lift_lifts_it() {
    let global = RedisServer::start();
    let (ra, rb) = (RedisServer::start(), RedisServer::start());
    let (a, b) = (
        region(&ra, &global.url(), "eu"),
        region(&rb, &global.url(), "us"),
    );
    let followers = [following(&a), following(&b)];
    let (ha, hb) = (
        RegionalStoreHandle(Arc::clone(&a)),
        RegionalStoreHandle(Arc::clone(&b)),
    );
    let key: Arc<str> = Arc::from("key_abusive");
    let limits = per_minute(5);
    let quick = BanPolicy {
        strikes: 2,
        ..BanPolicy::default()
    };
    whole_minute_ahead(10).await;
    // Region b decides the key once (admitted): its ban, if any, must come from region a.
    assert_eq!(decide(&hb, &key, limits, &quick).await, Outcome::Admitted);
    let mut started = None;
    for _ in 0..40 {
        if ha
            .acquire(&key, limits, 1, &quick)
            .await
            .unwrap()
            .ban_started
        {
            started = Some(Instant::now());
            break;
        }
    }
    let started = started.expect("region a never banned the key");
    // Region b only reads (no strike of its own could ban the key there).
    let held = until_ban(&hb, &key, true, Duration::from_secs(3)).await;
    let took = started.elapsed();
    assert!(held.is_some(), "region b never held the ban started in a");
    assert!(
        took < Duration::from_secs(1),
        "the ban took {took:?} to hold in region b"
    );
    let lenient = BanPolicy {
        strikes: 1_000,
        ..BanPolicy::default()
    };
    assert_eq!(decide(&hb, &key, limits, &lenient).await, Outcome::Banned);

    // Lifted in region b (as its admin's store does): lifted in a too.
    assert!(
        hb.lift_ban(&key).await.unwrap(),
        "region b's lift found no ban"
    );
    let lifted = until_ban(&ha, &key, false, Duration::from_secs(2)).await;
    assert!(lifted.is_some(), "region a still holds the ban lifted in b");
    for f in followers {
        f.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_store_that_lost_its_bans_lifts_none_in_the_regions() {
    let global = RedisServer::start();
    let rb = RedisServer::start();
    let b = region(&rb, &global.url(), "us");
    let hb = RegionalStoreHandle(Arc::clone(&b));
    let publish = |quota: &'static str| {
        let url = global.url();
        async move {
            let f = feed(&url);
            assert!(f.publish(quota, (now(), now() + 120, now())).await.unwrap());
        }
    };
    publish("key_kept").await;
    b.follow_bans().await;
    assert!(hb.ban_of("key_kept").await.unwrap().is_some());
    // The global store restarted without its data; then other regions' bans move its version
    // past the one this node read (and a new feed at the very version it knew is read too).
    global.cli(&["FLUSHALL"]);
    publish("key_other").await;
    b.follow_bans().await;
    assert!(
        hb.ban_of("key_other").await.unwrap().is_some(),
        "a new feed at the version this node knew was not read"
    );
    publish("key_third").await;
    publish("key_fourth").await;
    b.follow_bans().await;
    for quota in ["key_other", "key_third", "key_fourth"] {
        assert!(
            hb.ban_of(quota).await.unwrap().is_some(),
            "{quota} not imported"
        );
    }
    assert!(
        hb.ban_of("key_kept").await.unwrap().is_some(),
        "a ban the global store forgot was lifted in the region"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lifted_ban_is_not_published_again_by_a_retry_started_before_the_lift() {
    let global = RedisServer::start();
    let (ra, rb) = (RedisServer::start(), RedisServer::start());
    let (a, b) = (
        region(&ra, &global.url(), "eu"),
        region(&rb, &global.url(), "us"),
    );
    let f = feed(&global.url());
    let started = now();
    assert!(f
        .publish("key_lifted", (started, started + 600, now()))
        .await
        .unwrap());
    a.follow_bans().await;
    b.follow_bans().await;
    RegionalStoreHandle(Arc::clone(&b))
        .lift_ban("key_lifted")
        .await
        .unwrap();
    // A node's retry of the same ban (its first publish failed), or another region's ban of
    // the same strikes, arrives after the lift: refused.
    assert!(!f
        .publish("key_lifted", (started, started + 600, now()))
        .await
        .unwrap());
    a.follow_bans().await;
    b.follow_bans().await;
    for (name, r) in [("eu", &a), ("us", &b)] {
        let h = RegionalStoreHandle(Arc::clone(r));
        assert!(
            h.ban_of("key_lifted").await.unwrap().is_none(),
            "{name} still holds the lifted ban"
        );
    }
    // A ban started after the lift is a new one: published and held.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert!(f
        .publish("key_lifted", (now(), now() + 600, now()))
        .await
        .unwrap());
    a.follow_bans().await;
    let ha = RegionalStoreHandle(Arc::clone(&a));
    assert!(ha.ban_of("key_lifted").await.unwrap().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lift_spares_a_later_ban_and_a_malformed_record_spares_the_rest() {
    let global = RedisServer::start();
    let rb = RedisServer::start();
    let b = region(&rb, &global.url(), "us");
    let hb = RegionalStoreHandle(Arc::clone(&b));
    let f = feed(&global.url());
    // Region b holds a ban of its own ending in an hour.
    assert!(f
        .publish("key_long", (now(), now() + 3_600, now()))
        .await
        .unwrap());
    b.follow_bans().await;
    // Another region lifts a ban of the quota ending in a minute (as if b had never read the
    // long one): b's longer ban stays.
    let prefix = format!("{PREFIX}:region-bans");
    let short = format!("l {} {}", now(), now() + 60);
    global.cli(&["HSET", &prefix, "key_long", &short]);
    global.cli(&["INCR", &format!("{prefix}:version")]);
    // A record that does not parse, beside a good one.
    global.cli(&["HSET", &prefix, "key_bad", "b one two"]);
    assert!(f
        .publish("key_good", (now(), now() + 60, now()))
        .await
        .unwrap());
    b.follow_bans().await;
    assert!(
        hb.ban_of("key_long").await.unwrap().is_some(),
        "a lift of a shorter ban lifted the region's later one"
    );
    assert!(
        hb.ban_of("key_good").await.unwrap().is_some(),
        "a malformed record kept the others out"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_regions_redis_restarted_empty_gets_the_bans_back() {
    let global = RedisServer::start();
    let rb = RedisServer::start();
    let b = region(&rb, &global.url(), "us");
    let hb = RegionalStoreHandle(Arc::clone(&b));
    assert!(feed(&global.url())
        .publish("key_back", (now(), now() + 120, now()))
        .await
        .unwrap());
    b.follow_bans().await;
    assert!(hb.ban_of("key_back").await.unwrap().is_some());
    rb.cli(&["FLUSHALL"]);
    let start = Instant::now();
    while hb.ban_of("key_back").await.unwrap().is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(12),
            "the region's Redis never got the ban back"
        );
        b.follow_bans().await;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
