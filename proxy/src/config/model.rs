//! What the configuration produces: the one [`Config`] the gateway runs from, and the error
//! every layer reports. It imports nothing from the rest of `config`, so the layers, the parts
//! and the merge all build on it without a circle.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::base::redis::RedisAccess;
use crate::quota::admission::OnStoreError;
use crate::quota::rules::BanPolicy;
use crate::quota::unauth::UnauthSettings;

/// Where the API keys live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum KeysSource {
    /// The keys file, edited by the `keys` commands on each node.
    #[default]
    File,
    /// The fleet-wide registry in the quota store's Redis; `keys_file` is then this node's
    /// local snapshot of it.
    Store,
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// For people at a terminal.
    #[default]
    Text,
    /// One JSON object per line, for log pipelines.
    Json,
}

/// The certificate chain and private key (PEM) of the public listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Name of the deployment (`production`, `staging`, `local`), for logs and metrics.
    pub environment: String,
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    /// When set, every admin request must carry it as a bearer token.
    pub admin_token: Option<String>,
    /// Host names the admin listener answers to besides `localhost` and IP addresses.
    pub admin_hosts: Vec<String>,
    pub upstreams: Vec<crate::upstream::names::UpstreamAddr>,
    /// How often backends given by host name are looked up again (zero: only on a failure).
    pub upstream_resolve_interval: std::time::Duration,
    /// Places at each backend, the wait for one, the reserve for critical requests.
    pub upstream_places: crate::upstream::places::PlaceSettings,
    /// Each operation's level when waiting for a place.
    pub upstream_priorities: crate::upstream::priority::Priorities,
    /// How long a concurrency lease lasts unless given back or renewed: the bound on how long a
    /// node that died holds its keys' places.
    pub concurrency_lease_secs: u64,
    /// `None`: the embedded in-process store.
    pub redis_url: Option<String>,
    /// How to reach and log in to the Redis of `redis_url` (`Some` exactly when it is).
    pub redis: Option<RedisAccess>,
    /// The region this node belongs to and the global store (`None`: no regions).
    pub region: Option<Region>,
    /// The credentials key changes write the registry with, apart from the node's own.
    pub registry_admin: Option<crate::base::redis::Credentials>,
    pub key_prefix: String,
    /// What new API keys start with (`pet_live_` in production, else `pet_test_`).
    pub api_key_prefix: String,
    pub keys_source: KeysSource,
    /// Where key changes are logged, one JSON line each; `None`: standard error.
    pub audit_log: Option<PathBuf>,
    pub keys_file: PathBuf,
    /// Public keys every registry record must be signed by; empty: unsigned records are taken.
    pub registry_verify_keys: Vec<String>,
    /// The fleet's signing key, for what changes records from this process.
    pub registry_signing_key_file: Option<PathBuf>,
    /// What this node's signatures are bound to, and whether unbound records are still taken.
    pub registry_signature_binding: crate::keys::signing::BindingMode,
    /// How often the whole registry is compared with this node's replica.
    pub registry_compare_interval: Duration,
    pub plans_dir: PathBuf,
    pub store_timeout: Duration,
    /// The most decisions one Redis script run carries (group commit); 1: one run each.
    pub store_batch_max: usize,
    pub on_store_error: OnStoreError,
    /// Worker threads of the proxy.
    pub threads: usize,
    /// Whether idle proxy threads take tasks queued on busy ones (pingora's work stealing).
    pub work_stealing: bool,
    /// Idle connections to the backends kept for reuse, in all.
    pub upstream_keepalive_pool_size: usize,
    /// The limit on requests with a missing or invalid key: per minute, per client (an IPv4
    /// address or an IPv6 network), how many clients are tracked, and which peers' `X-Forwarded-For`
    /// is believed.
    pub unauthenticated: UnauthSettings,
    /// The whole request head (request line and headers) must arrive within this, however it
    /// trickles in; otherwise the connection is closed.
    pub request_header_timeout: Duration,
    pub ban: BanPolicy,
    pub upstream_connect_timeout: Duration,
    pub upstream_read_timeout: Duration,
    /// How long a client may stall while sending a request body before it is cut off (408).
    pub client_read_timeout: Duration,
    /// How often the keys file, plans directory and certificate are checked for edits.
    pub reload_interval: Duration,
    /// `Some`: the public listener speaks TLS (HTTP/2 and HTTP/1.1); `None`: plain HTTP.
    pub tls: Option<TlsFiles>,
    pub log_format: LogFormat,
    /// The OTLP collector's traces URL; `None`: the SDK's variables, or no traces.
    pub tracing_otlp_endpoint: Option<String>,
    pub tracing_sample_ratio: SampleRatio,
    /// After SIGTERM (or SIGQUIT, handing over to a successor) the listeners close at once and
    /// in-flight requests get this long to finish; pingora then stops, so it should cover the
    /// upstream read timeout.
    pub grace_period_secs: u64,
    pub shutdown_timeout_secs: u64,
    /// Where a running gateway hands its sockets to its successor (`serve --upgrade`).
    pub upgrade_sock: PathBuf,
    /// This node's name in its events.
    pub node_id: String,
    /// Where usage events go (`<metering_file>.YYYY-MM-DD`); none without it.
    pub metering_file: Option<PathBuf>,
    /// Where events are POSTed, signed and spooled; none without `events_webhook_url`.
    pub events_webhook: Option<crate::events::webhook::Webhook>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{source_name}: {message}")]
    Invalid {
        /// The file, "command line", "environment" or "built-in default".
        source_name: String,
        message: String,
    },
}

/// `tracing_sample_ratio`: a share from 0 to 1, never NaN (so equal to itself, as the config's
/// comparisons need).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleRatio(pub f64);

impl Eq for SampleRatio {}

/// A node of a region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Region {
    pub name: String,
    /// The global store: `global_store_url` with `redis_url`'s credentials and TLS files.
    pub global: RedisAccess,
    pub replicas: u32,
}
