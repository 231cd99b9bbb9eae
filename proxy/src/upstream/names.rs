//! Backends given by host name (`backend:8081`: a compose service, a pod's name): looked up at
//! start, again when a connection to one fails, and every `upstream_resolve_interval_secs`. A
//! backend that comes back at a new address (a restarted container) is followed without a
//! restart of the gateway, where looking names up once at start gave 502s until one. An address
//! written as an IP is never looked up and costs the request path nothing.

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::RwLock;
use std::time::{Duration, Instant};

/// A name is looked up at most this often, however many requests fail on it: a backend that
/// is down for good must not turn every request into a lookup.
pub const LOOKUP_GAP: Duration = Duration::from_secs(1);
/// The most one lookup may take before the address in hand is kept.
pub const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

/// A backend as configured: its address now, and the name it was given by when that was a
/// host name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamAddr {
    pub addr: SocketAddr,
    pub name: Option<String>,
}

impl UpstreamAddr {
    /// `ip:port` as is; `host:port` looked up now (blocking: at config load, not on a request).
    pub fn parse(s: &str) -> Result<UpstreamAddr, String> {
        if let Ok(addr) = s.parse() {
            return Ok(UpstreamAddr { addr, name: None });
        }
        let addr = s
            .to_socket_addrs()
            .map_err(|e| format!("`{s}` is not a host:port address: {e}"))?
            .next()
            .ok_or_else(|| format!("`{s}` resolves to no address"))?;
        Ok(UpstreamAddr {
            addr,
            name: Some(s.to_owned()),
        })
    }
}

impl From<SocketAddr> for UpstreamAddr {
    fn from(addr: SocketAddr) -> UpstreamAddr {
        UpstreamAddr { addr, name: None }
    }
}

/// The name when there is one (what an operator wrote, stable across lookups), else the address.
impl fmt::Display for UpstreamAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.name {
            Some(name) => write!(f, "{name} ({})", self.addr),
            None => write!(f, "{}", self.addr),
        }
    }
}

/// One backend's address, as the rotation holds it.
pub enum Address {
    Fixed(SocketAddr),
    Named(Named),
}

pub struct Named {
    name: String,
    current: RwLock<SocketAddr>,
    /// Held while the name is looked up, so that one lookup runs at a time and the requests
    /// behind it take its answer; when the last one started.
    lookup: tokio::sync::Mutex<Option<Instant>>,
}

impl Address {
    pub fn new(u: UpstreamAddr) -> Address {
        match u.name {
            None => Address::Fixed(u.addr),
            Some(name) => Address::Named(Named {
                name,
                current: RwLock::new(u.addr),
                lookup: tokio::sync::Mutex::new(None),
            }),
        }
    }

    pub fn get(&self) -> SocketAddr {
        match self {
            Address::Fixed(a) => *a,
            Address::Named(n) => *n.current.read().unwrap_or_else(|p| p.into_inner()),
        }
    }

    /// The label for metrics: the name as written when there is one (it outlives addresses).
    pub fn label(&self) -> String {
        match self {
            Address::Fixed(a) => a.to_string(),
            Address::Named(n) => n.name.clone(),
        }
    }

    pub fn is_named(&self) -> bool {
        matches!(self, Address::Named(_))
    }

    /// Looks the name up again, unless the last lookup ended less than [`LOOKUP_GAP`] ago: a
    /// caller that waited behind a running lookup (at most [`LOOKUP_TIMEOUT`]) takes its
    /// answer, through [`Address::get`], instead of starting one more. The new address when
    /// it changed. A lookup that fails or finds nothing keeps the address in hand, and says so
    /// in the log.
    pub async fn look_up_again(&self) -> Option<SocketAddr> {
        let Address::Named(n) = self else {
            return None;
        };
        let mut last = n.lookup.lock().await;
        if last.is_some_and(|t| t.elapsed() < LOOKUP_GAP) {
            return None;
        }
        let moved = n.look_up().await;
        // Stamped when it ended: a slow lookup must not leave the callers queued behind it
        // to start one each, in turn.
        *last = Some(Instant::now());
        moved
    }
}

impl Named {
    async fn look_up(&self) -> Option<SocketAddr> {
        let found =
            tokio::time::timeout(LOOKUP_TIMEOUT, tokio::net::lookup_host(self.name.as_str()));
        let new = match found.await {
            Ok(Ok(mut addrs)) => addrs.next(),
            Ok(Err(e)) => {
                tracing::warn!(upstream = %self.name, error = %e, "looking the backend's name up failed; keeping its address");
                return None;
            }
            Err(_) => {
                tracing::warn!(upstream = %self.name, timeout = ?LOOKUP_TIMEOUT, "looking the backend's name up timed out; keeping its address");
                return None;
            }
        };
        let Some(new) = new else {
            tracing::warn!(upstream = %self.name, "the backend's name resolves to no address; keeping its address");
            return None;
        };
        let mut current = self.current.write().unwrap_or_else(|p| p.into_inner());
        if *current == new {
            return None;
        }
        tracing::info!(upstream = %self.name, was = %*current, now = %new, "the backend's name resolves to a new address");
        *current = new;
        Some(new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ip_is_taken_as_is_and_a_name_is_kept_beside_its_address() {
        let ip = UpstreamAddr::parse("127.0.0.1:8081").unwrap();
        assert_eq!(ip.name, None);
        assert_eq!(ip.to_string(), "127.0.0.1:8081");
        let named = UpstreamAddr::parse("localhost:8081").unwrap();
        assert_eq!(named.name.as_deref(), Some("localhost:8081"));
        assert!(named.addr.ip().is_loopback() && named.addr.port() == 8081);
        assert!(UpstreamAddr::parse("no-port").is_err());
        assert!(Address::new(named).is_named() && !Address::new(ip).is_named());
    }

    #[tokio::test]
    async fn a_name_is_looked_up_at_most_once_a_gap_and_a_fixed_address_never() {
        let fixed = Address::new(UpstreamAddr::parse("127.0.0.1:1").unwrap());
        assert_eq!(fixed.look_up_again().await, None);
        // An address the name does not resolve to, as if its backend had moved since.
        let moved = Address::new(UpstreamAddr {
            addr: "192.0.2.1:1".parse().unwrap(),
            name: Some("localhost:1".to_owned()),
        });
        let now = moved
            .look_up_again()
            .await
            .expect("the name's address, not the old one");
        assert!(now.ip().is_loopback(), "{now}");
        assert_eq!(moved.get(), now);
        assert_eq!(moved.label(), "localhost:1");
        // Within the gap nothing is looked up, even where it would now differ.
        if let Address::Named(n) = &moved {
            *n.current.write().unwrap() = "192.0.2.1:1".parse().unwrap();
        }
        assert_eq!(moved.look_up_again().await, None);
        assert_eq!(moved.get(), "192.0.2.1:1".parse().unwrap());
    }
}
