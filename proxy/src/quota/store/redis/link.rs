//! The connection every Redis call of the store goes through, and the deadline each one runs
//! under: a reconnecting multiplexed connection to one server (or to the primary the Sentinels
//! name), or a cluster connection.
//!
//! A call that fails in a way a new connection could cure (unreachable, timed out, refused
//! credentials, `READONLY` from a primary demoted by a failover) starts a refresh in the
//! background, at most one at a time and one per [`REFRESH_EVERY`]: the password and
//! certificate files are read again and the Sentinels asked for the primary again; when where
//! the connection points or what it logs in with changed, the next call connects anew. The
//! call itself returns at once with its error, so `on_store_error` decides it and no request
//! waits on the refresh. A connection to the same place with the same secrets is kept: it
//! reconnects by itself.
//!
//! With Sentinels, a call also starts a refresh once the last one is [`SENTINEL_RECHECK`] old:
//! after a failover that left the old primary up (`SENTINEL FAILOVER`, a partition), the old
//! one takes writes until the Sentinels demote it, and whatever it counts then is lost with
//! it. Asking the Sentinels once a second bounds that; when their answer is unchanged, it costs
//! one connection to a Sentinel and nothing on the primary.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;

use super::errors::classify;
use super::function::{Acquire, AcquireCall};
use crate::base::redis::{Prepared, RedisAccess, RedisAccessError};
use crate::quota::store::StoreError;

/// The least time between two refreshes started by failing calls.
const REFRESH_EVERY: Duration = Duration::from_millis(250);
/// How often, while calls flow, the Sentinels are asked again even without a failure.
const SENTINEL_RECHECK: Duration = Duration::from_secs(1);
/// The least deadline of one step of a refresh (a Sentinel lookup, a connection): a refresh
/// runs in the background, never on a request's time, so it may wait longer than a call.
const REFRESH_STEP: Duration = Duration::from_millis(500);

#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// What calls use: the client prepared last, and the connection made from it (once a call
/// needed one).
#[derive(Default)]
struct State {
    prepared: Option<Arc<Prepared>>,
    conn: Option<Conn>,
}

#[derive(Default)]
struct Refresh {
    running: bool,
    last: Option<Instant>,
    /// The last refresh's error, for the message of calls that find no primary, and so the
    /// log says a failure once rather than four times a second.
    error: Option<String>,
}

struct Inner {
    access: RedisAccess,
    timeout: Duration,
    /// `Some` for a Sentinel target: ask them again this often.
    recheck: Option<Duration>,
    /// When the last refresh started, in milliseconds after `born`: read by every call of a
    /// Sentinel target without taking a lock.
    born: Instant,
    last_refresh_ms: AtomicU64,
    state: ArcSwap<State>,
    /// Serialises making a connection and replacing the prepared client.
    making: tokio::sync::Mutex<()>,
    refresh: Mutex<Refresh>,
    refreshed: tokio::sync::Notify,
}

/// The connection every call goes through, and the deadline each one runs under. Shared by the
/// store and its batches' drain tasks.
pub(crate) struct Link {
    inner: Arc<Inner>,
}

impl Link {
    /// Reads the password and certificate files now (at start-up); a Sentinel target is asked
    /// for its primary by the first call.
    pub(super) fn new(access: RedisAccess, timeout: Duration) -> Result<Link, RedisAccessError> {
        let prepared = access.prepare_now(timeout)?.map(Arc::new);
        let recheck = access.is_sentinel().then_some(SENTINEL_RECHECK);
        Ok(Link {
            inner: Arc::new(Inner {
                access,
                timeout,
                recheck,
                born: Instant::now(),
                last_refresh_ms: AtomicU64::new(0),
                state: ArcSwap::from_pointee(State {
                    prepared,
                    conn: None,
                }),
                making: tokio::sync::Mutex::new(()),
                refresh: Mutex::new(Refresh::default()),
                refreshed: tokio::sync::Notify::new(),
            }),
        })
    }

