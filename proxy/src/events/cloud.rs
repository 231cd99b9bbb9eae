//! The CloudEvents 1.0 envelope (JSON format) and the ids of this process's events.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use crate::base::clock::rfc3339;

/// The gateway's event types, each named once here: its producers use them, and the spool's
/// check and the delivered-events metric know the set.
pub const USAGE: &str = "pet.usage.v1";
pub const THRESHOLD: &str = "pet.quota.threshold.v1";
pub const ISSUED: &str = "pet.key.issued.v1";
pub const REVOKED: &str = "pet.key.revoked.v1";
pub const ROTATED: &str = "pet.key.rotated.v1";
pub const BANNED: &str = "pet.key.banned.v1";
pub const EXPIRING: &str = "pet.key.expiring.v1";

/// Every type the gateway makes: a delivered event is counted under its type only when it is
/// one of these (a metric's labels stay a fixed set), and a spooled line of any other is not
/// the gateway's.
pub const TYPES: [&str; 7] = [USAGE, THRESHOLD, ISSUED, REVOKED, ROTATED, BANNED, EXPIRING];

/// The type of one line if it is a CloudEvent as the gateway writes them (spec version 1.0, a
/// type of [`TYPES`], a `pet-gateway/` source, an id), else why not.
pub fn gateway_event(line: &[u8]) -> Result<&'static str, String> {
    #[derive(serde::Deserialize)]
    struct Head<'a> {
        specversion: &'a str,
        #[serde(rename = "type")]
        kind: &'a str,
        #[serde(borrow)]
        source: std::borrow::Cow<'a, str>,
        #[serde(borrow)]
        id: std::borrow::Cow<'a, str>,
    }
    let head: Head = serde_json::from_slice(line).map_err(|e| format!("not an event: {e}"))?;
    let kind = TYPES
        .iter()
        .find(|t| **t == head.kind)
        .ok_or_else(|| format!("not a type of the gateway's: {:?}", head.kind))?;
    if head.specversion != "1.0" || !head.source.starts_with("pet-gateway/") || head.id.is_empty() {
        return Err("not a CloudEvent of the gateway's (specversion, source or id)".to_owned());
    }
    Ok(kind)
}

/// Where this process's events come from, and their ids.
pub struct Origin {
    /// `pet-gateway/<environment>/<node>`.
    source: String,
    /// A part of every id that no other process has: the node, the process id and when the
    /// process started, so that an old and a new process of one node (`serve --upgrade`) never
    /// share an id.
    process: String,
    next: AtomicU64,
}

impl Origin {
    pub fn new(environment: &str, node: &str) -> Origin {
        let started = crate::base::clock::unix_now_ms();
        Origin {
            source: format!("pet-gateway/{environment}/{node}"),
            process: format!("{node}.{}.{started:x}", std::process::id()),
            next: AtomicU64::new(1),
        }
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// A new id, unique to this event: a receiver drops a second delivery of one id.
    pub fn next_id(&self) -> String {
        format!(
            "{}.{}",
            self.process,
            self.next.fetch_add(1, Ordering::Relaxed)
        )
    }
}

#[derive(Serialize)]
struct Envelope<'a, D: Serialize> {
    specversion: &'static str,
    id: String,
    source: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    time: String,
    datacontenttype: &'static str,
    data: &'a D,
}

/// One event as one line of JSON (ending in `\n`), its id made now: written and retried as
/// it is, so the id stays the same across deliveries.
pub fn line<D: Serialize>(origin: &Origin, kind: &'static str, time: u64, data: &D) -> String {
    line_with_id(origin, origin.next_id(), kind, time, data)
}

/// One event whose id is given: derived from what it is about, so that whoever reports the
/// same happening gives it the same id and a receiver keeps one.
pub fn line_with_id<D: Serialize>(
    origin: &Origin,
    id: String,
    kind: &'static str,
    time: u64,
    data: &D,
) -> String {
    let envelope = Envelope {
        specversion: "1.0",
        id,
        source: origin.source(),
        kind,
        time: rfc3339(time),
        datacontenttype: "application/json",
        data,
    };
    // A struct of strings and integers always serializes.
    let mut s = serde_json::to_string(&envelope).unwrap_or_default();
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_is_a_cloudevent_with_a_fresh_id() {
        let origin = Origin::new("production", "node-a");
        let a = line(
            &origin,
            "pet.test.v1",
            1_795_000_000,
            &serde_json::json!({"n": 1}),
        );
        let b = line(
            &origin,
            "pet.test.v1",
            1_795_000_000,
            &serde_json::json!({"n": 1}),
        );
        assert!(a.ends_with('\n') && !a[..a.len() - 1].contains('\n'));
        let v: serde_json::Value = serde_json::from_str(&a).unwrap();
        assert_eq!(v["specversion"], "1.0");
        assert_eq!(v["source"], "pet-gateway/production/node-a");
        assert_eq!(v["type"], "pet.test.v1");
        assert_eq!(v["time"], "2026-11-18T11:06:40Z");
        assert_eq!(v["data"]["n"], 1);
        let w: serde_json::Value = serde_json::from_str(&b).unwrap();
        assert_ne!(v["id"], w["id"]);
        let id = v["id"].as_str().unwrap();
        assert!(
            id.starts_with(&format!("node-a.{}.", std::process::id())),
            "{id}"
        );
    }
}
