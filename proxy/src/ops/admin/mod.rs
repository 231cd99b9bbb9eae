//! The admin listener (loopback by default; elsewhere only with `admin_token`, which every
//! request must then carry as a bearer token): health for supervisors and load balancers,
//! metrics for Prometheus, and bans, keys and reloads for operators. The `bans` and `keys`
//! commands talk to it ([`crate::ops::admin_client`]), so they act on the running gateway's own
//! store, embedded or Redis. Its endpoints are one table, [`routes::ROUTES`]; the handlers are
//! grouped by resource: [`health`], [`bans`], [`keys`], [`reload`], [`usage`].
//!
//! A request passes, in order: the page guard ([`guard`]: `Host`, `Origin`, `Sec-Fetch-Site`),
//! the wrong-token limit of its peer ([`token_limit`]), the token, and for a change a JSON
//! `Content-Type` ([`reply::refuse_media_type`]); each refusal comes before any work. The
//! listener's heads are under the proxy's deadline (`request_header_timeout_ms`).
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
//! | `GET /usage/top?window=day\|month&limit=N` | the quota holders that spent the most this UTC day or month, from the store's top consumers' index |
//! | `GET /overview`, `GET /overview/history` | the console's figures now, and its chart's last 15 minutes ([`history`]) |

pub mod bans;
pub mod guard;
pub mod health;
pub mod history;
pub mod keys;
pub mod overview;
pub mod reload;
pub mod reply;
pub mod routes;
pub mod search;
pub mod token_limit;
pub mod usage;

use std::sync::Arc;

use async_trait::async_trait;
use http::Response;
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;

use self::reply::{error, json_body};
use self::routes::{Handler, Resolved};
use crate::base::metrics::METRICS;
use crate::http::responses::ErrorCode;
use crate::keys::catalog::Catalog;
use crate::keys::service::KeyService;
use crate::quota::resilience::BanCache;
use crate::quota::store::QuotaStore;

pub struct Admin {
    pub catalog: Arc<Catalog>,
    pub store: Arc<dyn QuotaStore>,
    /// This node's ban cache, cleared on a lift so the lift applies here at once.
    pub ban_cache: Arc<BanCache>,
    /// The breaker in front of the store, for the overview.
    pub breaker: Arc<crate::quota::resilience::Breaker>,
    /// When the store fails, requests are still served (`on_store_error` local or open, or the
    /// embedded store): then an unreachable store does not make the gateway unready.
    pub store_optional: bool,
    /// When set, every request must carry it (`Authorization: Bearer`).
    pub token: Option<String>,
    /// Wrong tokens by peer: a peer that sent too many is refused for a while ([`token_limit`]).
    pub token_limit: token_limit::TokenLimit,
    /// Host names answered besides `localhost` and IP addresses ([`guard`]).
    pub hosts: Vec<String>,
    /// The key service the key endpoints change keys through, auditing as `admin`.
    pub keys: KeyService,
    /// With `keys_source = "store"`: where this node's keys come from right now.
    pub registry: Option<Arc<crate::keys::replica::SyncState>>,
    /// The key records as last read for `/key-search`.
    pub records: search::Records,
    /// The last 15 minutes of traffic, for the console's chart.
    pub history: Arc<history::History>,
    /// The places at the backends, for the overview's figures.
    pub places: Arc<crate::upstream::places::Places>,
}

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let method = session.req_header().method.clone();
        let path = session.req_header().uri.path().to_owned();
        let probe = matches!(path.as_str(), "/healthz" | "/readyz" | "/metrics");
        let resolved = routes::resolve(&method, &path);
        let page = matches!(resolved, Resolved::Route(Handler::Console, _));
        if let Some(why) = guard::refuse(session.req_header(), &self.hosts, probe, page) {
            return error(403, ErrorCode::Forbidden, why);
        }
        if page {
            return crate::ops::console::file(&path).unwrap_or_else(crate::ops::console::redirect);
        }
        if let Some(refused) = self.unauthorized(session) {
            return refused;
        }
        match resolved {
            Resolved::Route(handler, id) => {
                if let Some(refused) = reply::refuse_media_type(session.req_header()) {
                    return refused;
                }
                self.handle(handler, id, session).await
            }
            Resolved::WrongMethod(allowed) => error(
                405,
                ErrorCode::MethodNotAllowed,
                &format!("use {}", allowed.join(" or ")),
            ),
            Resolved::NotFound => error(404, ErrorCode::NotFound, "no such admin endpoint"),
        }
    }
}

