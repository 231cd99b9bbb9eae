//! `pet-client`: an async client for the pet adoption API behind pet-gateway.
//!
//! - The operations: [`Client::list_pets`] (one page), [`Client::list_all`] (every page, through
//!   `Link: rel="next"`), [`Client::create_pet`], [`Client::get_pet`], and [`Client::quota`]
//!   (`GET /v1/rate_limit`, which spends nothing: every window of the key's plan, whatever their
//!   lengths, and any ban).
//! - Errors are typed: the API's Error body becomes [`Error::Api`] with its `code`.
//! - The rate-limit headers of every answer are kept ([`Client::rate_state`]) and feed a
//!   client-side limiter (`rate.rs`): a request the client knows would be refused is not sent.
//! - Retries follow the interface (`retry.rs`): `Retry-After` on 429, never less; no retry
//!   before a ban ends; gateway 5xx retried only for idempotent requests, with exponential
//!   backoff and full jitter, but for a 503 `overloaded` (shed before the backend saw it),
//!   retried after its `Retry-After` whatever the method; every wait bounded by the caller's
//!   total deadline.
//!
//! ```no_run
//! # async fn demo() -> Result<(), pet_client::Error> {
//! let client = pet_client::Client::new("http://127.0.0.1:8080", "pet_live_…")?;
//! let available = client.list_all(Some("available")).await?;
//! println!("{} available, {:?} left", available.len(), client.rate_state().remaining);
//! # Ok(()) }
//! ```

mod rate;
mod retry;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use reqwest::Method;
use serde::{Deserialize, Serialize};

pub use rate::{header_windows, unix_now, HeaderWindow, Limiter, RateState};
pub use retry::RetryPolicy;

/// The API's types on the wire, shared with the backend through `pet-api`. A status this
/// client does not know reads as [`PetStatus::Other`] and is kept as sent.
pub use pet_api::{NewPet, Pet, PetStatus};

/// One page of `GET /v1/pets`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    pub pets: Vec<Pet>,
    /// The next page's path and query, from `Link: <…>; rel="next"`.
    pub next: Option<String>,
}

/// The `minute` or `day` window of `GET /v1/rate_limit` (the body's first form).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Window {
    /// Units the window allows: a request spends its operation's cost (1 by default).
    pub limit: u64,
    pub remaining: u64,
    /// When the window ends, Unix seconds.
    pub reset: u64,
}

/// One enforced window of `GET /v1/rate_limit`'s `windows`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamedWindow {
    /// `second`, `minute`, `hour`, `day`, `month`, or the length in its largest whole unit
    /// (`10s`, `90m`, `6h`, `7d`).
    pub name: String,
    /// The length in seconds (for `month`, the current month's).
    pub every: u64,
    pub limit: u64,
    pub remaining: u64,
    /// When the window ends, Unix seconds.
    pub reset: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ban {
    pub until: u64,
}

/// The most requests of the caller (or of its customer's keys) in flight at once, and how many
/// are now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Concurrency {
    pub limit: u64,
    pub in_flight: u64,
}

/// `GET /v1/rate_limit`: where the caller's quota stands.
///
/// A plan has any windows: `windows` lists every enforced one, shortest first; `minute` and
/// `day` are there only when the plan has a window of that length. A gateway from before windows
/// answered `minute` and `day` alone: such a body reads with `windows` empty, and
/// [`Quota::all_windows`] gives the windows of either form.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quota {
    pub plan: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minute: Option<Window>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub day: Option<Window>,
    #[serde(default)]
    pub windows: Vec<NamedWindow>,
    pub ban: Option<Ban>,
    /// `None` when the plan sets none, or from a gateway that does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<Concurrency>,
}

impl Quota {
    /// Every window the body tells of: `windows`, or, from a gateway that does not send it,
    /// `minute` and `day`.
    pub fn all_windows(&self) -> Vec<NamedWindow> {
        if !self.windows.is_empty() {
            return self.windows.clone();
        }
        [("minute", 60, self.minute), ("day", 86_400, self.day)]
            .into_iter()
            .filter_map(|(name, every, w)| {
                w.map(|w| NamedWindow {
                    name: name.to_owned(),
                    every,
                    limit: w.limit,
                    remaining: w.remaining,
                    reset: w.reset,
                })
            })
            .collect()
    }
}

