//! The key endpoints: list, issue, show, reset usage, rotate and revoke. Changes go through the
//! key service (the same one the `keys` commands use), are audited as `admin`, and are in force
//! on this node when the answer goes out.

use std::sync::Arc;
use std::time::Duration;

use http::Response;
use serde::Deserialize;

use super::reply::{error, json_response};
use super::Admin;
use crate::base::clock::rfc3339;
use crate::http::responses::ErrorCode;
use crate::keys::index::KeyInfo;
use crate::keys::limits::{Every, Limits};
use crate::keys::record::{KeysError, NewKey};
use crate::keys::service::{Changed, KeyService};
use crate::quota::store::Usage;

/// `POST /keys/{id}/rotate`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RotateBody {
    overlap: Option<String>,
}

/// The most entries of a key's history answered.
const HISTORY_MAX: usize = 100;

impl Admin {
    /// `GET /keys`: every key of the keys file in force, with its status (never the key).
    /// `GET /keys/{id}/audit`: the key's changes, newest first (the fleet's, from the registry,
    /// or this node's audit log), as the audit lines they were.
    pub(super) async fn key_history(&self, id: String) -> Response<Vec<u8>> {
        let keys = self.keys.clone();
        let found = tokio::task::spawn_blocking(move || keys.history(&id, HISTORY_MAX)).await;
        match found {
            Ok(Ok(lines)) => {
                let entries: Vec<serde_json::Value> = lines
                    .iter()
                    .filter_map(|l| serde_json::from_str(l).ok())
                    .collect();
                let body = serde_json::json!({ "entries": entries });
                json_response(200, body.to_string().into_bytes())
            }
            Ok(Err(e)) => error(503, ErrorCode::Internal, &e.to_string()),
            Err(e) => error(500, ErrorCode::Internal, &e.to_string()),
        }
    }

    pub(super) async fn list_keys(&self) -> Response<Vec<u8>> {
        let keys = self.keys.clone();
        let file = match tokio::task::spawn_blocking(move || keys.list()).await {
            Ok(Ok(file)) => file,
            Ok(Err(e)) => return error(500, ErrorCode::Internal, &e.to_string()),
            Err(e) => return error(500, ErrorCode::Internal, &e.to_string()),
        };
        let bans = self.bans().await.ok();
        let now = crate::base::clock::unix_now();
        let list: Vec<serde_json::Value> = file
            .keys
            .iter()
            .map(|k| {
                let ban = bans
                    .as_ref()
                    .and_then(|b| b.bans.iter().find(|b| b.key_id == k.id))
                    .map(|b| b.until_utc.as_str());
                k.to_json(&k.status(ban, now), bans.is_some())
            })
            .collect();
        json_response(200, serde_json::Value::Array(list).to_string().into_bytes())
    }

