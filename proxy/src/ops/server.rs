//! Assembles and runs the gateway: the proxy service on the public listener (plain HTTP, or TLS
//! with HTTP/2), the admin service, and the background reloader, in one pingora server.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::listeners::tls::TlsSettings;
use pingora::proxy::HttpProxy;
use pingora::server::configuration::{Opt, ServerConf};
use pingora::server::{RunArgs, Server, ShutdownWatch};
use pingora::services::background::{background_service, BackgroundService};
use pingora::services::listening::Service;

use crate::base::metrics::METRICS;
use crate::base::redis::{RedisAccess, RedisAccessError};
use crate::base::traces::{TraceExport, TraceSettings, Tracing};
use crate::config::Config;
use crate::events::cloud::Origin;
use crate::events::pump::{self, PumpHandle};
use crate::events::queue::{FileOutput, Queue, SpoolOutput};
use crate::events::usage::Meter;
use crate::events::webhook::deliver::{self, DeliveryHandle};
use crate::events::webhook::spool::Spool;
use crate::http::draining::{self, Draining};
use crate::http::gateway::{self, Gateway};
use crate::http::head_deadline::HeadDeadline;
use crate::http::tls::{CertResolver, TlsError};
use crate::keys::catalog::{Catalog, CatalogError};
use crate::keys::replica::SyncState;
use crate::keys::service::KeyStore;
use crate::ops::admin::Admin;
use crate::ops::stop_signals::StopSignals;
use crate::ops::wiring::{key_changes, open_registry, REDIS_CHECK_TIMEOUT};
use crate::quota::admission::OnStoreError;
use crate::quota::regions::{RegionalStore, RegionalStoreHandle};
use crate::quota::resilience::{Resilience, BAN_RECHECK};
use crate::quota::store::memory::MemoryStore;
use crate::quota::store::redis::ban_feed::BanFeed;
use crate::quota::store::redis::ledger::Ledger;
use crate::quota::store::redis::RedisStore;
use crate::quota::store::{QuotaStore, StoreConfigError};
use crate::quota::top::TopTally;
use crate::quota::unauth::UnauthLimiter;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    #[error(transparent)]
    Store(#[from] StoreConfigError),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("key registry: {0}")]
    Registry(String),
    #[error(transparent)]
    Redis(#[from] RedisAccessError),
    #[error("cannot start the events thread (metering_file): {0}")]
    Events(std::io::Error),
    #[error("cannot start the webhook (events_webhook_url): {0}")]
    Webhook(String),
    #[error("traces: {0}")]
    Traces(#[from] crate::base::traces::TraceError),
    #[error("cannot listen on {addr} ({what}): {source}")]
    Listen {
        addr: SocketAddr,
        what: &'static str,
        source: std::io::Error,
    },
}

/// Pingora retries a busy port for a long while before giving up; an operator who starts a
/// second gateway on a taken port should hear about it at once instead.
fn probe_listen(addr: SocketAddr, what: &'static str) -> Result<(), ServeError> {
    bound(addr)
        .map(drop)
        .map_err(|source| ServeError::Listen { addr, what, source })
}

/// A socket bound to `addr` and never listening (a taken port fails the bind): a probe that
/// listened accepted connections for its moment, and a client polling the port (a test, a load
/// balancer's TCP check) took the gateway for up while it still started, its next request
/// refused.
fn bound(addr: SocketAddr) -> std::io::Result<socket2::Socket> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        None,
    )?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    Ok(socket)
}

