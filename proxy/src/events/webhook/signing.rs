//! How a batch tells its receiver it is ours: the headers each POST carries, by the scheme the
//! operator chose (`events_webhook_signature`).
//!
//! - `pet`, the default: `Pet-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of
//!   "<t>.<body>">`, keyed by the secret's bytes as written. It stays the default because
//!   receivers deployed today check it; switching would break them silently.
//! - `standard`: the Standard Webhooks specification, which receivers verify with a library
//!   (`standardwebhooks`, Svix's): `webhook-id`, `webhook-timestamp` and `webhook-signature:
//!   v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">`, keyed by the base64 value after a
//!   `whsec_` secret's prefix.
//! - `both`: the two header sets, for moving receivers from one scheme to the other.
//!
//! During a secret rotation (`events_webhook_previous_secret`) each scheme's header carries the
//! signature by the new secret first, then by the previous one: `v1=<new>,v1=<old>` and
//! `v1,<new> v1,<old>`, as each scheme allows, so a receiver holding either verifies.

use base64::Engine;
use ring::hmac;

use super::WebhookSecret;

/// The scheme of `events_webhook_signature`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scheme {
    Pet,
    Standard,
    Both,
}

impl Scheme {
    fn pet(self) -> bool {
        matches!(self, Scheme::Pet | Scheme::Both)
    }

    fn standard(self) -> bool {
        matches!(self, Scheme::Standard | Scheme::Both)
    }
}

/// The prefix of a Standard Webhooks secret.
pub const STANDARD_PREFIX: &str = "whsec_";

/// The bytes of a `whsec_` secret's key, as the specification bounds them.
const STANDARD_KEY_BYTES: std::ops::RangeInclusive<usize> = 24..=64;

/// The shortest secret the `pet` scheme signs with, in bytes as written. Standard Webhooks
/// (`spec/standard-webhooks.md`) asks for keys of 24 to 64 random bytes,
/// written `whsec_` and base64: 24 bytes are 32 base64 characters. A `pet` secret is used as
/// written, so it must be at least that long: what `openssl rand -base64 24` makes, and any
/// `whsec_` secret, pass; a word or a short phrase does not.
pub const MIN_PET_SECRET_BYTES: usize = 32;

/// One secret's keys: the bytes as written (the `pet` scheme's) and, for a `whsec_` secret,
/// the decoded key (the standard one's).
struct Keys {
    pet: hmac::Key,
    standard: Option<hmac::Key>,
}

/// Signs batches by the configured scheme with the current secret, and the previous one during
/// a rotation.
pub struct Signer {
    scheme: Scheme,
    /// The current secret's first.
    keys: Vec<Keys>,
}

impl Signer {
    /// Refuses a secret the scheme cannot use: with `standard` or `both`, the current secret
    /// must be `whsec_<base64>` of 24 to 64 bytes, and so must the previous one with
    /// `standard` (with `both`, a previous secret of another form signs `Pet-Signature` only,
    /// as it did before the move). The current secret is at least [`MIN_PET_SECRET_BYTES`]
    /// long; a previous one is not held to it, so that a short secret can be rotated away
    /// from. The error names no secret.
    pub fn new(
        scheme: Scheme,
        current: &WebhookSecret,
        previous: Option<&WebhookSecret>,
    ) -> Result<Signer, String> {
        let mut keys = vec![keys_of(current, scheme.standard())
            .map_err(|why| format!("the webhook's secret {why}"))?];
        if current.bytes().len() < MIN_PET_SECRET_BYTES {
            return Err(format!(
                "the webhook's secret is {} bytes; it must be at least {MIN_PET_SECRET_BYTES} \
                 (the base64 of the 24 random bytes Standard Webhooks asks for at least: \
                 `openssl rand -base64 24`, or `{STANDARD_PREFIX}$(openssl rand -base64 32)`)",
                current.bytes().len()
            ));
        }
        if let Some(previous) = previous {
            let needs_standard = scheme == Scheme::Standard;
            keys.push(
                keys_of(previous, needs_standard)
                    .map_err(|why| format!("the webhook's previous secret {why}"))?,
            );
        }
        Ok(Signer { scheme, keys })
    }

