//! The metering file: events appended one a line, a file a day. The setting names the base,
//! `metering_file = "/var/lib/pet-gateway/metering.ndjson"`; a day's events go to
//! `metering.ndjson.YYYY-MM-DD` (the UTC day they are written), so a billing job reads whole
//! days that nothing writes any more. Appends are synced; a write that fails (a full disk) is
//! cut back off the file, so no line is ever left half-written.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::base::clock::civil_from_days;

pub struct DailyFile {
    base: PathBuf,
    /// The day and file open now.
    open: Option<(u64, File)>,
}

impl DailyFile {
    pub fn new(base: &Path) -> DailyFile {
        DailyFile {
            base: base.to_owned(),
            open: None,
        }
    }

    /// The file of the UTC day that Unix second `now` falls in.
    pub fn path_for(base: &Path, now: u64) -> PathBuf {
        let (y, m, d) = civil_from_days(now / 86_400);
        let mut name = base.as_os_str().to_owned();
        name.push(format!(".{y:04}-{m:02}-{d:02}"));
        PathBuf::from(name)
    }

    /// Appends `lines` (whole lines) to the day's file and syncs it; on an error the file is
    /// as it was.
    pub fn append(&mut self, now: u64, lines: &[u8]) -> std::io::Result<()> {
        let day = now / 86_400;
        if self.open.as_ref().is_none_or(|(d, _)| *d != day) {
            let file = OpenOptions::new()
                .create(true)
                .append(true)
                .open(Self::path_for(&self.base, now))?;
            self.open = Some((day, file));
        }
        let Some((_, file)) = self.open.as_mut() else {
            return Ok(());
        };
        let before = file.metadata()?.len();
        let written = file.write_all(lines).and_then(|()| file.sync_data());
        if written.is_err() {
            // Whatever part of it went in comes out again; the caller keeps the lines.
            let _ = file.set_len(before);
            self.open = None;
        }
        written
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_utc_day_has_its_own_file() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("metering.ndjson");
        let mut f = DailyFile::new(&base);
        f.append(1_795_046_399, b"{\"a\":1}\n").unwrap();
        f.append(1_795_046_400, b"{\"b\":2}\n").unwrap();
        f.append(1_795_046_401, b"{\"c\":3}\n").unwrap();
        let day1 = std::fs::read_to_string(dir.path().join("metering.ndjson.2026-11-18")).unwrap();
        let day2 = std::fs::read_to_string(dir.path().join("metering.ndjson.2026-11-19")).unwrap();
        assert_eq!(day1, "{\"a\":1}\n");
        assert_eq!(day2, "{\"b\":2}\n{\"c\":3}\n");
    }
}
