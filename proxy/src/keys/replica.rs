//! Each node's replica of the key registry: a full load, then the registry's change feed,
//! every applied change written to the node's snapshot (its `keys_file`) and reloaded into the
//! catalog. Apart from the registry itself, so that the registry (which the key service writes
//! through) never depends on the catalog (which reads what the service wrote).
//!
//! The node is also the registry's memory. It holds the highest version of every record it has
//! seen (in its snapshot, across restarts) and never takes a lower one, so a replayed old record
//! is refused. When the registry lost records (a restart without persistence, a flush, a
//! failover to a lagging replica, a wrong prefix) the node writes back the ones it holds,
//! add-if-absent or older-only, under the registry's identity, which the node remembers too.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::base::metrics::METRICS;
use crate::keys::catalog::Catalog;
use crate::keys::record::{KeyRecord, KeysError, KeysFile};
use crate::keys::registry::{new_identity, Changes, Conn, Loaded, Registry, POLL};

/// Where a node's keys come from right now, for `/readyz`, `keys list` and the log.
#[derive(Debug, Default)]
pub struct SyncState {
    code: AtomicU8,
    /// What `Repairing` and `Apart` say.
    detail: Mutex<String>,
    /// The node's snapshot cannot be written (a full disk): it serves its keys from memory.
    unsaved: AtomicBool,
    /// Why, for `/readyz`.
    unsaved_why: Mutex<String>,
}

/// 0: nothing yet; then one of these.
impl SyncState {
    const SNAPSHOT: u8 = 1;
    const SYNCED: u8 = 2;
    const REPAIRING: u8 = 3;
    const APART: u8 = 4;

    pub fn snapshot_only(&self) {
        self.code.store(Self::SNAPSHOT, Ordering::Relaxed)
    }

    fn set(&self, code: u8, detail: String) {
        if let Ok(mut d) = self.detail.lock() {
            *d = detail;
        }
        self.code.store(code, Ordering::Relaxed);
        METRICS
            .registry_in_step
            .set(i64::from(code == Self::SYNCED));
    }

    /// `Ok(how)` when the node may serve: from the registry (also while it heals it), or from
    /// its snapshot while the registry is unreachable or disagrees; `Err` when it has neither.
    /// One Redis restart must not take the whole fleet out of the load balancer.
    pub fn readiness(&self) -> Result<String, String> {
        let how = self.source()?;
        if self.unsaved.load(Ordering::Relaxed) {
            let why = self
                .unsaved_why
                .lock()
                .map(|w| w.clone())
                .unwrap_or_default();
            return Ok(format!(
                "{how}; this node's snapshot cannot be written ({why}): its keys are served \
                 from memory and a restart would start from the last snapshot written"
            ));
        }
        Ok(how)
    }

