//! Signed key records: whoever changes records (the `keys` commands, a node's admin key API)
//! signs each with the fleet's Ed25519 signing key, and every node verifies each record it takes
//! from the registry against the public keys it trusts. So write access to Redis alone can mint
//! no key, upgrade no plan, extend no expiry and, with the versions a node remembers, undo no
//! revocation.
//!
//! What is signed: a domain tag and the record as JSON with its keys sorted and its `signature`
//! left out, so the signature does not depend on field order, and a record moved into another
//! kind of document cannot pass for a key record. A bound signature (`ed25519-bound:`) also
//! covers the deployment's `environment`, so that with one signing key for staging and
//! production a record copied from staging's registry into production's does not verify there;
//! the older, unbound form (`ed25519:`) is taken as long as [`Binding`] allows it, so a fleet can
//! move to bound records without reissuing a key (the roll is in the book's "Signed key records").

use std::io::Write;
use std::path::Path;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use ring::rand::SystemRandom;
use ring::signature::{Ed25519KeyPair, KeyPair, UnparsedPublicKey, ED25519};

use crate::keys::record::KeyRecord;

/// Prefixes the signed bytes: a signature over anything else never verifies as a record's.
const DOMAIN: &[u8] = b"pet-gateway key record v1\n";
/// Prefixes a bound signature's bytes, then the environment and a newline: a bound signature
/// never verifies as an unbound one, nor the other way round.
const DOMAIN_BOUND: &[u8] = b"pet-gateway key record v2 bound\n";
const PEM_BEGIN: &str = "-----BEGIN PRIVATE KEY-----";
const PEM_END: &str = "-----END PRIVATE KEY-----";
/// How public keys and unbound signatures are written: `ed25519:<base64>`.
const SCHEME: &str = "ed25519:";
/// How bound signatures are written: `ed25519-bound:<base64>`. A prefix of its own, so a node
/// that predates binding reads such a record as unsigned (never as a forgery of a known form)
/// and `registry sign` can tell the records still to re-sign.
const SCHEME_BOUND: &str = "ed25519-bound:";

#[derive(Debug, thiserror::Error)]
pub enum SigningError {
    #[error("{}: {source}", path.display())]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not an Ed25519 private key written by `registry keygen` ({reason})", path.display())]
    BadKeyFile {
        path: std::path::PathBuf,
        reason: String,
    },
    #[error("`{0}` is not a public key of the form ed25519:<base64 of 32 bytes>")]
    BadPublicKey(String),
    #[error("cannot generate a key pair: {0}")]
    Generate(String),
}

/// Why a record was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejected {
    Unsigned,
    BadSignature,
    /// Signed in the unbound form where `registry_signature_binding = "require"`.
    Unbound,
}

impl Rejected {
    /// The metric label.
    pub fn reason(self) -> &'static str {
        match self {
            Rejected::Unsigned => "unsigned",
            Rejected::BadSignature => "bad_signature",
            Rejected::Unbound => "unbound",
        }
    }
}

/// Where a fleet is in its move to bound signatures (`registry_signature_binding`). Every mode
/// verifies bound records; the modes differ in what a writer signs and whether unbound records
/// are still taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BindingMode {
    /// Writers sign unbound, which nodes that predate binding can still read; both forms taken.
    #[default]
    Off,
    /// Writers sign bound; unbound records are still taken (until `registry sign` re-signed them).
    Sign,
    /// Writers sign bound; an unbound record is refused.
    Require,
}

/// What a signature is bound to, and how far the fleet has moved to bound signatures.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Binding {
    /// The deployment's `environment`.
    pub environment: String,
    pub mode: BindingMode,
}

impl Binding {
    pub fn new(environment: &str, mode: BindingMode) -> Binding {
        Binding {
            environment: environment.to_owned(),
            mode,
        }
    }

    /// The same binding, with unbound records refused: what a record must pass to need no
    /// re-signing.
    pub fn required(&self) -> Binding {
        Binding {
            mode: BindingMode::Require,
            ..self.clone()
        }
    }
}

/// The fleet's private key.
pub struct SigningKey {
    pair: Ed25519KeyPair,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SigningKey({})", self.public_key())
    }
}

