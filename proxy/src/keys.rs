//! The keys file: which API keys exist, their plan, name and id. It holds only the SHA-256 hash
//! of each key: whoever reads the file (or a backup of it) cannot use the keys. `keys issue`
//! prints a new key once; nothing can print it again.
//!
//! Writes go through a lock file and an atomic rename, so two `keys` commands never lose each
//! other's change and a running gateway never reads a half-written file.

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::hash::BuildHasherDefault;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rand::RngCore;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::clock::{parse_rfc3339, rfc3339_now};
use crate::plans::Plans;
use crate::quota::Limits;
use std::num::NonZeroU32;

/// What keys issued before the checksummed format (`key_format`) start with: `pet_` and 64
/// hex digits. They keep working.
pub const LEGACY_KEY_PREFIX: &str = "pet_";

#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: cannot write: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {message}", path.display())]
    Invalid { path: PathBuf, message: String },
    #[error("no plan `{plan}` (plans: {known}); add {plan}.toml to the plans directory first")]
    UnknownPlan { plan: String, known: String },
    #[error("no key with id `{0}`")]
    NoSuchKey(String),
    #[error("key `{0}` is revoked or expired: issue a new one instead")]
    NotActive(String),
    #[error("key registry: {0}")]
    Registry(String),
    #[error("key `{0}` was rotated to `{1}` already: rotate that one, or revoke")]
    AlreadyRotated(String, String),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyRecord {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub plan: String,
    /// Hex SHA-256 of the key.
    pub sha256: String,
    /// RFC 3339, UTC.
    pub created_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<String>,
    /// RFC 3339; from then on the key gets 401 saying it expired.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    /// This key's own limits, in place of its plan's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_minute: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_day: Option<u64>,
    /// The key whose quota (counts and bans) this one shares: set on a rotation's successor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota_of: Option<String>,
    /// The successor this key was rotated to; it stops at its `expires_at`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotated_to: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeysFile {
    #[serde(default, rename = "key")]
    pub keys: Vec<KeyRecord>,
}

/// What the gateway needs to know about a valid key on the hot path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInfo {
    pub id: Arc<str>,
    pub plan: Arc<str>,
    /// Per-key settings, 4 bytes each (a million keys carry them).
    pub overrides: Overrides,
    /// The id counts and bans are kept under when it is not `id` (a rotation's successor).
    pub quota: Option<Arc<str>>,
}

/// A key's own limits and expiry; `None` where the plan's apply or it never expires.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overrides {
    pub per_minute: Option<NonZeroU32>,
    pub per_day: Option<NonZeroU32>,
    /// Unix seconds (fits until 2106).
    pub expires_at: Option<NonZeroU32>,
}

impl KeyInfo {
    /// The id of the quota this key counts against.
    pub fn quota_id(&self) -> &Arc<str> {
        self.quota.as_ref().unwrap_or(&self.id)
    }

    /// Whether the key has expired at `now` (Unix seconds).
    pub fn expired(&self, now: u64) -> bool {
        self.overrides
            .expires_at
            .is_some_and(|at| now >= u64::from(at.get()))
    }

    /// The limits this key is held to: its plan's, with its own in their place.
    pub fn limits(&self, plan: Limits) -> Limits {
        Limits {
            per_minute: self
                .overrides
                .per_minute
                .map_or(plan.per_minute, |n| u64::from(n.get())),
            per_day: self
                .overrides
                .per_day
                .map_or(plan.per_day, |n| u64::from(n.get())),
        }
    }
}