/// The API's Error body (`pet_api::ErrorBody`).
pub use pet_api::ErrorBody as ApiError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{} {}: {}", .0.status, .0.code, .0.message)]
    Api(ApiError),
    /// Waiting any longer would pass the caller's deadline; `last` is the answer that made the
    /// client wait, when there was one.
    #[error("gave up: the next attempt would pass the deadline of {deadline:?}{}", last.as_ref().map(|e| format!(" (last answer: {e})")).unwrap_or_default())]
    Deadline {
        deadline: Duration,
        last: Option<Box<Error>>,
    },
    #[error("could not reach the API: {0}")]
    Transport(String),
    #[error("the API answered something unexpected: {0}")]
    Decode(String),
    #[error("invalid base URL `{0}`")]
    BaseUrl(String),
}

impl Error {
    /// The API's error code, when the API answered with one.
    pub fn code(&self) -> Option<&str> {
        match self {
            Error::Api(e) => Some(&e.code),
            Error::Deadline { last: Some(e), .. } => e.code(),
            _ => None,
        }
    }
}

/// A successful answer: its next-page link (`Link: rel="next"`, checked) and body.
struct Answer {
    link: Option<String>,
    body: Vec<u8>,
}

pub struct Client {
    http: reqwest::Client,
    /// `scheme://host[:port]`, without a trailing slash.
    origin: String,
    key: String,
    policy: RetryPolicy,
    limiter: Mutex<Limiter>,
    last: Mutex<RateState>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Client {
    /// A client of the API at `base_url` (`http://host:port`, with or without `/v1`) with the
    /// default [`RetryPolicy`].
    pub fn new(base_url: &str, api_key: &str) -> Result<Client, Error> {
        Client::with_policy(base_url, api_key, RetryPolicy::default())
    }

    pub fn with_policy(
        base_url: &str,
        api_key: &str,
        policy: RetryPolicy,
    ) -> Result<Client, Error> {
        let trimmed = base_url.trim().trim_end_matches('/');
        let origin = trimmed.strip_suffix("/v1").unwrap_or(trimmed);
        if !(origin.starts_with("http://") || origin.starts_with("https://"))
            || origin.len() <= "https://".len()
        {
            return Err(Error::BaseUrl(base_url.to_owned()));
        }
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| Error::Transport(e.to_string()))?;
        Ok(Client {
            http,
            origin: origin.to_owned(),
            key: api_key.to_owned(),
            policy,
            limiter: Mutex::default(),
            last: Mutex::default(),
        })
    }

    /// The rate-limit headers of the latest answer.
    pub fn rate_state(&self) -> RateState {
        *lock(&self.last)
    }

