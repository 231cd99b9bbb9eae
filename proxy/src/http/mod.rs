//! The HTTP wing: the request path through pingora. It may import [`crate::quota`],
//! [`crate::keys`] and [`crate::base`]; only the operations wing and the config import it.
//!
//! | module | owns |
//! |---|---|
//! | [`gateway`] | the pingora phases, each thin |
//! | [`pipeline`] | the request path as ordered steps: continue, a refusal, or an answer |
//! | [`context`] | a request's state from phase to phase |
//! | [`request`] | a request's shape limits, its request id, an HTTP/2 body under a deadline |
//! | [`head_deadline`] | the deadline on a whole HTTP/1.x request head (slow clients) |
//! | [`draining`] | once a stop or an upgrade begins, every answer closes its connection |
//! | [`routes`] | the operation a request is for (the route label) |
//! | [`auth`] | the bearer token |
//! | [`responses`] | every response the gateway writes itself (one [`responses::Refusal`] exit) |
//! | [`quota_status`] | `GET /v1/rate_limit`: the quota without spending it |
//! | [`metric_handles`] | per-request metrics with handles resolved once |
//! | [`tls`] | the certificate resolver and its reload |
//! | [`trace`] | W3C trace context: join or start a trace, the gateway's span |
//! | [`spans`] | a sampled request's spans: its path noted as it goes, made into OTLP spans at its end |

pub mod access_log;
pub mod auth;
pub mod context;
pub mod draining;
pub mod gateway;
pub mod head_deadline;
pub mod header_names;
pub mod metric_handles;
pub mod pipeline;
pub mod quota_status;
pub mod request;
pub mod responses;
pub mod routes;
pub mod spans;
pub mod tls;
pub mod trace;
