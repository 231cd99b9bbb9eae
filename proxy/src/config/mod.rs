//! One internal [`Config`], produced from three layers with a stated precedence:
//! command-line flags > environment variables > the config file > built-in defaults.
//!
//! `load` = read each layer ([`file`], [`flags`]: flags and environment) into a [`Layer`] →
//! merge them, each value remembering the layer it came from ([`Sourced`]) → validate into
//! [`Config`]. Every error names the layer that really supplied the bad value: the file and its
//! field, the flag, or the environment variable. Adding a setting costs one line per layer and
//! one in [`validate`].
//!
//! Relative paths in a config file are relative to that file's directory, so a config works
//! from wherever the gateway is started; relative paths from flags or the environment are
//! relative to the working directory, as on any command line.

mod file;
mod flags;

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

pub use self::flags::{Env, Overrides};
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
    pub upstreams: Vec<SocketAddr>,
    /// `None`: the embedded in-process store.
    pub redis_url: Option<String>,
    pub key_prefix: String,
    /// What new API keys start with (`pet_live_` in production, else `pet_test_`).
    pub api_key_prefix: String,
    pub keys_source: KeysSource,
    /// Where key changes are logged, one JSON line each; `None`: standard error.
    pub audit_log: Option<PathBuf>,
    pub keys_file: PathBuf,
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
    /// After SIGTERM (or SIGQUIT, handing over to a successor) the listeners close at once and
    /// in-flight requests get this long to finish; pingora then stops, so it should cover the
    /// upstream read timeout.
    pub grace_period_secs: u64,
    pub shutdown_timeout_secs: u64,
    /// Where a running gateway hands its sockets to its successor (`serve --upgrade`).
    pub upgrade_sock: PathBuf,
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

/// One layer's settings: `Some` where that layer gives a value. Every layer produces this one
/// shape, so merging is the same for all of them.
#[derive(Debug, Clone, Default)]
pub struct Layer {
    pub environment: Option<String>,
    pub listen: Option<String>,
    pub admin_listen: Option<String>,
    pub admin_token: Option<String>,
    pub upstreams: Option<Vec<String>>,
    pub redis_url: Option<String>,
    pub key_prefix: Option<String>,
    pub api_key_prefix: Option<String>,
    pub keys_source: Option<KeysSource>,
    pub audit_log: Option<PathBuf>,
    pub keys_file: Option<PathBuf>,
    pub plans_dir: Option<PathBuf>,
    pub store_timeout_ms: Option<u64>,
    pub store_batch_max: Option<usize>,
    pub on_store_error: Option<OnStoreError>,
    pub threads: Option<usize>,
    pub work_stealing: Option<bool>,
    pub upstream_keepalive_pool_size: Option<usize>,
    pub unauthenticated_per_minute: Option<u32>,
    pub unauthenticated_ipv6_prefix: Option<u8>,
    pub unauthenticated_max_tracked: Option<usize>,
    pub trusted_proxies: Option<Vec<String>>,
    pub request_header_timeout_ms: Option<u64>,
    pub upstream_connect_timeout_ms: Option<u64>,
    pub upstream_read_timeout_ms: Option<u64>,
    pub client_read_timeout_ms: Option<u64>,
    pub reload_interval_ms: Option<u64>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub log_format: Option<LogFormat>,
    pub grace_period_secs: Option<u64>,
    pub shutdown_timeout_secs: Option<u64>,
    pub upgrade_sock: Option<PathBuf>,
    pub ban_strikes: Option<u64>,
    pub ban_durations_secs: Option<Vec<u64>>,
    pub ban_decay_secs: Option<u64>,
}

/// A setting's names in each layer.
#[derive(Debug)]
pub struct Setting {
    /// The file's key (`ban.strikes` for a table's field).
    file: &'static str,
    flag: Option<&'static str>,
    env: Option<&'static str>,
}

impl Setting {
    const fn file_only(file: &'static str) -> Setting {
        Setting {
            file,
            flag: None,
            env: None,
        }
    }

    /// In the file or the environment, never a flag (a flag shows in `ps`).
    const fn secret(file: &'static str, env: &'static str) -> Setting {
        Setting {
            file,
            flag: None,
            env: Some(env),
        }
    }

    const fn overridable(file: &'static str, flag: &'static str, env: &'static str) -> Setting {
        Setting {
            file,
            flag: Some(flag),
            env: Some(env),
        }
    }

