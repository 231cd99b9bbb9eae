//! `ACQUIRE` as a Redis Function (`FCALL`), and the script (`EVALSHA`) where a server will not
//! run functions.
//!
//! A script's top level runs on every `EVALSHA`: each `local function` of the state's and the
//! leases' code is made again, and the head (the ban policy and the sets of limits) read again.
//! A function library's top level runs once, at `FUNCTION LOAD`, and its locals outlive a call,
//! so the head one run read serves the next (`scripts::ACQUIRE_LIBRARY`). Redis's instructions a
//! decision, one hot key (`bench/script_cost.py --rev WORK --rev WORK+fcall`): 131,600 a run of one decision by
//! `EVALSHA`, 84,700 by `FCALL`; 20,400 and 17,900 at 16 a run; 13,700 and 13,500 at 128.
//!
//! The library is named by the digest of its text, `pet_gateway_<16 hex>`, and so is its one
//! function, `pet_acquire_<16 hex>`: nodes of two versions during an upgrade each load and call
//! their own, and loading again is harmless (`FUNCTION LOAD REPLACE` of the same text). A
//! server without the library (restarted without persistence, flushed, a replica promoted
//! before it had it) answers "Function not found": the library is loaded and the call sent
//! again, within the same deadline, as redis-rs does for a script on `NOSCRIPT`. A server
//! without functions (before Redis 7.0) or a user not allowed `FCALL` or `FUNCTION LOAD` (an
//! ACL from before this version, `deploy/redis/acl-users`) gets the script for a minute, then
//! functions are tried again; the log says so at each switch. So does a library that fails to
//! load for another reason (too little memory to compile it). A call that may have run (it
//! reached the function) is never sent again by the script. Either way every decision is the
//! same: one text, run whole or in two parts.
//!
//! A library is shared by every user and runs with its caller's rights, and any user allowed
//! `FUNCTION LOAD` may replace it: only the `gateway` user is given it, and what a planted
//! library could do is what that user's own commands can (deploy/README.md, "Redis over TLS,
//! with a password, behind Sentinel").

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use redis::aio::ConnectionLike;

use super::errors::{classify, function_missing};
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
    /// The library's name and its function's.
    name: String,
    function: String,
    born: Instant,
    /// Until when (milliseconds after `born`) calls go by the script; 0: none.
    script_until_ms: AtomicU64,
    /// One `FUNCTION LOAD` at a time from this node, and none for calls that learnt the library
    /// was missing before another call loaded it: after a flush, every lane of a node (a
    /// Cluster has one per slot) would otherwise send its own copy, each compiled on Redis's
    /// one thread and written to its AOF. The number counts this node's loads.
    loading: tokio::sync::Mutex<()>,
    loads: AtomicU64,
}

impl Acquire {
    pub(super) fn new() -> Acquire {
        let template = format!(
            "#!lua name=pet_gateway_@TAG@\n{ACQUIRE_LIBRARY}\n\
             redis.register_function('pet_acquire_@TAG@', function(KEYS, ARGV)\n{ACQUIRE_RUN}\nend)\n"
        );
        // Named by the digest of the whole library, so that any change to what is loaded (the
        // script or its wrapper) is a library of another name, never one that keeps the name.
        let tag = redis::Script::new(&template)
            .get_hash()
            .get(..16)
            .unwrap_or("0")
            .to_owned();
        Acquire {
            script: redis::Script::new(ACQUIRE),
            library: template.replace("@TAG@", &tag),
            name: format!("pet_gateway_{tag}"),
            function: format!("pet_acquire_{tag}"),
            born: Instant::now(),
            script_until_ms: AtomicU64::new(0),
            loading: tokio::sync::Mutex::new(()),
            loads: AtomicU64::new(0),
        }
    }

    /// The function's name, as `FCALL` takes it.
    #[cfg(test)]
    pub(super) fn function(&self) -> &str {
        &self.function
    }

