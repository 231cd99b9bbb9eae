//! The base layer: what several wings share and nothing else. It imports no other wing.
//!
//! | module | owns |
//! |---|---|
//! | [`clock`] | the wall clock, a hand-moved clock for tests, RFC 3339 dates, durations |
//! | [`log_sink`] | where every log line goes: a bounded buffer, written to stderr by its own thread |
//! | [`metrics`] | every Prometheus metric, registered once in the registry pingora serves |
//! | [`redis`] | where the fleet's Redis is (one server or a cluster): the store and the registry use it |
//! | [`traces`] | OpenTelemetry traces: the sampler, and the bounded queue and thread that export spans over OTLP |

pub mod alloc;
pub mod clock;
pub mod log_sink;
pub mod metrics;
pub mod redis;
pub mod traces;
