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
use std::time::Duration;

use redis::ConnectionLike;

pub(crate) use crate::base::redis::BlockingConn as Conn;
use crate::base::redis::RedisAccess;
use crate::keys::record::{KeyRecord, KeysError, KeysFile};

/// How often a node asks the change feed for news: a change reaches every node within this
/// plus a reload.
pub const POLL: Duration = Duration::from_millis(200);

/// Feed entries kept; a node further behind reloads the whole table.
const FEED_LENGTH: u64 = 10_000;

/// Writes records and their feed entries, only if every record is still as the writer read it
/// (compare-and-set: two writers changing one record never lose either change; the loser
/// reads again and retries).
///
/// - `KEYS[1]`: the records hash; `KEYS[2]`: the change stream (same slot: `{registry}`).
/// - `ARGV`: key id, the record JSON as read (empty: it was absent), the new record JSON, …;
///   the last one is the feed length.
///
/// Returns `{1, last feed id}`, or `{0, key id}` for the first record that changed meanwhile
/// (then nothing was written).
const PUT: &str = r#"
local n = #ARGV - 1
for i = 1, n, 3 do
  local current = redis.call('HGET', KEYS[1], ARGV[i]) or ''
  if current ~= ARGV[i + 1] then
    return {0, ARGV[i]}
  end
