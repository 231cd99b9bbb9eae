//! The keys file on disk: read, and written through a lock file and an atomic rename, so two
//! `keys` commands never lose each other's change and a running gateway never reads a
//! half-written file. A rewritten file keeps the owner, group and mode of the one it replaces.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

use rand::RngCore;

use crate::keys::record::{KeysError, KeysFile};

impl KeysFile {
    /// Reads the file; a file that does not exist yet holds no keys.
    pub fn load(path: &Path) -> Result<KeysFile, KeysError> {
        // Only a regular file (following a symlink): a FIFO would block a reload, a device
        // would never end.
        match std::fs::metadata(path) {
            Ok(m) if !m.is_file() => {
                return Err(KeysError::Invalid {
                    path: path.to_owned(),
                    message: "not a regular file".into(),
                })
            }
            _ => {}
        }
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(KeysFile::default()),
            Err(source) => {
                return Err(KeysError::Read {
                    path: path.to_owned(),
                    source,
                })
            }
        };
        let file: KeysFile = toml::from_str(&text).map_err(|e| KeysError::Invalid {
            path: path.to_owned(),
            message: e.to_string().trim_end().to_owned(),
        })?;
        file.validate(path)?;
        Ok(file)
    }

    fn save(&self, path: &Path) -> Result<(), KeysError> {
        // Never write a file that would not load again (the gateway, `check` and every later
        // command would refuse it).
        self.validate(path)?;
        let write_err = |source| KeysError::Write {
            path: path.to_owned(),
            source,
        };
        let body = toml::to_string(self).map_err(|e| KeysError::Invalid {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        // A fresh name, created exclusively (never through a symlink someone left there).
        let mut suffix = [0u8; 8];
        rand::rng().fill_bytes(&mut suffix);
        let tmp = path.with_extension(format!("toml.{}.tmp", hex::encode(suffix)));
        let result = (|| {
            let mut f = new_private_file(&tmp)?;
            keep_owner_and_mode(path, &f)?;
            f.write_all(
                b"# Managed by `pet-gateway keys`: SHA-256 hashes of API keys, never the keys.\n\n",
            )?;
            f.write_all(body.as_bytes())?;
            f.sync_all()
        })();
        if let Err(e) = result {
            let _ = std::fs::remove_file(&tmp);
            return Err(write_err(e));
        }
        std::fs::rename(&tmp, path).map_err(write_err)
    }
}

/// The new file gets the owner, group and mode of the one it replaces: a `keys` command run as
/// root or another user must never leave the gateway a file it cannot read (it would keep its
/// old keys, revoked ones included). Where that owner cannot be given (not root), nothing is
/// written and the error says whom to run as.
#[cfg(unix)]
fn keep_owner_and_mode(path: &Path, new: &File) -> std::io::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let old = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let mine = new.metadata()?;
    if (mine.uid(), mine.gid()) != (old.uid(), old.gid()) {
        std::os::unix::fs::fchown(new, Some(old.uid()), Some(old.gid())).map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!(
                    "cannot give the new file the owner uid {} and group gid {} of the one it \
                     replaces ({e}); run this command as that user or as root; nothing was changed",
                    old.uid(),
                    old.gid()
                ),
            )
        })?;
    }
    // Permission bits only: never set-user-id and the like.
    new.set_permissions(std::fs::Permissions::from_mode(old.mode() & 0o777))
}

#[cfg(not(unix))]
fn keep_owner_and_mode(_path: &Path, _new: &File) -> std::io::Result<()> {
    Ok(())
}

/// Creates `path`, which must not exist yet (`O_EXCL`: a symlink there fails too), mode 0600.
#[cfg(unix)]
fn new_private_file(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
}

#[cfg(not(unix))]
fn new_private_file(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().write(true).create_new(true).open(path)
}

/// Opens (creating) the lock file without truncating it and never through a symlink.
#[cfg(unix)]
fn lock_file(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

#[cfg(not(unix))]
fn lock_file(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
}

/// Writes `file` as the keys file at `path` (a registry node's local snapshot), under the
/// same lock and atomic rename as every other write.
pub fn write_snapshot(path: &Path, file: &KeysFile) -> Result<(), KeysError> {
    with_lock(path, || file.save(path))
}

pub(crate) fn modify<T>(
    path: &Path,
    change: impl FnOnce(&mut KeysFile) -> Result<T, KeysError>,
) -> Result<T, KeysError> {
    modify_raw(path, change, true)
}

/// `read`: start from the file's records (a snapshot overwrite does not need them, and must
/// not fail on a damaged old snapshot).
fn modify_raw<T>(
    path: &Path,
    change: impl FnOnce(&mut KeysFile) -> Result<T, KeysError>,
    read: bool,
) -> Result<T, KeysError> {
    with_lock(path, || {
        let mut file = if read {
            KeysFile::load(path)?
        } else {
            KeysFile::default()
        };
        let out = change(&mut file)?;
        file.save(path)?;
        Ok(out)
    })
}

/// Runs `work` holding the keys file's lock (its folder created first).
fn with_lock<T>(path: &Path, work: impl FnOnce() -> Result<T, KeysError>) -> Result<T, KeysError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| KeysError::Write {
            path: dir.to_owned(),
            source,
        })?;
    }
    let lock_path = path.with_extension("toml.lock");
    let lock = lock_file(&lock_path).map_err(|source| KeysError::Write {
        path: lock_path.clone(),
        source,
    })?;
    lock.lock().map_err(|source| KeysError::Write {
        path: lock_path,
        source,
    })?;
    work()
}