/// Runs the gateway until `shutdown` asks it to stop. SIGTERM: stop accepting after the grace
/// period and let in-flight requests finish. SIGQUIT: hand the listening sockets to a new
/// process started with `upgrade = true` (`serve --upgrade`), then drain and exit. Either begins
/// the drain (`http::draining`) the moment pingora takes the signal.
pub fn run(config: Config, upgrade: bool, shutdown: StopSignals) -> Result<(), ServeError> {
    if !upgrade {
        probe_listen(config.listen, "listen")?;
        probe_listen(config.admin_listen, "admin_listen")?;
    }
    let (catalog, certs) = load_files(&config)?;
    log_start(&config, &catalog, upgrade);
    if let Some(redis) = &config.redis {
        check_redis(redis, config.on_store_error)?;
    }
    let (store, admin_store, redis_store) = stores(&config)?;
    let unauth = Arc::new(UnauthLimiter::new(config.unauthenticated.clone()));
    let mut server = pingora_server(&config, upgrade);
    let (store, admin_store) = regional(&config, (store, admin_store), &redis_store, &mut server)?;
    let (key_store, registry_state) = key_source(&config, &mut server, &catalog)?;

    let resilience = Resilience::with_lease_secs(config.concurrency_lease_secs);
    let (meter, metering) = metering(&config)?;
    let (tracing, trace_export) = traces(&config)?;
    let top = Arc::new(TopTally::default());
    add_usage_upkeep(&mut server, &config, &catalog, &admin_store, &meter, &top)?;
    let gateway = Gateway::new(
        gateway_settings(&config, meter, top, tracing, shutdown.draining()),
        Arc::clone(&catalog),
        store,
        Arc::clone(&unauth),
        resilience.clone(),
    );
    let quota_status = gateway.quota_status();
    let places = gateway.places();
    add_place_upkeep(&mut server, &config, &gateway);
    let proxy = proxy_service(&config, &server, gateway, certs.clone())?;
    server.add_service(proxy);

    let history = Arc::new(crate::ops::admin::history::History::default());
    server.add_service(background_service(
        "console history",
        ConsoleHistory(Arc::clone(&history)),
    ));
    server.add_service(admin_service(
        &config,
        &catalog,
        admin_store,
        &resilience,
        (key_store, registry_state),
        (history, places),
    ));

    add_store_probe(&mut server, &config, &resilience)?;
    server.add_service(background_service(
        "reloader",
        Reloader {
            catalog,
            certs,
            unauth,
            resilience,
            quota_status,
            interval: config.reload_interval,
        },
    ));

    server.run(RunArgs {
        shutdown_signal: Box::new(shutdown),
    });
    // Every request has finished: the pump writes the minutes still open, then stops; the
    // leases go back; then the last spans get a moment to go out.
    drop(metering);
    if let Some((store, _)) = redis_store {
        release_on_stop(&config, &store);
    }
    drop(trace_export);
    Ok(())
}

/// The keys and plans, and the certificate when there is TLS: a file that cannot be read stops
/// the start.
fn load_files(config: &Config) -> Result<(Arc<Catalog>, Option<Arc<CertResolver>>), ServeError> {
    let catalog = Arc::new(Catalog::load_with(
        &config.keys_file,
        &config.plans_dir,
        config.keys_source == crate::config::KeysSource::File,
    )?);
    let certs = match &config.tls {
        Some(files) => Some(Arc::new(CertResolver::load(&files.cert, &files.key)?)),
        None => None,
    };
    Ok((catalog, certs))
}

/// The flush of the top consumers' tally to the store, and, when there is a meter, the
/// notices of keys expiring (one node of the fleet claims each).
fn add_usage_upkeep(
    server: &mut Server,
    config: &Config,
    catalog: &Arc<Catalog>,
    admin_store: &Arc<dyn QuotaStore>,
    meter: &Option<Arc<Meter>>,
    top: &Arc<TopTally>,
) -> Result<(), ServeError> {
    server.add_service(background_service(
        "top consumers flush",
        TopFlush {
            tally: Arc::clone(top),
            store: top_store(config, admin_store)?,
            drain: drain_window(config),
        },
    ));
    if let Some(meter) = meter {
        server.add_service(background_service(
            "key expiry notices",
            ExpiryNotices {
                claimant: format!("{}.{}", config.node_id, std::process::id()),
                catalog: Arc::clone(catalog),
                store: Arc::clone(admin_store),
                meter: Arc::clone(meter),
            },
        ));
    }
    Ok(())
}

/// What keeps the gateway's places at the backends true: the renewals of its concurrency
/// leases in the store, and the lookups of backends given by name.
fn add_place_upkeep(server: &mut Server, config: &Config, gateway: &Gateway) {
    server.add_service(background_service(
        "concurrency leases",
        LeaseRenewals(gateway.slots()),
    ));
    server.add_service(background_service(
        "backend name lookups",
        NameLookups(
            Arc::clone(gateway.places().rotation()),
            config.upstream_resolve_interval,
        ),
    ));
}

