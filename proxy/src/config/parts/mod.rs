//! The settings, one table per part of the gateway. Each part declares its rows and validates
//! its own section into its piece of [`super::Config`].

pub mod admin;
pub mod events;
pub mod keys;
pub mod limits;
pub mod listen;
pub mod logging;
pub mod redis_access;
pub mod regions;
pub mod runtime;
pub mod store;
pub mod tls;
pub mod tracing;
pub mod upstreams;

mod values;

use crate::config::setting::Row;

/// Every part's table, in the order the book and `check` show them.
pub const ALL: &[&[Row]] = &[
    runtime::SETTINGS,
    listen::SETTINGS,
    admin::SETTINGS,
    upstreams::SETTINGS,
    store::SETTINGS,
    redis_access::SETTINGS,
    regions::SETTINGS,
    keys::SETTINGS,
    limits::SETTINGS,
    tls::SETTINGS,
    logging::SETTINGS,
    tracing::SETTINGS,
    events::SETTINGS,
];

/// Every setting's row, part by part.
pub fn rows() -> impl Iterator<Item = &'static Row> {
    ALL.iter().flat_map(|part| part.iter())
}
