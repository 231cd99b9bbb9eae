//! The operations wing: what runs the gateway and what operators use. It may import every other
//! wing; none imports it.
//!
//! | module | owns |
//! |---|---|
//! | [`server`] | assembling and running it all: proxy, admin listener, reloader, store probe |
//! | [`admin`] | the admin listener: a route table, handlers by resource |
//! | [`admin_client`] | the command line's HTTP client to a running gateway's admin listener |
//! | [`cli`] | the command line (a stable contract operators script against) |
//! | [`commands`] | what each command does |
//! | [`stop_signals`] | SIGTERM, SIGQUIT, SIGINT and SIGHUP, taken before anything listens |
//! | [`wiring`] | what a node and the commands both open: the key registry, the key-change sink |

pub mod admin;
pub mod admin_client;
pub mod cli;
pub mod commands;
pub mod console;
pub mod server;
pub mod stop_signals;
pub mod wiring;
