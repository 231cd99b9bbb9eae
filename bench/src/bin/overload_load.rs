//! The load of `bench/overload`: clients recording every answer's status and latency, so a
//! row can say what one key got beside another.
//!
//! - `--group NAME:KEY:CONNECTIONS`: a closed loop, `CONNECTIONS` kept-alive connections each
//!   sending `GET /v1/pets` with `KEY` as soon as the last answer came (a key's script).
//! - `--burst KEYS_FILE:RATE:CREATE_PERCENT`: an open loop, `RATE` requests a second whatever
//!   the answers, each on a connection of its own, the keys of `KEYS_FILE` (one a line) in turn,
//!   `CREATE_PERCENT` of them `POST /v1/pets` (createPet), the rest `GET /v1/pets`.
//!
//! Every request gives up after `--timeout-ms` (default 2000): that is a client timeout, not an
//! answer. Prints one JSON object per group (the burst's named `burst`, and per operation):
//! sent, answered, timeouts, each status's count, and of the 2xx answers their rate and latency
//! percentiles.
//!
//! `overload-load --url http://127.0.0.1:8080 --seconds 8 --group light:KEY:2 --group heavy:KEY2:64`

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[derive(Default)]
struct Record {
    sent: u64,
    timeouts: u64,
    status: BTreeMap<u16, u64>,
    ok_micros: Vec<u64>,
}

type Records = Arc<Mutex<BTreeMap<String, Record>>>;

fn usage() -> ! {
    eprintln!(
        "usage: overload-load --url URL --seconds N [--timeout-ms MS] \
         [--group NAME:KEY:CONNECTIONS]... [--burst KEYS_FILE:RATE:CREATE_PERCENT]"
    );
    std::process::exit(2)
}

struct Args {
    addr: String,
    seconds: u64,
    timeout: Duration,
    groups: Vec<(String, String, usize)>,
    burst: Option<(Vec<String>, u64, u64)>,
}

fn args() -> Args {
    let mut a = Args {
        addr: String::new(),
        seconds: 8,
        timeout: Duration::from_millis(2_000),
        groups: Vec::new(),
        burst: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| usage());
        match flag.as_str() {
            "--url" => {
                a.addr = value
                    .strip_prefix("http://")
                    .unwrap_or(&value)
                    .trim_end_matches('/')
                    .to_owned()
            }
            "--seconds" => a.seconds = value.parse().unwrap_or_else(|_| usage()),
            "--timeout-ms" => {
                a.timeout = Duration::from_millis(value.parse().unwrap_or_else(|_| usage()))
            }
            "--group" => {
                let parts: Vec<&str> = value.splitn(3, ':').collect();
                let [name, key, conns] = parts[..] else {
                    usage()
                };
                let conns = conns.parse().unwrap_or_else(|_| usage());
                a.groups.push((name.to_owned(), key.to_owned(), conns));
            }
            "--burst" => {
                let parts: Vec<&str> = value.rsplitn(3, ':').collect();
                let [share, rate, file] = parts[..] else {
                    usage()
                };
                let keys: Vec<String> = std::fs::read_to_string(file)
                    .unwrap_or_else(|_| usage())
                    .lines()
                    .map(|l| l.trim().to_owned())
                    .filter(|l| !l.is_empty())
                    .collect();
                let rate = rate.parse().unwrap_or_else(|_| usage());
                let share = share.parse().unwrap_or_else(|_| usage());
                a.burst = Some((keys, rate, share));
            }
            _ => usage(),
        }
    }
    if a.addr.is_empty() || (a.groups.is_empty() && a.burst.is_none()) {
        usage();
    }
    a
}

fn main() {
    let args = args();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap_or_else(|e| {
            eprintln!("overload-load: {e}");
            std::process::exit(1)
        });
    let records: Records = Arc::default();
    runtime.block_on(run(&args, &records));
    let records = records.lock().unwrap_or_else(|p| p.into_inner());
    for (name, r) in records.iter() {
        println!("{}", summary(name, r, args.seconds));
    }
}

