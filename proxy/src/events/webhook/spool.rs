//! The spool: the folder (`events_spool_dir`) that holds every event the webhook has not yet
//! delivered, so a receiver that is down for hours, or a gateway that restarts, loses nothing.
//!
//! Each batch is one file, a *segment*, `<created ms>-<pid>-<seq>-<events>.events`, NDJSON, one
//! event a line: written whole as `tmp-…`, synced, then renamed, so a segment is either all
//! there or not there, whoever wrote it (the gateway's events thread, or a `keys` command
//! reporting a key change). Names sort by age. Only the process holding the folder's `lock`
//! (an exclusive `flock`) delivers; a segment leaves the folder once the receiver took it (or
//! went to `dead-letter.ndjson`), so a restart delivers what is left, and a successor during
//! `serve --upgrade` takes the lock, and the segments, once its predecessor has exited.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::base::clock::unix_now_ms;
use crate::events::file_sink::give_to_folder_owner;

const SUFFIX: &str = ".events";
const TMP: &str = "tmp-";
pub const DEAD_LETTER: &str = "dead-letter.ndjson";
const LOCK: &str = "lock";
/// The file holding the spool's own id ([`Spool::id`]).
const ID_FILE: &str = "spool-id";
/// How long a measure of the spool's size is trusted before the folder is listed again.
const SIZE_TTL: Duration = Duration::from_secs(1);

static SEQ: AtomicU64 = AtomicU64::new(0);

/// One segment waiting for delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub path: PathBuf,
    pub created_ms: u64,
    pub events: usize,
}

pub struct Spool {
    dir: PathBuf,
    max_bytes: u64,
    /// The spool's size as last measured, plus what this process wrote since.
    used: Option<(Instant, u64)>,
}

impl Spool {
    pub fn new(dir: &Path, max_bytes: u64) -> Spool {
        Spool {
            dir: dir.to_owned(),
            max_bytes,
            used: None,
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// This spool's own name, 16 random hex digits kept in its `spool-id` file (made on first
    /// use): with a batch's segment name, the batch's `webhook-id`, unique across the fleet
    /// whatever the nodes are called and stable across restarts. A file that holds anything
    /// else (the folder is one others may write) is refused, never used or replaced.
    pub fn id(&self) -> std::io::Result<String> {
        let path = self.dir.join(ID_FILE);
        if let Some(id) = read_id(&path)? {
            return Ok(id);
        }
        let id = hex::encode(rand::random::<[u8; 8]>());
        let tmp = self
            .dir
            .join(format!("{TMP}{ID_FILE}-{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        write_synced(&tmp, &self.dir, id.as_bytes())?;
        // A link, not a rename: a process that made the file first keeps its id.
        let linked = std::fs::hard_link(&tmp, &path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => Ok(id),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                read_id(&path)?.ok_or_else(|| std::io::Error::other("spool-id vanished"))
            }
            Err(e) => Err(e),
        }
    }

    /// Writes `lines` (whole NDJSON lines, `events` of them) as a new segment, synced before it
    /// is visible. Refused, with nothing written, when the spool would pass its size.
    pub fn write(&mut self, lines: &[u8], events: usize) -> std::io::Result<()> {
        let used = self.used()?;
        if used + lines.len() as u64 > self.max_bytes {
            return Err(std::io::Error::other(format!(
                "the spool {} is full ({used} bytes of events_spool_max_mb)",
                self.dir.display()
            )));
        }
        let name = format!(
            "{:013}-{}-{}-{events}{SUFFIX}",
            unix_now_ms(),
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let tmp = self.dir.join(format!("{TMP}{name}"));
        let written = write_synced(&tmp, &self.dir, lines)
            .and_then(|()| std::fs::rename(&tmp, self.dir.join(&name)))
            .and_then(|()| File::open(&self.dir)?.sync_all());
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written?;
        if let Some((_, used)) = &mut self.used {
            *used += lines.len() as u64;
        }
        Ok(())
    }

    fn used(&mut self) -> std::io::Result<u64> {
        if let Some((at, used)) = self.used {
            if at.elapsed() < SIZE_TTL {
                return Ok(used);
            }
        }
        // Segments and the dead letters: both stay on this disk until someone acts.
        let mut used = 0;
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.ends_with(SUFFIX) || name == DEAD_LETTER {
                used += entry.metadata().map_or(0, |m| m.len());
            }
        }
        self.used = Some((Instant::now(), used));
        Ok(used)
    }

    /// The segments waiting, oldest first.
    pub fn segments(&self) -> std::io::Result<Vec<Segment>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let name = entry?.file_name();
            if let Some(seg) = parse(&self.dir, &name.to_string_lossy()) {
                out.push(seg);
            }
        }
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    }

    /// A segment's lines: only a regular file in the folder itself (a link planted there is
    /// never followed to a file this process may read and others may not).
    pub fn read(seg: &Segment) -> std::io::Result<Vec<u8>> {
        let mut file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&seg.path)?;
        if !file.metadata()?.is_file() {
            return Err(std::io::Error::other("not a regular file"));
        }
        let mut lines = Vec::new();
        file.read_to_end(&mut lines)?;
        Ok(lines)
    }