    /// One page of animals, optionally of one `status`.
    pub async fn list_pets(&self, status: Option<&str>, limit: Option<u32>) -> Result<Page, Error> {
        let mut query = Vec::new();
        if let Some(limit) = limit {
            query.push(format!("limit={limit}"));
        }
        if let Some(status) = status {
            let encoded: String = status
                .bytes()
                .map(|b| {
                    if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                        char::from(b).to_string()
                    } else {
                        format!("%{b:02X}")
                    }
                })
                .collect();
            query.push(format!("status={encoded}"));
        }
        let path = if query.is_empty() {
            "/v1/pets".to_owned()
        } else {
            format!("/v1/pets?{}", query.join("&"))
        };
        self.page(&path).await
    }

    /// Every animal (of one `status`), following `Link: rel="next"` page by page. A link that
    /// does not move on (the same page again) ends with an error rather than a loop.
    pub async fn list_all(&self, status: Option<&str>) -> Result<Vec<Pet>, Error> {
        let mut page = self.list_pets(status, Some(100)).await?;
        let mut pets = std::mem::take(&mut page.pets);
        let mut seen = std::collections::HashSet::new();
        while let Some(next) = page.next.take() {
            // A million pets of 100 a page: past that the server is not paging, it is looping.
            if !seen.insert(next.clone()) || seen.len() > MAX_PAGES {
                return Err(Error::Decode(format!(
                    "the next-page link `{next}` repeats, or paging passed {MAX_PAGES} pages"
                )));
            }
            page = self.page(&next).await?;
            pets.append(&mut page.pets);
        }
        Ok(pets)
    }

    pub async fn create_pet(&self, pet: &NewPet) -> Result<Pet, Error> {
        let body = serde_json::to_vec(pet).map_err(|e| Error::Decode(e.to_string()))?;
        let answer = self.send(Method::POST, "/v1/pets", Some(body)).await?;
        decode(&answer.body)
    }

    pub async fn get_pet(&self, id: i64) -> Result<Pet, Error> {
        let answer = self
            .send(Method::GET, &format!("/v1/pets/{id}"), None)
            .await?;
        decode(&answer.body)
    }

    /// Where the quota stands (`GET /v1/rate_limit`, which spends none of it). What it says
    /// also tells the client-side limiter: a ban, or any window with nothing left (the client
    /// waits until every such window has reset).
    pub async fn quota(&self) -> Result<Quota, Error> {
        let answer = self.send(Method::GET, "/v1/rate_limit", None).await?;
        let quota: Quota = decode(&answer.body)?;
        let mut limiter = lock(&self.limiter);
        let now = unix_now();
        match quota.ban {
            // During a ban every window reads 0 whatever it holds: the ban's end is what counts.
            Some(ban) => limiter.block_until(ban.until, now),
            None => {
                for w in quota.all_windows() {
                    if w.remaining == 0 {
                        limiter.block_until(w.reset, now);
                    }
                }
            }
        }
        Ok(quota)
    }

    async fn page(&self, path: &str) -> Result<Page, Error> {
        let answer = self.send(Method::GET, path, None).await?;
        Ok(Page {
            pets: decode(&answer.body)?,
            next: answer.link,
        })
    }

    /// One call, with the retry policy: waits the client-side limiter asks for, `Retry-After`
    /// after a 429, backoff after a gateway 5xx or a lost connection (idempotent requests only),
    /// all within the policy's deadline.
    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Answer, Error> {
        let call = Call {
            idempotent: method == Method::GET,
            // The quota endpoint spends nothing and is how a client learns that a block is over
            // (an operator lifted the ban, reset the usage): the limiter never holds it back.
            limited: path != "/v1/rate_limit",
            deadline: Instant::now().checked_add(self.policy.deadline),
            method,
            path,
            body,
        };
        let mut attempt = 0u32;
        let mut last: Option<Error> = None;
        loop {
            self.wait_for_limiter(&call, &mut last).await?;
            let remaining = call.remaining();
            if remaining.is_zero() {
                return Err(self.give_up(last));
            }
            let error = match self.exchange(&call, remaining).await {
                Outcome::Done(result) => return result,
                Outcome::Limited { error, retry_after } => {
                    let wait = self.retry_after_wait(retry_after, attempt);
                    attempt = attempt.saturating_add(1);
                    if !call.fits(wait) {
                        return Err(self.give_up(Some(error)));
                    }
                    last = Some(error);
                    tokio::time::sleep(wait).await;
                    continue;
                }
                Outcome::Failed(error) => error,
            };
            if !self.policy.enabled || !call.idempotent {
                return Err(error);
            }
            last = Some(error);
            self.back_off(&mut attempt, &call, &mut last).await?;
        }
    }

    /// Waits as long as the client-side limiter asks (a window it knows is spent, a ban), or
    /// gives up with `last` when that would pass the deadline.
    async fn wait_for_limiter(
        &self,
        call: &Call<'_>,
        last: &mut Option<Error>,
    ) -> Result<(), Error> {
        if !(self.policy.enabled && call.limited) {
            return Ok(());
        }
        let wait = lock(&self.limiter).wait(unix_now());
        if wait.is_zero() {
            return Ok(());
        }
        // Whole seconds are what the headers give; a little more makes sure the window has
        // turned by the gateway's clock too.
        let wait = wait + MARGIN;
        if !call.fits(wait) {
            return Err(self.give_up(last.take()));
        }
        tokio::time::sleep(wait).await;
        Ok(())
    }

    /// One attempt: sends the request once, within `timeout`, and sorts out the answer.
    async fn exchange(&self, call: &Call<'_>, timeout: Duration) -> Outcome {
        let resp = match self.request(call, timeout).send().await {
            Ok(resp) => resp,
            Err(e) => return Outcome::Failed(Error::Transport(e.to_string())),
        };
        let status = resp.status();
        let state = self.observe(resp.headers(), call.limited);
        let link = next_of(resp.headers());
        let bytes = match resp.bytes().await {
            Ok(b) => b,
            Err(e) => return Outcome::Failed(Error::Transport(e.to_string())),
        };
        if status.is_success() {
            return Outcome::Done(link.map(|link| Answer {
                link,
                body: bytes.to_vec(),
            }));
        }
        let body = error_body(status, &bytes);
        // Shed before it reached the backend: safe to send again, whatever the method.
        let unsent = status.as_u16() == 503 && body.code == "overloaded";
        let error = Error::Api(body);
        match status.as_u16() {
            429 if self.policy.enabled => Outcome::Limited {
                error,
                retry_after: state.retry_after,
            },
            503 if self.policy.enabled && unsent => Outcome::Limited {
                error,
                retry_after: state.retry_after,
            },
            502..=504 => Outcome::Failed(error),
            _ => Outcome::Done(Err(error)),
        }
    }

    fn request(&self, call: &Call<'_>, timeout: Duration) -> reqwest::RequestBuilder {
        let request = self
            .http
            .request(call.method.clone(), format!("{}{}", self.origin, call.path))
            .bearer_auth(&self.key)
            .timeout(timeout);
        match &call.body {
            Some(body) => request
                .header("content-type", "application/json")
                .body(body.clone()),
            None => request,
        }
    }

    /// The rate-limit headers of an answer. Only the plan's headers (those with
    /// `RateLimit-Policy`) describe the quota, and only they are kept and fed to the limiter;
    /// a 401's per-address limit or the quota endpoint's own limit do not. The quota endpoint
    /// (`limited` false) answers a banned key with every window at 0: its body, not `RateLimit`,
    /// tells how long to wait (`X-RateLimit-Reset` is the ban's end).
    fn observe(&self, headers: &reqwest::header::HeaderMap, limited: bool) -> RateState {
        let mut state = RateState::from_headers(headers);
        if !limited {
            state.spent_for = None;
        }
        if headers.contains_key("ratelimit-policy") {
            *lock(&self.last) = state;
            if self.policy.enabled {
                lock(&self.limiter).observe(&state, unix_now());
            }
        }
        state
    }

    /// How long to wait after a 429: at least `Retry-After` from now (whole seconds, so a
    /// little more), and never a quick retry when it is missing or unreadable (a 429 from
    /// something in front of the gateway): the backoff of `attempt`, at least a second.
    fn retry_after_wait(&self, retry_after: Option<u64>, attempt: u32) -> Duration {
        let told = retry_after.map_or(Duration::ZERO, |s| {
            Duration::from_secs(s.min(rate::MAX_BLOCK_SECS))
        });
        (told + MARGIN)
            .max(self.policy.backoff(attempt))
            .max(Duration::from_secs(1))
    }

    /// The deadline error, with the answer that made the client wait, when there was one.
    fn give_up(&self, last: Option<Error>) -> Error {
        Error::Deadline {
            deadline: self.policy.deadline,
            last: last.map(Box::new),
        }
    }

    /// Sleeps the backoff of `attempt` (and counts it), or gives up with `last` when that would
    /// pass the deadline.
    async fn back_off(
        &self,
        attempt: &mut u32,
        call: &Call<'_>,
        last: &mut Option<Error>,
    ) -> Result<(), Error> {
        let wait = self.policy.backoff(*attempt);
        *attempt = attempt.saturating_add(1);
        if !call.fits(wait) {
            return Err(self.give_up(last.take()));
        }
        tokio::time::sleep(wait).await;
        Ok(())
    }
}

