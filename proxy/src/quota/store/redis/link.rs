//! The connection every Redis call of the store goes through, and the deadline each one runs
//! under: a reconnecting multiplexed connection to one server, or a cluster connection.

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use tokio::sync::OnceCell;

use crate::quota::store::StoreError;

pub(super) enum Client {
    Single(redis::Client),
    Cluster(Box<ClusterClient>),
}

#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// The connection every call goes through, and the deadline each one runs under. Shared by the
/// store and its batches' drain tasks.
pub(crate) struct Link {
    client: Client,
    /// Created on first use, inside the runtime that serves requests, so the connection's
    /// driver task lives where its callers do.
    conn: OnceCell<Conn>,
    timeout: Duration,
}

impl Link {
    pub(super) fn new(client: Client, timeout: Duration) -> Link {
        Link {
            client,
            conn: OnceCell::new(),
            timeout,
        }
    }

    /// Whether batches must be formed per cluster slot.
    pub(super) fn is_cluster(&self) -> bool {
        matches!(self.client, Client::Cluster(_))
    }

    pub(super) fn timeout(&self) -> Duration {
        self.timeout
    }

    async fn conn(&self) -> Result<Conn, StoreError> {
        self.conn
            .get_or_try_init(|| async {
                match &self.client {
                    Client::Single(client) => {
                        let config = ConnectionManagerConfig::new()
                            .set_connection_timeout(Some(self.timeout))
                            .set_response_timeout(Some(self.timeout))
                            .set_number_of_retries(1)
                            .set_max_delay(Duration::from_millis(500));
                        ConnectionManager::new_lazy_with_config(client.clone(), config)
                            .map(Conn::Single)
                            .map_err(|e| StoreError::Unavailable(e.to_string()))
                    }
                    // Learning the cluster's slots takes a round trip to a seed node; bounded
                    // like any call, and retried by the next request when it fails.
                    Client::Cluster(client) => {
                        match tokio::time::timeout(self.timeout * 4, client.get_async_connection())
                            .await
                        {
                            Err(_) => Err(StoreError::Timeout(self.timeout * 4)),
                            Ok(Err(e)) => Err(StoreError::Unavailable(e.to_string())),
                            Ok(Ok(c)) => Ok(Conn::Cluster(c)),
                        }
                    }
                }
            })
            .await
            .cloned()
    }

    /// Runs one plain command under the deadline.
    pub(super) async fn query<T: redis::FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
    ) -> Result<T, StoreError> {
        let call = async {
            let result = match self.conn().await? {
                Conn::Single(mut c) => cmd.query_async::<T>(&mut c).await,
                Conn::Cluster(mut c) => cmd.query_async::<T>(&mut c).await,
            };
            result.map_err(|e| StoreError::Unavailable(e.to_string()))
        };
        match tokio::time::timeout(self.timeout, call).await {
            Err(_) => Err(StoreError::Timeout(self.timeout)),
            Ok(result) => result,
        }
    }

    /// Runs one script invocation under the deadline.
    pub(super) async fn run<T: redis::FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T, StoreError> {
        let call = async {
            match self.conn().await? {
                Conn::Single(mut c) => invoke_on(invocation, &mut c).await,
                Conn::Cluster(mut c) => invoke_on(invocation, &mut c).await,
            }
        };
        match tokio::time::timeout(self.timeout, call).await {
            Err(_) => Err(StoreError::Timeout(self.timeout)),
            Ok(result) => result,
        }
    }
}

async fn invoke_on<T: redis::FromRedisValue>(
    invocation: &redis::ScriptInvocation<'_>,
    conn: &mut (impl ConnectionLike + Send),
) -> Result<T, StoreError> {
    invocation.invoke_async(conn).await.map_err(|e| {
        if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_cluster_error() {
            StoreError::Unavailable(e.to_string())
        } else {
            StoreError::Protocol(e.to_string())
        }
    })
}
