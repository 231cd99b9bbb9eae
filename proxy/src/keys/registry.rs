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
//! | `<prefix>:{registry}:changes` | stream, trimmed to about 10,000 entries: one entry (`id`, and `version` written) per changed record |
//! | `<prefix>:{registry}:meta` | hash: `id`, the registry's identity, created with it; nodes remember it |
//! | `<prefix>:{registry}:audit` | stream, trimmed to about 100,000 entries: one entry (`key`, `line`) per key change, the audit line its maker wrote, so every node's console shows the fleet's history; written by whoever may write records (the shipped ACL: `admin`, which `registry_admin_username` names; not the `gateway` user) |
//!
//! A change ([`Registry::modify`], used by the `keys` commands and the admin key API) raises each
//! changed record's version, signs it with the fleet's key when the writer has one, and writes
//! the changed records and their feed entries in one script. Records are read through the
//! public keys the reader trusts ([`VerifyKeys`]): one that does not verify is left out (and
//! counted), never built upon. A node that finds records missing or older in the registry than
//! it holds writes its own back ([`Registry::heal`]). Each node polls the feed every
//! [`POLL`] from the last entry it applied, fetches the changed records, writes its replica to
//! its local snapshot (the `keys_file`, in the keys file's format) and reloads from it; a node
//! whose feed position was trimmed away, or that lost Redis for a while, reloads the whole
//! table, and every node compares the whole table with its replica every
//! `registry_compare_interval_secs` (what the feed misses: a record put back by hand). A node that starts while Redis is down starts from its snapshot and catches up when
//! Redis returns.

use std::collections::BTreeMap;
use std::time::Duration;

use redis::ConnectionLike;

use crate::base::metrics::METRICS;
pub(crate) use crate::base::redis::BlockingConn as Conn;
use crate::base::redis::RedisAccess;
use crate::keys::record::{KeyRecord, KeysError, KeysFile};
use crate::keys::signing::{Binding, BindingMode, SigningKey, VerifyKeys};

/// How often a node asks the change feed for news: a change reaches every node within this
/// plus a reload.
pub const POLL: Duration = Duration::from_millis(200);

/// Feed entries kept; a node further behind reloads the whole table.
const FEED_LENGTH: u64 = 10_000;
/// Audit entries kept: the fleet's recent key changes.
const AUDIT_LENGTH: u64 = 100_000;
/// How many of the newest audit entries a key's history is looked for in.
const AUDIT_SCAN: usize = 10_000;
/// An audit line is a few hundred bytes; a longer one was not written by a key service.
const MAX_AUDIT_LINE: usize = 4096;

/// Writes records and their feed entries, only if every record is still as the writer read it
/// (compare-and-set: two writers changing one record never lose either change; the loser
/// reads again and retries). Writers never set the registry's identity: after a loss, the
/// first to write would otherwise give it a new one, and the nodes that remember the old one
/// could no longer heal it; the nodes set it ([`HEAL`]).
///
/// - `KEYS[1]`: the records hash; `KEYS[2]`: the change stream; `KEYS[3]`: the floors hash
///   (one slot: `{registry}`).
/// - `ARGV[1]`: the feed length; then key id, the record JSON as read (empty: it was absent),
///   the new record JSON, its version, ….
///
/// Each feed entry names the record's version too, and the floors hash keeps it: what a node
/// that holds no version of a record (started without a snapshot) knows of its latest state
/// ([`FeedVersions`]). The feed can be trimmed by whoever may append to it (the `gateway` ACL
/// user, which heals through it); the floors only by the registry's writer (`admin`), and
/// they are never trimmed.
///
/// Returns `{1, last feed id}`, or `{0, key id}` for the first record that changed meanwhile
/// (then nothing was written).
const PUT: &str = r#"
for i = 2, #ARGV, 4 do
  local current = redis.call('HGET', KEYS[1], ARGV[i]) or ''
  if current ~= ARGV[i + 1] then
    return {0, ARGV[i]}
  end
