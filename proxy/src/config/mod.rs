//! One internal [`Config`], produced from three layers with a stated precedence:
//! command-line flags > environment variables > the config file > built-in defaults.
//!
//! Each setting is declared once, as a row of its part's table ([`parts`]): its file key (from
//! which one rule spells its flag and variable), default, check and meaning. From the rows come the file layer ([`file`]), the flag
//! and environment layers ([`flags`]), the merge ([`setting::Layers`]), each part's validation,
//! the book's settings table ([`settings_table`]) and `check`'s report ([`settings_report`]).
//! Every error names the layer that really supplied the bad value: the file and its field, the
//! flag, or the environment variable.
//!
//! Inside the wing the imports run one way: [`model`] (the `Config` and its error) imports no
//! sibling; [`setting`] builds on it; the [`parts`] on both; the layers read the parts' rows;
//! this module assembles them.
//!
//! Relative paths in a config file are relative to that file's directory, so a config works
//! from wherever the gateway is started; relative paths from flags or the environment are
//! relative to the working directory, as on any command line.

mod file;
mod flags;
mod model;
mod parts;

pub use parts::admin::Admin as AdminSettings;

pub use parts::events::ready as events_ready;
mod setting;

use std::path::Path;

pub use self::flags::{env_var, Env, FlagSet, Overrides};
pub use self::model::{Config, ConfigError, KeysSource, LogFormat, SampleRatio, TlsFiles};
use self::parts::rows;
use self::setting::Layers;

impl Config {
    /// Reads `file` (if any), the environment and the flags, merges them and validates the
    /// result.
    pub fn load(file: Option<&Path>, env: &Env, flags: &Overrides) -> Result<Config, ConfigError> {
        Ok(load_layers(file, env, flags)?.0)
    }

    /// Only the admin listener's settings (its address, token and host names): what a probe
    /// (`pet-gateway health`) needs, without the rest, so that it never depends on what the
    /// rest checks (a backend's name resolving, a file being readable) and a DNS outage cannot
    /// fail the liveness probe of every pod at once.
    pub fn load_admin(
        file: Option<&Path>,
        env: &Env,
        flags: &Overrides,
    ) -> Result<AdminSettings, ConfigError> {
        parts::admin::validate(&layers(file, env, flags)?)
    }
}

fn layers(file: Option<&Path>, env: &Env, flags: &Overrides) -> Result<Layers, ConfigError> {
    if let Some(message) = env.unreadable() {
        return Err(ConfigError::Invalid {
            source_name: "environment".to_owned(),
            message,
        });
    }
    Ok(Layers {
        flags: flags.layer().clone(),
        env: env.layer(),
        file: match file {
            Some(path) => file::read(path)?,
            None => Default::default(),
        },
        file_path: file.map(Path::to_owned),
        resolved: Default::default(),
    })
}

/// The config, and the layers it came from with a record of each value in force.
fn load_layers(
    file: Option<&Path>,
    env: &Env,
    flags: &Overrides,
) -> Result<(Config, Layers), ConfigError> {
    let layers = layers(file, env, flags)?;
    Ok((validate(&layers)?, layers))
}

/// Each part validates its own section; the parts a later one depends on come first.
fn validate(l: &Layers) -> Result<Config, ConfigError> {
    let config = validate_parts(l)?;
    all_in_tables(l)?;
    Ok(config)
}

/// A setting validated but missing from its part's table would be refused in the file and
/// read from no flag or variable: fail at once, on the defaults every test loads.
fn all_in_tables(l: &Layers) -> Result<(), ConfigError> {
    match l
        .resolved
        .borrow()
        .iter()
        .find(|r| !rows().any(|row| row.name == r.name))
    {
        Some(r) => Err(ConfigError::Invalid {
            source_name: "built-in default".to_owned(),
            message: format!("`{}`: is missing from its part's table", r.name),
        }),
        None => Ok(()),
    }
}