/// What stays the same across the attempts of one call.
struct Call<'a> {
    method: Method,
    path: &'a str,
    body: Option<Vec<u8>>,
    /// Only these are retried after a gateway 5xx or a lost connection.
    idempotent: bool,
    /// Whether the client-side limiter may hold the call back.
    limited: bool,
    /// `None` when the policy's deadline is too far to represent: no deadline.
    deadline: Option<Instant>,
}

impl Call<'_> {
    /// Whether waiting `wait` from now still ends by the deadline.
    fn fits(&self, wait: Duration) -> bool {
        self.deadline
            .is_none_or(|d| Instant::now().checked_add(wait).is_some_and(|t| t <= d))
    }

    /// Time left until the deadline.
    fn remaining(&self) -> Duration {
        self.deadline.map_or(Duration::MAX, |d| {
            d.saturating_duration_since(Instant::now())
        })
    }
}

/// How one attempt ended.
enum Outcome {
    /// The call's result: a success, or an error no retry can help.
    Done(Result<Answer, Error>),
    /// A 429, or a 503 `overloaded` (shed before the backend saw it), while the retry policy is
    /// on: wait (at least `Retry-After`, in seconds) and retry.
    Limited {
        error: Error,
        retry_after: Option<u64>,
    },
    /// A lost connection or a gateway 5xx: retried with backoff if the call is idempotent and
    /// the policy is on.
    Failed(Error),
}

