//! The thread that turns usage into events and writes them. Once a second it takes the minutes
//! that ended at least `GRACE` ago by the store's clock (the latest a decision came with, or
//! this node's less `LOCAL_LAG` when that is later: no decisions come, or the store's clock is
//! behind; a minute is written at most GRACE + LOCAL_LAG + a round after it ends), makes one
//! `pet.usage.v1` a slot, and hands every event to each sink's [`Queue`]: the metering file and
//! the webhook's spool. Stopping it (dropping the handle after the server has stopped) writes
//! every minute, the open one too, retrying a failing sink for `STOP_RETRY` before counting
//! what is left as dropped.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::cloud::{line, line_with_id, Origin, USAGE};
use super::queue::{Queue, Waiting};
use super::usage::Meter;
use crate::base::clock::unix_now;

/// How long after its end a minute is taken: decisions of it may still be arriving.
const GRACE: u64 = 10;
/// How far this node's clock may run ahead of the store's before it releases minutes itself.
const LOCAL_LAG: u64 = 30;
const TICK: Duration = Duration::from_secs(1);
/// How long the last round keeps trying a failing file.
const STOP_RETRY: Duration = Duration::from_secs(5);
/// How long a stop waits for the thread (a disk that hangs for good must not hold it).
const STOP_WAIT: Duration = Duration::from_secs(10);

struct Pump {
    meter: Arc<Meter>,
    origin: Arc<Origin>,
    sinks: Vec<Queue>,
}

/// Stops the pump when dropped, after it has written everything it can.
pub struct PumpHandle {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Starts the pump writing `meter`'s usage and notices to `sinks`.
pub fn start(
    meter: Arc<Meter>,
    origin: Arc<Origin>,
    sinks: Vec<Queue>,
) -> std::io::Result<PumpHandle> {
    let stop = Arc::new((Mutex::new(false), Condvar::new()));
    let mut pump = Pump {
        meter,
        origin,
        sinks,
    };
    let signal = Arc::clone(&stop);
    let thread = std::thread::Builder::new()
        .name("events".into())
        .spawn(move || pump.run(&signal))?;
    Ok(PumpHandle {
        stop,
        thread: Some(thread),
    })
}

impl Pump {
    fn run(&mut self, signal: &(Mutex<bool>, Condvar)) {
        let (lock, cv) = signal;
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
            // A round that panics loses its events, not the thread: the next round goes on.
            let round = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.round(unix_now(), last);
            }));
            if round.is_err() {
                tracing::error!("a round of the events thread panicked; its events are lost");
            }
            if last {
                self.finish();
                return;
            }
        }
    }

    /// Makes the events of the minutes ended by the store's clock (all of them when `last`)
    /// and writes what is waiting.
    fn round(&mut self, local_now: u64, last: bool) {
        let clock = self
            .meter
            .store_now()
            .max(local_now.saturating_sub(LOCAL_LAG));
        let before = if last {
            u64::MAX
        } else {
            clock.saturating_sub(60 + GRACE) / 60 * 60 + 60
        };
        for sink in &mut self.sinks {
            sink.new_round();
        }
        for notice in self.meter.take_notices() {
            let event = line_with_id(
                &self.origin,
                notice.id,
                notice.kind,
                notice.time,
                &notice.data,
            );
            self.queue(notice.kind, notice.time / 86_400, event);
        }
        for (slot, counts) in self.meter.take_before(before) {
            let event = line(&self.origin, USAGE, local_now, &slot.data(counts));
            self.queue(USAGE, slot.minute / 86_400, event);
        }
        self.write();
    }

    fn queue(&mut self, kind: &'static str, day: u64, line: String) {
        let event = Arc::new(Waiting { kind, day, line });
        for sink in &mut self.sinks {
            sink.push(Arc::clone(&event));
        }
    }

    fn write(&mut self) {
        for sink in &mut self.sinks {
            sink.write();
        }
    }

    /// The last round's retries; what still cannot be written is dropped and counted.
    fn finish(&mut self) {
        let until = Instant::now() + STOP_RETRY;
        for sink in &mut self.sinks {
            sink.finish(until);
        }
    }
}

