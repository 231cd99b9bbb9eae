//! How the fleet's Redis is reached, as the settings give it: where it is (one server, a primary
//! watched by Sentinels, or a cluster), whether the connection is TLS, and who the gateway is
//! to it. Only names are held here: the password files, certificates and keys are read when a
//! connection is made (`materials.rs`), so a rotated password or certificate applies at the
//! next reconnect without a restart.

use std::path::PathBuf;

/// A Redis URL, or a combination of Redis settings, that cannot be used; found at start-up or
/// by `check`. Never carries a password.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct RedisUrlError(pub String);

/// Where the fleet's Redis is. URLs are held without their user info: the credentials are in
/// [`RedisAccess::auth`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// One server (`redis://host:port/db`, `rediss://…`, `unix://…`).
    Single(String),
    /// A primary watched by Sentinels, asked for its address at every (re)connection.
    Sentinel(SentinelTarget),
    /// The seed nodes of a cluster.
    Cluster(Vec<String>),
}

/// `redis+sentinel://HOST:PORT,HOST:PORT/MASTER_NAME[/DB]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentinelTarget {
    pub sentinels: Vec<(String, u16)>,
    pub master: String,
    pub db: i64,
}

/// A password, and the setting it came from so that errors can name it without printing it.
#[derive(Clone, PartialEq, Eq)]
pub enum Secret {
    /// Given as text: in `redis_url`'s user info, or by a variable (`setting` names which).
    Given {
        value: String,
        setting: &'static str,
    },
    /// Read from a file at every (re)connection.
    File {
        path: PathBuf,
        setting: &'static str,
    },
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

impl Secret {
    /// Where the password comes from, for messages: never the password itself.
    pub fn describe(&self) -> String {
        match self {
            Secret::Given { setting, .. } => (*setting).to_owned(),
            Secret::File { path, setting } => format!("{setting} (`{}`)", path.display()),
        }
    }
}

/// Who the gateway is to a Redis server or to the Sentinels.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Credentials {
    pub username: Option<String>,
    pub password: Option<Secret>,
}

/// The PEM files of a TLS connection; without a CA the system's roots verify the server.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// Everything needed to open a connection to the fleet's Redis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisAccess {
    pub target: RedisTarget,
    /// TLS to every node (and to the Sentinels): `rediss://`, `rediss+sentinel://`.
    pub tls: bool,
    pub tls_files: TlsFiles,
    /// To the Redis servers holding the data.
    pub auth: Credentials,
    /// To the Sentinels, which often have a password of their own.
    pub sentinel_auth: Credentials,
}

/// The setting a password in the URL is blamed on.
pub const URL_PASSWORD: &str = "the password in redis_url";

impl RedisAccess {
    /// `redis://[user:password@]host:port/db` (also `rediss://`, `unix://`) is one server;
    /// `redis+sentinel://` or `rediss+sentinel://[user:password@]host:port,host:port/MASTER[/DB]`
    /// a primary found through its Sentinels (the user info is the primary's, not the
    /// Sentinels'); `redis+cluster://host:port,host:port` or a comma-separated list of
    /// `redis://` URLs a cluster, given by some of its nodes.
    pub fn from_url(url: &str) -> Result<RedisAccess, RedisUrlError> {
        let url = url.trim();
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| RedisUrlError("not a URL (`redis://host:port/db`)".to_owned()))?;
        let (target, tls, auth) = match scheme {
            "redis+sentinel" | "rediss+sentinel" => {
                let (auth, rest) = split_user_info(rest)?;
                (sentinel_target(rest)?, scheme == "rediss+sentinel", auth)
            }
            "redis+cluster" | "rediss+cluster" => {
                let (auth, rest) = split_user_info(rest)?;
                let plain = if scheme == "rediss+cluster" {
                    "rediss"
                } else {
                    "redis"
                };
                let nodes = rest
                    .trim_end_matches('/')
                    .split(',')
                    .map(|n| format!("{plain}://{}", n.trim()))
                    .collect();
                (RedisTarget::Cluster(nodes), plain == "rediss", auth)
            }
            _ if url.contains(',') => cluster_of_urls(url)?,
            _ => {
                let (auth, stripped) = server_url(url)?;
                let tls = matches!(scheme, "rediss" | "valkeys");
                (RedisTarget::Single(stripped), tls, auth)
            }
        };
        Ok(RedisAccess {
            target,
            tls,
            tls_files: TlsFiles::default(),
            auth,
            sentinel_auth: Credentials::default(),
        })
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self.target, RedisTarget::Cluster(_))
    }

    pub fn is_sentinel(&self) -> bool {
        matches!(self.target, RedisTarget::Sentinel(_))
    }
}