    /// Moves a segment's events to the dead-letter file (appended whole or not at all, synced)
    /// and drops it.
    pub fn dead_letter(&self, seg: &Segment) -> std::io::Result<()> {
        let lines = Self::read(seg)?;
        let path = self.dir.join(DEAD_LETTER);
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o660)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)?;
        give_to_folder_owner(&file, &self.dir);
        let before = file.metadata()?.len();
        let mut out: &File = &file;
        let written = out.write_all(&lines).and_then(|()| file.sync_data());
        if let Err(e) = written {
            let _ = file.set_len(before);
            return Err(e);
        }
        std::fs::remove_file(&seg.path)
    }

    /// Sets aside a segment that cannot be read (another user's, or not a file), so it no
    /// longer holds up the ones behind it; an operator looks at `<name>.unreadable`.
    pub fn set_aside(&self, seg: &Segment) -> std::io::Result<()> {
        let mut aside = seg.path.clone().into_os_string();
        aside.push(".unreadable");
        std::fs::rename(&seg.path, aside)
    }

    /// Removes what a process that died while writing left (`tmp-…` older than an hour).
    pub fn clean_leftovers(&self) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let old = entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > Duration::from_secs(3600)));
            if entry.file_name().to_string_lossy().starts_with(TMP) && old {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    /// The spool's lock, when no other process holds it: only its holder delivers.
    pub fn try_lock(&self) -> std::io::Result<Option<File>> {
        // Not through a link: whoever may write the folder must not point the gateway's
        // open (and create) elsewhere.
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(self.dir.join(LOCK))?;
        // SAFETY: a valid open descriptor; flock takes no pointers.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            Ok(Some(file))
        } else {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::WouldBlock {
                Ok(None)
            } else {
                Err(e)
            }
        }
    }
}

/// The id in `path`: `None` when there is no file; an error when it holds anything but 16
/// lowercase hex digits.
fn read_id(path: &Path) -> std::io::Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let id = text.trim();
            let valid = id.len() == 16
                && id
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
            if valid {
                Ok(Some(id.to_owned()))
            } else {
                Err(std::io::Error::other(format!(
                    "{} holds something other than a spool id",
                    path.display()
                )))
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

fn write_synced(path: &Path, dir: &Path, lines: &[u8]) -> std::io::Result<()> {
    let mut file = OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o660)
        .open(path)?;
    give_to_folder_owner(&file, dir);
    file.write_all(lines)?;
    file.sync_all()
}

