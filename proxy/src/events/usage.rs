//! Usage as the store decided it, counted in memory per quota holder, operation and minute:
//! the request path's only part of metering. Sharded, so that proxy threads rarely meet on a
//! lock, with a map per minute that the pump takes whole once the minute has ended.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use serde::Serialize;

use crate::keys::index::{customer_of, KeyInfo};

const SHARDS: usize = 16;

/// One key's use of one operation in one minute.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Slot {
    pub key_id: Arc<str>,
    /// The quota the key spends when not its own: `customer:<name>`, or a rotation's
    /// predecessor (shared, so the request path allocates nothing for it).
    pub quota: Option<Arc<str>>,
    pub plan: Arc<str>,
    pub operation: &'static str,
    /// Unix seconds at the minute's start, by the store's clock of the decision.
    pub minute: u64,
}

/// What one slot saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Requests the store admitted and counted.
    pub admitted: u64,
    /// Units those spent.
    pub cost: u64,
    /// Requests refused (over a limit, or banned).
    pub refused: u64,
}

/// `pet.usage.v1`'s data.
#[derive(Serialize)]
pub struct UsageData<'a> {
    pub key_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub customer: Option<&'a str>,
    pub plan: &'a str,
    pub operation: &'a str,
    pub minute: String,
    pub admitted: u64,
    pub cost: u64,
    pub refused: u64,
}

impl Slot {
    pub fn data(&self, c: Counts) -> UsageData<'_> {
        UsageData {
            key_id: &self.key_id,
            customer: self.quota.as_deref().and_then(customer_of),
            plan: &self.plan,
            operation: self.operation,
            minute: crate::base::clock::rfc3339(self.minute),
            admitted: c.admitted,
            cost: c.cost,
            refused: c.refused,
        }
    }
}

/// An event the request path reports whole (a ban the store started), for the pump to write.
pub struct Notice {
    pub kind: &'static str,
    /// Derived from what it is about (see [`super::cloud::line_with_id`]).
    pub id: String,
    /// Unix seconds, by the store's clock.
    pub time: u64,
    pub data: serde_json::Value,
}

/// A shard's slots, a map per minute (usually one or two): the pump takes a minute's map whole,
/// so the lock a request waits on is held for a move, never a pass over the slots.
type Minutes = Vec<(u64, HashMap<Slot, Counts>)>;

/// The counts of every slot not yet taken, and the notices not yet written.
pub struct Meter {
    notices: Mutex<Vec<Notice>>,
    hasher: std::hash::RandomState,
    shards: Vec<Mutex<Minutes>>,
    /// The latest store clock a decision came with: minutes are released by it, not by this
    /// node's clock, which may differ from the store's.
    store_now: AtomicU64,
}

impl Default for Meter {
    fn default() -> Meter {
        Meter {
            notices: Mutex::new(Vec::new()),
            hasher: std::hash::RandomState::new(),
            shards: (0..SHARDS).map(|_| Mutex::new(Vec::new())).collect(),
            store_now: AtomicU64::new(0),
        }
    }
}

impl Meter {
    /// Counts one decision about `key` at `now` (the store's clock): admitted spending `cost`,
    /// or refused.
    pub fn record(
        &self,
        key: &KeyInfo,
        operation: &'static str,
        now: u64,
        admitted: bool,
        cost: u64,
    ) {
        let slot = Slot {
            key_id: Arc::clone(&key.id),
            quota: key.quota.clone(),
            plan: Arc::clone(&key.plan),
            operation,
            minute: now - now % 60,
        };
        // Read first: the clock moves once a second, and a write on every request would pull
        // this cache line from thread to thread.
        if now > self.store_now.load(Ordering::Relaxed) {
            self.store_now.fetch_max(now, Ordering::Relaxed);
        }
        // By key id: one key's slots stay on one shard.
        let shard = self.hasher.hash_one(&slot.key_id) as usize % SHARDS;
        let mut minutes = self.shards[shard]
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let at = match minutes.iter().position(|(m, _)| *m == slot.minute) {
            Some(at) => at,
            None => {
                // A new minute is sized like the one before, so a busy minute does not grow by
                // rehashing; a late decision of an older one (taken already) starts small.
                let newest = minutes.iter().all(|(m, _)| *m < slot.minute);
                let size = match minutes.iter().map(|(_, m)| m.len()).max() {
                    Some(size) if newest => size,
                    _ => 0,
                };
                minutes.push((slot.minute, HashMap::with_capacity(size)));
                minutes.len() - 1
            }
        };
        let c = minutes[at].1.entry(slot).or_default();
        if admitted {
            c.admitted += 1;
            c.cost += cost;
        } else {
            c.refused += 1;
        }
    }