    fn invalid_env(&self, message: String) -> ConfigError {
        Origin::Env(self.env.unwrap_or("?")).error(self, message)
    }
}

const ENVIRONMENT: Setting = Setting::file_only("environment");
const LISTEN: Setting = Setting::overridable("listen", "--listen", "PET_GATEWAY_LISTEN");
const ADMIN_LISTEN: Setting =
    Setting::overridable("admin_listen", "--admin-listen", "PET_GATEWAY_ADMIN_LISTEN");
const ADMIN_TOKEN: Setting = Setting::secret("admin_token", "PET_GATEWAY_ADMIN_TOKEN");
const UPSTREAMS: Setting = Setting::overridable("upstreams", "--upstream", "PET_GATEWAY_UPSTREAM");
const REDIS_URL: Setting =
    Setting::overridable("redis_url", "--redis-url", "PET_GATEWAY_REDIS_URL");
const KEY_PREFIX: Setting =
    Setting::overridable("key_prefix", "--key-prefix", "PET_GATEWAY_KEY_PREFIX");
const API_KEY_PREFIX: Setting = Setting::file_only("api_key_prefix");
const KEYS_SOURCE: Setting =
    Setting::overridable("keys_source", "--keys-source", "PET_GATEWAY_KEYS_SOURCE");
const AUDIT_LOG: Setting =
    Setting::overridable("audit_log", "--audit-log", "PET_GATEWAY_AUDIT_LOG");
const KEYS_FILE: Setting =
    Setting::overridable("keys_file", "--keys-file", "PET_GATEWAY_KEYS_FILE");
const PLANS_DIR: Setting =
    Setting::overridable("plans_dir", "--plans-dir", "PET_GATEWAY_PLANS_DIR");
const STORE_TIMEOUT_MS: Setting = Setting::file_only("store_timeout_ms");
const STORE_BATCH_MAX: Setting = Setting::file_only("store_batch_max");
const ON_STORE_ERROR: Setting = Setting::overridable(
    "on_store_error",
    "--on-store-error",
    "PET_GATEWAY_ON_STORE_ERROR",
);
const THREADS: Setting = Setting::file_only("threads");
const WORK_STEALING: Setting = Setting::file_only("work_stealing");
const UPSTREAM_KEEPALIVE_POOL_SIZE: Setting = Setting::file_only("upstream_keepalive_pool_size");
const UNAUTHENTICATED_PER_MINUTE: Setting = Setting::file_only("unauthenticated_per_minute");
const UNAUTHENTICATED_IPV6_PREFIX: Setting = Setting::file_only("unauthenticated_ipv6_prefix");
const UNAUTHENTICATED_MAX_TRACKED: Setting = Setting::file_only("unauthenticated_max_tracked");
const TRUSTED_PROXIES: Setting = Setting::file_only("trusted_proxies");
const REQUEST_HEADER_TIMEOUT_MS: Setting = Setting::file_only("request_header_timeout_ms");
const UPSTREAM_CONNECT_TIMEOUT_MS: Setting = Setting::file_only("upstream_connect_timeout_ms");
const UPSTREAM_READ_TIMEOUT_MS: Setting = Setting::file_only("upstream_read_timeout_ms");
const CLIENT_READ_TIMEOUT_MS: Setting = Setting::file_only("client_read_timeout_ms");
const RELOAD_INTERVAL_MS: Setting = Setting::file_only("reload_interval_ms");
const TLS_CERT: Setting = Setting::overridable("tls_cert", "--tls-cert", "PET_GATEWAY_TLS_CERT");
const TLS_KEY: Setting = Setting::overridable("tls_key", "--tls-key", "PET_GATEWAY_TLS_KEY");
const LOG_FORMAT: Setting =
    Setting::overridable("log_format", "--log-format", "PET_GATEWAY_LOG_FORMAT");
const GRACE_PERIOD_SECS: Setting = Setting::file_only("grace_period_secs");
const SHUTDOWN_TIMEOUT_SECS: Setting = Setting::file_only("shutdown_timeout_secs");
const UPGRADE_SOCK: Setting = Setting::file_only("upgrade_sock");
const BAN_STRIKES: Setting = Setting::file_only("ban.strikes");
const BAN_DURATIONS_SECS: Setting = Setting::file_only("ban.durations_secs");
const BAN_DECAY_SECS: Setting = Setting::file_only("ban.decay_secs");

