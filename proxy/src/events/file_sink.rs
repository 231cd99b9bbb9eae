//! The metering file: events appended one a line, a file a day. The setting names the base,
//! `metering_file = "/var/lib/pet-gateway/metering.ndjson"`; the events of a UTC day go to
//! `metering.ndjson.YYYY-MM-DD` (the day of the minute a usage event is of). Appends are synced,
//! under an exclusive `flock` so that the processes sharing a file (nodes on one folder, an old
//! and a new process during `serve --upgrade`) never interleave; a write that fails (a full
//! disk) is cut back off the file under the same lock, so no line is ever half-written and no
//! other process's lines are touched. The sync comes after the lock is released, so a disk that
//! holds one writer's sync does not hold the others' appends. A file deleted or moved away
//! while open (a billing job taking it) is noticed at the next append and made anew.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::base::clock::civil_from_days;

pub struct DailyFile {
    base: PathBuf,
    /// The day and file open now.
    open: Option<(u64, File)>,
    /// How long an append waits for another process's lock ([`LOCK_WAIT`]).
    lock_wait: Duration,
}

impl DailyFile {
    pub fn new(base: &Path) -> DailyFile {
        DailyFile {
            base: base.to_owned(),
            open: None,
            lock_wait: LOCK_WAIT,
        }
    }

    /// The file of UTC day `day` (days since 1970-01-01).
    pub fn path_for(base: &Path, day: u64) -> PathBuf {
        let (y, m, d) = civil_from_days(day);
        let mut name = base.as_os_str().to_owned();
        name.push(format!(".{y:04}-{m:02}-{d:02}"));
        PathBuf::from(name)
    }

    /// Appends `lines` (whole lines) to day `day`'s file and syncs it; on an error the file
    /// is as it was.
    pub fn append(&mut self, day: u64, lines: &[u8]) -> std::io::Result<()> {
        let path = Self::path_for(&self.base, day);
        let stale = match &self.open {
            Some((d, file)) => *d != day || !same_file(&path, file),
            None => true,
        };
        if stale {
            self.open = None;
            let file = OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o660)
                .open(&path)?;
            if let Some(folder) = path.parent() {
                give_to_folder_owner(&file, folder);
            }
            self.open = Some((day, file));
        }
        let Some((_, file)) = self.open.as_ref() else {
            return Ok(());
        };
        let before = {
            let _lock = Flock::exclusive(file, self.lock_wait)?;
            let before = file.metadata()?.len();
            let mut out: &File = file;
            if let Err(e) = out.write_all(lines) {
                // Whatever part of it went in comes out again; the caller keeps the lines.
                let _ = file.set_len(before);
                let _ = file.sync_data();
                return Err(e);
            }
            before
        };
        // Synced with the lock released: the lock keeps lines whole, and a sync that a stalled
        // disk holds must not hold every other writer of the file with it (the other nodes, a
        // keys command, this process's stop writing the open minute).
        let synced = file.sync_data();
        if synced.is_err() {
            // Cut back when nothing came after them (the caller keeps the lines and writes them
            // again); after another writer's lines they stay, and their second copy has the
            // same ids, which a reader drops.
            if let Ok(_lock) = Flock::exclusive(file, self.lock_wait) {
                if file
                    .metadata()
                    .is_ok_and(|m| m.len() == before + lines.len() as u64)
                {
                    let _ = file.set_len(before);
                    let _ = file.sync_data();
                }
            }
        }
        synced
    }
}

/// A file this process made in a folder of the gateway's, handed to the folder's owner and
/// group when this process is root (a `keys` command run with sudo), so the gateway, running
/// as its own user, can still append to the day's file or read a spooled batch. Best effort:
/// a file that stays root's is reported by the gateway's failing writes.
pub fn give_to_folder_owner(file: &File, folder: &Path) {
    // SAFETY: geteuid takes nothing and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return;
    }
    let (Ok(dir), Ok(own)) = (std::fs::metadata(folder), file.metadata()) else {
        return;
    };
    if (own.uid(), own.gid()) != (dir.uid(), dir.gid()) {
        // SAFETY: a valid open descriptor; fchown takes no pointers.
        unsafe { libc::fchown(file.as_raw_fd(), dir.uid(), dir.gid()) };
    }
}

