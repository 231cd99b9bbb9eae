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

use crate::keys::{KeyIndex, KeysError, KeysFile};
use crate::metrics::METRICS;
use crate::plans::{PlanError, Plans};

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
    pub fn load(keys_file: &Path, plans_dir: &Path) -> Result<Snapshot, CatalogError> {
        let plans = Plans::load_dir(plans_dir)?;
        let keys = load_keys(keys_file, &plans)?;
        Ok(Snapshot {
            plans: Arc::new(plans),
            keys: Arc::new(keys),
        })
    }
}

fn load_keys(keys_file: &Path, plans: &Plans) -> Result<KeyIndex, KeysError> {
    let keys = KeysFile::load(keys_file)?;
    keys.check_plans(keys_file, plans)?;
    Ok(keys.index())
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
    Keys,
    Plans,
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
        let seen = Seen {
            keys: fingerprint(std::slice::from_ref(&keys_file.to_owned())),
            plans: plans_fingerprint(plans_dir),
        };
        let snapshot = Snapshot::load(keys_file, plans_dir)?;
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

    /// Reloads each part whose files changed since the last attempt (or both, when `force`,
    /// as on SIGHUP). Plans go first, so a key naming a plan added in the same edit loads.
    /// Blocking file I/O: call it off the request path.
    pub fn reload(&self, force: bool) -> ReloadReport {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let keys_now = fingerprint(std::slice::from_ref(&self.keys_file));
        let plans_now = plans_fingerprint(&self.plans_dir);
        // Remember even a refused version, so a broken file is reported once, not every tick.
        let keys_changed = force || seen.keys != keys_now;
        let plans_changed = force || seen.plans != plans_now;
        seen.keys = keys_now;
        seen.plans = plans_now;

        let current = Snapshot::clone(&self.current.load());
        let mut next = current.clone();
        let plans = if plans_changed {
            match self.load_plans(&current.keys) {
                Ok(plans) => {
                    next.plans = Arc::new(plans);
                    Reload::Applied
                }
                Err(reason) => Reload::Refused(reason),
            }
        } else {
            Reload::Unchanged
        };
        let keys = if keys_changed {
            match load_keys(&self.keys_file, &next.plans) {
                Ok(keys) => {
                    next.keys = Arc::new(keys);
                    Reload::Applied
                }
                Err(e) => Reload::Refused(e.to_string()),
            }
        } else {
            Reload::Unchanged
        };
        let report = ReloadReport { keys, plans };
        if report.parts().iter().any(|(_, r)| **r == Reload::Applied) {
            self.current.store(Arc::new(next.clone()));
        }
        for (part, result) in report.parts() {
            match result {
                Reload::Unchanged => {}
                Reload::Applied => {
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
                Reload::Refused(reason) => {
                    METRICS.config_reloads.with_label_values(&["refused"]).inc();
                    METRICS
                        .catalog_reload_failing
                        .with_label_values(&[part.as_str()])
                        .set(1);
                    tracing::error!(part = part.as_str(), error = %reason,
                        "reload refused; the previous version stays in force");
                }
            }
        }
        report
    }

    /// The plans directory, refused when it is broken or when it would leave an active key
    /// without its plan (that key would stop working on a plan edit nobody meant for it).
    fn load_plans(&self, keys: &KeyIndex) -> Result<Plans, String> {
        let plans = Plans::load_dir(&self.plans_dir).map_err(|e| e.to_string())?;
        if let Some(warning) = plans.ignored_warning(&self.plans_dir) {
            tracing::warn!("{warning}");
        }
        if let Some(orphan) = keys.keys().find(|k| !plans.contains(&k.plan)) {
            return Err(format!(
                "{}: no plan `{}` any more, but key `{}` (and maybe others) uses it; \
                 revoke or move those keys first",
                self.plans_dir.display(),
                orphan.plan,
                orphan.id
            ));
        }
        Ok(plans)
    }
}

fn mark_loaded(part: Part) {
    METRICS
        .catalog_reload_failing
        .with_label_values(&[part.as_str()])
        .set(0);
    METRICS
        .catalog_last_reload
        .with_label_values(&[part.as_str()])
        .set(crate::clock::unix_now() as i64);
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

    #[test]
    fn a_broken_plan_file_does_not_hold_back_a_key_change() {
        let (_dir, keys, plans_dir, catalog) = setup();
        let plans = Plans::load_dir(&plans_dir).unwrap();
        let (record, key) = crate::keys::issue(&keys, &plans, "free", None).unwrap();
        assert_eq!(catalog.reload(false).keys, Reload::Applied);
        assert!(catalog.snapshot().keys.lookup(&key).is_some());

        std::fs::write(plans_dir.join("pro.toml"), "requests_per_minute = oops").unwrap();
        crate::keys::revoke(&keys, &record.id).unwrap();
        let report = catalog.reload(false);
        assert!(matches!(report.plans, Reload::Refused(ref r) if r.contains("pro.toml")));
        assert_eq!(report.keys, Reload::Applied);
        assert!(catalog.snapshot().keys.lookup(&key).is_none(), "revoked");
        assert_eq!(catalog.snapshot().plans.names(), ["free"], "old plans stay");
    }

    #[test]
    fn a_plan_edit_that_orphans_an_active_key_is_refused() {
        let (_dir, keys, plans_dir, catalog) = setup();
        std::fs::write(plans_dir.join("pro.toml"), FREE).unwrap();
        catalog.reload(false);
        let plans = Plans::load_dir(&plans_dir).unwrap();
        let (_, key) = crate::keys::issue(&keys, &plans, "pro", None).unwrap();
        catalog.reload(false);
        std::fs::remove_file(plans_dir.join("pro.toml")).unwrap();
        let report = catalog.reload(false);
        assert!(matches!(report.plans, Reload::Refused(ref r) if r.contains("`pro`")));
        let snapshot = catalog.snapshot();
        let info = snapshot.keys.lookup(&key).unwrap();
        assert!(snapshot.plans.contains(&info.plan));
    }

    #[test]
    fn an_edit_keeping_size_and_mtime_is_still_noticed() {
        let (_dir, keys, plans_dir, catalog) = setup();
        let plans = Plans::load_dir(&plans_dir).unwrap();
        let (record, key) = crate::keys::issue(&keys, &plans, "free", None).unwrap();
        catalog.reload(false);
        let before = std::fs::read_to_string(&keys).unwrap();
        let mtime = std::fs::metadata(&keys).unwrap().modified().unwrap();
        // Swap the key for another hash of the same length, in place, and set mtime back.
        let other = hex::encode(crate::keys::sha256("pet_other"));
        let after = before.replace(&hex::encode(crate::keys::sha256(&key)), &other);
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
