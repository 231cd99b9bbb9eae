//! Finding the primary through its Sentinels, as the Sentinel client guidelines describe: ask
//! each Sentinel in turn `SENTINEL GET-MASTER-ADDR-BY-NAME`, take the first address given, and
//! believe it only once the server there says `ROLE` master (a Sentinel may still name the old
//! primary for a moment after a failover). Every connection and every command runs under a
//! deadline; the redis crate's own Sentinel client does not bound its blocking calls, hence
//! this small one of our own, in a blocking and an async form.

use std::time::Duration;

use redis::aio::MultiplexedConnection;

use crate::base::redis::access::{node_url, RedisAccess, SentinelTarget};
use crate::base::redis::error::{classify, RedisAccessError, Role};
use crate::base::redis::materials::Materials;

/// A Sentinel's answer: the primary's address, or none (it knows no master of that name).
type Lookup = Result<Option<(String, String)>, RedisAccessError>;

/// The answers of the Sentinels asked so far.
#[derive(Default)]
struct Answers {
    unknown: Vec<String>,
    fatal: Option<RedisAccessError>,
    last: Option<RedisAccessError>,
}

impl Answers {
    /// The address in `lookup`, if it gave a usable one.
    fn take(&mut self, lookup: Lookup, peer: &str) -> Option<(String, u16)> {
        match lookup {
            Ok(Some((host, port))) => match port.parse() {
                Ok(port) => return Some((host, port)),
                Err(_) => {
                    self.last = Some(RedisAccessError::Unreachable {
                        peer: peer.to_owned(),
                        detail: format!("named the port `{port}`"),
                    })
                }
            },
            Ok(None) => self.unknown.push(peer.to_owned()),
            Err(e) if e.is_fatal() => {
                self.fatal.get_or_insert(e);
            }
            Err(e) => self.last = Some(e),
        }
        None
    }

    /// Why no Sentinel gave an address: a Sentinel that knows no such master is a wrong
    /// setting, and so is one refusing our credentials; anything else may pass.
    fn conclude(self, target: &SentinelTarget) -> RedisAccessError {
        if !self.unknown.is_empty() {
            return RedisAccessError::UnknownMaster {
                master: target.master.clone(),
                sentinels: self.unknown.join(", "),
            };
        }
        self.fatal
            .or(self.last)
            .unwrap_or_else(|| RedisAccessError::Invalid("redis_url names no Sentinel".to_owned()))
    }
}

fn peer(what: &str, host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("{what} [{host}]:{port}")
    } else {
        format!("{what} {host}:{port}")
    }
}

fn lookup_cmd(master: &str) -> redis::Cmd {
    let mut cmd = redis::cmd("SENTINEL");
    cmd.arg("GET-MASTER-ADDR-BY-NAME").arg(master);
    cmd
}

/// Whether `ROLE`'s answer says primary; a user not allowed `ROLE` takes the Sentinel's word
/// (a stale answer then shows as `READONLY` on the first write, which asks again).
fn check_role(
    role: redis::RedisResult<redis::Value>,
    peer: &str,
    access: &RedisAccess,
) -> Result<(), RedisAccessError> {
    let value = match role {
        Ok(v) => v,
        Err(e) if e.code() == Some("NOPERM") => return Ok(()),
        Err(e) => return Err(classify(&e, peer, access, Role::Data)),
    };
    let first = match &value {
        redis::Value::Array(items) => items.first(),
        _ => None,
    };
    let is_master = matches!(first, Some(redis::Value::BulkString(b)) if b == b"master");
    if is_master {
        Ok(())
    } else {
        Err(RedisAccessError::Unreachable {
            peer: peer.to_owned(),
            detail: "the Sentinels name it, but it is not (or no longer) the primary: a \
                     failover is under way"
                .to_owned(),
        })
    }
}

/// The primary's address and a verified blocking connection to it.
pub(crate) fn master_blocking(
    access: &RedisAccess,
    target: &SentinelTarget,
    m: &Materials,
    timeout: Duration,
) -> Result<redis::Connection, RedisAccessError> {
    let mut answers = Answers::default();
    for (host, port) in &target.sentinels {
        let who = peer("Sentinel", host, *port);
        let lookup = (|| {
            let client = m.client(&node_url(access.tls, host, *port, 0), &m.sentinel_auth)?;
            let fail = |e: redis::RedisError| classify(&e, &who, access, Role::Sentinel);
            let mut conn = connect_blocking(&client, timeout).map_err(fail)?;
            lookup_cmd(&target.master).query(&mut conn).map_err(fail)
        })();
        let Some((host, port)) = answers.take(lookup, &who) else {
            continue;
        };
        let who = peer("Redis primary", &host, port);
        let client = m.client(&node_url(access.tls, &host, port, target.db), &m.auth)?;
        let mut conn = connect_blocking(&client, timeout)
            .map_err(|e| classify(&e, &who, access, Role::Data))?;
        check_role(redis::cmd("ROLE").query(&mut conn), &who, access)?;
        return Ok(conn);
    }
    Err(answers.conclude(target))
}

/// A blocking connection whose every read and write has the deadline.
pub(crate) fn connect_blocking(
    client: &redis::Client,
    timeout: Duration,
) -> redis::RedisResult<redis::Connection> {
    let conn = client.get_connection_with_timeout(timeout)?;
    conn.set_read_timeout(Some(timeout))?;
    conn.set_write_timeout(Some(timeout))?;
    Ok(conn)
}

/// The primary's address as the first Sentinel that knows it names it (not yet checked: see
/// [`verify_primary`]), every step under `timeout`.
pub(crate) async fn master(
    access: &RedisAccess,
    target: &SentinelTarget,
    m: &Materials,
    timeout: Duration,
) -> Result<(String, u16), RedisAccessError> {
    let mut answers = Answers::default();
    for (host, port) in &target.sentinels {
        let who = peer("Sentinel", host, *port);
        let lookup = async {
            let client = m.client(&node_url(access.tls, host, *port, 0), &m.sentinel_auth)?;
            let fail = |e: redis::RedisError| classify(&e, &who, access, Role::Sentinel);
            let mut conn = connect_async(&client, timeout).await.map_err(fail)?;
            lookup_cmd(&target.master)
                .query_async(&mut conn)
                .await
                .map_err(fail)
        };
        if let Some(address) = answers.take(lookup.await, &who) {
            return Ok(address);
        }
    }
    Err(answers.conclude(target))
}

/// Whether the server at `url` (a Sentinel's answer) says it is the primary, under `timeout`.
pub(crate) async fn verify_primary(
    access: &RedisAccess,
    url: &str,
    m: &Materials,
    timeout: Duration,
) -> Result<(), RedisAccessError> {
    let who = format!("Redis primary {}", url.split("://").nth(1).unwrap_or(url));
    let client = m.client(url, &m.auth)?;
    let mut conn = connect_async(&client, timeout)
        .await
        .map_err(|e| classify(&e, &who, access, Role::Data))?;
    let role = redis::cmd("ROLE").query_async(&mut conn).await;
    check_role(role, &who, access)
}

/// An async connection made, and answering, within `timeout`.
pub(crate) async fn connect_async(
    client: &redis::Client,
    timeout: Duration,
) -> redis::RedisResult<MultiplexedConnection> {
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout));
    match tokio::time::timeout(
        timeout * 2,
        client.get_multiplexed_async_connection_with_config(&config),
    )
    .await
    {
        Ok(result) => result,
        Err(_) => {
            Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "connection timed out").into())
        }
    }
}
