//! The command-line layer (clap) and the environment layer beside it. Both give only the
//! settings an operator overrides per run; everything else lives in the file.
//!
//! The environment is read here rather than by clap, so that a value remembers whether it came
//! from a flag or a variable and an error can name the one that really supplied it.

use std::collections::HashMap;
use std::path::PathBuf;

use clap::ValueEnum;

use super::{ConfigError, KeysSource, Layer, LogFormat, OnStoreError, Setting};
use super::{
    ADMIN_LISTEN, ADMIN_TOKEN, AUDIT_LOG, KEYS_FILE, KEYS_SOURCE, KEY_PREFIX, LISTEN, LOG_FORMAT,
    ON_STORE_ERROR, PLANS_DIR, REDIS_URL, TLS_CERT, TLS_KEY, UPSTREAMS,
};

/// The flags that override the file (each also has an environment variable, read by [`Env`]).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Overrides {
    /// Public listening address [env: PET_GATEWAY_LISTEN].
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// Admin listening address (health, metrics) [env: PET_GATEWAY_ADMIN_LISTEN].
    #[arg(long, value_name = "ADDR")]
    pub admin_listen: Option<String>,
    /// Backend address; repeat (or comma-separate) for several [env: PET_GATEWAY_UPSTREAM].
    #[arg(long = "upstream", value_name = "ADDR", value_delimiter = ',')]
    pub upstreams: Vec<String>,
    /// Redis URL of the shared quota store; empty: the embedded store [env: PET_GATEWAY_REDIS_URL].
    #[arg(long, value_name = "URL")]
    pub redis_url: Option<String>,
    /// Prefix of every Redis key (one per environment) [env: PET_GATEWAY_KEY_PREFIX].
    #[arg(long, value_name = "P")]
    pub key_prefix: Option<String>,
    /// The keys file [env: PET_GATEWAY_KEYS_FILE].
    #[arg(long, value_name = "PATH")]
    pub keys_file: Option<PathBuf>,
    /// The plans directory [env: PET_GATEWAY_PLANS_DIR].
    #[arg(long, value_name = "DIR")]
    pub plans_dir: Option<PathBuf>,
    /// What to do when the quota store fails: local, open or closed [env: PET_GATEWAY_ON_STORE_ERROR].
    #[arg(long, value_name = "MODE")]
    pub on_store_error: Option<OnStoreError>,
    /// Certificate chain (PEM) for TLS on the public listener; needs --tls-key [env: PET_GATEWAY_TLS_CERT].
    #[arg(long, value_name = "PATH")]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM) for TLS on the public listener; needs --tls-cert [env: PET_GATEWAY_TLS_KEY].
    #[arg(long, value_name = "PATH")]
    pub tls_key: Option<PathBuf>,
    /// Log format: text or json [env: PET_GATEWAY_LOG_FORMAT].
    #[arg(long, value_name = "FORMAT")]
    pub log_format: Option<LogFormat>,
    /// Where the keys live: file, or store (the fleet-wide registry in the quota store's Redis)
    /// [env: PET_GATEWAY_KEYS_SOURCE].
    #[arg(long, value_name = "SOURCE")]
    pub keys_source: Option<KeysSource>,
    /// The audit log of key changes; a flag of the `keys` commands only.
    #[arg(skip)]
    pub audit_log: Option<PathBuf>,
}

impl Overrides {
    pub fn layer(&self) -> Layer {
        Layer {
            listen: self.listen.clone(),
            admin_listen: self.admin_listen.clone(),
            upstreams: Some(self.upstreams.clone()).filter(|u| !u.is_empty()),
            redis_url: self.redis_url.clone(),
            key_prefix: self.key_prefix.clone(),
            keys_file: self.keys_file.clone(),
            plans_dir: self.plans_dir.clone(),
            on_store_error: self.on_store_error,
            tls_cert: self.tls_cert.clone(),
            tls_key: self.tls_key.clone(),
            log_format: self.log_format,
            audit_log: self.audit_log.clone(),
            keys_source: self.keys_source,
            ..Layer::default()
        }
    }
}

/// The `PET_GATEWAY_*` variables of a process: a snapshot, so tests can give their own.
#[derive(Debug, Clone, Default)]
pub struct Env {
    vars: HashMap<String, String>,
}

impl Env {
    /// This process's `PET_GATEWAY_*` variables. `vars_os`, not `vars`: an unrelated variable
    /// that is not UTF-8 must not abort the gateway; one of ours that is not is left out.
    pub fn process() -> Env {
        Env {
            vars: std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
                .filter(|(k, _)| k.starts_with("PET_GATEWAY_"))
                .collect(),
        }
    }

    /// Only the named variables: a command that needs a few settings (`keys`, `bans`) is not
    /// stopped by a bad value of one it never uses.
    pub fn only(mut self, names: &[&str]) -> Env {
        self.vars.retain(|k, _| names.contains(&k.as_str()));
        self
    }

    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Env {
        Env {
            vars: pairs
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
        }
    }

    fn get(&self, s: &Setting) -> Option<String> {
        s.env.and_then(|name| self.vars.get(name).cloned())
    }

    /// A choice, checked as clap checks the flag (case-sensitive); not checked at all when a
    /// flag overrides it (`overridden`), as flags > environment.
    fn choice<T: ValueEnum>(
        &self,
        s: &Setting,
        overridden: bool,
    ) -> Result<Option<T>, ConfigError> {
        if overridden {
            return Ok(None);
        }
        self.get(s)
            .map(|v| {
                T::from_str(&v, false).map_err(|_| {
                    let choices: Vec<String> = T::value_variants()
                        .iter()
                        .filter_map(|c| c.to_possible_value())
                        .map(|p| p.get_name().to_owned())
                        .collect();
                    s.invalid_env(format!("`{v}` is not one of {}", choices.join(", ")))
                })
            })
            .transpose()
    }

    /// This layer; `flags` is the layer above it, whose values make these unused.
    pub fn layer(&self, flags: &Layer) -> Result<Layer, ConfigError> {
        Ok(Layer {
            listen: self.get(&LISTEN),
            admin_listen: self.get(&ADMIN_LISTEN),
            upstreams: self
                .get(&UPSTREAMS)
                .map(|v| v.split(',').map(str::to_owned).collect()),
            redis_url: self.get(&REDIS_URL),
            key_prefix: self.get(&KEY_PREFIX),
            keys_file: self.get(&KEYS_FILE).map(PathBuf::from),
            plans_dir: self.get(&PLANS_DIR).map(PathBuf::from),
            on_store_error: self.choice(&ON_STORE_ERROR, flags.on_store_error.is_some())?,
            tls_cert: self.get(&TLS_CERT).map(PathBuf::from),
            tls_key: self.get(&TLS_KEY).map(PathBuf::from),
            log_format: self.choice(&LOG_FORMAT, flags.log_format.is_some())?,
            audit_log: self.get(&AUDIT_LOG).map(PathBuf::from),
            keys_source: self.choice(&KEYS_SOURCE, flags.keys_source.is_some())?,
            admin_token: self.get(&ADMIN_TOKEN),
            ..Layer::default()
        })
    }
}
