//! How the gateway gets into the Redis of `redis_url`: TLS files, its user and password, and
//! the Sentinels' own credentials. Only names and paths are checked here; the files are read
//! when a connection is made (`base::redis`), so `check` and start-up report an unreadable one
//! naming its setting, and a rotated password applies at the next reconnect.

use std::path::PathBuf;

use crate::base::redis::{Credentials, RedisAccess, Secret, TlsFiles, URL_PASSWORD};
use crate::config::model::ConfigError;
use crate::config::setting::{Kind, Layers, Origin, Preset, Row, Setting, Sourced, Value};

fn some_text(v: Value) -> Result<String, String> {
    let t = v.text()?;
    if t.is_empty() {
        Err("must not be empty".to_owned())
    } else {
        Ok(t)
    }
}

const REDIS_USERNAME: Setting<String> = Setting::new(
    "redis_username",
    Kind::Text,
    Preset::Absent("none: the URL's, else the default user"),
    "the ACL user the gateway logs in to Redis as (or the user in `redis_url`: \
     `redis://USER:PASSWORD@host:6379/0`)",
    some_text,
)
.value_name("USER");
const REDIS_PASSWORD: Setting<String> = Setting::new(
    "redis_password",
    Kind::Text,
    Preset::Absent("none"),
    "the Redis password (of `redis_username`, or of the default user); give it in the \
     environment or in `redis_password_file` rather than in a file others read. Never a flag: \
     flags show in `ps`, and a password in `--redis-url` is refused for that reason",
    some_text,
)
.secret();
const REDIS_PASSWORD_FILE: Setting<PathBuf> = Setting::new(
    "redis_password_file",
    Kind::Path,
    Preset::Absent("none"),
    "a file holding the Redis password (one line), read again at every reconnection: rotate \
     by writing the new password here, then changing it in Redis",
    Value::path,
);
const REDIS_TLS_CA_FILE: Setting<PathBuf> = Setting::new(
    "redis_tls_ca_file",
    Kind::Path,
    Preset::Absent("none: the system's roots"),
    "PEM CA certificate(s) that verify the certificates of Redis and of the Sentinels, for \
     `rediss://` and `rediss+sentinel://` URLs",
    Value::path,
);
const REDIS_TLS_CERT_FILE: Setting<PathBuf> = Setting::new(
    "redis_tls_cert_file",
    Kind::Path,
    Preset::Absent("none"),
    "PEM client certificate (chain) the gateway presents to Redis and the Sentinels, with \
     `redis_tls_key_file`, where they ask for one (`tls-auth-clients`)",
    Value::path,
);
const REDIS_TLS_KEY_FILE: Setting<PathBuf> = Setting::new(
    "redis_tls_key_file",
    Kind::Path,
    Preset::Absent("none"),
    "PEM private key of `redis_tls_cert_file`",
    Value::path,
);
const REDIS_SENTINEL_USERNAME: Setting<String> = Setting::new(
    "redis_sentinel_username",
    Kind::Text,
    Preset::Absent("none: the default user"),
    "the ACL user the gateway logs in to the Sentinels as (`redis+sentinel://` URLs)",
    some_text,
)
.value_name("USER");
const REDIS_SENTINEL_PASSWORD: Setting<String> = Setting::new(
    "redis_sentinel_password",
    Kind::Text,
    Preset::Absent("none"),
    "the Sentinels' own password (their `requirepass`, or `redis_sentinel_username`'s); never \
     a flag",
    some_text,
)
.secret();
const REDIS_SENTINEL_PASSWORD_FILE: Setting<PathBuf> = Setting::new(
    "redis_sentinel_password_file",
    Kind::Path,
    Preset::Absent("none"),
    "a file holding the Sentinels' password, read again at every reconnection",
    Value::path,
);

