//! The audit log of key changes: one JSON line per change (issue, rotate, revoke), with the time, the
//! action, the key's id and plan, and who made it, never the key. It goes to the `audit_log`
//! file (appended, created 0600) or, when that is not set, to standard error.

use std::io::Write;
use std::path::Path;

use crate::keys::record::KeyRecord;

#[derive(Debug, thiserror::Error)]
#[error("audit log {path}: {source}")]
pub struct AuditError {
    path: String,
    source: std::io::Error,
}

/// Who runs this process: the login name from the environment, and the real user id, which the
/// environment cannot change.
pub fn os_user() -> String {
    let name = std::env::var("SUDO_USER")
        .or_else(|_| std::env::var("USER"))
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "?".into());
    #[cfg(unix)]
    {
        // SAFETY: getuid has no preconditions and cannot fail.
        let uid = unsafe { libc::getuid() };
        format!("{name} (uid {uid})")
    }
    #[cfg(not(unix))]
    name
}

/// The line for `action` on `key` by `who`.
pub fn line(action: &str, key: &KeyRecord, who: &str) -> String {
    let mut entry = serde_json::json!({
        "time": crate::base::clock::rfc3339_now(),
        "action": action,
        "key_id": key.id,
        "plan": key.plan,
        "who": who,
    });
    for (field, value) in [
        (
            "expires_at",
            key.expires_at.clone().map(serde_json::Value::from),
        ),
        ("per_minute", key.per_minute.map(serde_json::Value::from)),
        ("per_day", key.per_day.map(serde_json::Value::from)),
        (
            "limits",
            (!key.limits.is_empty()).then(|| serde_json::json!(key.limits)),
        ),
        ("concurrency", key.concurrency.map(serde_json::Value::from)),
        (
            "customer",
            key.customer.clone().map(serde_json::Value::from),
        ),
        (
            "quota_of",
            key.quota_of.clone().map(serde_json::Value::from),
        ),
        (
            "rotated_to",
            key.rotated_to.clone().map(serde_json::Value::from),
        ),
    ] {
        if let (Some(value), Some(map)) = (value, entry.as_object_mut()) {
            map.insert(field.into(), value);
        }
    }
    entry.to_string()
}

/// Appends `line` to `target`, or writes it to standard error.
pub fn write(target: Option<&Path>, line: &str) -> Result<(), AuditError> {
    let Some(path) = target else {
        eprintln!("{line}");
        return Ok(());
    };
    let err = |source| AuditError {
        path: path.display().to_string(),
        source,
    };
    let mut options = std::fs::OpenOptions::new();
    options.create(true).append(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(path).map_err(err)?;
    file.write_all(format!("{line}\n").as_bytes())
        .map_err(err)?;
    file.sync_data().map_err(err)
}

/// How much of the end of the audit log a key's history is looked for in.
const HISTORY_TAIL: u64 = 8 * 1024 * 1024;

/// The newest lines of `key_id` (at most `max`, newest first) in the last [`HISTORY_TAIL`]
/// bytes of the audit log at `path`; none when it cannot be read.
pub fn lines_of(path: &Path, key_id: &str, max: usize) -> Vec<String> {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut file) = std::fs::File::open(path) else {
        return Vec::new();
    };
    let len = file.metadata().map_or(0, |m| m.len());
    let start = len.saturating_sub(HISTORY_TAIL);
    let mut bytes = Vec::new();
    if file.seek(SeekFrom::Start(start)).is_err()
        || file.take(HISTORY_TAIL).read_to_end(&mut bytes).is_err()
    {
        return Vec::new();
    }
    // The cut may fall inside a character: read leniently, the first line is dropped anyway.
    let text = String::from_utf8_lossy(&bytes);
    // A cut first line is not a whole entry.
    let whole = if start > 0 {
        text.split_once('\n').map_or("", |(_, r)| r)
    } else {
        &text
    };
    whole
        .lines()
        .rev()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l).is_ok_and(|v| v["key_id"] == key_id)
        })
        .take(max)
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_carry_who_did_what_to_which_key_and_never_the_key() {
        let key = KeyRecord {
            id: "key_1".into(),
            name: Some("acme".into()),
            plan: "pro".into(),
            sha256: "ab".repeat(32),
            created_at: "2026-01-01T00:00:00Z".into(),
            revoked_at: None,
            expires_at: Some("2027-01-01T00:00:00Z".into()),
            per_minute: Some(5),
            per_day: None,
            limits: [("1s".to_owned(), 2)].into(),
            concurrency: Some(4),
            customer: Some("acme-corp".into()),
            quota_of: None,
            rotated_to: None,
            version: 0,
            signature: None,
        };
        let v: serde_json::Value = serde_json::from_str(&line("issue", &key, "alice")).unwrap();
        assert_eq!(v["action"], "issue");
        assert_eq!(v["key_id"], "key_1");
        assert_eq!(v["plan"], "pro");
        assert_eq!(v["who"], "alice");
        assert_eq!(v["per_minute"], 5);
        assert_eq!(v["concurrency"], 4);
        assert_eq!(
            (v["limits"]["1s"].clone(), v["customer"].clone()),
            (2.into(), "acme-corp".into())
        );
        assert!(v.get("per_day").is_none() && v.get("sha256").is_none());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        write(Some(&path), "one").unwrap();
        write(Some(&path), "two").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "one\ntwo\n");
    }
}
