//! pet-gateway: authentication, plan quotas and bans in front of pet-backend, on pingora.
//!
//! One module per concern: [`config`] (file, environment and flags into one `Config`),
//! [`plans`] and [`keys`] (the hand-edited files), [`auth`] (the bearer token), [`quota`] (the
//! window arithmetic), [`store`] (where counts live), [`gateway`] (the pingora phases),
//! [`reload`] (picking up edited files), [`server`] (assembling and running it all).

pub mod quota;
pub mod store;
