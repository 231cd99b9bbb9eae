//! The key service: issue, rotate and revoke, on whichever store holds the keys (the keys file,
//! or the fleet-wide registry). The `keys` commands and the admin API both call it, so a change
//! means the same whichever door it came through.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rand::RngCore;

use crate::base::clock::{parse_rfc3339, rfc3339_now};
use crate::keys::file::modify;
use crate::keys::index::sha256;
use crate::keys::limits::Every;
use crate::keys::plans::{Plan, Plans};
use crate::keys::record::{own_windows, KeyRecord, KeyRecordOptions, KeysError, KeysFile};

/// Where the keys live: the keys file, or the fleet-wide registry in Redis
/// (`keys_source = "store"`). Every change goes through [`KeyStore::modify`].
#[derive(Clone)]
pub enum KeyStore {
    File(PathBuf),
    Registry(Arc<crate::keys::registry::Registry>),
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

/// Creates a key for `plan`; returns its record and the key itself (to be shown once).
pub fn issue(
    store: impl Into<KeyStore>,
    plans: &Plans,
    plan: &str,
    name: Option<&str>,
    key_prefix: &str,
    own: &KeyRecordOptions,
) -> Result<(KeyRecord, String), KeysError> {
    let Some(in_force) = plans.get(plan) else {
        return Err(KeysError::UnknownPlan {
            plan: plan.to_owned(),
            known: plans.names().join(", "),
        });
    };
    check_fits(in_force, own).map_err(KeysError::OwnLimits)?;
    store.into().modify(|file| {
        let mut rng = rand::rng();
        let key = crate::keys::format::generate(key_prefix);
        let id = new_id(file, &mut rng);
        let record = KeyRecord {
            id,
            name: name.map(str::to_owned),
            plan: plan.to_owned(),
            sha256: hex::encode(sha256(&key)),
            created_at: rfc3339_now(),
            revoked_at: None,
            expires_at: own.expires_at.map(crate::base::clock::rfc3339),
            per_minute: own.per_minute,
            per_day: own.per_day,
            limits: own.limits.clone(),
            concurrency: own.concurrency,
            customer: own.customer.clone(),
            quota_of: None,
            rotated_to: None,
            version: 0,
            signature: None,
        };
        file.keys.push(record.clone());
        Ok((record, key))
    })
}

/// A key's own limits under its plan follow the plan's rules: at most six windows in all, and no
/// operation costing more than the smallest enforced limit (it could never pass).
fn check_fits(plan: &Plan, own: &KeyRecordOptions) -> Result<(), String> {
    let mut lengths: Vec<Every> = plan.limits.windows().iter().map(|w| w.every).collect();
    let mut overrides = Vec::new();
    for (every, n) in own_windows(own.per_minute, own.per_day, &own.limits) {
        if !lengths.contains(&every) {
            lengths.push(every);
        }
        overrides.push((every, u32::try_from(n).unwrap_or(u32::MAX)));
    }
    if lengths.len() > crate::keys::limits::MAX_WINDOWS {
        return Err(format!(
            "the key's own limits and plan `{}` make {} windows; at most {} are allowed",
            plan.name,
            lengths.len(),
            crate::keys::limits::MAX_WINDOWS
        ));
    }
    let limits = plan.limits.with_overrides(&overrides);
    let smallest = limits.smallest_enforced().unwrap_or(u64::MAX);
    if let Some((operation, cost)) = plan.costs.listed().find(|&(_, c)| c > smallest) {
        return Err(format!(
            "{operation} costs {cost} under plan `{}`, more than this key's smallest limit \
             ({smallest}): it could never pass",
            plan.name
        ));
    }
    Ok(())
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
        let now = crate::base::clock::unix_now();
        let old = file.get(id)?;
        if old.revoked_at.is_some() || old.expired(now) {
            return Err(KeysError::NotActive(id.to_owned()));
        }
        if let Some(successor) = &old.rotated_to {
            return Err(KeysError::AlreadyRotated(id.to_owned(), successor.clone()));
        }
        let mut rng = rand::rng();
        let key = crate::keys::format::generate(key_prefix);
        let successor = KeyRecord {
            id: new_id(file, &mut rng),
            sha256: hex::encode(sha256(&key)),
            created_at: rfc3339_now(),
            revoked_at: None,
            quota_of: Some(old.quota_of.clone().unwrap_or_else(|| old.id.clone())),
            rotated_to: None,
            version: 0,
            signature: None,
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
        old.expires_at = Some(crate::base::clock::rfc3339(
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

/// Where a key change is reported besides the audit log (the events' metering file, issue 24):
/// a trait here, so that `keys` need not know the `events` wing above it. `change` is `issued`,
/// `revoked` or `rotated` (then `successor` is the new key).
pub trait ChangeSink: Send + Sync {
    fn changed(
        &self,
        change: &'static str,
        record: &KeyRecord,
        successor: Option<&KeyRecord>,
    ) -> Result<(), String>;
}

/// The key service: both doors to a key change (the `keys` commands and the admin API) go
/// through it, so a change, its audit line and its event are the same whichever door it came
/// through.
#[derive(Clone)]
pub struct KeyService {
    pub store: KeyStore,
    /// What new keys start with.
    pub api_key_prefix: String,
    /// Where changes are logged; `None`: standard error.
    pub audit_log: Option<PathBuf>,
    /// Who changes keys, for the audit log: the OS user at the command line, `admin` through
    /// the admin API.
    pub who: String,
    /// Where changes are reported as events; none without `metering_file`.
    pub changes: Option<std::sync::Arc<dyn ChangeSink>>,
}

/// A change made, and whether its audit line was written. The change stands either way: the
/// caller shows what was made (a new key is shown only once) before it reports a failed audit.
pub struct Changed<T> {
    pub value: T,
    pub audit: Result<(), AuditFailed>,
}

/// A change that is done but could not be written to the audit log, or reported as an event.
#[derive(Debug, thiserror::Error)]
#[error("{action} of {key_id} is done, but {reason}")]
pub struct AuditFailed {
    pub action: String,
    pub key_id: String,
    pub reason: String,
}

impl From<AuditFailed> for String {
    fn from(e: AuditFailed) -> String {
        e.to_string()
    }
}

impl KeyService {
    pub fn issue(
        &self,
        plans: &Plans,
        plan: &str,
        name: Option<&str>,
        own: &KeyRecordOptions,
    ) -> Result<Changed<(KeyRecord, String)>, KeysError> {
        let (record, key) = issue(&self.store, plans, plan, name, &self.api_key_prefix, own)?;
        // Both, whatever the other did: a full audit disk must not also lose the event.
        let audited = self.audit("issue", &record);
        let reported = self.report("issue", "issued", &record, None);
        let audit = audited.and(reported);
        Ok(Changed {
            value: (record, key),
            audit,
        })
    }

    /// Returns the old record, the successor and the successor's key.
    pub fn rotate(
        &self,
        id: &str,
        overlap_secs: u64,
    ) -> Result<Changed<(KeyRecord, KeyRecord, String)>, KeysError> {
        let (old, new, key) = rotate(&self.store, id, overlap_secs, &self.api_key_prefix)?;
        // Both, whatever the other did: a full audit disk must not also lose the event.
        let audited = self.audit("rotate", &old);
        let reported = self.report("rotate", "rotated", &old, Some(&new));
        let audit = audited.and(reported);
        Ok(Changed {
            value: (old, new, key),
            audit,
        })
    }

    pub fn revoke(&self, id: &str) -> Result<Changed<KeyRecord>, KeysError> {
        let record = revoke(&self.store, id)?;
        // Both, whatever the other did: a full audit disk must not also lose the event.
        let audited = self.audit("revoke", &record);
        let reported = self.report("revoke", "revoked", &record, None);
        let audit = audited.and(reported);
        Ok(Changed {
            value: record,
            audit,
        })
    }

    /// Every key record.
    pub fn list(&self) -> Result<KeysFile, KeysError> {
        self.store.load()
    }

    /// Reports a change made to the change sink, when there is one.
    fn report(
        &self,
        action: &str,
        change: &'static str,
        record: &KeyRecord,
        successor: Option<&KeyRecord>,
    ) -> Result<(), AuditFailed> {
        let Some(sink) = &self.changes else {
            return Ok(());
        };
        sink.changed(change, record, successor)
            .map_err(|e| AuditFailed {
                action: action.to_owned(),
                key_id: record.id.clone(),
                reason: format!("its event could not be written: {e}"),
            })
    }

    /// Logs a change of `record` already made (also one made elsewhere, such as a usage reset
    /// in the quota store); a failure says that the change is done.
    pub fn audit(&self, action: &str, record: &KeyRecord) -> Result<(), AuditFailed> {
        let line = crate::keys::audit::line(action, record, &self.who);
        let failed = |reason: String| AuditFailed {
            action: action.to_owned(),
            key_id: record.id.clone(),
            reason,
        };
        // In a fleet the line goes beside the registry too, so every node shows the history.
        let fleet = match &self.store {
            KeyStore::Registry(registry) => registry.record_audit(&record.id, &line).map_err(|e| {
                failed(format!(
                    "it could not be added to the registry's history: {e}"
                ))
            }),
            KeyStore::File(_) => Ok(()),
        };
        let local = crate::keys::audit::write(self.audit_log.as_deref(), &line)
            .map_err(|e| failed(format!("it could not be written to the audit log: {e}")));
        match (local, fleet) {
            (Err(a), Err(b)) => Err(failed(format!("{}; and {}", a.reason, b.reason))),
            (local, fleet) => local.and(fleet),
        }
    }

    /// A key's history, newest first: the fleet's (the registry's) or this node's audit log.
    pub fn history(&self, key_id: &str, max: usize) -> Result<Vec<String>, KeysError> {
        match &self.store {
            KeyStore::Registry(registry) => registry.audit_of(key_id, max),
            KeyStore::File(_) => Ok(match &self.audit_log {
                Some(path) => crate::keys::audit::lines_of(path, key_id, max),
                None => Vec::new(),
            }),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::keys::record::valid_key_id;

    /// A key of `plan` with no settings of its own, issued into the keys file at `path`.
    pub(crate) fn test_key(path: &Path, plans: &Plans, plan: &str) -> (KeyRecord, String) {
        issue(
            path,
            plans,
            plan,
            None,
            "pet_test_",
            &KeyRecordOptions::default(),
        )
        .unwrap()
    }

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
        assert!(key.starts_with("pet_test_") && crate::keys::format::plausible(&key, ""));
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
        let (a, key_a) = test_key(&path, &plans, "free");
        let (_, key_b) = test_key(&path, &plans, "free");
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
        test_key(&path, &plans, "free");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        // As root (CI), hand the file to another user as a service account would own it.
        let root = std::fs::metadata(&path).unwrap().uid() == 0;
        if root {
            std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
        }
        let before = std::fs::metadata(&path).unwrap();
        test_key(&path, &plans, "free");
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
        let (a, _) = test_key(&path, &plans, "free");
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
