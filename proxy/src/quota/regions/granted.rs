//! What a region's node says of the global store's grants (`GET /v1/rate_limit`): the region's
//! own counts are exact and local; the units granted to every region together are read from the
//! global store with the region's figures, and when it does not answer (a region cut off), the
//! last figures this node read are shown with when they were read (`as_of`), or none (at once
//! while the node finds the global store away). A read costs one round trip to the global
//! store; the endpoint's own limit (one a second a key, on each node) bounds them.

use std::collections::HashMap;
use std::sync::Arc;

use super::{lock, RegionalStore};
use crate::base::clock::unix_now;
use crate::quota::store::redis::ledger::Instance;
use crate::quota::store::{GlobalUsage, Usage};

/// The most quotas whose last figures a node keeps (then it starts again).
const KEEP_AT_MOST: usize = 4_096;

/// The last figures this node read, by quota id.
pub type LastRead = HashMap<Arc<str>, GlobalUsage>;

impl RegionalStore {
    /// `usage`, the region's, with the global store's figures of the same windows.
    pub(super) async fn with_granted(&self, quota: &str, mut usage: Usage) -> Usage {
        let at: Vec<Instance> = usage
            .windows
            .iter()
            .map(|&(every, _)| Instance::at(every, usage.now))
            .collect();
        if at.is_empty() {
            return usage;
        }
        if self.away() {
            // Cut off: the last figures at once, not a deadline's wait for none.
            usage.global = lock(&self.last_granted).get(quota).cloned();
            return usage;
        }
        usage.global = match self.ledger.totals(quota, &self.region, &at).await {
            Ok(totals) => {
                let read = GlobalUsage {
                    as_of: unix_now(),
                    windows: at
                        .iter()
                        .zip(totals)
                        .map(|(i, (all, here))| (i.every, i.index, all, here))
                        .collect(),
                };
                let mut last = lock(&self.last_granted);
                if last.len() >= KEEP_AT_MOST {
                    last.clear();
                }
                last.insert(Arc::from(quota), read.clone());
                Some(read)
            }
            Err(e) => {
                tracing::debug!(error = %e, "could not read the global store's grants");
                lock(&self.last_granted).get(quota).cloned()
            }
        };
        usage
    }
}
