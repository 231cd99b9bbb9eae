//! The keys and plans in force, swapped atomically when their files change. Requests read the
//! current snapshot without locking.
//!
//! Keys and plans reload independently: a plan edit that is refused (a typo in `pro.toml`)
//! never holds back a key change (a revocation), and the other way round. A refused part leaves
//! its previous version in force, says why (file and field) in the log, and shows in
//! `pet_gateway_catalog_reload_failing{part}` until a good version loads.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use arc_swap::ArcSwap;

use crate::base::metrics::METRICS;
use crate::keys::index::{KeyIndex, KeyInfo};
use crate::keys::limits::Limits;
use crate::keys::plans::{PlanError, Plans};
use crate::keys::record::{KeysError, KeysFile};

#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error(transparent)]
    Plans(#[from] PlanError),
    #[error(transparent)]
    Keys(#[from] KeysError),
}

/// The two halves are shared, so reloading one never copies the other (a million keys).
#[derive(Clone)]
pub struct Snapshot {
    pub plans: Arc<Plans>,
    pub keys: Arc<KeyIndex>,
}

impl Snapshot {
    /// The limits `key` is held to: its plan's, with its own; none when its plan is missing.
    pub fn limits_of(&self, key: &KeyInfo) -> Option<Limits> {
        self.plans.get(&key.plan).map(|p| key.limits(&p.limits))
    }

    /// `key` while the gateway accepts it (not expired at `now`), with the limits it is held to:
    /// what the admin side shows usage against.
    pub fn accepted(&self, key: &KeyInfo, now: u64) -> Option<(KeyInfo, Option<Limits>)> {
        (!key.expired(now)).then(|| (key.clone(), self.limits_of(key)))
    }

    pub fn load(keys_file: &Path, plans_dir: &Path) -> Result<Snapshot, CatalogError> {
        let plans = Plans::load_dir(plans_dir)?;
        let keys = load_keys(keys_file, &plans)?;
        Ok(Snapshot {
            plans: Arc::new(plans),
            keys: Arc::new(keys),
        })
    }

    /// As [`Snapshot::load`], but a key naming a plan this node lacks is skipped (logged),
    /// not fatal: a registry node's snapshot holds keys issued on other hosts.
    fn load_lenient(keys_file: &Path, plans_dir: &Path) -> Result<Snapshot, CatalogError> {
        let plans = Plans::load_dir(plans_dir)?;
        let file = KeysFile::load(keys_file)?;
        let (keys, skipped) = file.index_for(&plans);
        count_keys(&file, skipped.len());
        if !skipped.is_empty() {
            tracing::error!(count = skipped.len(), first = ?&skipped[..skipped.len().min(20)],
                "keys naming a plan this node lacks were skipped (they get 401)");
        }
        Ok(Snapshot {
            plans: Arc::new(plans),
            keys: Arc::new(keys),
        })
    }
}

fn load_keys(keys_file: &Path, plans: &Plans) -> Result<KeyIndex, KeysError> {
    let keys = KeysFile::load(keys_file)?;
    keys.check_plans(keys_file, plans)?;
    count_keys(&keys, 0);
    Ok(keys.index())
}

/// `pet_gateway_keys{status}` for the keys now in force.
fn count_keys(keys: &KeysFile, skipped: usize) {
    for (status, n) in keys.status_counts(crate::base::clock::unix_now()) {
        let n = if status == "active" {
            n - skipped.min(n)
        } else {
            n
        };
        METRICS.keys.with_label_values(&[status]).set(n as i64);
    }
    METRICS
        .keys
        .with_label_values(&["skipped"])
        .set(skipped as i64);
}

/// What a file looked like at the last attempt: enough that any write, rename or change of
/// owner or mode shows, even one that keeps the size and the modification time.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileStamp {
    path: PathBuf,
    len: u64,
    modified: Option<SystemTime>,
    #[cfg(unix)]
    identity: (u64, u64, i64, i64, u32, u32, u32),
}

type Fingerprint = Vec<FileStamp>;

/// The two parts, for logs and the `part` metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Keys = 0,
    Plans = 1,
}

impl Part {
    pub fn as_str(self) -> &'static str {
        match self {
            Part::Keys => "keys",
            Part::Plans => "plans",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reload {
    Unchanged,
    Applied,
    /// The previous version stays in force, for this reason.
    Refused(String),
}

/// What one reload did to each part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReloadReport {
    pub keys: Reload,
    pub plans: Reload,
}

impl ReloadReport {
    pub fn parts(&self) -> [(Part, &Reload); 2] {
        [(Part::Keys, &self.keys), (Part::Plans, &self.plans)]
    }

