//! Drives the Redis store's decisions as hard as it can, the way a fleet of gateway nodes would,
//! and reports what Redis spent on them: the question is how many decisions one Redis core can
//! make, which the gateways in front of one 2-core machine cannot show (they saturate first).
//!
//! `store-load --redis URL --keys N --batch-max M --concurrency C --seconds S --windows W
//! [--key-concurrency K] [--top]`
//!
//! C tasks each loop over `acquire` on keys spread over N ids (a plan with room for every
//! request, so each decision is an admission: the path that writes), with W windows: 2 is the
//! minute and the day, 4 adds a second and the month, up to 6 (an hour and a week). Before and after, Redis's
//! `INFO commandstats` (the scripts' own time) and `INFO cpu` (the whole process: parsing,
//! networking, scripts) are read. One JSON line goes to stdout.
//!
//! `--key-concurrency K` gives the limits a concurrency of K (a plan's `concurrency`): each
//! decision then takes a lease in the same script run, and gives it back (`release`) at once,
//! the release riding a later run of the lane, as a request ending does; a decision's cost is
//! then its acquire and its release (issue 32's Redis CPU target counts both).
//!
//! `--top` adds the top consumers' index as the gateway runs it: every admitted decision is
//! added to a `TopTally` (holder the key's id, the store's clock from the verdict), and the
//! gateway's own flush task (`proxy::quota::top::run_flush`, once a second, its `ZINCRBY`s on a
//! connection of its own) writes it to Redis; at the end the task is stopped (one last flush, as
//! at a gateway's stop) before Redis is read. The line then counts the flushes (`EXPIREAT`s / 2)
//! and the holders per flush (`ZINCRBY`s / 2 / flushes), from `INFO commandstats`, and the
//! flushes that failed (`pet_gateway_top_flush_failures_total`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proxy::keys::limits::{Every, Limits, WindowLimit};
use proxy::quota::rules::{BanPolicy, Outcome};
use proxy::quota::store::redis::RedisStore;
use proxy::quota::store::QuotaStore;
use proxy::quota::top::{run_flush, TopTally};

#[global_allocator]
static GLOBAL: proxy::base::alloc::MiMalloc = proxy::base::alloc::MiMalloc;

struct Args {
    redis: String,
    keys: usize,
    batch_max: usize,
    concurrency: usize,
    seconds: u64,
    threads: usize,
    windows: usize,
    key_concurrency: u32,
    top: bool,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        redis: "redis://127.0.0.1:6379/".into(),
        keys: 10_000,
        batch_max: proxy::quota::store::redis::DEFAULT_BATCH_MAX,
        concurrency: 512,
        seconds: 5,
        threads: 1,
        windows: 2,
        key_concurrency: 0,
        top: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--top" {
            a.top = true;
            continue;
        }
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<usize>()
                .map_err(|e| format!("{flag} {value}: {e}"))
        };
        match flag.as_str() {
            "--redis" => a.redis = value.clone(),
            "--keys" => a.keys = number()?.max(1),
            "--batch-max" => a.batch_max = number()?.max(1),
            "--concurrency" => a.concurrency = number()?.max(1),
            "--seconds" => a.seconds = number()? as u64,
            "--threads" => a.threads = number()?.max(1),
            "--windows" => a.windows = number()?.clamp(1, 6),
            "--key-concurrency" => a.key_concurrency = number()? as u32,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(a)
}

/// What `INFO commandstats` and `INFO cpu` say at one moment.
#[derive(Default, Clone, Copy)]
struct Stats {
    /// Script calls that ran, and their microseconds.
    script_runs: f64,
    script_usec: f64,
    /// The top consumers' index: `ZINCRBY` calls and microseconds, `EXPIREAT` calls.
    zincrby_calls: f64,
    zincrby_usec: f64,
    expireat_calls: f64,
    /// Redis process CPU seconds (`used_cpu_sys` + `used_cpu_user`).
    cpu: f64,
}

fn redis_stats(conn: &mut redis::Connection) -> Result<Stats, String> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .arg("cpu")
        .query(conn)
        .map_err(|e| e.to_string())?;
    let field = |line: &str, name: &str| -> f64 {
        line.split([':', ','])
            .find_map(|f| f.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
            .unwrap_or(0.0)
    };
    let mut s = Stats::default();
    for line in info.lines() {
        if line.starts_with("cmdstat_evalsha:") || line.starts_with("cmdstat_fcall:") {
            s.script_runs += field(line, "calls") - field(line, "failed_calls");
            s.script_usec += field(line, "usec");
        }
        if line.starts_with("cmdstat_zincrby:") {
            s.zincrby_calls += field(line, "calls");
            s.zincrby_usec += field(line, "usec");
        }
        if line.starts_with("cmdstat_expireat:") {
            s.expireat_calls += field(line, "calls");
        }
        for name in ["used_cpu_sys:", "used_cpu_user:"] {
            if let Some(v) = line.strip_prefix(name) {
                s.cpu += v.trim().parse::<f64>().unwrap_or(0.0);
            }
        }
    }
    Ok(s)
}

