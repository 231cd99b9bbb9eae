//! What listing the bans costs the embedded store, and the requests beside it, when many keys
//! have state: the console's overview asks every few seconds, and each shard's lock is held
//! while that shard is listed.
//!
//! `ban-list --keys N --bans B --repeat R`
//!
//! N keys each decided once (a state in the store each), B of them driven into a ban, then R
//! calls of `bans()` timed one after another while a second thread decides for other keys in a
//! loop and records how long each decision took. One JSON line goes to stdout: the median and
//! slowest `bans()`, and the slowest decision and 99.9th percentile beside the listing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proxy::keys::limits::Limits;
use proxy::quota::rules::BanPolicy;
use proxy::quota::store::memory::MemoryStore;
use proxy::quota::store::QuotaStore;

#[global_allocator]
static GLOBAL: proxy::base::alloc::MiMalloc = proxy::base::alloc::MiMalloc;

fn arg(name: &str, default: usize) -> Result<usize, String> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.replace('_', "").parse().ok())
            .ok_or_else(|| format!("{name} takes a number")),
    }
}

fn main() -> Result<(), String> {
    let keys = arg("--keys", 1_000_000)?;
    let bans = arg("--bans", 100)?.min(keys);
    let repeat = arg("--repeat", 21)?.max(1);
    let store = Arc::new(MemoryStore::new());
    let limits = Limits::minute_day(1, 1_000)?;
    let policy = BanPolicy {
        strikes: 0,
        durations: vec![600],
        decay_secs: 3_600,
    };
    let now = proxy::base::clock::unix_now();
    let ids: Vec<Arc<str>> = (0..keys).map(|i| Arc::from(format!("key-{i}"))).collect();
    for id in &ids {
        store.decide(id, &limits, 1, &policy, now);
    }
    for id in &ids[..bans] {
        store.decide(id, &limits, 1, &policy, now); // refused: past the strikes, banned
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| e.to_string())?;

    let room = Limits::minute_day(1_000_000, 1_000_000)?;
    // Decisions alone for a second, then beside the listings for at least a second.
    let alone = decide_while(&store, room, now, || {
        std::thread::sleep(Duration::from_secs(1))
    });
    let mut listing = Vec::new();
    let mut found = 0;
    let beside = decide_while(&store, room, now, || {
        let began = Instant::now();
        while listing.len() < repeat || began.elapsed() < Duration::from_secs(1) {
            let started = Instant::now();
            found = runtime.block_on(store.bans()).map(|b| b.len()).unwrap_or(0);
            listing.push(started.elapsed());
        }
    });
    listing.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1_000.0;
    println!(
        "{{\"keys\": {keys}, \"bans\": {found}, \"listings\": {}, \"listing_ms_median\": {:.3}, \
         \"listing_ms_max\": {:.3}, \"decision_alone\": {alone}, \"decision_beside_listing\": {beside}}}",
        listing.len(),
        ms(listing[listing.len() / 2]),
        ms(listing[listing.len() - 1]),
    );
    Ok(())
}

/// Runs `meanwhile` on this thread while a second thread decides for other keys in a loop, and
/// says how long those decisions took: their count, 99.9th percentile and slowest, in µs.
fn decide_while(
    store: &Arc<MemoryStore>,
    room: Limits,
    now: u64,
    meanwhile: impl FnOnce(),
) -> String {
    let stop = Arc::new(AtomicBool::new(false));
    let started = Arc::new(AtomicBool::new(false));
    let decider = {
        let (store, stop, started) = (Arc::clone(store), Arc::clone(&stop), Arc::clone(&started));
        std::thread::spawn(move || {
            let ids: Vec<Arc<str>> = (0..10_000)
                .map(|i| Arc::from(format!("other-{i}")))
                .collect();
            let policy = BanPolicy::default();
            let mut took = Vec::new();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let began = Instant::now();
                store.decide(&ids[i % ids.len()], &room, 1, &policy, now);
                took.push(began.elapsed());
                i += 1;
                started.store(true, Ordering::Relaxed);
            }
            took
        })
    };
    while !started.load(Ordering::Relaxed) {
        std::thread::yield_now();
    }
    meanwhile();
    stop.store(true, Ordering::Relaxed);
    let mut took = decider.join().unwrap_or_default();
    took.sort();
    let us = |d: Duration| d.as_secs_f64() * 1_000_000.0;
    match took.last() {
        None => "null".to_owned(),
        Some(max) => format!(
            "{{\"decisions\": {}, \"us_p999\": {:.1}, \"us_max\": {:.1}}}",
            took.len(),
            us(took[took.len() * 999 / 1000]),
            us(*max)
        ),
    }
}
