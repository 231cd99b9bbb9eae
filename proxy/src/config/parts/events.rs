//! Events for the business: this node's name in them, and the metering file.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::config::model::ConfigError;
use crate::config::parts::values::{choice, parse_choice};
use crate::config::setting::{Kind, Layers, Origin, Preset, Row, Setting, Sourced, Value};
use crate::config::Config;
use crate::events::webhook::{Scheme, SecretSource, Webhook, WebhookSecret, WebhookUrl};

const NODE_ID: Setting<String> = Setting::new(
    "node_id",
    Kind::Text,
    Preset::Computed("the host name"),
    "this node's name in its events' `source` (`pet-gateway/<environment>/<node_id>`) and ids: \
     1 to 64 letters, digits, `-`, `_` or `.`",
    node_name,
)
.value_name("NAME");
const METERING_FILE: Setting<PathBuf> = Setting::new(
    "metering_file",
    Kind::Path,
    Preset::Absent("none: no usage events"),
    "usage events (`pet.usage.v1` CloudEvents, one a key, operation and minute) appended one a \
     line to `<metering_file>.YYYY-MM-DD`, a file a UTC day; its folder must exist and be \
     writable (`check` and `serve` say so otherwise)",
    Value::path,
);

const WEBHOOK_URL: Setting<WebhookUrl> = Setting::new(
    "events_webhook_url",
    Kind::Text,
    Preset::Absent("none: no webhook"),
    "an `http://` or `https://` URL every event is POSTed to, in signed batches \
     (`application/cloudevents-batch+json`, signed as `events_webhook_signature` says), at \
     least once; needs \
     `events_webhook_secret` (or its file) and `events_spool_dir`",
    |v| WebhookUrl::parse(&v.text()?),
)
.value_name("URL");
const WEBHOOK_SECRET: Setting<String> = Setting::new(
    "events_webhook_secret",
    Kind::Text,
    Preset::Absent("none"),
    "the key the webhook's batches are signed with (HMAC-SHA256), at least 32 bytes \
     (`openssl rand -base64 24`); in the environment or `events_webhook_secret_file`, never a \
     flag",
    Value::text,
)
.secret();
const WEBHOOK_SECRET_FILE: Setting<PathBuf> = Setting::new(
    "events_webhook_secret_file",
    Kind::Path,
    Preset::Absent("none"),
    "a file holding the webhook's signing key (one trailing newline is dropped), read at start",
    Value::path,
);
const WEBHOOK_SIGNATURE: Setting<Scheme> = Setting::new(
    "events_webhook_signature",
    choice::<Scheme>(),
    Preset::Value("pet"),
    "how batches are signed: `pet` (`Pet-Signature: t=…,v1=<hex HMAC-SHA256 of \"<t>.<body>\">`), \
     `standard` (Standard Webhooks: `webhook-id`, `webhook-timestamp`, `webhook-signature`; the \
     secret a `whsec_` base64 value), or `both` (the two, while receivers move)",
    parse_choice,
)
.value_name("SCHEME");
const WEBHOOK_PREVIOUS_SECRET: Setting<String> = Setting::new(
    "events_webhook_previous_secret",
    Kind::Text,
    Preset::Absent("none"),
    "during a rotation of the webhook's secret, the one being retired: each batch is signed \
     with both (the new first) until it is removed; in the environment or \
     `events_webhook_previous_secret_file`, never a flag",
    Value::text,
)
.secret();
const WEBHOOK_PREVIOUS_SECRET_FILE: Setting<PathBuf> = Setting::new(
    "events_webhook_previous_secret_file",
    Kind::Path,
    Preset::Absent("none"),
    "a file holding the secret being retired (one trailing newline is dropped), read at start",
    Value::path,
);
const SPOOL_DIR: Setting<PathBuf> = Setting::new(
    "events_spool_dir",
    Kind::Path,
    Preset::Absent("none"),
    "the folder (existing, writable) where events wait for the webhook, on disk so that a \
     receiver that is down or a restart loses nothing; its `dead-letter.ndjson` keeps what the \
     receiver refused or what ran out of retries",
    Value::path,
);
const SPOOL_MAX_MB: Setting<u64> = Setting::new(
    "events_spool_max_mb",
    Kind::Int,
    Preset::Value("1024"),
    "the most the spool may hold, in MiB; past it new events wait in memory (64 MiB), then are \
     dropped and counted",
    |v| {
        let mb: u64 = v.int()?;
        if (1..=1_048_576).contains(&mb) {
            Ok(mb)
        } else {
            Err(format!("must be from 1 to 1048576 (got {mb})"))
        }
    },
)
.value_name("MIB");

