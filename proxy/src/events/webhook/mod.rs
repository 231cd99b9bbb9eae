//! The webhook sink (`events_webhook_url`): events POSTed in signed batches ([`signing`]), at
//! least once.
//! The events thread writes each batch to the spool ([`spool`]) the moment it is made; a thread
//! of its own ([`deliver`]) posts the spool's batches ([`post`]) and retries them, so neither a
//! slow receiver nor one that is down touches a request, and a restart loses nothing queued.

pub mod deliver;
pub mod post;
pub mod signing;
pub mod spool;

use std::path::PathBuf;

pub use post::WebhookUrl;
pub use signing::{Scheme, Signer};

/// The most events in one batch (one spool segment, one POST).
pub const BATCH_EVENTS: usize = 500;
/// The most bytes of events in one batch.
pub const BATCH_BYTES: usize = 1024 * 1024;

/// The webhook as configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Webhook {
    pub url: WebhookUrl,
    pub secret: SecretSource,
    /// During a rotation, the secret being retired: batches are signed with both.
    pub previous_secret: SecretSource,
    pub signature: Scheme,
    pub spool_dir: PathBuf,
    pub spool_max_bytes: u64,
}

/// Where the signing secret comes from. Read when the gateway starts (and by `check`), never by
/// the `keys` commands, which only spool events and need no secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecretSource {
    /// `PET_GATEWAY_EVENTS_WEBHOOK_SECRET` (or the file setting `events_webhook_secret`).
    Given(WebhookSecret),
    /// `events_webhook_secret_file`.
    File(PathBuf),
    Missing,
}

impl Webhook {
    /// What signs the batches: the scheme with the secrets, read now; the error names the
    /// setting (never the secret).
    pub fn signer(&self) -> Result<Signer, String> {
        let current = match self.secret.read("events_webhook_secret_file")? {
            Some(secret) => secret,
            None => {
                return Err("events_webhook_url needs a signing secret: \
                     PET_GATEWAY_EVENTS_WEBHOOK_SECRET or events_webhook_secret_file"
                    .to_owned())
            }
        };
        let previous = self
            .previous_secret
            .read("events_webhook_previous_secret_file")?;
        Signer::new(self.signature, &current, previous.as_ref()).map_err(|why| {
            let scheme = clap::ValueEnum::to_possible_value(&self.signature)
                .map(|v| v.get_name().to_owned())
                .unwrap_or_default();
            format!("events_webhook_signature = \"{scheme}\": {why}")
        })
    }
}

impl SecretSource {
    /// The secret, read now when it is in a file (`file_setting` names it in an error).
    fn read(&self, file_setting: &str) -> Result<Option<WebhookSecret>, String> {
        match self {
            SecretSource::Given(s) => Ok(Some(s.clone())),
            SecretSource::File(path) => {
                let bytes = std::fs::read(path)
                    .map_err(|e| format!("{file_setting}: cannot read {}: {e}", path.display()))?;
                WebhookSecret::new(bytes)
                    .map(Some)
                    .map_err(|why| format!("{file_setting}: {} {why}", path.display()))
            }
            SecretSource::Missing => Ok(None),
        }
    }
}

/// The key batches are signed with; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct WebhookSecret(Vec<u8>);

impl WebhookSecret {
    /// A secret as given (a variable) or read from its file (one trailing newline dropped):
    /// refused when empty.
    pub fn new(mut bytes: Vec<u8>) -> Result<WebhookSecret, String> {
        if bytes.last() == Some(&b'\n') {
            bytes.pop();
            if bytes.last() == Some(&b'\r') {
                bytes.pop();
            }
        }
        if bytes.is_empty() {
            return Err("is empty".to_owned());
        }
        Ok(WebhookSecret(bytes))
    }

    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WebhookSecret(…)")
    }
}