fn main() -> Result<(), String> {
    let a = args()?;
    let client = redis::Client::open(a.redis.as_str()).map_err(|e| e.to_string())?;
    let mut stats = client.get_connection().map_err(|e| e.to_string())?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(a.threads)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let store = Arc::new(
        RedisStore::new(&a.redis, "bench:load", Duration::from_secs(2))
            .map_err(|e| e.to_string())?
            .with_batch_max(a.batch_max),
    );
    let ids: Arc<Vec<Arc<str>>> =
        Arc::new((0..a.keys).map(|i| Arc::from(format!("k{i}"))).collect());
    let lengths = [
        Every::MINUTE,
        Every::DAY,
        Every::Secs(1),
        Every::Month,
        Every::Secs(3_600),
        Every::Secs(7 * 86_400),
    ];
    let windows: Vec<WindowLimit> = lengths[..a.windows]
        .iter()
        .map(|&every| WindowLimit::new(every, 4_000_000_000))
        .collect::<Result<_, _>>()?;
    let limits = Limits::new(&windows)?.with_concurrency(a.key_concurrency);
    let ban = Arc::new(BanPolicy::default());
    // Loads the script and opens the connection before anything is counted.
    runtime
        .block_on(store.acquire(&ids[0], limits, 1, &ban))
        .map_err(|e| e.to_string())?;

    // The gateway's tally and flush task, on a store of its own as the gateway's (`top_store`).
    let top = a.top.then(|| Arc::new(TopTally::default()));
    let (stop_flush, flush_stopped) = tokio::sync::watch::channel(false);
    let flusher = match &top {
        Some(tally) => {
            let flush_store: Arc<dyn QuotaStore> = Arc::new(
                RedisStore::new(&a.redis, "bench:load", Duration::from_millis(500))
                    .map_err(|e| e.to_string())?,
            );
            Some(runtime.spawn(run_flush(Arc::clone(tally), flush_store, flush_stopped)))
        }
        None => None,
    };

    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let before = redis_stats(&mut stats)?;
    let started = Instant::now();
    runtime.block_on(async {
        let tasks: Vec<_> = (0..a.concurrency)
            .map(|t| {
                let (store, ids, ban) = (store.clone(), ids.clone(), ban.clone());
                let top = top.clone();
                let (stop, done, errors) = (stop.clone(), done.clone(), errors.clone());
                tokio::spawn(async move {
                    let mut i = t * 7_919;
                    while !stop.load(Ordering::Relaxed) {
                        i = (i + 1) % ids.len();
                        match store.acquire(&ids[i], limits, 1, &ban).await {
                            Ok(v) => {
                                // The request ends at once: its lease goes back.
                                store.release(&ids[i], v.lease);
                                // As the request path does (`pipeline.rs`): admitted units only.
                                if let (Some(top), Outcome::Admitted) = (&top, v.outcome) {
                                    top.add(&ids[i], v.now, 1);
                                }
                                done.fetch_add(1, Ordering::Relaxed)
                            }
                            Err(_) => errors.fetch_add(1, Ordering::Relaxed),
                        };
                    }
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(a.seconds)).await;
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            let _ = t.await;
        }
        if let Some(flusher) = flusher {
            let _ = stop_flush.send(true);
            let _ = flusher.await;
        }
    });
    let elapsed = started.elapsed().as_secs_f64();
    let after = redis_stats(&mut stats)?;
    let decisions = done.load(Ordering::Relaxed);
    let zincrby = after.zincrby_calls - before.zincrby_calls;
    let flushes = (after.expireat_calls - before.expireat_calls) / 2.0;
    let redis_cpu = after.cpu - before.cpu;
    println!(
        "{{\"keys\":{},\"batch_max\":{},\"concurrency\":{},\"windows\":{},\"key_concurrency\":{},\"top\":{},\"seconds\":{elapsed:.3},\"decisions\":{decisions},\"errors\":{},\"script_runs\":{},\"script_usec\":{},\"redis_cpu_s\":{redis_cpu:.6},\"redis_cpu_us_per_decision\":{:.3},\"top_flushes\":{flushes},\"top_holders_per_flush\":{:.1},\"zincrby_calls\":{zincrby},\"zincrby_usec\":{},\"top_flush_failures\":{}}}",
        a.keys,
        a.batch_max,
        a.concurrency,
        a.windows,
        a.key_concurrency,
        a.top,
        errors.load(Ordering::Relaxed),
        after.script_runs - before.script_runs,
        after.script_usec - before.script_usec,
        redis_cpu * 1e6 / decisions.max(1) as f64,
        if flushes > 0.0 { zincrby / 2.0 / flushes } else { 0.0 },
        after.zincrby_usec - before.zincrby_usec,
        proxy::base::metrics::METRICS.top_flush_failures.get(),
    );
    Ok(())
}
