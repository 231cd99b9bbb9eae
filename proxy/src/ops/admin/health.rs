//! `GET /healthz`, `GET /readyz` and `GET /metrics`: for supervisors, load balancers and
//! Prometheus.

use std::time::Duration;

use http::Response;

use super::reply::json_response;
use super::Admin;

pub fn healthz() -> Response<Vec<u8>> {
    json_response(200, br#"{"status":"ok"}"#.to_vec())
}

pub fn metrics() -> Response<Vec<u8>> {
    let body = crate::base::metrics::render();
    Response::builder()
        .status(200)
        .header("content-type", "text/plain; version=0.0.4; charset=utf-8")
        .header("content-length", body.len())
        .body(body)
        .unwrap_or_default()
}

impl Admin {
    pub(super) async fn readyz(&self) -> Response<Vec<u8>> {
        let upstream = self.upstream_reachable().await;
        let store = match self.store.ping().await {
            Ok(()) => "ok".to_owned(),
            Err(e) if self.store_optional => format!("fallback active: {e}"),
            Err(e) => format!("failing: {e}"),
        };
        let store_ok = store == "ok" || store.starts_with("fallback");
        let keys = match &self.registry {
            None => Ok("file".to_owned()),
            Some(state) => state.readiness(),
        };
        let ready = upstream && store_ok && keys.is_ok();
        let body = serde_json::json!({
            "status": if ready { "ready" } else { "not ready" },
            "checks": {
                "config": "loaded",
                "upstream": if upstream { "reachable" } else { "unreachable" },
                "store": store,
                "keys": keys.unwrap_or_else(|e| e),
            }
        });
        json_response(if ready { 200 } else { 503 }, body.to_string().into_bytes())
    }

    async fn upstream_reachable(&self) -> bool {
        for addr in self.places.rotation().addrs() {
            let connect = tokio::net::TcpStream::connect(addr);
            if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(300), connect).await {
                return true;
            }
        }
        false
    }
}