impl KeyRecord {
    /// The per-key settings, as checked on load (invalid ones never get this far).
    pub fn overrides(&self) -> Overrides {
        let small = |n: Option<u64>| {
            n.and_then(|n| u32::try_from(n).ok())
                .and_then(NonZeroU32::new)
        };
        Overrides {
            per_minute: small(self.per_minute),
            per_day: small(self.per_day),
            expires_at: small(self.expires_at.as_deref().and_then(parse_rfc3339)),
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
    fn from_entries(
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

    pub fn lookup(&self, token: &str) -> Option<&KeyInfo> {
        let at = *self.slots.get(&index_hash(&sha256(token)))?;
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

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// Longest key id accepted.
pub const MAX_KEY_ID: usize = 64;

/// Whether `id` is safe everywhere a key id goes: the `X-Api-Key-Id` header, the Redis hash tag
/// `{id}`, the admin URL `/bans/{id}/lift`, log lines and metrics tooling. Issued ids
/// (`key_` and hex) always are; a hand-edited file may hold anything.
pub fn valid_key_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_KEY_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

pub fn sha256(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// The part of a key's SHA-256 the index is keyed by.
fn index_hash(sha: &[u8; 32]) -> [u8; 16] {
    let mut h = [0u8; 16];
    h.copy_from_slice(&sha[..16]);
    h
}

impl KeysFile {
    /// Reads the file; a file that does not exist yet holds no keys.
    pub fn load(path: &Path) -> Result<KeysFile, KeysError> {
        // Only a regular file (following a symlink): a FIFO would block a reload, a device
        // would never end.
        match std::fs::metadata(path) {
            Ok(m) if !m.is_file() => {
                return Err(KeysError::Invalid {
                    path: path.to_owned(),
                    message: "not a regular file".into(),
                })
            }
            _ => {}
        }
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(KeysFile::default()),
            Err(source) => {
                return Err(KeysError::Read {
                    path: path.to_owned(),
                    source,
                })
            }
        };
        let file: KeysFile = toml::from_str(&text).map_err(|e| KeysError::Invalid {
            path: path.to_owned(),
            message: e.to_string().trim_end().to_owned(),
        })?;
        file.validate(path)?;
        Ok(file)
    }

    fn validate(&self, path: &Path) -> Result<(), KeysError> {
        let invalid = |message: String| KeysError::Invalid {
            path: path.to_owned(),
            message,
        };
        let mut ids = HashSet::new();
        let mut hashes = HashSet::new();
        for (i, k) in self.keys.iter().enumerate() {
            let at = format!("key #{} (id `{}`)", i + 1, k.id);
            if !valid_key_id(&k.id) {
                return Err(invalid(format!(
                    "{at}: field `id` must be 1 to {MAX_KEY_ID} letters, digits, `_` or `-` \
                     (it becomes a header value, a Redis hash tag and part of an admin URL)"
                )));
            }
            if !ids.insert(k.id.as_str()) {
                return Err(invalid(format!("{at}: field `id` is repeated")));
            }
            if k.sha256.len() != 64 || hex::decode(&k.sha256).is_err() {
                return Err(invalid(format!(
                    "{at}: field `sha256` must be 64 hex digits"
                )));
            }
            if !hashes.insert(k.sha256.to_ascii_lowercase()) {
                return Err(invalid(format!(
                    "{at}: field `sha256` repeats another key's"
                )));
            }
            if k.plan.is_empty() {
                return Err(invalid(format!("{at}: field `plan` is empty")));
            }
            for (field, value) in [("quota_of", &k.quota_of), ("rotated_to", &k.rotated_to)] {
                if value.as_deref().is_some_and(|v| !valid_key_id(v)) {
                    return Err(invalid(format!("{at}: field `{field}` is not a key id")));
                }
            }
            if let Some(e) = &k.expires_at {
                if parse_rfc3339(e).is_none_or(|t| t == 0 || t > u64::from(u32::MAX)) {
                    return Err(invalid(format!(
                        "{at}: field `expires_at` must be an RFC 3339 date-time \
                         (`2027-01-31T00:00:00Z`) before 2106"
                    )));
                }
            }
            for (field, value) in [("per_minute", k.per_minute), ("per_day", k.per_day)] {
                if value.is_some_and(|n| n == 0 || n > u64::from(u32::MAX)) {
                    return Err(invalid(format!(
                        "{at}: field `{field}` must be a whole number from 1 to {}",
                        u32::MAX
                    )));
                }
            }
        }
        Ok(())
    }

    /// Every active key's plan must exist.
    pub fn check_plans(&self, path: &Path, plans: &Plans) -> Result<(), KeysError> {
        for k in self.active() {
            if !plans.contains(&k.plan) {
                return Err(KeysError::Invalid {
                    path: path.to_owned(),
                    message: format!(
                        "key `{}`: field `plan`: no plan `{}` in the plans directory (plans: {})",
                        k.id,
                        k.plan,
                        plans.names().join(", ")
                    ),
                });
            }
        }
        Ok(())
    }

    /// The records neither revoked nor expired: those whose plan must exist.
    pub fn active(&self) -> impl Iterator<Item = &KeyRecord> {
        let now = crate::clock::unix_now();
        self.keys
            .iter()
            .filter(move |k| k.revoked_at.is_none() && !k.expired(now))
    }

    /// The record with this id.
    pub fn get(&self, id: &str) -> Result<&KeyRecord, KeysError> {
        self.keys
            .iter()
            .find(|k| k.id == id)
            .ok_or_else(|| KeysError::NoSuchKey(id.to_owned()))
    }

    fn get_mut(&mut self, id: &str) -> Result<&mut KeyRecord, KeysError> {
        self.keys
            .iter_mut()
            .find(|k| k.id == id)
            .ok_or_else(|| KeysError::NoSuchKey(id.to_owned()))
    }

    /// Oldest first (ties by id): the order files and snapshots are written in.
    pub fn sort(&mut self) {
        self.keys
            .sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
    }

    /// How many records are active, expired and revoked at `now` (for `pet_gateway_keys`).
    pub fn status_counts(&self, now: u64) -> [(&'static str, usize); 3] {
        let revoked = self.keys.iter().filter(|k| k.revoked_at.is_some()).count();
        let expired = self
            .keys
            .iter()
            .filter(|k| k.revoked_at.is_none() && k.expired(now))
            .count();
        [
            ("active", self.keys.len() - revoked - expired),
            ("expired", expired),
            ("revoked", revoked),
        ]
    }

    /// The index of the active keys whose plan is in `plans`, and `id (plan)` of those skipped
    /// for naming another.
    pub fn index_for(&self, plans: &Plans) -> (KeyIndex, Vec<String>) {
        let skipped: Vec<String> = self
            .active()
            .filter(|k| !plans.contains(&k.plan))
            .map(|k| format!("{} ({})", k.id, k.plan))
            .collect();
        let index = if skipped.is_empty() {
            self.index()
        } else {
            KeyIndex::from_entries(
                self.keys.len(),
                self.entries().filter(|(_, k)| plans.contains(&k.plan)),
            )
        };
        (index, skipped)
    }

    pub fn index(&self) -> KeyIndex {
        let active = self.keys.iter().filter(|k| k.revoked_at.is_none()).count();
        KeyIndex::from_entries(active, self.entries())
    }

    /// Every active key with the part of its hash the index is keyed by.
    fn entries(&self) -> impl Iterator<Item = ([u8; 16], KeyInfo)> + '_ {
        // One shared string per plan, not one per key: a million keys name only a few plans.
        let mut plans: HashMap<&str, Arc<str>> = HashMap::new();
        self.keys
            .iter()
            .filter(|k| k.revoked_at.is_none())
            .filter_map(move |k| {
                let mut hash = [0u8; 32];
                hex::decode_to_slice(&k.sha256, &mut hash).ok()?;
                let plan = Arc::clone(
                    plans
                        .entry(&k.plan)
                        .or_insert_with(|| k.plan.as_str().into()),
                );
                Some((
                    index_hash(&hash),
                    KeyInfo {
                        id: k.id.as_str().into(),
                        plan,
                        overrides: k.overrides(),
                        quota: k.quota_of.as_deref().map(Arc::from),
                    },
                ))
            })
    }

    fn save(&self, path: &Path) -> Result<(), KeysError> {
        // Never write a file that would not load again (the gateway, `check` and every later
        // command would refuse it).
        self.validate(path)?;
        let write_err = |source| KeysError::Write {
            path: path.to_owned(),
            source,
        };
        let body = toml::to_string(self).map_err(|e| KeysError::Invalid {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        // A fresh name, created exclusively (never through a symlink someone left there).
        let mut suffix = [0u8; 8];
        rand::rng().fill_bytes(&mut suffix);
        let tmp = path.with_extension(format!("toml.{}.tmp", hex::encode(suffix)));
        let result = (|| {
            let mut f = new_private_file(&tmp)?;
            keep_owner_and_mode(path, &f)?;
            f.write_all(
                b"# Managed by `pet-gateway keys`: SHA-256 hashes of API keys, never the keys.\n\n",
            )?;
            f.write_all(body.as_bytes())?;
            f.sync_all()
        })();
        if let Err(e) = result {
            let _ = std::fs::remove_file(&tmp);
            return Err(write_err(e));
        }
        std::fs::rename(&tmp, path).map_err(write_err)
    }
}

/// The new file gets the owner, group and mode of the one it replaces: a `keys` command run as
/// root or another user must never leave the gateway a file it cannot read (it would keep its
/// old keys, revoked ones included). Where that owner cannot be given (not root), nothing is
/// written and the error says whom to run as.
#[cfg(unix)]
fn keep_owner_and_mode(path: &Path, new: &File) -> std::io::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let old = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let mine = new.metadata()?;
    if (mine.uid(), mine.gid()) != (old.uid(), old.gid()) {
        std::os::unix::fs::fchown(new, Some(old.uid()), Some(old.gid())).map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!(
                    "cannot give the new file the owner uid {} and group gid {} of the one it \
                     replaces ({e}); run this command as that user or as root; nothing was changed",
                    old.uid(),
                    old.gid()
                ),
            )
        })?;
    }
    // Permission bits only: never set-user-id and the like.
    new.set_permissions(std::fs::Permissions::from_mode(old.mode() & 0o777))
}

#[cfg(not(unix))]
fn keep_owner_and_mode(_path: &Path, _new: &File) -> std::io::Result<()> {
    Ok(())
}

/// Creates `path`, which must not exist yet (`O_EXCL`: a symlink there fails too), mode 0600.
#[cfg(unix)]
fn new_private_file(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
}

#[cfg(not(unix))]
fn new_private_file(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().write(true).create_new(true).open(path)
}

/// Opens (creating) the lock file without truncating it and never through a symlink.
#[cfg(unix)]
fn lock_file(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

#[cfg(not(unix))]
fn lock_file(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
}

/// Runs `change` on the keys file under an exclusive lock and saves the result.
/// Where the keys live: the keys file, or the fleet-wide registry in Redis
/// (`keys_source = "store"`). Every change goes through [`KeyStore::modify`].
#[derive(Clone)]
pub enum KeyStore {
    File(PathBuf),
    Registry(Arc<crate::registry::Registry>),
}

impl KeyStore {
    /// Every key record.
    pub fn load(&self) -> Result<KeysFile, KeysError> {
        match self {
            KeyStore::File(path) => KeysFile::load(path),
            KeyStore::Registry(registry) => registry.load().map(|(file, _)| file),
        }
    }

    /// Runs `change` on the key records and saves what it changed: the file under its lock;
    /// in the registry, the changed records and one change-feed entry each.
    pub fn modify<T>(
        &self,
        change: impl FnMut(&mut KeysFile) -> Result<T, KeysError>,
    ) -> Result<T, KeysError> {
        match self {
            KeyStore::File(path) => modify(path, change),
            KeyStore::Registry(registry) => registry.modify(change),
        }
    }
}

impl From<&Path> for KeyStore {
    fn from(path: &Path) -> KeyStore {
        KeyStore::File(path.to_owned())
    }
}

impl From<&PathBuf> for KeyStore {
    fn from(path: &PathBuf) -> KeyStore {
        KeyStore::File(path.clone())
    }
}

impl From<&KeyStore> for KeyStore {
    fn from(store: &KeyStore) -> KeyStore {
        store.clone()
    }
}

/// Writes `file` as the keys file at `path` (a registry node's local snapshot), under the
/// same lock and atomic rename as every other write.
pub fn write_snapshot(path: &Path, file: &KeysFile) -> Result<(), KeysError> {
    modify_raw(
        path,
        |current| {
            *current = file.clone();
            Ok(())
        },
        false,
    )
}

fn modify<T>(
    path: &Path,
    change: impl FnOnce(&mut KeysFile) -> Result<T, KeysError>,
) -> Result<T, KeysError> {
    modify_raw(path, change, true)
}

/// `read`: start from the file's records (a snapshot overwrite does not need them, and must
/// not fail on a damaged old snapshot).
fn modify_raw<T>(
    path: &Path,
    change: impl FnOnce(&mut KeysFile) -> Result<T, KeysError>,
    read: bool,
) -> Result<T, KeysError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| KeysError::Write {
            path: dir.to_owned(),
            source,
        })?;
    }
    let lock_path = path.with_extension("toml.lock");
    let lock = lock_file(&lock_path).map_err(|source| KeysError::Write {
        path: lock_path.clone(),
        source,
    })?;
    lock.lock().map_err(|source| KeysError::Write {
        path: lock_path,
        source,
    })?;
    let mut file = if read {
        KeysFile::load(path)?
    } else {
        KeysFile::default()
    };
    let out = change(&mut file)?;
    file.save(path)?;
    Ok(out)
}

/// What `keys issue` may set beyond the plan.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyRecordOptions {
    /// Unix seconds.
    pub expires_at: Option<u64>,
    pub per_minute: Option<u64>,
    pub per_day: Option<u64>,
}

