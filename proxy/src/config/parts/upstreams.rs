//! The backends and how the gateway talks to them.

use std::net::SocketAddr;
use std::time::Duration;

use super::values::{at_least_one, millis, socket_addr};
use crate::config::model::ConfigError;
use crate::config::setting::{Kind, Layers, Preset, Row, Setting, Value};

const UPSTREAMS: Setting<Vec<SocketAddr>> = Setting::new(
    "upstreams",
    Kind::Texts,
    Preset::Value("127.0.0.1:8081"),
    "backends, used round-robin with passive health (see Faults)",
    |v| {
        let list = v.texts()?;
        if list.is_empty() {
            return Err("needs at least one backend address".to_owned());
        }
        list.into_iter()
            .map(|u| socket_addr(Value::Text(u)))
            .collect()
    },
)
.flag("--upstream", "ADDR")
.env("PET_GATEWAY_UPSTREAM");
const UPSTREAM_KEEPALIVE_POOL_SIZE: Setting<usize> = Setting::new(
    "upstream_keepalive_pool_size",
    Kind::Int,
    Preset::Value("128"),
    "idle backend connections kept for reuse, in all",
    |v| at_least_one(v.int()?),
);
const UPSTREAM_CONNECT_TIMEOUT_MS: Setting<Duration> = Setting::new(
    "upstream_connect_timeout_ms",
    Kind::Int,
    Preset::Value("1000"),
    "connecting to a backend (then 502)",
    millis,
);
const UPSTREAM_READ_TIMEOUT_MS: Setting<Duration> = Setting::new(
    "upstream_read_timeout_ms",
    Kind::Int,
    Preset::Value("10000"),
    "waiting for a backend's answer (then 504)",
    millis,
);

pub const SETTINGS: &[Row] = &[
    UPSTREAMS.row,
    UPSTREAM_KEEPALIVE_POOL_SIZE.row,
    UPSTREAM_CONNECT_TIMEOUT_MS.row,
    UPSTREAM_READ_TIMEOUT_MS.row,
];

pub struct Upstreams {
    pub upstreams: Vec<SocketAddr>,
    pub upstream_keepalive_pool_size: usize,
    pub upstream_connect_timeout: Duration,
    pub upstream_read_timeout: Duration,
}

pub fn validate(l: &Layers) -> Result<Upstreams, ConfigError> {
    Ok(Upstreams {
        upstreams: l.value(&UPSTREAMS)?,
        upstream_keepalive_pool_size: l.value(&UPSTREAM_KEEPALIVE_POOL_SIZE)?,
        upstream_connect_timeout: l.value(&UPSTREAM_CONNECT_TIMEOUT_MS)?,
        upstream_read_timeout: l.value(&UPSTREAM_READ_TIMEOUT_MS)?,
    })
}