fn validate_parts(l: &Layers) -> Result<Config, ConfigError> {
    let runtime = parts::runtime::validate(l)?;
    let environment = runtime.environment.as_str();
    let listen = parts::listen::validate(l, environment)?;
    let admin = parts::admin::validate(l)?;
    let upstreams = parts::upstreams::validate(l)?;
    let store = parts::store::validate(l, environment)?;
    let redis = parts::redis_access::validate(l, store.redis_url.as_ref())?;
    let registry_admin = parts::redis_access::registry_admin(l)?;
    let region = parts::regions::validate(l, store.redis_url.as_ref())?;
    let keys = parts::keys::validate(l, environment, store.redis_url.is_some())?;
    let limits = parts::limits::validate(l)?;
    let events = parts::events::validate(l)?;
    let tracing = parts::tracing::validate(l)?;
    Ok(Config {
        listen: listen.listen,
        admin_listen: admin.admin_listen,
        admin_token: admin.admin_token,
        admin_hosts: admin.admin_hosts,
        upstreams: upstreams.upstreams,
        upstream_resolve_interval: upstreams.upstream_resolve_interval,
        upstream_places: upstreams.places,
        upstream_priorities: upstreams.priorities,
        concurrency_lease_secs: store.concurrency_lease_secs,
        redis_url: store.redis_url.map(|u| u.value),
        redis,
        region,
        registry_admin,
        key_prefix: store.key_prefix,
        api_key_prefix: keys.api_key_prefix,
        keys_source: keys.keys_source,
        audit_log: keys.audit_log,
        keys_file: keys.keys_file,
        registry_verify_keys: keys.registry_verify_keys,
        registry_signing_key_file: keys.registry_signing_key_file,
        registry_signature_binding: keys.registry_signature_binding,
        registry_compare_interval: keys.registry_compare_interval,
        plans_dir: keys.plans_dir,
        store_timeout: store.store_timeout,
        store_batch_max: store.store_batch_max,
        on_store_error: store.on_store_error,
        threads: runtime.threads,
        work_stealing: runtime.work_stealing,
        upstream_keepalive_pool_size: upstreams.upstream_keepalive_pool_size,
        unauthenticated: limits.unauthenticated,
        request_header_timeout: listen.request_header_timeout,
        ban: limits.ban,
        upstream_connect_timeout: upstreams.upstream_connect_timeout,
        upstream_read_timeout: upstreams.upstream_read_timeout,
        client_read_timeout: listen.client_read_timeout,
        reload_interval: runtime.reload_interval,
        tls: parts::tls::validate(l)?,
        log_format: parts::logging::validate(l)?,
        tracing_otlp_endpoint: tracing.endpoint,
        tracing_sample_ratio: tracing.sample_ratio,
        grace_period_secs: runtime.grace_period_secs,
        shutdown_timeout_secs: runtime.shutdown_timeout_secs,
        upgrade_sock: listen.upgrade_sock,
        node_id: events.node_id,
        metering_file: events.metering_file,
        events_webhook: events.webhook,
        environment: runtime.environment,
    })
}

/// Every setting with the value in force and the layer it came from, for `check`: what a
/// deployment really runs with, secrets shown only as `(set)` or `(unset)`.
pub fn settings_report(
    file: Option<&Path>,
    env: &Env,
    flags: &Overrides,
) -> Result<String, ConfigError> {
    let (_, layers) = load_layers(file, env, flags)?;
    let resolved = layers.resolved.into_inner();
    let lines: Vec<[String; 3]> = rows()
        .filter_map(|row| resolved.iter().find(|r| r.name == row.name))
        .map(|r| [r.name.to_owned(), r.shown.clone(), r.origin.label()])
        .collect();
    let width = |i: usize| {
        lines
            .iter()
            .map(|l| l[i].chars().count())
            .max()
            .unwrap_or(0)
    };
    let (name_width, value_width) = (width(0).max(7), width(1).max(5));
    let mut out = format!(
        "{:name_width$}  {:value_width$}  from\n",
        "setting", "value"
    );
    for [name, shown, origin] in &lines {
        out.push_str(&format!(
            "{name:name_width$}  {shown:value_width$}  {origin}\n"
        ));
    }
    Ok(out)
}

/// The settings table of the book's configuration chapter, rendered from the rows; a unit test
/// holds the chapter to it.
pub fn settings_table() -> String {
    let mut out = String::from(
        "| file key | flag | environment | default | meaning |\n\
         | --- | --- | --- | --- | --- |\n\
         | | `--config FILE` | `PET_GATEWAY_CONFIG` | none | the config file |\n",
    );
    for row in rows() {
        let key = match row.name.split_once('.') {
            Some((table, key)) => format!("`[{table}] {key}`"),
            None => format!("`{}`", row.name),
        };
        let list = matches!(row.kind, setting::Kind::Texts | setting::Kind::Ints);
        let flag = row.flag().map_or_else(String::new, |f| {
            let repeat = if list { " (repeatable)" } else { "" };
            let only = if f.serve { "" } else { " (`keys` commands)" };
            format!("`{} {}`{repeat}{only}", f.name, f.value_name)
        });
        let env = row.env().map_or_else(String::new, |var| {
            format!("`{var}`{}", if list { " (comma-separated)" } else { "" })
        });
        for cell in [key, flag, env, row.preset_doc(), row.doc.to_owned()] {
            // `| |` for an empty cell, as the book writes it.
            out.push_str("| ");
            out.push_str(&cell);
            if !cell.is_empty() {
                out.push(' ');
            }
        }
        out.push_str("|\n");
    }
    out
}