    /// `{"keys": "applied", "plans": {"refused": "why"}}`, for the admin listener.
    pub fn to_json(&self) -> serde_json::Value {
        let one = |r: &Reload| match r {
            Reload::Unchanged => serde_json::json!("unchanged"),
            Reload::Applied => serde_json::json!("applied"),
            Reload::Refused(why) => serde_json::json!({ "refused": why }),
        };
        serde_json::json!({ "keys": one(&self.keys), "plans": one(&self.plans) })
    }
}

#[derive(Default)]
struct Seen {
    keys: Fingerprint,
    plans: Fingerprint,
    /// Why each part's newest version is refused, by [`Part`].
    refused: [Option<String>; 2],
    /// Active keys left out of the index for naming a plan not in force.
    skipped: usize,
    /// Keys a registry node applied but could not write to its snapshot (a full disk): served
    /// in place of the keys file until the snapshot is written ([`Catalog::saved`]).
    unsaved: Option<Arc<KeysFile>>,
    /// The keys must be indexed again at the next reload, whatever the file's fingerprint.
    keys_pending: bool,
}

pub struct Catalog {
    current: ArcSwap<Snapshot>,
    keys_file: PathBuf,
    plans_dir: PathBuf,
    /// Held for the whole of a reload: the reloader and an admin `POST /reload` never race.
    seen: Mutex<Seen>,
}

impl Catalog {
    pub fn load(keys_file: &Path, plans_dir: &Path) -> Result<Catalog, CatalogError> {
        Self::load_with(keys_file, plans_dir, true)
    }

    /// `strict`: a key naming a missing plan fails the load (a keys file edited by hand on
    /// this host); otherwise it is skipped (a registry node's snapshot).
    pub fn load_with(
        keys_file: &Path,
        plans_dir: &Path,
        strict: bool,
    ) -> Result<Catalog, CatalogError> {
        let seen = Seen {
            keys: fingerprint(std::slice::from_ref(&keys_file.to_owned())),
            plans: plans_fingerprint(plans_dir),
            refused: [None, None],
            skipped: 0,
            unsaved: None,
            keys_pending: false,
        };
        let snapshot = if strict {
            Snapshot::load(keys_file, plans_dir)?
        } else {
            Snapshot::load_lenient(keys_file, plans_dir)?
        };
        if let Some(warning) = snapshot.plans.ignored_warning(plans_dir) {
            tracing::warn!("{warning}");
        }
        for part in [Part::Keys, Part::Plans] {
            mark_loaded(part);
        }
        Ok(Catalog {
            current: ArcSwap::from_pointee(snapshot),
            keys_file: keys_file.to_owned(),
            plans_dir: plans_dir.to_owned(),
            seen: Mutex::new(seen),
        })
    }

    pub fn snapshot(&self) -> arc_swap::Guard<Arc<Snapshot>> {
        self.current.load()
    }

    /// Keys expire with no change to any file: `pet_gateway_keys{status="active"|"expired"}` are
    /// counted again from the index in force (the reloader does it every minute).
    pub fn recount_expiry(&self, now: u64) {
        let snapshot = self.snapshot();
        let expired = snapshot.keys.keys().filter(|k| k.expired(now)).count();
        let active = snapshot.keys.len() - expired;
        METRICS
            .keys
            .with_label_values(&["active"])
            .set(active as i64);
        METRICS
            .keys
            .with_label_values(&["expired"])
            .set(expired as i64);
    }