impl SigningKey {
    /// Writes a new private key to `out` (PKCS#8 in PEM, mode 0600; an existing file is never
    /// overwritten) and returns its public key as `ed25519:<base64>`.
    pub fn generate(out: &Path) -> Result<String, SigningError> {
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&SystemRandom::new())
            .map_err(|e| SigningError::Generate(e.to_string()))?;
        let pair = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref())
            .map_err(|e| SigningError::Generate(e.to_string()))?;
        let io = |source| SigningError::Io {
            path: out.to_owned(),
            source,
        };
        let mut file = open_new_private(out).map_err(io)?;
        let pem = format!("{PEM_BEGIN}\n{}\n{PEM_END}\n", B64.encode(pkcs8.as_ref()));
        file.write_all(pem.as_bytes()).map_err(io)?;
        file.sync_all().map_err(io)?;
        Ok(public_text(pair.public_key().as_ref()))
    }

    pub fn load(path: &Path) -> Result<SigningKey, SigningError> {
        let text = std::fs::read_to_string(path).map_err(|source| SigningError::Io {
            path: path.to_owned(),
            source,
        })?;
        let bad = |reason: &str| SigningError::BadKeyFile {
            path: path.to_owned(),
            reason: reason.to_owned(),
        };
        let body: String = text
            .trim()
            .strip_prefix(PEM_BEGIN)
            .and_then(|t| t.strip_suffix(PEM_END))
            .ok_or_else(|| bad("no PRIVATE KEY block"))?
            .split_whitespace()
            .collect();
        let der = B64.decode(body).map_err(|_| bad("not base64"))?;
        let pair =
            Ed25519KeyPair::from_pkcs8_maybe_unchecked(&der).map_err(|e| bad(&e.to_string()))?;
        Ok(SigningKey { pair })
    }

    pub fn public_key(&self) -> String {
        public_text(self.pair.public_key().as_ref())
    }

    /// `record` with its signature set (over everything else in it), bound to `binding`'s
    /// environment unless the fleet has not moved to bound signatures yet.
    pub fn sign(&self, record: &mut KeyRecord, binding: &Binding) {
        record.signature = None;
        let (scheme, message) = match binding.mode {
            BindingMode::Off => (SCHEME, signed_bytes(record)),
            BindingMode::Sign | BindingMode::Require => {
                (SCHEME_BOUND, bound_bytes(record, &binding.environment))
            }
        };
        let signature = self.pair.sign(&message);
        record.signature = Some(format!("{scheme}{}", B64.encode(signature.as_ref())));
    }
}

/// The public keys a node trusts (several, so the signing key can be rotated).
#[derive(Debug, Clone, Default)]
pub struct VerifyKeys(Vec<Vec<u8>>);

impl VerifyKeys {
    pub fn parse(keys: &[String]) -> Result<VerifyKeys, SigningError> {
        keys.iter()
            .map(|k| parse_public(k))
            .collect::<Result<_, _>>()
            .map(VerifyKeys)
    }

    /// No keys: records are taken unsigned (the rollout's first step).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether one of the trusted keys signed `record` for `binding`'s environment (or, where
    /// its mode takes them, in the unbound form). With no keys every record passes.
    pub fn verify(&self, record: &KeyRecord, binding: &Binding) -> Result<(), Rejected> {
        if self.0.is_empty() {
            return Ok(());
        }
        let signature = record.signature.as_deref().unwrap_or_default();
        let (signature, message) = if let Some(bound) = signature.strip_prefix(SCHEME_BOUND) {
            (bound, bound_bytes(record, &binding.environment))
        } else if let Some(unbound) = signature.strip_prefix(SCHEME) {
            if binding.mode == BindingMode::Require {
                return Err(Rejected::Unbound);
            }
            (unbound, signed_bytes(record))
        } else {
            return Err(Rejected::Unsigned);
        };
        let signature = B64.decode(signature).map_err(|_| Rejected::BadSignature)?;
        self.0
            .iter()
            .any(|key| {
                UnparsedPublicKey::new(&ED25519, key)
                    .verify(&message, &signature)
                    .is_ok()
            })
            .then_some(())
            .ok_or(Rejected::BadSignature)
    }
}

