//! What each command does. Errors end here as one clear line on standard error and a non-zero
//! exit code.

use std::process::ExitCode;

use crate::catalog::Snapshot;
use crate::cli::{Cli, Command, KeyFiles, KeysCommand, ServeArgs};
use crate::config::{Config, Overrides};
use crate::keys::{self, KeysFile};
use crate::plans::Plans;

pub fn run(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Command::Serve(args) => serve(args),
        Command::Check(args) => check(args),
        Command::Keys(cmd) => keys_command(cmd),
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
fn init_logging() -> tracing_appender::non_blocking::WorkerGuard {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let (writer, guard) = tracing_appender::non_blocking(std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    guard
}

fn serve(args: ServeArgs) -> Result<(), String> {
    let _flush_on_exit = init_logging();
    let config =
        Config::load(args.config.as_deref(), &args.overrides).map_err(|e| e.to_string())?;
    crate::server::run(config, Box::new(pingora::server::UnixShutdownSignalWatch))
        .map_err(|e| e.to_string())
}

fn check(args: ServeArgs) -> Result<(), String> {
    let config =
        Config::load(args.config.as_deref(), &args.overrides).map_err(|e| e.to_string())?;
    let snapshot =
        Snapshot::load(&config.keys_file, &config.plans_dir).map_err(|e| e.to_string())?;
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
    Ok(())
}

fn key_config(files: &KeyFiles) -> Result<Config, String> {
    let over = Overrides {
        keys_file: files.keys_file.clone(),
        plans_dir: files.plans_dir.clone(),
        ..Overrides::default()
    };
    Config::load(files.config.as_deref(), &over).map_err(|e| e.to_string())
}

fn keys_command(cmd: KeysCommand) -> Result<(), String> {
    match cmd {
        KeysCommand::Issue { files, plan, name } => {
            let config = key_config(&files)?;
            let plans = Plans::load_dir(&config.plans_dir).map_err(|e| e.to_string())?;
            let (record, key) = keys::issue(&config.keys_file, &plans, &plan, name.as_deref())
                .map_err(|e| e.to_string())?;
            println!(
                "issued {} (plan {}) in {}; the key is shown only now:",
                record.id,
                record.plan,
                config.keys_file.display()
            );
            println!("{key}");
            Ok(())
        }
        KeysCommand::List { files } => {
            let config = key_config(&files)?;
            let file = KeysFile::load(&config.keys_file).map_err(|e| e.to_string())?;
            println!(
                "{:<18} {:<12} {:<9} {:<22} NAME",
                "ID", "PLAN", "STATUS", "CREATED"
            );
            for k in &file.keys {
                println!(
                    "{:<18} {:<12} {:<9} {:<22} {}",
                    k.id,
                    k.plan,
                    if k.revoked_at.is_some() {
                        "revoked"
                    } else {
                        "active"
                    },
                    k.created_at,
                    k.name.as_deref().unwrap_or("-")
                );
            }
            Ok(())
        }
        KeysCommand::Revoke { files, id } => {
            let config = key_config(&files)?;
            let record = keys::revoke(&config.keys_file, &id).map_err(|e| e.to_string())?;
            println!(
                "revoked {} (plan {}) at {}",
                record.id,
                record.plan,
                record.revoked_at.as_deref().unwrap_or("?")
            );
            Ok(())
        }
    }
}
