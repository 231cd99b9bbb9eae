//! pet-gateway: authentication, plan quotas and bans in front of pet-backend.
//!
//! Not built yet: the gateway issue fills this crate. It exists now so the workspace has its
//! final layout.
