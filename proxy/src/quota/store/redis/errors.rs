//! A Redis error as the store's: whether the call surely did not run (another connection may
//! cure it, or the server refused it before running), may have run, or was answered wrong. Both
//! the connection (`link.rs`) and the quota function (`function.rs`) read errors this way: a
//! release sent again after it ran would free another request's place, so only a call that
//! surely did not run is ever sent again.

use crate::quota::store::StoreError;

/// A script's or a function's error as the store's: whether it surely did not run, may have
/// run (the connection), or was answered wrong.
pub(super) fn classify(e: redis::RedisError) -> StoreError {
    if not_run(&e) {
        StoreError::Refused(e.to_string())
    } else if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_cluster_error()
    {
        StoreError::Unavailable(e.to_string())
    } else {
        StoreError::Protocol(e.to_string())
    }
}

/// Whether the call surely did not run: refused at connecting, or answered by a server that
/// would not run it. Anything else says nothing of whether it ran: a connection closed while
/// the answer was awaited reads as a broken pipe, just like one found closed before sending,
/// and a timeout is a timeout. (A release sent again after it ran would free another
/// request's place.)
fn not_run(e: &redis::RedisError) -> bool {
    e.is_connection_refusal() || needs_another_connection(e) || function_missing(e)
}

/// A server that is no longer the primary (a failover demoted it), not yet one (loading), or
/// that refuses the credentials (a rotated password): another connection may cure it.
fn needs_another_connection(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(
            e.code(),
            Some("READONLY" | "MASTERDOWN" | "LOADING" | "NOAUTH" | "WRONGPASS")
        )
}

/// "Function not found": the server lacks the library (it surely did not run the call).
pub(super) fn function_missing(e: &redis::RedisError) -> bool {
    e.code() == Some("ERR")
        && e.detail()
            .is_some_and(|d| d.starts_with("Function not found"))
}
