//! Events for the business: this node's name in them, and the metering file.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::config::model::ConfigError;
use crate::config::setting::{Kind, Layers, Preset, Row, Setting, Value};

const NODE_ID: Setting<String> = Setting::new(
    "node_id",
    Kind::Text,
    Preset::Computed("the host name"),
    "this node's name in its events' `source` (`pet-gateway/<environment>/<node_id>`) and ids: \
     1 to 64 letters, digits, `-`, `_` or `.`",
    node_name,
)
.flag("--node-id", "NAME")
.env("PET_GATEWAY_NODE_ID");
const METERING_FILE: Setting<PathBuf> = Setting::new(
    "metering_file",
    Kind::Path,
    Preset::Absent("none: no usage events"),
    "usage events (`pet.usage.v1` CloudEvents, one a key, operation and minute) appended one a \
     line to `<metering_file>.YYYY-MM-DD`, a file a UTC day; its folder must exist and be \
     writable (`check` and `serve` say so otherwise)",
    Value::path,
)
.flag("--metering-file", "PATH")
.env("PET_GATEWAY_METERING_FILE");

pub const SETTINGS: &[Row] = &[NODE_ID.row, METERING_FILE.row];

pub struct Events {
    pub node_id: String,
    pub metering_file: Option<PathBuf>,
}

pub fn validate(l: &Layers) -> Result<Events, ConfigError> {
    let node_id = l.or(&NODE_ID, Value::Text(host_name()))?.value;
    let metering_file = match l.get(&METERING_FILE)? {
        Some(file) => {
            if let Err(why) = writable_folder(&file.value) {
                return Err(file.error(why));
            }
            Some(file.value)
        }
        None => None,
    };
    Ok(Events {
        node_id,
        metering_file,
    })
}

fn node_name(v: Value) -> Result<String, String> {
    let t = v.text()?;
    let ok = (1..=64).contains(&t.len())
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(t)
    } else {
        Err(format!(
            "`{t}` must be 1 to 64 letters, digits, `-`, `_` or `.`"
        ))
    }
}

/// The host name, cut to what a node id may hold; `localhost` when there is none.
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its whole length, which is passed.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    let name: String = String::from_utf8_lossy(&buf[..end])
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .take(64)
        .collect();
    if rc != 0 || name.is_empty() {
        "localhost".to_owned()
    } else {
        name
    }
}

/// Whether the files of `base` can be made: its folder exists and this process may write it.
fn writable_folder(base: &Path) -> Result<(), String> {
    if base.file_name().is_none() {
        return Err(format!("{} names no file", base.display()));
    }
    let folder = match base.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !folder.is_dir() {
        return Err(format!("{}: no such folder", folder.display()));
    }
    let c = CString::new(folder.as_os_str().as_bytes())
        .map_err(|_| format!("{}: a NUL in the path", folder.display()))?;
    // SAFETY: a NUL-terminated path; access() only reads it.
    if unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
        return Err(format!(
            "{}: cannot be written by this process ({})",
            folder.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_are_checked_and_the_host_name_fits_them() {
        assert!(node_name(Value::Text("node-a.eu_1".into())).is_ok());
        assert!(node_name(Value::Text("".into())).is_err());
        assert!(node_name(Value::Text("a b".into())).is_err());
        assert!(node_name(Value::Text("x".repeat(65))).is_err());
        assert!(node_name(Value::Text(host_name())).is_ok());
    }

    #[test]
    fn a_metering_file_needs_a_writable_folder() {
        let dir = tempfile::tempdir().unwrap();
        assert!(writable_folder(&dir.path().join("m.ndjson")).is_ok());
        let missing = writable_folder(&dir.path().join("nope/m.ndjson")).unwrap_err();
        assert!(missing.contains("no such folder"), "{missing}");
        assert!(writable_folder(Path::new("/")).is_err());
    }
}
