//! The thread that turns usage into events and writes them: once a second it takes the minutes
//! that ended at least `GRACE` ago (the store's clock may run a little ahead of this node's, and
//! a decision is counted just after it is made), makes one `pet.usage.v1` a slot, and appends
//! what is waiting to the metering file. A failed write keeps the events, in order, for the next
//! round, up to `MAX_PENDING` bytes; past that new events are dropped and counted. Stopping it
//! (dropping the handle after the server has stopped) writes every minute, the open one too.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use super::cloud::{line, Origin};
use super::file_sink::DailyFile;
use super::usage::Meter;
use crate::base::clock::unix_now;
use crate::base::metrics::METRICS;

const USAGE: &str = "pet.usage.v1";
/// How long after its end a minute is taken: decisions of it may still be arriving.
const GRACE: u64 = 10;
const TICK: Duration = Duration::from_secs(1);
/// The most bytes of events kept for a sink that fails.
const MAX_PENDING: usize = 64 * 1024 * 1024;

struct Pending {
    lines: VecDeque<(&'static str, String)>,
    bytes: usize,
}

struct Pump {
    meter: Arc<Meter>,
    origin: Arc<Origin>,
    file: DailyFile,
    pending: Pending,
}

/// Stops the pump when dropped, after it has written everything it can.
pub struct PumpHandle {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Starts the pump writing `meter`'s usage to the metering file at `base`.
pub fn start(meter: Arc<Meter>, origin: Arc<Origin>, base: &Path) -> std::io::Result<PumpHandle> {
    let stop = Arc::new((Mutex::new(false), Condvar::new()));
    let mut pump = Pump {
        meter,
        origin,
        file: DailyFile::new(base),
        pending: Pending {
            lines: VecDeque::new(),
            bytes: 0,
        },
    };
    let signal = Arc::clone(&stop);
    let thread = std::thread::Builder::new()
        .name("events".into())
        .spawn(move || {
            let (lock, cv) = &*signal;
            loop {
                let mut stopped = lock.lock().unwrap_or_else(PoisonError::into_inner);
                if !*stopped {
                    stopped = cv
                        .wait_timeout(stopped, TICK)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
                let last = *stopped;
                drop(stopped);
                pump.round(unix_now(), last);
                if last {
                    return;
                }
            }
        })?;
    Ok(PumpHandle {
        stop,
        thread: Some(thread),
    })
}

impl Pump {
    /// Makes the events of the minutes ended by `now` (all of them when `last`) and writes
    /// what is waiting.
    fn round(&mut self, now: u64, last: bool) {
        let before = if last {
            u64::MAX
        } else {
            now.saturating_sub(60 + GRACE) / 60 * 60 + 60
        };
        for (slot, counts) in self.meter.take_before(before) {
            let event = line(&self.origin, USAGE, now, &slot.data(counts));
            self.queue(USAGE, event);
        }
        self.write(now);
    }

    fn queue(&mut self, kind: &'static str, event: String) {
        if self.pending.bytes + event.len() > MAX_PENDING {
            METRICS.events_dropped.inc();
            return;
        }
        self.pending.bytes += event.len();
        self.pending.lines.push_back((kind, event));
        METRICS.events_pending.set(self.pending.lines.len() as i64);
    }

    /// Appends every waiting event in one write; on failure they stay, in order.
    fn write(&mut self, now: u64) {
        if self.pending.lines.is_empty() {
            return;
        }
        let mut batch = Vec::with_capacity(self.pending.bytes);
        for (_, l) in &self.pending.lines {
            batch.extend_from_slice(l.as_bytes());
        }
        match self.file.append(now, &batch) {
            Ok(()) => {
                for (kind, _) in self.pending.lines.drain(..) {
                    METRICS.events_delivered.with_label_values(&[kind]).inc();
                }
                self.pending.bytes = 0;
            }
            Err(e) => {
                METRICS.events_delivery_failures.inc();
                tracing::warn!(
                    error = %e,
                    pending = self.pending.lines.len(),
                    "cannot write the metering file; its events are kept and written again"
                );
            }
        }
        METRICS.events_pending.set(self.pending.lines.len() as i64);
    }
}

impl Drop for PumpHandle {
    fn drop(&mut self) {
        let (lock, cv) = &*self.stop;
        *lock.lock().unwrap_or_else(PoisonError::into_inner) = true;
        cv.notify_all();
        if let Some(thread) = self.thread.take() {
            // Its last round is one append and sync: a disk that hangs for good would hold the
            // stop here, as it would hold any write of the process.
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(meter: &Meter, now: u64) {
        let key = crate::keys::index::KeyInfo {
            id: Arc::from("k1"),
            plan: Arc::from("pro"),
            overrides: Default::default(),
            quota: None,
        };
        meter.record(&key, "listPets", now, true, 1);
    }

    fn lines(dir: &Path) -> Vec<serde_json::Value> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            out.extend(text.lines().map(|l| serde_json::from_str(l).unwrap()));
        }
        out
    }

    #[test]
    fn a_minute_is_written_once_it_has_ended_and_the_open_one_at_the_last_round() {
        let dir = tempfile::tempdir().unwrap();
        let meter = Arc::new(Meter::default());
        let mut pump = Pump {
            meter: Arc::clone(&meter),
            origin: Arc::new(Origin::new("test", "n1")),
            file: DailyFile::new(&dir.path().join("m.ndjson")),
            pending: Pending {
                lines: VecDeque::new(),
                bytes: 0,
            },
        };
        let t = 1_795_000_020; // 11:07:00 UTC
        usage(&meter, t - 60);
        usage(&meter, t);
        pump.round(t + GRACE - 1, false);
        assert!(lines(dir.path()).is_empty(), "11:06 ended under GRACE ago");
        pump.round(t + GRACE, false);
        let got = lines(dir.path());
        assert_eq!(got.len(), 1);
        assert_eq!(got[0]["data"]["minute"], "2026-11-18T11:06:00Z");
        pump.round(t + GRACE + 1, false);
        assert_eq!(lines(dir.path()).len(), 1, "11:07 is still open");
        pump.round(t + GRACE + 2, true);
        let got = lines(dir.path());
        assert_eq!(got.len(), 2);
        assert_eq!(got[1]["data"]["minute"], "2026-11-18T11:07:00Z");
        assert_eq!(got[1]["type"], "pet.usage.v1");
    }

    #[test]
    fn the_handle_writes_everything_when_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let meter = Arc::new(Meter::default());
        let handle = start(
            Arc::clone(&meter),
            Arc::new(Origin::new("test", "n1")),
            &dir.path().join("m.ndjson"),
        )
        .unwrap();
        usage(&meter, unix_now());
        drop(handle);
        assert_eq!(lines(dir.path()).len(), 1);
    }
}
