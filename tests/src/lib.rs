//! The harness the end-to-end tests share, one module per subject:
//!
//! | module | what |
//! |---|---|
//! | `process` | binaries and tools, free ports, child processes killed on drop, `pet-backend` |
//! | `redis` | a private `redis-server` or Redis Cluster |
//! | `redis_ha` | Redis as production runs it: a CA made with `openssl`, `redis-sentinel` |
//! | `gateway` | `pet-gateway` processes, its CLI, plans and keys, `Fixture`, response helpers |
//! | `upstreams` | fake backends (echo, silent, closing, truncating, chaotic) and the bench's backend of fixed capacity |
//! | `tls` | test certificates and a client that trusts them |
//! | `disk` | a small disk of a test's own (tmpfs), to fill: the full-disk seam |
//! | `python` | receivers in Python on the ecosystem's own packages (Standard Webhooks, OTLP) |
//!
//! Everything is re-exported here, so a test writes `e2e::Fixture`.

pub mod browser;
pub mod disk;
pub mod gateway;
pub mod process;
pub mod python;
pub mod redis;
pub mod redis_ha;
pub mod tls;
pub mod upstreams;
pub mod webhook;

use std::time::Duration;

pub use crate::browser::*;
pub use crate::disk::*;
pub use crate::gateway::*;
pub use crate::process::*;
pub use crate::python::*;
pub use crate::redis::*;
pub use crate::redis_ha::*;
pub use crate::tls::*;
pub use crate::upstreams::*;
pub use crate::webhook::*;

/// Sleeps, if needed, so that at least `margin` seconds remain in the current UTC minute: tests
/// that count within one minute window must not straddle two.
pub fn fresh_minute(margin: Duration) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970");
    let into_minute = Duration::from_millis((now.as_millis() % 60_000) as u64);
    let left = Duration::from_secs(60) - into_minute;
    if left < margin {
        std::thread::sleep(left + Duration::from_millis(50));
    }
}