impl Config {
    /// Where the key registry lives when `keys_source = "store"`: the global store in a region
    /// (one registry for every region, so a key issued, revoked or rotated anywhere is in force
    /// everywhere within a node's read of its feed), else the Redis of `redis_url`. `None`: no
    /// registry (the keys file).
    pub fn registry_redis(&self) -> Option<&crate::base::redis::RedisAccess> {
        if self.keys_source != crate::config::KeysSource::Store {
            return None;
        }
        match (&self.region, &self.redis) {
            (Some(region), Some(_)) => Some(&region.global),
            (_, redis) => redis.as_ref(),
        }
    }

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
        if let Some(webhook) = &self.events_webhook {
            if !webhook.url.https && !is_loopback(&webhook.url.host) {
                warnings.push(format!(
                    "events_webhook_url `{}` is plain http to another machine: the events (key \
                     ids, customers, usage) cross the network readable by anyone on the path; \
                     the signature proves who sent them, not that nobody read them; use https://",
                    webhook.url.text
                ));
            }
        }
        if self.environment != "production" {
            return warnings;
        }
        if self.keys_source == KeysSource::Store && self.registry_verify_keys.is_empty() {
            warnings.push(
                "environment `production` takes the key registry's records unsigned: whoever can \
                 write to its Redis can mint a key; sign the registry (`registry keygen`, \
                 `registry sign`) and set `registry_verify_keys`"
                    .to_owned(),
            );
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
    let host = host.strip_suffix('.').unwrap_or(host);
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.to_canonical().is_loopback())
}

/// A file of the repository, for tests that hold the code to the book or the shipped configs.
/// Found when the test runs (cargo sets `CARGO_MANIFEST_DIR` for it), never with `env!`: the
/// build cache serves a test built in another clone, whose compiled-in path would be that
/// clone's.
#[cfg(test)]
pub(crate) fn repo_path(relative: &str) -> std::path::PathBuf {
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR")
        .expect("CARGO_MANIFEST_DIR: run the tests through cargo test or cargo nextest");
    Path::new(&manifest).join("..").join(relative)
}