    /// Whether batches must be formed per cluster slot.
    pub(super) fn is_cluster(&self) -> bool {
        self.inner.access.is_cluster()
    }

    pub(super) fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    async fn conn(&self) -> Result<Conn, StoreError> {
        if let Some(c) = &self.inner.state.load().conn {
            return Ok(c.clone());
        }
        // Boxed: inline, the cold path's state (a lock held, a connection being made) would be
        // part of every call's future and copied with it on every call (about 1,500
        // instructions a decision in callgrind, bench/RESULTS.md).
        Box::pin(self.connect()).await
    }

    /// Makes the connection from the prepared client; with none prepared yet (a Sentinel
    /// target before its first answer), asks for one and waits for it, within the caller's
    /// deadline (unless the last ask was a moment ago and failed: then it fails at once).
    async fn connect(&self) -> Result<Conn, StoreError> {
        let i = &self.inner;
        for _ in 0..2 {
            {
                let _making = i.making.lock().await;
                let state = i.state.load_full();
                if let Some(c) = &state.conn {
                    return Ok(c.clone());
                }
                if let Some(p) = &state.prepared {
                    let conn = make(p, i.timeout).await?;
                    i.state.store(Arc::new(State {
                        prepared: Some(Arc::clone(p)),
                        conn: Some(conn.clone()),
                    }));
                    return Ok(conn);
                }
            }
            let refreshed = i.refreshed.notified();
            tokio::pin!(refreshed);
            refreshed.as_mut().enable();
            if !self.refresh() {
                break;
            }
            refreshed.await;
        }
        let why = i
            .refresh
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .error
            .clone();
        Err(StoreError::Refused(format!(
            "no Redis primary known yet: {}",
            why.unwrap_or_else(|| "the Sentinels have not answered".to_owned())
        )))
    }

    /// Starts a refresh in the background unless one runs or one started less than
    /// [`REFRESH_EVERY`] ago (so failing calls, however many, start at most four a second).
    /// Whether one runs now.
    fn refresh(&self) -> bool {
        {
            let mut r = self
                .inner
                .refresh
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if r.running {
                return true;
            }
            if r.last.is_some_and(|t| t.elapsed() < REFRESH_EVERY) {
                return false;
            }
            r.running = true;
            r.last = Some(Instant::now());
        }
        let since_born = self.inner.born.elapsed().as_millis();
        self.inner.last_refresh_ms.store(
            u64::try_from(since_born).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        let inner = Arc::clone(&self.inner);
        tokio::spawn(async move { inner.refresh_now().await });
        true
    }

    /// Runs one plain command under the deadline.
    pub(super) async fn query<T: redis::FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
    ) -> Result<T, StoreError> {
        let call = async {
            let result = match self.conn().await? {
                Conn::Single(mut c) => cmd.query_async::<T>(&mut c).await,
                Conn::Cluster(mut c) => cmd.query_async::<T>(&mut c).await,
            };
            result.map_err(|e| StoreError::Unavailable(e.to_string()))
        };
        self.settle(tokio::time::timeout(self.inner.timeout, call).await)
    }

    /// Runs one pipeline (one round trip) under the deadline; its replies as `T` (`()` reads
    /// none).
    pub(super) async fn pipe<T: redis::FromRedisValue>(
        &self,
        pipeline: &redis::Pipeline,
    ) -> Result<T, StoreError> {
        let call = async {
            let result = match self.conn().await? {
                Conn::Single(mut c) => pipeline.query_async::<T>(&mut c).await,
                Conn::Cluster(mut c) => pipeline.query_async::<T>(&mut c).await,
            };
            result.map_err(|e| StoreError::Unavailable(e.to_string()))
        };
        self.settle(tokio::time::timeout(self.inner.timeout, call).await)
    }

