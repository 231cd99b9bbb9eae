//! The backends: round-robin over the configured addresses with passive health. A backend that
//! refuses or times out a connection is skipped for a while, and the request that hit it is
//! retried on the next one, so one backend can restart without a client seeing an error.
//! Backends are named by their index in the configured list; one given by host name follows
//! its name's address ([`super::names`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pingora::server::ShutdownWatch;

use super::names::{Address, UpstreamAddr};

/// How long a backend that failed a connection is left out of the rotation.
pub const COOL_DOWN: Duration = Duration::from_secs(5);

pub struct Rotation {
    addrs: Vec<Address>,
    /// Per backend: milliseconds since `epoch` until which it is skipped (0: healthy).
    down_until: Vec<AtomicU64>,
    next: AtomicUsize,
    epoch: Instant,
}

impl Rotation {
    pub fn new(backends: Vec<UpstreamAddr>) -> Rotation {
        Rotation {
            down_until: backends.iter().map(|_| AtomicU64::new(0)).collect(),
            addrs: backends.into_iter().map(Address::new).collect(),
            next: AtomicUsize::new(0),
            epoch: Instant::now(),
        }
    }

    pub fn len(&self) -> usize {
        self.addrs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.addrs.is_empty()
    }

    /// The address of backend `i` now.
    pub fn addr(&self, i: usize) -> SocketAddr {
        self.addrs[i % self.addrs.len()].get()
    }

    /// Every backend's address now.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.addrs.iter().map(Address::get).collect()
    }

    /// Every backend's label for metrics: its name as written, else its address.
    pub fn labels(&self) -> Vec<String> {
        self.addrs.iter().map(Address::label).collect()
    }

    /// Whether backend `i` was given by host name (so a failed connection may be a move).
    pub fn is_named(&self, i: usize) -> bool {
        self.addrs.get(i).is_some_and(Address::is_named)
    }

    /// Looks backend `i`'s name up again ([`Address::look_up_again`]); whether it is now
    /// somewhere else than `failed` (the address a connection just failed at, when there is
    /// one: a lookup made by another request in the same second counts too). When it moved it
    /// is back in the rotation at once: the failure that marked it down was at the old address.
    pub async fn look_up_again(&self, i: usize, failed: Option<SocketAddr>) -> bool {
        let Some(address) = self.addrs.get(i) else {
            return false;
        };
        let changed = address.look_up_again().await.is_some();
        let moved = match failed {
            Some(failed) => address.get() != failed,
            None => changed,
        };
        if moved {
            self.down_until[i].store(0, Ordering::Relaxed);
        }
        moved
    }

    /// Looks every named backend up again every `interval`, until `shutdown`: a backend that
    /// moved while no connection to it failed (its old address now someone else's, or a new
    /// one beside) is followed too. Nothing to do without names, or with a zero interval.
    pub async fn run_lookups(&self, interval: Duration, mut shutdown: ShutdownWatch) {
        if interval.is_zero() || !self.addrs.iter().any(Address::is_named) {
            return;
        }
        loop {
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = shutdown.changed() => return,
            }
            for i in 0..self.addrs.len() {
                self.look_up_again(i, None).await;
            }
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// The backends in this request's turn: every one, starting from the next in rotation.
    pub fn in_turn(&self) -> impl Iterator<Item = usize> + '_ {
        let n = self.addrs.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..n).map(move |i| (start + i) % n)
    }

    /// Whether backend `i` is in the rotation (not marked down).
    pub fn healthy(&self, i: usize) -> bool {
        self.down_until[i].load(Ordering::Relaxed) <= self.now_ms()
    }

    /// The next healthy backend in turn other than `avoid` (the one a retried request just
    /// failed on); else the next other one even if marked down (a down mark is a guess, the
    /// failure just seen is not); `avoid` itself only when it is the only backend.
    pub fn pick(&self, avoid: Option<usize>) -> usize {
        let n = self.addrs.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let in_turn = || (0..n).map(|i| (start + i) % n);
        let other = |i: &usize| Some(*i) != avoid;
        in_turn()
            .filter(|i| self.healthy(*i))
            .find(other)
            .or_else(|| in_turn().find(other))
            .unwrap_or(start % n.max(1))
    }

    pub fn mark_down(&self, i: usize) {
        if let Some(down) = self.down_until.get(i) {
            let until = self.now_ms() + COOL_DOWN.as_millis() as u64;
            down.store(until, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two requests fail at a backend's old address in the same second: the first looks its
    /// name up, the second (inside the gap, no lookup of its own) still learns that it moved.
    #[tokio::test]
    async fn a_request_failing_just_after_anothers_lookup_sees_the_move() {
        let old: SocketAddr = "192.0.2.1:1".parse().unwrap();
        let u = Rotation::new(vec![UpstreamAddr {
            addr: old,
            name: Some("localhost:1".to_owned()),
        }]);
        u.mark_down(0);
        assert!(
            u.look_up_again(0, Some(old)).await,
            "the first finds the move"
        );
        assert!(u.healthy(0), "back in the rotation at its new address");
        u.mark_down(0);
        assert!(
            u.look_up_again(0, Some(old)).await,
            "the second takes the first's answer"
        );
        let now = u.addr(0);
        assert!(
            !u.look_up_again(0, Some(now)).await,
            "a failure at the new address is no move"
        );
    }

    #[test]
    fn round_robin_skips_backends_marked_down() {
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
        let u = Rotation::new(vec![a.into(), b.into()]);
        let picks: Vec<_> = (0..4).map(|_| u.addr(u.pick(None))).collect();
        assert_eq!(picks, [a, b, a, b]);
        u.mark_down(0);
        assert!((0..4).all(|_| u.pick(None) == 1));
        assert_eq!(
            u.pick(Some(1)),
            0,
            "a retry goes to another backend, even one marked down"
        );
        u.mark_down(1);
        let any = u.pick(None);
        assert!(any == 0 || any == 1);
        assert!(
            (0..4).all(|_| u.pick(Some(0)) == 1),
            "all down: not the one that failed"
        );
        let only = Rotation::new(vec![a.into()]);
        assert_eq!(only.pick(Some(0)), 0, "the only backend: still an answer");
    }
}