/// Which layer gave a value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Default,
    File(PathBuf),
    Env(&'static str),
    Flag(&'static str),
}

impl Origin {
    /// An error about `setting`'s value, naming where that value came from.
    fn error(&self, setting: &Setting, message: String) -> ConfigError {
        let (source_name, name) = match self {
            Origin::Default => ("built-in default".to_owned(), format!("`{}`", setting.file)),
            Origin::File(path) => (
                path.display().to_string(),
                format!("field `{}`", setting.file),
            ),
            Origin::Env(var) => ("environment".to_owned(), (*var).to_owned()),
            Origin::Flag(flag) => ("command line".to_owned(), (*flag).to_owned()),
        };
        ConfigError::Invalid {
            source_name,
            message: format!("{name}: {message}"),
        }
    }
}

/// A value and the layer it came from.
#[derive(Debug, Clone)]
pub struct Sourced<T> {
    pub value: T,
    pub origin: Origin,
    setting: &'static Setting,
}

impl<T> Sourced<T> {
    /// Checks or converts the value; an error names the layer that gave it.
    fn parse<U>(self, f: impl FnOnce(T) -> Result<U, String>) -> Result<U, ConfigError> {
        f(self.value).map_err(|m| self.origin.error(self.setting, m))
    }

    fn error(&self, message: String) -> ConfigError {
        self.origin.error(self.setting, message)
    }
}

/// The layers, highest precedence first.
struct Layers {
    flags: Layer,
    env: Layer,
    file: Layer,
    file_path: Option<PathBuf>,
}

impl Layers {
    /// The value of the highest layer that gives one.
    fn get<T: Clone>(
        &self,
        setting: &'static Setting,
        field: fn(&Layer) -> &Option<T>,
    ) -> Option<Sourced<T>> {
        let sourced = |value: &T, origin| {
            Some(Sourced {
                value: value.clone(),
                origin,
                setting,
            })
        };
        if let (Some(v), Some(flag)) = (field(&self.flags), setting.flag) {
            return sourced(v, Origin::Flag(flag));
        }
        if let (Some(v), Some(var)) = (field(&self.env), setting.env) {
            return sourced(v, Origin::Env(var));
        }
        match (field(&self.file), &self.file_path) {
            (Some(v), Some(path)) => sourced(v, Origin::File(path.clone())),
            _ => None,
        }
    }

    /// The value of the highest layer that gives one, else `default`.
    fn or<T: Clone>(
        &self,
        setting: &'static Setting,
        field: fn(&Layer) -> &Option<T>,
        default: T,
    ) -> Sourced<T> {
        self.get(setting, field).unwrap_or(Sourced {
            value: default,
            origin: Origin::Default,
            setting,
        })
    }
}

impl Config {
    /// Reads `file` (if any), the environment and the flags, merges them and validates the
    /// result.
    pub fn load(file: Option<&Path>, env: &Env, flags: &Overrides) -> Result<Config, ConfigError> {
        let flags = flags.layer();
        let layers = Layers {
            env: env.layer(&flags)?,
            flags,
            file: match file {
                Some(path) => file::read(path)?,
                None => Layer::default(),
            },
            file_path: file.map(Path::to_owned),
        };
        validate(&layers)
    }
}

impl Config {
    /// Settings that load but are probably a mistake in this environment; `check` prints them
    /// and `serve` logs them at start-up.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        for net in &self.unauthenticated.trusted_proxies {
            if net.prefix_len() == 0 {
                warnings.push(format!(
                    "trusted_proxies holds `{net}`: every peer is trusted, so any client can \
                     choose the address it is limited as with X-Forwarded-For"
                ));
            }
        }
        if self.environment != "production" {
            return warnings;
        }
        match &self.redis_url {
            None => warnings.push(
                "environment `production` uses the embedded store: every gateway node counts \
                 on its own, so a fleet of N nodes admits N times each quota; set `redis_url` \
                 to the Redis all nodes share"
                    .to_owned(),
            ),
            Some(url) => {
                let loopback: Vec<String> = url
                    .split(',')
                    .filter_map(redis_host)
                    .filter(|h| is_loopback(h))
                    .collect();
                if !loopback.is_empty() {
                    warnings.push(format!(
                        "environment `production` uses a loopback Redis ({}): each node would \
                         count in a Redis of its own, so a fleet of N nodes admits N times each \
                         quota; name the Redis host all nodes share",
                        loopback.join(", ")
                    ));
                }
            }
        }
        warnings
    }
}