    /// Reports `notice` (rare: not on every request).
    pub fn notify(&self, notice: Notice) {
        self.notices
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(notice);
    }

    /// The notices reported since the last call.
    pub fn take_notices(&self) -> Vec<Notice> {
        std::mem::take(&mut *self.notices.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The latest store clock seen (0 before the first decision).
    pub fn store_now(&self) -> u64 {
        self.store_now.load(Ordering::Relaxed)
    }

    /// Takes the slots of minutes that started before `before` (all of them with `u64::MAX`).
    pub fn take_before(&self, before: u64) -> Vec<(Slot, Counts)> {
        let mut out = Vec::new();
        for shard in &self.shards {
            let ended: Minutes = {
                let mut minutes = shard.lock().unwrap_or_else(PoisonError::into_inner);
                if minutes.iter().all(|(m, _)| *m >= before) {
                    continue;
                }
                let (ended, open) = std::mem::take(&mut *minutes)
                    .into_iter()
                    .partition(|(m, _)| *m < before);
                *minutes = open;
                ended
            };
            // The slots are read with the lock released.
            for (_, map) in ended {
                out.extend(map);
            }
        }
        // The file reads in the order of the minutes.
        out.sort_by_key(|(slot, _)| slot.minute);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(m: &Meter, key: &str, quota: Option<&str>, now: u64, admitted: bool, cost: u64) {
        let key = KeyInfo {
            id: Arc::from(key),
            plan: Arc::from("pro"),
            overrides: Default::default(),
            quota: quota.map(Arc::from),
        };
        m.record(&key, "listPets", now, admitted, cost);
    }

    #[test]
    fn decisions_add_up_per_key_operation_and_minute() {
        let m = Meter::default();
        record(&m, "k1", None, 120, true, 1);
        record(&m, "k1", None, 179, true, 3);
        record(&m, "k1", None, 150, false, 3);
        record(&m, "k1", None, 180, true, 1);
        record(&m, "k2", Some("customer:acme"), 130, true, 2);
        let mut ended = m.take_before(180);
        ended.sort_by(|a, b| a.0.key_id.cmp(&b.0.key_id));
        assert_eq!(ended.len(), 2);
        assert_eq!(ended[0].0.minute, 120);
        assert_eq!(
            ended[0].1,
            Counts {
                admitted: 2,
                cost: 4,
                refused: 1
            }
        );
        assert_eq!(ended[1].0.data(ended[1].1).customer, Some("acme"));
        assert_eq!(m.store_now(), 180);
        assert_eq!(ended[1].1.cost, 2);
        assert!(m.take_before(180).is_empty(), "taken once");
        let rest = m.take_before(u64::MAX);
        assert_eq!(rest.len(), 1);
        assert_eq!((rest[0].0.minute, rest[0].1.admitted), (180, 1));
    }

    #[test]
    fn usage_data_names_the_minute_and_leaves_out_a_missing_customer() {
        let m = Meter::default();
        record(&m, "k1", Some("k0"), 1_795_000_030, true, 1);
        let (slot, counts) = m.take_before(u64::MAX).pop().unwrap();
        let v = serde_json::to_value(slot.data(counts)).unwrap();
        assert_eq!(v["minute"], "2026-11-18T11:07:00Z");
        assert!(
            v.get("customer").is_none(),
            "a rotation's quota is no customer"
        );
        assert_eq!(
            (v["admitted"].clone(), v["refused"].clone()),
            (1.into(), 0.into())
        );
    }
}
