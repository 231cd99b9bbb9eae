//! The admin listener (loopback by default; elsewhere only with `admin_token`, which every
//! request must then carry as a bearer token): health for supervisors and load
//! balancers, metrics for Prometheus, and ban management for operators. The `bans` commands and
//! `keys list` talk to it, so they act on the running gateway's own store, embedded or Redis.
//!
//! | request | answer |
//! |---|---|
//! | `GET /healthz` | 200 while the process serves |
//! | `GET /readyz` | 200 when the config is loaded, a backend accepts connections and the quota store answers (or a fallback covers for it); 503 otherwise, with the failing checks |
//! | `GET /metrics` | the Prometheus text format |
//! | `GET /bans` | the active bans of the keys in the keys file |
//! | `POST /bans/{key id}/lift` | ends that key's ban now |
//! | `POST /reload` | reloads the keys and plans now; says what each part did, which keys file is served and why a part is refused |
//! | `GET /keys/{key id}` | 200 with the key's plan, limits and usage (this minute, this UTC day) while this gateway accepts the key, else 404 |
//! | `POST /keys/{key id}/reset-usage` | zeroes the key's counts of this minute and day |
//! | `GET /keys` | every key of the keys file with its status (never a key) |
//! | `POST /keys` | issues a key (`plan`, `name`, `expires_in`/`expires_at`, `per_minute`, `per_day`); 201 with the key, shown once |
//! | `POST /keys/{key id}/revoke`, `POST /keys/{key id}/rotate` | as the `keys` commands; changes are audited as `admin` |

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use http::Response;
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;
use serde::{Deserialize, Serialize};

use crate::base::clock::rfc3339;
use crate::http::responses::{error_body, ErrorCode};
use crate::keys::catalog::Catalog;
use crate::keys::index::KeyInfo;
use crate::quota::resilience::BanCache;
use crate::quota::store::QuotaStore;

pub struct Admin {
    pub catalog: Arc<Catalog>,
    pub store: Arc<dyn QuotaStore>,
    /// This node's ban cache, cleared on a lift so the lift applies here at once.
    pub ban_cache: Arc<BanCache>,
    pub upstreams: Vec<SocketAddr>,
    /// When the store fails, requests are still served (`on_store_error` local or open, or the
    /// embedded store): then an unreachable store does not make the gateway unready.
    pub store_optional: bool,
    /// When set, every request must carry it (`Authorization: Bearer`).
    pub token: Option<String>,
    /// Where the key API writes: the keys file, the prefix of new keys, the audit log.
    pub key_files: KeyFiles,
    /// With `keys_source = "store"`: where this node's keys come from right now.
    pub registry: Option<Arc<crate::keys::replica::SyncState>>,
}

/// What the key endpoints need beyond the catalog.
#[derive(Clone)]
pub struct KeyFiles {
    /// Where changes go: the keys file, or the registry.
    pub store: crate::keys::service::KeyStore,
    pub api_key_prefix: String,
    pub audit_log: Option<std::path::PathBuf>,
}

/// `POST /keys`: the key's settings; anything else, or a wrong type, is a 400.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct IssueBody {
    plan: String,
    name: Option<String>,
    expires_in: Option<String>,
    expires_at: Option<String>,
    per_minute: Option<u64>,
    per_day: Option<u64>,
}

/// `POST /keys/{id}/rotate`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RotateBody {
    overlap: Option<String>,
}

/// Largest admin request body: a key's settings are a few fields.
const MAX_ADMIN_BODY: usize = 16 * 1024;

/// Reads the request body as a JSON object; an empty body is `{}`.
async fn json_body(session: &mut ServerSession) -> Result<serde_json::Value, Response<Vec<u8>>> {
    let bad = |m: &str| error(400, ErrorCode::InvalidRequest, m);
    let mut body = Vec::new();
    loop {
        match session.read_request_body().await {
            Ok(Some(chunk)) => {
                body.extend_from_slice(&chunk);
                if body.len() > MAX_ADMIN_BODY {
                    return Err(error(413, ErrorCode::PayloadTooLarge, "body over 16 KiB"));
                }
            }
            Ok(None) => break,
            Err(_) => return Err(bad("the request body could not be read")),
        }
    }
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(serde_json::json!({}));
    }
    match serde_json::from_slice::<serde_json::Value>(&body) {
        Ok(v) if v.is_object() => Ok(v),
        _ => Err(bad("the body must be a JSON object")),
    }
}

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

fn json_response(status: u16, body: Vec<u8>) -> Response<Vec<u8>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("content-length", body.len())
        .header("cache-control", "no-store")
        .body(body)
        .unwrap_or_default()
}

fn error(status: u16, code: ErrorCode, message: &str) -> Response<Vec<u8>> {
    json_response(status, error_body(status, code, message).to_vec())
}

