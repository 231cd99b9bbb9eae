//! The quota wing: deciding whether an authenticated request may go, and where counts live. It
//! may import [`crate::keys`] (a key's limits) and [`crate::base`]; only the HTTP and operations
//! wings import it.
//!
//! | module | owns |
//! |---|---|
//! | [`rules`] | the window, strike and ban arithmetic; the rate-limit header numbers |
//! | [`store`] | where counts live: the `QuotaStore` trait, memory, Redis, group commit, scripts |
//! | [`resilience`] | circuit breaker, per-node fallback limiter, ban cache |
//! | [`admission`] | ban cache → breaker → store → `on_store_error`: one [`admission::Decision`] |
//! | [`crowded`] | holders just refused for their concurrency, refused here a moment without the store |
//! | [`concurrency`] | the leases this node holds for requests in flight: given back at their end, renewed |
//! | [`unauth`] | the per-client limit on requests without a valid key (IPv6 /64, trusted proxies) |
//! | [`top`] | units admitted per quota holder and day, flushed to the store's top consumers' index |

pub mod admission;
pub mod concurrency;
pub mod crowded;
pub mod regions;
pub mod resilience;
pub mod rules;
pub mod store;
pub mod top;
pub mod unauth;