/// A comma-separated list of `redis://` URLs: a cluster; every node's credentials must agree.
fn cluster_of_urls(url: &str) -> Result<(RedisTarget, bool, Credentials), RedisUrlError> {
    let mut nodes = Vec::new();
    let mut first: Option<(Credentials, bool)> = None;
    for (i, node) in url.split(',').map(str::trim).enumerate() {
        let (auth, stripped) =
            server_url(node).map_err(|e| RedisUrlError(format!("cluster node {}: {e}", i + 1)))?;
        let tls = stripped.starts_with("rediss://");
        match &first {
            None => first = Some((auth, tls)),
            Some(seen) if *seen != (auth, tls) => {
                return Err(RedisUrlError(
                    "the cluster's node URLs differ in scheme or credentials".to_owned(),
                ))
            }
            Some(_) => {}
        }
        nodes.push(stripped);
    }
    let (auth, tls) = first.unwrap_or_default();
    Ok((RedisTarget::Cluster(nodes), tls, auth))
}

/// One server's URL, checked by the redis crate, with its credentials taken out.
fn server_url(url: &str) -> Result<(Credentials, String), RedisUrlError> {
    if url.contains('#') {
        return Err(RedisUrlError(
            "a URL fragment (`#insecure`) is not taken: the server's certificate is always \
             verified (give redis_tls_ca_file)"
                .to_owned(),
        ));
    }
    let info = redis::IntoConnectionInfo::into_connection_info(url)
        .map_err(|e| RedisUrlError(e.to_string()))?;
    let settings = info.redis_settings();
    let auth = Credentials {
        username: settings.username().map(str::to_owned),
        password: settings.password().map(|p| Secret::Given {
            value: p.to_owned(),
            setting: URL_PASSWORD,
        }),
    };
    let stripped = match url.split_once("://") {
        Some((scheme, rest)) if !scheme.starts_with("unix") => {
            let (_, rest) = split_user_info(rest)?;
            format!("{scheme}://{rest}")
        }
        _ => url.to_owned(),
    };
    Ok((auth, stripped))
}

/// `user:password@rest` into the credentials (percent-decoded) and `rest`.
fn split_user_info(rest: &str) -> Result<(Credentials, &str), RedisUrlError> {
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return Ok((Credentials::default(), rest));
    };
    let (user, password) = match rest[..at].split_once(':') {
        Some((u, p)) => (u, Some(p)),
        None => (&rest[..at], None),
    };
    let decode = |s: &str| {
        percent_decode(s).ok_or_else(|| {
            RedisUrlError("the URL's user info is not valid percent-encoded UTF-8".to_owned())
        })
    };
    let username = Some(decode(user)?).filter(|u| !u.is_empty());
    let password = match password {
        Some(p) if !p.is_empty() => Some(Secret::Given {
            value: decode(p)?,
            setting: URL_PASSWORD,
        }),
        _ => None,
    };
    Ok((Credentials { username, password }, &rest[at + 1..]))
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// `host:port,host:port/MASTER[/DB]` (user info already taken out).
fn sentinel_target(rest: &str) -> Result<RedisTarget, RedisUrlError> {
    let usage = "`redis+sentinel://HOST:PORT,HOST:PORT/MASTER_NAME`";
    let (hosts, path) = rest
        .split_once('/')
        .ok_or_else(|| RedisUrlError(format!("names no master: {usage}")))?;
    let mut path = path.trim_end_matches('/').splitn(2, '/');
    let master = path.next().unwrap_or_default().to_owned();
    if master.is_empty() || !master.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(RedisUrlError(format!("names no master: {usage}")));
    }
    let db = match path.next() {
        Some(db) => db
            .parse::<i64>()
            .map_err(|_| RedisUrlError(format!("`{db}` is not a database number")))?,
        None => 0,
    };
    let sentinels = hosts
        .split(',')
        .map(|h| host_port(h.trim(), 26379))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(RedisTarget::Sentinel(SentinelTarget {
        sentinels,
        master,
        db,
    }))
}