impl Admin {
    async fn readyz(&self) -> Response<Vec<u8>> {
        let upstream = self.upstream_reachable().await;
        let store = match self.store.ping().await {
            Ok(()) => "ok".to_owned(),
            Err(e) if self.store_optional => format!("fallback active: {e}"),
            Err(e) => format!("failing: {e}"),
        };
        let store_ok = store == "ok" || store.starts_with("fallback");
        let keys = match &self.registry {
            None => Ok("file"),
            Some(state) => state.readiness(),
        };
        let ready = upstream && store_ok && keys.is_ok();
        let body = serde_json::json!({
            "status": if ready { "ready" } else { "not ready" },
            "checks": {
                "config": "loaded",
                "upstream": if upstream { "reachable" } else { "unreachable" },
                "store": store,
                "keys": keys.unwrap_or_else(|e| e),
            }
        });
        json_response(if ready { 200 } else { 503 }, body.to_string().into_bytes())
    }

    async fn upstream_reachable(&self) -> bool {
        for addr in &self.upstreams {
            let connect = tokio::net::TcpStream::connect(addr);
            if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(300), connect).await {
                return true;
            }
        }
        false
    }

    /// `GET /keys`: every key of the keys file in force, with its status (never the key).
    async fn list_keys(&self) -> Response<Vec<u8>> {
        let store = self.key_files.store.clone();
        let file = match tokio::task::spawn_blocking(move || store.load()).await {
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
        change: impl FnOnce(
                &KeyFiles,
            )
                -> Result<(T, crate::keys::record::KeyRecord), crate::keys::record::KeysError>
            + Send
            + 'static,
    ) -> Result<T, Response<Vec<u8>>> {
        let files = self.key_files.clone();
        let catalog = Arc::clone(&self.catalog);
        let done = tokio::task::spawn_blocking(move || {
            let (out, record) = change(&files)?;
            let line = crate::keys::audit::line(action, &record, "admin");
            if let Err(e) = crate::keys::audit::write(files.audit_log.as_deref(), &line) {
                tracing::error!(error = %e, action, key_id = %record.id, "audit log not written");
            }
            catalog.reload(false);
            Ok::<T, crate::keys::record::KeysError>(out)
        })
        .await;
        match done {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(e @ crate::keys::record::KeysError::NoSuchKey(_))) => {
                Err(error(404, ErrorCode::NotFound, &e.to_string()))
            }
            Ok(Err(
                e @ (crate::keys::record::KeysError::UnknownPlan { .. }
                | crate::keys::record::KeysError::NotActive(_)),
            )) => Err(error(400, ErrorCode::InvalidRequest, &e.to_string())),
            Ok(Err(e)) => Err(error(500, ErrorCode::Internal, &e.to_string())),
            Err(e) => Err(error(500, ErrorCode::Internal, &e.to_string())),
        }
    }

    /// `POST /keys` `{"plan", "name"?, "expires_in"? | "expires_at"?, "per_minute"?,
    /// "per_day"?}`: 201 with the record and the key, shown only in this answer.
    async fn issue_key(&self, body: serde_json::Value) -> Response<Vec<u8>> {
        let body: IssueBody = match serde_json::from_value(body) {
            Ok(b) => b,
            Err(e) => return error(400, ErrorCode::InvalidRequest, &format!("body: {e}")),
        };
        if body.expires_in.is_some() && body.expires_at.is_some() {
            return error(
                400,
                ErrorCode::InvalidRequest,
                "give expires_in or expires_at, not both",
            );
        }
        let own = crate::keys::record::KeyRecordOptions::checked(
            body.expires_in.as_deref(),
            body.expires_at.as_deref(),
            body.per_minute,
            body.per_day,
        );
        let own = match own {
            Ok(own) => own,
            Err(e) => return error(400, ErrorCode::InvalidRequest, &e),
        };
        let (plan, name) = (body.plan, body.name);
        let plans = Arc::clone(&self.catalog.snapshot().plans);
        let issued = self
            .change_keys("issue", move |files| {
                let (record, key) = crate::keys::service::issue(
                    &files.store,
                    &plans,
                    &plan,
                    name.as_deref(),
                    &files.api_key_prefix,
                    &own,
                )?;
                Ok(((record.clone(), key), record))
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
    async fn revoke_key(&self, id: String) -> Response<Vec<u8>> {
        let target = id.clone();
        let revoked = self
            .change_keys("revoke", move |files| {
                let record = crate::keys::service::revoke(&files.store, &target)?;
                Ok((record.clone(), record))
            })
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
    async fn rotate_key(&self, id: String, body: serde_json::Value) -> Response<Vec<u8>> {
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
            .change_keys("rotate", move |files| {
                let (old, new, key) = crate::keys::service::rotate(
                    &files.store,
                    &id,
                    overlap,
                    &files.api_key_prefix,
                )?;
                Ok(((old.clone(), new, key), old))
            })
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

    /// Logs a change made without rewriting a record (reset-usage) as `admin`.
    async fn audit_admin(&self, action: &'static str, id: &str) {
        let store = self.key_files.store.clone();
        let audit_log = self.key_files.audit_log.clone();
        let id = id.to_owned();
        let _ = tokio::task::spawn_blocking(move || {
            let record = store.load().ok()?.get(&id).ok()?.clone();
            let line = crate::keys::audit::line(action, &record, "admin");
            if let Err(e) = crate::keys::audit::write(audit_log.as_deref(), &line) {
                tracing::error!(error = %e, action, key_id = %record.id, "audit log not written");
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
    fn active_key(&self, id: &str) -> Option<(KeyInfo, Option<crate::keys::plans::Limits>)> {
        let snapshot = self.catalog.snapshot();
        let key = snapshot
            .keys
            .by_id(id)
            .filter(|k| !k.expired(crate::base::clock::unix_now()))
            .cloned()?;
        let limits = snapshot.plans.get(&key.plan).map(|p| key.limits(p.limits));
        Some((key, limits))
    }

    /// One store call, whatever the number of keys; the plans come from the keys in force (a
    /// ban of a key no longer in the keys file is not listed).
    async fn bans(&self) -> Result<Bans, String> {
        let active = self.store.bans().await.map_err(|e| e.to_string())?;
        if active.is_empty() {
            return Ok(Bans { bans: Vec::new() });
        }
        let snapshot = self.catalog.snapshot();
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
        Ok(Bans { bans })
    }
}

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        if let Some(token) = &self.token {
            let given = crate::http::auth::bearer_token(
                session
                    .req_header()
                    .headers
                    .get_all("authorization")
                    .iter()
                    .map(|v| v.as_bytes()),
            );
            if !given.is_ok_and(|g| token_matches(g.as_bytes(), token.as_bytes())) {
                let mut refused = error(
                    401,
                    ErrorCode::Unauthorized,
                    "the admin listener needs its token: Authorization: Bearer <admin_token>",
                );
                refused.headers_mut().insert(
                    http::header::WWW_AUTHENTICATE,
                    http::HeaderValue::from_static("Bearer"),
                );
                return refused;
            }
        }
        let method = session.req_header().method.clone();
        let path = session.req_header().uri.path().to_owned();
        let get = method == http::Method::GET;
        match path.as_str() {
            "/healthz" if get => json_response(200, br#"{"status":"ok"}"#.to_vec()),
            "/readyz" if get => self.readyz().await,
            "/metrics" if get => {
                let body = crate::base::metrics::render();
                Response::builder()
                    .status(200)
                    .header("content-type", "text/plain; version=0.0.4; charset=utf-8")
                    .header("content-length", body.len())
                    .body(body)
                    .unwrap_or_default()
            }
            "/bans" if get => match self.bans().await {
                Ok(bans) => json_response(200, serde_json::to_vec(&bans).unwrap_or_default()),
                Err(e) => error(503, ErrorCode::Internal, &format!("quota store: {e}")),
            },
            "/reload" if method == http::Method::POST => {
                let catalog = Arc::clone(&self.catalog);
                let reloaded = tokio::task::spawn_blocking(move || {
                    let report = catalog.reload(false).to_json();
                    let mut state = catalog.state();
                    if let (Some(state), serde_json::Value::Object(report)) =
                        (state.as_object_mut(), report)
                    {
                        state.extend(report);
                    }
                    state
                })
                .await;
                match reloaded {
                    Ok(answer) => json_response(200, answer.to_string().into_bytes()),
                    Err(e) => error(500, ErrorCode::Internal, &format!("reload failed: {e}")),
                }
            }
            "/keys" if get => self.list_keys().await,
            "/keys" if method == http::Method::POST => match json_body(session).await {
                Ok(body) => self.issue_key(body).await,
                Err(refused) => refused,
            },
            "/keys" => error(405, ErrorCode::MethodNotAllowed, "use GET or POST"),
            p if action_target(p, "revoke").is_some() => {
                if method != http::Method::POST {
                    return error(405, ErrorCode::MethodNotAllowed, "use POST");
                }
                let id = action_target(p, "revoke").unwrap_or_default().to_owned();
                self.revoke_key(id).await
            }
            p if action_target(p, "rotate").is_some() => {
                if method != http::Method::POST {
                    return error(405, ErrorCode::MethodNotAllowed, "use POST");
                }
                let id = action_target(p, "rotate").unwrap_or_default().to_owned();
                match json_body(session).await {
                    Ok(body) => self.rotate_key(id, body).await,
                    Err(refused) => refused,
                }
            }
            p if key_target(p).is_some() && get => {
                let id = key_target(p).unwrap_or_default();
                match self.active_key(id) {
                    Some((key, limits)) => {
                        let (usage, usage_error) = match self.store.usage(key.quota_id()).await {
                            Ok(u) => {
                                let mut v = serde_json::to_value(u).unwrap_or_default();
                                // To the minute: when, not a trace of the client's traffic.
                                v["last_used"] = serde_json::json!((u.last_admitted > 0)
                                    .then(|| rfc3339(u.last_admitted / 60 * 60)));
                                if let Some(map) = v.as_object_mut() {
                                    map.remove("last_admitted");
                                }
                                (Some(v), None)
                            }
                            Err(e) => (None, Some(e.to_string())),
                        };
                        let body = serde_json::json!({
                            "id": id,
                            "plan": &*key.plan,
                            "status": "active",
                            "quota_id": &**key.quota_id(),
                            "limits": limits.map(|l| serde_json::json!({
                                "per_minute": l.per_minute,
                                "per_day": l.per_day,
                            })),
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
            p if reset_target(p).is_some() => {
                if method != http::Method::POST {
                    return error(405, ErrorCode::MethodNotAllowed, "use POST");
                }
                let id = reset_target(p).unwrap_or_default();
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
            p if lift_target(p).is_some() => {
                if method != http::Method::POST {
                    return error(405, ErrorCode::MethodNotAllowed, "use POST");
                }
                let id = lift_target(p).unwrap_or_default();
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
            "/healthz" | "/readyz" | "/metrics" | "/bans" => {
                error(405, ErrorCode::MethodNotAllowed, "use GET")
            }
            "/reload" => error(405, ErrorCode::MethodNotAllowed, "use POST"),
            _ => error(404, ErrorCode::NotFound, "no such admin endpoint"),
        }
    }
}

/// The key id of `/bans/{key id}/lift`, when the path is that and the id could be one
/// (anything else, `/bans/lift` included, is 404).
fn lift_target(path: &str) -> Option<&str> {
    path.strip_prefix("/bans/")?
        .strip_suffix("/lift")
        .filter(|id| crate::keys::record::valid_key_id(id))
}

/// The key id of `/keys/{key id}/reset-usage`.
fn reset_target(path: &str) -> Option<&str> {
    action_target(path, "reset-usage")
}

/// The key id of `/keys/{key id}/{action}`.
fn action_target<'a>(path: &'a str, action: &str) -> Option<&'a str> {
    path.strip_prefix("/keys/")?
        .strip_suffix(action)?
        .strip_suffix('/')
        .filter(|id| crate::keys::record::valid_key_id(id))
}

/// The key id of `/keys/{key id}`.
fn key_target(path: &str) -> Option<&str> {
    path.strip_prefix("/keys/")
        .filter(|id| crate::keys::record::valid_key_id(id))
}

/// A running gateway's admin listener, as the command line reaches it.
#[derive(Debug, Clone)]
pub struct AdminClient {
    pub addr: SocketAddr,
    /// Sent as a bearer token when the gateway requires one (`admin_token`).
    pub token: Option<String>,
}

impl AdminClient {
    pub fn of(config: &crate::config::Config) -> AdminClient {
        AdminClient {
            addr: config.admin_listen,
            token: config.admin_token.clone(),
        }
    }

    /// One request: `(status, body)`.
    pub fn call(&self, method: &str, path: &str) -> Result<(u16, String), String> {
        call(self.addr, self.token.as_deref(), method, path)
    }
}

/// Whether `given` is `token`, in time that depends on neither where they differ nor their
/// lengths: the SHA-256 digests are compared, in full.
fn token_matches(given: &[u8], token: &[u8]) -> bool {
    use sha2::{Digest, Sha256};
    let (a, b) = (Sha256::digest(given), Sha256::digest(token));
    let diff = a
        .iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// One request to a gateway's admin listener, for the command line: `(status, body)`.
fn call(
    addr: SocketAddr,
    token: Option<&str>,
    method: &str,
    path: &str,
) -> Result<(u16, String), String> {
    let unreachable = |e: std::io::Error| {
        format!(
            "the gateway's admin listener at {addr} does not answer ({e}); is the gateway running?"
        )
    };
    let mut stream =
        TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(unreachable)?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(unreachable)?;
    let authorization = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{authorization}Content-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .map_err(unreachable)?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).map_err(unreachable)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("the admin listener at {addr} sent no complete response"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("the admin listener at {addr} sent no status"))?;
    Ok((status, body.to_owned()))
}
