//! What each command does. Errors end here as one clear line on standard error and a non-zero
//! exit code.

use std::process::ExitCode;

use crate::admin::{AdminClient, Bans};
use crate::catalog::Snapshot;
use crate::cli::{
    AdminArgs, BansCommand, Cli, Command, ConfigArgs, KeyFiles, KeysCommand, ServeArgs,
};
use crate::config::{Config, Env, KeysSource, LogFormat, Overrides};
use crate::keys::{self, KeysFile};
use crate::plans::Plans;

pub fn run(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Command::Serve(args) => serve(args),
        Command::Check(args) => check(args),
        Command::Keys(cmd) => keys_command(cmd),
        Command::Bans(cmd) => bans_command(cmd),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("pet-gateway: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Logs go to standard error through a background writer: a slow or blocked stderr (a full
/// pipe, a stalled journald) must never stall a proxy thread inside a request. When the buffer
/// is full, lines are dropped rather than waited for. Keep the guard alive until exit: dropping
/// it flushes what is buffered.
fn init_logging(format: LogFormat) -> tracing_appender::non_blocking::WorkerGuard {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let (writer, guard) = tracing_appender::non_blocking(std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    let _ = match format {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
    };
    guard
}

fn serve(args: ServeArgs) -> Result<(), String> {
    let c = &args.config;
    let config = load(c.config.as_deref(), &c.overrides)?;
    let _flush_on_exit = init_logging(config.log_format);
    for warning in config.warnings() {
        tracing::warn!("{warning}");
    }
    crate::server::run(
        config,
        args.upgrade,
        Box::new(pingora::server::UnixShutdownSignalWatch),
    )
    .map_err(|e| e.to_string())
}

fn check(args: ConfigArgs) -> Result<(), String> {
    let config = load(args.config.as_deref(), &args.overrides)?;
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

/// The config as this process's file, environment and flags give it.
fn load(file: Option<&std::path::Path>, flags: &Overrides) -> Result<Config, String> {
    Config::load(file, &Env::process(), flags).map_err(|e| e.to_string())
}

/// The same, reading only the variables a `keys` or `bans` command uses: a bad unrelated
/// variable must never stop, say, revoking a leaked key.
fn load_for_admin(file: Option<&std::path::Path>, flags: &Overrides) -> Result<Config, String> {
    let env = Env::process().only(&[
        "PET_GATEWAY_KEYS_SOURCE",
        "PET_GATEWAY_REDIS_URL",
        "PET_GATEWAY_KEY_PREFIX",
        "PET_GATEWAY_KEYS_FILE",
        "PET_GATEWAY_PLANS_DIR",
        "PET_GATEWAY_ADMIN_LISTEN",
        "PET_GATEWAY_AUDIT_LOG",
        "PET_GATEWAY_ADMIN_TOKEN",
    ]);
    Config::load(file, &env, flags).map_err(|e| e.to_string())
}

fn key_config(files: &KeyFiles, admin_listen: Option<&str>) -> Result<Config, String> {
    let over = files.overrides.0.clone().with("admin_listen", admin_listen);
    load_for_admin(files.config.as_deref(), &over)
}

/// Where the `keys` commands read and write: the keys file, or the registry
/// (`keys_source = "store"`).
fn key_store(config: &Config) -> Result<keys::KeyStore, String> {
    match (config.keys_source, &config.redis_url) {
        (KeysSource::Store, Some(url)) => Ok(keys::KeyStore::Registry(std::sync::Arc::new(
            crate::registry::Registry::new(
                url,
                &config.key_prefix,
                std::time::Duration::from_secs(2),
            )
            .map_err(|e| e.to_string())?,
        ))),
        _ => Ok(keys::KeyStore::File(config.keys_file.clone())),
    }
}

fn keys_command(cmd: KeysCommand) -> Result<(), String> {
    match cmd {
        KeysCommand::Issue {
            files,
            plan,
            name,
            expires_in,
            expires_at,
            per_minute,
            per_day,
        } => {
            let config = key_config(&files, None)?;
            let plans = Plans::load_dir(&config.plans_dir).map_err(|e| e.to_string())?;
            let own = keys::KeyRecordOptions::checked(
                expires_in.as_deref(),
                expires_at.as_deref(),
                per_minute,
                per_day,
            )?;
            let (record, key) = keys::issue(
                &key_store(&config)?,
                &plans,
                &plan,
                name.as_deref(),
                &config.api_key_prefix,
                &own,
            )
            .map_err(|e| e.to_string())?;
            println!(
                "issued {} (plan {}) in {}; the key is shown only now:",
                record.id,
                record.plan,
                where_keys(&config)
            );
            println!("{key}");
            // After the key is shown: a failed audit line must not lose a key already made.
            audit(&config, "issue", &record)
        }
        KeysCommand::List {
            files,
            admin_listen,
            json,
        } => {
            let config = key_config(&files, admin_listen.as_deref())?;
            let file = key_store(&config)?.load().map_err(|e| e.to_string())?;
            // The table first, whole; a note about it after, on its own line, so that a
            // terminal showing both streams never runs the note into the last row.
            let (bans, note) = match fetch_bans(&AdminClient::of(&config)) {
                Ok(bans) => (Some(bans), None),
                Err(e) => (None, Some(format!("note: ban status unknown: {e}"))),
            };
            let now = crate::clock::unix_now();
            if json {
                let admin = AdminClient::of(&config);
                // Usage from the running gateway (one call per key still in use), when it
                // answers; otherwise `usage` is null and `usage_error` says why.
                let mut reachable = bans.is_some();
                let list: Vec<serde_json::Value> = file
                    .keys
                    .iter()
                    .map(|k| {
                        let status = k.status(ban_of(bans.as_ref(), &k.id), now);
                        let mut v = k.to_json(&status, bans.is_some());
                        v["usage"] = serde_json::Value::Null;
                        if reachable && k.revoked_at.is_none() && status != "expired" {
                            match admin.call("GET", &format!("/keys/{}", k.id)) {
                                Ok((200, body)) => {
                                    let live: serde_json::Value =
                                        serde_json::from_str(&body).unwrap_or_default();
                                    v["usage"] = live["usage"].clone();
                                    v["limits"] = live["limits"].clone();
                                }
                                Ok((code, _)) => {
                                    v["usage_error"] = format!("gateway answered {code}").into()
                                }
                                Err(e) => {
                                    reachable = false;
                                    v["usage_error"] = e.into();
                                }
                            }
                        }
                        v
                    })
                    .collect();
                println!("{}", serde_json::Value::Array(list));
                return Ok(());
            }
            let mut table = format!(
                "{:<18} {:<12} {:<32} {:<22} NAME\n",
                "ID", "PLAN", "STATUS", "CREATED"
            );
            for k in &file.keys {
                table.push_str(&format!(
                    "{:<18} {:<12} {:<32} {:<22} {}\n",
                    k.id,
                    k.plan,
                    k.status(ban_of(bans.as_ref(), &k.id), now),
                    k.created_at,
                    k.name.as_deref().unwrap_or("-")
                ));
            }
            print!("{table}");
            use std::io::Write as _;
            let _ = std::io::stdout().flush();
            if let Some(note) = note {
                eprintln!("\n{note}");
            }
            Ok(())
        }
        KeysCommand::Show {
            files,
            admin_listen,
            json,
            id,
        } => {
            let config = key_config(&files, admin_listen.as_deref())?;
            let file = key_store(&config)?.load().map_err(|e| e.to_string())?;
            let record = file.get(&id).map_err(|e| e.to_string())?;
            let admin = AdminClient::of(&config);
            let bans = fetch_bans(&admin).ok();
            let status = record.status(ban_of(bans.as_ref(), &record.id), crate::clock::unix_now());
            let mut shown = record.to_json(&status, bans.is_some());
            // What the running gateway knows: the limits in force and the usage.
            let live =
                admin
                    .call("GET", &format!("/keys/{id}"))
                    .and_then(|(code, body)| match code {
                        200 => serde_json::from_str::<serde_json::Value>(&body)
                            .map_err(|e| format!("unexpected answer from the gateway: {e}")),
                        404 => Err("the gateway does not accept this key".to_owned()),
                        other => Err(format!("the gateway answered {other}: {body}")),
                    });
            let usage_note = match live {
                Ok(live) => {
                    shown["limits"] = live["limits"].clone();
                    shown["usage"] = live["usage"].clone();
                    live["usage_error"].as_str().map(str::to_owned)
                }
                Err(e) => Some(e),
            };
            if json {
                shown["usage_error"] = serde_json::json!(usage_note);
                println!("{shown}");
                return Ok(());
            }
            let field = |name: &str| match &shown[name] {
                serde_json::Value::Null => "-".to_owned(),
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            for name in [
                "id",
                "name",
                "plan",
                "status",
                "created_at",
                "expires_at",
                "revoked_at",
            ] {
                println!("{:<12} {}", format!("{name}:"), field(name));
            }
            let limits = &shown["limits"];
            let usage = &shown["usage"];
            if usage.is_object() {
                println!(
                    "{:<12} {} of {} this minute, {} of {} today (UTC)",
                    "usage:",
                    usage["minute"],
                    limits["per_minute"],
                    usage["day"],
                    limits["per_day"]
                );
                println!("{:<12} {}", "429s today:", usage["refused_today"]);
                println!(
                    "{:<12} {}",
                    "last used:",
                    usage["last_used"].as_str().unwrap_or("-")
                );
            }
            if let Some(note) = usage_note {
                eprintln!("\nnote: usage unknown: {note}");
            }
            Ok(())
        }
        KeysCommand::ResetUsage {
            files,
            admin_listen,
            id,
        } => {
            let config = key_config(&files, admin_listen.as_deref())?;
            let file = key_store(&config)?.load().map_err(|e| e.to_string())?;
            file.get(&id).map_err(|e| e.to_string())?;
            let (code, body) =
                AdminClient::of(&config).call("POST", &format!("/keys/{id}/reset-usage"))?;
            if code != 200 {
                return Err(format!("the gateway answered {code}: {body}"));
            }
            // The gateway writes the audit line (who: admin): the change is made there.
            println!("reset the usage of {id} for this minute and this UTC day");
            Ok(())
        }
        KeysCommand::Import { files, from } => {
            let config = key_config(&files, None)?;
            let crate::keys::KeyStore::Registry(registry) = key_store(&config)? else {
                return Err(
                    "keys import copies a keys file into the key registry: run it with \
                     keys_source = \"store\" (and redis_url) in the config or \
                     PET_GATEWAY_KEYS_SOURCE=store"
                        .into(),
                );
            };
            let from = from.unwrap_or_else(|| config.keys_file.clone());
            let file = KeysFile::load(&from).map_err(|e| e.to_string())?;
            let (added, kept) = registry.import(&file.keys).map_err(|e| e.to_string())?;
            println!(
                "imported {added} key(s) from {} into {}; {kept} were there already and keep \
                 the registry's version",
                from.display(),
                where_keys(&config)
            );
            for record in &file.keys {
                audit(&config, "import", record)?;
            }
            Ok(())
        }
        KeysCommand::Rotate { files, overlap, id } => {
            let config = key_config(&files, None)?;
            let overlap =
                crate::clock::parse_duration(&overlap).map_err(|e| format!("--overlap: {e}"))?;
            let (old, new, key) =
                keys::rotate(&key_store(&config)?, &id, overlap, &config.api_key_prefix)
                    .map_err(|e| e.to_string())?;
            println!(
                "rotated {} to {} (plan {}, one quota); {} works until {}; the new key is \
                 shown only now:",
                old.id,
                new.id,
                new.plan,
                old.id,
                old.expires_at.as_deref().unwrap_or("?")
            );
            println!("{key}");
            audit(&config, "rotate", &old)
        }
        KeysCommand::Revoke {
            files,
            admin_listen,
            id,
        } => {
            let config = key_config(&files, admin_listen.as_deref())?;
            let record = keys::revoke(&key_store(&config)?, &id).map_err(|e| e.to_string())?;
            audit(&config, "revoke", &record)?;
            println!(
                "revoked {} (plan {}) in {} at {}",
                record.id,
                record.plan,
                where_keys(&config),
                record.revoked_at.as_deref().unwrap_or("?")
            );
            if config.keys_source == KeysSource::Store {
                // In the registry: every node applies it from the change feed within a second.
                println!("in force: the registry holds it; every node applies it within a second");
                return Ok(());
            }
            confirm_revoked(&AdminClient::of(&config), &config.keys_file, &record.id)
                .map_err(|why| format!("the revocation is NOT confirmed in force: {why}"))?;
            println!(
                "in force: the gateway at {} refuses {} now",
                config.admin_listen, record.id
            );
            Ok(())
        }
    }
}

/// Where the keys are, for messages.
fn where_keys(config: &Config) -> String {
    match config.keys_source {
        KeysSource::Store => format!("the key registry ({})", config.key_prefix),
        KeysSource::File => config.keys_file.display().to_string(),
    }
}

/// When the gateway's list says `id` is banned: until when (RFC 3339).
fn ban_of<'a>(bans: Option<&'a Bans>, id: &str) -> Option<&'a str> {
    bans?
        .bans
        .iter()
        .find(|b| b.key_id == id)
        .map(|b| b.until_utc.as_str())
}

/// Logs a key change; the change is made already, so a failure says so.
fn audit(config: &Config, action: &str, record: &keys::KeyRecord) -> Result<(), String> {
    let line = crate::audit::line(action, record, &crate::audit::os_user());
    crate::audit::write(config.audit_log.as_deref(), &line).map_err(|e| {
        format!(
            "{action} of {} is done, but it could not be written to the audit log: {e}",
            record.id
        )
    })
}

/// Asks the running gateway to reload its keys now, checks that it serves this keys file, and
/// whether it still accepts `id`.
fn confirm_revoked(
    admin: &AdminClient,
    keys_file: &std::path::Path,
    id: &str,
) -> Result<(), String> {
    let addr = admin.addr;
    let (status, body) = admin.call("POST", "/reload")?;
    if status != 200 {
        return Err(format!("the gateway answered {status} to a reload: {body}"));
    }
    let answer: serde_json::Value = serde_json::from_str(&body)
        .map_err(|e| format!("unexpected answer from the gateway: {e}"))?;
    let mine = std::fs::canonicalize(keys_file).unwrap_or(keys_file.to_owned());
    let Some(served) = answer["keys_file"].as_str() else {
        return Err(format!(
            "the gateway at {addr} does not say which keys file it serves (an older version?)"
        ));
    };
    if std::path::Path::new(served) != mine {
        return Err(format!(
            "the gateway at {addr} serves the keys file {served}, not {}; give the right \
             --admin-listen or --config",
            mine.display()
        ));
    }
    if let Some(reason) = answer["keys_refused"].as_str() {
        return Err(format!(
            "the gateway at {addr} refuses the keys file and keeps its previous keys: {reason}"
        ));
    }
    let (status, body) = admin.call("GET", &format!("/keys/{id}"))?;
    match status {
        404 => Ok(()),
        200 => Err(format!(
            "the gateway at {addr} still accepts {id} after reloading"
        )),
        other => Err(format!("the gateway answered {other}: {body}")),
    }
}

fn admin_of(args: &AdminArgs) -> Result<AdminClient, String> {
    let over = Overrides::default().with("admin_listen", args.admin_listen.as_deref());
    Ok(AdminClient::of(&load_for_admin(
        args.config.as_deref(),
        &over,
    )?))
}

fn fetch_bans(admin: &AdminClient) -> Result<Bans, String> {
    let (status, body) = admin.call("GET", "/bans")?;
    if status != 200 {
        return Err(format!("the gateway answered {status}: {body}"));
    }
    serde_json::from_str(&body).map_err(|e| format!("unexpected answer from the gateway: {e}"))
}

fn bans_command(cmd: BansCommand) -> Result<(), String> {
    match cmd {
        BansCommand::List { admin } => {
            let bans = fetch_bans(&admin_of(&admin)?)?;
            println!("{:<18} {:<12} UNTIL", "ID", "PLAN");
            for b in &bans.bans {
                println!("{:<18} {:<12} {}", b.key_id, b.plan, b.until_utc);
            }
            Ok(())
        }
        BansCommand::Lift { admin, id } => {
            let client = admin_of(&admin)?;
            let (status, body) = client.call("POST", &format!("/bans/{id}/lift"))?;
            if status != 200 {
                return Err(format!("the gateway answered {status}: {body}"));
            }
            let lifted = body.contains("\"lifted\":true");
            println!(
                "{}",
                if lifted {
                    format!("lifted the ban of {id}")
                } else {
                    format!("{id} was not banned")
                }
            );
            Ok(())
        }
    }
}
