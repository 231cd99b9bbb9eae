//! A key's record and the keys file's model: which API keys exist, their plan, name and id. A
//! record holds only the SHA-256 hash of its key: whoever reads the records (or a backup of
//! them) cannot use the keys. Validation, status and the records' JSON live here; reading and
//! writing the file is [`crate::keys::file`], changing records is [`crate::keys::service`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::base::clock::parse_rfc3339;
use crate::keys::index::{index_hash, KeyIndex, KeyInfo, Overrides, Own};
use crate::keys::limits::{check_concurrency, Every, CONCURRENCY};
use crate::keys::plans::Plans;

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
    /// The key's own limits do not fit its plan (too many windows, an operation that could
    /// never pass).
    #[error("{0}")]
    OwnLimits(String),
    #[error("key `{0}` is revoked or expired: issue a new one instead")]
    NotActive(String),
    #[error("key registry: {0}")]
    Registry(String),
    /// This writer cannot sign, and the fleet verifies: a change it made would be refused by
    /// every node, so it makes none.
    #[error("key registry: this node cannot change keys: {0}")]
    CannotSign(String),
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
    /// This key's own limits of windows by length as a plan writes it (`1s`, `month`): a length
    /// its plan has takes this limit, a length it lacks is added for this key.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, u64>,
    /// This key's own concurrency, in place of its plan's: the most of its requests (or of its
    /// customer's keys' together) in flight at once. A field of its own, not a window: nodes
    /// that predate it refuse such a record rather than ignore the limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u64>,
    /// The customer this key belongs to: keys of one customer share every window's count and
    /// every ban, each held to the limits of its own plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub customer: Option<String>,
    /// The key whose quota (counts and bans) this one shares: set on a rotation's successor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota_of: Option<String>,
    /// The successor this key was rotated to; it stops at its `expires_at`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotated_to: Option<String>,
    /// Grows by one with every change the registry records (0: a record from before versions,
    /// or of a keys file). A node never takes a lower version of a record than it holds, so a
    /// replayed old record (before its revocation, say) is refused.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub version: u64,
    /// `ed25519:<base64>` by the fleet's signing key over everything else in the record
    /// ([`crate::keys::signing`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
}

/// A record for the tests of the modules that read records.
#[cfg(test)]
pub(crate) fn sample_record(version: u64) -> KeyRecord {
    KeyRecord {
        id: "key_1".into(),
        name: Some("acme".into()),
        plan: "free".into(),
        sha256: "ab".repeat(32),
        created_at: "2026-01-01T00:00:00Z".into(),
        revoked_at: None,
        expires_at: None,
        per_minute: None,
        per_day: None,
        limits: BTreeMap::new(),
        concurrency: None,
        customer: None,
        quota_of: None,
        rotated_to: None,
        version,
        signature: None,
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeysFile {
    /// In a node's snapshot of the registry: the registry's identity, so the node knows a
    /// registry that lost its data (no identity) from another registry (another identity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry: Option<String>,
    #[serde(default, rename = "key")]
    pub keys: Vec<KeyRecord>,
}

impl KeyRecord {
    /// The per-key settings, as checked on load (invalid ones never get this far).
    pub fn overrides(&self) -> Overrides {
        let small = |n: Option<u64>| {
            n.and_then(|n| u32::try_from(n).ok())
                .and_then(NonZeroU32::new)
        };
        let windows: Vec<(Every, u32)> = own_windows(self.per_minute, self.per_day, &self.limits)
            .filter_map(|(every, n)| Some((every, small(Some(n))?.get())))
            .collect();
        let concurrency = small(self.concurrency);
        let own = (!windows.is_empty() || concurrency.is_some()).then(|| {
            Arc::new(Own {
                windows,
                concurrency,
            })
        });
        Overrides {
            own,
            expires_at: small(self.expires_at.as_deref().and_then(parse_rfc3339)),
        }
    }
}

impl KeyRecord {
    /// The quota this key's counts and bans are kept under when it is not its own id: its
    /// customer's (`customer:<name>`, which no key id can be), else the key it was rotated from.
    pub fn shared_quota(&self) -> Option<String> {
        match (&self.customer, &self.quota_of) {
            (Some(customer), _) => {
                Some(format!("{}{customer}", crate::keys::index::CUSTOMER_QUOTA))
            }
            (None, quota_of) => quota_of.clone(),
        }
    }
}

/// A key's own limits by window length: the `--per-minute`/`--per-day` shorthands, then its
/// `limits` (lengths that do not parse are left out: records are checked on load).
pub fn own_windows<'a>(
    per_minute: Option<u64>,
    per_day: Option<u64>,
    limits: &'a BTreeMap<String, u64>,
) -> impl Iterator<Item = (Every, u64)> + 'a {
    let shorthands = [(Every::MINUTE, per_minute), (Every::DAY, per_day)];
    let windows = limits
        .iter()
        .filter_map(|(every, &n)| Some((Every::parse(every).ok()?, n)));
    shorthands
        .into_iter()
        .filter_map(|(every, n)| Some((every, n?)))
        .chain(windows)
}

