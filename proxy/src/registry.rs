//! The fleet-wide key registry (`keys_source = "store"`): the key records live in the quota
//! store's Redis, and every gateway node keeps a complete local replica, so authentication
//! never waits on Redis.
//!
//! In Redis, under the environment's `key_prefix`, two keys sharing the hash tag `{registry}`
//! (one Redis Cluster slot, so one script may write both):
//!
//! | key | what |
//! |---|---|
//! | `<prefix>:{registry}:keys` | hash: key id → the key record as JSON (the keys file's fields: a hash, never the key) |
//! | `<prefix>:{registry}:changes` | stream, trimmed to about 10,000 entries: one entry (`id`) per changed record |
//!
//! A change ([`Registry::modify`], used by the `keys` commands and the admin key API) writes
//! the changed records and their feed entries in one script. Each node polls the feed every
//! [`POLL`] from the last entry it applied, fetches the changed records, writes its replica to
//! its local snapshot (the `keys_file`, in the keys file's format) and reloads from it; a node
//! whose feed position was trimmed away, or that lost Redis for a while, reloads the whole
//! table. A node that starts while Redis is down starts from its snapshot and catches up when
//! Redis returns.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use redis::ConnectionLike;

use crate::keys::{KeyRecord, KeysError, KeysFile};
use crate::store::RedisTarget;

/// How often a node asks the change feed for news: a change reaches every node within this
/// plus a reload.
pub const POLL: Duration = Duration::from_millis(200);

/// Feed entries kept; a node further behind reloads the whole table.
const FEED_LENGTH: u64 = 10_000;

/// Writes records and their feed entries.
///
/// - `KEYS[1]`: the records hash; `KEYS[2]`: the change stream (same slot: `{registry}`).
/// - `ARGV`: key id, record JSON, key id, record JSON, …; the last one is the feed length.
///
/// Returns the id of the last feed entry written.
const PUT: &str = r#"
local n = #ARGV - 1
local last = ''
for i = 1, n, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  last = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[#ARGV], '*', 'id', ARGV[i])
end
return last
"#;

pub struct Registry {
    target: RedisTarget,
    records: String,
    changes: String,
    timeout: Duration,
}

enum Conn {
    Single(redis::Connection),
    Cluster(Box<redis::cluster::ClusterConnection>),
}

impl Conn {
    fn as_mut(&mut self) -> &mut dyn ConnectionLike {
        match self {
            Conn::Single(c) => c,
            Conn::Cluster(c) => &mut **c,
        }
    }
}

fn err(e: impl std::fmt::Display) -> KeysError {
    KeysError::Registry(e.to_string())
}

/// What a poll of the change feed found.
pub enum Changes {
    /// Records changed since the position, and the new position.
    Some(Vec<KeyRecord>, String),
    None,
    /// The position is older than the feed: reload everything.
    Trimmed,
}

impl Registry {
    pub fn new(url: &str, prefix: &str, timeout: Duration) -> Result<Registry, KeysError> {
        Ok(Registry {
            target: RedisTarget::parse(url).map_err(err)?,
            records: format!("{prefix}:{{registry}}:keys"),
            changes: format!("{prefix}:{{registry}}:changes"),
            timeout,
        })
    }

    /// A blocking connection with the deadline on every read and write. (The registry is
    /// used off the request path: by the CLI, and by the sync task in a blocking thread.)
    fn connect(&self) -> Result<Conn, KeysError> {
        match &self.target {
            RedisTarget::Single(url) => {
                let client = redis::Client::open(url.as_str()).map_err(err)?;
                let c = client
                    .get_connection_with_timeout(self.timeout)
                    .map_err(err)?;
                c.set_read_timeout(Some(self.timeout)).map_err(err)?;
                c.set_write_timeout(Some(self.timeout)).map_err(err)?;
                Ok(Conn::Single(c))
            }
            RedisTarget::Cluster(nodes) => {
                let client = redis::cluster::ClusterClient::builder(nodes.clone())
                    .connection_timeout(self.timeout)
                    .response_timeout(self.timeout)
                    .build()
                    .map_err(err)?;
                Ok(Conn::Cluster(Box::new(
                    client.get_connection().map_err(err)?,
                )))
            }
        }
    }

    /// Every record, and the feed position they are complete up to (read first, so a change
    /// racing with the read is applied again later rather than lost).
    pub fn load(&self) -> Result<(KeysFile, String), KeysError> {
        let mut conn = self.connect()?;
        self.load_on(conn.as_mut())
    }

    fn load_on(&self, conn: &mut dyn ConnectionLike) -> Result<(KeysFile, String), KeysError> {
        let last: Vec<(String, Vec<(String, String)>)> = redis::cmd("XREVRANGE")
            .arg(&self.changes)
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(1)
            .query(conn)
            .map_err(err)?;
        let position = last.first().map_or("0-0".to_owned(), |(id, _)| id.clone());
        let all: BTreeMap<String, String> = redis::cmd("HGETALL")
            .arg(&self.records)
            .query(conn)
            .map_err(err)?;
        let mut file = KeysFile::default();
        for (id, json) in all {
            file.keys.push(parse_record(&id, &json)?);
        }
        file.keys
            .sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
        Ok((file, position))
    }

    /// Applies `change` to the current records and writes back the records it changed.
    pub fn modify<T>(
        &self,
        change: impl FnOnce(&mut KeysFile) -> Result<T, KeysError>,
    ) -> Result<T, KeysError> {
        let mut conn = self.connect()?;
        let (mut file, _) = self.load_on(conn.as_mut())?;
        let before: BTreeMap<String, KeyRecord> = file
            .keys
            .iter()
            .map(|k| (k.id.clone(), k.clone()))
            .collect();
        let out = change(&mut file)?;
        let changed: Vec<&KeyRecord> = file
            .keys
            .iter()
            .filter(|k| before.get(&k.id) != Some(k))
            .collect();
        self.put_on(conn.as_mut(), &changed)?;
        Ok(out)
    }

    /// Writes `records` as they are (for `keys import`: idempotent).
    pub fn put(&self, records: &[KeyRecord]) -> Result<(), KeysError> {
        let mut conn = self.connect()?;
        let all: Vec<&KeyRecord> = records.iter().collect();
        for chunk in all.chunks(500) {
            self.put_on(conn.as_mut(), chunk)?;
        }
        Ok(())
    }

    fn put_on(
        &self,
        conn: &mut dyn ConnectionLike,
        records: &[&KeyRecord],
    ) -> Result<(), KeysError> {
        if records.is_empty() {
            return Ok(());
        }
        let script = redis::Script::new(PUT);
        let mut invocation = script.key(&self.records);
        invocation.key(&self.changes);
        for r in records {
            invocation
                .arg(&r.id)
                .arg(serde_json::to_string(r).map_err(err)?);
        }
        invocation.arg(FEED_LENGTH);
        invocation.invoke::<String>(conn).map_err(err)?;
        Ok(())
    }

    /// The records changed after feed position `after`.
    pub fn changes(
        &self,
        conn: &mut dyn ConnectionLike,
        after: &str,
    ) -> Result<Changes, KeysError> {
        let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
            .arg(&self.changes)
            .arg(format!("({after}"))
            .arg("+")
            .arg("COUNT")
            .arg(1000)
            .query(conn)
            .map_err(err)?;
        if after != "0-0" {
            // Trimmed past our position: the oldest entry left is newer than it, and the
            // entries between are gone.
            let first: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
                .arg(&self.changes)
                .arg("-")
                .arg("+")
                .arg("COUNT")
                .arg(1)
                .query(conn)
                .map_err(err)?;
            if first
                .first()
                .is_some_and(|(id, _)| stream_id(id) > stream_id(after))
            {
                return Ok(Changes::Trimmed);
            }
        }
        let Some((position, _)) = entries.last() else {
            return Ok(Changes::None);
        };
        let mut ids: Vec<String> = entries
            .iter()
            .filter_map(|(_, fields)| {
                fields
                    .iter()
                    .find(|(f, _)| f == "id")
                    .map(|(_, v)| v.clone())
            })
            .collect();
        ids.sort();
        ids.dedup();
        let json: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(&self.records)
            .arg(&ids)
            .query(conn)
            .map_err(err)?;
        let mut records = Vec::new();
        for (id, json) in ids.iter().zip(json) {
            if let Some(json) = json {
                records.push(parse_record(id, &json)?);
            }
        }
        Ok(Changes::Some(records, position.clone()))
    }
}

fn parse_record(id: &str, json: &str) -> Result<KeyRecord, KeysError> {
    serde_json::from_str(json).map_err(|e| KeysError::Registry(format!("record `{id}`: {e}")))
}

/// A stream id's `(milliseconds, sequence)`, for ordering.
fn stream_id(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
    (ms.parse().unwrap_or(0), seq.parse().unwrap_or(0))
}

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
    pub catalog: Arc<crate::catalog::Catalog>,
    pub state: Arc<SyncState>,
}

