//! The per-client limit on requests with a missing or invalid key. It lives in this process
//! (GCRA): floods of bad keys are stopped before they cost a Redis round trip, and guessing
//! keys from one client is slowed to this rate.
//!
//! - A client is an IPv4 address, or an IPv6 network of `ipv6_prefix` bits (default /64: one
//!   host usually holds a whole /64 and could otherwise rotate through it to escape the limit).
//! - At most `max_tracked` clients are remembered; past that the longest-tracked is forgotten
//!   first, so a flood from many addresses costs bounded memory, whatever the sweep interval.
//! - Behind a load balancer every request comes from the balancer's address: with
//!   `trusted_proxies` set, a request from one of those addresses is attributed to the address
//!   its `X-Forwarded-For` names (the right-most one that is not itself a trusted proxy, since
//!   anything left of that the client wrote itself). From any other peer the header is ignored.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Mutex;
use std::time::Instant;

use ipnet::IpNet;

use crate::quota::rules::SimpleLimit;
use crate::quota::rules::{gcra_refill_secs, retry_after_secs};

/// The limiter's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnauthSettings {
    pub per_minute: u32,
    /// IPv6 clients are grouped by this many leading bits (1 to 128).
    pub ipv6_prefix: u8,
    /// Clients remembered at most.
    pub max_tracked: usize,
    /// Peers whose `X-Forwarded-For` is believed.
    pub trusted_proxies: Vec<IpNet>,
}

impl Default for UnauthSettings {
    fn default() -> Self {
        UnauthSettings {
            per_minute: 60,
            ipv6_prefix: 64,
            max_tracked: 100_000,
            trusted_proxies: Vec::new(),
        }
    }
}

const SHARDS: usize = 16;

/// One shard: each client's GCRA "theoretical arrival time" (ns since the limiter's start),
/// and the order clients were first tracked in, for eviction.
#[derive(Default)]
struct Shard {
    tat: HashMap<IpAddr, u64>,
    order: VecDeque<IpAddr>,
}

pub struct UnauthLimiter {
    settings: UnauthSettings,
    shards: Box<[Mutex<Shard>]>,
    /// Nanoseconds between two requests at the steady rate.
    interval: u64,
    started: Instant,
    hasher: std::collections::hash_map::RandomState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnauthDecision {
    /// Answer 401, reporting this limit.
    Allowed(SimpleLimit),
    /// Answer 429: this client has used up its unauthenticated requests.
    Refused {
        limit: SimpleLimit,
        retry_after: u64,
    },
}

impl UnauthLimiter {
    pub fn new(settings: UnauthSettings) -> UnauthLimiter {
        let per_minute = settings.per_minute.max(1);
        UnauthLimiter {
            interval: 60_000_000_000 / u64::from(per_minute),
            settings: UnauthSettings {
                per_minute,
                ipv6_prefix: settings.ipv6_prefix.clamp(1, 128),
                max_tracked: settings.max_tracked.max(SHARDS),
                ..settings
            },
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            started: Instant::now(),
            hasher: std::collections::hash_map::RandomState::new(),
        }
    }

    /// Whether `peer` is one of `trusted_proxies`: what it says of the request (the client's
    /// address, a trace's sampled flag) is believed.
    pub fn trusts(&self, peer: IpAddr) -> bool {
        self.settings
            .trusted_proxies
            .iter()
            .any(|n| n.contains(&peer))
    }

    /// The client a request counts against: the peer, or for a trusted proxy the address its
    /// `X-Forwarded-For` (all of the request's such headers, in order) names; then grouped.
    pub fn client(&self, peer: IpAddr, forwarded_for: &[&[u8]]) -> IpAddr {
        let peer = peer.to_canonical();
        let trusted = |ip: &IpAddr| self.settings.trusted_proxies.iter().any(|n| n.contains(ip));
        let mut client = peer;
        if trusted(&peer) {
            let hops = forwarded_for
                .iter()
                .flat_map(|v| v.split(|&b| b == b','))
                .map(|hop| std::str::from_utf8(hop).ok().and_then(parse_hop))
                .collect::<Vec<_>>();
            // Right to left: each trusted hop vouches for the one before it. A hop that is not
            // an address ends the chain where it is (nothing left of it can be believed).
            for hop in hops.into_iter().rev() {
                match hop {
                    Some(ip) => {
                        client = ip.to_canonical();
                        if !trusted(&client) {
                            break;
                        }
                    }
                    None => break,
                }
            }
        }
        self.group(client)
    }