/// The text of [`repo_path`]'s file.
#[cfg(test)]
pub(crate) fn repo_file(relative: &str) -> String {
    let path = repo_path(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::time::Duration;

    use super::setting::{Kind, Origin, Row, Value};
    use super::*;
    use crate::quota::admission::OnStoreError;
    use crate::quota::rules::BanPolicy;

    /// The flags `serve` would parse from `args`.
    fn flags(args: &[&str]) -> Overrides {
        let cmd = Overrides::add_args(clap::Command::new("t"), FlagSet::Serve);
        let m = cmd
            .try_get_matches_from(std::iter::once("t").chain(args.iter().copied()))
            .unwrap();
        Overrides::from_matches(&m, FlagSet::Serve)
    }

    fn write(dir: &Path, text: &str) -> PathBuf {
        let path = dir.join("gw.toml");
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn defaults_without_a_file() {
        let c = Config::load(None, &Env::default(), &Overrides::default()).unwrap();
        assert_eq!(c.listen, "127.0.0.1:8080".parse().unwrap());
        let default: std::net::SocketAddr = "127.0.0.1:8081".parse().unwrap();
        assert_eq!(c.upstreams, [default.into()]);
        assert_eq!(
            c.upstream_resolve_interval,
            std::time::Duration::from_secs(30)
        );
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
    fn a_lease_must_leave_time_to_renew_it_within_the_stores_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let load = |text: &str| {
            let path = write(dir.path(), text);
            Config::load(Some(&path), &Env::default(), &Overrides::default())
        };
        // Renewed 5 s before its end: a 3 s deadline fits, a 5 s one does not.
        let c = load("concurrency_lease_secs = 15\nstore_timeout_ms = 3000\n").unwrap();
        assert_eq!(c.concurrency_lease_secs, 15);
        let e = load("concurrency_lease_secs = 15\nstore_timeout_ms = 5000\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("concurrency_lease_secs") && e.contains("store_timeout_ms = 5000"),
            "{e}"
        );
        // The shortest lease is renewed 2 s before its end.
        assert!(load("concurrency_lease_secs = 3\nstore_timeout_ms = 500\n").is_ok());
        assert!(load("concurrency_lease_secs = 3\nstore_timeout_ms = 600\n").is_err());
        // Unset, the lease is made long enough for the deadline: 3 × ⌈5 s + 1.5 s⌉.
        let c = load("store_timeout_ms = 5000\n").unwrap();
        assert_eq!(c.concurrency_lease_secs, 21);
        assert_eq!(load("").unwrap().concurrency_lease_secs, 15);
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

        let over = flags(&[
            "--listen",
            "127.0.0.1:7100",
            "--upstream",
            "127.0.0.1:7101",
            "--upstream",
            "127.0.0.1:7102",
            "--redis-url",
            "",
            "--keys-file",
            "mine.toml",
        ]);
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
        let flag = |key_prefix: &str| flags(&["--key-prefix", key_prefix]);

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

        let cert_only = flags(&["--tls-cert", "cert.pem"]);
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
        let over = flags(&["--listen", "127.0.0.1:7002"]);
        assert_eq!(
            Config::load(Some(&path), &env, &over)
                .unwrap()
                .listen
                .port(),
            7002
        );
    }

    #[test]
    fn a_plain_http_webhook_off_this_machine_is_warned_about() {
        let dir = tempfile::tempdir().unwrap();
        let warn = |url: &str| {
            let path = write(
                dir.path(),
                &format!(
                    "events_webhook_url = \"{url}\"\nevents_webhook_secret_file = \"/tmp/secret\"\n\
                     events_spool_dir = \"/tmp/spool\"\n"
                ),
            );
            Config::load(Some(&path), &Env::default(), &Overrides::default())
                .unwrap()
                .warnings()
        };
        let w = warn("http://billing.example.com/events?token=x");
        assert!(
            w.len() == 1
                && w[0].contains("`http://billing.example.com/events`")
                && w[0].contains("https://"),
            "{w:?}"
        );
        for quiet in [
            "https://billing.example.com/events",
            "http://127.0.0.1:9000/events",
            "http://localhost/events",
            "http://[::1]:9000/",
            "http://LOCALHOST./events",
            "http://[::ffff:127.0.0.1]:9000/",
        ] {
            assert!(warn(quiet).is_empty(), "{quiet}: {:?}", warn(quiet));
        }
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
        let over = flags(&["--on-store-error", "closed"]);
        let c = Config::load(None, &env, &over).unwrap();
        assert_eq!(c.on_store_error, OnStoreError::Closed);
        let upper = Env::from_pairs([("PET_GATEWAY_ON_STORE_ERROR", "Closed")]);
        assert!(Config::load(None, &upper, &Overrides::default()).is_err());
        let unrelated = Env::from_pairs([("PET_GATEWAY_LISTEN", "nowhere")]).only(&["keys_file"]);
        assert!(Config::load(None, &unrelated, &Overrides::default()).is_ok());
    }

    /// A value of `row`'s kind that its flag, variable and file key all accept.
    fn sample(row: &Row) -> (String, String) {
        match row.kind {
            Kind::Int => ("7".into(), "7".into()),
            Kind::Bool => ("true".into(), "true".into()),
            Kind::Texts => ("x".into(), "[\"x\"]".into()),
            Kind::Ints => ("7".into(), "[7]".into()),
            Kind::Choice(names) => {
                let name = names()[0].get_name().to_owned();
                (name.clone(), format!("{name:?}"))
            }
            Kind::Text | Kind::Path => ("x".into(), "\"x\"".into()),
            Kind::Number => ("7".into(), "7".into()),
        }
    }

    /// The flag layer `set`'s command line would give for `args`.
    fn parsed(set: FlagSet, args: &[&str]) -> Layers {
        let cmd = Overrides::add_args(clap::Command::new("t"), set);
        let m = cmd
            .try_get_matches_from(std::iter::once("t").chain(args.iter().copied()))
            .unwrap();
        Layers {
            flags: Overrides::from_matches(&m, set).layer().clone(),
            ..Layers::default()
        }
    }

    /// The flags and variables of the settings that had them before the rule spelled the rest,
    /// as operators' scripts spell them: none of these may change.
    const FLAGS_AND_VARIABLES: &[(&str, &str, &str)] = &[
        ("environment", "--environment", "PET_GATEWAY_ENVIRONMENT"),
        ("listen", "--listen", "PET_GATEWAY_LISTEN"),
        ("admin_listen", "--admin-listen", "PET_GATEWAY_ADMIN_LISTEN"),
        ("admin_hosts", "--admin-host", "PET_GATEWAY_ADMIN_HOSTS"),
        ("upstreams", "--upstream", "PET_GATEWAY_UPSTREAM"),
        ("redis_url", "--redis-url", "PET_GATEWAY_REDIS_URL"),
        (
            "redis_username",
            "--redis-username",
            "PET_GATEWAY_REDIS_USERNAME",
        ),
        (
            "redis_password_file",
            "--redis-password-file",
            "PET_GATEWAY_REDIS_PASSWORD_FILE",
        ),
        (
            "redis_tls_ca_file",
            "--redis-tls-ca-file",
            "PET_GATEWAY_REDIS_TLS_CA_FILE",
        ),
        (
            "redis_tls_cert_file",
            "--redis-tls-cert-file",
            "PET_GATEWAY_REDIS_TLS_CERT_FILE",
        ),
        (
            "redis_tls_key_file",
            "--redis-tls-key-file",
            "PET_GATEWAY_REDIS_TLS_KEY_FILE",
        ),
        (
            "redis_sentinel_username",
            "--redis-sentinel-username",
            "PET_GATEWAY_REDIS_SENTINEL_USERNAME",
        ),
        (
            "redis_sentinel_password_file",
            "--redis-sentinel-password-file",
            "PET_GATEWAY_REDIS_SENTINEL_PASSWORD_FILE",
        ),
        ("key_prefix", "--key-prefix", "PET_GATEWAY_KEY_PREFIX"),
        (
            "on_store_error",
            "--on-store-error",
            "PET_GATEWAY_ON_STORE_ERROR",
        ),
        ("keys_source", "--keys-source", "PET_GATEWAY_KEYS_SOURCE"),
        ("keys_file", "--keys-file", "PET_GATEWAY_KEYS_FILE"),
        ("plans_dir", "--plans-dir", "PET_GATEWAY_PLANS_DIR"),
        ("audit_log", "--audit-log", "PET_GATEWAY_AUDIT_LOG"),
        (
            "registry_admin_username",
            "--registry-admin-username",
            "PET_GATEWAY_REGISTRY_ADMIN_USERNAME",
        ),
        (
            "registry_admin_password_file",
            "--registry-admin-password-file",
            "PET_GATEWAY_REGISTRY_ADMIN_PASSWORD_FILE",
        ),
        (
            "registry_verify_keys",
            "--registry-verify-key",
            "PET_GATEWAY_REGISTRY_VERIFY_KEYS",
        ),
        (
            "registry_signing_key_file",
            "--registry-signing-key-file",
            "PET_GATEWAY_REGISTRY_SIGNING_KEY_FILE",
        ),
        (
            "registry_signature_binding",
            "--registry-signature-binding",
            "PET_GATEWAY_REGISTRY_SIGNATURE_BINDING",
        ),
        (
            "registry_compare_interval_secs",
            "--registry-compare-interval-secs",
            "PET_GATEWAY_REGISTRY_COMPARE_INTERVAL_SECS",
        ),
        ("tls_cert", "--tls-cert", "PET_GATEWAY_TLS_CERT"),
        ("tls_key", "--tls-key", "PET_GATEWAY_TLS_KEY"),
        ("log_format", "--log-format", "PET_GATEWAY_LOG_FORMAT"),
        (
            "tracing_otlp_endpoint",
            "--tracing-otlp-endpoint",
            "PET_GATEWAY_TRACING_OTLP_ENDPOINT",
        ),
        (
            "tracing_sample_ratio",
            "--tracing-sample-ratio",
            "PET_GATEWAY_TRACING_SAMPLE_RATIO",
        ),
        ("node_id", "--node-id", "PET_GATEWAY_NODE_ID"),
        (
            "metering_file",
            "--metering-file",
            "PET_GATEWAY_METERING_FILE",
        ),
        (
            "events_webhook_url",
            "--events-webhook-url",
            "PET_GATEWAY_EVENTS_WEBHOOK_URL",
        ),
        (
            "events_webhook_secret_file",
            "--events-webhook-secret-file",
            "PET_GATEWAY_EVENTS_WEBHOOK_SECRET_FILE",
        ),
        (
            "events_webhook_signature",
            "--events-webhook-signature",
            "PET_GATEWAY_EVENTS_WEBHOOK_SIGNATURE",
        ),
        (
            "events_webhook_previous_secret_file",
            "--events-webhook-previous-secret-file",
            "PET_GATEWAY_EVENTS_WEBHOOK_PREVIOUS_SECRET_FILE",
        ),
        (
            "events_spool_dir",
            "--events-spool-dir",
            "PET_GATEWAY_EVENTS_SPOOL_DIR",
        ),
        (
            "events_spool_max_mb",
            "--events-spool-max-mb",
            "PET_GATEWAY_EVENTS_SPOOL_MAX_MB",
        ),
    ];

    #[test]
    fn the_flags_and_variables_are_the_ones_operators_script_against() {
        let with_flags: Vec<_> = rows()
            .filter_map(|r| Some((r.name, r.flag()?.name, r.env()?)))
            .collect();
        for triple in FLAGS_AND_VARIABLES {
            assert!(with_flags.contains(triple), "{triple:?}");
        }
        let env_only: Vec<_> = rows()
            .filter(|r| r.flag().is_none())
            .filter_map(|r| Some((r.name, r.env()?, r.secret)))
            .collect();
        assert_eq!(
            env_only,
            [
                ("admin_token", "PET_GATEWAY_ADMIN_TOKEN", true),
                ("redis_password", "PET_GATEWAY_REDIS_PASSWORD", true),
                (
                    "redis_sentinel_password",
                    "PET_GATEWAY_REDIS_SENTINEL_PASSWORD",
                    true
                ),
                (
                    "registry_admin_password",
                    "PET_GATEWAY_REGISTRY_ADMIN_PASSWORD",
                    true
                ),
                (
                    "events_webhook_secret",
                    "PET_GATEWAY_EVENTS_WEBHOOK_SECRET",
                    true
                ),
                (
                    "events_webhook_previous_secret",
                    "PET_GATEWAY_EVENTS_WEBHOOK_PREVIOUS_SECRET",
                    true
                ),
            ]
        );
        let keys_only: Vec<_> = rows()
            .filter(|r| r.flag().is_some_and(|f| !f.serve))
            .map(|r| r.name)
            .collect();
        assert_eq!(keys_only, ["audit_log"]);
    }

    #[test]
    fn each_rows_flag_and_variable_are_what_the_layers_read() {
        for row in rows() {
            let (text, _) = sample(row);
            if let Some(flag) = row.flag() {
                let name: &'static [&'static str] = Box::leak(Box::new([row.name]));
                let set = if flag.serve {
                    FlagSet::Serve
                } else {
                    FlagSet::Named(name)
                };
                let layers = parsed(set, &[flag.name, &text]);
                let origin = layers.given(row).map(|(_, o)| o);
                assert_eq!(origin, Some(Origin::Flag(flag.name)), "{}", row.name);
            }
            if let Some(var) = row.env() {
                let layers = Layers {
                    env: Env::from_pairs([(var, text.as_str())]).layer(),
                    ..Layers::default()
                };
                let origin = layers.given(row).map(|(_, o)| o);
                assert_eq!(origin, Some(Origin::Env(var)), "{}", row.name);
            }
        }
        // `serve` does not take the flag of the `keys` commands only.
        let cmd = Overrides::add_args(clap::Command::new("t"), FlagSet::Serve);
        assert!(cmd.try_get_matches_from(["t", "--audit-log", "a"]).is_err());
    }

    #[test]
    fn the_file_takes_every_rows_key_and_no_other() {
        let dir = tempfile::tempdir().unwrap();
        for row in rows() {
            let (_, toml) = sample(row);
            let text = match row.name.split_once('.') {
                Some((table, key)) => format!("[{table}]\n{key} = {toml}\n"),
                None => format!("{} = {toml}\n", row.name),
            };
            let layer = file::read(&write(dir.path(), &text)).unwrap();
            assert!(layer.get(row.name).is_some(), "{text}");
            let flat = row.name.contains('.').then(|| row.name.replace('.', "_"));
            for wrong in flat
                .into_iter()
                .chain([format!("{}s", row.name), row.name.to_uppercase()])
            {
                let wrong = format!("{wrong} = {toml}\n");
                let e = file::read(&write(dir.path(), &wrong))
                    .unwrap_err()
                    .to_string();
                assert!(
                    e.contains("gw.toml") && e.contains("unknown field"),
                    "{wrong}: {e}"
                );
            }
        }
        let e = file::read(&write(dir.path(), "[ban]\nstrike = 1\n"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`ban.strike`"), "{e}");
    }

    #[test]
    fn flags_beat_the_environment_which_beats_the_file_which_beats_the_default() {
        let path = PathBuf::from("gw.toml");
        for row in rows() {
            let value = |layer: &str| Value::Text(format!("{layer}-{}", row.name));
            let mut l = Layers {
                file_path: Some(path.clone()),
                ..Layers::default()
            };
            assert_eq!(l.given(row), None, "{}: the default", row.name);
            l.file.set(row.name, value("file"));
            let from_file = Some((value("file"), Origin::File(path.clone())));
            assert_eq!(l.given(row), from_file, "{}", row.name);
            l.env.set(row.name, value("env"));
            if let Some(var) = row.env() {
                assert_eq!(l.given(row), Some((value("env"), Origin::Env(var))));
            }
            l.flags.set(row.name, value("flag"));
            match (row.flag(), row.env()) {
                (Some(flag), _) => {
                    assert_eq!(l.given(row), Some((value("flag"), Origin::Flag(flag.name))))
                }
                (None, Some(var)) => {
                    assert_eq!(l.given(row), Some((value("env"), Origin::Env(var))))
                }
                (None, None) => assert_eq!(l.given(row), from_file),
            }
        }
    }

    #[test]
    fn every_shipped_config_loads() {
        let deploy = repo_path("deploy");
        let mut loaded = 0;
        for entry in std::fs::read_dir(deploy).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                let c = Config::load(Some(&path), &Env::default(), &Overrides::default());
                assert!(c.is_ok(), "{}: {c:?}", path.display());
                loaded += 1;
            }
        }
        assert!(loaded >= 3);
    }

    #[test]
    fn a_commands_own_flag_is_a_flag_of_its_setting() {
        let over = Overrides::default().with("admin_listen", Some("127.0.0.1:9999"));
        let env = Env::from_pairs([("PET_GATEWAY_ADMIN_LISTEN", "127.0.0.1:9998")]);
        let c = Config::load(None, &env, &over).unwrap();
        assert_eq!(c.admin_listen.port(), 9999);
        let unset = Overrides::default().with("admin_listen", None);
        assert_eq!(
            Config::load(None, &env, &unset)
                .unwrap()
                .admin_listen
                .port(),
            9998
        );
    }

    #[test]
    fn a_setting_validated_but_in_no_table_fails_the_load() {
        let l = Layers::default();
        l.resolved.borrow_mut().push(setting::Resolved {
            name: "not_in_any_table",
            shown: "1".to_owned(),
            origin: Origin::Default,
        });
        let err = all_in_tables(&l).unwrap_err().to_string();
        assert!(err.contains("`not_in_any_table`: is missing"), "{err}");
        assert!(
            validate(&Layers::default()).is_ok(),
            "every part's settings are in a table"
        );
    }

    /// The config from `env` and the flags `args`.
    fn load_redis(env: &[(&str, &str)], args: &[&str]) -> Result<Config, ConfigError> {
        Config::load(None, &Env::from_pairs(env.iter().copied()), &flags(args))
    }

    fn redis_error(env: &[(&str, &str)], args: &[&str]) -> String {
        load_redis(env, args).unwrap_err().to_string()
    }

    #[test]
    fn a_redis_password_is_refused_in_the_flag_and_each_credential_is_given_once() {
        use crate::base::redis::Secret;
        let url = "redis://gw:hunter22@10.0.0.1/0";
        // A password in the flag shows in `ps`: refused, without repeating it.
        let m = redis_error(&[], &["--redis-url", url]);
        assert!(
            m.starts_with("command line: --redis-url:") && m.contains("ps"),
            "{m}"
        );
        assert!(!m.contains("hunter22"), "{m}");
        // In the variable it is taken, as the URL's, and never shown.
        let redis = load_redis(&[("PET_GATEWAY_REDIS_URL", url)], &[])
            .unwrap()
            .redis
            .unwrap();
        assert_eq!(redis.auth.username.as_deref(), Some("gw"));
        let given = matches!(&redis.auth.password, Some(Secret::Given { value, .. }) if value == "hunter22");
        assert!(given && !format!("{redis:?}").contains("hunter22"));

        let plain = ["--redis-url", "redis://10.0.0.1/0"];
        let with = |more: &[&'static str]| [&plain[..], more].concat();
        let env = [("PET_GATEWAY_REDIS_PASSWORD", "pw")];
        let c = load_redis(&env, &with(&["--redis-username", "gateway"])).unwrap();
        let auth = c.redis.unwrap().auth;
        assert_eq!(auth.username.as_deref(), Some("gateway"));
        let setting = match auth.password {
            Some(Secret::Given { setting, .. }) => setting,
            other => panic!("{other:?}"),
        };
        assert_eq!(setting, "PET_GATEWAY_REDIS_PASSWORD");
        let m = redis_error(&env, &with(&["--redis-password-file", "/run/pw"]));
        assert!(m.starts_with("command line: --redis-password-file:"), "{m}");
        let in_url = [("PET_GATEWAY_REDIS_URL", "redis://:pw@10.0.0.1/0")];
        let m = redis_error(&in_url, &["--redis-password-file", "/run/pw"]);
        assert!(
            m.contains("--redis-password-file") && m.contains("once"),
            "{m}"
        );
        let user_in_url = [("PET_GATEWAY_REDIS_URL", "redis://gw@10.0.0.1/0")];
        let m = redis_error(&user_in_url, &["--redis-username", "other"]);
        assert!(m.contains("--redis-username") && m.contains("once"), "{m}");
    }

    #[test]
    fn redis_tls_files_go_with_a_tls_url_and_a_client_certificate_with_its_key() {
        let plain = ["--redis-url", "redis://10.0.0.1/0"];
        let tls = ["--redis-url", "rediss://10.0.0.1/0"];
        let m = redis_error(
            &[],
            &[&plain[..], &["--redis-tls-ca-file", "ca.pem"]].concat(),
        );
        assert!(m.starts_with("command line: --redis-tls-ca-file:"), "{m}");
        assert!(m.contains("rediss://"), "{m}");
        let m = redis_error(
            &[],
            &[&tls[..], &["--redis-tls-cert-file", "c.pem"]].concat(),
        );
        assert!(
            m.contains("--redis-tls-cert-file") && m.contains("redis_tls_key_file"),
            "{m}"
        );
        let env = [("PET_GATEWAY_REDIS_TLS_KEY_FILE", "k.pem")];
        let args = [&tls[..], &["--redis-tls-cert-file", "c.pem"]].concat();
        let redis = load_redis(&env, &args).unwrap().redis.unwrap();
        assert!(redis.tls);
        assert_eq!(redis.tls_files.key, Some(PathBuf::from("k.pem")));
        assert_eq!(redis.tls_files.ca, None);
    }

    #[test]
    fn sentinel_credentials_go_with_a_sentinel_url_which_names_its_master() {
        use crate::base::redis::RedisTarget;
        let user = ["--redis-sentinel-username", "s"];
        let m = redis_error(
            &[],
            &[&["--redis-url", "redis://10.0.0.1/0"][..], &user].concat(),
        );
        assert!(
            m.starts_with("command line: --redis-sentinel-username:"),
            "{m}"
        );
        let url = [
            "--redis-url",
            "rediss+sentinel://10.0.0.1:26379,10.0.0.2/main",
        ];
        let env = [("PET_GATEWAY_REDIS_SENTINEL_PASSWORD", "spw")];
        let redis = load_redis(&env, &[&url[..], &user].concat())
            .unwrap()
            .redis
            .unwrap();
        assert!(matches!(redis.target, RedisTarget::Sentinel(ref t) if t.master == "main"));
        assert_eq!(redis.sentinel_auth.username.as_deref(), Some("s"));
        assert!(redis.sentinel_auth.password.is_some() && redis.auth.password.is_none());
        assert!(redis.tls);
        let m = redis_error(&[], &["--redis-url", "redis+sentinel://10.0.0.1:26379"]);
        assert!(m.contains("--redis-url") && m.contains("master"), "{m}");
    }

    /// The book's configuration chapter shows the settings table made from the rows. With
    /// `PET_BLESS=1` the test writes it there instead (after a setting is added or changed).
    #[test]
    fn the_book_shows_the_table_of_the_rows() {
        let path = repo_path("docs/src/operating/configuration.md");
        let chapter = std::fs::read_to_string(&path).unwrap();
        let table = settings_table();
        let start = chapter
            .find("| file key |")
            .expect("the chapter has the settings table");
        let end = chapter[start..]
            .find("\n\n")
            .map_or(chapter.len(), |n| start + n + 1);
        if std::env::var_os("PET_BLESS").is_some() {
            let blessed = format!("{}{table}{}", &chapter[..start], &chapter[end..]);
            std::fs::write(path, blessed).unwrap();
            return;
        }
        assert_eq!(
            &chapter[start..end],
            table,
            "docs/src/operating/configuration.md's settings table is not the rows' \
             (PET_BLESS=1 cargo test -p proxy --lib the_book_shows writes it)"
        );
    }

    fn line_of<'a>(report: &'a str, name: &str) -> Vec<&'a str> {
        let line = report.lines().find(|l| l.starts_with(&format!("{name} ")));
        line.unwrap_or_default().split_whitespace().collect()
    }

    #[test]
    fn the_report_shows_each_value_and_its_layer_but_never_a_secret() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "environment = \"staging\"\nthreads = 3\n");
        let token = "Zm9vYmFyYmF6cXV4cXV1eGNvcmdlZ3JhdWx0Z2FycGx5";
        let env = Env::from_pairs([
            ("PET_GATEWAY_ADMIN_TOKEN", token),
            ("PET_GATEWAY_LISTEN", "127.0.0.1:7001"),
        ]);
        let report = settings_report(Some(&path), &env, &flags(&["--log-format", "json"])).unwrap();
        let line = |name: &str| {
            let line = report.lines().find(|l| l.starts_with(&format!("{name} ")));
            line.unwrap_or_default()
                .split_whitespace()
                .collect::<Vec<_>>()
        };
        assert_eq!(line("environment"), ["environment", "staging", "file"]);
        assert_eq!(line("threads"), ["threads", "3", "file"]);
        assert_eq!(
            line("listen"),
            ["listen", "127.0.0.1:7001", "env", "PET_GATEWAY_LISTEN"]
        );
        assert_eq!(
            line("log_format"),
            ["log_format", "json", "flag", "--log-format"]
        );
        assert_eq!(line("key_prefix"), ["key_prefix", "pet:staging", "default"]);
        assert_eq!(line("admin_token")[1], "(set)");
        assert!(!report.contains(token), "{report}");
        assert_eq!(report.lines().count(), rows().count() + 1, "{report}");
        let unset = settings_report(None, &Env::default(), &Overrides::default()).unwrap();
        assert!(unset.contains("(unset)"), "{unset}");
        let redis = Env::from_pairs([
            (
                "PET_GATEWAY_REDIS_URL",
                "redis://gw:pw1@10.0.0.1,redis://gw:pw1@10.0.0.2",
            ),
            ("PET_GATEWAY_REDIS_SENTINEL_PASSWORD", "pw2"),
        ]);
        let report = settings_report(None, &redis, &Overrides::default());
        assert!(report.is_err(), "a Sentinel password without Sentinels");
        let redis = Env::from_pairs([
            (
                "PET_GATEWAY_REDIS_URL",
                "redis+sentinel://gw:pw1@10.0.0.1,10.0.0.2/main",
            ),
            ("PET_GATEWAY_REDIS_SENTINEL_PASSWORD", "pw2"),
        ]);
        let report = settings_report(None, &redis, &Overrides::default()).unwrap();
        assert!(
            !report.contains("pw1") && !report.contains("pw2"),
            "{report}"
        );
        assert!(
            report.contains("redis+sentinel://gw:***@10.0.0.1,10.0.0.2/main"),
            "{report}"
        );
        assert_eq!(line_of(&report, "redis_sentinel_password")[1], "(set)");
        let cluster = Env::from_pairs([(
            "PET_GATEWAY_REDIS_URL",
            "redis://gw:pw1@10.0.0.1,redis://gw:pw1@10.0.0.2",
        )]);
        let report = settings_report(None, &cluster, &Overrides::default()).unwrap();
        assert!(!report.contains("pw1"), "{report}");
        assert!(
            report.contains("redis://gw:***@10.0.0.1,redis://gw:***@10.0.0.2"),
            "{report}"
        );
        let webhook = Env::from_pairs([
            (
                "PET_GATEWAY_EVENTS_WEBHOOK_URL",
                "https://billing.example.com/in?token=tk-4711",
            ),
            ("PET_GATEWAY_EVENTS_WEBHOOK_SECRET", "0123456789abcdef"),
            ("PET_GATEWAY_EVENTS_SPOOL_DIR", "/tmp/spool"),
        ]);
        let report = settings_report(None, &webhook, &Overrides::default()).unwrap();
        assert!(!report.contains("tk-4711"), "{report}");
        assert!(
            report.contains("https://billing.example.com/in?(hidden)"),
            "{report}"
        );
    }
}
