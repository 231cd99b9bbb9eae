//! Where the fleet's Redis is and how to get in: one server, a primary found through its
//! Sentinels, or a cluster; TLS and the credentials for the servers and for the Sentinels.
//! Shared by the quota store (async, on the request path) and the key registry (blocking, off
//! it), the two things that keep state in Redis, and by the start-up check.
//!
//! | module | owns |
//! |---|---|
//! | [`access`] | the settings' view: target, TLS files, credentials; URL parsing |
//! | [`error`] | why a connection failed, fatal (settings) or passing (unreachable) |
//! | [`materials`] | the password files and PEM files read at each (re)connection; clients |
//! | [`sentinel`] | asking the Sentinels for the primary, under deadlines |

pub mod access;
pub mod error;
mod materials;
mod sentinel;

use std::time::Duration;

use redis::ConnectionLike;

pub use self::access::{
    Credentials, RedisAccess, RedisTarget, RedisUrlError, Secret, SentinelTarget, TlsFiles,
    URL_PASSWORD,
};
pub use self::error::RedisAccessError;
use self::error::{classify, Role};
use self::materials::Materials;

/// A blocking connection (the registry's, the CLI's), each read and write under a deadline.
pub enum BlockingConn {
    Single(redis::Connection),
    Cluster(Box<redis::cluster::ClusterConnection>),
}

impl BlockingConn {
    pub(crate) fn as_mut(&mut self) -> &mut dyn ConnectionLike {
        match self {
            BlockingConn::Single(c) => c,
            BlockingConn::Cluster(c) => &mut **c,
        }
    }
}

/// What an async connection is to be made with: the client of the server (the primary the
/// Sentinels named) or of the cluster, and a digest of where it points and of the secrets and
/// certificates it logs in with, so a reconnect can tell whether anything changed.
pub enum Prepared {
    Single {
        client: Box<redis::Client>,
        identity: [u8; 32],
    },
    Cluster {
        client: Box<redis::cluster::ClusterClient>,
        identity: [u8; 32],
    },
}

impl Prepared {
    pub fn identity(&self) -> [u8; 32] {
        match self {
            Prepared::Single { identity, .. } | Prepared::Cluster { identity, .. } => *identity,
        }
    }
}

fn identity(m: &Materials, place: &str) -> [u8; 32] {
    use sha2::Digest;
    let mut d = sha2::Sha256::new();
    d.update(m.digest);
    d.update(place);
    d.finalize().into()
}

impl RedisAccess {
    /// A blocking connection: each step (Sentinel lookup, connect, TLS, login) and then each
    /// command under `timeout`. Files are read again on every call, so the registry's thread,
    /// which reconnects after any error, picks up a rotated password by itself.
    pub fn connect_blocking(&self, timeout: Duration) -> Result<BlockingConn, RedisAccessError> {
        let m = self.read_materials()?;
        match &self.target {
            RedisTarget::Single(url) => {
                let client = m.client(url, &m.auth)?;
                sentinel::connect_blocking(&client, timeout)
                    .map(BlockingConn::Single)
                    .map_err(|e| classify(&e, &redis_peer(url), self, Role::Data))
            }
            RedisTarget::Sentinel(target) => {
                sentinel::master_blocking(self, target, &m, timeout).map(BlockingConn::Single)
            }
            RedisTarget::Cluster(nodes) => {
                // One retry, soon: a call must not stretch to many deadlines.
                let client = m.cluster_client(nodes, timeout, 1)?;
                client
                    .get_connection()
                    .map(|c| BlockingConn::Cluster(Box::new(c)))
                    .map_err(|e| classify(&e, "Redis Cluster", self, Role::Data))
            }
        }
    }

    /// Connects and sends `PING`, as `serve` does at start-up and `check` does: tells a setting
    /// that cannot work (fatal) from a Redis that is only not there yet.
    pub fn probe_blocking(&self, timeout: Duration) -> Result<(), RedisAccessError> {
        let mut conn = self.connect_blocking(timeout)?;
        redis::cmd("PING")
            .query::<String>(conn.as_mut())
            .map(drop)
            .map_err(|e| classify(&e, "Redis", self, Role::Data))
    }