/// The host of one Redis URL (or one `host:port` of a `redis+cluster://` list).
fn redis_host(url: &str) -> Option<String> {
    let url = url.trim();
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let authority = rest.split('/').next()?;
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next()?,
        None => authority.split(':').next()?,
    };
    (!host.is_empty()).then(|| host.to_owned())
}

fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn at_least_one<T: PartialEq + From<u8>>(v: T) -> Result<T, String> {
    if v == T::from(0) {
        Err("must be at least 1".into())
    } else {
        Ok(v)
    }
}

/// A script run blocks the Redis it runs on; past this many decisions one run would hold it for
/// milliseconds, delaying every other client.
const MAX_STORE_BATCH: usize = 1024;

fn millis(v: u64) -> Result<Duration, String> {
    at_least_one(v).map(Duration::from_millis)
}

/// Turns the merged layers into a [`Config`], one setting at a time.
fn validate(l: &Layers) -> Result<Config, ConfigError> {
    let environment = l
        .or(&ENVIRONMENT, |l| &l.environment, "local".into())
        .parse(|e| {
            if e.is_empty() {
                Err("must not be empty".to_owned())
            } else {
                Ok(e)
            }
        })?;
    let listen = l
        .or(&LISTEN, |l| &l.listen, "127.0.0.1:8080".into())
        .parse(|v| socket_addr(&v))?;
    let admin_listen = l
        .or(&ADMIN_LISTEN, |l| &l.admin_listen, "127.0.0.1:9090".into())
        .parse(|v| socket_addr(&v))?;
    let admin_token = l
        .get(&ADMIN_TOKEN, |l| &l.admin_token)
        .map(|t| {
            t.parse(|t| {
                // What a bearer token may hold (RFC 6750 token68), or no request could match.
                let body = t.trim_end_matches('=');
                let token68 = !body.is_empty()
                    && body.bytes().all(|b| {
                        b.is_ascii_alphanumeric()
                            || matches!(b, b'-' | b'.' | b'_' | b'~' | b'+' | b'/')
                    });
                let distinct = t.bytes().collect::<std::collections::HashSet<u8>>().len();
                if (16..=crate::http::auth::MAX_TOKEN_LEN).contains(&t.len())
                    && token68
                    && distinct >= 8
                {
                    Ok(t)
                } else {
                    Err(
                        "must be 16 to 256 of A-Z, a-z, 0-9, `-._~+/` (then any `=`), not a \
                         repeated pattern (`openssl rand -base64 32`)"
                            .to_owned(),
                    )
                }
            })
        })
        .transpose()?;
    if admin_token.is_none() && !admin_listen.ip().is_loopback() {
        return Err(l
            .or(&ADMIN_LISTEN, |l| &l.admin_listen, String::new())
            .error(format!(
                "{admin_listen} is reachable from other hosts: set admin_token (in the file or \
             PET_GATEWAY_ADMIN_TOKEN), which every admin request must then carry, or listen \
             on loopback"
            )));
    }
    let upstreams = l
        .or(&UPSTREAMS, |l| &l.upstreams, vec!["127.0.0.1:8081".into()])
        .parse(|list| {
            if list.is_empty() {
                return Err("needs at least one backend address".to_owned());
            }
            list.iter().map(|u| socket_addr(u)).collect()
        })?;
    let redis_url = match l.get(&REDIS_URL, |l| &l.redis_url) {
        Some(url) if !url.value.trim().is_empty() => Some(url.parse(|u| {
            crate::base::redis::RedisTarget::parse(&u)
                .map(|_| u)
                .map_err(|e| format!("not a usable Redis URL: {e}"))
        })?),
        _ => None,
    };
    let key_prefix = l
        .or(&KEY_PREFIX, |l| &l.key_prefix, format!("pet:{environment}"))
        .parse(|p| {
            if p.is_empty() || p.contains(['{', '}']) {
                Err(
                    "must be non-empty and free of '{' and '}' (they are the Redis hash tag)"
                        .to_owned(),
                )
            } else {
                Ok(p)
            }
        })?;
    let api_key_prefix = l
        .or(
            &API_KEY_PREFIX,
            |l| &l.api_key_prefix,
            crate::keys::format::default_prefix(&environment).to_owned(),
        )
        .parse(|p| {
            if crate::keys::format::valid_prefix(&p) {
                Ok(p)
            } else {
                Err("must be 2 to 16 of a-z, 0-9 and '_', ending in '_' (`acme_`)".to_owned())
            }
        })?;
    let keys_source = l.or(&KEYS_SOURCE, |l| &l.keys_source, KeysSource::File);
    if keys_source.value == KeysSource::Store && redis_url.is_none() {
        return Err(keys_source
            .error("`store` keeps the keys in the quota store's Redis: set redis_url too".into()));
    }
    let keys_source = keys_source.value;
    let keys_file = l.or(&KEYS_FILE, |l| &l.keys_file, default_path(l, "keys.toml"));
    let plans_dir = l.or(&PLANS_DIR, |l| &l.plans_dir, default_path(l, "plans"));
    let threads = l
        .get(&THREADS, |l| &l.threads)
        .map(|t| t.parse(at_least_one))
        .transpose()?
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2)
        });

    let defaults = BanPolicy::default();
    let ban = BanPolicy {
        strikes: l
            .or(&BAN_STRIKES, |l| &l.ban_strikes, defaults.strikes)
            .value,
        durations: l
            .or(
                &BAN_DURATIONS_SECS,
                |l| &l.ban_durations_secs,
                defaults.durations,
            )
            .parse(|d| {
                if d.is_empty() || d.contains(&0) {
                    Err("needs at least one duration, each at least 1 second".to_owned())
                } else {
                    Ok(d)
                }
            })?,
        decay_secs: l
            .or(&BAN_DECAY_SECS, |l| &l.ban_decay_secs, defaults.decay_secs)
            .value,
    };

    let tls = match (
        l.get(&TLS_CERT, |l| &l.tls_cert),
        l.get(&TLS_KEY, |l| &l.tls_key),
    ) {
        (Some(cert), Some(key)) => Some(TlsFiles {
            cert: cert.value,
            key: key.value,
        }),
        (None, None) => None,
        (Some(given), None) | (None, Some(given)) => {
            return Err(given.error(
                "tls_cert and tls_key go together: give both (TLS) or neither (plain HTTP)".into(),
            ))
        }
    };

    // One per environment and port, so gateways on one host never take each other's sockets.
    let upgrade_sock = l
        .or(
            &UPGRADE_SOCK,
            |l| &l.upgrade_sock,
            PathBuf::from(format!(
                "/tmp/pet-gateway-{environment}-{}.sock",
                listen.port()
            )),
        )
        .value;

    Ok(Config {
        listen,
        admin_listen,
        admin_token,
        upstreams,
        redis_url,
        key_prefix,
        api_key_prefix,
        keys_source,
        audit_log: l
            .get(&AUDIT_LOG, |l| &l.audit_log)
            .map(|s| s.value)
            .filter(|p| !p.as_os_str().is_empty()),
        keys_file: keys_file.value,
        plans_dir: plans_dir.value,
        store_timeout: l
            .or(&STORE_TIMEOUT_MS, |l| &l.store_timeout_ms, 50)
            .parse(millis)?,
        store_batch_max: l
            .or(
                &STORE_BATCH_MAX,
                |l| &l.store_batch_max,
                crate::quota::store::redis::DEFAULT_BATCH_MAX,
            )
            .parse(|n| {
                if (1..=MAX_STORE_BATCH).contains(&n) {
                    Ok(n)
                } else {
                    Err(format!("must be from 1 to {MAX_STORE_BATCH}"))
                }
            })?,
        on_store_error: l
            .or(&ON_STORE_ERROR, |l| &l.on_store_error, OnStoreError::Local)
            .value,
        threads,
        // Off by default: measured cheaper per request (bench/RESULTS.md).
        work_stealing: l.or(&WORK_STEALING, |l| &l.work_stealing, false).value,
        upstream_keepalive_pool_size: l
            .or(
                &UPSTREAM_KEEPALIVE_POOL_SIZE,
                |l| &l.upstream_keepalive_pool_size,
                128,
            )
            .parse(at_least_one)?,
        unauthenticated: UnauthSettings {
            per_minute: l
                .or(
                    &UNAUTHENTICATED_PER_MINUTE,
                    |l| &l.unauthenticated_per_minute,
                    60,
                )
                .parse(at_least_one)?,
            ipv6_prefix: l
                .or(
                    &UNAUTHENTICATED_IPV6_PREFIX,
                    |l| &l.unauthenticated_ipv6_prefix,
                    64,
                )
                .parse(|p| {
                    if (1..=128).contains(&p) {
                        Ok(p)
                    } else {
                        Err(format!("must be 1 to 128 bits (got {p})"))
                    }
                })?,
            max_tracked: l
                .or(
                    &UNAUTHENTICATED_MAX_TRACKED,
                    |l| &l.unauthenticated_max_tracked,
                    100_000,
                )
                .parse(|n| {
                    if n >= 16 {
                        Ok(n)
                    } else {
                        Err(format!("must be at least 16 (got {n})"))
                    }
                })?,
            trusted_proxies: l
                .or(&TRUSTED_PROXIES, |l| &l.trusted_proxies, Vec::new())
                .parse(|list| list.iter().map(|n| parse_net(n)).collect())?,
        },
        request_header_timeout: l
            .or(
                &REQUEST_HEADER_TIMEOUT_MS,
                |l| &l.request_header_timeout_ms,
                10_000,
            )
            .parse(millis)?,
        ban,
        upstream_connect_timeout: l
            .or(
                &UPSTREAM_CONNECT_TIMEOUT_MS,
                |l| &l.upstream_connect_timeout_ms,
                1_000,
            )
            .parse(millis)?,
        upstream_read_timeout: l
            .or(
                &UPSTREAM_READ_TIMEOUT_MS,
                |l| &l.upstream_read_timeout_ms,
                10_000,
            )
            .parse(millis)?,
        client_read_timeout: l
            .or(
                &CLIENT_READ_TIMEOUT_MS,
                |l| &l.client_read_timeout_ms,
                10_000,
            )
            .parse(millis)?,
        reload_interval: l
            .or(&RELOAD_INTERVAL_MS, |l| &l.reload_interval_ms, 500)
            .parse(millis)?,
        tls,
        log_format: l
            .or(&LOG_FORMAT, |l| &l.log_format, LogFormat::default())
            .value,
        grace_period_secs: l.or(&GRACE_PERIOD_SECS, |l| &l.grace_period_secs, 10).value,
        shutdown_timeout_secs: l
            .or(&SHUTDOWN_TIMEOUT_SECS, |l| &l.shutdown_timeout_secs, 30)
            .value,
        upgrade_sock,
        environment,
    })
}