pub const SETTINGS: &[Row] = &[
    NODE_ID.row,
    METERING_FILE.row,
    WEBHOOK_URL.row,
    WEBHOOK_SECRET.row,
    WEBHOOK_SECRET_FILE.row,
    WEBHOOK_SIGNATURE.row,
    WEBHOOK_PREVIOUS_SECRET.row,
    WEBHOOK_PREVIOUS_SECRET_FILE.row,
    SPOOL_DIR.row,
    SPOOL_MAX_MB.row,
];

pub struct Events {
    pub node_id: String,
    pub metering_file: Option<PathBuf>,
    pub webhook: Option<Webhook>,
}

pub fn validate(l: &Layers) -> Result<Events, ConfigError> {
    let node_id = l.or(&NODE_ID, Value::Text(host_name()))?.value;
    // Only the form here: whether the folders can be written, and the secret read, is asked by
    // `check` and `serve` ([`ready`]), never by the `keys` and `bans` commands, which must
    // work from any operator's shell (revoking a leaked key cannot wait for a secret).
    let metering_file = match l.get(&METERING_FILE)? {
        Some(file) if file.value.file_name().is_none() => {
            return Err(file.error(format!("{} names no file", file.value.display())));
        }
        Some(file) => Some(file.value),
        None => None,
    };
    Ok(Events {
        node_id,
        metering_file,
        webhook: webhook(l)?,
    })
}

/// The webhook, when a URL is given; each of its other settings is refused without one.
fn webhook(l: &Layers) -> Result<Option<Webhook>, ConfigError> {
    let url = l.get(&WEBHOOK_URL)?;
    let secret = l.get(&WEBHOOK_SECRET)?;
    let secret_file = l.get(&WEBHOOK_SECRET_FILE)?;
    let previous = l.get(&WEBHOOK_PREVIOUS_SECRET)?;
    let previous_file = l.get(&WEBHOOK_PREVIOUS_SECRET_FILE)?;
    let signature = l.get(&WEBHOOK_SIGNATURE)?;
    let spool = l.get(&SPOOL_DIR)?;
    let max_mb = l.value(&SPOOL_MAX_MB)?;
    let Some(url) = url else {
        let given = [
            secret.as_ref().map(Sourced::blame),
            secret_file.as_ref().map(Sourced::blame),
            previous.as_ref().map(Sourced::blame),
            previous_file.as_ref().map(Sourced::blame),
            signature
                .as_ref()
                .filter(|s| s.origin != Origin::Default)
                .map(Sourced::blame),
            spool.as_ref().map(Sourced::blame),
        ];
        if let Some(g) = given.into_iter().flatten().next() {
            return Err(g.error("is for the webhook: set events_webhook_url too".to_owned()));
        }
        return Ok(None);
    };
    let secret = secret_source(secret, secret_file)?;
    let previous_secret = secret_source(previous, previous_file)?;
    let Some(spool) = spool else {
        return Err(url.error(
            "needs events_spool_dir, the folder where events wait for the receiver".to_owned(),
        ));
    };
    Ok(Some(Webhook {
        url: url.value,
        secret,
        previous_secret,
        signature: signature.map_or(Scheme::Pet, |s| s.value),
        spool_dir: spool.value,
        spool_max_bytes: max_mb * 1024 * 1024,
    }))
}