    /// What the next async connection should be made with, without asking the network: the
    /// files read now (at start-up). `None` for a Sentinel target, whose primary only the
    /// Sentinels can name ([`RedisAccess::prepare`]).
    pub fn prepare_now(&self, timeout: Duration) -> Result<Option<Prepared>, RedisAccessError> {
        let m = self.read_materials()?;
        self.prepared_with(&m, None, timeout)
    }

    /// The files read again (in the blocking pool) and, for a Sentinel target, the primary
    /// asked of the Sentinels, each step under `timeout`. `None` when nothing changed since
    /// the client of identity `known` was prepared (then no connection to the primary is made;
    /// a new primary is checked with `ROLE` first).
    pub async fn prepare(
        &self,
        timeout: Duration,
        known: Option<[u8; 32]>,
    ) -> Result<Option<Prepared>, RedisAccessError> {
        let access = self.clone();
        let m = tokio::task::spawn_blocking(move || access.read_materials())
            .await
            .map_err(|e| RedisAccessError::Invalid(format!("reading the Redis files: {e}")))??;
        let place = match &self.target {
            RedisTarget::Single(url) => url.clone(),
            RedisTarget::Cluster(nodes) => nodes.join(","),
            RedisTarget::Sentinel(target) => {
                let (host, port) = sentinel::master(self, target, &m, timeout).await?;
                access::node_url(self.tls, &host, port, target.db)
            }
        };
        if known == Some(identity(&m, &place)) {
            return Ok(None);
        }
        let master = match &self.target {
            RedisTarget::Sentinel(_) => {
                sentinel::verify_primary(self, &place, &m, timeout).await?;
                Some(place)
            }
            _ => None,
        };
        self.prepared_with(&m, master, timeout)
    }

    fn prepared_with(
        &self,
        m: &Materials,
        master: Option<String>,
        timeout: Duration,
    ) -> Result<Option<Prepared>, RedisAccessError> {
        Ok(Some(match (&self.target, master) {
            (RedisTarget::Single(url), _) => Prepared::Single {
                client: Box::new(m.client(url, &m.auth)?),
                identity: identity(m, url),
            },
            (RedisTarget::Sentinel(_), Some(url)) => Prepared::Single {
                client: Box::new(m.client(&url, &m.auth)?),
                identity: identity(m, &url),
            },
            (RedisTarget::Sentinel(_), None) => return Ok(None),
            (RedisTarget::Cluster(nodes), _) => Prepared::Cluster {
                client: Box::new(m.cluster_client(nodes, timeout, 2)?),
                identity: identity(m, &nodes.join(",")),
            },
        }))
    }

    /// Where the primary is now, as the log says it: the URL without user info, or the
    /// Sentinels' master name.
    pub fn describe(&self) -> String {
        match &self.target {
            RedisTarget::Single(url) => url.clone(),
            RedisTarget::Sentinel(t) => format!(
                "the primary `{}` of {} Sentinel(s)",
                t.master,
                t.sentinels.len()
            ),
            RedisTarget::Cluster(nodes) => format!("a Redis Cluster ({} seed nodes)", nodes.len()),
        }
    }
}

/// `Redis at host:port` for a URL without user info.
fn redis_peer(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    format!("Redis at {}", rest.split('/').next().unwrap_or(rest))
}

/// A Redis URL with any password replaced by `***`, for messages and `check`'s report.
pub fn redact(url: &str) -> String {
    let start = url.find("://").map_or(0, |i| i + 3);
    let end = url[start..].find('/').map_or(url.len(), |i| start + i);
    match url[start..end].rfind('@') {
        Some(at) => {
            let userinfo = &url[start..start + at];
            let user = userinfo.split(':').next().unwrap_or_default();
            let hidden = if userinfo.contains(':') { ":***" } else { "" };
            format!("{}{user}{hidden}{}", &url[..start], &url[start + at..])
        }
        None => url.to_owned(),
    }
}
