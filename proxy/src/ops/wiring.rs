//! What a node and the command line both open from a [`Config`]: the key registry (through
//! its verify and signing keys), the sink key changes are reported to, and the deadline of
//! the start-up check on Redis. Here, below both, so that `server` and `commands` share them
//! without importing each other.

use std::time::Duration;

use crate::config::Config;

/// How long the start-up check gives each step (a Sentinel lookup, a connection, `PING`).
pub const REDIS_CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// The key registry on `redis`, reading through the configured verify keys and signing with the
/// configured signing key: for a node and for the `keys` commands alike. `for_changes`: the one
/// key changes go through, which logs in as `registry_admin_username` when that is set.
pub fn open_registry(
    config: &Config,
    redis: &crate::base::redis::RedisAccess,
    timeout: Duration,
    for_changes: bool,
) -> Result<crate::keys::registry::Registry, String> {
    let mut redis = redis.clone();
    if let (true, Some(admin)) = (for_changes, &config.registry_admin) {
        redis.auth = admin.clone();
    }
    let verify = crate::keys::signing::VerifyKeys::parse(&config.registry_verify_keys)
        .map_err(|e| format!("registry_verify_keys: {e}"))?;
    let signer = match &config.registry_signing_key_file {
        Some(path) => Some(
            crate::keys::signing::SigningKey::load(path)
                .map_err(|e| format!("registry_signing_key_file: {e}"))?,
        ),
        None => None,
    };
    let registry = crate::keys::registry::Registry::connecting(redis, &config.key_prefix, timeout);
    let binding =
        crate::keys::signing::Binding::new(&config.environment, config.registry_signature_binding);
    Ok(registry.with_trust(crate::keys::registry::Trust {
        verify,
        signer,
        binding,
    }))
}

/// Where the key service reports its changes: the metering file and the webhook's spool, when
/// there are any (the `keys` commands and the admin API alike).
pub fn key_changes(
    config: &Config,
) -> Option<std::sync::Arc<dyn crate::keys::service::ChangeSink>> {
    let spool = config
        .events_webhook
        .as_ref()
        .map(|w| crate::events::webhook::spool::Spool::new(&w.spool_dir, w.spool_max_bytes));
    if config.metering_file.is_none() && spool.is_none() {
        return None;
    }
    Some(std::sync::Arc::new(
        crate::events::lifecycle::KeyChanges::new(
            &config.environment,
            &config.node_id,
            config.metering_file.clone(),
            spool,
        ),
    ))
}