/// `<ms>-<pid>-<seq>-<events>.events`; anything else (a temporary file, the lock, the dead
/// letters, an operator's file) is not a segment.
fn parse(dir: &Path, name: &str) -> Option<Segment> {
    let stem = name.strip_suffix(SUFFIX)?;
    let mut parts = stem.split('-');
    let created_ms = parts.next()?.parse().ok()?;
    parts.next()?.parse::<u32>().ok()?;
    parts.next()?.parse::<u64>().ok()?;
    let events: usize = parts.next()?.parse().ok()?;
    if parts.next().is_some() || events > super::BATCH_EVENTS {
        return None;
    }
    Some(Segment {
        path: dir.join(name),
        created_ms,
        events,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spool_keeps_one_id_and_refuses_a_file_that_is_not_one() {
        let dir = tempfile::tempdir().unwrap();
        let first = Spool::new(dir.path(), 1 << 20).id().unwrap();
        assert_eq!(first.len(), 16, "{first}");
        assert_eq!(Spool::new(dir.path(), 1 << 20).id().unwrap(), first);
        let other = tempfile::tempdir().unwrap();
        assert_ne!(Spool::new(other.path(), 1 << 20).id().unwrap(), first);
        std::fs::write(dir.path().join(ID_FILE), "node\r\nX-Evil: 1").unwrap();
        assert!(Spool::new(dir.path(), 1 << 20).id().is_err());
        assert_eq!(
            std::fs::read_to_string(dir.path().join(ID_FILE)).unwrap(),
            "node\r\nX-Evil: 1",
            "never replaced"
        );
    }

    #[test]
    fn segments_are_listed_oldest_first_and_other_files_are_not_segments() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::new(dir.path(), 1 << 20);
        spool.write(b"{\"a\":1}\n", 1).unwrap();
        spool.write(b"{\"b\":1}\n{\"c\":1}\n", 2).unwrap();
        std::fs::write(dir.path().join("tmp-0000000000001-1-1-1.events"), "x").unwrap();
        std::fs::write(dir.path().join("notes.txt"), "x").unwrap();
        let segs = spool.segments().unwrap();
        assert_eq!(segs.iter().map(|s| s.events).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(std::fs::read(&segs[0].path).unwrap(), b"{\"a\":1}\n");
    }

    #[test]
    fn a_full_spool_refuses_a_segment_and_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::new(dir.path(), 20);
        spool.write(b"0123456789\n", 1).unwrap();
        let e = spool.write(b"0123456789\n", 1).unwrap_err();
        assert!(e.to_string().contains("full"), "{e}");
        assert_eq!(spool.segments().unwrap().len(), 1);
    }

    #[test]
    fn dead_letters_are_appended_and_the_segment_goes() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::new(dir.path(), 1 << 20);
        spool.write(b"{\"a\":1}\n", 1).unwrap();
        spool.write(b"{\"b\":1}\n", 1).unwrap();
        for seg in spool.segments().unwrap() {
            spool.dead_letter(&seg).unwrap();
        }
        assert!(spool.segments().unwrap().is_empty());
        let dead = std::fs::read_to_string(dir.path().join(DEAD_LETTER)).unwrap();
        assert_eq!(dead, "{\"a\":1}\n{\"b\":1}\n");
    }

    #[test]
    fn a_link_planted_in_the_spool_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret.key");
        std::fs::write(&secret, "PRIVATE").unwrap();
        let spool_dir = dir.path().join("spool");
        std::fs::create_dir(&spool_dir).unwrap();
        std::os::unix::fs::symlink(&secret, spool_dir.join("0000000000001-1-1-1.events")).unwrap();
        let spool = Spool::new(&spool_dir, 1 << 20);
        let seg = spool.segments().unwrap().remove(0);
        assert!(Spool::read(&seg).is_err());
        assert!(spool.dead_letter(&seg).is_err());
        assert!(
            !spool_dir.join(DEAD_LETTER).exists()
                || std::fs::read_to_string(spool_dir.join(DEAD_LETTER))
                    .unwrap()
                    .is_empty()
        );
        spool.set_aside(&seg).unwrap();
        assert!(spool.segments().unwrap().is_empty());
    }

    #[test]
    fn one_process_holds_the_lock_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let spool = Spool::new(dir.path(), 1 << 20);
        let held = spool.try_lock().unwrap();
        assert!(held.is_some());
        // flock locks belong to the open file: a second open is a second holder.
        assert!(spool.try_lock().unwrap().is_none());
        drop(held);
        assert!(spool.try_lock().unwrap().is_some());
    }
}