impl KeyRecordOptions {
    /// The per-key settings of `keys issue` (and the admin API), checked: an expiry in the
    /// future, limits that fit.
    pub fn checked(
        expires_in: Option<&str>,
        expires_at: Option<&str>,
        per_minute: Option<u64>,
        per_day: Option<u64>,
    ) -> Result<KeyRecordOptions, String> {
        let now = crate::clock::unix_now();
        let expires_at = match (expires_in, expires_at) {
            (Some(d), _) => Some(now.saturating_add(
                crate::clock::parse_duration(d).map_err(|e| format!("--expires-in: {e}"))?,
            )),
            (None, Some(t)) => Some(crate::clock::parse_rfc3339(t).ok_or_else(|| {
                format!("--expires-at: `{t}` is not an RFC 3339 date-time (`2027-01-31T00:00:00Z`)")
            })?),
            (None, None) => None,
        };
        if let Some(at) = expires_at {
            if at <= now {
                return Err("the expiry is not in the future".into());
            }
            if at > u64::from(u32::MAX) {
                return Err("the expiry is after 2106".into());
            }
        }
        for (flag, value) in [("--per-minute", per_minute), ("--per-day", per_day)] {
            if value.is_some_and(|n| n == 0 || n > u64::from(u32::MAX)) {
                return Err(format!("{flag}: a whole number from 1 to {}", u32::MAX));
            }
        }
        Ok(KeyRecordOptions {
            expires_at,
            per_minute,
            per_day,
        })
    }
}

