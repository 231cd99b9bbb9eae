//! Where the API keys and plans live, what new keys look like, and where key changes are logged.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::values::{choice, parse_choice};
use crate::config::model::{ConfigError, KeysSource};
use crate::config::setting::{Kind, Layers, Preset, Row, Setting, Value};
use crate::keys::format::{default_prefix, valid_prefix};
use crate::keys::signing::{parse_public, BindingMode, SigningKey};

const KEYS_SOURCE: Setting<KeysSource> = Setting::new(
    "keys_source",
    choice::<KeysSource>(),
    Preset::Value("file"),
    "where the keys live: `file` (the keys file), or `store` (the fleet-wide key registry in the \
     quota store's Redis, see \"The key registry\"; needs `redis_url`)",
    parse_choice,
)
.value_name("SOURCE");
const KEYS_FILE: Setting<PathBuf> = Setting::new(
    "keys_file",
    Kind::Path,
    Preset::Computed("`keys.toml`"),
    "the keys file; with `keys_source = \"store\"`, this node's local snapshot of the registry",
    Value::path,
);
const PLANS_DIR: Setting<PathBuf> = Setting::new(
    "plans_dir",
    Kind::Path,
    Preset::Computed("`plans`"),
    "the plan files",
    Value::path,
)
.value_name("DIR");
const API_KEY_PREFIX: Setting<String> = Setting::new(
    "api_key_prefix",
    Kind::Text,
    Preset::Computed("`pet_live_` in production, else `pet_test_`"),
    "what new API keys start with (see API keys)",
    |v| {
        let p = v.text()?;
        if valid_prefix(&p) {
            Ok(p)
        } else {
            Err("must be 2 to 16 of a-z, 0-9 and '_', ending in '_' (`acme_`)".to_owned())
        }
    },
)
.value_name("PREFIX");
const AUDIT_LOG: Setting<Option<PathBuf>> = Setting::new(
    "audit_log",
    Kind::Path,
    Preset::Absent("standard error"),
    "where key changes are logged, one JSON line each",
    |v| Ok(Some(v.path()?).filter(|p| !p.as_os_str().is_empty())),
)
.keys_commands_only();
const REGISTRY_VERIFY_KEYS: Setting<Vec<String>> = Setting::new(
    "registry_verify_keys",
    Kind::Texts,
    Preset::Value(""),
    "with `keys_source = \"store\"`: the public keys (`ed25519:<base64>`, from `registry keygen`) \
     a key record must be signed by; a record that is unsigned, fails verification or is older \
     than the version this node holds is refused. Several, so the signing key can be rotated; \
     empty: records are taken unsigned (sign the registry first, then set this; see \"Signed \
     key records\")",
    |v| {
        let keys = v.texts()?;
        for key in &keys {
            parse_public(key).map_err(|e| e.to_string())?;
        }
        Ok(keys)
    },
)
.flag("--registry-verify-key", "KEY");
const REGISTRY_SIGNING_KEY_FILE: Setting<Option<PathBuf>> = Setting::new(
    "registry_signing_key_file",
    Kind::Path,
    Preset::Absent("none: with verify keys set, no key change here"),
    "the fleet's private signing key (`registry keygen --out FILE`), for whatever changes key \
     records here (the `keys` commands, this node's admin key API); without it, where \
     `registry_verify_keys` is set, changes are refused (409 from the admin API)",
    |v| {
        let path = v.path()?;
        if path.as_os_str().is_empty() {
            return Ok(None);
        }
        SigningKey::load(&path).map_err(|e| e.to_string())?;
        Ok(Some(path))
    },
);

const REGISTRY_SIGNATURE_BINDING: Setting<BindingMode> = Setting::new(
    "registry_signature_binding",
    choice::<BindingMode>(),
    Preset::Value("off"),
    "with signed records: `off` signs records unbound (nodes from before binding read them), \
     `sign` binds each new signature to `environment` so another environment's registry refuses \
     it, `require` also refuses unbound records; every mode refuses a record bound to another \
     environment. Move `off` → `sign` (then `registry sign`) → `require` once every node runs a \
     release that knows binding (see \"Signed key records\")",
    parse_choice,
)
.value_name("MODE");
const REGISTRY_COMPARE_INTERVAL_SECS: Setting<Duration> = Setting::new(
    "registry_compare_interval_secs",
    Kind::Int,
    Preset::Value("60"),
    "with `keys_source = \"store\"`: how often each node reads the whole registry (in pages, \
     off the request path) and compares it with the records it holds, so a record put back \
     older without a feed entry is refused and the newer one written back within this long \
     (give or take a fifth, drawn each time, so that nodes started together do not read it at \
     once)",
    |v| super::values::at_least_one(v.int::<u64>()?).map(Duration::from_secs),
)
.value_name("SECS");

pub const SETTINGS: &[Row] = &[
    KEYS_SOURCE.row,
    KEYS_FILE.row,
    PLANS_DIR.row,
    API_KEY_PREFIX.row,
    AUDIT_LOG.row,
    REGISTRY_VERIFY_KEYS.row,
    REGISTRY_SIGNING_KEY_FILE.row,
    REGISTRY_SIGNATURE_BINDING.row,
    REGISTRY_COMPARE_INTERVAL_SECS.row,
];

pub struct Keys {
    pub keys_source: KeysSource,
    pub keys_file: PathBuf,
    pub plans_dir: PathBuf,
    pub api_key_prefix: String,
    pub audit_log: Option<PathBuf>,
    pub registry_verify_keys: Vec<String>,
    pub registry_signing_key_file: Option<PathBuf>,
    pub registry_signature_binding: BindingMode,
    pub registry_compare_interval: Duration,
}

pub fn validate(l: &Layers, environment: &str, redis: bool) -> Result<Keys, ConfigError> {
    let keys_source = l.required(&KEYS_SOURCE)?;
    if keys_source.value == KeysSource::Store && !redis {
        return Err(keys_source
            .error("`store` keeps the keys in the quota store's Redis: set redis_url too".into()));
    }
    let api_key_prefix = Value::Text(default_prefix(environment).to_owned());
    Ok(Keys {
        keys_source: keys_source.value,
        keys_file: l.or(&KEYS_FILE, beside_the_file(l, "keys.toml"))?.value,
        plans_dir: l.or(&PLANS_DIR, beside_the_file(l, "plans"))?.value,
        api_key_prefix: l.or(&API_KEY_PREFIX, api_key_prefix)?.value,
        audit_log: l.get(&AUDIT_LOG)?.and_then(|a| a.value),
        registry_verify_keys: l.value(&REGISTRY_VERIFY_KEYS)?,
        registry_signing_key_file: l.get(&REGISTRY_SIGNING_KEY_FILE)?.and_then(|k| k.value),
        registry_signature_binding: l.value(&REGISTRY_SIGNATURE_BINDING)?,
        registry_compare_interval: l.value(&REGISTRY_COMPARE_INTERVAL_SECS)?,
    })
}

/// A default path sits beside the config file, like the file's own relative paths.
fn beside_the_file(l: &Layers, name: &str) -> Value {
    Value::Path(
        l.file_path
            .as_deref()
            .and_then(Path::parent)
            .map_or_else(|| PathBuf::from(name), |dir| dir.join(name)),
    )
}