const REGISTRY_ADMIN_USERNAME: Setting<String> = Setting::new(
    "registry_admin_username",
    Kind::Text,
    Preset::Absent("none: changes use the node's own credentials"),
    "with `keys_source = \"store\"`: the ACL user (`admin` of deploy/redis/acl-users) that key \
     changes made here (the `keys` commands, this node's admin key API) write the registry as, \
     apart from the node's own `redis_username`; a node without it changes keys with its own",
    some_text,
)
.value_name("USER");
const REGISTRY_ADMIN_PASSWORD: Setting<String> = Setting::new(
    "registry_admin_password",
    Kind::Text,
    Preset::Absent("none"),
    "the password of `registry_admin_username`; in the environment or in \
     `registry_admin_password_file`, never a flag",
    some_text,
)
.secret();
const REGISTRY_ADMIN_PASSWORD_FILE: Setting<PathBuf> = Setting::new(
    "registry_admin_password_file",
    Kind::Path,
    Preset::Absent("none"),
    "a file holding the password of `registry_admin_username`, read again at every connection",
    Value::path,
);

pub const SETTINGS: &[Row] = &[
    REDIS_USERNAME.row,
    REDIS_PASSWORD.row,
    REDIS_PASSWORD_FILE.row,
    REDIS_TLS_CA_FILE.row,
    REDIS_TLS_CERT_FILE.row,
    REDIS_TLS_KEY_FILE.row,
    REDIS_SENTINEL_USERNAME.row,
    REDIS_SENTINEL_PASSWORD.row,
    REDIS_SENTINEL_PASSWORD_FILE.row,
    REGISTRY_ADMIN_USERNAME.row,
    REGISTRY_ADMIN_PASSWORD.row,
    REGISTRY_ADMIN_PASSWORD_FILE.row,
];

/// The credentials key changes write the registry with, apart from the node's own: `None`
/// when none are given (the node's own are used).
pub fn registry_admin(l: &Layers) -> Result<Option<Credentials>, ConfigError> {
    let given = credentials(
        l.get(&REGISTRY_ADMIN_USERNAME)?,
        l.get(&REGISTRY_ADMIN_PASSWORD)?,
        l.get(&REGISTRY_ADMIN_PASSWORD_FILE)?,
    )?;
    match (&given.username_from, &given.password_from) {
        (None, None) => Ok(None),
        (Some(_), Some(_)) => Ok(Some(given.credentials)),
        (Some(from), None) | (None, Some(from)) => Err(from.error(
            "registry_admin_username and its password go together: give both or neither".to_owned(),
        )),
    }
}

/// The access to the Redis of `url` (`None`: the embedded store). Every setting is read even
/// without a URL, so `check` reports each.
pub fn validate(
    l: &Layers,
    url: Option<&Sourced<String>>,
) -> Result<Option<RedisAccess>, ConfigError> {
    let auth = credentials(
        l.get(&REDIS_USERNAME)?,
        l.get(&REDIS_PASSWORD)?,
        l.get(&REDIS_PASSWORD_FILE)?,
    )?;
    let sentinel = credentials(
        l.get(&REDIS_SENTINEL_USERNAME)?,
        l.get(&REDIS_SENTINEL_PASSWORD)?,
        l.get(&REDIS_SENTINEL_PASSWORD_FILE)?,
    )?;
    let tls = tls_files(l)?;
    let Some(url) = url else {
        return Ok(None);
    };
    let mut access = RedisAccess::from_url(&url.value)
        .map_err(|e| url.error(format!("not a usable Redis URL: {e}")))?;
    if access.auth.password.is_some() && matches!(url.origin, Origin::Flag(_)) {
        return Err(url.error(
            "carries a password, which every user of this machine can read in `ps`: give it in \
             PET_GATEWAY_REDIS_PASSWORD or redis_password_file (or in the URL in the config file \
             or PET_GATEWAY_REDIS_URL)"
                .to_owned(),
        ));
    }
    access.auth = merge(std::mem::take(&mut access.auth), auth)?;
    if !access.is_sentinel() {
        if let Some(given) = sentinel.any() {
            return Err(
                given.error("is for the Sentinels of a `redis+sentinel://` redis_url".to_owned())
            );
        }
    }
    access.sentinel_auth = sentinel.credentials;
    if !access.tls {
        if let Some(given) = &tls.given {
            return Err(given.error(
                "is for TLS connections: a `rediss://` or `rediss+sentinel://` redis_url"
                    .to_owned(),
            ));
        }
    }
    access.tls_files = tls.files;
    Ok(Some(access))
}