end
local last = ''
for i = 2, #ARGV, 4 do
  -- The feed entry first: a feed that takes no entry (its last id exhausted by hand) fails the
  -- script before any record changes, never leaving a change the nodes do not hear of.
  last = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'id', ARGV[i],
    'version', ARGV[i + 3])
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 2])
  redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 3])
end
return {1, last}
"#;

/// A node writing back what the registry lost: a record absent from it, or held there at a
/// lower version than the node's, or (when the node names it) one that failed verification.
/// Never lowers a version, so a failover to a lagging replica cannot bring back a revoked key;
/// and never writes into a registry of another identity.
///
/// - `KEYS[1]`: the records hash; `KEYS[2]`: the change stream; `KEYS[3]`: the meta hash.
/// - `ARGV[1]`: the feed length; `ARGV[2]`: the node's identity of the registry; then key id,
///   version, record JSON, and the JSON to replace whatever its version (empty: compare
///   versions), ….
///
/// Returns the number of records written, or -1 when the registry has another identity.
const HEAL: &str = r#"
local have = redis.call('HGET', KEYS[3], 'id')
if have and have ~= ARGV[2] then
  return -1
end
if not have then
  redis.call('HSETNX', KEYS[3], 'id', ARGV[2])
end
local written = 0
for i = 3, #ARGV, 4 do
  local current = redis.call('HGET', KEYS[1], ARGV[i])
  local write = not current or current == ARGV[i + 3]
  if current and not write then
    local ok, stored = pcall(cjson.decode, current)
    local version = ok and type(stored) == 'table' and tonumber(stored['version']) or 0
    write = version < tonumber(ARGV[i + 1])
  end
  if write then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'id', ARGV[i],
      'version', ARGV[i + 1])
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 2])
    written = written + 1
  end
end
return written
"#;

/// Attempts of one change against concurrent writers.
const ATTEMPTS: usize = 8;

pub struct Registry {
    redis: RedisAccess,
    records: String,
    changes: String,
    meta: String,
    floors: String,
    audit: String,
    timeout: Duration,
    trust: Trust,
}

/// What a reader verifies records with, what a writer signs them with, and what signatures are
/// bound to.
#[derive(Debug, Default)]
pub struct Trust {
    pub verify: VerifyKeys,
    pub signer: Option<SigningKey>,
    pub binding: Binding,
}

/// The registry as read: the records that verify, the raw JSON of every record (for
/// compare-and-set), the ids of those that did not verify, and its identity.
pub struct Loaded {
    pub file: KeysFile,
    pub position: String,
    pub raw: BTreeMap<String, String>,
    pub refused: Vec<String>,
    /// Whether the change feed still holds every entry ever written to it: when not (trimmed),
    /// a record whose last change was trimmed away has no latest version to be held to.
    pub feed_complete: bool,
}

/// The highest version the change feed names for each record: what the registry held after
/// each change. A record in the hash older than that was put back there by hand, without a
/// feed entry (a replay of a revoked key's older record, say), and is refused even by a node
/// that holds no version of it.
#[derive(Debug, Default)]
struct FeedVersions {
    latest: BTreeMap<String, u64>,
    complete: bool,
}

/// Records and feed entries read per round trip of a full load: each reply stays small, and
/// each read has the connection's deadline.
const PAGE: usize = 1000;

