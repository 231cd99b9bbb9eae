//! Where the fleet's Redis is: one server or the seed nodes of a cluster. Shared by the quota
//! store and the key registry, the two things that keep state in it.

/// A Redis URL that cannot be used, found at start-up or by `check`.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct RedisUrlError(pub String);

/// Where the store's Redis is: one server, or the seed nodes of a cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    Single(String),
    Cluster(Vec<String>),
}

impl RedisTarget {
    /// `redis://host:port/db` (also `rediss://`, `unix://`) is one server;
    /// `redis+cluster://host:port,host:port` or a comma-separated list of `redis://` URLs is a
    /// cluster, given by some of its nodes.
    pub fn parse(url: &str) -> Result<RedisTarget, RedisUrlError> {
        let url = url.trim();
        let nodes: Vec<String> = if let Some(rest) = url.strip_prefix("redis+cluster://") {
            rest.trim_end_matches('/')
                .split(',')
                .map(|n| format!("redis://{}", n.trim()))
                .collect()
        } else if url.contains(',') {
            url.split(',').map(|n| n.trim().to_owned()).collect()
        } else {
            redis::Client::open(url).map_err(|e| RedisUrlError(e.to_string()))?;
            return Ok(RedisTarget::Single(url.to_owned()));
        };
        for node in &nodes {
            redis::Client::open(node.as_str())
                .map_err(|e| RedisUrlError(format!("cluster node `{node}`: {e}")))?;
        }
        Ok(RedisTarget::Cluster(nodes))
    }
}
