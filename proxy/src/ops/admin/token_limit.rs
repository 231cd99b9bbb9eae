//! Wrong admin tokens, limited by peer: once an address has sent [`MAX_FAILURES`] wrong tokens
//! within [`WINDOW`] of its first, every request from it is answered 429 with `Retry-After`
//! until that window has passed, without the token even being compared. A token of 32 or more
//! random characters cannot be guessed at 10 tries a minute; the limit keeps a guesser from
//! trying at the listener's full speed, and from filling its one thread while trying.
//!
//! The peer is the socket's: the admin listener is reached directly (loopback, a private
//! network, a tunnel), never through the proxies `trusted_proxies` names. An IPv6 peer counts
//! by its /64, which one host holds whole, so it cannot hop addresses within it.
//!
//! The table holds at most [`CAPACITY`] peers. When it is full, the windows that have passed are
//! dropped first, then the peer whose window began longest ago: memory stays bounded, and the
//! price is that a guesser with more than [`CAPACITY`] addresses may see a limited peer of its
//! own forgotten (each address still gets only [`MAX_FAILURES`] tries a window).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Wrong tokens a peer may send within one window.
pub const MAX_FAILURES: u32 = 10;
/// How long a peer's count lasts from its first wrong token; a limited peer waits it out.
pub const WINDOW: Duration = Duration::from_secs(60);
/// The most peers remembered at once.
pub const CAPACITY: usize = 4096;

#[derive(Debug, Clone, Copy)]
struct Count {
    since: Instant,
    failures: u32,
}

/// The wrong tokens counted per peer.
#[derive(Debug)]
pub struct TokenLimit {
    peers: Mutex<HashMap<IpAddr, Count>>,
    max_failures: u32,
    window: Duration,
    capacity: usize,
}

impl Default for TokenLimit {
    fn default() -> TokenLimit {
        TokenLimit::new(MAX_FAILURES, WINDOW, CAPACITY)
    }
}

impl TokenLimit {
    pub fn new(max_failures: u32, window: Duration, capacity: usize) -> TokenLimit {
        TokenLimit {
            peers: Mutex::new(HashMap::new()),
            max_failures,
            window,
            capacity: capacity.max(1),
        }
    }

    /// While `peer` is limited, how long until its window ends.
    pub fn limited(&self, peer: IpAddr, now: Instant) -> Option<Duration> {
        let mut peers = self.lock();
        let key = counted(peer);
        let count = *peers.get(&key)?;
        let ends = count.since + self.window;
        if now >= ends {
            peers.remove(&key);
            return None;
        }
        (count.failures >= self.max_failures).then(|| ends - now)
    }

    /// Counts a wrong token from `peer`.
    pub fn failed(&self, peer: IpAddr, now: Instant) {
        let mut peers = self.lock();
        let key = counted(peer);
        let window = self.window;
        if !peers.contains_key(&key) && peers.len() >= self.capacity {
            peers.retain(|_, c| now < c.since + window);
            if peers.len() >= self.capacity {
                let oldest = peers.iter().min_by_key(|(_, c)| c.since).map(|(k, _)| *k);
                if let Some(oldest) = oldest {
                    peers.remove(&oldest);
                }
            }
        }
        let count = peers.entry(key).or_insert(Count {
            since: now,
            failures: 0,
        });
        if now >= count.since + window {
            *count = Count {
                since: now,
                failures: 0,
            };
        }
        count.failures = count.failures.saturating_add(1);
    }

    /// A right token: the peer's earlier mistakes are forgotten.
    pub fn succeeded(&self, peer: IpAddr) {
        self.lock().remove(&counted(peer));
    }

    /// Peers remembered now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A poisoned lock still holds counts worth keeping: a panic elsewhere must not open the
    /// listener to unlimited guessing.
    fn lock(&self) -> MutexGuard<'_, HashMap<IpAddr, Count>> {
        self.peers.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The address a peer is counted by: an IPv4 address (or an IPv4-mapped IPv6 one) as it is,
/// an IPv6 one by its /64.
fn counted(peer: IpAddr) -> IpAddr {
    match peer {
        IpAddr::V4(_) => peer,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let bits = u128::from(v6) & !((1u128 << 64) - 1);
                IpAddr::V6(bits.into())
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_peer_is_limited_after_its_failures_until_the_window_ends() {
        let limit = TokenLimit::new(3, Duration::from_secs(60), 16);
        let t0 = Instant::now();
        let (a, b) = (ip("10.0.0.1"), ip("10.0.0.2"));
        for i in 0..3 {
            assert_eq!(limit.limited(a, t0), None, "failure {i}");
            limit.failed(a, t0 + Duration::from_secs(i));
        }
        assert_eq!(
            limit.limited(a, t0 + Duration::from_secs(10)),
            Some(Duration::from_secs(50))
        );
        assert_eq!(limit.limited(b, t0), None, "another peer is not limited");
        assert_eq!(limit.limited(a, t0 + Duration::from_secs(60)), None);
        assert_eq!(limit.len(), 0, "a passed window is forgotten");
        // A new window starts with the next failure.
        limit.failed(a, t0 + Duration::from_secs(61));
        assert_eq!(limit.limited(a, t0 + Duration::from_secs(62)), None);
    }

    #[test]
    fn a_right_token_forgets_earlier_mistakes() {
        let limit = TokenLimit::new(2, Duration::from_secs(60), 16);
        let (t0, a) = (Instant::now(), ip("10.0.0.1"));
        limit.failed(a, t0);
        limit.succeeded(a);
        limit.failed(a, t0);
        assert_eq!(limit.limited(a, t0), None);
    }

    #[test]
    fn the_table_is_capped_and_the_oldest_peer_goes_first() {
        let limit = TokenLimit::new(1, Duration::from_secs(60), 3);
        let t0 = Instant::now();
        for (i, peer) in ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]
            .into_iter()
            .enumerate()
        {
            limit.failed(ip(peer), t0 + Duration::from_secs(i as u64));
        }
        assert_eq!(limit.len(), 3);
        let now = t0 + Duration::from_secs(5);
        assert_eq!(limit.limited(ip("10.0.0.1"), now), None, "the oldest went");
        for kept in ["10.0.0.2", "10.0.0.3", "10.0.0.4"] {
            assert!(limit.limited(ip(kept), now).is_some(), "{kept}");
        }
        // Passed windows go before any live one.
        let later = t0 + Duration::from_secs(62);
        limit.failed(ip("10.0.0.9"), later);
        assert_eq!(limit.len(), 2, "the two passed windows were dropped");
    }

    #[test]
    fn an_ipv6_peer_counts_by_its_64_and_a_mapped_ipv4_one_as_ipv4() {
        let limit = TokenLimit::new(2, Duration::from_secs(60), 16);
        let t0 = Instant::now();
        limit.failed(ip("2001:db8:1:2::1"), t0);
        limit.failed(ip("2001:db8:1:2:ffff::9"), t0);
        assert!(limit.limited(ip("2001:db8:1:2::77"), t0).is_some());
        assert_eq!(limit.limited(ip("2001:db8:1:3::1"), t0), None);
        limit.failed(ip("::ffff:10.0.0.1"), t0);
        limit.failed(ip("10.0.0.1"), t0);
        assert!(limit.limited(ip("10.0.0.1"), t0).is_some());
    }
}