    /// Reloads what changed since the last attempt (everything, when `force`, as on SIGHUP).
    ///
    /// Plans go first and are refused when broken or when they would take away the plan of an
    /// active key. Keys are read whenever their file changed or the plans were tried (a plan
    /// edit changes which keys can load), and are never refused for one key's sake: a key
    /// whose plan is not in force is skipped and named in the log, the rest (revocations
    /// included) apply. Only a keys file that cannot be read or parsed at all keeps the old
    /// keys. A refused part is tried again whenever the other part changes, so no pair of edits
    /// can leave the catalog stuck. Blocking file I/O: call it off the request path.
    pub fn reload(&self, force: bool) -> ReloadReport {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let keys_now = fingerprint(std::slice::from_ref(&self.keys_file));
        let plans_now = plans_fingerprint(&self.plans_dir);
        let keys_changed = seen.keys != keys_now;
        let plans_changed = seen.plans != plans_now;
        // Remember even a refused version, so a broken file is reported once, not every tick.
        seen.keys = keys_now;
        seen.plans = plans_now;
        let try_plans = force
            || plans_changed
            || (keys_changed && seen.refused[Part::Plans as usize].is_some());
        let try_keys_file = force || keys_changed || std::mem::take(&mut seen.keys_pending);

        let current = Snapshot::clone(&self.current.load());
        let mut next = current.clone();
        // The keys file as it is now, for the plans' orphan check and the keys' reload.
        // Shared, not copied: unsaved keys may be a million records.
        let mut keys_file = (try_keys_file || try_plans).then(|| match &seen.unsaved {
            Some(unsaved) => Ok(Arc::clone(unsaved)),
            None => KeysFile::load(&self.keys_file).map(Arc::new),
        });
        let plans = if try_plans {
            match self.load_plans(keys_file.as_ref(), &current) {
                Ok(plans) => {
                    next.plans = Arc::new(plans);
                    Reload::Applied
                }
                Err(reason) => Reload::Refused(reason),
            }
        } else {
            Reload::Unchanged
        };
        // Keys are indexed again when their file changed, or when new plans change which keys
        // can load; a plan edit that was refused leaves them alone.
        if !try_keys_file && plans != Reload::Applied {
            keys_file = None;
        }
        let keys = match keys_file {
            None => Reload::Unchanged,
            Some(Err(e)) => Reload::Refused(e.to_string()),
            Some(Ok(file)) => {
                seen.skipped = self.index_keys(&file, &mut next);
                Reload::Applied
            }
        };
        let report = ReloadReport { keys, plans };
        if report.parts().iter().any(|(_, r)| **r == Reload::Applied) {
            self.current.store(Arc::new(next.clone()));
        }
        for (part, result) in report.parts() {
            seen.refused[part as usize] = match result {
                Reload::Unchanged => continue,
                Reload::Applied => {
                    applied(part, &next);
                    None
                }
                Reload::Refused(reason) => {
                    refused(part, reason);
                    Some(reason.clone())
                }
            };
        }
        report
    }

    /// Serves `file`'s keys now although the keys file could not be written with them (a
    /// registry node's full disk): a revocation the node has taken must apply whether or not
    /// its snapshot can be saved. Later reloads keep using `file` until [`Catalog::saved`].
    pub fn serve_unsaved(&self, file: Arc<KeysFile>) -> ReloadReport {
        {
            let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
            seen.unsaved = Some(file);
            seen.keys_pending = true;
        }
        self.reload(false)
    }

    /// The keys file now holds what is to be served: read it again, and serve no unsaved keys.
    pub fn saved(&self) -> ReloadReport {
        {
            let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
            seen.unsaved = None;
            seen.keys_pending = true;
        }
        self.reload(false)
    }

    /// Indexes `file`'s keys under `next`'s plans into `next`; returns how many were skipped
    /// for naming a plan not in force (and logs them).
    fn index_keys(&self, file: &KeysFile, next: &mut Snapshot) -> usize {
        let (index, skipped) = file.index_for(&next.plans);
        METRICS.catalog_keys_skipped.set(skipped.len() as i64);
        count_keys(file, skipped.len());
        if !skipped.is_empty() {
            tracing::error!(
                keys_file = %self.keys_file.display(),
                plans = ?next.plans.names(),
                count = skipped.len(),
                first = ?&skipped[..skipped.len().min(20)],
                "keys naming a plan that is not in force were skipped (they get 401, \
                 and `check` and a restart refuse the file until it is fixed); the \
                 other keys, revocations included, apply"
            );
        }
        next.keys = Arc::new(index);
        skipped.len()
    }

    /// What this catalog serves, for the admin listener: the keys file (canonical path), and
    /// why each part's newest version is refused, if it is (whether or not the refusal happened
    /// in this very reload).
    pub fn state(&self) -> serde_json::Value {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let keys_file = std::fs::canonicalize(&self.keys_file).unwrap_or(self.keys_file.clone());
        serde_json::json!({
            "keys_file": keys_file.to_string_lossy(),
            "keys_skipped": seen.skipped,
            "keys_refused": seen.refused[Part::Keys as usize],
            "plans_refused": seen.refused[Part::Plans as usize],
            "keys_unsaved": seen.unsaved.is_some(),
        })
    }

