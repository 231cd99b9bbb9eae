//! `GET /key-search?q=&status=&plan=&id=&customer=&page=&per_page=`: one page of key records,
//! found by id, name or customer (`q`, any part, any case) and filtered by status, plan, exact
//! id and exact customer, each active one with its usage: what the console's keys page shows,
//! in one admin call.
//!
//! The records are read once per version of the keys in force (the catalog's index changing
//! is what says they changed) and kept, so a console polling every few seconds filters them in
//! memory rather than reading the keys file (or the registry) again; the page's usage is one
//! store read per active key shown, at most `per_page`. Reading them again after a change takes
//! seconds at a million keys (bench/RESULTS.md): a search waits for it up to [`FRESH_WAIT`],
//! then answers from the records it had, saying so (`"stale": true`), while the read goes on
//! in the background; one read at a time.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use tokio::sync::watch;

use http::Response;

use super::keys::usage_json;
use super::reply::{error, json_response};
use super::Admin;
use crate::base::clock::unix_now;
use crate::http::responses::ErrorCode;
use crate::keys::catalog::Snapshot;
use crate::keys::index::{KeyIndex, KeyInfo};
use crate::keys::limits::Limits;
use crate::keys::record::{KeyRecord, KeysFile};
use crate::quota::store::StoreError;

const PER_PAGE: usize = 25;
const MAX_PER_PAGE: usize = 100;

/// How long a search waits for the records of the keys now in force before it answers from
/// older ones.
const FRESH_WAIT: Duration = Duration::from_millis(500);
/// How long the first search waits for the records (none are kept yet) before its 503.
const FIRST_WAIT: Duration = Duration::from_secs(30);

/// The records as last read, and the read under way, each with the catalog's index they are
/// of (held weakly: the index's allocation then cannot be reused by a newer one while it is
/// remembered, so an address never stands for two versions).
#[derive(Default)]
pub struct Records(Arc<Mutex<RecordsState>>);

type Read = Option<Result<Arc<KeysFile>, String>>;

#[derive(Default)]
struct RecordsState {
    read: Option<(Weak<KeyIndex>, Arc<KeysFile>)>,
    reading: Option<(Weak<KeyIndex>, watch::Receiver<Read>)>,
}

/// What a search asks.
#[derive(Debug, PartialEq, Eq)]
struct Ask {
    q: String,
    /// Exactly this id (the console's key page), or exactly this customer's keys.
    id: Option<String>,
    customer: Option<String>,
    status: Option<String>,
    plan: Option<String>,
    page: usize,
    per_page: usize,
}

fn parse(query: Option<&str>) -> Result<Ask, String> {
    let mut ask = Ask {
        q: String::new(),
        id: None,
        customer: None,
        status: None,
        plan: None,
        page: 1,
        per_page: PER_PAGE,
    };
    for (k, v) in form_pairs(query.unwrap_or_default()) {
        match k.as_str() {
            "q" => ask.q = v.to_lowercase(),
            "id" if !v.is_empty() => ask.id = Some(v),
            "customer" if !v.is_empty() => ask.customer = Some(v),
            "status" if !v.is_empty() => ask.status = Some(v),
            "plan" if !v.is_empty() => ask.plan = Some(v),
            "id" | "customer" | "status" | "plan" => {}
            "page" => {
                ask.page = v
                    .parse()
                    .ok()
                    .filter(|p| *p >= 1)
                    .ok_or("`page` must be a whole number from 1")?
            }
            "per_page" => {
                ask.per_page = v
                    .parse()
                    .ok()
                    .filter(|p| (1..=MAX_PER_PAGE).contains(p))
                    .ok_or(format!("`per_page` must be from 1 to {MAX_PER_PAGE}"))?
            }
            other => return Err(format!("unknown parameter `{other}`")),
        }
    }
    Ok(ask)
}

/// One page of what a search found.
struct Page {
    page: usize,
    per_page: usize,
    records: Vec<(KeyRecord, String)>,
}

/// How many records match `ask`, and its page of them with their status. Status is worked out
/// only where it is asked for or shown, so a pass over a million records allocates nothing
/// per record.
fn find(file: &KeysFile, ask: &Ask, banned: &HashMap<String, String>) -> (usize, Page) {
    let now = unix_now();
    let status_of = |k: &KeyRecord| k.status(banned.get(&k.id).map(String::as_str), now);
    let matches = |k: &&KeyRecord| {
        ask.plan.as_deref().is_none_or(|p| k.plan == p)
            && ask.id.as_deref().is_none_or(|id| k.id == id)
            && ask
                .customer
                .as_deref()
                .is_none_or(|c| k.customer.as_deref() == Some(c))
            && (ask.q.is_empty()
                || contains(&k.id, &ask.q)
                || k.name.as_deref().is_some_and(|n| contains(n, &ask.q))
                || k.customer.as_deref().is_some_and(|c| contains(c, &ask.q)))
            && ask
                .status
                .as_deref()
                .is_none_or(|want| status_word(&status_of(k)) == want)
    };
    let skip = (ask.page - 1).saturating_mul(ask.per_page);
    let mut total = 0;
    let mut records = Vec::new();
    for k in file.keys.iter().filter(matches) {
        if total >= skip && records.len() < ask.per_page {
            records.push((k.clone(), status_of(k)));
        }
        total += 1;
    }
    (
        total,
        Page {
            page: ask.page,
            per_page: ask.per_page,
            records,
        },
    )
}

