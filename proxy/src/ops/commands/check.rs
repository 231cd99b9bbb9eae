//! `pet-gateway check`: the config, the plans and the keys file validated as `serve` would, and
//! Redis asked once as `serve` asks it at start-up.

use crate::base::redis::RedisAccess;
use crate::config::Env;
use crate::keys::catalog::Snapshot;
use crate::ops::cli::ConfigArgs;

pub fn check(args: ConfigArgs) -> Result<(), String> {
    let config = super::load(args.config.as_deref(), &args.overrides)?;
    crate::config::events_ready(&config)?;
    let snapshot =
        Snapshot::load(&config.keys_file, &config.plans_dir).map_err(|e| e.to_string())?;
    let redis = match &config.redis {
        Some(redis) => Some(redis_state(redis)?),
        None => None,
    };
    let ignored = snapshot.plans.ignored_warning(&config.plans_dir);
    let unknown = Env::process().unknown();
    for warning in config.warnings().into_iter().chain(ignored).chain(unknown) {
        eprintln!("warning: {warning}");
    }
    println!(
        "ok: environment `{}`, listen {}, {} upstream(s), store {}, plans {} ({}), {} active key(s) in {}",
        config.environment,
        config.listen,
        config.upstreams.len(),
        if config.redis_url.is_some() { "redis" } else { "embedded" },
        snapshot.plans.names().join(", "),
        config.plans_dir.display(),
        snapshot.keys.len(),
        config.keys_file.display(),
    );
    if let Some(state) = redis {
        println!("redis: {state}");
    }
    let file = args.config.as_deref();
    let report = crate::config::settings_report(file, &Env::process(), &args.overrides);
    print!("{}", report.map_err(|e| e.to_string())?);
    Ok(())
}

/// Connects to Redis as `serve` does at start-up: settings that cannot work (a wrong password
/// or CA, a master no Sentinel knows, an unreadable file) are an error naming the setting. A
/// Redis that does not answer from where `check` runs is no fault of the config (`serve`
/// would start, `on_store_error` deciding until it answers): said, not failed.
fn redis_state(redis: &RedisAccess) -> Result<String, String> {
    match redis.probe_blocking(crate::ops::wiring::REDIS_CHECK_TIMEOUT) {
        Ok(()) => Ok(format!("{} answers", redis.describe())),
        Err(e) if e.is_fatal() => Err(e.to_string()),
        Err(e) => Ok(format!(
            "does not answer from here ({e}); `serve` would start anyway, with on_store_error \
             deciding until it does"
        )),
    }
}
