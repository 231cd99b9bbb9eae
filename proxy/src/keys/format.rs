//! The API key format: recognisable by secret scanners and checkable by the gateway before any
//! lookup.
//!
//! A key is `<prefix><24 random characters><6 checksum characters>`, all after the prefix in
//! `[0-9A-Za-z]`:
//!
//! - the prefix names the environment: `pet_live_` for production, `pet_test_` for staging and
//!   local (the `api_key_prefix` setting overrides it);
//! - 24 random base62 characters carry 142 bits, far beyond guessing;
//! - the checksum is the CRC32 of everything before it, in 6 base62 characters: a typo, a
//!   truncated copy or a made-up token is refused as malformed without hashing or a lookup, and
//!   a scanner can tell a real key from a look-alike.
//!
//! For secret scanning: [`SCAN_PATTERN`]. Keys issued before this format (`pet_` and 64 hex
//! digits) keep working; they have no checksum.

use rand::Rng;

pub const LIVE_PREFIX: &str = "pet_live_";
pub const TEST_PREFIX: &str = "pet_test_";
const RANDOM_CHARS: usize = 24;
const CHECK_CHARS: usize = 6;
const ALPHABET: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// A regular expression matching keys of the shipped prefixes, for secret scanners.
pub const SCAN_PATTERN: &str = r"\bpet_(?:live|test)_[0-9A-Za-z]{30}\b";

/// The prefix of new keys in `environment`, unless configured otherwise.
pub fn default_prefix(environment: &str) -> &'static str {
    if environment == "production" {
        LIVE_PREFIX
    } else {
        TEST_PREFIX
    }
}

/// Whether `prefix` can start keys: 2 to 16 of `a-z`, `0-9`, `_`, ending in `_`.
pub fn valid_prefix(prefix: &str) -> bool {
    (2..=16).contains(&prefix.len())
        && prefix.ends_with('_')
        && prefix
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// A new key with `prefix`.
pub fn generate(prefix: &str) -> String {
    let mut rng = rand::rng();
    let mut key = String::with_capacity(prefix.len() + RANDOM_CHARS + CHECK_CHARS);
    key.push_str(prefix);
    for _ in 0..RANDOM_CHARS {
        key.push(char::from(ALPHABET[rng.random_range(0..ALPHABET.len())]));
    }
    let check = checksum(key.as_bytes());
    key.push_str(&check);
    key
}

/// Whether a presented token may be looked up. A token that starts like a key of the new
/// format (a shipped prefix, or `custom`) must be one, checksum included; anything else (a key
/// of the old format, or any other string) is left to the lookup.
pub fn plausible(token: &str, custom: &str) -> bool {
    if is_legacy(token) {
        return true;
    }
    let mut claimed = false;
    for prefix in [LIVE_PREFIX, TEST_PREFIX, custom] {
        let Some(rest) = token.strip_prefix(prefix).filter(|_| !prefix.is_empty()) else {
            continue;
        };
        claimed = true;
        // One prefix may start another (`pet_live_` and `pet_live_eu_`): any that fits wins.
        if rest.len() == RANDOM_CHARS + CHECK_CHARS
            && rest.bytes().all(|b| b.is_ascii_alphanumeric())
        {
            let (body, check) = token.split_at(token.len() - CHECK_CHARS);
            if checksum(body.as_bytes()) == check {
                return true;
            }
        }
    }
    !claimed
}

/// A key of the format before this one: `pet_` and 64 hex digits (no checksum).
fn is_legacy(token: &str) -> bool {
    token
        .strip_prefix("pet_")
        .is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

fn checksum(bytes: &[u8]) -> String {
    let mut n = crc32(bytes);
    let mut out = [b'0'; CHECK_CHARS];
    for slot in out.iter_mut().rev() {
        *slot = ALPHABET[(n % 62) as usize];
        n /= 62;
    }
    out.iter().map(|&b| char::from(b)).collect()
}

/// CRC-32 (IEEE 802.3, as zlib's `crc32`), bit by bit: a few dozen bytes per request.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_is_the_standard_one() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
    }

    #[test]
    fn generated_keys_have_the_prefix_the_shape_and_a_valid_checksum() {
        for prefix in [LIVE_PREFIX, TEST_PREFIX, "acme_"] {
            let key = generate(prefix);
            assert!(key.starts_with(prefix));
            assert_eq!(key.len(), prefix.len() + 30);
            assert!(plausible(&key, "acme_"), "{key}");
        }
        assert_ne!(generate(LIVE_PREFIX), generate(LIVE_PREFIX));
        assert_eq!(default_prefix("production"), LIVE_PREFIX);
        assert_eq!(default_prefix("staging"), TEST_PREFIX);
    }

    #[test]
    fn a_changed_character_a_truncation_or_a_made_up_token_fails_the_checksum() {
        let key = generate(LIVE_PREFIX);
        let mut typo = key.clone().into_bytes();
        let i = LIVE_PREFIX.len() + 3;
        typo[i] = if typo[i] == b'a' { b'b' } else { b'a' };
        let typo = String::from_utf8(typo).unwrap();
        for bad in [
            typo.as_str(),
            &key[..key.len() - 1],
            "pet_live_aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            "pet_test_short",
            "pet_live_aaaaaaaaaaaaaaaaaaaaaaaa-aaaaa",
        ] {
            assert!(!plausible(bad, ""), "{bad}");
        }
        // The old format and foreign strings are left to the lookup.
        assert!(plausible(&format!("pet_{}", "ab".repeat(32)), ""));
        assert!(plausible("something-else", ""));
    }

    #[test]
    fn a_custom_prefix_never_shadows_keys_of_another_prefix_or_the_old_format() {
        let eu = generate("pet_live_eu_");
        assert!(plausible(&eu, "pet_live_eu_"), "{eu}");
        assert!(plausible(&generate(LIVE_PREFIX), "pet_live_eu_"));
        let legacy = format!("pet_{}", "0f".repeat(32));
        assert!(plausible(&legacy, "pet_"));
        assert!(!plausible(
            "pet_live_eu_aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            "pet_live_eu_"
        ));
    }

    #[test]
    fn prefixes_are_checked() {
        assert!(valid_prefix("pet_live_") && valid_prefix("acme_"));
        for bad in ["", "_", "acme", "Acme_", "a-b_", "very_long_prefix_x_"] {
            assert!(!valid_prefix(bad), "{bad}");
        }
    }
}