/// Whether `name` may name a customer: 1 to 64 letters, digits, `-`, `_` or `.` (it becomes part
/// of a Redis key and of log lines).
pub fn valid_customer(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// A key's own windows (`limits`), checked: known lengths, limits that fit, at most
/// [`crate::keys::limits::MAX_WINDOWS`]. `what` names the field or flag in the error.
pub fn check_own_limits(limits: &BTreeMap<String, u64>, what: &str) -> Result<(), String> {
    if limits.len() > crate::keys::limits::MAX_WINDOWS {
        return Err(format!(
            "{what}: {} windows, at most {} are allowed",
            limits.len(),
            crate::keys::limits::MAX_WINDOWS
        ));
    }
    for (every, &n) in limits {
        Every::parse(every).map_err(|e| format!("{what}: {e}"))?;
        if n == 0 || n > u64::from(u32::MAX) {
            return Err(format!(
                "{what}: the limit of `{every}` must be a whole number from 1 to {}",
                u32::MAX
            ));
        }
    }
    Ok(())
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

impl KeysFile {
    pub(crate) fn validate(&self, path: &Path) -> Result<(), KeysError> {
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
            if k.customer.as_deref().is_some_and(|c| !valid_customer(c)) {
                return Err(invalid(format!(
                    "{at}: field `customer` must be 1 to 64 letters, digits, `-`, `_` or `.`"
                )));
            }
            check_own_limits(&k.limits, "field `limits`")
                .map_err(|e| invalid(format!("{at}: {e}")))?;
            if let Some(n) = k.concurrency {
                check_concurrency(n)
                    .map_err(|e| invalid(format!("{at}: field `concurrency`: {e}")))?;
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
        let now = crate::base::clock::unix_now();
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

    pub(crate) fn get_mut(&mut self, id: &str) -> Result<&mut KeyRecord, KeysError> {
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
                        quota: k.shared_quota().map(Arc::from),
                    },
                ))
            })
    }
}

/// What `keys issue` may set beyond the plan.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyRecordOptions {
    /// Unix seconds.
    pub expires_at: Option<u64>,
    pub per_minute: Option<u64>,
    pub per_day: Option<u64>,
    /// Own limits by window length as a plan writes it (`1s`, `month`).
    pub limits: BTreeMap<String, u64>,
    /// Own concurrency (`--limit concurrency=N`).
    pub concurrency: Option<u64>,
    pub customer: Option<String>,
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
        let now = crate::base::clock::unix_now();
        let expires_at = match (expires_in, expires_at) {
            (Some(d), _) => Some(now.saturating_add(
                crate::base::clock::parse_duration(d).map_err(|e| format!("--expires-in: {e}"))?,
            )),
            (None, Some(t)) => Some(crate::base::clock::parse_rfc3339(t).ok_or_else(|| {
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
            ..KeyRecordOptions::default()
        })
    }

    /// With the key's own windows (`--limit EVERY=N`, or the admin API's `limits`), its own
    /// concurrency (`concurrency=N` among them) and its customer, checked; `flag` names where
    /// the limits came from in an error.
    pub fn with(
        mut self,
        mut limits: BTreeMap<String, u64>,
        customer: Option<String>,
        flag: &str,
    ) -> Result<KeyRecordOptions, String> {
        if let Some(n) = limits.remove(CONCURRENCY) {
            check_concurrency(n).map_err(|e| format!("{flag} {CONCURRENCY}: {e}"))?;
            self.concurrency = Some(n);
        }
        // One spelling per length (`60s` is `1m`), so a length cannot be given twice.
        let mut canonical = BTreeMap::new();
        for (every, n) in limits {
            let spec = Every::parse(&every)
                .map_err(|e| format!("{flag}: {e}"))?
                .spec();
            if canonical.insert(spec.clone(), n).is_some() {
                return Err(format!("{flag}: the window `{spec}` is given twice"));
            }
        }
        check_own_limits(&canonical, flag)?;
        if let Some(c) = customer.as_deref().filter(|c| !valid_customer(c)) {
            return Err(format!(
                "customer: `{c}` must be 1 to 64 letters, digits, `-`, `_` or `.`"
            ));
        }
        self.limits = canonical;
        self.customer = customer;
        Ok(self)
    }
}

