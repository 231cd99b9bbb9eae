//! What each command does, one file per command: [`serve`], [`check`], [`keys`], [`bans`],
//! [`registry`], [`usage`], [`health`],
//! with the output helpers they share in [`output`]. Errors end here as one clear line on
//! standard error and a non-zero exit code.

mod bans;
mod check;
mod health;
mod keys;
mod output;
mod registry;
mod serve;
mod usage;

use std::process::ExitCode;

use crate::config::{Config, Env, Overrides};
use crate::ops::cli::{Cli, Command};

pub fn run(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Command::Serve(args) => serve::serve(args),
        Command::Check(args) => check::check(args),
        Command::Keys(cmd) => keys::keys_command(cmd),
        Command::Bans(cmd) => bans::bans_command(cmd),
        Command::Registry(cmd) => registry::registry_command(cmd),
        Command::Usage(cmd) => usage::usage_command(cmd),
        Command::Health { admin, ready } => health::health(&admin, ready),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("pet-gateway: {message}");
            ExitCode::FAILURE
        }
    }
}

/// The config as this process's file, environment and flags give it.
fn load(file: Option<&std::path::Path>, flags: &Overrides) -> Result<Config, String> {
    Config::load(file, &Env::process(), flags).map_err(|e| e.to_string())
}

/// The settings a `keys` or `bans` command reads from the environment.
const ADMIN_COMMAND_SETTINGS: &[&str] = &[
    "keys_source",
    "redis_url",
    "redis_username",
    "redis_password",
    "redis_password_file",
    "redis_tls_ca_file",
    "redis_tls_cert_file",
    "redis_tls_key_file",
    "redis_sentinel_username",
    "redis_sentinel_password",
    "redis_sentinel_password_file",
    "key_prefix",
    "keys_file",
    "plans_dir",
    "admin_listen",
    "audit_log",
    "admin_token",
    "registry_verify_keys",
    "registry_signing_key_file",
    "registry_signature_binding",
    "registry_admin_username",
    "registry_admin_password",
    "registry_admin_password_file",
    // Key changes are reported as events by whoever makes them, in their environment.
    "environment",
    "node_id",
    "metering_file",
    "events_webhook_url",
    "events_spool_dir",
    "events_spool_max_mb",
];

/// The same, reading only the variables a `keys` or `bans` command uses: a bad unrelated
/// variable must never stop, say, revoking a leaked key.
fn load_for_admin(file: Option<&std::path::Path>, flags: &Overrides) -> Result<Config, String> {
    let env = Env::process().only(ADMIN_COMMAND_SETTINGS);
    Config::load(file, &env, flags).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_setting_the_keys_and_bans_commands_read_has_a_variable() {
        for name in ADMIN_COMMAND_SETTINGS {
            assert!(crate::config::env_var(name).is_some(), "{name}");
        }
    }
}