/// Credentials from settings, and the settings that gave them (to blame in errors).
struct Given {
    credentials: Credentials,
    username_from: Option<Sourced<()>>,
    password_from: Option<Sourced<()>>,
}

impl Given {
    /// A setting that gave any of it.
    fn any(&self) -> Option<&Sourced<()>> {
        self.username_from.as_ref().or(self.password_from.as_ref())
    }
}

fn credentials(
    username: Option<Sourced<String>>,
    password: Option<Sourced<String>>,
    password_file: Option<Sourced<PathBuf>>,
) -> Result<Given, ConfigError> {
    if let (Some(p), Some(file)) = (&password, &password_file) {
        return Err(file.error(format!(
            "the password is given twice, here and by {} ({}): give one",
            p.name(),
            p.origin.label()
        )));
    }
    let username_from = username.as_ref().map(Sourced::blame);
    let password_from = match (&password, &password_file) {
        (Some(p), _) => Some(p.blame()),
        (None, f) => f.as_ref().map(Sourced::blame),
    };
    let secret = match (password, password_file) {
        (Some(p), _) => Some(Secret::Given {
            setting: match p.origin {
                Origin::Env(var) => var,
                _ => p.name(),
            },
            value: p.value,
        }),
        (None, Some(f)) => Some(Secret::File {
            setting: f.name(),
            path: f.value,
        }),
        (None, None) => None,
    };
    Ok(Given {
        credentials: Credentials {
            username: username.map(|u| u.value),
            password: secret,
        },
        username_from,
        password_from,
    })
}

/// The URL's credentials with the settings': each given once.
fn merge(url: Credentials, settings: Given) -> Result<Credentials, ConfigError> {
    if let (Some(_), Some(from)) = (&url.username, &settings.username_from) {
        return Err(from.error("redis_url names a user too: name it once".to_owned()));
    }
    if let (Some(_), Some(from)) = (&url.password, &settings.password_from) {
        return Err(from.error(format!(
            "{URL_PASSWORD} is given too: give the password once"
        )));
    }
    Ok(Credentials {
        username: url.username.or(settings.credentials.username),
        password: url.password.or(settings.credentials.password),
    })
}

struct Tls {
    files: TlsFiles,
    /// A setting that gave a file.
    given: Option<Sourced<()>>,
}

fn tls_files(l: &Layers) -> Result<Tls, ConfigError> {
    let ca = l.get(&REDIS_TLS_CA_FILE)?;
    let cert = l.get(&REDIS_TLS_CERT_FILE)?;
    let key = l.get(&REDIS_TLS_KEY_FILE)?;
    if let (Some(given), None) | (None, Some(given)) = (
        cert.as_ref().map(Sourced::blame),
        key.as_ref().map(Sourced::blame),
    ) {
        return Err(given.error(
            "redis_tls_cert_file and redis_tls_key_file go together: give both (a client \
             certificate) or neither"
                .to_owned(),
        ));
    }
    let given = ca
        .as_ref()
        .map(Sourced::blame)
        .or_else(|| cert.as_ref().map(Sourced::blame));
    Ok(Tls {
        files: TlsFiles {
            ca: ca.map(|s| s.value),
            cert: cert.map(|s| s.value),
            key: key.map(|s| s.value),
        },
        given,
    })
}
