//! A backend of fixed capacity, the shape `bench/overload` and the overload tests need: it
//! serves `workers` requests at a time, each taking `service` (a sleep), and queues the rest
//! in the order they came, without limit, as a thread or connection pool of a real service
//! does; everything it answers is 200 with `[]`. So its throughput is `workers / service` and a
//! request's latency grows with what is queued in front of it.
//!
//! Its control endpoints (not counted, never queued): `POST /control/workers/N` sets the
//! workers now (the adaptive limit's test: 4 → 2 → 8); `GET /control/served` answers what it
//! has served, in the order it started serving them: `{"served": N, "keys": ["key_1", …]}`
//! (the `X-Api-Key-Id` the gateway sent; the last 10,000), `"in_flight"` and `"most_in_flight"`
//! (the most it ever had started and not finished).
//!
//! `capacity-backend --listen 127.0.0.1:9000 --workers 4 --service-ms 25`

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::sync::Semaphore;

struct Backend {
    service: Duration,
    /// Permits are the free workers; `workers` the count they add up to.
    permits: Semaphore,
    workers: Mutex<usize>,
    served: AtomicUsize,
    in_flight: AtomicUsize,
    most_in_flight: AtomicUsize,
    keys: Mutex<VecDeque<String>>,
}

const KEPT_KEYS: usize = 10_000;

fn usage() -> ! {
    eprintln!("usage: capacity-backend --listen ADDR --workers N --service-ms MS");
    std::process::exit(2)
}

fn main() {
    let mut listen: Option<SocketAddr> = None;
    let (mut workers, mut service_ms) = (4usize, 25u64);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_else(|| usage());
        match flag.as_str() {
            "--listen" => listen = Some(value.parse().unwrap_or_else(|_| usage())),
            "--workers" => workers = value.parse().unwrap_or_else(|_| usage()),
            "--service-ms" => service_ms = value.parse().unwrap_or_else(|_| usage()),
            _ => usage(),
        }
    }
    let listen = listen.unwrap_or_else(|| usage());
    let backend = Arc::new(Backend {
        service: Duration::from_millis(service_ms),
        permits: Semaphore::new(workers),
        workers: Mutex::new(workers),
        served: AtomicUsize::new(0),
        in_flight: AtomicUsize::new(0),
        most_in_flight: AtomicUsize::new(0),
        keys: Mutex::new(VecDeque::new()),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap_or_else(|e| {
            eprintln!("capacity-backend: cannot start a runtime: {e}");
            std::process::exit(1)
        });
    runtime.block_on(serve(listen, backend));
}

async fn serve(listen: SocketAddr, backend: Arc<Backend>) {
    let listener = match tokio::net::TcpListener::bind(listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("capacity-backend: cannot listen on {listen}: {e}");
            std::process::exit(1)
        }
    };
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let backend = Arc::clone(&backend);
        tokio::spawn(async move {
            let service = service_fn(move |req| handle(Arc::clone(&backend), req));
            let _ = hyper::server::conn::http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn handle(
    backend: Arc<Backend>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    let path = req.uri().path().to_owned();
    if let Some(n) = path.strip_prefix("/control/workers/") {
        let Ok(n) = n.parse::<usize>() else {
            return Ok(reply(
                400,
                "{\"error\":\"workers must be a number\"}".into(),
            ));
        };
        set_workers(&backend, n).await;
        return Ok(reply(200, format!("{{\"workers\":{n}}}")));
    }
    if path == "/control/served" {
        let keys: Vec<String> = backend
            .keys
            .lock()
            .map(|k| k.iter().cloned().collect())
            .unwrap_or_default();
        let body = serde_json::json!({
            "served": backend.served.load(Ordering::Relaxed),
            "in_flight": backend.in_flight.load(Ordering::Relaxed),
            "most_in_flight": backend.most_in_flight.load(Ordering::Relaxed),
            "keys": keys,
        });
        return Ok(reply(200, body.to_string()));
    }
    let key = req
        .headers()
        .get("x-api-key-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_owned();
    // Waits its turn for a worker, in arrival order (tokio's semaphore is fair).
    let Ok(worker) = backend.permits.acquire().await else {
        return Ok(reply(503, "{\"error\":\"closed\"}".into()));
    };
    let now = backend.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
    backend.most_in_flight.fetch_max(now, Ordering::Relaxed);
    if let Ok(mut keys) = backend.keys.lock() {
        if keys.len() == KEPT_KEYS {
            keys.pop_front();
        }
        keys.push_back(key);
    }
    tokio::time::sleep(backend.service).await;
    backend.in_flight.fetch_sub(1, Ordering::Relaxed);
    backend.served.fetch_add(1, Ordering::Relaxed);
    drop(worker);
    Ok(reply(200, "[]".into()))
}

/// Adds permits, or takes them back as they come free.
async fn set_workers(backend: &Backend, n: usize) {
    let mut workers = match backend.workers.lock() {
        Ok(w) => *w,
        Err(_) => return,
    };
    if n > workers {
        backend.permits.add_permits(n - workers);
        workers = n;
    }
    while workers > n.max(1) {
        if let Ok(p) = backend.permits.acquire().await {
            p.forget();
            workers -= 1;
        }
    }
    if let Ok(mut w) = backend.workers.lock() {
        *w = workers;
    }
}

fn reply(status: u16, body: String) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::OK);
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    resp
}
