//! `ACQUIRE` as a Redis Function (`FCALL`), and the script (`EVALSHA`) where a server will not
//! run functions.
//!
//! A script's top level runs on every `EVALSHA`: each `local function` of the state's and the
//! leases' code is made again, and the head (the ban policy and the sets of limits) read again.
//! A function library's top level runs once, at `FUNCTION LOAD`, and its locals outlive a call,
//! so the head one run read serves the next (`scripts::ACQUIRE_LIBRARY`). Redis's instructions a
//! decision, one hot key (`bench/script_cost.py --function`): 131,600 a run of one decision by
//! `EVALSHA`, 84,700 by `FCALL`; 20,400 and 17,900 at 16 a run; 13,700 and 13,500 at 128.
//!
//! The library is named by the script's digest (the same text), `pet_gateway_<16 hex>`, and so is its one
//! function, `pet_acquire_<16 hex>`: nodes of two versions during an upgrade each load and call
//! their own, and loading again is harmless (`FUNCTION LOAD REPLACE` of the same text). A
//! server without the library (restarted without persistence, flushed, a replica promoted
//! before it had it) answers "Function not found": the library is loaded and the call sent
//! again, within the same deadline, as redis-rs does for a script on `NOSCRIPT`. A server
//! without functions (before Redis 7.0) or a user not allowed `FCALL` or `FUNCTION LOAD` (an
//! ACL from before this version, `deploy/redis/acl-users`) gets the script for a minute, then
//! functions are tried again; the log says so once. Either way every decision is the same: one
//! text, run whole or in two parts.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use redis::aio::ConnectionLike;

use super::link::classify;
use crate::quota::store::scripts::{ACQUIRE, ACQUIRE_LIBRARY, ACQUIRE_RUN};
use crate::quota::store::StoreError;

/// How long a server that would not run the function gets the script before it is tried again.
const SCRIPT_FOR: Duration = Duration::from_secs(60);

/// One `ACQUIRE` call: the quotas' keys and the two packed arguments (see `scripts::ACQUIRE`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct AcquireCall {
    pub keys: Vec<String>,
    pub head: Vec<u8>,
    pub entries: Vec<u8>,
}

/// How `ACQUIRE` is sent: by `FCALL` where the server allows it, else by `EVALSHA`.
pub(crate) struct Acquire {
    script: redis::Script,
    /// The text `FUNCTION LOAD` takes.
    library: String,
    function: String,
    born: Instant,
    /// Until when (milliseconds after `born`) calls go by the script; 0: none.
    script_until_ms: AtomicU64,
    warned: AtomicBool,
}

impl Acquire {
    pub(super) fn new() -> Acquire {
        let script = redis::Script::new(ACQUIRE);
        // The script's digest names the library: ACQUIRE is its two parts, whole.
        let tag = script.get_hash().get(..16).unwrap_or("0").to_owned();
        let function = format!("pet_acquire_{tag}");
        let library = format!(
            "#!lua name=pet_gateway_{tag}\n{ACQUIRE_LIBRARY}\n\
             redis.register_function('{function}', function(KEYS, ARGV)\n{ACQUIRE_RUN}\nend)\n"
        );
        Acquire {
            script,
            library,
            function,
            born: Instant::now(),
            script_until_ms: AtomicU64::new(0),
            warned: AtomicBool::new(false),
        }
    }

    /// The function's name, as `FCALL` takes it.
    #[cfg(test)]
    pub(super) fn function(&self) -> &str {
        &self.function
    }

    /// Sends `call` on `conn`; the caller holds the deadline.
    pub(super) async fn call_on(
        &self,
        conn: &mut (impl ConnectionLike + Send),
        call: &AcquireCall,
    ) -> Result<Vec<i64>, StoreError> {
        if self.functions_now() {
            let fcall = self.fcall(call);
            match fcall.query_async::<Vec<i64>>(conn).await {
                Ok(values) => return Ok(values),
                Err(e) if function_missing(&e) => {
                    let load = redis::cmd("FUNCTION")
                        .arg("LOAD")
                        .arg("REPLACE")
                        .arg(&self.library)
                        .query_async::<redis::Value>(conn)
                        .await;
                    match load {
                        Ok(_) => return fcall.query_async(conn).await.map_err(classify),
                        Err(e) if not_allowed(&e) => self.use_the_script(&e),
                        Err(e) => return Err(classify(e)),
                    }
                }
                Err(e) if not_allowed(&e) => self.use_the_script(&e),
                Err(e) => return Err(classify(e)),
            }
        }
        let mut invocation = self.script.prepare_invoke();
        for key in &call.keys {
            invocation.key(key);
        }
        invocation.arg(&call.head).arg(&call.entries);
        invocation.invoke_async(conn).await.map_err(classify)
    }

    fn fcall(&self, call: &AcquireCall) -> redis::Cmd {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(&self.function).arg(call.keys.len());
        for key in &call.keys {
            cmd.arg(key);
        }
        cmd.arg(&call.head).arg(&call.entries);
        cmd
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn functions_now(&self) -> bool {
        let until = self.script_until_ms.load(Ordering::Relaxed);
        until == 0 || self.now_ms() >= until
    }

    fn use_the_script(&self, e: &redis::RedisError) {
        let until = self
            .now_ms()
            .saturating_add(SCRIPT_FOR.as_millis() as u64)
            .max(1);
        self.script_until_ms.store(until, Ordering::Relaxed);
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                error = %e,
                "Redis will not run the quota function (FCALL, FUNCTION LOAD: Redis before 7.0, \
                 or an ACL without them); deciding by EVALSHA instead, which costs Redis more a \
                 decision; tried again every minute, said once"
            );
        }
    }
}

/// "Function not found": the server lacks the library (it surely did not run the call).
pub(super) fn function_missing(e: &redis::RedisError) -> bool {
    e.code() == Some("ERR")
        && e.detail()
            .is_some_and(|d| d.starts_with("Function not found"))
}

/// A server without functions, or a user not allowed them: the call did not run.
fn not_allowed(e: &redis::RedisError) -> bool {
    e.code() == Some("NOPERM")
        || (e.code() == Some("ERR") && e.detail().is_some_and(|d| d.starts_with("unknown command")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_library_is_the_script_in_two_parts_named_by_its_digest() {
        assert_eq!(ACQUIRE, format!("{ACQUIRE_LIBRARY}{ACQUIRE_RUN}"));
        let acquire = Acquire::new();
        let script = redis::Script::new(ACQUIRE);
        let tag = &script.get_hash()[..16];
        assert_eq!(acquire.function(), format!("pet_acquire_{tag}"));
        // Redis takes names of letters, digits and underscores only.
        assert!(acquire
            .function()
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_'));
        let first = acquire.library.lines().next().unwrap_or_default();
        assert_eq!(first, format!("#!lua name=pet_gateway_{tag}"));
        assert!(acquire
            .library
            .contains(&format!("redis.register_function('pet_acquire_{tag}'")));
    }
}
