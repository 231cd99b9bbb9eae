//! What a region's Redis holds from the global store (issue 48, `quota::regions`): units,
//! adding what the global store granted (`HOLD`) and taking back what a quota whose traffic left
//! the region did not spend (`GIVE`), beside the quota's state (`scripts::regional_lua`); and
//! bans started in other regions (`IMPORT_BAN`, from `ban_feed`).

use super::acquire::{number, pack};
use super::ledger::check_len;
use std::sync::Arc;

use super::RedisStore;
use crate::quota::store::StoreError;

/// One instance's part of a `HOLD`: the window's length code and instance, the units granted,
/// and until when (Unix seconds; 0: not) the global store is known to have none left of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub code: u32,
    pub index: u64,
    pub units: u64,
    pub none_left_until: u64,
}

/// `numbers` as the scripts unpack them (`acquire::pack`).
fn packed(numbers: impl IntoIterator<Item = u64>) -> Vec<u8> {
    let mut out = Vec::new();
    pack(&mut out, numbers.into_iter().map(number));
    out
}

impl RedisStore {
    /// Adds `grants` to what the region holds of `quota_id`'s instances; the units held of each
    /// after it. Sent once, never again on a failure: run twice, it would hold units the global
    /// store granted once (a `HOLD` lost leaves them unspent: under-admission, never over).
    pub async fn hold(&self, quota_id: &str, grants: &[Held]) -> Result<Vec<u64>, StoreError> {
        let args = packed(
            grants
                .iter()
                .flat_map(|g| [u64::from(g.code), g.index, g.units, g.none_left_until]),
        );
        let mut invocation = self.hold.key(self.redis_key(quota_id));
        invocation.arg(args);
        check_len(self.link.run(&invocation).await?, grants.len())
    }

    /// Takes back what the region holds and has not spent of `quota_id`'s current and next
    /// instances of each window (`windows`: its length code, and the fewest spare units worth
    /// taking), by the region's Redis clock, when none of its requests was admitted in the
    /// region for `idle_secs`: `None` while one was, else each instance's units taken (length
    /// code, instance, units), to give back to the global store.
    pub async fn give(
        &self,
        quota_id: &str,
        idle_secs: u64,
        windows: &[(u32, u64)],
    ) -> Result<Option<Vec<(u32, u64, u64)>>, StoreError> {
        let args = packed(windows.iter().flat_map(|&(c, least)| [u64::from(c), least]));
        let mut invocation = self.give.key(self.redis_key(quota_id));
        invocation.arg(idle_secs).arg(args);
        let reply: Vec<u64> = self.link.run(&invocation).await?;
        let bad = || StoreError::Protocol(format!("a give-back answered {reply:?}"));
        let (&idle, rest) = reply.split_first().ok_or_else(bad)?;
        if rest.len() % 3 != 0 {
            return Err(bad());
        }
        if idle == 0 {
            return Ok(None);
        }
        let taken = rest
            .chunks(3)
            .map(|t| (u32::try_from(t[0]).unwrap_or(u32::MAX), t[1], t[2]))
            .collect();
        Ok(Some(taken))
    }

    /// Bans `quota_id` in this region until `until` (Unix seconds), a ban another region
    /// started: a later end than the region's own wins, and the region's ban index lists it.
    /// Whether the ban's end moved.
    pub async fn import_ban(&self, quota_id: &str, until: u64) -> Result<bool, StoreError> {
        let moved: i64 = self.invoke(&self.import_ban, quota_id, &[until]).await?;
        if moved == 1 {
            self.index_ban_now(&Arc::from(quota_id), until).await;
        }
        Ok(moved == 1)
    }

    /// Lifts `quota_id`'s ban here, a ban lifted in another region that ended at `until`,
    /// unless the region's ends later (`LIFT_BAN`'s bound); whether one was lifted.
    pub async fn lift_imported(&self, quota_id: &str, until: u64) -> Result<bool, StoreError> {
        let lifted: i64 = self.invoke(&self.lift_ban, quota_id, &[until]).await?;
        if lifted == 1 {
            self.index_ban_now(&Arc::from(quota_id), 0).await;
        }
        Ok(lifted == 1)
    }
}
