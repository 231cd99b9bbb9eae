//! `pet.key.expiring.v1`: seven days and one day before a key expires (a rotation's
//! predecessor, or a key given an end by hand), so the customer can be told before requests
//! start failing with 401.
//!
//! Every node looks through the keys in force once a minute; the first node to claim the
//! notice in the store ([`QuotaStore::claim_once`], `SET NX` in Redis) reports it, so one event a
//! notice across the fleet. A node remembers what it already saw, so the store is asked once
//! per node and notice, not every minute. A store that fails is asked again a minute later.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::cloud::EXPIRING;
use super::usage::{Meter, Notice};
use crate::base::clock::{rfc3339, unix_now};
use crate::keys::catalog::Catalog;
use crate::keys::index::KeyInfo;
use crate::quota::store::QuotaStore;

const DAY: u64 = 86_400;
/// How often the keys are looked through.
pub const EVERY: Duration = Duration::from_secs(60);

/// The notices this node has seen settled (claimed here or elsewhere), until their key's end.
pub struct ExpiryWatch {
    settled: HashMap<String, u64>,
    /// Who this node is in its claims: its events' origin, unique to the process.
    claimant: String,
}

impl ExpiryWatch {
    /// One look through the keys in force at `now`.
    pub async fn round(
        &mut self,
        catalog: &Catalog,
        store: &dyn QuotaStore,
        meter: &Meter,
        now: u64,
    ) {
        self.settled.retain(|_, &mut until| until > now);
        let due: Vec<(KeyInfo, u64, u64)> = {
            let snapshot = catalog.snapshot();
            snapshot
                .keys
                .keys()
                .filter_map(|k| {
                    let at = u64::from(k.overrides.expires_at?.get());
                    Some((k.clone(), at, days_due(at, now)?))
                })
                .collect()
        };
        for (key, at, days) in due {
            let name = format!("expiring:{}:{days}:{at}", key.id);
            if self.settled.contains_key(&name) {
                continue;
            }
            match store.claim_once(&name, &self.claimant, at + DAY).await {
                Ok(first) => {
                    if first {
                        meter.notify(notice(&key, at, days, now));
                    }
                    self.settled.insert(name, at + DAY);
                }
                Err(e) => {
                    tracing::warn!(error = %e, key_id = %key.id, "cannot settle a key's expiry notice; trying again in a minute");
                    return;
                }
            }
        }
    }
}

/// Which notice is due for a key expiring at `at`: 1 in its last day; 7 from seven days
/// before to six (a day to catch up in, for a fleet that was down at the mark), so a key given
/// an end under six days away gets only the notice still ahead, never a "seven days" notice
/// that is not true; none before, between, or once it has expired.
fn days_due(at: u64, now: u64) -> Option<u64> {
    if now >= at {
        None
    } else if at - now <= DAY {
        Some(1)
    } else if at - now <= 7 * DAY && at - now > 6 * DAY {
        Some(7)
    } else {
        None
    }
}

fn notice(key: &KeyInfo, at: u64, days: u64, now: u64) -> Notice {
    Notice {
        kind: EXPIRING,
        id: format!("{EXPIRING}:{}:{days}d:{at}", key.id),
        time: now,
        data: serde_json::json!({
            "key_id": &*key.id,
            "customer": key.customer(),
            "plan": &*key.plan,
            "expires_at": rfc3339(at),
            "days_before": days,
        }),
    }
}

/// Runs [`ExpiryWatch::round`] now and every [`EVERY`] until `shutdown`.
pub async fn run(
    claimant: String,
    catalog: Arc<Catalog>,
    store: Arc<dyn QuotaStore>,
    meter: Arc<Meter>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let mut watch = ExpiryWatch {
        settled: HashMap::new(),
        claimant,
    };
    loop {
        watch.round(&catalog, &*store, &meter, unix_now()).await;
        tokio::select! {
            _ = tokio::time::sleep(EVERY) => {}
            _ = shutdown.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_due_its_seven_day_notice_then_its_one_day_notice() {
        let at = 1_795_000_000;
        assert_eq!(days_due(at, at - 8 * DAY), None);
        assert_eq!(days_due(at, at - 7 * DAY), Some(7));
        assert_eq!(days_due(at, at - 6 * DAY - 1), Some(7));
        assert_eq!(
            days_due(at, at - 6 * DAY),
            None,
            "past its day to catch up in"
        );
        assert_eq!(
            days_due(at, at - 3 * DAY),
            None,
            "not seven days: no such notice"
        );
        assert_eq!(days_due(at, at - DAY), Some(1));
        assert_eq!(days_due(at, at - 1), Some(1));
        assert_eq!(days_due(at, at), None);
    }
}
