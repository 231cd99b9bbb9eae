//! pet-gateway: authentication, plan quotas and bans in front of pet-backend, on pingora.
//!
//! One module per concern:
//!
//! | module | concern |
//! |---|---|
//! | [`gateway`] | the pingora phases, and nothing else |
//! | [`request`] | a request's shape limits, its request id, and reading an HTTP/2 body under a deadline |
//! | [`head_deadline`] | the deadline on a whole HTTP/1.x request head (slow clients) |
//! | [`routes`] | the operation a request is for (the route label) |
//! | [`auth`] | the bearer token |
//! | [`admission`] | ban cache → breaker → store → `on_store_error`: one [`admission::Decision`] |
//! | [`responses`] | every response the gateway writes itself (one [`responses::Refusal`] exit) |
//! | [`quota`] | the window, strike and ban arithmetic; the rate-limit header numbers |
//! | [`store`] | where counts live: the `QuotaStore` trait, memory and Redis (Lua scripts) |
//! | [`resilience`] | circuit breaker, per-node fallback limiter, ban cache |
//! | [`unauth`] | the per-client limit on requests without a valid key (IPv6 /64, trusted proxies) |
//! | [`upstreams`] | backend rotation and passive health |
//! | [`keys`], [`plans`] | the hand-edited keys file and plan files |
//! | [`audit`] | the audit log of key changes |
//! | [`key_format`] | the API key format: environment prefix, random part, checksum |
//! | [`catalog`] | the keys and plans in force, reloaded on edits |
//! | [`registry`] | the fleet-wide key registry in Redis, and each node's replica of it |
//! | [`clock`] | the wall clock, a hand-moved clock for tests, RFC 3339 dates |
//! | [`config`] | file, environment and flags into one `Config` |
//! | [`cli`], [`commands`] | the command line and what each command does |
//! | [`server`] | assembling and running it all: proxy, admin listener, reloader, store probe |
//! | [`admin`] | health, readiness, metrics and ban endpoints |
//! | [`metrics`] | the Prometheus metrics |
//! | [`metric_handles`] | per-request metrics with handles resolved once (no label lookup per request) |
//! | [`quota_status`] | `GET /v1/rate_limit`: the quota without spending it |
//! | [`tls`] | the certificate resolver and its reload |
//! | [`trace`] | W3C trace context: join or start a trace, the gateway's span |

pub mod admin;
pub mod admission;
pub mod audit;
pub mod auth;
pub mod catalog;
pub mod cli;
pub mod clock;
pub mod commands;
pub mod config;
pub mod gateway;
pub mod head_deadline;
pub mod key_format;
pub mod keys;
pub mod metric_handles;
pub mod metrics;
pub mod plans;
pub mod quota;
pub mod quota_status;
pub mod registry;
pub mod request;
pub mod resilience;
pub mod responses;
pub mod routes;
pub mod server;
pub mod store;
pub mod tls;
pub mod trace;
pub mod unauth;
pub mod upstreams;
