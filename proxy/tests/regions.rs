//! One quota across regions (issue 48), on real `redis-server`s: a Redis per region and one
//! global store, each region's store built as its nodes build it. Regions deciding at once never
//! admit more than the limit between them; a region short of units refuses without a strike and,
//! cut off from the global store, with `Unleased`; a region's Redis restarted forfeits what it
//! held; units a quiet region held go back to the global store for another region to spend.

use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::{free_addr, RedisServer};
use proxy::base::redis::RedisAccess;
use proxy::keys::limits::{Every, Limits, WindowLimit};
use proxy::quota::regions::{RegionalStore, RegionalStoreHandle};
use proxy::quota::rules::{BanPolicy, Outcome};
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
    RegionalStore::new(Arc::new(store), Arc::new(ledger), name)
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
    // The global store has no replica, but the region waits for one: no grant is acknowledged,
    // as when a failover would lose it. Each counts as granted, none is held.
    let global = RedisServer::start();
    let local = RedisServer::start();
    let store = RedisStore::new(&local.url(), PREFIX, Duration::from_millis(500))
        .unwrap()
        .regional();
    let ledger = Ledger::new(
        RedisAccess::from_url(&global.url()).unwrap(),
        PREFIX,
        Duration::from_millis(400),
        1,
    )
    .unwrap();
    let r = RegionalStoreHandle(RegionalStore::new(Arc::new(store), Arc::new(ledger), "eu"));
    let key: Arc<str> = Arc::from("key_unacked");
    let limits = per_minute(100);
    let ban = BanPolicy::default();
    whole_minute_ahead(10).await;
    assert_eq!(decide(&r, &key, limits, &ban).await, Outcome::Unleased);
    assert_eq!(
        local.cli(&["EXISTS", "pet:test:held:{key_unacked}"]).trim(),
        "0"
    );
    let ledger = Ledger::new(
        RedisAccess::from_url(&global.url()).unwrap(),
        PREFIX,
        Duration::from_millis(500),
        0,
    )
    .unwrap();
    let (total, _) = ledger
        .granted("key_unacked", &Instance::at(Every::MINUTE, now()))
        .await
        .unwrap();
    assert!(total >= 1, "the grant stays counted at the global store");
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
    let regional = RegionalStore::new(Arc::clone(&store), Arc::new(ledger), "eu");
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
}
