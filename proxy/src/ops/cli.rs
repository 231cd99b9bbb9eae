//! The command line: a stable contract that operators and tests script against.

use std::path::PathBuf;

use clap::{ArgMatches, Args, FromArgMatches, Parser, Subcommand};

use crate::config::{FlagSet, Overrides};
use crate::keys::record::NewKey;

#[derive(Debug, Parser)]
#[command(
    name = "pet-gateway",
    version,
    about = "Edge gateway for the pet adoption API"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the gateway.
    Serve(ServeArgs),
    /// Validate the config, the plans and the keys file; exit non-zero naming what is wrong.
    Check(ConfigArgs),
    /// Issue, list and revoke API keys.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// List and lift bans, through the running gateway's admin listener.
    #[command(subcommand)]
    Bans(BansCommand),
    /// The fleet's signing key for key records: make one, sign an existing registry.
    #[command(subcommand)]
    Registry(RegistryCommand),
    /// What quota holders spend, through the running gateway's admin listener.
    #[command(subcommand)]
    Usage(UsageCommand),
    /// Ask the running gateway whether it is alive (`/healthz`) or ready (`/readyz`) and exit
    /// 0 when it answers 200, 1 otherwise (with why): a container's `HEALTHCHECK` and a
    /// Kubernetes probe, where there is no curl and the admin listener wants its token.
    Health {
        #[command(flatten)]
        admin: AdminArgs,
        /// Ask `/readyz` (the config loaded, a backend accepting connections, the quota store
        /// answering or covered for) instead of `/healthz` (the process serves).
        #[arg(long)]
        ready: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum UsageCommand {
    /// The keys and customers that spent the most units this UTC day or month, heaviest first
    /// (as of the nodes' last flush, about a second behind).
    Top {
        #[command(flatten)]
        admin: AdminArgs,
        /// The period: this UTC `day` or this UTC `month`.
        #[arg(long, value_name = "PERIOD", default_value = "day",
              value_parser = clap::builder::PossibleValuesParser::new(["day", "month"]))]
        window: String,
        /// How many holders, 1 to 1000.
        #[arg(long, value_name = "N", default_value_t = 10,
              value_parser = clap::value_parser!(u16).range(1..=1000))]
        limit: u16,
        /// The admin API's JSON body on standard output, nothing else.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum RegistryCommand {
    /// Write a new Ed25519 signing key to FILE (mode 0600; an existing file is never
    /// overwritten) and print its public key, the form `registry_verify_keys` takes.
    Keygen {
        /// Where the private key goes.
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
    },
    /// Sign every record of the key registry that the signing key has not signed yet (records
    /// from before signing, or signed by a retired key), or signed unbound where
    /// `registry_signature_binding` is `sign` or `require`, each at a higher version.
    Sign {
        #[command(flatten)]
        files: KeyFiles,
    },
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Take the listening sockets over from the running gateway of the same environment and port
    /// (send it SIGQUIT after starting this one): a restart without dropped requests.
    #[arg(long)]
    pub upgrade: bool,
}

#[derive(Debug, Args)]
pub struct ConfigArgs {
    /// Config file (TOML). Flags and environment variables override it.
    #[arg(long, env = "PET_GATEWAY_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub overrides: Overrides,
}

/// Where the keys file and plans are: from `--config`, or given directly.
#[derive(Debug, Args)]
pub struct KeyFiles {
    /// Config file naming the keys file and plans directory.
    #[arg(long, env = "PET_GATEWAY_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub overrides: KeyOverrides,
}

/// The `keys` commands' flags, from the settings' table: the key store's settings, and
/// `--audit-log`, which only these commands take (`serve` changes no key).
const KEYS_COMMAND_FLAGS: FlagSet = FlagSet::Named(&[
    "keys_file",
    "plans_dir",
    "keys_source",
    "redis_url",
    "redis_username",
    "redis_password_file",
    "redis_tls_ca_file",
    "redis_tls_cert_file",
    "redis_tls_key_file",
    "redis_sentinel_username",
    "redis_sentinel_password_file",
    "audit_log",
    "registry_verify_keys",
    "registry_signing_key_file",
    "registry_signature_binding",
    "registry_admin_username",
    "registry_admin_password_file",
]);

#[derive(Debug, Clone, Default)]
pub struct KeyOverrides(pub Overrides);

impl Args for KeyOverrides {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        Overrides::add_args(cmd, KEYS_COMMAND_FLAGS)
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Overrides::add_args(cmd, KEYS_COMMAND_FLAGS)
    }
}