/// `10.0.0.0/8`, `2001:db8::/32`, or one address (`10.1.2.3`, a /32 or /128).
fn parse_net(text: &str) -> Result<ipnet::IpNet, String> {
    let text = text.trim();
    text.parse::<ipnet::IpNet>()
        .or_else(|_| text.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
        .map_err(|_| format!("`{text}` is not an address or a network (`10.0.0.0/8`)"))
}

/// A default path sits beside the config file, like the file's own relative paths.
fn default_path(l: &Layers, name: &str) -> PathBuf {
    l.file_path
        .as_deref()
        .and_then(Path::parent)
        .map_or_else(|| PathBuf::from(name), |dir| dir.join(name))
}

/// `host:port`, resolved once at start-up.
fn socket_addr(s: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = s.parse() {
        return Ok(addr);
    }
    s.to_socket_addrs()
        .map_err(|e| format!("`{s}` is not a host:port address: {e}"))?
        .next()
        .ok_or_else(|| format!("`{s}` resolves to no address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, text: &str) -> PathBuf {
        let path = dir.join("gw.toml");
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn defaults_without_a_file() {
        let c = Config::load(None, &Env::default(), &Overrides::default()).unwrap();
        assert_eq!(c.listen, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(c.upstreams, ["127.0.0.1:8081".parse().unwrap()]);
        assert_eq!(c.redis_url, None);
        assert_eq!(c.key_prefix, "pet:local");
        assert_eq!(c.on_store_error, OnStoreError::Local);
        assert_eq!(c.store_timeout, Duration::from_millis(50));
        assert_eq!(c.ban, BanPolicy::default());
        assert!(!c.work_stealing);
        assert_eq!(c.upstream_keepalive_pool_size, 128);
        assert_eq!(c.store_batch_max, 128);
        assert_eq!(c.keys_source, KeysSource::File);
        assert_eq!(c.request_header_timeout, Duration::from_secs(10));
    }

    #[test]
    fn pingora_runtime_settings_come_from_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(
            dir.path(),
            "work_stealing = true
upstream_keepalive_pool_size = 16
",
        );
        let c = Config::load(Some(&path), &Env::default(), &Overrides::default()).unwrap();
        assert!(c.work_stealing);
        assert_eq!(c.upstream_keepalive_pool_size, 16);
        let path = write(
            dir.path(),
            "upstream_keepalive_pool_size = 0
",
        );
        let e = Config::load(Some(&path), &Env::default(), &Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("upstream_keepalive_pool_size"), "{e}");
    }

    #[test]
    fn flags_and_environment_override_the_file_whose_paths_are_relative_to_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(
            dir.path(),
            "environment = \"staging\"\nlisten = \"127.0.0.1:7000\"\nupstreams = [\"127.0.0.1:7001\"]\n\
             keys_file = \"k.toml\"\nplans_dir = \"/etc/plans\"\nredis_url = \"redis://127.0.0.1:6379\"\n",
        );
        let c = Config::load(Some(&path), &Env::default(), &Overrides::default()).unwrap();
        assert_eq!(c.listen.port(), 7000);
        assert_eq!(c.keys_file, dir.path().join("k.toml"));
        assert_eq!(c.plans_dir, PathBuf::from("/etc/plans"));
        assert_eq!(c.key_prefix, "pet:staging");

        let over = Overrides {
            listen: Some("127.0.0.1:7100".into()),
            upstreams: vec!["127.0.0.1:7101".into(), "127.0.0.1:7102".into()],
            redis_url: Some(String::new()),
            keys_file: Some("mine.toml".into()),
            ..Overrides::default()
        };
        let c = Config::load(Some(&path), &Env::default(), &over).unwrap();
        assert_eq!(c.listen.port(), 7100);
        assert_eq!(c.upstreams.len(), 2);
        assert_eq!(
            c.redis_url, None,
            "an empty --redis-url selects the embedded store"
        );
        assert_eq!(c.keys_file, PathBuf::from("mine.toml"));
    }

    #[test]
    fn errors_name_the_file_and_the_field() {
        let dir = tempfile::tempdir().unwrap();
        for (text, field) in [
            ("listen = \"nowhere\"", "`listen`"),
            ("upstreams = []", "`upstreams`"),
            ("store_timeout_ms = 0", "`store_timeout_ms`"),
            ("store_batch_max = 0", "`store_batch_max`"),
            ("store_batch_max = 5000", "`store_batch_max`"),
            ("[ban]\ndurations_secs = []", "`ban.durations_secs`"),
            ("on_store_error = \"maybe\"", "on_store_error"),
            ("listne = \"127.0.0.1:1\"", "listne"),
            ("key_prefix = \"a{b}\"", "`key_prefix`"),
        ] {
            let path = write(dir.path(), text);
            let message = Config::load(Some(&path), &Env::default(), &Overrides::default())
                .unwrap_err()
                .to_string();
            assert!(message.contains("gw.toml"), "{message}");
            assert!(message.contains(field), "{text}: {message}");
        }
    }

    #[test]
    fn errors_name_the_layer_that_really_supplied_the_value() {
        let dir = tempfile::tempdir().unwrap();
        // The file is fine; the bad value comes from above it.
        let path = write(
            dir.path(),
            "key_prefix = \"pet:ok\"\nlisten = \"127.0.0.1:7000\"\n",
        );
        let load = |env: &[(&str, &str)], over: Overrides| {
            Config::load(Some(&path), &Env::from_pairs(env.iter().copied()), &over)
                .unwrap_err()
                .to_string()
        };
        let flag = |key_prefix: &str| Overrides {
            key_prefix: Some(key_prefix.into()),
            ..Overrides::default()
        };

        let m = load(&[], flag("a{b}"));
        assert!(m.starts_with("command line: --key-prefix:"), "{m}");
        let m = load(&[("PET_GATEWAY_KEY_PREFIX", "a{b}")], Overrides::default());
        assert!(m.starts_with("environment: PET_GATEWAY_KEY_PREFIX:"), "{m}");
        // A flag beats the environment, so the flag's bad value is the one blamed.
        let m = load(&[("PET_GATEWAY_KEY_PREFIX", "fine")], flag("x}"));
        assert!(
            m.contains("--key-prefix") && !m.contains("PET_GATEWAY"),
            "{m}"
        );

        let cert_only = Overrides {
            tls_cert: Some("cert.pem".into()),
            ..Overrides::default()
        };
        let m = load(&[], cert_only);
        assert!(m.starts_with("command line: --tls-cert:"), "{m}");
        let m = load(&[("PET_GATEWAY_TLS_KEY", "key.pem")], Overrides::default());
        assert!(m.starts_with("environment: PET_GATEWAY_TLS_KEY:"), "{m}");
        let m = load(
            &[("PET_GATEWAY_ON_STORE_ERROR", "maybe")],
            Overrides::default(),
        );
        assert!(
            m.starts_with("environment: PET_GATEWAY_ON_STORE_ERROR:") && m.contains("closed"),
            "{m}"
        );
        let m = load(
            &[("PET_GATEWAY_UPSTREAM", "127.0.0.1:1,nowhere")],
            Overrides::default(),
        );
        assert!(m.starts_with("environment: PET_GATEWAY_UPSTREAM:"), "{m}");

        // Still the file when the file gave it.
        let bad_file = write(dir.path(), "tls_key = \"k.pem\"\n");
        let m = Config::load(Some(&bad_file), &Env::default(), &Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(m.contains("gw.toml: field `tls_key`"), "{m}");
    }

    #[test]
    fn the_environment_sits_between_the_file_and_the_flags() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(
            dir.path(),
            "listen = \"127.0.0.1:7000\"\nlog_format = \"text\"\n",
        );
        let env = Env::from_pairs([
            ("PET_GATEWAY_LISTEN", "127.0.0.1:7001"),
            ("PET_GATEWAY_LOG_FORMAT", "json"),
            ("PET_GATEWAY_REDIS_URL", ""),
        ]);
        let c = Config::load(Some(&path), &env, &Overrides::default()).unwrap();
        assert_eq!((c.listen.port(), c.log_format), (7001, LogFormat::Json));
        assert_eq!(c.redis_url, None);
        let over = Overrides {
            listen: Some("127.0.0.1:7002".into()),
            ..Overrides::default()
        };
        assert_eq!(
            Config::load(Some(&path), &env, &over)
                .unwrap()
                .listen
                .port(),
            7002
        );
    }

    #[test]
    fn production_on_a_loopback_or_embedded_store_is_warned_about() {
        let dir = tempfile::tempdir().unwrap();
        let warn = |text: &str| {
            let path = write(dir.path(), text);
            Config::load(Some(&path), &Env::default(), &Overrides::default())
                .unwrap()
                .warnings()
        };
        for url in [
            "redis://127.0.0.1:6379/0",
            "redis://:secret@localhost/0",
            "redis://[::1]:6379",
            "redis+cluster://10.0.0.5:7000,127.0.0.2:7001",
        ] {
            let w = warn(&format!(
                "environment = \"production\"\nredis_url = \"{url}\"\n"
            ));
            assert!(w.len() == 1 && w[0].contains("loopback"), "{url}: {w:?}");
        }
        assert!(warn("environment = \"production\"\n")[0].contains("embedded"));
        assert!(warn(
            "environment = \"production\"\nredis_url = \"redis://redis.pet.internal:6379/0\"\n"
        )
        .is_empty());
        assert!(warn("environment = \"staging\"\nredis_url = \"redis://127.0.0.1\"\n").is_empty());
    }

    #[test]
    fn a_flag_makes_a_bad_variable_of_the_same_setting_irrelevant_and_choices_are_exact() {
        let env = Env::from_pairs([("PET_GATEWAY_ON_STORE_ERROR", "bogus")]);
        let over = Overrides {
            on_store_error: Some(OnStoreError::Closed),
            ..Overrides::default()
        };
        let c = Config::load(None, &env, &over).unwrap();
        assert_eq!(c.on_store_error, OnStoreError::Closed);
        let upper = Env::from_pairs([("PET_GATEWAY_ON_STORE_ERROR", "Closed")]);
        assert!(Config::load(None, &upper, &Overrides::default()).is_err());
        let unrelated =
            Env::from_pairs([("PET_GATEWAY_LISTEN", "nowhere")]).only(&["PET_GATEWAY_KEYS_FILE"]);
        assert!(Config::load(None, &unrelated, &Overrides::default()).is_ok());
    }
}