/// With Redis, the probe that finds it back after an outage, on a connection of its own.
fn add_store_probe(
    server: &mut Server,
    config: &Config,
    resilience: &Resilience,
) -> Result<(), ServeError> {
    if let Some(redis) = &config.redis {
        server.add_service(background_service(
            "store probe",
            StoreProbe {
                resilience: resilience.clone(),
                store: Arc::new(RedisStore::connecting(
                    redis.clone(),
                    &config.key_prefix,
                    config.store_timeout,
                )?),
            },
        ));
    }
    Ok(())
}

/// Gives back, through a connection of its own, the concurrency leases the requests of this
/// process released and that did not go out (their runtime stopped first): a graceful stop
/// leaves no place held in the store. Bounded by a few store deadlines; what still fails ends
/// by itself within `concurrency_lease_secs`.
fn release_on_stop(config: &Config, store: &RedisStore) {
    let releases = store.unsent_releases();
    if releases.is_empty() {
        return;
    }
    let Some(redis) = &config.redis else {
        return;
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "cannot give back {} concurrency leases at the stop; they end by themselves", releases.len());
            return;
        }
    };
    let count = releases.len();
    let result = runtime.block_on(async {
        let last =
            RedisStore::connecting(redis.clone(), &config.key_prefix, Duration::from_secs(1))
                .map_err(|e| e.to_string())?
                .with_lease_secs(config.concurrency_lease_secs);
        tokio::time::timeout(Duration::from_secs(3), last.release_now(&releases))
            .await
            .map_err(|_| "timed out".to_owned())?
            .map_err(|e| e.to_string())
    });
    match result {
        Ok(()) => tracing::info!(
            count,
            "gave back the concurrency leases still held at the stop"
        ),
        Err(e) => tracing::warn!(count, error = %e,
            "could not give back the concurrency leases still held at the stop; they end by themselves within concurrency_lease_secs"),
    }
}

/// The admin listener, on one thread of its own.
fn admin_service(
    config: &Config,
    catalog: &Arc<Catalog>,
    store: Arc<dyn QuotaStore>,
    resilience: &Resilience,
    (key_store, registry): (KeyStore, Option<Arc<SyncState>>),
    (history, places): (
        Arc<crate::ops::admin::history::History>,
        Arc<crate::upstream::places::Places>,
    ),
) -> Service<HeadDeadline<Admin>> {
    let admin = Admin {
        catalog: Arc::clone(catalog),
        store,
        ban_cache: Arc::clone(&resilience.ban_cache),
        breaker: Arc::clone(&resilience.breaker),
        store_optional: config.redis_url.is_none() || config.on_store_error != OnStoreError::Closed,
        token: config.admin_token.clone(),
        token_limit: Default::default(),
        hosts: config.admin_hosts.clone(),
        keys: crate::keys::service::KeyService {
            store: key_store,
            api_key_prefix: config.api_key_prefix.clone(),
            audit_log: config.audit_log.clone(),
            who: "admin".to_owned(),
            changes: key_changes(config),
        },
        registry,
        records: Default::default(),
        history,
        places,
    };
    // The proxy's head deadline here too: the two listeners share the process's descriptors,
    // so heads trickled to this one under pingora's 60 s read timeout would starve the proxy.
    let mut admin_service = Service::new(
        "admin".to_owned(),
        HeadDeadline::new(admin, config.request_header_timeout),
    );
    admin_service.add_tcp(&config.admin_listen.to_string());
    admin_service.threads = Some(1);
    admin_service
}

/// The proxy's store and the admin listener's (and both as Redis stores: the proxy's for what a
/// stop has left to send, both for a region's node). The two run on separate runtimes; in Redis mode each gets its own
/// connection so admin calls never queue behind request traffic, while the embedded store must
/// be one and the same map.
#[allow(clippy::type_complexity)]
fn stores(
    config: &Config,
) -> Result<
    (
        Arc<dyn QuotaStore>,
        Arc<dyn QuotaStore>,
        Option<(Arc<RedisStore>, Arc<RedisStore>)>,
    ),
    ServeError,