    /// The header lines (each ending `\r\n`) that sign `body`, sent at `t` as batch `id`.
    pub fn headers(&self, id: &str, t: u64, body: &[u8]) -> String {
        let mut out = String::new();
        if self.scheme.pet() {
            let signatures: Vec<String> = self
                .keys
                .iter()
                .map(|k| format!("v1={}", hex::encode(pet_signature(&k.pet, t, body))))
                .collect();
            out += &format!("Pet-Signature: t={t},{}\r\n", signatures.join(","));
        }
        if self.scheme.standard() {
            let signatures: Vec<String> = self
                .keys
                .iter()
                .filter_map(|k| k.standard.as_ref())
                .map(|key| {
                    let mac = standard_signature(key, id, t, body);
                    format!(
                        "v1,{}",
                        base64::engine::general_purpose::STANDARD.encode(mac)
                    )
                })
                .collect();
            out += &format!(
                "webhook-id: {id}\r\nwebhook-timestamp: {t}\r\nwebhook-signature: {}\r\n",
                signatures.join(" ")
            );
        }
        out
    }
}

fn keys_of(secret: &WebhookSecret, needs_standard: bool) -> Result<Keys, String> {
    let standard = match standard_key(secret.bytes()) {
        Ok(key) => Some(hmac::Key::new(hmac::HMAC_SHA256, &key)),
        Err(why) if needs_standard => return Err(why),
        Err(_) => None,
    };
    Ok(Keys {
        pet: hmac::Key::new(hmac::HMAC_SHA256, secret.bytes()),
        standard,
    })
}

/// The key of a `whsec_<base64>` secret.
fn standard_key(secret: &[u8]) -> Result<Vec<u8>, String> {
    let Some(encoded) = secret.strip_prefix(STANDARD_PREFIX.as_bytes()) else {
        return Err(format!(
            "must be `{STANDARD_PREFIX}` and the base64 of 24 to 64 random bytes for the \
             standard signature (for instance `{STANDARD_PREFIX}$(openssl rand -base64 32)`)"
        ));
    };
    let key = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .map_err(|_| format!("is not base64 after `{STANDARD_PREFIX}`"))?;
    if !STANDARD_KEY_BYTES.contains(&key.len()) {
        return Err(format!(
            "holds {} bytes after `{STANDARD_PREFIX}`; the standard signature takes 24 to 64",
            key.len()
        ));
    }
    Ok(key)
}

fn pet_signature(key: &hmac::Key, t: u64, body: &[u8]) -> hmac::Tag {
    let mut ctx = hmac::Context::with_key(key);
    ctx.update(t.to_string().as_bytes());
    ctx.update(b".");
    ctx.update(body);
    ctx.sign()
}

