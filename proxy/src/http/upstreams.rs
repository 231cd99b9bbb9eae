//! The backends: round-robin over the configured addresses with passive health. A backend that
//! refuses or times out a connection is skipped for a while, and the request that hit it is
//! retried on the next one, so one backend can restart without a client seeing an error.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How long a backend that failed a connection is left out of the rotation.
pub const COOL_DOWN: Duration = Duration::from_secs(5);

pub struct Upstreams {
    addrs: Vec<SocketAddr>,
    /// Per backend: milliseconds since `epoch` until which it is skipped (0: healthy).
    down_until: Vec<AtomicU64>,
    next: AtomicUsize,
    epoch: Instant,
}

impl Upstreams {
    pub fn new(addrs: Vec<SocketAddr>) -> Upstreams {
        Upstreams {
            down_until: addrs.iter().map(|_| AtomicU64::new(0)).collect(),
            addrs,
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

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// The next healthy backend in turn other than `avoid` (the one a retried request just
    /// failed on); else the next other one even if marked down (a down mark is a guess, the
    /// failure just seen is not); `avoid` itself only when it is the only backend.
    pub fn pick(&self, avoid: Option<SocketAddr>) -> SocketAddr {
        let n = self.addrs.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let now = self.now_ms();
        let healthy = |i: &usize| self.down_until[*i].load(Ordering::Relaxed) <= now;
        let other = |i: &usize| Some(self.addrs[*i]) != avoid;
        let in_turn = || (0..n).map(|i| (start + i) % n);
        in_turn()
            .filter(healthy)
            .find(other)
            .or_else(|| in_turn().find(other))
            .map_or(self.addrs[start % n], |i| self.addrs[i])
    }

    pub fn mark_down(&self, addr: SocketAddr) {
        if let Some(i) = self.addrs.iter().position(|a| *a == addr) {
            let until = self.now_ms() + COOL_DOWN.as_millis() as u64;
            self.down_until[i].store(until, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_skips_backends_marked_down() {
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
        let u = Upstreams::new(vec![a, b]);
        let picks: Vec<_> = (0..4).map(|_| u.pick(None)).collect();
        assert_eq!(picks, [a, b, a, b]);
        u.mark_down(a);
        assert!((0..4).all(|_| u.pick(None) == b));
        assert_eq!(
            u.pick(Some(b)),
            a,
            "a retry goes to another backend, even one marked down"
        );
        u.mark_down(b);
        let any = u.pick(None);
        assert!(any == a || any == b);
        assert!(
            (0..4).all(|_| u.pick(Some(a)) == b),
            "all down: not the one that failed"
        );
        let only = Upstreams::new(vec![a]);
        assert_eq!(only.pick(Some(a)), a, "the only backend: still an answer");
    }
}