> {
    Ok(match &config.redis {
        Some(redis) => {
            let mut proxy =
                RedisStore::connecting(redis.clone(), &config.key_prefix, config.store_timeout)?
                    .with_batch_max(config.store_batch_max)
                    .with_lease_secs(config.concurrency_lease_secs);
            if config.region.is_some() {
                proxy = proxy.regional();
            }
            let proxy = Arc::new(proxy);
            let mut admin = RedisStore::connecting(
                redis.clone(),
                &config.key_prefix,
                Duration::from_millis(500),
            )?;
            if config.region.is_some() {
                // Its `keys reset-usage` drops the units the region holds with the counts.
                admin = admin.regional();
            }
            let admin = Arc::new(admin);
            (proxy.clone(), admin.clone(), Some((proxy, admin)))
        }
        None => {
            let memory =
                Arc::new(MemoryStore::new().with_lease_secs(config.concurrency_lease_secs));
            (memory.clone(), memory, None)
        }
    })
}

/// A node of a region (`region` set): its proxy store (built regional by [`stores`]) admits
/// only out of the units the global store granted the region (`quota::regions`), gives back
/// every second what quiet quotas hold, and follows the bans of every region. The admin API's
/// store is the region's Redis store (built regional: its `reset-usage` drops the units held)
/// with the same ledger and ban feed, so a `bans lift` ends the ban in every region.
#[allow(clippy::type_complexity)]
fn regional(
    config: &Config,
    (store, admin): (Arc<dyn QuotaStore>, Arc<dyn QuotaStore>),
    redis_stores: &Option<(Arc<RedisStore>, Arc<RedisStore>)>,
    server: &mut Server,
) -> Result<(Arc<dyn QuotaStore>, Arc<dyn QuotaStore>), ServeError> {
    let (Some(region), Some((local, local_admin))) = (&config.region, redis_stores) else {
        return Ok((store, admin));
    };
    let ledger = Arc::new(Ledger::new(
        region.global.clone(),
        &config.key_prefix,
        GLOBAL_TIMEOUT,
        region.replicas,
    )?);
    let feed = Arc::new(BanFeed::new(
        region.global.clone(),
        &config.key_prefix,
        GLOBAL_TIMEOUT,
        region.replicas,
    )?);
    let regional = RegionalStore::new(
        Arc::clone(local),
        Arc::clone(&ledger),
        Arc::clone(&feed),
        &region.name,
    );
    let r = Arc::clone(&regional);
    server.add_service(background_service(
        "region give-backs",
        every(crate::quota::regions::sweep::EVERY, move || {
            let r = Arc::clone(&r);
            async move { r.sweep().await }
        }),
    ));
    let r = Arc::clone(&regional);
    server.add_service(background_service(
        "region bans",
        every(crate::quota::regions::bans::EVERY, move || {
            let r = Arc::clone(&r);
            async move { r.follow_bans().await }
        }),
    ));
    let admin = RegionalStore::for_admin(Arc::clone(local_admin), ledger, feed, &region.name);
    Ok((
        Arc::new(RegionalStoreHandle(regional)),
        Arc::new(RegionalStoreHandle(admin)),
    ))
}

/// The deadline of a call to the global store: a round trip between regions, and the wait for
/// its replicas' acknowledgement (`WAIT` is given half of it).
const GLOBAL_TIMEOUT: Duration = Duration::from_millis(800);

/// One task of the node's, run every interval until shutdown: a region's give-backs of what it
/// holds of quotas whose traffic left it, its reading of the ban feed (`quota::regions`).
struct Every(Duration, Box<dyn Fn() -> Task + Send + Sync>);

type Task = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

fn every<F, T>(interval: Duration, task: F) -> Every
where
    F: Fn() -> T + Send + Sync + 'static,
    T: std::future::Future<Output = ()> + Send + 'static,
{
    Every(interval, Box::new(move || Box::pin(task())))
}

#[async_trait]
impl BackgroundService for Every {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(self.0) => (self.1)().await,
                _ = shutdown.changed() => return,
            }
        }
    }
}