fn standard_signature(key: &hmac::Key, id: &str, t: u64, body: &[u8]) -> hmac::Tag {
    let mut ctx = hmac::Context::with_key(key);
    ctx.update(id.as_bytes());
    ctx.update(b".");
    ctx.update(t.to_string().as_bytes());
    ctx.update(b".");
    ctx.update(body);
    ctx.sign()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(text: &str) -> WebhookSecret {
        WebhookSecret::new(text.as_bytes().to_vec()).unwrap()
    }

    /// The specification's own example (standard-webhooks, `spec/standard-webhooks.md`): its
    /// secret, id, timestamp and body, and the signature it gives for them.
    #[test]
    fn the_standard_signature_is_the_specifications_example() {
        let signer = Signer::new(
            Scheme::Standard,
            &secret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"),
            None,
        )
        .unwrap();
        let headers = signer.headers(
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            br#"{"test": 2432232314}"#,
        );
        assert_eq!(
            headers,
            "webhook-id: msg_p5jXN8AQM9LWM0D4loKWxJek\r\nwebhook-timestamp: 1614265330\r\n\
             webhook-signature: v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=\r\n"
        );
    }

    #[test]
    fn the_pet_signature_is_the_hmac_of_time_dot_body() {
        // Computed independently:
        // printf '1795000000.[]' | openssl dgst -sha256 -hmac 0123456789abcdef0123456789abcdef
        let signer = Signer::new(
            Scheme::Pet,
            &secret("0123456789abcdef0123456789abcdef"),
            None,
        )
        .unwrap();
        assert_eq!(
            signer.headers("ignored", 1_795_000_000, b"[]"),
            "Pet-Signature: t=1795000000,v1=\
             e8f881e1baa194eb34e3a440063e616a431c456f4ae367f6faf6e0bb70c0079d\r\n"
        );
    }

    #[test]
    fn a_rotation_signs_with_both_secrets_the_new_first() {
        let new = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let old = "whsec_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";
        let both = Signer::new(Scheme::Both, &secret(new), Some(&secret(old))).unwrap();
        let alone = |s: &str| {
            Signer::new(Scheme::Both, &secret(s), None)
                .unwrap()
                .headers("id", 7, b"x")
        };
        let (new_h, old_h, both_h) = (alone(new), alone(old), both.headers("id", 7, b"x"));
        let value = |h: &str, name: &str| {
            h.lines()
                .find_map(|l| l.strip_prefix(name))
                .unwrap()
                .to_owned()
        };
        let sig = "webhook-signature: ";
        assert_eq!(
            value(&both_h, sig),
            format!("{} {}", value(&new_h, sig), value(&old_h, sig))
        );
        let pet = "Pet-Signature: t=7,";
        assert_eq!(
            value(&both_h, pet),
            format!("{},{}", value(&new_h, pet), value(&old_h, pet))
        );
    }

    #[test]
    fn a_secret_the_standard_scheme_cannot_use_is_refused_naming_no_secret() {
        for (text, why) in [
            ("plain-secret", "must be `whsec_`"),
            ("whsec_not*base64", "is not base64"),
            ("whsec_c2hvcnQ=", "holds 5 bytes"),
        ] {
            let e = Signer::new(Scheme::Standard, &secret(text), None)
                .err()
                .unwrap();
            assert!(e.contains(why), "{text}: {e}");
            assert!(!e.contains(text), "{e}");
            let long = format!("{text}-{}", "x".repeat(MIN_PET_SECRET_BYTES));
            assert!(Signer::new(Scheme::Pet, &secret(&long), None).is_ok());
        }
        // Moving from `pet`: the old plain secret still signs Pet-Signature.
        let moving = Signer::new(
            Scheme::Both,
            &secret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"),
            Some(&secret("plain-secret")),
        )
        .unwrap();
        let h = moving.headers("id", 7, b"x");
        assert_eq!(h.matches("v1=").count(), 2, "{h}");
        assert_eq!(h.matches("v1,").count(), 1, "{h}");
        assert!(Signer::new(
            Scheme::Standard,
            &secret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"),
            Some(&secret("plain-secret")),
        )
        .is_err());
    }

    /// A short `pet` secret is refused, naming its length and the rule, never the secret; one
    /// of the minimum passes, and a short previous one still signs while it is rotated away.
    #[test]
    fn a_pet_secret_shorter_than_the_standard_minimum_is_refused() {
        let short = "whsec-test-0123456789";
        let e = Signer::new(Scheme::Pet, &secret(short), None)
            .err()
            .unwrap();
        assert!(e.contains("21 bytes") && e.contains("at least 32"), "{e}");
        assert!(!e.contains(short), "{e}");
        let minimum = "a".repeat(MIN_PET_SECRET_BYTES);
        assert!(Signer::new(Scheme::Pet, &secret(&minimum[1..]), None).is_err());
        assert!(Signer::new(Scheme::Pet, &secret(&minimum), None).is_ok());
        let rotating = Signer::new(Scheme::Pet, &secret(&minimum), Some(&secret(short))).unwrap();
        assert_eq!(rotating.headers("id", 7, b"x").matches("v1=").count(), 2);
    }
}
