//! The config file's layer: the TOML shape, and its translation into a [`Layer`]. Relative paths
//! in a file are relative to that file's directory, so a config works from wherever the gateway
//! is started.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{ConfigError, KeysSource, Layer, LogFormat, OnStoreError};

/// Every field is optional: the layers above and the defaults fill the rest.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    environment: Option<String>,
    listen: Option<String>,
    admin_listen: Option<String>,
    admin_token: Option<String>,
    upstreams: Option<Vec<String>>,
    redis_url: Option<String>,
    key_prefix: Option<String>,
    api_key_prefix: Option<String>,
    keys_source: Option<KeysSource>,
    audit_log: Option<PathBuf>,
    keys_file: Option<PathBuf>,
    plans_dir: Option<PathBuf>,
    store_timeout_ms: Option<u64>,
    store_batch_max: Option<usize>,
    on_store_error: Option<OnStoreError>,
    threads: Option<usize>,
    work_stealing: Option<bool>,
    upstream_keepalive_pool_size: Option<usize>,
    unauthenticated_per_minute: Option<u32>,
    unauthenticated_ipv6_prefix: Option<u8>,
    unauthenticated_max_tracked: Option<usize>,
    trusted_proxies: Option<Vec<String>>,
    request_header_timeout_ms: Option<u64>,
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

/// Reads and parses `path` into a layer.
pub fn read(path: &Path) -> Result<Layer, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    let f: FileConfig = toml::from_str(&text).map_err(|e| ConfigError::Invalid {
        source_name: path.display().to_string(),
        message: e.to_string().trim_end().to_owned(),
    })?;
    let base = path.parent().map(Path::to_owned).unwrap_or_default();
    let here = |p: Option<PathBuf>| p.map(|p| if p.is_absolute() { p } else { base.join(p) });
    let ban = f.ban.unwrap_or_default();
    Ok(Layer {
        environment: f.environment,
        listen: f.listen,
        admin_listen: f.admin_listen,
        admin_token: f.admin_token,
        upstreams: f.upstreams,
        redis_url: f.redis_url,
        key_prefix: f.key_prefix,
        api_key_prefix: f.api_key_prefix,
        keys_source: f.keys_source,
        audit_log: here(f.audit_log),
        keys_file: here(f.keys_file),
        plans_dir: here(f.plans_dir),
        store_timeout_ms: f.store_timeout_ms,
        store_batch_max: f.store_batch_max,
        on_store_error: f.on_store_error,
        threads: f.threads,
        work_stealing: f.work_stealing,
        upstream_keepalive_pool_size: f.upstream_keepalive_pool_size,
        unauthenticated_per_minute: f.unauthenticated_per_minute,
        unauthenticated_ipv6_prefix: f.unauthenticated_ipv6_prefix,
        unauthenticated_max_tracked: f.unauthenticated_max_tracked,
        trusted_proxies: f.trusted_proxies,
        request_header_timeout_ms: f.request_header_timeout_ms,
        upstream_connect_timeout_ms: f.upstream_connect_timeout_ms,
        upstream_read_timeout_ms: f.upstream_read_timeout_ms,
        client_read_timeout_ms: f.client_read_timeout_ms,
        reload_interval_ms: f.reload_interval_ms,
        tls_cert: here(f.tls_cert),
        tls_key: here(f.tls_key),
        log_format: f.log_format,
        grace_period_secs: f.grace_period_secs,
        shutdown_timeout_secs: f.shutdown_timeout_secs,
        upgrade_sock: here(f.upgrade_sock),
        ban_strikes: ban.strikes,
        ban_durations_secs: ban.durations_secs,
        ban_decay_secs: ban.decay_secs,
    })
}