impl Sync {
    /// Runs until `stop` says so (checked between polls). Blocking: run it on its own thread.
    pub fn run(&self, stop: &dyn Fn() -> bool) {
        let mut replica: Option<(BTreeMap<String, KeyRecord>, String)> = None;
        let mut conn: Option<Conn> = None;
        let mut failing = false;
        while !stop() {
            let result = (|| -> Result<(), KeysError> {
                let c = match &mut conn {
                    Some(c) => c,
                    None => conn.insert(self.registry.connect()?),
                };
                match &mut replica {
                    None => {
                        let (file, position) = self.registry.load_on(c.as_mut())?;
                        let map = file.keys.into_iter().map(|k| (k.id.clone(), k)).collect();
                        self.apply(&map)?;
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
                            self.apply(map)?;
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
                        tracing::error!(error = %e, "key registry unreachable: serving the keys last synced (snapshot); retrying");
                    }
                    failing = true;
                    conn = None;
                    // Whatever was missed meanwhile, a full load catches up.
                    replica = None;
                    if self.state.0.load(Ordering::Relaxed) == SyncState::SYNCED {
                        self.state.snapshot_only();
                    }
                }
            }
            std::thread::sleep(POLL);
        }
    }

    /// Writes the replica to the snapshot and reloads the catalog from it.
    fn apply(&self, map: &BTreeMap<String, KeyRecord>) -> Result<(), KeysError> {
        let mut file = KeysFile {
            keys: map.values().cloned().collect(),
        };
        file.keys
            .sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
        crate::keys::write_snapshot(&self.snapshot, &file)?;
        self.catalog.reload(false);
        Ok(())
    }
}
