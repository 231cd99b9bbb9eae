//! Events about a key rather than its traffic. So far `pet.key.banned.v1`: reported by the node
//! whose decision started the ban, which the store decides once (its script, or the embedded
//! store's lock), so one event a ban across the fleet; its id is derived from the key and the
//! ban's end, so a receiver keeps one whatever reports it twice.

use super::usage::Notice;
use crate::base::clock::rfc3339;
use crate::keys::index::KeyInfo;

pub const BANNED: &str = "pet.key.banned.v1";

/// The notice of `key`'s ban, started at `now` and lasting until `until` (store clock).
pub fn banned(key: &KeyInfo, now: u64, until: u64) -> Notice {
    let customer = key
        .quota
        .as_deref()
        .and_then(|q| q.strip_prefix("customer:"));
    let mut data = serde_json::json!({
        "key_id": &*key.id,
        "plan": &*key.plan,
        "banned_until": rfc3339(until),
        "reason": "kept sending after 429",
    });
    if let Some(c) = customer {
        data["customer"] = c.into();
    }
    Notice {
        kind: BANNED,
        id: format!("{BANNED}:{}:{until}", key.id),
        time: now,
        data,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_ban_notice_names_the_key_and_its_end_and_has_a_derived_id() {
        let key = KeyInfo {
            id: Arc::from("k1"),
            plan: Arc::from("free"),
            overrides: Default::default(),
            quota: Some(Arc::from("customer:acme")),
        };
        let n = banned(&key, 1_795_000_000, 1_795_000_060);
        assert_eq!(n.id, "pet.key.banned.v1:k1:1795000060");
        assert_eq!(n.id, banned(&key, 1_795_000_001, 1_795_000_060).id);
        assert_eq!(n.data["banned_until"], "2026-11-18T11:07:40Z");
        assert_eq!(n.data["customer"], "acme");
    }
}