    fn group(&self, ip: IpAddr) -> IpAddr {
        match ip {
            IpAddr::V4(_) => ip,
            IpAddr::V6(v6) => {
                let bits = u128::from(v6);
                let prefix = u32::from(self.settings.ipv6_prefix);
                let mask = u128::MAX.checked_shl(128 - prefix).unwrap_or(0);
                IpAddr::V6(Ipv6Addr::from(bits & mask))
            }
        }
    }

    fn shard(&self, client: &IpAddr) -> &Mutex<Shard> {
        // A keyed hash: clients cannot choose addresses that all land in one shard and push
        // everyone else out of it.
        use std::hash::BuildHasher;
        let h = self.hasher.hash_one(client) as usize;
        &self.shards[h % SHARDS]
    }

    /// Counts one request of `client` (as [`UnauthLimiter::client`] gives it).
    pub fn check(&self, client: IpAddr, now_unix: u64) -> UnauthDecision {
        let now = u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let limit = u64::from(self.settings.per_minute);
        let capacity = self.interval * limit;
        let per_shard = self.settings.max_tracked / SHARDS;
        let mut shard = self
            .shard(&client)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let Shard { tat, order } = &mut *shard;
        let known = tat.get(&client).copied();
        let next = known.unwrap_or(now).max(now) + self.interval;
        if next - now > capacity {
            let retry_after =
                retry_after_secs(std::time::Duration::from_nanos(next - capacity - now));
            return UnauthDecision::Refused {
                limit: SimpleLimit {
                    limit,
                    remaining: 0,
                    reset: now_unix + gcra_refill_secs(limit, limit),
                },
                retry_after,
            };
        }
        if known.is_none() {
            while tat.len() >= per_shard {
                match order.pop_front() {
                    Some(oldest) => {
                        tat.remove(&oldest);
                    }
                    None => break,
                }
            }
            order.push_back(client);
        }
        tat.insert(client, next);
        let remaining = (capacity - (next - now)) / self.interval;
        UnauthDecision::Allowed(SimpleLimit {
            limit,
            remaining,
            reset: now_unix + gcra_refill_secs(limit - remaining.min(limit), limit),
        })
    }

    /// Forgets clients whose allowance is full again.
    pub fn sweep(&self) {
        let now = u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(|p| p.into_inner());
            let Shard { tat, order } = &mut *shard;
            tat.retain(|_, t| *t > now);
            order.retain(|c| tat.contains_key(c));
            tat.shrink_to_fit();
            order.shrink_to_fit();
        }
    }

    /// Clients tracked now.
    pub fn tracked(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).tat.len())
            .sum()
    }
}