/// Every field of the hash `key`, a page (`HSCAN`, [`PAGE`] a round trip, each under the
/// connection's deadline) at a time, to `take`. Two commands a round, not a pipeline: a
/// blocking cluster connection takes none.
fn scan_hash(
    conn: &mut dyn ConnectionLike,
    key: &str,
    mut take: impl FnMut(Vec<(String, String)>),
) -> Result<(), KeysError> {
    let mut cursor = 0u64;
    loop {
        let (next, page): (u64, Vec<(String, String)>) = redis::cmd("HSCAN")
            .arg(key)
            .arg(cursor)
            .arg("COUNT")
            .arg(PAGE)
            .query(conn)
            .map_err(err)?;
        take(page);
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

fn err(e: impl std::fmt::Display) -> KeysError {
    KeysError::Registry(e.to_string())
}

/// What a poll of the change feed found.
pub enum Changes {
    /// Records changed since the position (those that verify), the new position, and the ids
    /// of changed records that did not verify.
    Some(Vec<KeyRecord>, String, Vec<String>),
    None,
    /// The position is older than the feed: reload everything.
    Trimmed,
    /// The feed ends before the position: the registry went back in time (a failover to a
    /// lagging replica, a restore): reload everything and write back what it lacks.
    Behind,
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
            meta: format!("{prefix}:{{registry}}:meta"),
            floors: format!("{prefix}:{{registry}}:floors"),
            audit: format!("{prefix}:{{registry}}:audit"),
            timeout,
            trust: Trust::default(),
        }
    }

    /// Verifies what it reads with `trust.verify` and signs what it writes with `trust.signer`.
    pub fn with_trust(mut self, trust: Trust) -> Registry {
        self.trust = trust;
        self
    }

    pub fn verify_keys(&self) -> &VerifyKeys {
        &self.trust.verify
    }

    /// Whether `record` passes this reader's verify keys and binding.
    pub fn verifies(&self, record: &KeyRecord) -> bool {
        self.trust
            .verify
            .verify(record, &self.trust.binding)
            .is_ok()
    }

    /// A blocking connection with the deadline on every read and write, to the primary the
    /// Sentinels name now where there are Sentinels, with the password files read now. (The
    /// registry is used off the request path: by the CLI, and by the sync task in a blocking
    /// thread, which reconnects after any error.)
    pub(crate) fn connect(&self) -> Result<Conn, KeysError> {
        self.redis.connect_blocking(self.timeout).map_err(err)
    }

    /// Adds a key change's audit line to the fleet's history.
    pub fn record_audit(&self, key_id: &str, line: &str) -> Result<(), KeysError> {
        let mut conn = self.connect()?;
        redis::cmd("XADD")
            .arg(&self.audit)
            .arg("MAXLEN")
            .arg("~")
            .arg(AUDIT_LENGTH)
            .arg("*")
            .arg("key")
            .arg(key_id)
            .arg("line")
            .arg(line)
            .query::<String>(conn.as_mut())
            .map(drop)
            .map_err(err)
    }

    /// The newest audit lines of `key_id` (at most `max`), newest first, from the last
    /// [`AUDIT_SCAN`] changes of the fleet: one read, whatever the number of keys.
    pub fn audit_of(&self, key_id: &str, max: usize) -> Result<Vec<String>, KeysError> {
        let mut conn = self.connect()?;
        let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XREVRANGE")
            .arg(&self.audit)
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(AUDIT_SCAN)
            .query(conn.as_mut())
            .map_err(err)?;
        Ok(entries
            .into_iter()
            .filter_map(|(_, fields)| {
                let mine = fields.iter().any(|(k, v)| k == "key" && v == key_id);
                let line = fields.into_iter().find(|(k, _)| k == "line")?.1;
                // The entry's line must be about the key it is filed under.
                let about = serde_json::from_str::<serde_json::Value>(&line)
                    .is_ok_and(|v| v["key_id"] == key_id);
                (mine && about && line.len() <= MAX_AUDIT_LINE).then_some(line)
            })
            .take(max)
            .collect())
    }

    /// Every record, and the feed position they are complete up to (read first, so a change
    /// racing with the read is applied again later rather than lost).
    pub fn load(&self) -> Result<(KeysFile, String), KeysError> {
        let mut conn = self.connect()?;
        let loaded = self.load_on(conn.as_mut())?;
        Ok((loaded.file, loaded.position))
    }

    /// As [`Registry::load`], with each record's JSON as stored and the identity. Records that
    /// cannot be read or do not verify are left out with an error in the log and a count, never
    /// fatal: one bad record must not stop every other change from applying.
    pub(crate) fn load_on(&self, conn: &mut dyn ConnectionLike) -> Result<Loaded, KeysError> {
        self.load_known(conn, &BTreeMap::new())
    }

    /// As [`Registry::load_on`], taking a stored record that is, to the byte, the JSON of the
    /// one in `known` without parsing or verifying it again: a node comparing the whole
    /// registry with its replica checks a signature only where something changed.
    pub(crate) fn load_known(
        &self,
        conn: &mut dyn ConnectionLike,
        known: &BTreeMap<String, KeyRecord>,
    ) -> Result<Loaded, KeysError> {
        self.load_with(conn, known, &self.trust.binding, true)
    }

    /// As [`Registry::load_known`], verifying with `binding` (`registry sign` reads the unbound
    /// records it is to re-sign even where binding is required); `replays`: refusing records
    /// older than the feed names. A writer does not: its change is written above both the
    /// version read and its clock, so a revocation over a replayed record still goes through.
    fn load_with(
        &self,
        conn: &mut dyn ConnectionLike,
        known: &BTreeMap<String, KeyRecord>,
        binding: &Binding,
        replays: bool,
    ) -> Result<Loaded, KeysError> {
        let last: Vec<(String, Vec<(String, String)>)> = redis::cmd("XREVRANGE")
            .arg(&self.changes)
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(1)
            .query(conn)
            .map_err(err)?;
        let position = last.first().map_or("0-0".to_owned(), |(id, _)| id.clone());
        // The feed before the records: a change made between the two reads leaves the record
        // newer than its feed entry, never older.
        let feed = if replays {
            self.feed_versions(conn)?
        } else {
            FeedVersions::default()
        };
        let raw = self.scan_records(conn)?;
        let identity: Option<String> = redis::cmd("HGET")
            .arg(&self.meta)
            .arg("id")
            .query(conn)
            .map_err(err)?;
        let mut file = KeysFile {
            registry: identity,
            ..KeysFile::default()
        };
        let mut refused = Vec::new();
        for (id, json) in &raw {
            let same = known
                .get(id)
                .filter(|held| serde_json::to_string(held).is_ok_and(|j| j == *json));
            match same
                .cloned()
                .or_else(|| self.accept_with(id, json, binding))
            {
                Some(record) if !feed.replayed(&record) => file.keys.push(record),
                _ => refused.push(id.clone()),
            }
        }
        file.sort();
        Ok(Loaded {
            file,
            position,
            raw,
            refused,
            feed_complete: feed.complete,
        })
    }

    /// Every record's JSON, read in pages (`HSCAN`), not in one reply: a registry of a million
    /// records is read a page per round trip, each under the deadline, off the request path.
    /// A record changed during the scan may be read in either version: its feed entry, after
    /// the position read first, brings the newer one.
    fn scan_records(
        &self,
        conn: &mut dyn ConnectionLike,
    ) -> Result<BTreeMap<String, String>, KeysError> {
        let mut raw = BTreeMap::new();
        scan_hash(conn, &self.records, |page| raw.extend(page))?;
        Ok(raw)
    }

    /// The highest version each feed entry names per record, read in pages from the oldest
    /// entry (the feed is trimmed to about [`FEED_LENGTH`]). Entries without a version (written
    /// by a node that predates them) say nothing.
    fn feed_versions(&self, conn: &mut dyn ConnectionLike) -> Result<FeedVersions, KeysError> {
        let mut feed = FeedVersions::default();
        let horizon = super::replica::version_horizon();
        let mut from = "-".to_owned();
        loop {
            let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
                .arg(&self.changes)
                .arg(&from)
                .arg("+")
                .arg("COUNT")
                .arg(PAGE)
                .query(conn)
                .map_err(err)?;
            for (_, fields) in &entries {
                let field = |name: &str| fields.iter().find(|(f, _)| f == name).map(|(_, v)| v);
                let version = field("version").and_then(|v| v.parse::<u64>().ok());
                // A version beyond the horizon is no writer's (the `gateway` user may append):
                // it would deny the record to every fresh node.
                if let (Some(id), Some(v)) = (field("id"), version.filter(|&v| v <= horizon)) {
                    feed.raise(id.clone(), v);
                }
            }
            match entries.last() {
                Some((last, _)) if entries.len() == PAGE => from = format!("({last}"),
                _ => break,
            }
        }
        feed.complete = self.feed_trimmed(conn)?.is_none();
        self.floors_into(conn, &mut feed)?;
        Ok(feed)
    }

    /// The floors the registry's writer keeps (a record's version at its last change, see
    /// [`PUT`]), read in pages into `feed`: they outlive a feed trimmed by hand (`XADD … MAXLEN
    /// 0` is the `gateway` user's to send) or by its length. Absent for records last changed
    /// by a writer from before the floors, where the feed alone speaks.
    fn floors_into(
        &self,
        conn: &mut dyn ConnectionLike,
        feed: &mut FeedVersions,
    ) -> Result<(), KeysError> {
        scan_hash(conn, &self.floors, |page| {
            for (id, version) in page {
                if let Ok(v) = version.parse::<u64>() {
                    feed.floor(id, v);
                }
            }
        })
    }

    /// The newest id trimmed or deleted from the feed, if any was.
    fn feed_trimmed(&self, conn: &mut dyn ConnectionLike) -> Result<Option<(u64, u64)>, KeysError> {
        Ok(stream_field(&self.feed_info(conn)?, "max-deleted-entry-id"))
    }

    /// `XINFO STREAM` of the feed; `Nil` when there is no feed yet.
    fn feed_info(&self, conn: &mut dyn ConnectionLike) -> Result<redis::Value, KeysError> {
        redis::cmd("XINFO")
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
            .map_err(err)
    }

    /// A stored record if it parses and verifies; otherwise logged, counted, `None`.
    pub(crate) fn accept(&self, id: &str, json: &str) -> Option<KeyRecord> {
        self.accept_with(id, json, &self.trust.binding)
    }

    fn accept_with(&self, id: &str, json: &str, binding: &Binding) -> Option<KeyRecord> {
        let record = match parse_record(id, json) {
            Ok(record) => record,
            Err(e) => {
                reject("unparsable", &e.to_string());
                return None;
            }
        };
        match self.trust.verify.verify(&record, binding) {
            Ok(()) => Some(record),
            Err(why) => {
                reject(
                    why.reason(),
                    &format!(
                        "record `{id}` (version {}): {}",
                        record.version,
                        why.reason()
                    ),
                );
                None
            }
        }
    }

    /// The registry's identity, and how many records it holds (one round trip): how a node
    /// notices a registry that lost data.
    pub(crate) fn health(
        &self,
        conn: &mut dyn ConnectionLike,
    ) -> Result<(Option<String>, usize), KeysError> {
        let identity: Option<String> = redis::cmd("HGET")
            .arg(&self.meta)
            .arg("id")
            .query(conn)
            .map_err(err)?;
        let len: usize = redis::cmd("HLEN")
            .arg(&self.records)
            .query(conn)
            .map_err(err)?;
        Ok((identity, len))
    }

    /// Applies `change` to the current records and writes back the records it changed, unless
    /// another writer changed one of them meanwhile: then it reads again and re-applies. Each
    /// changed record gets a higher version and this writer's signature.
    pub fn modify<T>(
        &self,
        change: impl FnMut(&mut KeysFile) -> Result<T, KeysError>,
    ) -> Result<T, KeysError> {
        self.modify_reading(&self.trust.binding, change)
    }

    /// As [`Registry::modify`], reading the records through `binding`.
    fn modify_reading<T>(
        &self,
        binding: &Binding,
        mut change: impl FnMut(&mut KeysFile) -> Result<T, KeysError>,
    ) -> Result<T, KeysError> {
        let mut conn = self.connect()?;
        for _ in 0..ATTEMPTS {
            let Loaded { mut file, raw, .. } =
                self.load_with(conn.as_mut(), &BTreeMap::new(), binding, false)?;
            let before: BTreeMap<String, KeyRecord> = file
                .keys
                .iter()
                .map(|k| (k.id.clone(), k.clone()))
                .collect();
            let out = change(&mut file)?;
            let mut changed = Vec::new();
            for record in file.keys.iter().filter(|k| before.get(&k.id) != Some(k)) {
                let was = before.get(&record.id).map_or(0, |b| b.version);
                let read = raw.get(&record.id).map_or("", String::as_str);
                changed.push((self.prepare(record.clone(), was)?, read));
            }
            if self.put_on(conn.as_mut(), &changed)? {
                return Ok(out);
            }
        }
        Err(KeysError::Registry(format!(
            "the records changed under {ATTEMPTS} attempts in a row (other writers); try again"
        )))
    }

    /// A changed record as it is written: a record that already carries a trusted signature and
    /// a newer version (a signed backup restored) as it is; any other one at a higher version,
    /// signed by this writer. A writer that cannot sign for a fleet that verifies changes
    /// nothing.
    fn prepare(&self, mut record: KeyRecord, was: u64) -> Result<KeyRecord, KeysError> {
        let verify = &self.trust.verify;
        if record.version > was && !verify.is_empty() && self.verifies(&record) {
            return Ok(record);
        }
        // Above what was read and above the clock in milliseconds: a registry rolled back to an
        // older record (by a failover, or by hand) cannot make this change reuse a version the
        // nodes already hold for another content.
        record.version = record
            .version
            .max(was)
            .saturating_add(1)
            .max(crate::base::clock::unix_now_ms());
        match &self.trust.signer {
            Some(key) => key.sign(&mut record, &self.trust.binding),
            None if verify.is_empty() => record.signature = None,
            None => {
                return Err(KeysError::CannotSign(
                    "registry_verify_keys is set but registry_signing_key_file is not: every \
                     node would refuse an unsigned record"
                        .to_owned(),
                ))
            }
        }
        Ok(record)
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

    /// Signs every record that this writer's own key has not signed (records from before
    /// signing, or signed by a retired key), or signed unbound where this writer signs bound
    /// (`registry_signature_binding` `sign` or `require`), each at a higher version; returns
    /// them. Only
    /// records that pass this writer's verify keys are signed: with none set (the move to
    /// signed records) that is every record, so run it then on a registry known to be clean;
    /// with them set (rotating the key) a forged record is never signed.
    pub fn sign_all(&self) -> Result<Vec<KeyRecord>, KeysError> {
        let Some(key) = &self.trust.signer else {
            return Err(KeysError::CannotSign(
                "registry_signing_key_file is not set".to_owned(),
            ));
        };
        let own = VerifyKeys::parse(&[key.public_key()]).map_err(err)?;
        let done = match self.trust.binding.mode {
            BindingMode::Off => self.trust.binding.clone(),
            _ => self.trust.binding.required(),
        };
        // Unbound records read even where binding is required: they are what is re-signed.
        let reading = Binding {
            mode: BindingMode::Sign,
            ..self.trust.binding.clone()
        };
        self.modify_reading(&reading, |file| {
            let mut signed = Vec::new();
            for record in &mut file.keys {
                if own.verify(record, &done).is_err() {
                    signed.push(record.clone());
                    record.version = record.version.saturating_add(1);
                }
            }
            Ok(signed)
        })
    }

    /// Writes the changed records (each with its JSON as read); false when another writer
    /// changed one of them first (nothing was written).
    fn put_on(
        &self,
        conn: &mut dyn ConnectionLike,
        records: &[(KeyRecord, &str)],
    ) -> Result<bool, KeysError> {
        for chunk in records.chunks(500) {
            let script = redis::Script::new(PUT);
            let mut invocation = script.key(&self.records);
            invocation.key(&self.changes).key(&self.floors);
            invocation.arg(FEED_LENGTH);
            for (record, read) in chunk {
                invocation
                    .arg(&record.id)
                    .arg(*read)
                    .arg(serde_json::to_string(record).map_err(err)?)
                    .arg(record.version);
            }
            let (done, _): (i64, String) = invocation.invoke(conn).map_err(err)?;
            if done == 0 {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Writes back records a node holds that the registry lost or holds older (see [`HEAL`]);
    /// `replace` maps a key id to the stored JSON to overwrite whatever its version (a record
    /// there that failed verification). Returns how many were written, or `None` when the
    /// registry is another one (another identity).
    pub(crate) fn heal(
        &self,
        conn: &mut dyn ConnectionLike,
        identity: &str,
        records: &[&KeyRecord],
        replace: &BTreeMap<String, String>,
    ) -> Result<Option<usize>, KeysError> {
        let mut written = 0;
        // One run even with no records: it gives a registry without an identity this one.
        let chunks: Vec<&[&KeyRecord]> = if records.is_empty() {
            vec![&[]]
        } else {
            records.chunks(500).collect()
        };
        for chunk in chunks {
            let script = redis::Script::new(HEAL);
            let mut invocation = script.key(&self.records);
            invocation.key(&self.changes).key(&self.meta);
            invocation.arg(FEED_LENGTH).arg(identity);
            for record in chunk {
                invocation
                    .arg(&record.id)
                    .arg(record.version)
                    .arg(serde_json::to_string(record).map_err(err)?)
                    .arg(replace.get(&record.id).map_or("", String::as_str));
            }
            let n: i64 = invocation.invoke(conn).map_err(err)?;
            match usize::try_from(n) {
                Ok(n) => written += n,
                Err(_) => return Ok(None),
            }
        }
        Ok(Some(written))
    }

    /// What the feed's own record says of position `after`, when that settles the poll
    /// (trimmed past it, behind it, or nothing after it); `None` when there is news to read.
    fn feed_state(
        &self,
        conn: &mut dyn ConnectionLike,
        after: &str,
    ) -> Result<Option<Changes>, KeysError> {
        let info = self.feed_info(conn)?;
        let at = stream_id(after);
        // Trimmed past our position: Redis 7 remembers the newest id it deleted from the
        // stream; at or after our position means entries we never read are gone.
        if stream_field(&info, "max-deleted-entry-id").is_some_and(|deleted| deleted >= at) {
            return Ok(Some(Changes::Trimmed));
        }
        let last = stream_field(&info, "last-generated-id").unwrap_or((0, 0));
        Ok(match last.cmp(&at) {
            std::cmp::Ordering::Less => Some(Changes::Behind),
            // Nothing after our position (also where an id written by hand exhausted the
            // feed, which XRANGE past it would refuse): no round trip more, no reload.
            std::cmp::Ordering::Equal => Some(Changes::None),
            std::cmp::Ordering::Greater => None,
        })
    }

    /// The records changed after feed position `after`.
    pub fn changes(
        &self,
        conn: &mut dyn ConnectionLike,
        after: &str,
    ) -> Result<Changes, KeysError> {
        if let Some(answer) = self.feed_state(conn, after)? {
            return Ok(answer);
        }
        let entries: Vec<(String, Vec<(String, String)>)> = match redis::cmd("XRANGE")
            .arg(&self.changes)
            .arg(format!("({after}"))
            .arg("+")
            .arg("COUNT")
            .arg(1000)
            .query(conn)
        {
            Ok(entries) => entries,
            // The feed cannot be read from this position (an id written by hand past any
            // real one): reload everything rather than stall on it.
            Err(e)
                if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError) =>
            {
                tracing::warn!(error = %e, "key registry: the change feed cannot be read from this node's position");
                return Ok(Changes::Trimmed);
            }
            Err(e) => return Err(err(e)),
        };
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
        let mut refused = Vec::new();
        for (id, json) in ids.iter().zip(json) {
            match json.map(|json| self.accept(id, &json)) {
                Some(Some(record)) => records.push(record),
                Some(None) => refused.push(id.clone()),
                None => {}
            }
        }
        Ok(Changes::Some(records, position.clone(), refused))
    }
}

impl FeedVersions {
    /// What the registry held of `id` is at least version `v` (a feed entry says so; a floor
    /// replaces this: [`FeedVersions::floor`]).
    fn raise(&mut self, id: String, v: u64) {
        let latest = self.latest.entry(id).or_insert(0);
        *latest = (*latest).max(v);
    }

    /// The writer's floor for `id` is version `v`: it replaces what feed entries said. Only the
    /// `admin` user writes floors, while the `gateway` user may append feed entries, so a feed
    /// version above the floor is no writer's (planted, it would deny the record to every node
    /// started without a snapshot, and the writer's next version would not clear it).
    fn floor(&mut self, id: String, v: u64) {
        self.latest.insert(id, v);
    }

    /// Whether `record` is older than the feed says the registry held: logged with its id,
    /// counted (`replayed`).
    fn replayed(&self, record: &KeyRecord) -> bool {
        let Some(&latest) = self.latest.get(&record.id) else {
            return false;
        };
        if record.version >= latest {
            return false;
        }
        reject(
            "replayed",
            &format!(
                "record `{}` (version {}): older than version {latest}, which the change feed \
                 says the registry held (a record put back without a feed entry)",
                record.id, record.version
            ),
        );
        true
    }
}

/// A new registry's identity: 128 random bits.
pub(crate) fn new_identity() -> String {
    hex::encode(rand::random::<[u8; 16]>())
}

/// A record refused: logged and counted by reason.
fn reject(reason: &'static str, message: &str) {
    METRICS
        .registry_rejected_records
        .with_label_values(&[reason])
        .inc();
    if first_time(message) {
        tracing::error!(reason, "key registry: record refused: {message}");
    }
}

/// Whether this refusal is new: a record refused again at every comparison (a junk record left
/// in Redis) is counted each time but logged once. Bounded: past 10,000 it starts over.
fn first_time(message: &str) -> bool {
    static SEEN: std::sync::LazyLock<std::sync::Mutex<std::collections::HashSet<String>>> =
        std::sync::LazyLock::new(Default::default);
    let Ok(mut seen) = SEEN.lock() else {
        return true;
    };
    if seen.len() >= 10_000 {
        seen.clear();
    }
    seen.insert(message.to_owned())
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

/// A stream id field of an `XINFO STREAM` answer (a map, or a flat list in RESP2), such as
/// `max-deleted-entry-id`; `None` when absent or `0-0`.
fn stream_field(info: &redis::Value, name: &str) -> Option<(u64, u64)> {
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
        .find(|(k, _)| text(k).as_deref() == Some(name))?;
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
    fn a_refusal_seen_again_is_not_logged_again() {
        let message = "record `key_test_first_time` (version 3): unsigned";
        assert!(first_time(message));
        assert!(!first_time(message));
        assert!(first_time(
            "record `key_test_first_time` (version 4): unsigned"
        ));
    }

    #[test]
    fn a_record_whose_id_is_no_key_id_is_refused() {
        for id in ["}x", "a{b}", "", "key with space"] {
            let json = format!(r#"{{"id":"{}"}}"#, id.escape_default());
            let e = parse_record(id, &json).expect_err(id);
            assert!(e.to_string().contains("not a key id"), "{id}: {e}");
        }
    }
}