/// Whether `path` still names the open `file` (not deleted, moved away or replaced).
fn same_file(path: &Path, file: &File) -> bool {
    match (std::fs::metadata(path), file.metadata()) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// An exclusive `flock` on a file, released when dropped.
struct Flock<'a>(&'a File);

/// How long an append waits for another process's lock before it fails (its events are kept
/// and tried again the next round): a process that holds the lock for good (stopped by a
/// debugger, or on a hung disk) must not hold this one's thread, and its memory, with it. Long
/// enough for another writer's largest round (64 pieces of 1 MiB, each synced).
const LOCK_WAIT: Duration = Duration::from_secs(30);

impl<'a> Flock<'a> {
    /// Polled every millisecond: a blocking `flock` cannot be given a deadline.
    fn exclusive(file: &'a File, wait: Duration) -> std::io::Result<Flock<'a>> {
        let until = Instant::now() + wait;
        loop {
            // SAFETY: a valid open descriptor; flock takes no pointers.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Ok(Flock(file));
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::WouldBlock {
                return Err(e);
            }
            if Instant::now() >= until {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::WouldBlock,
                    format!("another process has held the file's lock for {wait:?}"),
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for Flock<'_> {
    fn drop(&mut self) {
        // SAFETY: as above.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: u64 = 20_775; // 2026-11-18

    #[test]
    fn each_utc_day_has_its_own_file() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("metering.ndjson");
        let mut f = DailyFile::new(&base);
        f.append(DAY, b"{\"a\":1}\n").unwrap();
        f.append(DAY + 1, b"{\"b\":2}\n").unwrap();
        f.append(DAY, b"{\"c\":3}\n").unwrap();
        let day1 = std::fs::read_to_string(dir.path().join("metering.ndjson.2026-11-18")).unwrap();
        let day2 = std::fs::read_to_string(dir.path().join("metering.ndjson.2026-11-19")).unwrap();
        assert_eq!(day1, "{\"a\":1}\n{\"c\":3}\n");
        assert_eq!(day2, "{\"b\":2}\n");
    }

    #[test]
    fn a_file_taken_away_while_open_is_made_anew() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("m.ndjson");
        let mut f = DailyFile::new(&base);
        f.append(DAY, b"one\n").unwrap();
        let path = DailyFile::path_for(&base, DAY);
        std::fs::rename(&path, dir.path().join("taken")).unwrap();
        f.append(DAY, b"two\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "two\n");
        assert_eq!(
            std::fs::read_to_string(dir.path().join("taken")).unwrap(),
            "one\n"
        );
    }

    #[test]
    fn a_lock_held_for_good_elsewhere_fails_the_append_rather_than_hanging_it() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("m.ndjson");
        let mut f = DailyFile::new(&base);
        f.lock_wait = Duration::from_millis(300);
        f.append(DAY, b"one\n").unwrap();
        let other = File::open(DailyFile::path_for(&base, DAY)).unwrap();
        let held = Flock::exclusive(&other, LOCK_WAIT).unwrap();
        let started = Instant::now();
        let e = f.append(DAY, b"two\n").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        drop(held);
        f.append(DAY, b"two\n").unwrap();
        let text = std::fs::read_to_string(DailyFile::path_for(&base, DAY)).unwrap();
        assert_eq!(text, "one\ntwo\n");
    }

    #[test]
    fn two_writers_of_one_file_keep_every_line_whole() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("m.ndjson");
        let writers: Vec<_> = (0..2)
            .map(|w| {
                let base = base.clone();
                std::thread::spawn(move || {
                    let mut f = DailyFile::new(&base);
                    for i in 0..200 {
                        let line = format!("{}{w}{i:04}\n", "x".repeat(5000));
                        f.append(DAY, line.as_bytes()).unwrap();
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        let text = std::fs::read_to_string(DailyFile::path_for(&base, DAY)).unwrap();
        assert_eq!(text.lines().count(), 400);
        assert!(text.lines().all(|l| l.len() == 5005));
    }
}