/// Samples the traffic for the console's chart every 5 s.
struct ConsoleHistory(Arc<crate::ops::admin::history::History>);

#[async_trait]
impl BackgroundService for ConsoleHistory {
    async fn start(&self, shutdown: ShutdownWatch) {
        self.0.run(shutdown).await
    }
}

/// Looks the backends given by host name up again on a timer (`upstream_resolve_interval_secs`).
struct NameLookups(Arc<crate::upstream::rotation::Rotation>, Duration);

#[async_trait]
impl BackgroundService for NameLookups {
    async fn start(&self, shutdown: ShutdownWatch) {
        self.0.run_lookups(self.1, shutdown).await
    }
}

/// Renews the concurrency leases of requests that outlive them, until the runtime stops (after
/// the grace period: requests still running then may need it).
struct LeaseRenewals(Arc<crate::quota::concurrency::Slots>);

#[async_trait]
impl BackgroundService for LeaseRenewals {
    async fn start(&self, _shutdown: ShutdownWatch) {
        Arc::clone(&self.0).run_renewals().await
    }
}

/// Connects to Redis once before serving. Settings that cannot work (a wrong password or CA, a
/// master no Sentinel knows, a file that cannot be read) stop the start with an error naming
/// the setting; a Redis that is only unreachable does not: `on_store_error` decides until it
/// answers, as it would for an outage later on.
fn check_redis(redis: &RedisAccess, on_store_error: OnStoreError) -> Result<(), ServeError> {
    match redis.probe_blocking(REDIS_CHECK_TIMEOUT) {
        Ok(()) => {
            tracing::info!(redis = %redis.describe(), "Redis answers");
            Ok(())
        }
        Err(e) if e.is_fatal() => Err(e.into()),
        Err(e) => {
            tracing::warn!(error = %e, redis = %redis.describe(), on_store_error = ?on_store_error,
                "Redis is unreachable at start-up; starting anyway, on_store_error decides until it answers");
            Ok(())
        }
    }
}

fn log_start(config: &Config, catalog: &Catalog, upgrade: bool) {
    let snapshot = catalog.snapshot();
    METRICS.init_plans(snapshot.plans.names());
    tracing::info!(
        environment = %config.environment,
        listen = %config.listen,
        tls = config.tls.is_some(),
        admin_listen = %config.admin_listen,
        upstreams = %config.upstreams.iter().map(|u| u.to_string()).collect::<Vec<_>>().join(", "),
        store = if config.redis_url.is_some() { "redis" } else { "memory" },
        key_prefix = %config.key_prefix,
        keys = snapshot.keys.len(),
        plans = ?snapshot.plans.names(),
        upgrade,
        "pet-gateway starting"
    );
}

fn pingora_server(config: &Config, upgrade: bool) -> Server {
    let conf = ServerConf {
        threads: config.threads,
        work_stealing: config.work_stealing,
        upstream_keepalive_pool_size: config.upstream_keepalive_pool_size,
        grace_period_seconds: Some(config.grace_period_secs),
        graceful_shutdown_timeout_seconds: Some(config.shutdown_timeout_secs),
        upgrade_sock: config.upgrade_sock.to_string_lossy().into_owned(),
        ..ServerConf::default()
    };
    let opt = Opt {
        upgrade,
        ..Opt::default()
    };
    let mut server = Server::new_with_opt_and_conf(opt, conf);
    server.bootstrap();
    server
}

