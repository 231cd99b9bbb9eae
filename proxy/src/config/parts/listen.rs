//! The public listener: its address, how long a client may take, and the socket a successor
//! takes it over by.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::values::{millis, socket_addr};
use crate::config::model::ConfigError;
use crate::config::setting::{Kind, Layers, Preset, Row, Setting, Value};

const LISTEN: Setting<SocketAddr> = Setting::new(
    "listen",
    Kind::Text,
    Preset::Value("127.0.0.1:8080"),
    "public listener",
    socket_addr,
)
.value_name("ADDR");
const REQUEST_HEADER_TIMEOUT_MS: Setting<Duration> = Setting::new(
    "request_header_timeout_ms",
    Kind::Int,
    Preset::Value("10000"),
    "the whole HTTP/1.x request head (line and headers) must arrive within this from the \
     connection's start, or for a later keep-alive request from its first byte; otherwise the \
     connection closes (`pet_gateway_slow_request_heads_total`)",
    millis,
);
const CLIENT_READ_TIMEOUT_MS: Setting<Duration> = Setting::new(
    "client_read_timeout_ms",
    Kind::Int,
    Preset::Value("10000"),
    "how long a client may stall while sending a request body, and a quarter of the time the \
     whole body may take (then 408; over HTTP/1.1 the connection closes, over HTTP/2 only the \
     stream ends). Bodies (at most 64 KiB, else 413) are read whole before the request waits \
     for a place at the backend, so a slow upload holds none",
    millis,
);
const UPGRADE_SOCK: Setting<PathBuf> = Setting::new(
    "upgrade_sock",
    Kind::Path,
    Preset::Computed("`/tmp/pet-gateway-<environment>-<port>.sock`"),
    "where a running gateway hands its sockets to `serve --upgrade`",
    Value::path,
);

pub const SETTINGS: &[Row] = &[
    LISTEN.row,
    REQUEST_HEADER_TIMEOUT_MS.row,
    CLIENT_READ_TIMEOUT_MS.row,
    UPGRADE_SOCK.row,
];

pub struct Listen {
    pub listen: SocketAddr,
    pub request_header_timeout: Duration,
    pub client_read_timeout: Duration,
    pub upgrade_sock: PathBuf,
}

pub fn validate(l: &Layers, environment: &str) -> Result<Listen, ConfigError> {
    let listen = l.value(&LISTEN)?;
    // One per environment and port, so gateways on one host never take each other's sockets.
    let sock = format!("/tmp/pet-gateway-{environment}-{}.sock", listen.port());
    Ok(Listen {
        listen,
        request_header_timeout: l.value(&REQUEST_HEADER_TIMEOUT_MS)?,
        client_read_timeout: l.value(&CLIENT_READ_TIMEOUT_MS)?,
        upgrade_sock: l.or(&UPGRADE_SOCK, Value::Path(sock.into()))?.value,
    })
}
