//! The keys and plans in force, swapped atomically when their files change. Requests read the
//! current snapshot without locking; a reload that fails validation leaves the old snapshot in
//! place and says why (file and field) in the log.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use arc_swap::ArcSwap;

use crate::keys::{KeyIndex, KeysError, KeysFile};
use crate::plans::{PlanError, Plans};

#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error(transparent)]
    Plans(#[from] PlanError),
    #[error(transparent)]
    Keys(#[from] KeysError),
}

pub struct Snapshot {
    pub plans: Plans,
    pub keys: KeyIndex,
}

impl Snapshot {
    pub fn load(keys_file: &Path, plans_dir: &Path) -> Result<Snapshot, CatalogError> {
        let plans = Plans::load_dir(plans_dir)?;
        let keys = KeysFile::load(keys_file)?;
        keys.check_plans(keys_file, &plans)?;
        Ok(Snapshot {
            plans,
            keys: keys.index(),
        })
    }
}

/// What the files looked like at the last load: names, sizes and modification times.
type Fingerprint = Vec<(PathBuf, u64, Option<SystemTime>)>;

pub struct Catalog {
    current: ArcSwap<Snapshot>,
    keys_file: PathBuf,
    plans_dir: PathBuf,
    seen: Mutex<Fingerprint>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reload {
    Unchanged,
    Applied,
    Refused,
}

impl Catalog {
    pub fn load(keys_file: &Path, plans_dir: &Path) -> Result<Catalog, CatalogError> {
        let seen = fingerprint(keys_file, plans_dir);
        let snapshot = Snapshot::load(keys_file, plans_dir)?;
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

    /// Reloads when the files changed since the last attempt (or always, when `force`, as on
    /// SIGHUP). Blocking file I/O: call it off the request path.
    pub fn reload(&self, force: bool) -> Reload {
        let now_seen = fingerprint(&self.keys_file, &self.plans_dir);
        {
            let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
            if !force && *seen == now_seen {
                return Reload::Unchanged;
            }
            // Remember even a refused version, so a broken file is reported once, not every tick.
            *seen = now_seen;
        }
        match Snapshot::load(&self.keys_file, &self.plans_dir) {
            Ok(snapshot) => {
                tracing::info!(
                    keys = snapshot.keys.len(),
                    plans = ?snapshot.plans.names(),
                    "reloaded keys and plans"
                );
                self.current.store(Arc::new(snapshot));
                Reload::Applied
            }
            Err(e) => {
                tracing::error!(error = %e, "reload refused; the previous keys and plans stay in force");
                Reload::Refused
            }
        }
    }
}

fn fingerprint(keys_file: &Path, plans_dir: &Path) -> Fingerprint {
    let stat = |p: PathBuf| {
        let meta = std::fs::metadata(&p).ok();
        let len = meta.as_ref().map(|m| m.len()).unwrap_or(u64::MAX);
        let modified = meta.and_then(|m| m.modified().ok());
        (p, len, modified)
    };
    let mut out = vec![stat(keys_file.to_owned())];
    if let Ok(entries) = std::fs::read_dir(plans_dir) {
        let mut plans: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        plans.sort();
        out.extend(plans.into_iter().map(stat));
    }
    out
}