async fn run(args: &Args, records: &Records) {
    let until = Instant::now() + Duration::from_secs(args.seconds);
    let mut tasks = Vec::new();
    for (name, key, conns) in &args.groups {
        for _ in 0..*conns {
            let (addr, key, name) = (args.addr.clone(), key.clone(), name.clone());
            let (records, timeout) = (Arc::clone(records), args.timeout);
            tasks.push(tokio::spawn(async move {
                closed_loop(&addr, &key, &name, &records, until, timeout).await
            }));
        }
    }
    if let Some((keys, rate, share)) = &args.burst {
        let (addr, records) = (args.addr.clone(), Arc::clone(records));
        let (keys, rate, share, timeout) = (keys.clone(), *rate, *share, args.timeout);
        tasks.push(tokio::spawn(async move {
            open_loop(&addr, &keys, rate, share, &records, until, timeout).await
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

/// One connection of a group: a request as soon as the last answer came.
async fn closed_loop(
    addr: &str,
    key: &str,
    name: &str,
    records: &Records,
    until: Instant,
    timeout: Duration,
) {
    let request = get(addr, key);
    let mut conn: Option<TcpStream> = None;
    while Instant::now() < until {
        let started = Instant::now();
        let answer = tokio::time::timeout(timeout, exchange(addr, &mut conn, &request)).await;
        let answer = match answer {
            Ok(a) => a,
            Err(_) => {
                conn = None;
                None
            }
        };
        note(records, name, answer, started.elapsed());
        if answer.is_none() {
            // A refused connection or a hang: do not spin.
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// `rate` requests a second, whatever the answers.
async fn open_loop(
    addr: &str,
    keys: &[String],
    rate: u64,
    create_percent: u64,
    records: &Records,
    until: Instant,
    timeout: Duration,
) {
    let gap = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
    let mut tick = tokio::time::interval(gap);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut n: u64 = 0;
    let mut tasks = Vec::new();
    while Instant::now() < until {
        tick.tick().await;
        let key = &keys[(n as usize) % keys.len().max(1)];
        let create = n % 100 < create_percent;
        n += 1;
        let (request, op) = if create {
            (post(addr, key), "createPet")
        } else {
            (get(addr, key), "listPets")
        };
        let (addr, records) = (addr.to_owned(), Arc::clone(records));
        tasks.push(tokio::spawn(async move {
            let started = Instant::now();
            let mut conn = None;
            let answer = tokio::time::timeout(timeout, exchange(&addr, &mut conn, &request))
                .await
                .ok()
                .flatten();
            let took = started.elapsed();
            note(&records, "burst", answer, took);
            note(&records, &format!("burst {op}"), answer, took);
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

fn note(records: &Records, name: &str, answer: Option<u16>, took: Duration) {
    let mut all = records.lock().unwrap_or_else(|p| p.into_inner());
    let r = all.entry(name.to_owned()).or_default();
    r.sent += 1;
    match answer {
        None => r.timeouts += 1,
        Some(status) => {
            *r.status.entry(status).or_default() += 1;
            if (200..300).contains(&status) {
                r.ok_micros.push(took.as_micros() as u64);
            }
        }
    }
}

fn get(addr: &str, key: &str) -> Vec<u8> {
    format!("GET /v1/pets HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {key}\r\n\r\n")
        .into_bytes()
}

fn post(addr: &str, key: &str) -> Vec<u8> {
    let body = r#"{"name":"Rex","categoryId":1}"#;
    format!(
        "POST /v1/pets HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Sends `request` on `conn` (connecting when there is none) and reads the answer; its status,
/// or `None` when the connection failed. The connection is kept unless the answer closed it.
async fn exchange(addr: &str, conn: &mut Option<TcpStream>, request: &[u8]) -> Option<u16> {
    for _ in 0..2 {
        if conn.is_none() {
            let stream = TcpStream::connect(addr).await.ok()?;
            let _ = stream.set_nodelay(true);
            *conn = Some(stream);
        }
        let stream = conn.as_mut()?;
        if stream.write_all(request).await.is_err() {
            *conn = None;
            continue;
        }
        match read_answer(stream).await {
            Some((status, keep)) => {
                if !keep {
                    *conn = None;
                }
                return Some(status);
            }
            None => *conn = None,
        }
    }
    None
}

/// An HTTP/1.1 answer's status and whether the connection stays open; `None` when it closed
/// first.
async fn read_answer(stream: &mut TcpStream) -> Option<(u16, bool)> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let status: u16 = head.split_whitespace().nth(1)?.parse().ok()?;
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let keep = !head.lines().any(|l| l.starts_with("connection: close"));
    let mut have = buf.len() - head_end;
    while have < length {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        have += n;
    }
    Some((status, keep))
}

fn summary(name: &str, r: &Record, seconds: u64) -> String {
    let mut ok = r.ok_micros.clone();
    ok.sort_unstable();
    let pct = |p: usize| -> f64 {
        if ok.is_empty() {
            return 0.0;
        }
        ok[(ok.len() * p / 100).min(ok.len() - 1)] as f64 / 1000.0
    };
    let status: BTreeMap<String, u64> = r.status.iter().map(|(s, n)| (s.to_string(), *n)).collect();
    serde_json::json!({
        "group": name,
        "sent": r.sent,
        "answered": r.sent - r.timeouts,
        "timeouts": r.timeouts,
        "status": status,
        "ok": ok.len(),
        "ok_per_s": ok.len() as f64 / seconds.max(1) as f64,
        "ok_p50_ms": pct(50),
        "ok_p99_ms": pct(99),
        "ok_max_ms": ok.last().map_or(0.0, |m| *m as f64 / 1000.0),
    })
    .to_string()
}
