//! pet-backend: the pet adoption interface (`openapi.yaml`) on SQLite.
//!
//! One module per concern: [`routes`] (what is served), [`api`] (handlers), [`pet`] and
//! [`query`] (the interface's rules), [`store`] (SQLite), [`error`] (the Error body),
//! [`server`] (connections and shutdown), [`metrics`] (Prometheus).

pub mod api;
pub mod error;
pub mod metrics;
pub mod pet;
pub mod query;
pub mod routes;
pub mod server;
pub mod store;

pub use api::Settings;
pub use server::{run, run_with, shutdown_signal};
pub use store::PetStore;