    fn source(&self) -> Result<String, String> {
        let detail = || self.detail.lock().map(|d| d.clone()).unwrap_or_default();
        match self.code.load(Ordering::Relaxed) {
            Self::SYNCED => Ok("registry".to_owned()),
            Self::REPAIRING => Ok(format!("repairing: {}", detail())),
            Self::APART => Ok(format!("snapshot: {}", detail())),
            Self::SNAPSHOT => Ok(
                "snapshot (the registry is unreachable; catching up when it returns)".to_owned(),
            ),
            _ => Err("no snapshot and the registry is unreachable".to_owned()),
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
    /// How often the whole registry is compared with the replica
    /// (`registry_compare_interval_secs`): the feed, the identity and the record count miss a
    /// record put back older without a feed entry, which only a whole comparison finds.
    pub compare_every: Duration,
}

/// The records this node holds (the highest version of each it has seen), and the registry's
/// identity.
#[derive(Default)]
struct Replica {
    records: BTreeMap<String, KeyRecord>,
    identity: Option<String>,
    /// The snapshot could not be written (a full disk): the catalog serves the replica from
    /// memory, and the write is tried again when this says.
    unsaved: Option<Unsaved>,
    /// Whether the replica was served once: until then a full load serves it whatever it found.
    served: bool,
}

/// While the snapshot cannot be written: when to try again, and the wait that led there. The
/// wait doubles up to [`UNSAVED_RETRY_MAX`]: a full disk is not cured in 200 ms, and writing a
/// million records five times a second would only add to the load of a node already in trouble.
struct Unsaved {
    due: Instant,
    wait: Duration,
}

impl Unsaved {
    fn due(&self) -> bool {
        Instant::now() >= self.due
    }
}

const UNSAVED_RETRY_FIRST: Duration = Duration::from_secs(1);
const UNSAVED_RETRY_MAX: Duration = Duration::from_secs(60);

impl Replica {
    /// Takes each of `records` as [`Replica::take`] does; whether any changed what is held.
    fn take_all(&mut self, records: &[KeyRecord]) -> bool {
        let taken: Vec<Taken> = records.iter().cloned().map(|r| self.take(r)).collect();
        taken.contains(&Taken::Changed)
    }

    /// Takes `record` unless it is older than (or a different record at the same version as)
    /// the one held; records from before versions (both 0) are taken as they come.
    fn take(&mut self, record: KeyRecord) -> Taken {
        if record.version > version_horizon() {
            METRICS
                .registry_rejected_records
                .with_label_values(&["future"])
                .inc();
            tracing::error!(key_id = %record.id, version = record.version,
                "key registry: record refused: its version is more than a day ahead of this node's clock");
            return Taken::Older;
        }
        match self.records.get(&record.id) {
            Some(held) if *held == record => Taken::Same,
            Some(held)
                if record.version > held.version || (record.version == 0 && held.version == 0) =>
            {
                self.records.insert(record.id.clone(), record);
                Taken::Changed
            }
            Some(held) => {
                METRICS
                    .registry_rejected_records
                    .with_label_values(&["older"])
                    .inc();
                tracing::error!(key_id = %record.id, version = record.version,
                    held = held.version,
                    "key registry: record refused: not newer than the version this node holds");
                Taken::Older
            }
            None => {
                self.records.insert(record.id.clone(), record);
                Taken::Changed
            }
        }
    }
}

/// Names the gap a node started without a snapshot cannot close by itself: the feed trimmed
/// past a record's last change leaves nothing in Redis saying its latest version.
fn warn_if_history_lost(replica: &Replica, loaded: &Loaded) {
    if replica.records.is_empty() && !loaded.feed_complete && !loaded.file.keys.is_empty() {
        tracing::warn!("key registry: this node holds no snapshot and the change feed was trimmed: a record put back older than its last change, if that change was trimmed away, cannot be told from the latest and is taken; the running nodes that hold the newer version write it back at their next comparison. Start new nodes from a copy of another node's snapshot to close this gap");
    }
}

/// The highest version a node takes: a day past its clock in milliseconds. Writers' versions
/// are at least their clock, so a version far beyond it was written by hand, and taking it
/// would leave no room above it for the next change (a revocation).
/// `every`, give or take a fifth, drawn anew for each comparison: nodes started together (a
/// rollout) would otherwise read the whole registry from Redis at the same moment every period.
fn jittered(every: Duration) -> Duration {
    every.mul_f64(rand::random_range(0.8..1.2))
}

pub(super) fn version_horizon() -> u64 {
    crate::base::clock::unix_now_ms().saturating_add(86_400_000)
}

/// What became of a record read from the registry.
#[derive(PartialEq)]
enum Taken {
    Changed,
    Same,
    /// Refused: the registry holds an older version than this node, which it writes back.
    Older,
}

/// How one round with the registry ended.
enum Round {
    InStep,
    /// Records written back.
    Repaired(usize),
    /// The registry is another one, or could not be healed; the reason.
    Apart(String),
}

impl Sync {
    /// Runs until `stop` says so (checked between polls). Blocking: run it on its own thread.
    pub fn run(&self, stop: &dyn Fn() -> bool) {
        let mut replica = self.snapshot_replica();
        let mut position: Option<String> = None;
        let mut conn: Option<Conn> = None;
        // Rounds failed in a row: the wait after a failure grows from one poll to five, so a
        // Redis back after a restart is caught up with within a poll or two, and a Redis that
        // stays away costs a connection attempt a second.
        let mut failures: u32 = 0;
        let mut compared = Instant::now();
        let mut compare_after = jittered(self.compare_every);
        while !stop() {
            // The feed's position a comparison set aside: a comparison that fails (a page past
            // its deadline, a failover mid-scan, `HSCAN` refused by an older ACL file) resumes
            // the feed from it, so changes keep arriving until the next period's comparison.
            let mut resume = None;
            if position.is_some() && compared.elapsed() >= compare_after {
                // No position: the round loads the whole registry, refuses what is older than
                // held and writes the held version back.
                resume = position.take();
            }
            if position.is_none() {
                compared = Instant::now();
                compare_after = jittered(self.compare_every);
            }
            // Before the registry is reached: a snapshot to write matters most while Redis is
            // away (a restart would start from it).
            if replica.unsaved.as_ref().is_some_and(Unsaved::due) {
                self.save(&mut replica, false);
            }
            let round = self.round(&mut conn, &mut replica, &mut position);
            let wait = match round {
                Ok(round) => {
                    if failures > 0 {
                        tracing::info!("key registry reachable again: caught up");
                    }
                    failures = 0;
                    // Poll quickly while in step, back off while apart.
                    if self.report(round) {
                        POLL * 5
                    } else {
                        POLL
                    }
                }
                Err(e) => {
                    if position.is_none() {
                        position = resume;
                    }
                    if failures == 0 {
                        tracing::error!(error = %e, "key registry: cannot sync; serving the keys last synced (snapshot) and retrying");
                    }
                    failures = failures.saturating_add(1);
                    // A new connection next time; the replica and its feed position stay,
                    // so the feed catches up on what was missed.
                    conn = None;
                    let code = self.state.code.load(Ordering::Relaxed);
                    if code == SyncState::SYNCED || code == SyncState::REPAIRING {
                        self.state.snapshot_only();
                    }
                    POLL * (1u32 << (failures - 1).min(3)).min(5)
                }
            };
            std::thread::sleep(wait);
        }
        if replica.unsaved.is_some() {
            // One last try on the way out, whatever the backoff says.
            replica.unsaved = None;
            self.save(&mut replica, false);
        }
    }

    /// Sets the state a round ended in; true when the next round should wait longer.
    fn report(&self, round: Round) -> bool {
        match round {
            Round::InStep => {
                self.state.set(SyncState::SYNCED, String::new());
                false
            }
            Round::Repaired(n) => {
                METRICS.registry_repairs.inc_by(n as u64);
                tracing::warn!(records = n, "key registry: it had lost key records (or held older versions); this node wrote back the ones it holds");
                self.state.set(
                    SyncState::REPAIRING,
                    format!("wrote back {n} record(s) the registry had lost or held older"),
                );
                false
            }
            Round::Apart(why) => {
                if self.state.code.load(Ordering::Relaxed) != SyncState::APART {
                    tracing::error!(reason = %why, "key registry: this node and the registry disagree; serving this node's keys");
                }
                self.state.set(SyncState::APART, why);
                true
            }
        }
    }

    /// The records and identity of this node's snapshot (the keys it served last time).
    fn snapshot_replica(&self) -> Replica {
        let file = match KeysFile::load(&self.snapshot) {
            Ok(file) => file,
            Err(e) => {
                // Not silently: without its snapshot the node forgets the versions it held, so
                // it would take a replayed older record until the fleet writes the newer back.
                if self.snapshot.exists() {
                    tracing::error!(error = %e, snapshot = %self.snapshot.display(),
                        "key registry: this node's snapshot cannot be read; starting without it");
                }
                KeysFile::default()
            }
        };
        // What this node would refuse from the registry it does not serve from its own snapshot
        // either: a record signed by a key no longer trusted, or unbound once binding is
        // required, stops here too rather than only on nodes started without a snapshot.
        let (kept, dropped): (Vec<KeyRecord>, Vec<KeyRecord>) = file
            .keys
            .into_iter()
            .partition(|k| self.registry.verifies(k));
        for k in &dropped {
            tracing::error!(key_id = %k.id, version = k.version,
                "key registry: a record of this node's snapshot no longer verifies (a retired signing key, or unbound where binding is required); not served until the registry holds one that does");
        }
        Replica {
            records: kept.into_iter().map(|k| (k.id.clone(), k)).collect(),
            identity: file.registry,
            ..Replica::default()
        }
    }

    /// One poll: a full load (first, after losing the feed, or when the registry lost data),
    /// or the changes since `position`.
    fn round(
        &self,
        conn: &mut Option<Conn>,
        replica: &mut Replica,
        position: &mut Option<String>,
    ) -> Result<Round, KeysError> {
        let c = match conn {
            Some(c) => c,
            None => conn.insert(self.registry.connect()?),
        };
        if let Some(at) = position.as_deref() {
            let (identity, len) = self.registry.health(c.as_mut())?;
            let held = replica.records.len();
            let lost = (identity.is_none() && held > 0) || len < held;
            if identity == replica.identity && !lost {
                return match self.registry.changes(c.as_mut(), at)? {
                    Changes::None => Ok(Round::InStep),
                    Changes::Trimmed | Changes::Behind => {
                        tracing::warn!("the key change feed no longer holds this node's position (trimmed, or the registry went back): reloading every key");
                        self.full(c, replica, position)
                    }
                    Changes::Some(records, next, refused) => {
                        let taken: Vec<Taken> =
                            records.into_iter().map(|r| replica.take(r)).collect();
                        if taken.contains(&Taken::Changed) {
                            self.apply(replica);
                        }
                        *position = Some(next);
                        // The registry holds an older or a forged version of a record this
                        // node holds: write the node's back.
                        let held = refused.iter().any(|id| replica.records.contains_key(id));
                        if taken.contains(&Taken::Older) || held {
                            return self.full(c, replica, position);
                        }
                        Ok(Round::InStep)
                    }
                };
            }
        }
        self.full(c, replica, position)
    }

    /// Loads the whole registry, takes what is newer than held, writes back what the registry
    /// lacks or holds older, and applies the result.
    fn full(
        &self,
        c: &mut Conn,
        replica: &mut Replica,
        position: &mut Option<String>,
    ) -> Result<Round, KeysError> {
        let loaded = self.registry.load_known(c.as_mut(), &replica.records)?;
        warn_if_history_lost(replica, &loaded);
        if let (Some(theirs), Some(ours)) = (&loaded.file.registry, replica.identity.clone()) {
            // Another identity over a record this node holds, the very same (verified, same
            // version and content), or over none at all, is this registry renamed (two nodes
            // named it at once, or one named it again after a loss): follow it. Otherwise it
            // is another registry (a wrong key_prefix or redis_url).
            let ours_there = loaded.raw.is_empty()
                || loaded
                    .file
                    .keys
                    .iter()
                    .any(|k| replica.records.get(&k.id) == Some(k));
            if *theirs != ours && ours_there {
                tracing::info!(registry = %theirs, was = %ours, "key registry: following the registry's identity");
                replica.identity = Some(theirs.clone());
            } else if *theirs != ours {
                *position = None;
                // Records signed by the fleet's key are the fleet's whatever the identity says
                // (which anyone who can write to Redis can change): newer versions of the
                // records this node holds still apply, so a revocation is never held up;
                // nothing is written back, and no record it does not hold is taken.
                if !self.registry.verify_keys().is_empty() {
                    let held: Vec<KeyRecord> = loaded
                        .file
                        .keys
                        .iter()
                        .filter(|r| replica.records.contains_key(&r.id))
                        .cloned()
                        .collect();
                    let taken: Vec<Taken> = held.into_iter().map(|r| replica.take(r)).collect();
                    if taken.contains(&Taken::Changed) {
                        self.apply(replica);
                    }
                }
                return Ok(Round::Apart(format!(
                    "the registry's identity is {theirs}, this node's is {ours}: another \
                     registry (key_prefix, redis_url)? Move this node's snapshot aside to adopt it"
                )));
            }
        }
        // Served again only when something changed: the periodic comparison of a registry in
        // step writes no snapshot and reloads nothing.
        let mut changed = replica.take_all(&loaded.file.keys) || !replica.served;
        // The registry's, or the one this node remembers; a new one only from a node that has
        // records to give it (a node with none, fresh, must not name a registry it never saw).
        let identity = loaded
            .file
            .registry
            .clone()
            .or_else(|| replica.identity.clone())
            .or_else(|| (!replica.records.is_empty()).then(new_identity));
        let written = match &identity {
            Some(id) => self.write_back(c, id, replica, &loaded)?,
            None => Some(0),
        };
        *position = Some(loaded.position);
        let Some(n) = written else {
            *position = None;
            return Ok(Round::Apart(
                "the registry took another identity while this node healed it".to_owned(),
            ));
        };
        changed |= replica.identity != identity;
        replica.identity = identity;
        if changed {
            self.apply(replica);
        }
        Ok(if n == 0 {
            Round::InStep
        } else {
            Round::Repaired(n)
        })
    }

    /// Writes back the held records the registry lacks, holds older, or holds in a form that
    /// did not verify; `Some(0)` when nothing was missing.
    fn write_back(
        &self,
        c: &mut Conn,
        identity: &str,
        replica: &Replica,
        loaded: &Loaded,
    ) -> Result<Option<usize>, KeysError> {
        let stored: BTreeMap<&str, u64> = loaded
            .file
            .keys
            .iter()
            .map(|k| (k.id.as_str(), k.version))
            .collect();
        let replace: BTreeMap<String, String> = loaded
            .refused
            .iter()
            .filter_map(|id| Some((id.clone(), loaded.raw.get(id)?.clone())))
            .collect();
        let missing: Vec<&KeyRecord> = replica
            .records
            .values()
            .filter(|r| stored.get(r.id.as_str()).is_none_or(|v| *v < r.version))
            .filter(|r| self.registry.verifies(r))
            .collect();
        if missing.is_empty() && loaded.file.registry.is_some() {
            return Ok(Some(0));
        }
        self.registry.heal(c.as_mut(), identity, &missing, &replace)
    }

    /// Serves the replica after a change: written to the snapshot and reloaded from it.
    fn apply(&self, replica: &mut Replica) {
        replica.served = true;
        self.save(replica, true);
    }

    /// Writes the replica to the snapshot and serves it. A snapshot that cannot be written (a
    /// full disk) never holds back a change (a revocation): the catalog then serves the
    /// replica from memory (`changed`: it has something new to serve) and the write is tried
    /// again later; nor is it a reason to stop following the feed.
    fn save(&self, replica: &mut Replica, changed: bool) {
        let mut file = KeysFile {
            registry: replica.identity.clone(),
            keys: replica.records.values().cloned().collect(),
        };
        file.sort();
        let file = Arc::new(file);
        // While the snapshot cannot be written, a change is served at once and written at the
        // next try: not a whole snapshot written per change.
        if !replica.unsaved.as_ref().is_none_or(Unsaved::due) {
            if changed {
                self.catalog.serve_unsaved(file);
            }
            return;
        }
        match crate::keys::file::write_snapshot(&self.snapshot, &file) {
            Ok(()) if replica.unsaved.take().is_some() => {
                tracing::info!(snapshot = %self.snapshot.display(),
                    "key registry: this node's snapshot is written again");
                self.catalog.saved();
                self.set_unsaved(None);
            }
            Ok(()) => {
                self.catalog.reload(false);
            }
            Err(e) => {
                let wait = match &replica.unsaved {
                    None => {
                        tracing::error!(error = %e, snapshot = %self.snapshot.display(),
                            "key registry: cannot write this node's snapshot; serving its keys from memory and trying again");
                        UNSAVED_RETRY_FIRST
                    }
                    Some(u) => (u.wait * 2).min(UNSAVED_RETRY_MAX),
                };
                replica.unsaved = Some(Unsaved {
                    due: Instant::now() + wait,
                    wait,
                });
                self.set_unsaved(Some(e.to_string()));
                if changed {
                    self.catalog.serve_unsaved(file);
                }
            }
        }
    }

    /// `Some(why)` while the snapshot cannot be written.
    fn set_unsaved(&self, why: Option<String>) {
        if let Ok(mut w) = self.state.unsaved_why.lock() {
            *w = why.clone().unwrap_or_default();
        }
        self.state.unsaved.store(why.is_some(), Ordering::Relaxed);
        METRICS
            .registry_snapshot_unsaved
            .set(i64::from(why.is_some()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(version: u64) -> KeyRecord {
        crate::keys::record::sample_record(version)
    }

    #[test]
    fn each_comparison_waits_the_period_give_or_take_a_fifth() {
        let every = Duration::from_secs(60);
        let waits: Vec<Duration> = (0..200).map(|_| jittered(every)).collect();
        for wait in &waits {
            assert!(
                *wait >= every.mul_f64(0.8) && *wait < every.mul_f64(1.2),
                "{wait:?}"
            );
        }
        let (shortest, longest) = (waits.iter().min().unwrap(), waits.iter().max().unwrap());
        assert!(
            longest.saturating_sub(*shortest) > Duration::from_secs(10),
            "no spread"
        );
    }

    #[test]
    fn a_node_takes_newer_versions_only_and_none_past_its_horizon() {
        let mut replica = Replica::default();
        assert!(replica.take(record(5)) == Taken::Changed);
        assert!(replica.take(record(5)) == Taken::Same);
        let mut other = record(5);
        other.plan = "enterprise".into();
        assert!(
            replica.take(other) == Taken::Older,
            "same version, other content"
        );
        assert!(replica.take(record(4)) == Taken::Older);
        assert!(
            replica.take(record(u64::MAX)) == Taken::Older,
            "past the horizon"
        );
        let near = version_horizon() - 1;
        assert!(replica.take(record(near)) == Taken::Changed);
        assert_eq!(replica.records["key_1"].version, near);
    }
}
