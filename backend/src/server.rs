//! Accepting connections and shutting down cleanly. `run` takes its listener and its shutdown
//! signal as arguments (as mini-redis does) so tests bind `127.0.0.1:0` and stop it at will.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use crate::api;
use crate::api::Settings;
use crate::store::PetStore;

/// How long a client may take to send its request headers (slowloris protection).
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long in-flight requests get to finish after the shutdown signal before they are dropped.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves the API on `listener` until `shutdown` completes, then stops accepting, lets
/// in-flight requests finish (up to [`DRAIN_TIMEOUT`]) and returns.
pub async fn run(listener: TcpListener, store: PetStore, shutdown: impl Future<Output = ()>) {
    run_with(listener, store, Settings::default(), shutdown).await
}

/// [`run`] with handler settings of its own (the getPet sunset).
pub async fn run_with(
    listener: TcpListener,
    store: PetStore,
    settings: Settings,
    shutdown: impl Future<Output = ()>,
) {
    let settings = Arc::new(settings);
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .keep_alive(true);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);

    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(conn) => conn,
                    Err(e) => {
                        // Usually EMFILE: back off instead of spinning, keep serving the rest.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let store = store.clone();
                let settings = Arc::clone(&settings);
                let service = service_fn(move |req| {
                    let store = store.clone();
                    let settings = Arc::clone(&settings);
                    async move { Ok::<_, Infallible>(api::handle(&store, &settings, req).await) }
                });
                let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(%peer, error = %e, "connection ended with an error");
                    }
                });
            }
            () = &mut shutdown => break,
        }
    }

    drop(listener);
    tracing::info!("shutting down: draining in-flight requests");
    tokio::select! {
        () = graceful.shutdown() => tracing::info!("all connections closed"),
        () = tokio::time::sleep(DRAIN_TIMEOUT) => {
            tracing::warn!("drain timeout passed; dropping the remaining connections");
        }
    }
}

/// Completes on SIGTERM (service managers) or Ctrl-C (a terminal).
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