    /// Runs `call`, an `EVALSHA` of the script `source`, and with `replicas` above 0 `WAIT`s
    /// in the same round trip for that many replicas to hold it (for up to half the deadline);
    /// the answer and the replicas that acknowledged (0 without a `WAIT`). A server without the
    /// script (restarted, flushed, promoted) has it loaded, then the call sent again. The
    /// global store's writes (`Ledger`, `BanFeed`) go this way: a write no replica holds can be
    /// lost with a failover, and the caller decides what that means.
    pub(super) async fn eval_waited<T: redis::FromRedisValue>(
        &self,
        call: &redis::Cmd,
        source: &str,
        replicas: u32,
    ) -> Result<(T, u32), StoreError> {
        match self.eval_waited_once(call, replicas).await {
            Err(StoreError::Unavailable(e)) if e.contains("NoScript") => {
                self.query::<String>(redis::cmd("SCRIPT").arg("LOAD").arg(source))
                    .await?;
                self.eval_waited_once(call, replicas).await
            }
            other => other,
        }
    }

    async fn eval_waited_once<T: redis::FromRedisValue>(
        &self,
        call: &redis::Cmd,
        replicas: u32,
    ) -> Result<(T, u32), StoreError> {
        if replicas == 0 {
            return Ok((self.query::<T>(call).await?, 0));
        }
        let wait_ms = u64::try_from(self.inner.timeout.as_millis() / 2).unwrap_or(u64::MAX);
        let mut pipe = redis::pipe();
        pipe.add_command(call.clone())
            .cmd("WAIT")
            .arg(replicas)
            .arg(wait_ms.max(1));
        self.pipe(&pipe).await
    }

    /// Runs one script invocation under the deadline.
    pub(super) async fn run<T: redis::FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T, StoreError> {
        let call = async {
            match self.conn().await? {
                Conn::Single(mut c) => invoke_on(invocation, &mut c).await,
                Conn::Cluster(mut c) => invoke_on(invocation, &mut c).await,
            }
        };
        // The deadline is awaited here rather than in a helper that takes the call: every move
        // of a future is a copy of it, on every call.
        self.settle(tokio::time::timeout(self.inner.timeout, call).await)
    }

    /// Runs `ACQUIRE` under the deadline (by `FCALL`, or the script: `function.rs`).
    pub(super) async fn acquire(
        &self,
        acquire: &Acquire,
        call: &AcquireCall,
    ) -> Result<Vec<i64>, StoreError> {
        let run = async {
            match self.conn().await? {
                Conn::Single(mut c) => acquire.call_on(&mut c, call).await,
                Conn::Cluster(mut c) => acquire.call_on(&mut c, call).await,
            }
        };
        self.settle(tokio::time::timeout(self.inner.timeout, run).await)
    }

    /// A call's outcome under the deadline; a failure a new connection could cure starts a
    /// refresh.
    fn settle<T>(
        &self,
        outcome: Result<Result<T, StoreError>, tokio::time::error::Elapsed>,
    ) -> Result<T, StoreError> {
        let result = match outcome {
            Err(_) => Err(StoreError::Timeout(self.inner.timeout)),
            Ok(result) => result,
        };
        if matches!(
            result,
            Err(StoreError::Unavailable(_) | StoreError::Refused(_) | StoreError::Timeout(_))
        ) || self.recheck_due()
        {
            self.refresh();
        }
        result
    }

    /// Whether a Sentinel target's last refresh is [`SENTINEL_RECHECK`] old.
    fn recheck_due(&self) -> bool {
        let Some(every) = self.inner.recheck else {
            return false;
        };
        let now = self.inner.born.elapsed().as_millis();
        let last = u128::from(self.inner.last_refresh_ms.load(Ordering::Relaxed));
        now.saturating_sub(last) >= every.as_millis()
    }
}

