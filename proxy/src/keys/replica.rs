//! Each node's replica of the key registry: a full load, then the registry's change feed,
//! every applied change written to the node's snapshot (its `keys_file`) and reloaded into the
//! catalog. Apart from the registry itself, so that the registry (which the key service writes
//! through) never depends on the catalog (which reads what the service wrote).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use crate::keys::catalog::Catalog;
use crate::keys::record::{KeyRecord, KeysError, KeysFile};
use crate::keys::registry::{Changes, Conn, Registry, POLL};

/// Where a node's keys come from right now, for `/readyz` and the log.
#[derive(Debug, Default)]
pub struct SyncState(AtomicU8);

/// 0: nothing yet; then one of these.
impl SyncState {
    const SNAPSHOT: u8 = 1;
    const SYNCED: u8 = 2;

    pub fn snapshot_only(&self) {
        self.0.store(Self::SNAPSHOT, Ordering::Relaxed)
    }

    /// `Ok(how)` when the node may serve: from the registry, or from its snapshot while the
    /// registry is unreachable; `Err` when it has neither.
    pub fn readiness(&self) -> Result<&'static str, &'static str> {
        match self.0.load(Ordering::Relaxed) {
            Self::SYNCED => Ok("registry"),
            Self::SNAPSHOT => {
                Ok("snapshot (the registry is unreachable; catching up when it returns)")
            }
            _ => Err("no snapshot and the registry is unreachable"),
        }
    }
}

/// Keeps this node's replica in step with the registry: a full load, then the change feed;
/// each applied change is written to the snapshot and reloaded into the catalog.
pub struct Sync {
    pub registry: Arc<Registry>,
    pub snapshot: PathBuf,
    pub catalog: Arc<Catalog>,
    pub state: Arc<SyncState>,
}

impl Sync {
    /// Runs until `stop` says so (checked between polls). Blocking: run it on its own thread.
    pub fn run(&self, stop: &dyn Fn() -> bool) {
        let mut replica: Option<(BTreeMap<String, KeyRecord>, String)> = None;
        let mut conn: Option<Conn> = None;
        let mut failing = false;
        // Records are never deleted (a revoked key keeps its record): a full load with fewer
        // than this node already holds means the registry lost data (flushed, evicted, a
        // wrong prefix, not imported yet), and applying it would wipe keys fleet-wide.
        let mut known = KeysFile::load(&self.snapshot).map_or(0, |f| f.keys.len());
        while !stop() {
            let result = (|| -> Result<(), KeysError> {
                let c = match &mut conn {
                    Some(c) => c,
                    None => conn.insert(self.registry.connect()?),
                };
                match &mut replica {
                    None => {
                        let (file, position) = self.registry.load_on(c.as_mut())?;
                        if file.keys.len() < known {
                            return Err(KeysError::Registry(format!(
                                "it holds {} key record(s), fewer than the {known} this node \
                                 has: refusing to apply it (flushed, evicted, another \
                                 key_prefix, or not imported yet: `pet-gateway keys import`)",
                                file.keys.len()
                            )));
                        }
                        let map: BTreeMap<String, KeyRecord> =
                            file.keys.into_iter().map(|k| (k.id.clone(), k)).collect();
                        known = map.len();
                        self.apply(&map);
                        replica = Some((map, position));
                    }
                    Some((map, position)) => match self.registry.changes(c.as_mut(), position)? {
                        Changes::None => {}
                        Changes::Trimmed => {
                            tracing::warn!("the key change feed was trimmed past this node's position: reloading every key");
                            replica = None;
                        }
                        Changes::Some(records, next) => {
                            for r in records {
                                map.insert(r.id.clone(), r);
                            }
                            known = map.len();
                            self.apply(map);
                            *position = next;
                        }
                    },
                }
                Ok(())
            })();
            match result {
                Ok(()) => {
                    if failing {
                        tracing::info!("key registry reachable again: caught up");
                    }
                    failing = false;
                    if replica.is_some() {
                        self.state.0.store(SyncState::SYNCED, Ordering::Relaxed);
                    }
                }
                Err(e) => {
                    if !failing {
                        tracing::error!(error = %e, "key registry: cannot sync; serving the keys last synced (snapshot) and retrying");
                    }
                    failing = true;
                    // A new connection next time; the replica and its feed position stay,
                    // so the feed catches up on what was missed.
                    conn = None;
                    if self.state.0.load(Ordering::Relaxed) == SyncState::SYNCED {
                        self.state.snapshot_only();
                    }
                }
            }
            // Poll quickly while in step, back off while failing.
            std::thread::sleep(if failing { POLL * 5 } else { POLL });
        }
    }

    /// Writes the replica to the snapshot and reloads the catalog from it. A snapshot that
    /// cannot be written is logged (the catalog keeps its keys; the next change tries again),
    /// never a reason to stop following the feed.
    fn apply(&self, map: &BTreeMap<String, KeyRecord>) {
        let mut file = KeysFile {
            keys: map.values().cloned().collect(),
        };
        file.sort();
        if let Err(e) = crate::keys::file::write_snapshot(&self.snapshot, &file) {
            tracing::error!(error = %e, snapshot = %self.snapshot.display(),
                "key registry: cannot write this node's snapshot; its keys stay as they were");
            return;
        }
        self.catalog.reload(false);
    }
}
