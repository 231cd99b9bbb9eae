//! The keys wing: which API keys exist and which plans are in force. It may import [`crate::base`]
//! only; the quota, HTTP and operations wings import it.
//!
//! | module | owns |
//! |---|---|
//! | [`format`] | the API key format: environment prefix, random part, checksum |
//! | [`limits`] | a quota as data: windows ([`limits::Every`], a limit each) and their arithmetic |
//! | [`plans`] | the plan files: a plan's [`limits::Limits`] and its costs |
//! | [`index`] | the hot-path index: a key's hash to its [`index::KeyInfo`] |
//! | [`digests`] | the SHA-256 of the last valid tokens, remembered per thread for the index |
//! | [`record`] | a key's record, the keys file's model, validation and status |
//! | [`file`] | the keys file on disk: locked, atomic writes that keep owner and mode |
//! | [`registry`] | the fleet-wide key registry in Redis (records and change feed) |
//! | [`catalog`] | the keys and plans in force on this node, reloaded on edits |
//! | [`replica`] | each node's replica of the registry: follows the feed into the catalog |
//! | [`signing`] | the fleet's Ed25519 signing key and the public keys nodes verify records with |
//! | [`audit`] | the audit log of key changes |
//! | [`service`] | the one key service (issue, rotate, revoke) that the CLI and admin API call |

pub mod audit;
pub mod catalog;
pub mod digests;
pub mod file;
pub mod format;
pub mod index;
pub mod limits;
pub mod plans;
pub mod record;
pub mod registry;
pub mod replica;
pub mod service;
pub mod signing;
