//! pet-gateway: authentication, plan quotas and bans in front of pet-backend, on pingora.
//!
//! The code lives in wings, one folder per concern, each with a header saying what it owns.
//! The wings form layers: a module imports only from its own wing or from a wing below it,
//! never from one above, so no two modules import each other, directly or through others.
//!
//! | layer | wing | owns |
//! |---|---|---|
//! | 8 | [`ops`] | the assembly (`serve`), the admin listener, the command line and its commands |
//! | 7 | [`config`] | file, environment and flags into one [`config::Config`] |
//! | 6 | [`http`] | the request path through pingora: phases, request shape, responses, TLS |
//! | 5 | [`upstream`] | the backends: rotation and health, places at each, the fair queue, adaptive limits |
//! | 4 | [`events`] | CloudEvents for the business: usage counted per key and minute, the metering file |
//! | 3 | [`quota`] | admission, resilience, the unauthenticated limit, the quota stores |
//! | 2 | [`keys`] | keys and plans: records, the keys file, the registry, the catalog, the key service |
//! | 1 | [`base`] | what every wing shares: the clock, the metrics, where Redis is |

pub mod base;
pub mod config;
pub mod events;
pub mod http;
pub mod keys;
pub mod ops;
pub mod quota;
pub mod upstream;