/// A status's first word, what `status=` matches: `banned until …` is `banned`, `active until
/// …` `active`, `rotated until …` `rotated`.
fn status_word(status: &str) -> &str {
    status.split(' ').next().unwrap_or(status)
}

/// The page's keys that are in force and not expired, with their limits.
fn active_keys(snapshot: &Snapshot, page: &Page) -> HashMap<String, (KeyInfo, Option<Limits>)> {
    let ids: HashSet<&str> = page.records.iter().map(|(r, _)| r.id.as_str()).collect();
    let now = unix_now();
    snapshot
        .keys
        .by_ids(&ids)
        .into_values()
        .filter_map(|key| Some((key.id.to_string(), snapshot.accepted(key, now)?)))
        .collect()
}

/// Whether `hay` holds `needle` (already lowercase), in any case; without allocating for
/// ASCII text, as ids and most names are.
fn contains(hay: &str, needle: &str) -> bool {
    if hay.is_ascii() && needle.is_ascii() {
        let (h, n) = (hay.as_bytes(), needle.as_bytes());
        n.is_empty() || h.windows(n.len()).any(|w| w.eq_ignore_ascii_case(n))
    } else {
        hay.to_lowercase().contains(needle)
    }
}

/// `a=b&c=d`, percent-decoded (`+` is a space).
fn form_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

