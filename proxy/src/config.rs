//! One internal [`Config`], produced from three layers with a stated precedence:
//! command-line flags > environment variables > the config file > built-in defaults.
//! (clap merges flags and environment into [`Overrides`]; this module lays them over the file.)
//!
//! Relative paths in a config file are relative to that file's directory, so a config works
//! from wherever the gateway is started; relative paths from flags or the environment are
//! relative to the working directory, as on any command line.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::quota::BanPolicy;

/// What to do when the quota store cannot answer in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum OnStoreError {
    /// Count on this node alone at the plan's per-minute rate; the day quota pauses.
    Local,
    /// Admit every authenticated request.
    Open,
    /// Refuse with 503.
    Closed,
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
    pub upstreams: Vec<SocketAddr>,
    /// `None`: the embedded in-process store.
    pub redis_url: Option<String>,
    pub key_prefix: String,
    pub keys_file: PathBuf,
    pub plans_dir: PathBuf,
    pub store_timeout: Duration,
    pub on_store_error: OnStoreError,
    /// Worker threads of the proxy.
    pub threads: usize,
    /// Requests per minute a client IP may make with a missing or invalid key.
    pub unauthenticated_per_minute: u32,
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

/// The layers above the file: each is `Some` when given as a flag or environment variable.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Overrides {
    /// Public listening address.
    #[arg(long, env = "PET_GATEWAY_LISTEN", value_name = "ADDR")]
    pub listen: Option<String>,
    /// Admin listening address (health, metrics).
    #[arg(long, env = "PET_GATEWAY_ADMIN_LISTEN", value_name = "ADDR")]
    pub admin_listen: Option<String>,
    /// Backend address; repeat (or comma-separate) for several.
    #[arg(
        long = "upstream",
        env = "PET_GATEWAY_UPSTREAM",
        value_name = "ADDR",
        value_delimiter = ','
    )]
    pub upstreams: Vec<String>,
    /// Redis URL of the shared quota store; empty: the embedded store.
    #[arg(long, env = "PET_GATEWAY_REDIS_URL", value_name = "URL")]
    pub redis_url: Option<String>,
    /// Prefix of every Redis key (one per environment).
    #[arg(long, env = "PET_GATEWAY_KEY_PREFIX", value_name = "P")]
    pub key_prefix: Option<String>,
    /// The keys file.
    #[arg(long, env = "PET_GATEWAY_KEYS_FILE", value_name = "PATH")]
    pub keys_file: Option<PathBuf>,
    /// The plans directory.
    #[arg(long, env = "PET_GATEWAY_PLANS_DIR", value_name = "DIR")]
    pub plans_dir: Option<PathBuf>,
    /// What to do when the quota store fails: local, open or closed.
    #[arg(long, env = "PET_GATEWAY_ON_STORE_ERROR", value_name = "MODE")]
    pub on_store_error: Option<OnStoreError>,
    /// Certificate chain (PEM) for TLS on the public listener; needs --tls-key.
    #[arg(long, env = "PET_GATEWAY_TLS_CERT", value_name = "PATH")]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM) for TLS on the public listener; needs --tls-cert.
    #[arg(long, env = "PET_GATEWAY_TLS_KEY", value_name = "PATH")]
    pub tls_key: Option<PathBuf>,
    /// Log format: text or json.
    #[arg(long, env = "PET_GATEWAY_LOG_FORMAT", value_name = "FORMAT")]
    pub log_format: Option<LogFormat>,
}

/// The config file's shape. Every field is optional: defaults fill the rest.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    environment: Option<String>,
    listen: Option<String>,
    admin_listen: Option<String>,
    upstreams: Option<Vec<String>>,
    redis_url: Option<String>,
    key_prefix: Option<String>,
    keys_file: Option<PathBuf>,
    plans_dir: Option<PathBuf>,
    store_timeout_ms: Option<u64>,
    on_store_error: Option<OnStoreError>,
    threads: Option<usize>,
    unauthenticated_per_minute: Option<u32>,
    upstream_connect_timeout_ms: Option<u64>,
    upstream_read_timeout_ms: Option<u64>,
    client_read_timeout_ms: Option<u64>,
    reload_interval_ms: Option<u64>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    log_format: Option<LogFormat>,
    grace_period_secs: Option<u64>,
    shutdown_timeout_secs: Option<u64>,
    upgrade_sock: Option<PathBuf>,
    ban: Option<FileBan>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileBan {
    strikes: Option<u64>,
    durations_secs: Option<Vec<u64>>,
    decay_secs: Option<u64>,
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
        /// The file, or "command line / environment".
        source_name: String,
        message: String,
    },
}