impl KeyRecord {
    /// Whether the key has expired at `now` (Unix seconds).
    pub fn expired(&self, now: u64) -> bool {
        self.expires_at
            .as_deref()
            .and_then(parse_rfc3339)
            .is_some_and(|t| t <= now)
    }

    /// The key's status at `now`, as `keys list`, `keys show` and the admin API say it;
    /// `banned_until`: when the running gateway says it is banned, until when.
    pub fn status(&self, banned_until: Option<&str>, now: u64) -> String {
        let expires = self.expires_at.as_deref();
        match (&self.revoked_at, self.expired(now), banned_until) {
            (Some(_), _, _) => "revoked".to_owned(),
            (None, true, _) => "expired".to_owned(),
            (None, false, Some(until)) => format!("banned until {until}"),
            (None, false, None) => match (expires, &self.rotated_to) {
                (Some(at), Some(_)) => format!("rotated until {at}"),
                (Some(at), None) => format!("active until {at}"),
                (None, _) => "active".to_owned(),
            },
        }
    }

    /// The record as JSON, with its status: every field but the hash (and never the key).
    pub fn to_json(&self, status: &str, bans_known: bool) -> serde_json::Value {
        serde_json::json!({
            "id": self.id,
            "name": self.name,
            "plan": self.plan,
            "status": status,
            "ban_status_known": bans_known,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "revoked_at": self.revoked_at,
            "per_minute": self.per_minute,
            "per_day": self.per_day,
            "quota_of": self.quota_of,
            "rotated_to": self.rotated_to,
        })
    }
}