impl Inner {
    /// Reads the files again and asks the Sentinels again; replaces the prepared client (and
    /// drops the connection made from it) only when where it points or what it logs in with
    /// changed.
    async fn refresh_now(&self) {
        let step = self.timeout.max(REFRESH_STEP);
        let known = self.state.load().prepared.as_ref().map(|p| p.identity());
        let outcome = match tokio::time::timeout(step * 8, self.access.prepare(step, known)).await {
            Ok(outcome) => outcome.map_err(|e| e.to_string()),
            Err(_) => Err(format!("no answer within {:?}", step * 8)),
        };
        let error = match outcome {
            Ok(Some(prepared)) => {
                self.adopt(prepared).await;
                None
            }
            Ok(None) => None,
            Err(e) => Some(e),
        };
        {
            let mut r = self.refresh.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(e) = &error {
                if r.error.as_ref() != Some(e) {
                    tracing::warn!(error = %e, redis = %self.access.describe(),
                        "Redis: cannot reconnect yet; on_store_error decides meanwhile");
                }
            }
            r.error = error;
            r.running = false;
        }
        self.refreshed.notify_waiters();
    }

    async fn adopt(&self, prepared: Prepared) {
        let _making = self.making.lock().await;
        let state = self.state.load();
        let same = state
            .prepared
            .as_ref()
            .is_some_and(|p| p.identity() == prepared.identity());
        if same {
            return;
        }
        if state.prepared.is_some() {
            tracing::info!(redis = %self.access.describe(),
                "Redis: the primary, or the secrets or certificates, changed: reconnecting");
        }
        self.state.store(Arc::new(State {
            prepared: Some(Arc::new(prepared)),
            conn: None,
        }));
    }
}

/// A connection from the prepared client: a lazy, reconnecting one for a single server (it
/// connects on its first call, inside the runtime that serves requests), or a cluster
/// connection (learning the slots takes a round trip to a seed node; bounded like any call).
async fn make(prepared: &Prepared, timeout: Duration) -> Result<Conn, StoreError> {
    match prepared {
        Prepared::Single { client, .. } => {
            // Opening a connection (TCP, TLS, `HELLO`, `AUTH`) may take longer than a call
            // on a loaded host: bounded by a call's deadline, every attempt would fail alike
            // and the store stay unreachable. Calls still fail at their own deadline while it
            // opens.
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(timeout.max(REFRESH_STEP)))
                .set_response_timeout(Some(timeout))
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_millis(500));
            let manager = ConnectionManager::new_lazy_with_config(resp3(client)?, config)
                .map_err(|e| StoreError::Refused(e.to_string()))?;
            // Lazy, so that it connects in the runtime that serves requests (this one); but a
            // lazy first attempt moves on only while a call waits on it, and a handshake of
            // several round trips met by one call, then by none for a while (the breaker's
            // probe comes every 250 ms), would run out its bound between them. One `PING`
            // spawned here drives it to the end; the manager's later attempts are its own.
            let mut first = manager.clone();
            tokio::spawn(async move {
                let _ = redis::cmd("PING")
                    .query_async::<redis::Value>(&mut first)
                    .await;
            });
            Ok(Conn::Single(manager))
        }
        Prepared::Cluster { client, .. } => {
            match tokio::time::timeout(timeout * 4, client.get_async_connection()).await {
                Err(_) => Err(StoreError::Timeout(timeout * 4)),
                Ok(Err(e)) => Err(StoreError::Refused(e.to_string())),
                Ok(Ok(c)) => Ok(Conn::Cluster(c)),
            }
        }
    }
}

/// `client` speaking RESP3: its connection manager then hears of a connection the server
/// closed (a restart, a failover's `CLIENT KILL`) as it happens and reconnects at once, rather
/// than at the next call, which would fail without telling whether it ran. So the releases of
/// requests that end after a Redis restart reach the new server, and only calls in flight at
/// the very moment are in doubt.
fn resp3(client: &redis::Client) -> Result<redis::Client, StoreError> {
    let info = client.get_connection_info().clone();
    let settings = info
        .redis_settings()
        .clone()
        .set_protocol(redis::ProtocolVersion::RESP3);
    redis::Client::open(info.set_redis_settings(settings))
        .map_err(|e| StoreError::Refused(e.to_string()))
}

async fn invoke_on<T: redis::FromRedisValue>(
    invocation: &redis::ScriptInvocation<'_>,
    conn: &mut (impl ConnectionLike + Send),
) -> Result<T, StoreError> {
    invocation.invoke_async(conn).await.map_err(classify)
}