fn decode(text: &str) -> String {
    let hex = |b: u8| (b as char).to_digit(16);
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match (
            bytes[i],
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) {
            (b'+', _, _) => out.push(b' '),
            (b'%', Some(hi), Some(lo)) => {
                out.push((hi * 16 + lo) as u8);
                i += 2;
            }
            (b, _, _) => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl Admin {
    /// The records in force (and whether they are older than the keys in force), read again
    /// only when the keys changed.
    async fn records(&self) -> Result<(Arc<KeysFile>, bool), String> {
        let index = Arc::downgrade(&self.catalog.snapshot().keys);
        let (older, mut rx, of_these) = {
            let mut state = self
                .records
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if let Some((seen, file)) = &state.read {
                if Weak::ptr_eq(seen, &index) {
                    return Ok((Arc::clone(file), false));
                }
            }
            let older = state.read.as_ref().map(|(_, f)| Arc::clone(f));
            let (rx, of_these) = self.read_under_way(&mut state, index);
            (older, rx, of_these)
        };
        let done = async {
            rx.wait_for(Option::is_some)
                .await
                .ok()
                .and_then(|v| v.clone())
        };
        // With nothing read yet there is nothing else to answer with: wait longer, not for ever
        // (a keys file on a disk that hangs).
        let wait = if older.is_some() {
            FRESH_WAIT
        } else {
            FIRST_WAIT
        };
        let finished = tokio::time::timeout(wait, done).await.ok().flatten();
        match (finished, older) {
            // Read: of the keys in force, or else said to be old (the next call reads again).
            (Some(Ok(file)), _) => Ok((file, !of_these)),
            // Slow or failed: the records there are, said to be old.
            (_, Some(older)) => Ok((older, true)),
            (Some(Err(e)), None) => Err(e),
            (None, None) => Err(format!(
                "the key records could not be read within {FIRST_WAIT:?}; the read goes on"
            )),
        }
    }

    /// Starts reading the records in the background if they are not those in force, without
    /// waiting: the console's first page asks, so its keys page rarely waits at all.
    pub(super) fn warm_records(&self) {
        let index = Arc::downgrade(&self.catalog.snapshot().keys);
        let mut state = self
            .records
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let fresh = state
            .read
            .as_ref()
            .is_some_and(|(seen, _)| Weak::ptr_eq(seen, &index));
        if !fresh {
            self.read_under_way(&mut state, index);
        }
    }

    /// The read under way, or a new one of `index`, and whether it is of `index`: one read at
    /// a time, however often the keys change while it runs (when it ends, the next call reads
    /// the newest).
    fn read_under_way(
        &self,
        state: &mut RecordsState,
        index: Weak<KeyIndex>,
    ) -> (watch::Receiver<Read>, bool) {
        if let Some((of, rx)) = &state.reading {
            // A read whose task is gone (its runtime stopping) is no read.
            if rx.has_changed().is_ok() {
                return (rx.clone(), Weak::ptr_eq(of, &index));
            }
        }
        let rx = self.read_records(index.clone());
        state.reading = Some((index, rx.clone()));
        (rx, true)
    }

    /// Reads the records in the background, keeping them when read.
    fn read_records(&self, index: Weak<KeyIndex>) -> watch::Receiver<Read> {
        let (tx, rx) = watch::channel(None);
        let keys = self.keys.clone();
        let state = Arc::clone(&self.records.0);
        tokio::spawn(async move {
            let read = tokio::task::spawn_blocking(move || keys.list())
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r.map_err(|e| e.to_string()))
                .map(Arc::new);
            {
                // One read at a time, so this is the newest read: it replaces what was read.
                let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
                if let Ok(file) = &read {
                    state.read = Some((index, Arc::clone(file)));
                }
                state.reading = None;
            }
            let _ = tx.send(Some(read));
        });
        rx
    }

    pub(super) async fn key_search(&self, query: Option<&str>) -> Response<Vec<u8>> {
        let ask = match parse(query) {
            Ok(a) => a,
            Err(why) => return error(400, ErrorCode::InvalidRequest, &why),
        };
        let (file, stale) = match self.records().await {
            Ok(f) => f,
            Err(e) => return error(503, ErrorCode::Internal, &e),
        };
        let bans = self.bans().await.ok();
        let known = bans.is_some();
        let banned: HashMap<String, String> = bans
            .map(|b| {
                b.bans
                    .into_iter()
                    .map(|b| (b.key_id, b.until_utc))
                    .collect()
            })
            .unwrap_or_default();
        // The passes over every record and every key in force run off the admin listener's
        // thread, which also answers the probes.
        let snapshot = Arc::clone(&*self.catalog.snapshot());
        let found = tokio::task::spawn_blocking(move || {
            let (total, page) = find(&file, &ask, &banned);
            let active = active_keys(&snapshot, &page);
            (total, page, active)
        });
        let (total, page, mut active) = match found.await {
            Ok(found) => found,
            Err(e) => return error(500, ErrorCode::Internal, &e.to_string()),
        };
        let mut keys = Vec::new();
        // After the store timed out or could not be reached, it is not asked again for this
        // page: a store that is away costs a search one deadline, not one per key shown.
        let mut away: Option<String> = None;
        for (record, status) in page.records {
            let mut entry = record.to_json(&status, known);
            if let Some((key, limits)) = active.remove(&record.id) {
                let read = match &away {
                    Some(e) => Err(e.clone()),
                    None => self.store.usage(key.quota_id()).await.map_err(|e| {
                        let text = e.to_string();
                        if matches!(
                            e,
                            StoreError::Timeout(_)
                                | StoreError::Unavailable(_)
                                | StoreError::Refused(_)
                        ) {
                            away = Some(text.clone());
                        }
                        text
                    }),
                };
                entry["usage"] = match read {
                    Ok(u) => usage_json(&u, limits.as_ref()),
                    Err(e) => serde_json::json!({ "error": e }),
                };
            }
            keys.push(entry);
        }
        let body = serde_json::json!({
            "stale": stale,
            "total": total,
            "page": page.page,
            "per_page": page.per_page,
            "keys": keys,
        });
        json_response(200, body.to_string().into_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asks_are_read_and_bad_ones_refused() {
        let a = parse(Some("q=Acme%20Corp&status=active&plan=&page=2&per_page=50")).unwrap();
        assert_eq!(a.q, "acme corp");
        assert_eq!(a.status.as_deref(), Some("active"));
        assert_eq!(a.plan, None);
        assert_eq!((a.page, a.per_page), (2, 50));
        let exact = parse(Some("id=k_A%2B1&customer=Acme")).unwrap();
        assert_eq!(exact.id.as_deref(), Some("k_A+1"));
        assert_eq!(exact.customer.as_deref(), Some("Acme"));
        assert_eq!(parse(None).unwrap().per_page, PER_PAGE);
        assert!(parse(Some("page=0")).is_err());
        assert!(parse(Some("per_page=101")).is_err());
        assert!(parse(Some("sort=name")).is_err());
        assert_eq!(decode("%3Cimg%3E+x%"), "<img> x%");
        assert_eq!(status_word("banned until 2026-11-26T10:00:00Z"), "banned");
        assert_eq!(status_word("active"), "active");
        assert_eq!(decode("%é%4"), "%é%4", "no panic on a cut escape");
        assert!(
            contains("Key_ABC", "abc") && contains("Ünïcode Co", "ünï") && !contains("ab", "abc")
        );
    }
}
