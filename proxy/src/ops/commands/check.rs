//! `pet-gateway check`: the config, the plans and the keys file validated as `serve` would.

use crate::config::Env;
use crate::keys::catalog::Snapshot;
use crate::ops::cli::ConfigArgs;

pub fn check(args: ConfigArgs) -> Result<(), String> {
    let config = super::load(args.config.as_deref(), &args.overrides)?;
    let snapshot =
        Snapshot::load(&config.keys_file, &config.plans_dir).map_err(|e| e.to_string())?;
    let ignored = snapshot.plans.ignored_warning(&config.plans_dir);
    for warning in config.warnings().into_iter().chain(ignored) {
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