end
local last = ''
for i = 1, n, 3 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 2])
  last = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[#ARGV], '*', 'id', ARGV[i])
end
return {1, last}
"#;

/// Attempts of one change against concurrent writers.
const ATTEMPTS: usize = 8;

pub struct Registry {
    redis: RedisAccess,
    records: String,
    changes: String,
    timeout: Duration,
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
    /// A registry on the Redis at `url` (which carries everything needed to connect).
    pub fn new(url: &str, prefix: &str, timeout: Duration) -> Result<Registry, KeysError> {
        Ok(Registry::connecting(
            RedisAccess::from_url(url).map_err(err)?,
            prefix,
            timeout,
        ))
    }

    /// A registry on the Redis that `redis` reaches (TLS, credentials, Sentinels).
    pub fn connecting(redis: RedisAccess, prefix: &str, timeout: Duration) -> Registry {
        Registry {
            redis,
            records: format!("{prefix}:{{registry}}:keys"),
            changes: format!("{prefix}:{{registry}}:changes"),
            timeout,
        }
    }

    /// A blocking connection with the deadline on every read and write, to the primary the
    /// Sentinels name now where there are Sentinels, with the password files read now. (The
    /// registry is used off the request path: by the CLI, and by the sync task in a blocking
    /// thread, which reconnects after any error.)
    pub(crate) fn connect(&self) -> Result<Conn, KeysError> {
        self.redis.connect_blocking(self.timeout).map_err(err)
    }

    /// Every record, and the feed position they are complete up to (read first, so a change
    /// racing with the read is applied again later rather than lost).
    pub fn load(&self) -> Result<(KeysFile, String), KeysError> {
        let mut conn = self.connect()?;
        self.load_on(conn.as_mut())
    }

    pub(crate) fn load_on(
        &self,
        conn: &mut dyn ConnectionLike,
    ) -> Result<(KeysFile, String), KeysError> {
        let (file, position, _) = self.load_raw(conn)?;
        Ok((file, position))
    }

    /// As [`Registry::load_on`], with each record's JSON as stored (for compare-and-set).
    /// Records that cannot be read are skipped with an error in the log, never fatal: one bad
    /// record must not stop every other change from applying.
    fn load_raw(
        &self,
        conn: &mut dyn ConnectionLike,
    ) -> Result<(KeysFile, String, BTreeMap<String, String>), KeysError> {
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
        for (id, json) in &all {
            match parse_record(id, json) {
                Ok(record) => file.keys.push(record),
                Err(e) => tracing::error!(error = %e, "key registry: record skipped"),
            }
        }
        file.sort();
        Ok((file, position, all))
    }

    /// Applies `change` to the current records and writes back the records it changed, unless
    /// another writer changed one of them meanwhile: then it reads again and re-applies.
    pub fn modify<T>(
        &self,
        mut change: impl FnMut(&mut KeysFile) -> Result<T, KeysError>,
    ) -> Result<T, KeysError> {
        let mut conn = self.connect()?;
        for _ in 0..ATTEMPTS {
            let (mut file, _, stored) = self.load_raw(conn.as_mut())?;
            let before: BTreeMap<String, KeyRecord> = file
                .keys
                .iter()
                .map(|k| (k.id.clone(), k.clone()))
                .collect();
            let out = change(&mut file)?;
            let changed: Vec<(&KeyRecord, &str)> = file
                .keys
                .iter()
                .filter(|k| before.get(&k.id) != Some(k))
                .map(|k| (k, stored.get(&k.id).map_or("", String::as_str)))
                .collect();
            if self.put_on(conn.as_mut(), &changed)? {
                return Ok(out);
            }
        }
        Err(KeysError::Registry(format!(
            "the records changed under {ATTEMPTS} attempts in a row (other writers); try again"
        )))
    }

    /// Copies `records` in: those the registry lacks are added; those it holds already stay
    /// as they are there (a second import never undoes a revocation or a rotation made since).
    /// Returns `(added, kept)`.
    pub fn import(&self, records: &[KeyRecord]) -> Result<(usize, usize), KeysError> {
        self.modify(|file| {
            let mut added = 0;
            let mut kept = 0;
            for record in records {
                if file.keys.iter().any(|k| k.id == record.id) {
                    kept += 1;
                } else {
                    file.keys.push(record.clone());
                    added += 1;
                }
            }
            Ok((added, kept))
        })
    }

    /// Writes the changed records (each with its JSON as read); false when another writer
    /// changed one of them first (nothing was written).
    fn put_on(
        &self,
        conn: &mut dyn ConnectionLike,
        records: &[(&KeyRecord, &str)],
    ) -> Result<bool, KeysError> {
        for chunk in records.chunks(500) {
            let script = redis::Script::new(PUT);
            let mut invocation = script.key(&self.records);
            invocation.key(&self.changes);
            for (record, read) in chunk {
                invocation
                    .arg(&record.id)
                    .arg(*read)
                    .arg(serde_json::to_string(record).map_err(err)?);
            }
            invocation.arg(FEED_LENGTH);
            let (done, _): (i64, String) = invocation.invoke(conn).map_err(err)?;
            if done == 0 {
                return Ok(false);
            }
        }
        Ok(true)
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
        // Trimmed past our position: Redis 7 remembers the newest id it deleted from the
        // stream; at or after our position means entries we never read are gone.
        let info: redis::Value = redis::cmd("XINFO")
            .arg("STREAM")
            .arg(&self.changes)
            .query(conn)
            .or_else(|e| {
                if e.to_string().contains("no such key") {
                    Ok(redis::Value::Nil)
                } else {
                    Err(e)
                }
            })
            .map_err(err)?;
        if max_deleted(&info).is_some_and(|deleted| deleted >= stream_id(after)) {
            return Ok(Changes::Trimmed);
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
    // The id becomes a Redis hash tag and a header value: a record written into Redis by hand
    // gets no further than one in a keys file would.
    if !crate::keys::record::valid_key_id(id) {
        return Err(KeysError::Registry(format!(
            "record `{}`: not a key id (1 to 64 of A-Z, a-z, 0-9, `_`, `-`)",
            id.escape_debug()
        )));
    }
    let record: KeyRecord = serde_json::from_str(json)
        .map_err(|e| KeysError::Registry(format!("record `{id}`: {e}")))?;
    if record.id != id {
        return Err(KeysError::Registry(format!(
            "record `{id}` holds the id `{}`",
            record.id
        )));
    }
    Ok(record)
}

/// `max-deleted-entry-id` of an `XINFO STREAM` answer (a map, or a flat list in RESP2).
fn max_deleted(info: &redis::Value) -> Option<(u64, u64)> {
    let text = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        redis::Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    let pairs: Vec<(&redis::Value, &redis::Value)> = match info {
        redis::Value::Map(m) => m.iter().map(|(k, v)| (k, v)).collect(),
        redis::Value::Array(a) => a
            .chunks(2)
            .filter_map(|c| Some((c.first()?, c.get(1)?)))
            .collect(),
        _ => return None,
    };
    let (_, id) = pairs
        .into_iter()
        .find(|(k, _)| text(k).as_deref() == Some("max-deleted-entry-id"))?;
    let id = stream_id(&text(id)?);
    (id != (0, 0)).then_some(id)
}

/// A stream id's `(milliseconds, sequence)`, for ordering.
fn stream_id(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
    (ms.parse().unwrap_or(0), seq.parse().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_whose_id_is_no_key_id_is_refused() {
        for id in ["}x", "a{b}", "", "key with space"] {
            let json = format!(r#"{{"id":"{}"}}"#, id.escape_default());
            let e = parse_record(id, &json).expect_err(id);
            assert!(e.to_string().contains("not a key id"), "{id}: {e}");
        }
    }
}