impl Config {
    /// Builds the config from an optional file and the flag/environment layer.
    pub fn load(file: Option<&Path>, over: &Overrides) -> Result<Config, ConfigError> {
        let (fc, base, source_name) = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.to_owned(),
                    source,
                })?;
                let fc: FileConfig = toml::from_str(&text).map_err(|e| ConfigError::Invalid {
                    source_name: path.display().to_string(),
                    message: e.to_string().trim_end().to_owned(),
                })?;
                let base = path.parent().map(Path::to_owned).unwrap_or_default();
                (fc, base, path.display().to_string())
            }
            None => (FileConfig::default(), PathBuf::new(), "defaults".to_owned()),
        };
        let file_err = |field: &str, message: String| ConfigError::Invalid {
            source_name: source_name.clone(),
            message: format!("field `{field}`: {message}"),
        };
        let flag_err = |flag: &str, message: String| ConfigError::Invalid {
            source_name: "command line / environment".to_owned(),
            message: format!("--{flag}: {message}"),
        };
        let in_file = |p: PathBuf| if p.is_absolute() { p } else { base.join(p) };

        let environment = fc.environment.unwrap_or_else(|| "local".to_owned());
        if environment.is_empty() {
            return Err(file_err("environment", "must not be empty".into()));
        }

        let listen = match &over.listen {
            Some(v) => socket_addr(v).map_err(|m| flag_err("listen", m))?,
            None => socket_addr(fc.listen.as_deref().unwrap_or("127.0.0.1:8080"))
                .map_err(|m| file_err("listen", m))?,
        };
        let admin_listen = match &over.admin_listen {
            Some(v) => socket_addr(v).map_err(|m| flag_err("admin-listen", m))?,
            None => socket_addr(fc.admin_listen.as_deref().unwrap_or("127.0.0.1:9090"))
                .map_err(|m| file_err("admin_listen", m))?,
        };
        let upstreams = if !over.upstreams.is_empty() {
            over.upstreams
                .iter()
                .map(|u| socket_addr(u).map_err(|m| flag_err("upstream", m)))
                .collect::<Result<Vec<_>, _>>()?
        } else {
            let list = fc
                .upstreams
                .unwrap_or_else(|| vec!["127.0.0.1:8081".to_owned()]);
            if list.is_empty() {
                return Err(file_err(
                    "upstreams",
                    "needs at least one backend address".into(),
                ));
            }
            list.iter()
                .map(|u| socket_addr(u).map_err(|m| file_err("upstreams", m)))
                .collect::<Result<Vec<_>, _>>()?
        };

        let redis_url = over
            .redis_url
            .clone()
            .or(fc.redis_url)
            .filter(|u| !u.trim().is_empty());
        if let Some(url) = &redis_url {
            if let Err(e) = crate::store::RedisTarget::parse(url) {
                let m = format!("not a usable Redis URL: {e}");
                return Err(if over.redis_url.is_some() {
                    flag_err("redis-url", m)
                } else {
                    file_err("redis_url", m)
                });
            }
        }
        let key_prefix = over
            .key_prefix
            .clone()
            .or(fc.key_prefix)
            .unwrap_or_else(|| format!("pet:{environment}"));
        if key_prefix.is_empty() || key_prefix.contains(['{', '}']) {
            return Err(file_err(
                "key_prefix",
                "must be non-empty and free of '{' and '}' (they are the Redis hash tag)".into(),
            ));
        }

        let keys_file = over
            .keys_file
            .clone()
            .unwrap_or_else(|| in_file(fc.keys_file.unwrap_or_else(|| "keys.toml".into())));
        let plans_dir = over
            .plans_dir
            .clone()
            .unwrap_or_else(|| in_file(fc.plans_dir.unwrap_or_else(|| "plans".into())));

        let store_timeout_ms = fc.store_timeout_ms.unwrap_or(50);
        if store_timeout_ms == 0 {
            return Err(file_err("store_timeout_ms", "must be at least 1".into()));
        }
        let threads = fc.threads.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2)
        });
        if threads == 0 {
            return Err(file_err("threads", "must be at least 1".into()));
        }
        let unauthenticated_per_minute = fc.unauthenticated_per_minute.unwrap_or(60);
        if unauthenticated_per_minute == 0 {
            return Err(file_err(
                "unauthenticated_per_minute",
                "must be at least 1".into(),
            ));
        }

        let mut ban = BanPolicy::default();
        if let Some(b) = fc.ban {
            if let Some(s) = b.strikes {
                ban.strikes = s;
            }
            if let Some(d) = b.durations_secs {
                if d.is_empty() || d.contains(&0) {
                    return Err(file_err(
                        "ban.durations_secs",
                        "needs at least one duration, each at least 1 second".into(),
                    ));
                }
                ban.durations = d;
            }
            if let Some(d) = b.decay_secs {
                ban.decay_secs = d;
            }
        }

        let tls_cert = over.tls_cert.clone().or_else(|| fc.tls_cert.map(&in_file));
        let tls_key = over.tls_key.clone().or_else(|| fc.tls_key.map(&in_file));
        let tls = match (tls_cert, tls_key) {
            (Some(cert), Some(key)) => Some(TlsFiles { cert, key }),
            (None, None) => None,
            _ => {
                return Err(file_err(
                    "tls_cert",
                    "tls_cert and tls_key go together: give both (TLS) or neither (plain HTTP)"
                        .into(),
                ))
            }
        };

        // One per environment and port, so gateways on one host never take each other's sockets.
        let upgrade_sock = fc.upgrade_sock.map(&in_file).unwrap_or_else(|| {
            PathBuf::from(format!(
                "/tmp/pet-gateway-{environment}-{}.sock",
                listen.port()
            ))
        });

        let ms = |v: Option<u64>, default: u64, field: &str| match v.unwrap_or(default) {
            0 => Err(file_err(field, "must be at least 1".into())),
            n => Ok(Duration::from_millis(n)),
        };
        Ok(Config {
            environment,
            listen,
            admin_listen,
            upstreams,
            redis_url,
            key_prefix,
            keys_file,
            plans_dir,
            store_timeout: Duration::from_millis(store_timeout_ms),
            on_store_error: over
                .on_store_error
                .or(fc.on_store_error)
                .unwrap_or(OnStoreError::Local),
            threads,
            unauthenticated_per_minute,
            ban,
            upstream_connect_timeout: ms(
                fc.upstream_connect_timeout_ms,
                1_000,
                "upstream_connect_timeout_ms",
            )?,
            upstream_read_timeout: ms(
                fc.upstream_read_timeout_ms,
                10_000,
                "upstream_read_timeout_ms",
            )?,
            client_read_timeout: ms(fc.client_read_timeout_ms, 10_000, "client_read_timeout_ms")?,
            reload_interval: ms(fc.reload_interval_ms, 500, "reload_interval_ms")?,
            tls,
            log_format: over.log_format.or(fc.log_format).unwrap_or_default(),
            grace_period_secs: fc.grace_period_secs.unwrap_or(10),
            shutdown_timeout_secs: fc.shutdown_timeout_secs.unwrap_or(30),
            upgrade_sock,
        })
    }
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
        let c = Config::load(None, &Overrides::default()).unwrap();
        assert_eq!(c.listen, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(c.upstreams, ["127.0.0.1:8081".parse().unwrap()]);
        assert_eq!(c.redis_url, None);
        assert_eq!(c.key_prefix, "pet:local");
        assert_eq!(c.on_store_error, OnStoreError::Local);
        assert_eq!(c.store_timeout, Duration::from_millis(50));
        assert_eq!(c.ban, BanPolicy::default());
    }

    #[test]
    fn flags_and_environment_override_the_file_whose_paths_are_relative_to_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(
            dir.path(),
            "environment = \"staging\"\nlisten = \"127.0.0.1:7000\"\nupstreams = [\"127.0.0.1:7001\"]\n\
             keys_file = \"k.toml\"\nplans_dir = \"/etc/plans\"\nredis_url = \"redis://127.0.0.1:6379\"\n",
        );
        let c = Config::load(Some(&path), &Overrides::default()).unwrap();
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
        let c = Config::load(Some(&path), &over).unwrap();
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
            ("[ban]\ndurations_secs = []", "`ban.durations_secs`"),
            ("on_store_error = \"maybe\"", "on_store_error"),
            ("listne = \"127.0.0.1:1\"", "listne"),
            ("key_prefix = \"a{b}\"", "`key_prefix`"),
        ] {
            let path = write(dir.path(), text);
            let message = Config::load(Some(&path), &Overrides::default())
                .unwrap_err()
                .to_string();
            assert!(message.contains("gw.toml"), "{message}");
            assert!(message.contains(field), "{text}: {message}");
        }
    }
}
