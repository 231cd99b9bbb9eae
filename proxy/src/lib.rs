//! pet-gateway: authentication, plan quotas and bans in front of pet-backend, on pingora.
//!
//! One module per concern: [`config`] (file, environment and flags into one `Config`),
//! [`plans`] and [`keys`] (the hand-edited files), [`auth`] (the bearer token), [`quota`] (the
//! window arithmetic), [`store`] (where counts live), [`gateway`] (the pingora phases),
//! [`catalog`] (the keys and plans in force, reloaded on edits), [`server`] (assembling and running it all).

pub mod admin;
pub mod auth;
pub mod catalog;
pub mod cli;
pub mod commands;
pub mod config;
pub mod gateway;
pub mod keys;
pub mod metrics;
pub mod plans;
pub mod quota;
pub mod resilience;
pub mod responses;
pub mod server;
pub mod store;
pub mod tls;
pub mod unauth;
pub mod upstreams;
