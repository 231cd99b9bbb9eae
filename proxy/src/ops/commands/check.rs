//! `pet-gateway check`: the config, the plans and the keys file validated as `serve` would.

use crate::base::redis::RedisAccess;
use crate::config::Env;
use crate::keys::catalog::Snapshot;
use crate::ops::cli::ConfigArgs;

pub fn check(args: ConfigArgs) -> Result<(), String> {
    let config = super::load(args.config.as_deref(), &args.overrides)?;
    let snapshot =
        Snapshot::load(&config.keys_file, &config.plans_dir).map_err(|e| e.to_string())?;
    let ignored = snapshot.plans.ignored_warning(&config.plans_dir);
    let unreachable = match &config.redis {
        Some(redis) => redis_warning(redis)?,
        None => None,
    };
    for warning in config
        .warnings()
        .into_iter()
        .chain(ignored)
        .chain(unreachable)
    {
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
    let file = args.config.as_deref();
    let report = crate::config::settings_report(file, &Env::process(), &args.overrides);
    print!("{}", report.map_err(|e| e.to_string())?);
    Ok(())
}

/// Connects to Redis as `serve` does at start-up: settings that cannot work are an error
/// naming the setting; a Redis that does not answer is only a warning (a gateway started now
/// would start, with `on_store_error` deciding until Redis answers).
fn redis_warning(redis: &RedisAccess) -> Result<Option<String>, String> {
    match redis.probe_blocking(crate::ops::server::REDIS_CHECK_TIMEOUT) {
        Ok(()) => Ok(None),
        Err(e) if e.is_fatal() => Err(format!("Redis: {e}")),
        Err(e) => Ok(Some(format!(
            "Redis does not answer now ({e}); `serve` would start anyway, with on_store_error \
             deciding until it does"
        ))),
    }
}
