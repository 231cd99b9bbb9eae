//! Assembles and runs the gateway: the proxy service on the public listener, the admin service,
//! and the background reloader, in one pingora server.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use http::Response;
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;
use pingora::server::configuration::ServerConf;
use pingora::server::{RunArgs, Server, ShutdownSignalWatch, ShutdownWatch};
use pingora::services::background::{background_service, BackgroundService};
use pingora::services::listening::Service;

use crate::catalog::{Catalog, CatalogError};
use crate::config::Config;
use crate::gateway::Gateway;
use crate::responses::{error_body, ErrorCode};
use crate::store::{MemoryStore, QuotaStore, RedisStore, StoreError};
use crate::unauth::UnauthLimiter;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot listen on {addr} ({what}): {source}")]
    Listen {
        addr: std::net::SocketAddr,
        what: &'static str,
        source: std::io::Error,
    },
}

/// Pingora retries a busy port for a long while before giving up; an operator who starts a
/// second gateway on a taken port should hear about it at once instead.
fn probe_listen(addr: std::net::SocketAddr, what: &'static str) -> Result<(), ServeError> {
    std::net::TcpListener::bind(addr)
        .map(drop)
        .map_err(|source| ServeError::Listen { addr, what, source })
}

/// Runs the gateway until `shutdown` asks it to stop (SIGTERM drains in-flight requests;
/// SIGQUIT hands the listeners to a new process started with `--upgrade`).
pub fn run(config: Config, shutdown: Box<dyn ShutdownSignalWatch>) -> Result<(), ServeError> {
    probe_listen(config.listen, "listen")?;
    probe_listen(config.admin_listen, "admin_listen")?;
    let catalog = Arc::new(Catalog::load(&config.keys_file, &config.plans_dir)?);
    let store: Arc<dyn QuotaStore> = match &config.redis_url {
        Some(url) => Arc::new(RedisStore::new(
            url,
            &config.key_prefix,
            config.store_timeout,
        )?),
        None => Arc::new(MemoryStore::new()),
    };
    {
        let snapshot = catalog.snapshot();
        tracing::info!(
            environment = %config.environment,
            listen = %config.listen,
            admin_listen = %config.admin_listen,
            upstreams = ?config.upstreams,
            store = if config.redis_url.is_some() { "redis" } else { "memory" },
            key_prefix = %config.key_prefix,
            keys = snapshot.keys.len(),
            plans = ?snapshot.plans.names(),
            "pet-gateway starting"
        );
    }
    let unauth = Arc::new(UnauthLimiter::new(config.unauthenticated_per_minute));

    let conf = ServerConf {
        threads: config.threads,
        grace_period_seconds: Some(1),
        graceful_shutdown_timeout_seconds: Some(10),
        upgrade_sock: format!(
            "/tmp/pet-gateway-{}-{}.sock",
            config.environment,
            config.listen.port()
        ),
        pid_file: format!(
            "/tmp/pet-gateway-{}-{}.pid",
            config.environment,
            config.listen.port()
        ),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();

    let gateway = Gateway::new(&config, Arc::clone(&catalog), store, Arc::clone(&unauth));
    let mut proxy =
        pingora::proxy::http_proxy_service_with_name(&server.configuration, gateway, "pet-gateway");
    proxy.add_tcp(&config.listen.to_string());
    server.add_service(proxy);

    let mut admin = Service::new("admin".to_owned(), Admin);
    admin.add_tcp(&config.admin_listen.to_string());
    admin.threads = Some(1);
    server.add_service(admin);

    server.add_service(background_service(
        "reloader",
        Reloader {
            catalog,
            unauth,
            interval: config.reload_interval,
        },
    ));

    server.run(RunArgs {
        shutdown_signal: shutdown,
    });
    Ok(())
}

/// Watches the keys file and the plans directory (and SIGHUP) and applies edits.
struct Reloader {
    catalog: Arc<Catalog>,
    unauth: Arc<UnauthLimiter>,
    interval: Duration,
}

#[async_trait]
impl BackgroundService for Reloader {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut hangup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGHUP; reloading on file changes only");
                None
            }
        };
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_sweep = tokio::time::Instant::now();
        loop {
            let force = tokio::select! {
                _ = tick.tick() => false,
                Some(()) = async { match hangup.as_mut() { Some(h) => h.recv().await, None => None } } => {
                    tracing::info!("SIGHUP: reloading keys and plans");
                    true
                }
                _ = shutdown.changed() => return,
            };
            let catalog = Arc::clone(&self.catalog);
            if let Err(e) = tokio::task::spawn_blocking(move || catalog.reload(force)).await {
                tracing::error!(error = %e, "reload task failed");
            }
            if last_sweep.elapsed() > Duration::from_secs(60) {
                last_sweep = tokio::time::Instant::now();
                self.unauth.sweep();
            }
        }
    }
}

/// The admin listener: health for load balancers and supervisors.
struct Admin;

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let path = session.req_header().uri.path().to_owned();
        let (status, body) = match path.as_str() {
            "/healthz" => (200, br#"{"status":"ok"}"#.to_vec()),
            _ => (
                404,
                error_body(404, ErrorCode::NotFound, "no such admin endpoint").to_vec(),
            ),
        };
        Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .header("content-length", body.len())
            .body(body)
            .unwrap_or_default()
    }
}