/// Creates a key for `plan`; returns its record and the key itself (to be shown once).
pub fn issue(
    store: impl Into<KeyStore>,
    plans: &Plans,
    plan: &str,
    name: Option<&str>,
    key_prefix: &str,
    own: &KeyRecordOptions,
) -> Result<(KeyRecord, String), KeysError> {
    if !plans.contains(plan) {
        return Err(KeysError::UnknownPlan {
            plan: plan.to_owned(),
            known: plans.names().join(", "),
        });
    }
    store.into().modify(|file| {
        let mut rng = rand::rng();
        let key = crate::key_format::generate(key_prefix);
        let id = new_id(file, &mut rng);
        let record = KeyRecord {
            id,
            name: name.map(str::to_owned),
            plan: plan.to_owned(),
            sha256: hex::encode(sha256(&key)),
            created_at: rfc3339_now(),
            revoked_at: None,
            expires_at: own.expires_at.map(crate::clock::rfc3339),
            per_minute: own.per_minute,
            per_day: own.per_day,
            quota_of: None,
            rotated_to: None,
        };
        file.keys.push(record.clone());
        Ok((record, key))
    })
}

fn new_id(file: &KeysFile, rng: &mut impl RngCore) -> String {
    loop {
        let mut raw = [0u8; 6];
        rng.fill_bytes(&mut raw);
        let id = format!("key_{}", hex::encode(raw));
        if file.keys.iter().all(|k| k.id != id) {
            return id;
        }
    }
}

