//! Drives the Redis store's decisions as hard as it can, the way a fleet of gateway nodes would,
//! and reports what Redis spent on them: the question is how many decisions one Redis core can
//! make, which the gateways in front of one 2-core machine cannot show (they saturate first).
//!
//! `store-load --redis URL --keys N --batch-max M --concurrency C --seconds S --windows W`
//!
//! C tasks each loop over `acquire` on keys spread over N ids (a plan with room for every
//! request, so each decision is an admission: the path that writes), with W windows: 2 is the
//! minute and the day, 4 adds a second and the month, up to 6 (an hour and a week). Before and after, Redis's
//! `INFO commandstats` (the scripts' own time) and `INFO cpu` (the whole process: parsing,
//! networking, scripts) are read. One JSON line goes to stdout.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proxy::keys::limits::{Every, Limits, WindowLimit};
use proxy::quota::rules::BanPolicy;
use proxy::quota::store::redis::RedisStore;
use proxy::quota::store::QuotaStore;

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
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
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
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(a)
}

/// `(script calls that ran, their microseconds, Redis process CPU seconds)`.
fn redis_stats(conn: &mut redis::Connection) -> Result<(u64, u64, f64), String> {
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
    let (mut calls, mut usec, mut cpu) = (0.0, 0.0, 0.0);
    for line in info.lines() {
        if line.starts_with("cmdstat_evalsha:") {
            calls += field(line, "calls") - field(line, "failed_calls");
            usec += field(line, "usec");
        }
        for name in ["used_cpu_sys:", "used_cpu_user:"] {
            if let Some(v) = line.strip_prefix(name) {
                cpu += v.trim().parse::<f64>().unwrap_or(0.0);
            }
        }
    }
    Ok((calls as u64, usec as u64, cpu))
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
    let limits = Limits::new(&windows)?;
    let ban = Arc::new(BanPolicy::default());
    // Loads the script and opens the connection before anything is counted.
    runtime
        .block_on(store.acquire(&ids[0], limits, 1, &ban))
        .map_err(|e| e.to_string())?;

    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let before = redis_stats(&mut stats)?;
    let started = Instant::now();
    runtime.block_on(async {
        let tasks: Vec<_> = (0..a.concurrency)
            .map(|t| {
                let (store, ids, ban) = (store.clone(), ids.clone(), ban.clone());
                let (stop, done, errors) = (stop.clone(), done.clone(), errors.clone());
                tokio::spawn(async move {
                    let mut i = t * 7_919;
                    while !stop.load(Ordering::Relaxed) {
                        i = (i + 1) % ids.len();
                        match store.acquire(&ids[i], limits, 1, &ban).await {
                            Ok(_) => done.fetch_add(1, Ordering::Relaxed),
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
    });
    let elapsed = started.elapsed().as_secs_f64();
    let after = redis_stats(&mut stats)?;
    let decisions = done.load(Ordering::Relaxed);
    println!(
        "{{\"keys\":{},\"batch_max\":{},\"concurrency\":{},\"seconds\":{elapsed:.3},\"decisions\":{decisions},\"errors\":{},\"script_runs\":{},\"script_usec\":{},\"redis_cpu_s\":{:.6}}}",
        a.keys,
        a.batch_max,
        a.concurrency,
        errors.load(Ordering::Relaxed),
        after.0 - before.0,
        after.1 - before.1,
        after.2 - before.2,
    );
    Ok(())
}