/// `host`, `host:port`, `[v6]` or `[v6]:port`.
fn host_port(text: &str, default_port: u16) -> Result<(String, u16), RedisUrlError> {
    let bad = || RedisUrlError(format!("`{text}` is not HOST:PORT"));
    let (host, port) = match text.strip_prefix('[') {
        Some(v6) => {
            let (host, after) = v6.split_once(']').ok_or_else(bad)?;
            (host, after.strip_prefix(':'))
        }
        None => match text.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (text, None),
        },
    };
    if host.is_empty() || host.contains(['/', '@', ' ']) {
        return Err(bad());
    }
    let port = match port {
        Some(p) => p.parse().map_err(|_| bad())?,
        None => default_port,
    };
    Ok((host.to_owned(), port))
}

/// `redis[s]://host:port/db` for an address a Sentinel named.
pub(crate) fn node_url(tls: bool, host: &str, port: u16, db: i64) -> String {
    let scheme = if tls { "rediss" } else { "redis" };
    if host.contains(':') {
        format!("{scheme}://[{host}]:{port}/{db}")
    } else {
        format!("{scheme}://{host}:{port}/{db}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn password(c: &Credentials) -> Option<&str> {
        match &c.password {
            Some(Secret::Given { value, .. }) => Some(value),
            _ => None,
        }
    }

    #[test]
    fn a_server_url_gives_up_its_credentials() {
        let a = RedisAccess::from_url("redis://gateway:s%40cret@10.0.0.5:6380/2").unwrap();
        assert_eq!(
            a.target,
            RedisTarget::Single("redis://10.0.0.5:6380/2".into())
        );
        assert_eq!(a.auth.username.as_deref(), Some("gateway"));
        assert_eq!(password(&a.auth), Some("s@cret"));
        assert!(!a.tls);
        let a = RedisAccess::from_url("rediss://:pw@redis.internal/0").unwrap();
        assert!(a.tls);
        assert_eq!(a.auth.username, None);
        assert_eq!(password(&a.auth), Some("pw"));
        assert!(!format!("{a:?}").contains("pw@"), "{a:?}");
        assert!(RedisAccess::from_url("rediss://h/#insecure").is_err());
    }

    #[test]
    fn sentinel_urls_name_their_sentinels_and_master() {
        let a = RedisAccess::from_url("rediss+sentinel://gw:pw@10.0.0.1:26380,[::1],s3/mymaster/3")
            .unwrap();
        assert!(a.tls);
        assert_eq!(password(&a.auth), Some("pw"));
        let RedisTarget::Sentinel(s) = a.target else {
            panic!("not a sentinel target")
        };
        assert_eq!(s.master, "mymaster");
        assert_eq!(s.db, 3);
        assert_eq!(
            s.sentinels,
            [
                ("10.0.0.1".to_owned(), 26380),
                ("::1".to_owned(), 26379),
                ("s3".to_owned(), 26379)
            ]
        );
        for bad in [
            "redis+sentinel://h:1",
            "redis+sentinel://h:1/",
            "redis+sentinel://h:x/m",
            "redis+sentinel://h:1/m/x",
        ] {
            assert!(RedisAccess::from_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn cluster_urls_keep_their_nodes_and_one_set_of_credentials() {
        let a = RedisAccess::from_url("redis+cluster://u:p@h1:7000,h2:7001").unwrap();
        assert_eq!(
            a.target,
            RedisTarget::Cluster(vec!["redis://h1:7000".into(), "redis://h2:7001".into()])
        );
        assert_eq!(password(&a.auth), Some("p"));
        let a = RedisAccess::from_url("rediss://:p@h1:7000,rediss://:p@h2:7001").unwrap();
        assert!(a.tls && a.is_cluster());
        assert_eq!(
            a.target,
            RedisTarget::Cluster(vec!["rediss://h1:7000".into(), "rediss://h2:7001".into()])
        );
        let e = RedisAccess::from_url("redis://:p@h1:7000,redis://:q@h2:7001").unwrap_err();
        assert!(e.0.contains("differ") && !e.0.contains(":q@"), "{e}");
    }

    #[test]
    fn node_urls_bracket_ipv6() {
        assert_eq!(node_url(true, "::1", 6379, 0), "rediss://[::1]:6379/0");
        assert_eq!(
            node_url(false, "10.0.0.1", 6380, 2),
            "redis://10.0.0.1:6380/2"
        );
    }
}