/// The keys: the keys file, or the registry with the keys file as this node's snapshot (then
/// the replica's sync runs as a background service, and its state feeds `/readyz`).
fn key_source(
    config: &Config,
    server: &mut Server,
    catalog: &Arc<Catalog>,
) -> Result<(KeyStore, Option<Arc<SyncState>>), ServeError> {
    let Some(redis) = config.registry_redis() else {
        return Ok((KeyStore::File(config.keys_file.clone()), None));
    };
    let open = |for_changes| {
        open_registry(config, redis, Duration::from_secs(1), for_changes)
            .map(Arc::new)
            .map_err(ServeError::Registry)
    };
    let registry = open(false)?;
    let changes = match config.registry_admin {
        Some(_) => open(true)?,
        None => Arc::clone(&registry),
    };
    let state = Arc::new(SyncState::default());
    if config.keys_file.exists() {
        state.snapshot_only();
        tracing::info!(snapshot = %config.keys_file.display(),
            "key registry: starting from this node's snapshot until the registry answers");
    }
    server.add_service(background_service(
        "key registry",
        RegistrySync(
            Arc::new(crate::keys::replica::Sync {
                registry: Arc::clone(&registry),
                snapshot: config.keys_file.clone(),
                catalog: Arc::clone(catalog),
                state: Arc::clone(&state),
                compare_every: config.registry_compare_interval,
            }),
            drain_window(config),
        ),
    ));
    Ok((KeyStore::Registry(changes), Some(state)))
}

/// The public listener: plain HTTP, or TLS with HTTP/2, each request head under its deadline.
fn proxy_service(
    config: &Config,
    server: &Server,
    gateway: Gateway,
    certs: Option<Arc<CertResolver>>,
) -> Result<Service<HeadDeadline<HttpProxy<Gateway>>>, ServeError> {
    let mut proxy = Service::new(
        "pet-gateway".to_owned(),
        HeadDeadline::new(
            pingora::proxy::http_proxy(&server.configuration, gateway),
            config.request_header_timeout,
        )
        .idle_open_for(drain_window(config)),
    );
    let listen = config.listen.to_string();
    match certs {
        Some(resolver) => {
            let mut tls = TlsSettings::intermediate("", "").map_err(|e| TlsError::Load {
                path: "tls".into(),
                message: e.to_string(),
            })?;
            tls.set_cert_resolver(resolver);
            tls.enable_h2();
            proxy.add_tls_with_settings(&listen, None, tls);
        }
        None => proxy.add_tcp(&listen),
    }
    Ok(proxy)
}

/// Watches the keys file, the plans directory and the certificate (and SIGHUP) and applies
/// edits.
struct Reloader {
    catalog: Arc<Catalog>,
    certs: Option<Arc<CertResolver>>,
    unauth: Arc<UnauthLimiter>,
    resilience: Resilience,
    quota_status: Arc<crate::http::quota_status::QuotaStatus>,
    interval: Duration,
}

fn count_reload(applied: Option<bool>) {
    match applied {
        Some(true) => METRICS.config_reloads.with_label_values(&["applied"]).inc(),
        Some(false) => METRICS.config_reloads.with_label_values(&["refused"]).inc(),
        None => {}
    }
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
                    tracing::info!("SIGHUP: reloading keys, plans and certificate");
                    true
                }
                _ = shutdown.changed() => return,
            };
            let catalog = Arc::clone(&self.catalog);
            let certs = self.certs.clone();
            let reloaded = tokio::task::spawn_blocking(move || {
                catalog.reload(force);
                certs.and_then(|c| c.reload(force))
            })
            .await;
            match reloaded {
                Ok(certs) => count_reload(certs),
                Err(e) => tracing::error!(error = %e, "reload task failed"),
            }
            if last_sweep.elapsed() > Duration::from_secs(60) {
                last_sweep = tokio::time::Instant::now();
                self.unauth.sweep();
                self.quota_status.sweep();
                self.resilience.local.sweep();
                self.resilience
                    .ban_cache
                    .sweep(crate::base::clock::unix_now());
                self.catalog.recount_expiry(crate::base::clock::unix_now());
            }
        }
    }
}

/// The one trial of a half-open breaker: while the breaker is open, runs the probe script
/// (the same kind of work as a request, under the request deadline) every
/// [`PROBE_INTERVAL`], one at a time, on a connection of its own, so no client request waits on
/// a failing store; closes the breaker once the script succeeds. A store that answers `PING`
/// but cannot run scripts or take writes keeps it open: the fallback gauge does not flap.
///
/// While the breaker is closed it keeps this node's ban cache true to the store once a second
/// (one call listing every active ban), so lifts made on other nodes reach it.
struct StoreProbe {
    resilience: Resilience,
    store: Arc<dyn QuotaStore>,
}

const PROBE_INTERVAL: Duration = Duration::from_millis(250);