    /// Sends `call` on `conn`; the caller holds the deadline. Once an `FCALL` may have run, its
    /// outcome is the answer: the script is sent only in place of one that surely did not run
    /// (a decision counted twice, or a release given back twice, would free another request's
    /// place).
    pub(super) async fn call_on(
        &self,
        conn: &mut (impl ConnectionLike + Send),
        call: &AcquireCall,
    ) -> Result<Vec<i64>, StoreError> {
        if self.functions_now() {
            let fcall = self.fcall(call);
            let loads = self.loads.load(Ordering::Acquire);
            match fcall.query_async::<Vec<i64>>(conn).await {
                Ok(values) => return Ok(values),
                Err(e) if function_missing(&e) => match self.load(conn, loads).await {
                    Ok(()) => return fcall.query_async(conn).await.map_err(classify),
                    Err(e) if e.is_io_error() || e.is_connection_dropped() || e.is_timeout() => {
                        // The call did not run; whether the library is there now is unknown.
                        return Err(StoreError::Refused(e.to_string()));
                    }
                    // Refused (an ACL without it), or failing where the script may not (too
                    // little memory to compile, a host that disables functions): the script.
                    Err(e) => self.use_the_script(&e),
                },
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

    /// Loads the library, unless another call of this node did since `seen` loads.
    async fn load(
        &self,
        conn: &mut (impl ConnectionLike + Send),
        seen: u64,
    ) -> Result<(), redis::RedisError> {
        let _one = self.loading.lock().await;
        if self.loads.load(Ordering::Acquire) != seen {
            return Ok(());
        }
        redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg("REPLACE")
            .arg(&self.library)
            .query_async::<redis::Value>(conn)
            .await?;
        self.loads.fetch_add(1, Ordering::AcqRel);
        tracing::info!(library = %self.name, "loaded the quota function into Redis");
        Ok(())
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

    /// Calls go by the script for [`SCRIPT_FOR`]; said at each switch (so at most once a
    /// minute), never silently.
    fn use_the_script(&self, e: &redis::RedisError) {
        let until = self
            .now_ms()
            .saturating_add(SCRIPT_FOR.as_millis() as u64)
            .max(1);
        let before = self.script_until_ms.swap(until, Ordering::Relaxed);
        if before == 0 || self.now_ms() >= before {
            tracing::warn!(
                error = %e,
                library = %self.name,
                "Redis will not run the quota function (Redis before 7.0, an ACL without \
                 +fcall +function|load, or the library failed to load); deciding by EVALSHA for \
                 a minute, which costs Redis more a decision, then trying the function again"
            );
        }
    }
}

/// `FCALL` or `FUNCTION LOAD` themselves refused (a user not allowed them) or unknown (Redis
/// before 7.0): the call did not run. Not a refusal from inside the function (a command it
/// runs that the ACL denies: Redis says "script: …" then), after which the function may have
/// written some of its keys.
fn not_allowed(e: &redis::RedisError) -> bool {
    let detail = e.detail().unwrap_or("");
    let ours = |d: &str| {
        let d = d.to_ascii_lowercase();
        d.contains("fcall") || d.contains("function")
    };
    if detail.contains(" script: ") {
        return false;
    }
    match e.code() {
        Some("NOPERM") => ours(detail),
        Some("ERR") => detail.starts_with("unknown command") && ours(detail),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error a server answering `reply` (one RESP error line) gives.
    fn error(reply: &str) -> redis::RedisError {
        let value = redis::parse_redis_value(format!("-{reply}\r\n").as_bytes())
            .expect("a RESP error parses");
        value.extract_error().expect_err("an error reply")
    }

    #[test]
    fn only_fcall_and_function_load_refused_or_unknown_send_the_script() {
        for reply in [
            "NOPERM this user has no permissions to run the 'fcall' command",
            "NOPERM this user has no permissions to run the 'function|load' command",
            "ERR unknown command 'FCALL', with args beginning with: 'pet_acquire_x' '1'",
            "ERR unknown command `FUNCTION`, with args beginning with: `LOAD` ",
        ] {
            assert!(not_allowed(&error(reply)), "{reply}");
        }
        // From inside the function (Redis 7.2 and later say NOPERM; 7.0 says ERR): it ran, and
        // may have written some of its keys.
        for reply in [
            "NOPERM this user has no permissions to run the 'set' command script: pet_acquire_x, \
             on @user_function:412.",
            "NOPERM this user has no permissions to run the 'fcall' command script: x, on \
             @user_function:1.",
            "ERR The user executing the script can't run this command or subcommand script: \
             pet_acquire_x, on @user_function:412.",
            "NOPERM this user has no permissions to access one of the keys used as arguments",
            "OOM command not allowed when used memory > 'maxmemory'.",
            "ERR Function not found",
        ] {
            assert!(!not_allowed(&error(reply)), "{reply}");
        }
        assert!(function_missing(&error("ERR Function not found")));
        assert!(!function_missing(&error("NOSCRIPT No matching script")));
    }

    #[test]
    fn the_library_is_the_script_in_two_parts_named_by_its_digest() {
        assert_eq!(ACQUIRE, format!("{ACQUIRE_LIBRARY}{ACQUIRE_RUN}"));
        let acquire = Acquire::new();
        let tag = acquire
            .function()
            .strip_prefix("pet_acquire_")
            .expect("named pet_acquire_<tag>");
        assert_eq!(tag.len(), 16);
        // The tag is the digest of the library with the tag left out: any change to the text
        // loaded changes the name.
        let template = acquire.library.replace(tag, "@TAG@");
        assert_eq!(&redis::Script::new(&template).get_hash()[..16], tag);
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