/// A secret given in the environment (or the file's setting), or by a file of its own: one of
/// the two.
fn secret_source(
    secret: Option<Sourced<String>>,
    secret_file: Option<Sourced<PathBuf>>,
) -> Result<SecretSource, ConfigError> {
    Ok(match (secret, secret_file) {
        (Some(s), Some(f)) => {
            return Err(f.error(format!(
                "the secret is given twice, here and by {} ({}): give one",
                s.name(),
                s.origin.label()
            )))
        }
        (Some(s), None) => {
            let named = match s.origin {
                Origin::Env(var) => var.to_owned(),
                _ => s.name().to_owned(),
            };
            let secret = WebhookSecret::new(s.value.clone().into_bytes())
                .map_err(|why| s.error(format!("{named} {why}")))?;
            SecretSource::Given(secret)
        }
        (None, Some(f)) => SecretSource::File(f.value),
        (None, None) => SecretSource::Missing,
    })
}

/// What `check` and `serve` ask beyond the settings' form: the metering file's and the spool's
/// folders can be written, and the webhook's secret read. An error names the setting.
pub fn ready(config: &Config) -> Result<(), String> {
    if let Some(file) = &config.metering_file {
        writable_folder(file).map_err(|why| format!("metering_file: {why}"))?;
    }
    if let Some(webhook) = &config.events_webhook {
        webhook.signer()?;
        writable_dir(&webhook.spool_dir).map_err(|why| format!("events_spool_dir: {why}"))?;
    }
    Ok(())
}

fn node_name(v: Value) -> Result<String, String> {
    let t = v.text()?;
    let ok = (1..=64).contains(&t.len())
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(t)
    } else {
        Err(format!(
            "`{t}` must be 1 to 64 letters, digits, `-`, `_` or `.`"
        ))
    }
}

/// The host name, cut to what a node id may hold; `localhost` when there is none.
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its whole length, which is passed.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    let name: String = String::from_utf8_lossy(&buf[..end])
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .take(64)
        .collect();
    if rc != 0 || name.is_empty() {
        "localhost".to_owned()
    } else {
        name
    }
}

/// Whether the files of `base` can be made: its folder exists and this process may write it.
fn writable_folder(base: &Path) -> Result<(), String> {
    if base.file_name().is_none() {
        return Err(format!("{} names no file", base.display()));
    }
    let folder = match base.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    writable_dir(folder)
}

/// Whether `folder` exists and this process may make files in it.
fn writable_dir(folder: &Path) -> Result<(), String> {
    if !folder.is_dir() {
        return Err(format!("{}: no such folder", folder.display()));
    }
    let c = CString::new(folder.as_os_str().as_bytes())
        .map_err(|_| format!("{}: a NUL in the path", folder.display()))?;
    // SAFETY: a NUL-terminated path; access() only reads it.
    if unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
        return Err(format!(
            "{}: cannot be written by this process ({})",
            folder.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_are_checked_and_the_host_name_fits_them() {
        assert!(node_name(Value::Text("node-a.eu_1".into())).is_ok());
        assert!(node_name(Value::Text("".into())).is_err());
        assert!(node_name(Value::Text("a b".into())).is_err());
        assert!(node_name(Value::Text("x".repeat(65))).is_err());
        assert!(node_name(Value::Text(host_name())).is_ok());
    }

    #[test]
    fn a_metering_file_needs_a_writable_folder() {
        let dir = tempfile::tempdir().unwrap();
        assert!(writable_folder(&dir.path().join("m.ndjson")).is_ok());
        let missing = writable_folder(&dir.path().join("nope/m.ndjson")).unwrap_err();
        assert!(missing.contains("no such folder"), "{missing}");
        assert!(writable_folder(Path::new("/")).is_err());
    }
}