#[async_trait]
impl BackgroundService for StoreProbe {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let r = &self.resilience;
        let mut last_refresh = tokio::time::Instant::now();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(PROBE_INTERVAL) => {}
                _ = shutdown.changed() => return,
            }
            if r.breaker.is_open() {
                match self.store.probe().await {
                    Ok(()) => {
                        if r.breaker.close() {
                            METRICS.store_fallback.set(0);
                            tracing::info!(
                                "quota store runs scripts again: exact shared counting resumes"
                            );
                        }
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "store probe failed; the breaker stays open")
                    }
                }
            } else if !r.ban_cache.is_empty() && last_refresh.elapsed() >= BAN_RECHECK {
                last_refresh = tokio::time::Instant::now();
                match self.store.bans().await {
                    Ok(active) => r.ban_cache.keep_only(&active),
                    Err(e) => tracing::debug!(error = %e, "cannot refresh the ban cache"),
                }
            }
        }
    }
}

/// Runs the registry sync on a thread of its own (its calls block, with deadlines) until
/// the shutdown's drain window has passed (requests taken meanwhile must see revocations).
struct RegistrySync(Arc<crate::keys::replica::Sync>, Duration);

#[async_trait]
impl BackgroundService for RegistrySync {
    async fn start(&self, shutdown: ShutdownWatch) {
        // Set when this future ends or is dropped: the runtime's end drops it before waiting
        // for the blocking worker (up to `shutdown_timeout_secs`), which must stop by then.
        let stop = StopOnDrop(Arc::new(std::sync::atomic::AtomicBool::new(false)));
        let sync = Arc::clone(&self.0);
        let flag = Arc::clone(&stop.0);
        let worker = tokio::task::spawn_blocking(move || {
            sync.run(&|| flag.load(std::sync::atomic::Ordering::Relaxed))
        });
        draining::drained(shutdown, self.1).await;
        drop(stop);
        let _ = worker.await;
    }
}

/// A stop flag set when dropped.
struct StopOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// What makes and delivers events; stopped in field order: the webhook's thread first (its
/// last POST given a moment), then the pump, whose last round spools the open minute for the
/// next process to deliver.
struct Metering {
    _webhook: Option<DeliveryHandle>,
    _pump: PumpHandle,
}

/// The usage meter the request path counts into, the pump that writes it to the metering file
/// and the webhook's spool, and the thread that posts the spool; none without a sink.
fn metering(config: &Config) -> Result<(Option<Arc<Meter>>, Option<Metering>), ServeError> {
    if config.metering_file.is_none() && config.events_webhook.is_none() {
        return Ok((None, None));
    }
    let file = config.metering_file.clone();
    let spool = config
        .events_webhook
        .as_ref()
        .map(|w| (w.spool_dir.clone(), w.spool_max_bytes));
    // Made once for the thread, and again by a stop that finds the thread held up.
    let make_sinks: pump::MakeSinks = Arc::new(move || {
        let mut sinks = Vec::new();
        if let Some(base) = &file {
            sinks.push(Queue::new(Box::new(FileOutput::new(base))));
        }
        if let Some((dir, max)) = &spool {
            sinks.push(Queue::new(Box::new(SpoolOutput(Spool::new(dir, *max)))));
        }
        sinks
    });
    let meter = Arc::new(Meter::default());
    let origin = Arc::new(Origin::new(&config.environment, &config.node_id));
    let webhook = match &config.events_webhook {
        Some(w) => Some(deliver::start(w, &config.node_id).map_err(ServeError::Webhook)?),
        None => None,
    };
    let pump = pump::start(Arc::clone(&meter), origin, make_sinks).map_err(ServeError::Events)?;
    Ok((
        Some(meter),
        Some(Metering {
            _webhook: webhook,
            _pump: pump,
        }),
    ))
}