impl FromArgMatches for KeyOverrides {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        Ok(KeyOverrides(Overrides::from_matches(m, KEYS_COMMAND_FLAGS)))
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        self.0 = Overrides::from_matches(m, KEYS_COMMAND_FLAGS);
        Ok(())
    }
}

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Create a key; prints it once, alone on the last line.
    Issue {
        #[command(flatten)]
        files: KeyFiles,
        #[command(flatten)]
        key: NewKey,
    },
    /// List keys (never the keys themselves).
    List {
        #[command(flatten)]
        files: KeyFiles,
        /// The running gateway's admin address, asked which keys are banned (overrides the
        /// config file's) [env: PET_GATEWAY_ADMIN_LISTEN].
        #[arg(long, value_name = "ADDR")]
        admin_listen: Option<String>,
        /// One JSON array on standard output, nothing else.
        #[arg(long)]
        json: bool,
    },
    /// One key: plan, limits, status, dates, and its usage this minute and this UTC day (asked
    /// of the running gateway).
    Show {
        #[command(flatten)]
        files: KeyFiles,
        /// The running gateway's admin address (overrides the config file's)
        /// [env: PET_GATEWAY_ADMIN_LISTEN].
        #[arg(long, value_name = "ADDR")]
        admin_listen: Option<String>,
        /// One JSON object on standard output, nothing else.
        #[arg(long)]
        json: bool,
        /// The key's id, as `keys list` shows it.
        id: String,
    },
    /// Zero a key's counts of this minute and this UTC day, through the running gateway.
    ResetUsage {
        #[command(flatten)]
        files: KeyFiles,
        /// The running gateway's admin address (overrides the config file's)
        /// [env: PET_GATEWAY_ADMIN_LISTEN].
        #[arg(long, value_name = "ADDR")]
        admin_listen: Option<String>,
        /// The key's id, as `keys list` shows it.
        id: String,
    },
    /// Copy a keys file into the key registry (`keys_source = "store"`); idempotent, so a
    /// deployment moves from `file` to `store` without reissuing keys.
    Import {
        #[command(flatten)]
        files: KeyFiles,
        /// The keys file to copy (default: the config's keys_file).
        #[arg(long, value_name = "PATH")]
        from: Option<PathBuf>,
    },
    /// Replace a key with a successor sharing its plan, name, limits, expiry and quota; prints
    /// the new key alone on the last line. The old key works until the overlap ends.
    Rotate {
        #[command(flatten)]
        files: KeyFiles,
        /// How long the old key keeps working: a number with `s`, `m`, `h` or `d`.
        #[arg(long, value_name = "DURATION", default_value = "24h")]
        overlap: String,
        /// The key's id, as `keys list` shows it.
        id: String,
    },
    /// Revoke a key by id, then ask the running gateway to reload and confirm that it refuses
    /// the key; exits non-zero, saying what did not happen, when it cannot confirm.
    Revoke {
        #[command(flatten)]
        files: KeyFiles,
        /// The running gateway's admin address, asked to confirm (overrides the config file's)
        /// [env: PET_GATEWAY_ADMIN_LISTEN].
        #[arg(long, value_name = "ADDR")]
        admin_listen: Option<String>,
        /// The key's id, as `keys list` shows it.
        id: String,
    },
}

/// Where the running gateway's admin listener is: from `--config`, or given directly.
#[derive(Debug, Args)]
pub struct AdminArgs {
    /// Config file naming the admin listener.
    #[arg(long, env = "PET_GATEWAY_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The gateway's admin address (overrides the config file's) [env: PET_GATEWAY_ADMIN_LISTEN].
    #[arg(long, value_name = "ADDR")]
    pub admin_listen: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum BansCommand {
    /// Active bans: key id, plan, and when each ends.
    List {
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// End a key's ban now.
    Lift {
        #[command(flatten)]
        admin: AdminArgs,
        /// The key's id, as `keys list` or `bans list` shows it.
        id: String,
    },
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_command_line_is_consistent_and_audit_log_is_a_keys_flag_only() {
        Cli::command().debug_assert();
        let serve = Cli::try_parse_from(["pet-gateway", "serve", "--audit-log", "a.log"]);
        assert!(serve.is_err());
        let keys = Cli::try_parse_from([
            "pet-gateway",
            "keys",
            "list",
            "--audit-log",
            "a.log",
            "--keys-file",
            "k.toml",
            "--admin-listen",
            "127.0.0.1:1",
        ]);
        assert!(keys.is_ok(), "{keys:?}");
        let choice = Cli::try_parse_from(["pet-gateway", "check", "--log-format", "JSON"]);
        assert!(choice.is_err(), "choices are exact, as before");
    }
}