/// The Error body of a failed answer, or one made of what came instead (a proxy's HTML page).
fn error_body(status: reqwest::StatusCode, bytes: &[u8]) -> ApiError {
    serde_json::from_slice::<ApiError>(bytes).unwrap_or_else(|_| ApiError {
        code: "unknown".into(),
        message: String::from_utf8_lossy(bytes).chars().take(200).collect(),
        status: status.as_u16(),
    })
}

/// The most pages `list_all` follows.
const MAX_PAGES: usize = 10_000;

/// Added to waits the headers give in whole seconds, so the window has turned by the gateway's
/// clock too.
const MARGIN: Duration = Duration::from_millis(250);

/// The `rel="next"` target among every `Link` header line. `Err` when there is a next page the
/// client will not follow (another origin): a partial listing must not pass for a whole one.
fn next_of(headers: &reqwest::header::HeaderMap) -> Result<Option<String>, Error> {
    for value in headers.get_all("link") {
        let Ok(text) = value.to_str() else { continue };
        if let Some(target) = next_link(text) {
            return Ok(Some(target));
        }
        if has_next(text) {
            return Err(Error::Decode(format!(
                "the next-page link is not a path on this origin: {text}"
            )));
        }
    }
    Ok(None)
}

/// Whether a `Link` value has a `rel="next"` entry at all.
fn has_next(link: &str) -> bool {
    link.split(',').any(|entry| {
        entry.split(';').skip(1).any(|p| {
            p.trim()
                .strip_prefix("rel=")
                .is_some_and(|r| r.trim_matches('"').split(' ').any(|r| r == "next"))
        })
    })
}

fn decode<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Error> {
    serde_json::from_slice(body).map_err(|e| Error::Decode(e.to_string()))
}

/// The target of the `rel="next"` entry of a `Link` header: only a path on the same origin
/// (`/…`, not `//host/…` nor `@host/…` nor an absolute URL), so that a link can never send the
/// API key anywhere else.
fn next_link(link: &str) -> Option<String> {
    link.split(',').find_map(|entry| {
        let (target, params) = entry.trim().split_once(';')?;
        let is_next = params.split(';').any(|p| {
            p.trim().trim_start_matches("rel=").trim_matches('"') == "next" && p.contains("rel=")
        });
        let target = target.trim().strip_prefix('<')?.strip_suffix('>')?;
        let same_origin = target.starts_with('/')
            && !target.starts_with("//")
            && !target.contains(['\\', '@'])
            && !target.bytes().any(|b| b.is_ascii_control() || b == b' ');
        (is_next && same_origin).then(|| target.to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_link_is_found_among_others() {
        assert_eq!(
            next_link("</v1/pets?limit=2&after=2>; rel=\"next\"").as_deref(),
            Some("/v1/pets?limit=2&after=2")
        );
        assert_eq!(
            next_link("</v1/pets>; rel=\"successor-version\", </v1/pets?after=9>; rel=next")
                .as_deref(),
            Some("/v1/pets?after=9")
        );
        assert_eq!(next_link("</v1/pets>; rel=\"successor-version\""), None);
        for elsewhere in [
            "<http://evil.example/v1/pets>; rel=next",
            "<//evil.example/v1/pets>; rel=next",
            "<@evil.example/v1/pets>; rel=next",
            "</v1/pets@evil.example>; rel=next",
            "<\\\\evil.example/x>; rel=next",
        ] {
            assert_eq!(next_link(elsewhere), None, "{elsewhere}");
        }
    }

    #[test]
    fn base_urls_are_checked_and_v1_is_optional() {
        assert_eq!(
            Client::new("http://127.0.0.1:8080/v1/", "k")
                .unwrap()
                .origin,
            "http://127.0.0.1:8080"
        );
        assert_eq!(
            Client::new("https://api.example", "k").unwrap().origin,
            "https://api.example"
        );
        assert!(matches!(
            Client::new("127.0.0.1:8080", "k"),
            Err(Error::BaseUrl(_))
        ));
    }
}
