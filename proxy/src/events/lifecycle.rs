//! Events about a key rather than its traffic. `pet.key.banned.v1`: reported by the node whose
//! decision started the ban, which the store decides once (its script, or the embedded store's
//! lock), so one event a ban across the fleet. `pet.key.issued.v1`, `pet.key.revoked.v1` and
//! `pet.key.rotated.v1`: reported by whoever made the change (a `keys` command or the admin
//! API), through the key service, written at once to the metering file and the webhook's spool
//! (the gateway holding the spool's lock posts them). Their ids are derived from the key and
//! what happened to it, so a receiver keeps one whatever reports it twice.

use std::path::PathBuf;
use std::sync::Mutex;

use super::cloud::{line_with_id, Origin, BANNED, ISSUED, REVOKED, ROTATED};
use super::file_sink::DailyFile;
use super::usage::Notice;
use super::webhook::spool::Spool;
use crate::base::clock::{rfc3339, unix_now};
use crate::keys::index::KeyInfo;
use crate::keys::record::KeyRecord;
use crate::keys::service::ChangeSink;

/// The notice of `key`'s ban, started at `now` and lasting until `until` (store clock).
pub fn banned(key: &KeyInfo, now: u64, until: u64) -> Notice {
    let mut data = serde_json::json!({
        "key_id": &*key.id,
        "plan": &*key.plan,
        "banned_until": rfc3339(until),
        "reason": "kept sending after 429",
    });
    if let Some(c) = key.customer() {
        data["customer"] = c.into();
    }
    Notice {
        kind: BANNED,
        id: format!("{BANNED}:{}:{until}", key.id),
        time: now,
        data,
    }
}

/// The key service's changes, written to the metering file and the spool as they are made.
pub struct KeyChanges {
    origin: Origin,
    file: Option<Mutex<DailyFile>>,
    spool: Option<Mutex<Spool>>,
}

impl KeyChanges {
    pub fn new(
        environment: &str,
        node_id: &str,
        file: Option<PathBuf>,
        spool: Option<Spool>,
    ) -> KeyChanges {
        KeyChanges {
            origin: Origin::new(environment, node_id),
            file: file.map(|base| Mutex::new(DailyFile::new(&base))),
            spool: spool.map(Mutex::new),
        }
    }
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl ChangeSink for KeyChanges {
    fn changed(
        &self,
        change: &'static str,
        record: &KeyRecord,
        successor: Option<&KeyRecord>,
    ) -> Result<(), String> {
        let kind = match change {
            "issued" => ISSUED,
            "revoked" => REVOKED,
            _ => ROTATED,
        };
        let mut data = serde_json::json!({
            "key_id": record.id,
            "plan": record.plan,
        });
        if let Some(c) = &record.customer {
            data["customer"] = c.as_str().into();
        }
        if let Some(s) = successor {
            data["successor_key_id"] = s.id.as_str().into();
        }
        let now = unix_now();
        let line = line_with_id(
            &self.origin,
            // The record's version too: a second change of one kind (a key revoked again, which
            // changes nothing) has the same id, and a receiver keeps one.
            format!("{kind}:{}:{}", record.id, record.version),
            kind,
            now,
            &data,
        );
        let mut failed = Vec::new();
        if let Some(file) = &self.file {
            if let Err(e) = locked(file).append(now / 86_400, line.as_bytes()) {
                failed.push(format!("the metering file: {e}"));
            }
        }
        if let Some(spool) = &self.spool {
            if let Err(e) = locked(spool).write(line.as_bytes(), 1) {
                failed.push(format!("the events spool: {e}"));
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(failed.join("; "))
        }
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