    /// Runs a change of the keys file off the runtime, logs it in the audit log (as `admin`),
    /// and reloads, so the change is in force when the answer goes out.
    async fn change_keys<T: Send + 'static>(
        &self,
        action: &'static str,
        change: impl FnOnce(&KeyService) -> Result<Changed<T>, KeysError> + Send + 'static,
    ) -> Result<T, Response<Vec<u8>>> {
        let keys = self.keys.clone();
        let catalog = Arc::clone(&self.catalog);
        let done = tokio::task::spawn_blocking(move || {
            let changed = change(&keys)?;
            if let Err(e) = changed.audit {
                tracing::error!(error = %e.reason, action, key_id = %e.key_id, "audit log not written");
            }
            catalog.reload(false);
            Ok::<T, KeysError>(changed.value)
        })
        .await;
        match done {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(e @ KeysError::NoSuchKey(_))) => {
                Err(error(404, ErrorCode::NotFound, &e.to_string()))
            }
            Ok(Err(e @ KeysError::CannotSign(_))) => {
                Err(error(409, ErrorCode::Conflict, &e.to_string()))
            }
            Ok(Err(
                e @ (KeysError::UnknownPlan { .. }
                | KeysError::NotActive(_)
                | KeysError::OwnLimits(_)),
            )) => Err(error(400, ErrorCode::InvalidRequest, &e.to_string())),
            Ok(Err(e)) => Err(error(500, ErrorCode::Internal, &e.to_string())),
            Err(e) => Err(error(500, ErrorCode::Internal, &e.to_string())),
        }
    }

    /// `POST /keys` `{"plan", "name"?, "expires_in"? | "expires_at"?, "per_minute"?,
    /// "per_day"?}`: 201 with the record and the key, shown only in this answer.
    pub(super) async fn issue_key(&self, body: serde_json::Value) -> Response<Vec<u8>> {
        // Anything but the key's settings, or a wrong type, is a 400.
        let new: NewKey = match serde_json::from_value(body) {
            Ok(b) => b,
            Err(e) => return error(400, ErrorCode::InvalidRequest, &format!("body: {e}")),
        };
        let own = match new.options() {
            Ok(own) => own,
            Err(e) => return error(400, ErrorCode::InvalidRequest, &e),
        };
        let (plan, name) = (new.plan, new.name);
        let plans = Arc::clone(&self.catalog.snapshot().plans);
        let issued = self
            .change_keys("issue", move |keys| {
                keys.issue(&plans, &plan, name.as_deref(), &own)
            })
            .await;
        match issued {
            Ok((record, key)) => {
                let in_force = self.settle(&record.id, true).await;
                let mut answer =
                    record.to_json(&record.status(None, crate::base::clock::unix_now()), false);
                answer["in_force"] = serde_json::json!(in_force);
                answer["key"] = serde_json::json!(key);
                json_response(201, answer.to_string().into_bytes())
            }
            Err(refused) => refused,
        }
    }

    /// `POST /keys/{id}/revoke`: 200 once this gateway refuses the key.
    pub(super) async fn revoke_key(&self, id: String) -> Response<Vec<u8>> {
        let target = id.clone();
        let revoked = self
            .change_keys("revoke", move |keys| keys.revoke(&target))
            .await;
        match revoked {
            Ok(record) => {
                let in_force = self.settle(&id, false).await;
                let mut answer = record.to_json("revoked", false);
                answer["in_force"] = serde_json::json!(in_force);
                if !in_force {
                    answer["reason"] = self.catalog.state()["keys_refused"].clone();
                }
                json_response(
                    if in_force { 200 } else { 500 },
                    answer.to_string().into_bytes(),
                )
            }
            Err(refused) => refused,
        }
    }

    /// `POST /keys/{id}/rotate` `{"overlap"?: "24h"}`: the successor, with its key shown only
    /// in this answer.
    pub(super) async fn rotate_key(
        &self,
        id: String,
        body: serde_json::Value,
    ) -> Response<Vec<u8>> {
        let body: RotateBody = match serde_json::from_value(body) {
            Ok(b) => b,
            Err(e) => return error(400, ErrorCode::InvalidRequest, &format!("body: {e}")),
        };
        let overlap = body.overlap.as_deref().unwrap_or("24h");
        let overlap = match crate::base::clock::parse_duration(overlap) {
            Ok(o) => o,
            Err(e) => return error(400, ErrorCode::InvalidRequest, &format!("overlap: {e}")),
        };
        let rotated = self
            .change_keys("rotate", move |keys| keys.rotate(&id, overlap))
            .await;
        match rotated {
            Ok((old, new, key)) => {
                self.settle(&new.id, true).await;
                let now = crate::base::clock::unix_now();
                let mut successor = new.to_json(&new.status(None, now), false);
                successor["key"] = serde_json::json!(key);
                let answer = serde_json::json!({
                    "old": old.to_json(&old.status(None, now), false),
                    "new": successor,
                });
                json_response(200, answer.to_string().into_bytes())
            }
            Err(refused) => refused,
        }
    }

    /// `GET /keys/{id}`: the key's plan, limits and usage while this gateway accepts it.
    pub(super) async fn show_key(&self, id: &str) -> Response<Vec<u8>> {
        match self.active_key(id) {
            Some((key, limits)) => {
                let (usage, usage_error) = match self.store.usage(key.quota_id()).await {
                    Ok(u) => (Some(usage_json(&u, limits.as_ref())), None),
                    Err(e) => (None, Some(e.to_string())),
                };
                let body = serde_json::json!({
                    "id": id,
                    "plan": &*key.plan,
                    "status": "active",
                    "quota_id": &**key.quota_id(),
                    "limits": limits.as_ref().map(limits_json),
                    "usage": usage,
                    "usage_error": usage_error,
                });
                json_response(200, body.to_string().into_bytes())
            }
            None => error(
                404,
                ErrorCode::NotFound,
                "no active key with this id (unknown, revoked or expired)",
            ),
        }
    }

    /// `POST /keys/{id}/reset-usage`: zeroes the key's counts of this minute and day.
    pub(super) async fn reset_usage(&self, id: &str) -> Response<Vec<u8>> {
        let Some((key, _)) = self.active_key(id) else {
            return error(404, ErrorCode::NotFound, "no active key with this id");
        };
        match self.store.reset_usage(key.quota_id()).await {
            Ok(()) => {
                self.audit_admin("reset-usage", id).await;
                json_response(
                    200,
                    serde_json::json!({ "id": id, "reset": true })
                        .to_string()
                        .into_bytes(),
                )
            }
            Err(e) => error(503, ErrorCode::Internal, &format!("quota store: {e}")),
        }
    }

    /// Logs a change made without rewriting a record (reset-usage) as `admin`.
    async fn audit_admin(&self, action: &'static str, id: &str) {
        let keys = self.keys.clone();
        let id = id.to_owned();
        let _ = tokio::task::spawn_blocking(move || {
            let record = keys.list().ok()?.get(&id).ok()?.clone();
            if let Err(e) = keys.audit(action, &record) {
                tracing::error!(error = %e.reason, action, key_id = %e.key_id, "audit log not written");
            }
            Some(())
        })
        .await;
    }

    /// Waits (at most 1.5 s) until this node's keys hold (`present`) or lack key `id`: with the
    /// registry a change reaches the node through the change feed, and the answer should say
    /// what is in force here.
    async fn settle(&self, id: &str, present: bool) -> bool {
        let started = std::time::Instant::now();
        loop {
            let found = self.catalog.snapshot().keys.by_id(id).is_some();
            if found == present {
                return true;
            }
            if started.elapsed() > Duration::from_millis(1_500) {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The key with this id while this gateway accepts it (not expired), and the limits it is
    /// held to (none when its plan is missing).
    fn active_key(&self, id: &str) -> Option<(KeyInfo, Option<Limits>)> {
        let snapshot = self.catalog.snapshot();
        let key = snapshot.keys.by_id(id)?;
        snapshot.accepted(key, crate::base::clock::unix_now())
    }
}

/// A key's limits as `GET /keys/{id}` shows them: `per_minute` and `per_day` where it has them
/// (the first form), and every window, shadow ones marked.
fn limits_json(limits: &Limits) -> serde_json::Value {
    let windows: Vec<serde_json::Value> = limits
        .windows()
        .iter()
        .map(|w| {
            serde_json::json!({
                "name": w.every.name(),
                "every": w.every.spec(),
                "limit": w.limit,
                "shadow": w.shadow,
            })
        })
        .collect();
    serde_json::json!({
        "per_minute": limits.enforced_limit(Every::MINUTE),
        "per_day": limits.enforced_limit(Every::DAY),
        "windows": windows,
    })
}

/// A quota's usage as `GET /keys/{id}` shows it: `minute` and `day` (the first form), and each
/// window of the key's limits (shadow ones marked) with what is used and left of it.
pub(super) fn usage_json(u: &Usage, limits: Option<&Limits>) -> serde_json::Value {
    let windows: Vec<serde_json::Value> = limits
        .map(|l| l.windows())
        .unwrap_or_default()
        .iter()
        .map(|w| {
            let used = u.count(w.every);
            serde_json::json!({
                "name": w.every.name(),
                "every": w.every.spec(),
                "limit": w.limit,
                "used": used,
                "remaining": w.limit().saturating_sub(used),
                "reset": w.every.reset(u.now),
                "shadow": w.shadow,
            })
        })
        .collect();
    serde_json::json!({
        "now": u.now,
        "minute": u.count(Every::MINUTE),
        "day": u.count(Every::DAY),
        "windows": windows,
        "refused_today": u.refused_today,
        // To the minute: when, not a trace of the client's traffic.
        "last_used": (u.last_admitted > 0).then(|| rfc3339(u.last_admitted / 60 * 60)),
        "ban_until": u.ban_until,
    })
}
