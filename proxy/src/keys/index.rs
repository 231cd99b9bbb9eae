//! The index of the keys in force, for the hot path: a key's SHA-256 to what the gateway needs
//! to know about it ([`KeyInfo`]), in as little memory as a million keys allow. Built from a
//! keys file by [`crate::keys::record`]; read on every request.

use std::collections::{HashMap, HashSet};
use std::hash::BuildHasherDefault;
use std::num::NonZeroU32;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::keys::digests;
use crate::keys::limits::{Every, Limits};

/// What the gateway needs to know about a valid key on the hot path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInfo {
    pub id: Arc<str>,
    pub plan: Arc<str>,
    /// Per-key settings, in 12 bytes (a million keys carry them).
    pub overrides: Overrides,
    /// The id counts and bans are kept under when it is not `id` (a rotation's successor).
    pub quota: Option<Arc<str>>,
}

/// A key's own limits and expiry; `None` where the plan's apply or it never expires.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// This key's own limits (behind one pointer: most keys have none).
    pub own: Option<Arc<Own>>,
    /// Unix seconds (fits until 2106).
    pub expires_at: Option<NonZeroU32>,
}

/// What a key sets for itself in place of its plan's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Own {
    /// Window lengths and their limits.
    pub windows: Vec<(Every, u32)>,
    /// Its requests in flight at once.
    pub concurrency: Option<NonZeroU32>,
}

/// What a customer's shared quota id starts with; no key id can.
pub const CUSTOMER_QUOTA: &str = "customer:";

/// The customer of a shared quota id (`customer:<name>`); none for a rotation's predecessor.
pub fn customer_of(quota: &str) -> Option<&str> {
    quota.strip_prefix(CUSTOMER_QUOTA)
}

impl KeyInfo {
    /// The id of the quota this key counts against.
    pub fn quota_id(&self) -> &Arc<str> {
        self.quota.as_ref().unwrap_or(&self.id)
    }

    /// The customer whose quota the key spends, when it has one.
    pub fn customer(&self) -> Option<&str> {
        self.quota.as_deref().and_then(customer_of)
    }

    /// Whether the key has expired at `now` (Unix seconds).
    pub fn expired(&self, now: u64) -> bool {
        self.overrides
            .expires_at
            .is_some_and(|at| now >= u64::from(at.get()))
    }

    /// The limits this key is held to: its plan's, with its own in their place.
    pub fn limits(&self, plan: &Limits) -> Limits {
        match &self.overrides.own {
            None => *plan,
            Some(own) => {
                let limits = plan.with_overrides(&own.windows);
                match own.concurrency {
                    Some(n) => limits.with_concurrency(n.get()),
                    None => limits,
                }
            }
        }
    }
}

/// Active (not revoked) keys by the SHA-256 of the key. The entries sit in one vector and the
/// table maps a hash to a 32-bit position in it: a hash table keeps a good part of its slots
/// empty, and an empty slot of 20 bytes costs far less than one of a whole entry (a million keys:
/// about 40 MB of table instead of 170).
#[derive(Debug, Clone, Default)]
pub struct KeyIndex {
    /// By the first 16 bytes of the key's SHA-256: finding another key with the same 128 bits is
    /// as hard as a second preimage of them (2^128 work).
    slots: HashMap<[u8; 16], u32, BuildHasherDefault<HashPrefix>>,
    keys: Vec<KeyInfo>,
}

/// The table's hasher: the keys are already SHA-256 output, uniformly spread and chosen by no
/// one (only issued keys are inserted; a lookup cannot add one), so their first bytes are the
/// hash.
#[derive(Debug, Default)]
pub struct HashPrefix(u64);

impl std::hash::Hasher for HashPrefix {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut word = [0u8; 8];
        let n = bytes.len().min(8);
        word[..n].copy_from_slice(&bytes[..n]);
        self.0 = self.0.rotate_left(5) ^ u64::from_le_bytes(word);
    }
}