/// A public key as `registry_verify_keys` takes it.
pub fn parse_public(text: &str) -> Result<Vec<u8>, SigningError> {
    let bad = || SigningError::BadPublicKey(text.to_owned());
    let key = B64
        .decode(text.trim().strip_prefix(SCHEME).ok_or_else(bad)?)
        .map_err(|_| bad())?;
    if key.len() == 32 {
        Ok(key)
    } else {
        Err(bad())
    }
}

fn public_text(key: &[u8]) -> String {
    format!("{SCHEME}{}", B64.encode(key))
}

/// The bytes an unbound signature covers: the domain tag, then the record as JSON with sorted
/// keys and without its signature.
fn signed_bytes(record: &KeyRecord) -> Vec<u8> {
    record_bytes(DOMAIN.to_vec(), record)
}

/// The bytes a bound signature covers: its own domain tag, the environment as JSON (so no
/// environment name can end early and pass for another) and a newline, then the record as
/// [`signed_bytes`] writes it.
fn bound_bytes(record: &KeyRecord, environment: &str) -> Vec<u8> {
    let mut out = DOMAIN_BOUND.to_vec();
    out.extend(
        serde_json::Value::String(environment.to_owned())
            .to_string()
            .bytes(),
    );
    out.push(b'\n');
    record_bytes(out, record)
}

fn record_bytes(mut out: Vec<u8>, record: &KeyRecord) -> Vec<u8> {
    let mut value = serde_json::to_value(record).unwrap_or_default();
    if let Some(fields) = value.as_object_mut() {
        fields.remove("signature");
    }
    write_sorted(&value, &mut out);
    out
}

/// JSON with every object's keys in byte order, whatever order the map keeps them in.
fn write_sorted(value: &serde_json::Value, out: &mut Vec<u8>) {
    match value {
        serde_json::Value::Object(map) => {
            let mut fields: Vec<_> = map.iter().collect();
            fields.sort_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (key, value)) in fields.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend(serde_json::Value::String(key.clone()).to_string().bytes());
                out.push(b':');
                write_sorted(value, out);
            }
            out.push(b'}');
        }
        other => out.extend(other.to_string().bytes()),
    }
}