    /// The plans directory, refused when it is broken or when it would leave an active key
    /// without its plan (that key would stop working on a plan edit nobody meant for it). The
    /// keys checked are the keys file as it is now, or the keys in force when it cannot be read.
    fn load_plans(
        &self,
        keys_file: Option<&Result<Arc<KeysFile>, KeysError>>,
        current: &Snapshot,
    ) -> Result<Plans, String> {
        let plans = Plans::load_dir(&self.plans_dir).map_err(|e| e.to_string())?;
        if let Some(warning) = plans.ignored_warning(&self.plans_dir) {
            tracing::warn!("{warning}");
        }
        // Only a plan in force now can be taken away; a key naming a plan that never was is
        // skipped already and must not block unrelated plan edits.
        let taken = |plan: &str| current.plans.contains(plan) && !plans.contains(plan);
        let orphan = match keys_file {
            Some(Ok(file)) => file
                .active()
                .find(|k| taken(&k.plan))
                .map(|k| (k.id.clone(), k.plan.clone())),
            _ => current
                .keys
                .keys()
                .find(|k| taken(&k.plan))
                .map(|k| (k.id.to_string(), k.plan.to_string())),
        };
        if let Some((id, plan)) = orphan {
            return Err(format!(
                "{}: no plan `{plan}` any more, but key `{id}` (and maybe others) uses it; \
                 revoke those keys or keep the plan",
                self.plans_dir.display(),
            ));
        }
        Ok(plans)
    }
}

/// Metrics and the log line of a part newly in force.
fn applied(part: Part, next: &Snapshot) {
    mark_loaded(part);
    METRICS.config_reloads.with_label_values(&["applied"]).inc();
    if part == Part::Plans {
        METRICS.init_plans(next.plans.names());
    }
    tracing::info!(
        part = part.as_str(),
        keys = next.keys.len(),
        plans = ?next.plans.names(),
        "reloaded"
    );
}

/// Metrics and the log line of a part whose newest version is refused.
fn refused(part: Part, reason: &str) {
    METRICS.config_reloads.with_label_values(&["refused"]).inc();
    METRICS
        .catalog_reload_failing
        .with_label_values(&[part.as_str()])
        .set(1);
    tracing::error!(part = part.as_str(), error = %reason,
        "reload refused; the previous version stays in force");
}

fn mark_loaded(part: Part) {
    METRICS
        .catalog_reload_failing
        .with_label_values(&[part.as_str()])
        .set(0);
    METRICS
        .catalog_last_reload
        .with_label_values(&[part.as_str()])
        .set(crate::base::clock::unix_now() as i64);
}

fn fingerprint(paths: &[PathBuf]) -> Fingerprint {
    paths
        .iter()
        .map(|p| {
            let meta = std::fs::metadata(p).ok();
            FileStamp {
                path: p.clone(),
                len: meta.as_ref().map(|m| m.len()).unwrap_or(u64::MAX),
                modified: meta.as_ref().and_then(|m| m.modified().ok()),
                // The inode catches a rename over the file; the change time (which no tool can
                // set back) catches an edit that kept size and mtime, and a chown or chmod that
                // made an unreadable file readable.
                #[cfg(unix)]
                identity: meta
                    .map(|m| {
                        use std::os::unix::fs::MetadataExt;
                        (
                            m.dev(),
                            m.ino(),
                            m.ctime(),
                            m.ctime_nsec(),
                            m.mode(),
                            m.uid(),
                            m.gid(),
                        )
                    })
                    .unwrap_or_default(),
            }
        })
        .collect()
}

fn plans_fingerprint(dir: &Path) -> Fingerprint {
    let mut paths = vec![dir.to_owned()];
    if let Ok(entries) = std::fs::read_dir(dir) {
        let mut files: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        files.sort();
        paths.extend(files);
    }
    fingerprint(&paths)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::service::tests::test_key;

    const FREE: &str = "requests_per_minute = 60\nrequests_per_day = 1000\n";

    fn setup() -> (tempfile::TempDir, PathBuf, PathBuf, Catalog) {
        let dir = tempfile::tempdir().unwrap();
        let plans = dir.path().join("plans");
        std::fs::create_dir(&plans).unwrap();
        std::fs::write(plans.join("free.toml"), FREE).unwrap();
        let keys = dir.path().join("keys.toml");
        let catalog = Catalog::load(&keys, &plans).unwrap();
        (dir, keys, plans, catalog)
    }

    /// A Kubernetes ConfigMap mounted as the plans folder is edited by swapping one symlink:
    /// `free.toml -> ..data/free.toml`, `..data -> ..<timestamp>`, the new files in a new
    /// hidden folder. The reload sees it, and takes neither the link nor the folders for plans.
    #[cfg(unix)]
    #[test]
    fn a_configmap_update_swapping_its_data_link_is_reloaded() {
        use std::os::unix::fs::symlink;
        let dir = tempfile::tempdir().unwrap();
        let plans = dir.path().join("plans");
        std::fs::create_dir_all(plans.join("..2026_11_27_08_00_00.1")).unwrap();
        std::fs::write(plans.join("..2026_11_27_08_00_00.1/free.toml"), FREE).unwrap();
        symlink("..2026_11_27_08_00_00.1", plans.join("..data")).unwrap();
        symlink("..data/free.toml", plans.join("free.toml")).unwrap();
        let catalog = Catalog::load(&dir.path().join("keys.toml"), &plans).unwrap();
        assert_eq!(catalog.snapshot().plans.names(), ["free"]);
        let before = format!("{:?}", catalog.snapshot().plans.get("free"));
        assert!(!before.contains('7'), "{before}");
        assert_eq!(catalog.reload(false).plans, Reload::Unchanged);

        // What the kubelet does: the new version beside, then the link renamed over.
        let next = plans.join("..2026_11_27_08_01_00.2");
        std::fs::create_dir(&next).unwrap();
        std::fs::write(
            next.join("free.toml"),
            "requests_per_minute = 7\nrequests_per_day = 1000\n",
        )
        .unwrap();
        symlink("..2026_11_27_08_01_00.2", plans.join("..data_tmp")).unwrap();
        std::fs::rename(plans.join("..data_tmp"), plans.join("..data")).unwrap();
        std::fs::remove_dir_all(plans.join("..2026_11_27_08_00_00.1")).unwrap();
        assert_eq!(catalog.reload(false).plans, Reload::Applied);
        let snapshot = catalog.snapshot();
        let free = snapshot.plans.get("free").expect("free");
        assert!(format!("{free:?}").contains('7'), "{free:?}");
        assert_eq!(
            snapshot.plans.names(),
            ["free"],
            "no plan from the links or folders"
        );
    }

    #[test]
    fn a_broken_plan_file_does_not_hold_back_a_key_change() {
        let (_dir, keys, plans_dir, catalog) = setup();
        let plans = Plans::load_dir(&plans_dir).unwrap();
        let (record, key) = test_key(&keys, &plans, "free");
        assert_eq!(catalog.reload(false).keys, Reload::Applied);
        assert!(catalog.snapshot().keys.lookup(&key).is_some());

        std::fs::write(plans_dir.join("pro.toml"), "requests_per_minute = oops").unwrap();
        crate::keys::service::revoke(&keys, &record.id).unwrap();
        let report = catalog.reload(false);
        assert!(matches!(report.plans, Reload::Refused(ref r) if r.contains("pro.toml")));
        assert_eq!(report.keys, Reload::Applied);
        assert!(catalog.snapshot().keys.lookup(&key).is_none(), "revoked");
        assert_eq!(catalog.snapshot().plans.names(), ["free"], "old plans stay");
    }

    #[test]
    fn unsaved_keys_are_served_through_every_reload_until_saved() {
        let (_dir, keys, plans_dir, catalog) = setup();
        let plans = Plans::load_dir(&plans_dir).unwrap();
        let (record, key) = test_key(&keys, &plans, "free");
        catalog.reload(false);
        let mut unsaved = KeysFile::load(&keys).unwrap();
        let revoked = unsaved.keys.iter_mut().find(|k| k.id == record.id).unwrap();
        revoked.revoked_at = Some("2026-01-01T00:00:00Z".into());
        assert_eq!(
            catalog.serve_unsaved(Arc::new(unsaved)).keys,
            Reload::Applied
        );
        assert!(catalog.snapshot().keys.lookup(&key).is_none(), "revoked");
        assert_eq!(catalog.state()["keys_unsaved"], true);
        // A forced reload (SIGHUP, POST /reload) and a plans edit keep the unsaved keys: the
        // file on disk still has the key active.
        catalog.reload(true);
        std::fs::write(plans_dir.join("pro.toml"), FREE).unwrap();
        catalog.reload(false);
        assert!(
            catalog.snapshot().keys.lookup(&key).is_none(),
            "still revoked"
        );
        // Saved: the file is read again (here it still has the key active, which shows that
        // it is the file, not memory, that is served now).
        assert_eq!(catalog.saved().keys, Reload::Applied);
        assert!(catalog.snapshot().keys.lookup(&key).is_some());
        assert_eq!(catalog.state()["keys_unsaved"], false);
    }

    #[test]
    fn a_plan_edit_that_orphans_an_active_key_is_refused() {
        let (_dir, keys, plans_dir, catalog) = setup();
        std::fs::write(plans_dir.join("pro.toml"), FREE).unwrap();
        catalog.reload(false);
        let plans = Plans::load_dir(&plans_dir).unwrap();
        let (_, key) = test_key(&keys, &plans, "pro");
        catalog.reload(false);
        std::fs::remove_file(plans_dir.join("pro.toml")).unwrap();
        let report = catalog.reload(false);
        assert!(matches!(report.plans, Reload::Refused(ref r) if r.contains("`pro`")));
        let snapshot = catalog.snapshot();
        let info = snapshot.keys.lookup(&key).unwrap();
        assert!(snapshot.plans.contains(&info.plan));
    }

    #[test]
    fn renaming_a_plan_in_use_never_stops_revocations() {
        let (_dir, keys, plans_dir, catalog) = setup();
        std::fs::write(plans_dir.join("pro.toml"), FREE).unwrap();
        catalog.reload(false);
        let plans = Plans::load_dir(&plans_dir).unwrap();
        let (free, free_key) = test_key(&keys, &plans, "free");
        let (pro, _) = test_key(&keys, &plans, "pro");
        catalog.reload(false);

        // The rename is refused: a key still uses `pro`.
        std::fs::rename(plans_dir.join("pro.toml"), plans_dir.join("pro2.toml")).unwrap();
        assert!(matches!(catalog.reload(false).plans, Reload::Refused(_)));
        // A key on the new name: skipped for now, the rest of the file applies.
        let plans = Plans::load_dir(&plans_dir).unwrap();
        let (_, pro2_key) = test_key(&keys, &plans, "pro2");
        assert_eq!(catalog.reload(false).keys, Reload::Applied);
        assert!(catalog.snapshot().keys.lookup(&pro2_key).is_none());
        // A revocation applies regardless.
        crate::keys::service::revoke(&keys, &free.id).unwrap();
        assert_eq!(catalog.reload(false).keys, Reload::Applied);
        assert!(catalog.snapshot().keys.lookup(&free_key).is_none());
        // Once no key uses `pro`, the refused plans are tried again with the keys edit.
        crate::keys::service::revoke(&keys, &pro.id).unwrap();
        let report = catalog.reload(false);
        assert_eq!(
            (report.plans, report.keys),
            (Reload::Applied, Reload::Applied)
        );
        assert!(catalog.snapshot().keys.lookup(&pro2_key).is_some());
        assert_eq!(catalog.state()["plans_refused"], serde_json::Value::Null);
    }

    #[test]
    fn an_edit_keeping_size_and_mtime_is_still_noticed() {
        let (_dir, keys, plans_dir, catalog) = setup();
        let plans = Plans::load_dir(&plans_dir).unwrap();
        let (record, key) = test_key(&keys, &plans, "free");
        catalog.reload(false);
        let before = std::fs::read_to_string(&keys).unwrap();
        let mtime = std::fs::metadata(&keys).unwrap().modified().unwrap();
        // Swap the key for another hash of the same length, in place, and set mtime back.
        let other = hex::encode(crate::keys::index::sha256("pet_other"));
        let after = before.replace(&hex::encode(crate::keys::index::sha256(&key)), &other);
        assert_eq!(after.len(), before.len());
        std::fs::write(&keys, after).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&keys)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        assert_eq!(catalog.reload(false).keys, Reload::Applied);
        assert!(catalog.snapshot().keys.lookup(&key).is_none());
        let info = catalog
            .snapshot()
            .keys
            .lookup("pet_other")
            .cloned()
            .unwrap();
        assert_eq!(&*info.id, record.id);
        assert_eq!(catalog.reload(false).keys, Reload::Unchanged);
    }
}
