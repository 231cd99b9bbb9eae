//! The quota store: embedded, or the Redis a fleet shares, and what to do when it fails.

use std::time::Duration;

use super::values::{choice, millis, parse_choice};
use crate::base::redis::RedisAccess;
use crate::config::model::ConfigError;
use crate::config::setting::{Kind, Layers, Origin, Preset, Row, Setting, Sourced, Value};
use crate::quota::admission::OnStoreError;
use crate::quota::store::redis::DEFAULT_BATCH_MAX;

/// A script run blocks the Redis it runs on; past this many decisions one run would hold it for
/// milliseconds, delaying every other client.
const MAX_STORE_BATCH: usize = 1024;

const REDIS_URL: Setting<Option<String>> = Setting::new(
    "redis_url",
    Kind::Text,
    Preset::Absent("absent: embedded store"),
    "shared quota store: `redis://host:port/db` for one Redis (`rediss://` with TLS; a user and \
     password may be in it, `redis://USER:PASSWORD@host:port/db`, but not in the flag, which \
     shows in `ps`), `redis+sentinel://host:port,host:port/MASTER_NAME` (`rediss+sentinel://` \
     with TLS) for a primary found through its Sentinels, `redis+cluster://host:port,host:port,…` \
     (or a comma-separated list of `redis://` URLs) for a Redis Cluster; an empty value selects \
     the embedded store",
    |v| {
        let url = v.text()?;
        if url.trim().is_empty() {
            return Ok(None);
        }
        RedisAccess::from_url(&url)
            .map(|_| Some(url))
            .map_err(|e| format!("not a usable Redis URL: {e}"))
    },
)
.value_name("URL");
const KEY_PREFIX: Setting<String> = Setting::new(
    "key_prefix",
    Kind::Text,
    Preset::Computed("`pet:<environment>`"),
    "prefix of every Redis key; keeps environments apart on one Redis",
    |v| {
        let p = v.text()?;
        if p.is_empty() || p.contains(['{', '}']) {
            Err(
                "must be non-empty and free of '{' and '}' (they are the Redis hash tag)"
                    .to_owned(),
            )
        } else {
            Ok(p)
        }
    },
)
.value_name("P");
pub(super) const ON_STORE_ERROR: Setting<OnStoreError> = Setting::new(
    "on_store_error",
    choice::<OnStoreError>(),
    Preset::Value("local"),
    "when the store fails: `local` (each node holds a key to its windows of a minute or shorter, \
     or its shortest if it has none, on its own; longer windows, the day, pause), `open` \
     (admit), `closed` (503)",
    parse_choice,
)
.value_name("MODE");
const STORE_TIMEOUT_MS: Setting<Duration> = Setting::new(
    "store_timeout_ms",
    Kind::Int,
    Preset::Value("50"),
    "deadline of every quota-store call",
    millis,
);
const STORE_BATCH_MAX: Setting<usize> = Setting::new(
    "store_batch_max",
    Kind::Int,
    Preset::Of(|| Value::Int(DEFAULT_BATCH_MAX as u64)),
    "Redis store: the most decisions one script run carries (group commit: decisions for a Redis \
     node queue while a run to it is in flight, and the next run carries them all; at low load a \
     run carries one, sent at once); 1 sends one run per decision; at most 1024",
    |v| {
        let n = v.int()?;
        if (1..=MAX_STORE_BATCH).contains(&n) {
            Ok(n)
        } else {
            Err(format!("must be from 1 to {MAX_STORE_BATCH}"))
        }
    },
);

const CONCURRENCY_LEASE_SECS: Setting<u64> = Setting::new(
    "concurrency_lease_secs",
    Kind::Int,
    Preset::Of(|| Value::Int(crate::quota::store::memory::DEFAULT_LEASE_SECS)),
    "how long a place among a key's requests in flight (a plan's or key's `concurrency`) is \
     held unless given back: a request that outlives it renews it; a node killed while holding \
     places frees them within this (from 3 to 600; a third of it must exceed `store_timeout_ms` \
     by a second and a half, the time to renew a lease; unset, it is made that long)",
    |v| {
        let n = v.int()?;
        let most = crate::quota::store::memory::MAX_LEASE_SECS;
        if (3..=most).contains(&n) {
            Ok(n)
        } else {
            Err(format!("must be from 3 to {most} seconds (got {n})"))
        }
    },
);

pub const SETTINGS: &[Row] = &[
    REDIS_URL.row,
    KEY_PREFIX.row,
    ON_STORE_ERROR.row,
    STORE_TIMEOUT_MS.row,
    STORE_BATCH_MAX.row,
    CONCURRENCY_LEASE_SECS.row,
];

pub struct Store {
    /// With the layer that gave it: a password in the flag is refused (`redis_access`).
    pub redis_url: Option<Sourced<String>>,
    pub key_prefix: String,
    pub on_store_error: OnStoreError,
    pub store_timeout: Duration,
    pub store_batch_max: usize,
    pub concurrency_lease_secs: u64,
}

pub fn validate(l: &Layers, environment: &str) -> Result<Store, ConfigError> {
    let prefix = Value::Text(format!("pet:{environment}"));
    let store_timeout: Duration = l.value(&STORE_TIMEOUT_MS)?;
    let lease = l.required(&CONCURRENCY_LEASE_SECS)?;
    // A lease is renewed a third of it (two seconds at least) before its end, by a pass every
    // `RENEW_TICK`: a renewal waiting out the store's whole deadline must still land in time,
    // and a lease's end is a whole second of the store's clock (up to a second sooner).
    let margin = crate::quota::concurrency::RENEW_TICK + Duration::from_secs(1);
    let lease_secs = match lease.origin {
        // Unset: the default, made longer for a store deadline too long for it, so that a
        // configuration that never names concurrency does not fail for it.
        Origin::Default => lease
            .value
            .max(3 * (store_timeout + margin).as_secs_f64().ceil() as u64)
            .min(crate::quota::store::memory::MAX_LEASE_SECS),
        _ => lease.value,
    };
    let renew_before = Duration::from_secs((lease_secs / 3).max(2));
    if renew_before < store_timeout + margin {
        return Err(lease.error(format!(
            "{} s leaves too little time to renew a lease before it ends with \
             store_timeout_ms = {}: a third of it must exceed the store's deadline by {} ms",
            lease_secs,
            store_timeout.as_millis(),
            margin.as_millis()
        )));
    }
    Ok(Store {
        redis_url: l.get(&REDIS_URL)?.and_then(Sourced::transpose),
        key_prefix: l.or(&KEY_PREFIX, prefix)?.value,
        on_store_error: l.value(&ON_STORE_ERROR)?,
        store_timeout,
        store_batch_max: l.value(&STORE_BATCH_MAX)?,
        concurrency_lease_secs: lease_secs,
    })
}