/// A new file only its owner can read; never one that exists.
fn open_new_private(path: &Path) -> std::io::Result<std::fs::File> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    options.open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> KeyRecord {
        crate::keys::record::sample_record(3)
    }

    fn off() -> Binding {
        Binding::default()
    }

    #[test]
    fn a_bound_signature_verifies_only_in_its_environment_and_unbound_ones_until_required() {
        let dir = tempfile::tempdir().unwrap();
        let (key, trusted) = pair(dir.path(), "fleet.key");
        let staging = Binding::new("staging", BindingMode::Sign);
        let production = Binding::new("production", BindingMode::Sign);
        let mut r = record();
        key.sign(&mut r, &staging);
        assert!(r.signature.as_deref().unwrap().starts_with(SCHEME_BOUND));
        assert_eq!(trusted.verify(&r, &staging), Ok(()));
        assert_eq!(trusted.verify(&r, &staging.required()), Ok(()));
        assert_eq!(
            trusted.verify(&r, &production),
            Err(Rejected::BadSignature),
            "a staging record in production"
        );
        assert_eq!(
            trusted.verify(&r, &Binding::new("production", BindingMode::Off)),
            Err(Rejected::BadSignature)
        );
        // An environment name cannot run into the record and pass for another one.
        assert_eq!(
            trusted.verify(&r, &Binding::new("stagin", BindingMode::Sign)),
            Err(Rejected::BadSignature)
        );
        let mut old = record();
        key.sign(&mut old, &off());
        assert!(old.signature.as_deref().unwrap().starts_with(SCHEME));
        assert_eq!(trusted.verify(&old, &production), Ok(()), "the roll");
        assert_eq!(
            trusted.verify(&old, &production.required()),
            Err(Rejected::Unbound)
        );
        // A bound signature relabelled unbound (or the other way) verifies as neither.
        let mut relabelled = r.clone();
        relabelled.signature = r
            .signature
            .as_deref()
            .map(|s| s.replacen(SCHEME_BOUND, SCHEME, 1));
        assert_eq!(
            trusted.verify(&relabelled, &staging),
            Err(Rejected::BadSignature)
        );
    }

    fn pair(dir: &Path, name: &str) -> (SigningKey, VerifyKeys) {
        let path = dir.join(name);
        let public = SigningKey::generate(&path).unwrap();
        let key = SigningKey::load(&path).unwrap();
        assert_eq!(key.public_key(), public);
        (key, VerifyKeys::parse(&[public]).unwrap())
    }

    #[test]
    fn a_signed_record_verifies_and_any_change_to_it_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let (key, trusted) = pair(dir.path(), "fleet.key");
        let mut r = record();
        assert_eq!(trusted.verify(&r, &off()), Err(Rejected::Unsigned));
        key.sign(&mut r, &off());
        assert_eq!(trusted.verify(&r, &off()), Ok(()));
        let changes: [fn(&mut KeyRecord); 5] = [
            |r| r.plan = "enterprise".into(),
            |r| r.version += 1,
            |r| r.revoked_at = None,
            |r| r.expires_at = Some("2099-01-01T00:00:00Z".into()),
            |r| r.per_day = Some(1_000_000),
        ];
        for change in changes {
            let mut forged = r.clone();
            change(&mut forged);
            if forged != r {
                assert_eq!(trusted.verify(&forged, &off()), Err(Rejected::BadSignature));
            }
        }
        let (_, other) = pair(dir.path(), "other.key");
        assert_eq!(other.verify(&r, &off()), Err(Rejected::BadSignature));
        let both = VerifyKeys::parse(&[
            key.public_key(),
            "ed25519:".to_owned() + &B64.encode([7u8; 32]),
        ])
        .unwrap();
        assert_eq!(
            both.verify(&r, &off()),
            Ok(()),
            "any trusted key will do (rotation)"
        );
        assert_eq!(
            VerifyKeys::default().verify(&record(), &off()),
            Ok(()),
            "no keys: unsigned taken"
        );
    }

    #[test]
    fn the_signature_covers_the_content_not_the_field_order() {
        let dir = tempfile::tempdir().unwrap();
        let (key, trusted) = pair(dir.path(), "fleet.key");
        let mut r = record();
        key.sign(&mut r, &off());
        // The record as another writer might lay it out: same fields, other order.
        let mut fields: Vec<(String, serde_json::Value)> = serde_json::to_value(&r)
            .unwrap()
            .as_object()
            .unwrap()
            .clone()
            .into_iter()
            .collect();
        fields.reverse();
        let text = format!(
            "{{{}}}",
            fields
                .iter()
                .map(|(k, v)| format!("{}:{v}", serde_json::Value::String(k.clone())))
                .collect::<Vec<_>>()
                .join(",")
        );
        let reparsed: KeyRecord = serde_json::from_str(&text).unwrap();
        assert_eq!(trusted.verify(&reparsed, &off()), Ok(()));
    }

    #[test]
    fn keygen_writes_a_private_file_and_never_overwrites_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fleet.key");
        let public = SigningKey::generate(&path).unwrap();
        assert!(public.starts_with("ed25519:") && parse_public(&public).is_ok());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        let before = std::fs::read(&path).unwrap();
        assert!(SigningKey::generate(&path).is_err(), "exists: refused");
        assert_eq!(std::fs::read(&path).unwrap(), before, "untouched");
    }

    #[test]
    fn bad_public_keys_and_key_files_are_refused_with_their_name() {
        for bad in [
            "",
            "ed25519:",
            "ed25519:AAAA",
            "rsa:AAAA",
            &B64.encode([1u8; 32]),
        ] {
            assert!(parse_public(bad).is_err(), "{bad}");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("not-a-key");
        std::fs::write(&path, "hello").unwrap();
        let e = SigningKey::load(&path).unwrap_err().to_string();
        assert!(
            e.contains("not-a-key") && e.contains("registry keygen"),
            "{e}"
        );
    }
}