/// What the request path takes from the config.
fn gateway_settings(
    config: &Config,
    meter: Option<Arc<Meter>>,
    top: Arc<TopTally>,
    tracing: Option<Arc<Tracing>>,
    draining: Draining,
) -> gateway::Settings {
    gateway::Settings {
        environment: config.environment.clone(),
        upstreams: config.upstreams.clone(),
        upstream_connect_timeout: config.upstream_connect_timeout,
        upstream_read_timeout: config.upstream_read_timeout,
        client_read_timeout: config.client_read_timeout,
        api_key_prefix: config.api_key_prefix.clone(),
        on_store_error: config.on_store_error,
        ban: config.ban.clone(),
        meter,
        top: Some(top),
        places: config.upstream_places,
        priorities: config.upstream_priorities,
        lease_secs: config.concurrency_lease_secs,
        tracing,
        store_kind: if config.redis.is_some() {
            "redis"
        } else {
            "memory"
        },
        store_batched: config.redis.is_some() && config.store_batch_max > 1,
        draining,
    }
}

/// The exporter of traces, when they are on.
fn traces(config: &Config) -> Result<(Option<Arc<Tracing>>, Option<TraceExport>), ServeError> {
    let settings = TraceSettings {
        endpoint: config.tracing_otlp_endpoint.clone(),
        sample_ratio: config.tracing_sample_ratio.0,
        environment: config.environment.clone(),
        node_id: config.node_id.clone(),
    };
    Ok(match crate::base::traces::start(&settings)? {
        Some((tracing, export)) => {
            tracing::info!(
                ratio = config.tracing_sample_ratio.0,
                "traces go to the OTLP collector"
            );
            (Some(tracing), Some(export))
        }
        None => (None, None),
    })
}

/// Where the top consumers' tally is flushed: on Redis a connection of its own, so a flush
/// never queues behind request or admin calls; the embedded store is the admin listener's.
fn top_store(
    config: &Config,
    admin_store: &Arc<dyn QuotaStore>,
) -> Result<Arc<dyn QuotaStore>, ServeError> {
    Ok(match &config.redis {
        Some(redis) => Arc::new(RedisStore::connecting(
            redis.clone(),
            &config.key_prefix,
            Duration::from_millis(500),
        )?),
        None => Arc::clone(admin_store),
    })
}

/// Reports keys whose end is a week or a day away, once across the fleet.
struct ExpiryNotices {
    claimant: String,
    catalog: Arc<Catalog>,
    store: Arc<dyn QuotaStore>,
    meter: Arc<Meter>,
}

#[async_trait]
impl BackgroundService for ExpiryNotices {
    async fn start(&self, shutdown: ShutdownWatch) {
        crate::events::expiring::run(
            self.claimant.clone(),
            Arc::clone(&self.catalog),
            Arc::clone(&self.store),
            Arc::clone(&self.meter),
            shutdown,
        )
        .await
    }
}

/// Writes the top consumers' tally to the store once a second, and once more at a stop, once
/// the shutdown's drain window has passed (the requests taken meanwhile count too).
struct TopFlush {
    tally: Arc<TopTally>,
    store: Arc<dyn QuotaStore>,
    drain: Duration,
}

#[async_trait]
impl BackgroundService for TopFlush {
    async fn start(&self, shutdown: ShutdownWatch) {
        let (stop, stopped) = tokio::sync::watch::channel(false);
        // A request taken on an idle connection at the window's very end is admitted a moment
        // later (its store call's deadline): the last flush comes half a window after.
        let drained = async move {
            draining::drained(shutdown, self.drain + self.drain / 2).await;
            let _ = stop.send(true);
        };
        let (tally, store) = (Arc::clone(&self.tally), Arc::clone(&self.store));
        tokio::join!(drained, crate::quota::top::run_flush(tally, store, stopped));
    }
}

/// How long after the shutdown begins requests on kept-alive connections are still taken.
fn drain_window(config: &Config) -> Duration {
    draining::window(Duration::from_secs(config.grace_period_secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The port probe finds a taken port and accepts no connection while it holds its own: a
    /// listening probe let a client connect to a gateway that was not serving yet.
    #[test]
    fn the_port_probe_finds_a_taken_port_and_accepts_nothing() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        assert!(probe_listen(addr, "listen").is_err(), "a taken port");
        drop(taken);
        let probe = bound(addr).expect("a free port binds");
        let connect = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500));
        assert!(connect.is_err(), "the probe accepted a connection");
        drop(probe);
    }
}
