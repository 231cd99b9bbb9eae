//! The upstream wing: the backends and what keeps them from being overloaded. It may import
//! [`crate::keys`] and [`crate::base`]; the HTTP wing, the config and the operations wing import
//! it.
//!
//! | module | owns |
//! |---|---|
//! | [`rotation`] | the backends in turn, passive health (a backend that refused is skipped for a while) |
//! | [`names`] | backends given by host name: looked up again on a failed connection and on a timer |
//! | [`places`] | requests at each backend at once (`upstream_max_in_flight`), the wait for a place, shedding |
//! | [`queue`] | who waits for a place: strict levels, round-robin over quota holders within a level |
//! | [`priority`] | a request's level, from its operation and its plan |
//! | [`adaptive`] | `upstream_max_in_flight = "auto"`: a gradient controller on the backend's latency |

pub mod adaptive;
pub mod names;
pub mod places;
pub mod priority;
pub mod queue;
pub mod rotation;
