//! Signed key records: whoever changes records (the `keys` commands, a node's admin key API)
//! signs each with the fleet's Ed25519 signing key, and every node verifies each record it takes
//! from the registry against the public keys it trusts. So write access to Redis alone can mint
//! no key, upgrade no plan, extend no expiry and, with the versions a node remembers, undo no
//! revocation.
//!
//! What is signed: a domain tag and the record as JSON with its keys sorted and its `signature`
//! left out, so the signature does not depend on field order, and a record moved into another
//! kind of document cannot pass for a key record.

use std::io::Write;
use std::path::Path;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use ring::rand::SystemRandom;
use ring::signature::{Ed25519KeyPair, KeyPair, UnparsedPublicKey, ED25519};

use crate::keys::record::KeyRecord;

/// Prefixes the signed bytes: a signature over anything else never verifies as a record's.
const DOMAIN: &[u8] = b"pet-gateway key record v1\n";
const PEM_BEGIN: &str = "-----BEGIN PRIVATE KEY-----";
const PEM_END: &str = "-----END PRIVATE KEY-----";
/// How public keys and signatures are written: `ed25519:<base64>`.
const SCHEME: &str = "ed25519:";

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
}

impl Rejected {
    /// The metric label.
    pub fn reason(self) -> &'static str {
        match self {
            Rejected::Unsigned => "unsigned",
            Rejected::BadSignature => "bad_signature",
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

    /// `record` with its signature set (over everything else in it).
    pub fn sign(&self, record: &mut KeyRecord) {
        record.signature = None;
        let signature = self.pair.sign(&signed_bytes(record));
        record.signature = Some(format!("{SCHEME}{}", B64.encode(signature.as_ref())));
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

    /// Whether one of the trusted keys signed `record`. With no keys every record passes.
    pub fn verify(&self, record: &KeyRecord) -> Result<(), Rejected> {
        if self.0.is_empty() {
            return Ok(());
        }
        let signature = record
            .signature
            .as_deref()
            .and_then(|s| s.strip_prefix(SCHEME))
            .ok_or(Rejected::Unsigned)?;
        let signature = B64.decode(signature).map_err(|_| Rejected::BadSignature)?;
        let message = signed_bytes(record);
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

/// The bytes a record's signature covers: the domain tag, then the record as JSON with sorted
/// keys and without its signature.
fn signed_bytes(record: &KeyRecord) -> Vec<u8> {
    let mut value = serde_json::to_value(record).unwrap_or_default();
    if let Some(fields) = value.as_object_mut() {
        fields.remove("signature");
    }
    let mut out = DOMAIN.to_vec();
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
        assert_eq!(trusted.verify(&r), Err(Rejected::Unsigned));
        key.sign(&mut r);
        assert_eq!(trusted.verify(&r), Ok(()));
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
                assert_eq!(trusted.verify(&forged), Err(Rejected::BadSignature));
            }
        }
        let (_, other) = pair(dir.path(), "other.key");
        assert_eq!(other.verify(&r), Err(Rejected::BadSignature));
        let both = VerifyKeys::parse(&[
            key.public_key(),
            "ed25519:".to_owned() + &B64.encode([7u8; 32]),
        ])
        .unwrap();
        assert_eq!(
            both.verify(&r),
            Ok(()),
            "any trusted key will do (rotation)"
        );
        assert_eq!(
            VerifyKeys::default().verify(&record()),
            Ok(()),
            "no keys: unsigned taken"
        );
    }

    #[test]
    fn the_signature_covers_the_content_not_the_field_order() {
        let dir = tempfile::tempdir().unwrap();
        let (key, trusted) = pair(dir.path(), "fleet.key");
        let mut r = record();
        key.sign(&mut r);
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
        assert_eq!(trusted.verify(&reparsed), Ok(()));
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
