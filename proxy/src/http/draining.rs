//! Draining: from the moment a stop or an upgrade begins, every HTTP/1.x answer closes its
//! connection (`Connection: close`), so that each kept-alive client moves to another node (or
//! to the new process) on its next request, and no connection is left idle for the old process
//! to close under a request already on its way.
//!
//! A server that closes an idle kept-alive connection races the client's next request on it: the
//! request reaches a closed socket and is answered by a reset, and a client may not send a
//! `POST` twice (RFC 9112 9.3.1), so it is lost. pingora closed its idle connections the moment
//! its shutdown began, and kept the others alive through the five seconds an upgrade waits
//! before that: the fleet soak saw a `createPet` reset exactly then. Now the gateway answers
//! with `Connection: close` from the signal on (this flag, set by `ops::stop_signals`), and its
//! idle connections stay open for the first half of the grace period ([`window`];
//! [`super::head_deadline`]'s `cleanup`), so only a connection unused through the whole drain is
//! closed under its client. What the requests of that half need runs on through it: the key
//! registry's sync (a revocation holds) and the top consumers' flush ([`drained`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pingora::server::ShutdownWatch;

/// Whether this process is draining; shared by the stop signals' watch and the request path.
#[derive(Clone, Debug, Default)]
pub struct Draining(Arc<AtomicBool>);

impl Draining {
    /// True once a stop or an upgrade has begun; never false again.
    pub fn is_on(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// Marks the drain begun; true the first time.
    pub fn begin(&self) -> bool {
        !self.0.swap(true, Ordering::Relaxed)
    }
}

/// How long after the shutdown begins requests on idle kept-alive connections are still taken:
/// half the grace period, so that the last of them has the other half to finish.
pub fn window(grace: Duration) -> Duration {
    grace / 2
}

/// Resolves once the shutdown has begun and then `window` has passed: when no request starts
/// any more, so work those requests need can end.
pub async fn drained(mut shutdown: ShutdownWatch, window: Duration) {
    if !*shutdown.borrow() {
        let _ = shutdown.changed().await;
    }
    if !window.is_zero() {
        tokio::time::sleep(window).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drain_begins_once_and_every_clone_sees_it() {
        let draining = Draining::default();
        let seen = draining.clone();
        assert!(!seen.is_on());
        assert!(draining.begin());
        assert!(!draining.begin(), "the second begin is no news");
        assert!(seen.is_on());
    }
}
