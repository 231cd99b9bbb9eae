//! `GET /bans` and `POST /bans/{key id}/lift`: the active bans of the keys in force, and ending
//! one now (on this node's ban cache at once, in the store for every node).

use http::Response;
use serde::{Deserialize, Serialize};

use super::reply::{error, json_response};
use super::Admin;
use crate::base::clock::rfc3339;
use crate::http::responses::ErrorCode;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BanEntry {
    pub key_id: String,
    pub plan: String,
    /// Unix seconds.
    pub until: u64,
    pub until_utc: String,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Bans {
    pub bans: Vec<BanEntry>,
}

impl Admin {
    pub(super) async fn list_bans(&self) -> Response<Vec<u8>> {
        match self.bans().await {
            Ok(bans) => json_response(200, serde_json::to_vec(&bans).unwrap_or_default()),
            Err(e) => error(503, ErrorCode::Internal, &format!("quota store: {e}")),
        }
    }

    pub(super) async fn lift_ban(&self, id: &str) -> Response<Vec<u8>> {
        // The ban is the quota's: a rotated key's successor names its first key's.
        let quota: String = self
            .catalog
            .snapshot()
            .keys
            .by_id(id)
            .map_or(id.to_owned(), |k| k.quota_id().to_string());
        self.ban_cache.forget(&quota);
        match self.store.lift_ban(&quota).await {
            Ok(lifted) => json_response(
                200,
                serde_json::json!({ "key_id": id, "lifted": lifted })
                    .to_string()
                    .into_bytes(),
            ),
            Err(e) => error(503, ErrorCode::Internal, &format!("quota store: {e}")),
        }
    }

    /// One store call, whatever the number of keys; the plans come from the keys in force (a
    /// ban of a key no longer in the keys file is not listed).
    pub(super) async fn bans(&self) -> Result<Bans, String> {
        let active = self.store.bans().await.map_err(|e| e.to_string())?;
        if active.is_empty() {
            return Ok(Bans { bans: Vec::new() });
        }
        let snapshot = std::sync::Arc::clone(&*self.catalog.snapshot());
        // A pass over every key in force: off the admin listener's one thread, which also
        // answers the probes.
        tokio::task::spawn_blocking(move || {
            let wanted: std::collections::HashMap<&str, u64> = active
                .iter()
                .map(|b| (b.key_id.as_str(), b.until))
                .collect();
            let mut bans: Vec<BanEntry> = snapshot
                .keys
                .keys()
                .filter_map(|k| {
                    // Bans are kept under the quota's id (a rotated key's successor shares it).
                    wanted.get(&**k.quota_id()).map(|&until| BanEntry {
                        key_id: k.id.to_string(),
                        plan: k.plan.to_string(),
                        until,
                        until_utc: rfc3339(until),
                    })
                })
                .collect();
            bans.sort_by(|a, b| a.key_id.cmp(&b.key_id));
            Bans { bans }
        })
        .await
        .map_err(|e| e.to_string())
    }
}