/// A key to issue, as `keys issue`'s flags and the admin API's `POST /keys` body both give it:
/// one set of fields, so the two doors cannot drift apart.
#[derive(Debug, Clone, Deserialize, clap::Args)]
#[serde(deny_unknown_fields)]
pub struct NewKey {
    /// Plan of the key: the name of a file in the plans directory.
    #[arg(long)]
    pub plan: String,
    /// A label for people (customer, purpose).
    #[arg(long)]
    pub name: Option<String>,
    /// The key stops working this long from now: a number with `s`, `m`, `h` or `d` (`90d`).
    #[arg(long, value_name = "DURATION", conflicts_with = "expires_at")]
    pub expires_in: Option<String>,
    /// The key stops working at this RFC 3339 time (`2027-01-31T00:00:00Z`).
    #[arg(long, value_name = "RFC3339")]
    pub expires_at: Option<String>,
    /// This key's requests per minute, in place of its plan's.
    #[arg(long, value_name = "N")]
    pub per_minute: Option<u64>,
    /// This key's requests per day, in place of its plan's.
    #[arg(long, value_name = "N")]
    pub per_day: Option<u64>,
    /// This key's own limit of a window, `EVERY=N` (`1s=50`, `month=1000000`; repeat the flag
    /// for more): a length its plan has takes this limit, a length it lacks is added;
    /// `concurrency=N`: at most N of its requests in flight at once, in place of its plan's.
    #[arg(long = "limit", value_name = "EVERY=N")]
    #[serde(skip)]
    pub limit: Vec<String>,
    /// The admin API's form of `--limit`: `{"1s": 50, "month": 1000000, "concurrency": 8}`.
    #[arg(skip)]
    #[serde(default)]
    pub limits: BTreeMap<String, u64>,
    /// The customer the key belongs to: keys of one customer share every window's count and
    /// every ban (1 to 64 letters, digits, `-`, `_` or `.`).
    #[arg(long)]
    pub customer: Option<String>,
}

impl NewKey {
    /// The key's own settings, checked.
    pub fn options(&self) -> Result<KeyRecordOptions, String> {
        if self.expires_in.is_some() && self.expires_at.is_some() {
            // clap refuses the pair of flags first; a JSON body can still hold both.
            return Err("give expires_in or expires_at, not both".to_owned());
        }
        let mut limits = self.limits.clone();
        for given in &self.limit {
            let (every, n) = given
                .split_once('=')
                .ok_or_else(|| format!("--limit {given}: write EVERY=N, such as 1s=50"))?;
            let n = n
                .trim()
                .parse::<u64>()
                .map_err(|_| format!("--limit {given}: N must be a whole number"))?;
            if limits.insert(every.trim().to_owned(), n).is_some() {
                return Err(format!(
                    "--limit {given}: the window `{every}` is given twice"
                ));
            }
        }
        let flag = if self.limit.is_empty() {
            "limits"
        } else {
            "--limit"
        };
        KeyRecordOptions::checked(
            self.expires_in.as_deref(),
            self.expires_at.as_deref(),
            self.per_minute,
            self.per_day,
        )?
        .with(limits, self.customer.clone(), flag)
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
            "limits": self.limits,
            "concurrency": self.concurrency,
            "customer": self.customer,
            "quota_of": self.quota_of,
            "rotated_to": self.rotated_to,
        })
    }
}