impl KeyIndex {
    /// `capacity`: how many entries there are, at most (the table and the vector are sized once).
    pub(crate) fn from_entries(
        capacity: usize,
        entries: impl IntoIterator<Item = ([u8; 16], KeyInfo)>,
    ) -> KeyIndex {
        let mut index = KeyIndex {
            slots: HashMap::with_capacity_and_hasher(capacity, Default::default()),
            keys: Vec::with_capacity(capacity),
        };
        for (hash, info) in entries {
            // At most u32::MAX keys (a keys file that large could not be loaded anyway).
            let Ok(at) = u32::try_from(index.keys.len()) else {
                break;
            };
            match index.slots.entry(hash) {
                std::collections::hash_map::Entry::Occupied(e) => {
                    // The same key twice: the later record wins, as it did in a map.
                    index.keys[*e.get() as usize] = info;
                }
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(at);
                    index.keys.push(info);
                }
            }
        }
        index.keys.shrink_to_fit();
        index
    }

    /// The key in force that `token` names. Its digest comes from this thread's memory of the
    /// last valid keys when it is there (`digests`), and goes there when the token names a key.
    pub fn lookup(&self, token: &str) -> Option<&KeyInfo> {
        let (sha, remembered) = digests::digest(token);
        let Some(&at) = self.slots.get(&index_hash(&sha)) else {
            if remembered {
                digests::forget(token);
            }
            return None;
        };
        if !remembered {
            digests::remember(token, sha);
        }
        self.keys.get(at as usize)
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Every active key.
    pub fn keys(&self) -> impl Iterator<Item = &KeyInfo> {
        self.keys.iter()
    }

    /// The key with this id (a scan: the index is by hash; for the admin side only).
    pub fn by_id(&self, id: &str) -> Option<&KeyInfo> {
        self.keys.iter().find(|k| &*k.id == id)
    }

    /// The keys with these ids: one pass (the index is by hash), ending once each is found.
    /// For the admin side, where a page or a ranking names a few keys among a million.
    pub fn by_ids(&self, ids: &HashSet<&str>) -> HashMap<&str, &KeyInfo> {
        let mut found = HashMap::with_capacity(ids.len());
        for key in &self.keys {
            if found.len() == ids.len() {
                break;
            }
            if ids.contains(&*key.id) {
                found.entry(&*key.id).or_insert(key);
            }
        }
        found
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

pub fn sha256(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// The part of a key's SHA-256 the index is keyed by.
pub(crate) fn index_hash(sha: &[u8; 32]) -> [u8; 16] {
    let mut h = [0u8; 16];
    h.copy_from_slice(&sha[..16]);
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(id: &str, plan: &str) -> KeyInfo {
        KeyInfo {
            id: Arc::from(id),
            plan: Arc::from(plan),
            overrides: Overrides::default(),
            quota: None,
        }
    }

    fn index(keys: &[(&str, KeyInfo)]) -> KeyIndex {
        KeyIndex::from_entries(
            keys.len(),
            keys.iter()
                .map(|(token, info)| (index_hash(&sha256(token)), info.clone())),
        )
    }

    /// The digest of a valid token is remembered (`digests`), the key is not: a key revoked or
    /// changed since is found as the index in force has it.
    #[test]
    fn a_remembered_token_still_finds_only_what_the_index_in_force_holds() {
        let token = "pet_test_index_remembers_the_digest_not_the_key_0123456789abcdef_x1";
        let before = index(&[(token, info("k1", "free"))]);
        assert_eq!(before.lookup(token).map(|k| &*k.plan), Some("free"));
        assert!(digests::digest(token).1, "remembered once it named a key");
        let revoked = index(&[("pet_test_another", info("k2", "free"))]);
        assert_eq!(revoked.lookup(token), None);
        assert!(
            !digests::digest(token).1,
            "a revoked key's token is not kept"
        );
        let moved = index(&[(token, info("k1", "pro"))]);
        assert_eq!(moved.lookup(token).map(|k| &*k.plan), Some("pro"));
        let unknown = "pet_test_never_issued_never_remembered_0000000000000000000000000_z9";
        assert_eq!(moved.lookup(unknown), None);
        assert!(
            !digests::digest(unknown).1,
            "a token that names no key is not kept"
        );
    }
}