/// Replaces the key `id` with a successor: same plan, name, limits and expiry, and the same
/// quota (counts and bans; rotating never doubles a quota). The old key keeps working for
/// `overlap_secs` more (or until its own expiry, if sooner), then gets 401. Returns the old
/// record, the new one and the new key (to be shown once).
pub fn rotate(
    store: impl Into<KeyStore>,
    id: &str,
    overlap_secs: u64,
    key_prefix: &str,
) -> Result<(KeyRecord, KeyRecord, String), KeysError> {
    store.into().modify(|file| {
        let now = crate::clock::unix_now();
        let old = file.get(id)?;
        if old.revoked_at.is_some() || old.expired(now) {
            return Err(KeysError::NotActive(id.to_owned()));
        }
        if let Some(successor) = &old.rotated_to {
            return Err(KeysError::AlreadyRotated(id.to_owned(), successor.clone()));
        }
        let mut rng = rand::rng();
        let key = crate::key_format::generate(key_prefix);
        let successor = KeyRecord {
            id: new_id(file, &mut rng),
            sha256: hex::encode(sha256(&key)),
            created_at: rfc3339_now(),
            revoked_at: None,
            quota_of: Some(old.quota_of.clone().unwrap_or_else(|| old.id.clone())),
            rotated_to: None,
            ..old.clone()
        };
        let old = file.get_mut(id)?;
        let end = now.saturating_add(overlap_secs);
        if end > u64::from(u32::MAX) {
            return Err(KeysError::Invalid {
                path: PathBuf::from(id),
                message: "the overlap would end after 2106".into(),
            });
        }
        let current_end = old.expires_at.as_deref().and_then(parse_rfc3339);
        old.expires_at = Some(crate::clock::rfc3339(
            current_end.map_or(end, |c| c.min(end)),
        ));
        old.rotated_to = Some(successor.id.clone());
        let old = old.clone();
        file.keys.push(successor.clone());
        Ok((old, successor, key))
    })
}