impl Drop for PumpHandle {
    fn drop(&mut self) {
        let (lock, cv) = &*self.stop;
        *lock.lock().unwrap_or_else(PoisonError::into_inner) = true;
        cv.notify_all();
        let Some(thread) = self.thread.take() else {
            return;
        };
        let deadline = Instant::now() + STOP_WAIT;
        while !thread.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if thread.is_finished() {
            let _ = thread.join();
        } else {
            tracing::error!("the events thread did not finish writing within {STOP_WAIT:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::metrics::METRICS;
    use crate::events::file_sink::DailyFile;
    use crate::events::queue::FileOutput;
    use std::path::Path;

    fn usage(meter: &Meter, now: u64) {
        let key = crate::keys::index::KeyInfo {
            id: Arc::from("k1"),
            plan: Arc::from("pro"),
            overrides: Default::default(),
            quota: None,
        };
        meter.record(&key, "listPets", now, true, 1);
    }

    fn file(dir: &Path) -> Vec<Queue> {
        vec![Queue::new(Box::new(FileOutput::new(&dir.join("m.ndjson"))))]
    }

    fn pump(dir: &Path, meter: &Arc<Meter>) -> Pump {
        Pump {
            meter: Arc::clone(meter),
            origin: Arc::new(Origin::new("test", "n1")),
            sinks: file(dir),
        }
    }

    fn lines(dir: &Path) -> Vec<serde_json::Value> {
        let mut out = Vec::new();
        let mut paths: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        paths.sort();
        for path in paths {
            let text = std::fs::read_to_string(path).unwrap();
            out.extend(text.lines().map(|l| serde_json::from_str(l).unwrap()));
        }
        out
    }

    #[test]
    fn a_minute_is_written_once_the_stores_clock_passed_its_end_and_the_open_one_at_stop() {
        let dir = tempfile::tempdir().unwrap();
        let meter = Arc::new(Meter::default());
        let mut pump = pump(dir.path(), &meter);
        let t = 1_795_000_020; // 11:07:00 UTC
        usage(&meter, t - 60);
        usage(&meter, t + GRACE - 1);
        pump.round(t + GRACE - 1, false);
        assert!(lines(dir.path()).is_empty(), "11:06 ended under GRACE ago");
        usage(&meter, t + GRACE);
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
        assert_eq!(got[1]["data"]["admitted"], 2);
        assert_eq!(got[1]["type"], "pet.usage.v1");
    }

    #[test]
    fn a_store_clock_ahead_releases_minutes_by_its_time() {
        let dir = tempfile::tempdir().unwrap();
        let meter = Arc::new(Meter::default());
        let mut pump = pump(dir.path(), &meter);
        let t = 1_795_000_020;
        // The store runs 40 s ahead: for it, 11:06 ended GRACE ago; for this node, not yet.
        usage(&meter, t - 60);
        usage(&meter, t + GRACE);
        pump.round(t + GRACE - 40, false);
        assert_eq!(lines(dir.path()).len(), 1);
    }

    #[test]
    fn without_decisions_this_nodes_clock_less_the_lag_releases_minutes() {
        let dir = tempfile::tempdir().unwrap();
        let meter = Arc::new(Meter::default());
        let mut pump = pump(dir.path(), &meter);
        let t = 1_795_000_020;
        usage(&meter, t - 60);
        pump.round(t + GRACE + LOCAL_LAG - 1, false);
        assert!(lines(dir.path()).is_empty());
        pump.round(t + GRACE + LOCAL_LAG, false);
        assert_eq!(lines(dir.path()).len(), 1);
    }

    #[test]
    fn a_minute_before_midnight_goes_to_its_own_days_file() {
        let dir = tempfile::tempdir().unwrap();
        let meter = Arc::new(Meter::default());
        let mut pump = pump(dir.path(), &meter);
        let midnight = 20_776 * 86_400; // 2026-11-19T00:00:00Z
        usage(&meter, midnight - 30);
        pump.round(midnight + GRACE + LOCAL_LAG, false);
        assert!(dir.path().join("m.ndjson.2026-11-18").exists());
        assert!(!dir.path().join("m.ndjson.2026-11-19").exists());
    }

    #[test]
    fn events_a_failing_file_did_not_take_are_kept_in_order_and_written_later() {
        let dir = tempfile::tempdir().unwrap();
        let meter = Arc::new(Meter::default());
        let mut pump = pump(dir.path(), &meter);
        let t = 1_795_000_020;
        // The day's file cannot be opened: a folder stands in its place.
        let blocker = DailyFile::path_for(&dir.path().join("m.ndjson"), t / 86_400);
        std::fs::create_dir(&blocker).unwrap();
        let failures = METRICS
            .events_delivery_failures
            .with_label_values(&["file"])
            .get();
        usage(&meter, t - 120);
        usage(&meter, t - 60);
        pump.round(t + GRACE + LOCAL_LAG, false);
        assert_eq!(pump.sinks[0].len(), 2);
        assert!(
            METRICS
                .events_delivery_failures
                .with_label_values(&["file"])
                .get()
                > failures
        );
        std::fs::remove_dir(&blocker).unwrap();
        pump.round(t + GRACE + LOCAL_LAG + 1, false);
        assert!(pump.sinks[0].is_empty());
        let got = lines(dir.path());
        let minutes: Vec<_> = got.iter().map(|e| e["data"]["minute"].clone()).collect();
        assert_eq!(minutes, ["2026-11-18T11:05:00Z", "2026-11-18T11:06:00Z"]);
    }

    #[test]
    fn the_handle_writes_everything_when_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let meter = Arc::new(Meter::default());
        let handle = start(
            Arc::clone(&meter),
            Arc::new(Origin::new("test", "n1")),
            file(dir.path()),
        )
        .unwrap();
        usage(&meter, unix_now());
        drop(handle);
        assert_eq!(lines(dir.path()).len(), 1);
    }
}