/// One `X-Forwarded-For` hop: an address, with or without a port (`192.0.2.1:5678`,
/// `[2001:db8::1]:443`). Anything else (`unknown`, an obfuscated name) is not an address.
fn parse_hop(hop: &str) -> Option<IpAddr> {
    let hop = hop.trim();
    if let Ok(ip) = hop.parse() {
        return Some(ip);
    }
    if let Some(rest) = hop.strip_prefix('[') {
        return rest.split_once(']')?.0.parse().ok();
    }
    let (host, port) = hop.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    host.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(per_minute: u32) -> UnauthLimiter {
        UnauthLimiter::new(UnauthSettings {
            per_minute,
            ..UnauthSettings::default()
        })
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn allows_the_per_minute_budget_per_address_then_refuses() {
        let l = limiter(3);
        let a = ip("192.0.2.1");
        let b = ip("192.0.2.2");
        for expected in [2, 1, 0] {
            match l.check(a, 1_000) {
                UnauthDecision::Allowed(s) => assert_eq!((s.limit, s.remaining), (3, expected)),
                other => panic!("{other:?}"),
            }
        }
        match l.check(a, 1_000) {
            UnauthDecision::Refused { retry_after, .. } => assert!((1..=20).contains(&retry_after)),
            other => panic!("{other:?}"),
        }
        assert!(matches!(l.check(b, 1_000), UnauthDecision::Allowed(_)));
    }

    #[test]
    fn ipv6_clients_are_grouped_by_their_64_bit_prefix() {
        let l = limiter(2);
        let peer = |s: &str| l.client(ip(s), &[]);
        assert_eq!(peer("2001:db8:1:2::1"), peer("2001:db8:1:2:ffff:1:2:3"));
        assert_ne!(peer("2001:db8:1:2::1"), peer("2001:db8:1:3::1"));
        // Rotating through the /64 does not escape the limit.
        assert!(matches!(
            l.check(peer("2001:db8:1:2::1"), 0),
            UnauthDecision::Allowed(_)
        ));
        assert!(matches!(
            l.check(peer("2001:db8:1:2::2"), 0),
            UnauthDecision::Allowed(_)
        ));
        assert!(matches!(
            l.check(peer("2001:db8:1:2::3"), 0),
            UnauthDecision::Refused { .. }
        ));
        // An IPv4-mapped address is the IPv4 client.
        assert_eq!(peer("::ffff:192.0.2.7"), ip("192.0.2.7"));
        let exact = UnauthLimiter::new(UnauthSettings {
            ipv6_prefix: 128,
            ..UnauthSettings::default()
        });
        assert_ne!(
            exact.client(ip("2001:db8::1"), &[]),
            exact.client(ip("2001:db8::2"), &[])
        );
    }

    #[test]
    fn tracked_clients_are_capped_oldest_first() {
        let l = UnauthLimiter::new(UnauthSettings {
            per_minute: 1,
            max_tracked: 32,
            ..UnauthSettings::default()
        });
        for i in 0..10_000u32 {
            l.check(IpAddr::from(i.to_be_bytes()), 0);
        }
        assert!(l.tracked() <= 32, "{} tracked", l.tracked());
        // The newest are still limited; the oldest were forgotten.
        assert!(matches!(
            l.check(IpAddr::from(9_999u32.to_be_bytes()), 0),
            UnauthDecision::Refused { .. }
        ));
        assert!(matches!(
            l.check(IpAddr::from(0u32.to_be_bytes()), 0),
            UnauthDecision::Allowed(_)
        ));
    }

    #[test]
    fn forwarded_for_is_believed_only_from_trusted_proxies() {
        let l = UnauthLimiter::new(UnauthSettings {
            trusted_proxies: vec!["10.0.0.0/8".parse().unwrap()],
            ..UnauthSettings::default()
        });
        let xff: &[&[u8]] = &[b"203.0.113.9, 198.51.100.4", b"10.1.1.1"];
        // From the balancer: the right-most untrusted hop (the left one the client could forge).
        assert_eq!(l.client(ip("10.0.0.5"), xff), ip("198.51.100.4"));
        // From anyone else: the peer, whatever the header says.
        assert_eq!(l.client(ip("192.0.2.1"), xff), ip("192.0.2.1"));
        // No header, or junk in it: the proxy itself / what was believable.
        assert_eq!(l.client(ip("10.0.0.5"), &[]), ip("10.0.0.5"));
        assert_eq!(
            l.client(ip("10.0.0.5"), &[b"198.51.100.4, junk"]),
            ip("10.0.0.5")
        );
        // Hops with ports, as some balancers write them.
        assert_eq!(
            l.client(ip("10.0.0.5"), &[b"198.51.100.4:5678"]),
            ip("198.51.100.4")
        );
        assert_eq!(
            l.client(ip("10.0.0.5"), &[b"[2001:db8::1]:443"]),
            ip("2001:db8::")
        );
    }
}