impl Admin {
    /// 401 when `admin_token` is set and the request does not carry it; 429 for a wrong one
    /// while its peer has sent too many ([`token_limit`]). The right token always passes: a
    /// peer is often shared (every local client of a loopback listener: the operator's CLI,
    /// the health probe, Prometheus), and a guesser there must not lock them out; guessing a
    /// token of 32 characters or more is no threat the limit needs to stop.
    fn unauthorized(&self, session: &ServerSession) -> Option<Response<Vec<u8>>> {
        let token = self.token.as_ref()?;
        let peer = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(|a| a.ip());
        let now = std::time::Instant::now();
        let headers = &session.req_header().headers;
        let given = crate::http::auth::bearer_token(
            headers
                .get_all("authorization")
                .iter()
                .map(|v| v.as_bytes()),
        );
        if given.is_ok_and(|g| token_matches(g.as_bytes(), token.as_bytes())) {
            return None;
        }
        if let Some(wait) = peer.and_then(|p| self.token_limit.limited(p, now)) {
            return Some(too_many_wrong_tokens(wait));
        }
        // No token at all is no guess (a probe not yet given one): only wrong ones count.
        if let Some(peer) = peer.filter(|_| headers.contains_key("authorization")) {
            METRICS
                .admin_auth_refusals
                .with_label_values(&["wrong_token"])
                .inc();
            self.token_limit.failed(peer, now);
        }
        let mut refused = error(
            401,
            ErrorCode::Unauthorized,
            "the admin listener needs its token: Authorization: Bearer <admin_token>",
        );
        refused.headers_mut().insert(
            http::header::WWW_AUTHENTICATE,
            http::HeaderValue::from_static("Bearer"),
        );
        Some(refused)
    }

    /// Runs the handler a route names; `id` is the key id of a `{key id}` path.
    async fn handle(
        &self,
        handler: Handler,
        id: &str,
        session: &mut ServerSession,
    ) -> Response<Vec<u8>> {
        match handler {
            Handler::Healthz => health::healthz(),
            Handler::Readyz => self.readyz().await,
            Handler::Metrics => health::metrics(),
            Handler::ListBans => self.list_bans().await,
            Handler::LiftBan => self.lift_ban(id).await,
            Handler::Reload => self.reload().await,
            Handler::ListKeys => self.list_keys().await,
            Handler::ShowKey => self.show_key(id).await,
            Handler::ResetUsage => self.reset_usage(id).await,
            Handler::RevokeKey => self.revoke_key(id.to_owned()).await,
            Handler::Overview => self.overview().await,
            Handler::OverviewHistory => self.history(),
            Handler::Plans => self.plans(),
            Handler::KeyHistory => self.key_history(id.to_owned()).await,
            Handler::KeySearch => {
                let query = session.req_header().uri.query().map(str::to_owned);
                self.key_search(query.as_deref()).await
            }
            Handler::Console => crate::ops::console::redirect(),
            Handler::UsageTop => {
                let query = session.req_header().uri.query().map(str::to_owned);
                self.usage_top(query.as_deref()).await
            }
            Handler::IssueKey => match json_body(session).await {
                Ok(body) => self.issue_key(body).await,
                Err(refused) => refused,
            },
            Handler::RotateKey => match json_body(session).await {
                Ok(body) => self.rotate_key(id.to_owned(), body).await,
                Err(refused) => refused,
            },
        }
    }
}

/// The 429 a peer gets while limited: `Retry-After` in whole seconds, rounded up.
fn too_many_wrong_tokens(wait: std::time::Duration) -> Response<Vec<u8>> {
    METRICS
        .admin_auth_refusals
        .with_label_values(&["limited"])
        .inc();
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    let mut refused = error(
        429,
        ErrorCode::RateLimited,
        &format!(
            "too many wrong admin tokens from this address; retry in {secs} s (no token is \
             checked until then)"
        ),
    );
    refused.headers_mut().insert(
        http::header::RETRY_AFTER,
        http::HeaderValue::from(secs.max(1)),
    );
    refused
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
