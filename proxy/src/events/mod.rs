//! Events for the business: what the gateway tells a billing job about usage, as CloudEvents
//! 1.0 in JSON (issue 24). So far: `pet.usage.v1`, per key, operation and minute, from each
//! node, and `pet.key.banned.v1`, once a ban across the fleet, to the metering file
//! (`metering_file`, NDJSON, a file a day).
//!
//! The request path only adds to a counter in memory ([`usage::Meter::record`]); a thread of
//! its own ([`pump`]) turns minutes that have ended into events and appends them to the file,
//! so a slow or full disk never stalls a request. What the file does not take is kept (up to a
//! bound, then dropped and counted) and written when it can; a graceful stop writes the minute
//! in progress too.

pub mod cloud;
pub mod expiring;
pub mod file_sink;
pub mod lifecycle;
pub mod pump;
pub mod queue;
pub mod threshold;
pub mod usage;
pub mod webhook;
