//! The SHA-256 of bearer tokens, remembered per thread for the last valid keys it saw.
//!
//! Every request's key is found by its SHA-256 ([`crate::keys::index`]), and a client sends the
//! same key on request after request: hashing it each time was 7,000 of the gateway's 41,800
//! instructions a request of its own work (callgrind, bench/RESULTS.md issue 33; natively, with
//! the CPU's SHA extensions, a few hundred cycles). pingora gives the proxy phases no state per
//! connection, so the memory is per thread: a few slots, each holding a token and its digest,
//! chosen by the token's last bytes (its checksum, for our keys).
//!
//! What it may and may not do:
//! - Only the digests of tokens that named a key of the index (in force, or expired) are kept,
//!   so a flood of made-up tokens cannot fill it; a remembered token that no longer names one (a
//!   key revoked) is forgotten when it is next sent.
//! - A hit still goes through the index: a revoked key is refused at once, as before.
//! - The token is compared whole, every byte whatever the others, so how long a comparison
//!   takes says nothing about how much of a token matched (a length that differs is seen at
//!   once: our keys' lengths are public). That a hit is faster than a miss says only that
//!   this thread saw the token recently, which only one who holds the key can ask.
//! - The tokens themselves are held (up to [`SLOTS`] a thread) as long as the thread lives or
//!   until evicted: the plaintext of keys in use, as the request buffers hold it briefly anyway,
//!   so a core dump of the gateway holds keys (the book, "The keys file").

use std::cell::RefCell;

use sha2::{Digest, Sha256};

/// Slots a thread.
pub const SLOTS: usize = 8;

/// Longer tokens are hashed each time (ours are 39 characters, 46 with the longest prefix).
const LONGEST: usize = 96;

#[derive(Clone, Copy)]
struct Slot {
    len: usize,
    token: [u8; LONGEST],
    digest: [u8; 32],
}

const EMPTY: Slot = Slot {
    len: 0,
    token: [0; LONGEST],
    digest: [0; 32],
};

thread_local! {
    static SEEN: RefCell<[Slot; SLOTS]> = const { RefCell::new([EMPTY; SLOTS]) };
}

/// The token's SHA-256, and whether it came from this thread's memory.
pub fn digest(token: &str) -> ([u8; 32], bool) {
    let bytes = token.as_bytes();
    if let Some(digest) = remembered(bytes) {
        return (digest, true);
    }
    (Sha256::digest(bytes).into(), false)
}

/// Keeps `digest` for `token`, which named a key of the index.
pub fn remember(token: &str, digest: [u8; 32]) {
    let bytes = token.as_bytes();
    with_slot(bytes, |slot| {
        slot.len = bytes.len();
        slot.token[..bytes.len()].copy_from_slice(bytes);
        slot.digest = digest;
    });
}

/// Forgets `token` (it no longer names a key): a revoked key's token is not kept.
pub fn forget(token: &str) {
    let bytes = token.as_bytes();
    with_slot(bytes, |slot| {
        if same(&slot.token[..slot.len], bytes) {
            *slot = EMPTY;
        }
    });
}

fn remembered(bytes: &[u8]) -> Option<[u8; 32]> {
    with_slot(bytes, |slot| {
        same(&slot.token[..slot.len], bytes).then_some(slot.digest)
    })
    .flatten()
}

/// `f` on this thread's slot for `bytes`; `None`, without calling it, for a token never
/// remembered (empty, or longer than [`LONGEST`]).
fn with_slot<R>(bytes: &[u8], f: impl FnOnce(&mut Slot) -> R) -> Option<R> {
    if bytes.is_empty() || bytes.len() > LONGEST {
        return None;
    }
    SEEN.with(|seen| Some(f(&mut seen.borrow_mut()[slot_of(bytes)])))
}

/// The slot a non-empty token goes to: its last two bytes (a key's checksum) and its length.
fn slot_of(bytes: &[u8]) -> usize {
    debug_assert!(!bytes.is_empty());
    let n = bytes.len();
    (usize::from(bytes[n - 1]) ^ (usize::from(bytes[n.saturating_sub(2)]) << 1) ^ n) % SLOTS
}

/// Equal, in a time that depends on the length only.
fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let differ = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(differ) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha(token: &str) -> [u8; 32] {
        Sha256::digest(token.as_bytes()).into()
    }

    #[test]
    fn a_remembered_token_is_served_its_digest_and_no_other_token_is() {
        let token = "pet_test_0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRS_ab1";
        assert_eq!(digest(token), (sha(token), false), "not seen yet");
        remember(token, sha(token));
        assert_eq!(digest(token), (sha(token), true));
        // The same length and last bytes (the same slot), one byte different anywhere.
        for at in [0, 20, token.len() - 3] {
            let mut other = token.as_bytes().to_vec();
            other[at] ^= 1;
            let other = String::from_utf8(other).unwrap();
            assert_eq!(slot_of(other.as_bytes()), slot_of(token.as_bytes()));
            assert_eq!(digest(&other), (sha(&other), false), "byte {at}");
        }
        // A longer token that starts with this one.
        let longer = format!("{token}x");
        assert_eq!(digest(&longer), (sha(&longer), false));
    }

    #[test]
    fn another_thread_and_a_token_of_the_same_slot_start_afresh() {
        let a = "pet_test_aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa_ab1";
        remember(a, sha(a));
        let elsewhere = std::thread::spawn(move || digest(a)).join().unwrap();
        assert_eq!(elsewhere, (sha(a), false), "per thread");
        let b = "pet_test_bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb_ab1";
        assert_eq!(slot_of(a.as_bytes()), slot_of(b.as_bytes()));
        remember(b, sha(b));
        assert_eq!(digest(b), (sha(b), true));
        assert_eq!(digest(a), (sha(a), false), "evicted by b");
    }

    #[test]
    fn a_forgotten_token_is_hashed_again_and_others_stay() {
        let a = "pet_test_forget_me_0000000000_x1";
        let b = "pet_test_keep_me_00000000000_y2";
        remember(a, sha(a));
        remember(b, sha(b));
        forget(a);
        assert_eq!(digest(a), (sha(a), false));
        if slot_of(a.as_bytes()) != slot_of(b.as_bytes()) {
            assert_eq!(digest(b), (sha(b), true));
        }
    }

    #[test]
    fn tokens_too_long_or_empty_are_never_kept() {
        let long = "k".repeat(LONGEST + 1);
        remember(&long, sha(&long));
        assert_eq!(digest(&long), (sha(&long), false));
        remember("", sha(""));
        assert_eq!(digest(""), (sha(""), false));
    }
}