/// Marks a key revoked (the record stays, for the audit trail); the gateway refuses it from its
/// next reload on.
pub fn revoke(store: impl Into<KeyStore>, id: &str) -> Result<KeyRecord, KeysError> {
    store.into().modify(|file| {
        let record = file.get_mut(id)?;
        if record.revoked_at.is_none() {
            record.revoked_at = Some(rfc3339_now());
        }
        Ok(record.clone())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plans(dir: &Path) -> Plans {
        std::fs::write(
            dir.join("free.toml"),
            "requests_per_minute = 60\nrequests_per_day = 1000\n",
        )
        .unwrap();
        Plans::load_dir(dir).unwrap()
    }

    #[test]
    fn issued_keys_are_found_by_hash_and_never_stored() {
        let dir = tempfile::tempdir().unwrap();
        let plans = plans(dir.path());
        let path = dir.path().join("keys.toml");
        let (record, key) = issue(
            &path,
            &plans,
            "free",
            Some("demo"),
            "pet_test_",
            &KeyRecordOptions::default(),
        )
        .unwrap();
        assert!(key.starts_with("pet_test_") && crate::key_format::plausible(&key, ""));
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            !text.contains(&key["pet_test_".len()..]),
            "the key itself is not stored"
        );
        assert!(text.contains(&record.sha256));
        let file = KeysFile::load(&path).unwrap();
        let found = file.index().lookup(&key).cloned().unwrap();
        assert_eq!((&*found.id, &*found.plan), (record.id.as_str(), "free"));
        assert!(file.index().lookup("pet_not-a-key").is_none());
    }

    #[test]
    fn revoked_keys_leave_the_index_but_stay_on_record() {
        let dir = tempfile::tempdir().unwrap();
        let plans = plans(dir.path());
        let path = dir.path().join("keys.toml");
        let (a, key_a) = issue(
            &path,
            &plans,
            "free",
            None,
            "pet_test_",
            &KeyRecordOptions::default(),
        )
        .unwrap();
        let (_, key_b) = issue(
            &path,
            &plans,
            "free",
            None,
            "pet_test_",
            &KeyRecordOptions::default(),
        )
        .unwrap();
        revoke(&path, &a.id).unwrap();
        let file = KeysFile::load(&path).unwrap();
        assert_eq!(file.keys.len(), 2);
        assert!(file.keys[0].revoked_at.is_some());
        assert!(file.index().lookup(&key_a).is_none());
        assert!(file.index().lookup(&key_b).is_some());
        assert!(matches!(
            revoke(&path, "key_nope"),
            Err(KeysError::NoSuchKey(_))
        ));
    }

    #[test]
    fn key_ids_that_would_break_a_header_a_hash_tag_or_a_url_are_refused_on_load() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.toml");
        let hash = "ab".repeat(32);
        for bad in ["has space", "br}ace", "sl/ash", "", &"x".repeat(65)] {
            std::fs::write(
                &path,
                format!(
                    "[[key]]\nid = \"{bad}\"\nplan = \"free\"\nsha256 = \"{hash}\"\n\
                     created_at = \"2026-01-01T00:00:00Z\"\n"
                ),
            )
            .unwrap();
            let err = KeysFile::load(&path).unwrap_err().to_string();
            assert!(
                err.contains("keys.toml") && err.contains("field `id`"),
                "{bad:?}: {err}"
            );
        }
        assert!(valid_key_id("key_0123abcd") && valid_key_id("Acme-2"));
    }

    #[cfg(unix)]
    #[test]
    fn a_rewritten_keys_file_keeps_the_owner_group_and_mode_of_the_old_one() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = tempfile::tempdir().unwrap();
        let plans = plans(dir.path());
        let path = dir.path().join("keys.toml");
        issue(
            &path,
            &plans,
            "free",
            None,
            "pet_test_",
            &KeyRecordOptions::default(),
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        // As root (CI), hand the file to another user as a service account would own it.
        let root = std::fs::metadata(&path).unwrap().uid() == 0;
        if root {
            std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
        }
        let before = std::fs::metadata(&path).unwrap();
        issue(
            &path,
            &plans,
            "free",
            None,
            "pet_test_",
            &KeyRecordOptions::default(),
        )
        .unwrap();
        let after = std::fs::metadata(&path).unwrap();
        assert_ne!(before.ino(), after.ino(), "replaced by rename");
        assert_eq!(after.mode() & 0o7777, 0o640);
        assert_eq!((after.uid(), after.gid()), (before.uid(), before.gid()));
        assert_eq!(KeysFile::load(&path).unwrap().keys.len(), 2);
    }

    #[test]
    fn rotation_refuses_a_second_successor_and_an_overlap_past_2106() {
        let dir = tempfile::tempdir().unwrap();
        let plans = plans(dir.path());
        let path = dir.path().join("keys.toml");
        let (a, _) = issue(
            &path,
            &plans,
            "free",
            None,
            "pet_test_",
            &KeyRecordOptions::default(),
        )
        .unwrap();
        assert!(matches!(
            rotate(&path, &a.id, u64::MAX / 2, "pet_test_"),
            Err(KeysError::Invalid { .. })
        ));
        KeysFile::load(&path).expect("nothing unloadable was written");
        let (_, b, _) = rotate(&path, &a.id, 60, "pet_test_").unwrap();
        assert_eq!(b.quota_of.as_deref(), Some(a.id.as_str()));
        assert!(matches!(
            rotate(&path, &a.id, 60, "pet_test_"),
            Err(KeysError::AlreadyRotated(..))
        ));
        let (_, c, _) = rotate(&path, &b.id, 60, "pet_test_").unwrap();
        assert_eq!(
            c.quota_of.as_deref(),
            Some(a.id.as_str()),
            "one quota down the chain"
        );
    }

    #[test]
    fn unknown_plans_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let plans = plans(dir.path());
        let err = issue(
            &dir.path().join("keys.toml"),
            &plans,
            "gold",
            None,
            "pet_test_",
            &KeyRecordOptions::default(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("gold"), "{err}");
        assert!(!dir.path().join("keys.toml").exists());
    }
}
