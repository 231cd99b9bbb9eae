//! The thread that turns usage into events and writes them. Once a second it takes the minutes
//! that ended at least `GRACE` ago by the store's clock (the latest a decision came with, or
//! this node's less `LOCAL_LAG` when that is later: no decisions come, or the store's clock is
//! behind; a minute is written at most GRACE + LOCAL_LAG + a round after it ends), makes one
//! `pet.usage.v1` a slot, and hands every event to each sink's [`Queue`]: the metering file and
//! the webhook's spool. Stopping it (dropping the handle after the server has stopped) writes
//! every minute, the open one too. The stop takes them itself rather than leave them to the
//! thread: a thread still held in an earlier round's write (a sync on a stalled disk, another
//! process's lock on the file) would take the open minute into the process's grave. It waits
//! `ROUND_WAIT` for the thread's round to end and keeps its sinks (and what waits in them), or
//! else makes sinks of its own; then each sink is written on a thread of its own, so one that
//! stalls holds neither the other nor the stop, retried for `STOP_RETRY`; what is left then is
//! dropped, logged and counted.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::cloud::{line, line_with_id, Origin, USAGE};
use super::queue::{Queue, Waiting};
use super::usage::Meter;
use crate::base::clock::unix_now;
use crate::base::metrics::METRICS;

/// How long after its end a minute is taken: decisions of it may still be arriving.
const GRACE: u64 = 10;
/// How far this node's clock may run ahead of the store's before it releases minutes itself.
const LOCAL_LAG: u64 = 30;
const TICK: Duration = Duration::from_secs(1);
/// How long a stop waits for the round the thread is in before it writes with sinks of its own.
const ROUND_WAIT: Duration = Duration::from_secs(4);
/// How long the stop keeps trying a failing sink.
const STOP_RETRY: Duration = Duration::from_secs(5);
/// Past `STOP_RETRY`, how long a stop waits for a sink's writer still inside a write.
const WRITER_MARGIN: Duration = Duration::from_secs(1);

/// Makes the sinks: the thread's, and a stop's own when the thread is held up.
pub type MakeSinks = Arc<dyn Fn() -> Vec<Queue> + Send + Sync>;

struct Pump {
    meter: Arc<Meter>,
    origin: Arc<Origin>,
    sinks: Vec<Queue>,
}

/// Stops the pump when dropped, after it has written everything it can.
pub struct PumpHandle {
    stop: Arc<(Mutex<bool>, Condvar)>,
    /// Gives its pump (its sinks, and what waits in them) back when it ends.
    thread: Option<std::thread::JoinHandle<Pump>>,
    meter: Arc<Meter>,
    origin: Arc<Origin>,
    make_sinks: MakeSinks,
    round_wait: Duration,
    retry: Duration,
}

/// Starts the pump writing `meter`'s usage and notices to the sinks `make_sinks` makes.
pub fn start(
    meter: Arc<Meter>,
    origin: Arc<Origin>,
    make_sinks: MakeSinks,
) -> std::io::Result<PumpHandle> {
    let stop = Arc::new((Mutex::new(false), Condvar::new()));
    let mut pump = Pump {
        meter: Arc::clone(&meter),
        origin: Arc::clone(&origin),
        sinks: make_sinks(),
    };
    let signal = Arc::clone(&stop);
    let thread = std::thread::Builder::new()
        .name("events".into())
        .spawn(move || {
            pump.run(&signal);
            pump
        })?;
    Ok(PumpHandle {
        stop,
        thread: Some(thread),
        meter,
        origin,
        make_sinks,
        round_wait: ROUND_WAIT,
        retry: STOP_RETRY,
    })
}

impl Pump {
    /// Rounds until stopped; the stop's own round is the handle's.
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
            if *stopped {
                return;
            }
            drop(stopped);
            // A round that panics loses its events, not the thread: the next round goes on.
            let round = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.round(unix_now(), false);
            }));
            if round.is_err() {
                tracing::error!("a round of the events thread panicked; its events are lost");
            }
        }
    }

    /// Makes the events of the minutes ended by the store's clock (all of them when `last`)
    /// and writes what is waiting.
    fn round(&mut self, local_now: u64, last: bool) {
        self.take(local_now, last);
        self.write();
    }

    /// Makes the events of the minutes ended by the store's clock (all of them when `last`)
    /// and the notices, into every sink's queue.
    fn take(&mut self, local_now: u64, last: bool) {
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
}

impl PumpHandle {
    /// The thread's sinks once its round has ended, or none when it is held up (or panicked).
    fn thread_sinks(&mut self) -> Option<Vec<Queue>> {
        let thread = self.thread.take()?;
        let deadline = Instant::now() + self.round_wait;
        while !thread.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if !thread.is_finished() {
            tracing::error!(
                "the events thread is still inside a write after {:?} (a stalled disk?): the \
                 stop writes the open minute with sinks of its own; what that thread holds is lost",
                self.round_wait
            );
            return None;
        }
        thread.join().ok().map(|pump| pump.sinks)
    }

    /// Sinks of the stop's own, the stuck thread's backlog (its sinks' pending gauges, at
    /// most: the batch inside the stalled write may yet land) counted as dropped.
    fn sinks_past_a_stuck_thread(&self) -> Vec<Queue> {
        let sinks = (self.make_sinks)();
        for q in &sinks {
            let held = METRICS.events_pending.with_label_values(&[q.name()]).get();
            if held > 0 {
                METRICS
                    .events_dropped
                    .with_label_values(&[q.name()])
                    .inc_by(held as u64);
                tracing::error!(
                    lost = held,
                    "events lost at stop (at most `lost`): held by the stuck events thread for the {} sink",
                    q.name()
                );
            }
        }
        sinks
    }
}

impl Drop for PumpHandle {
    fn drop(&mut self) {
        let (lock, cv) = &*self.stop;
        *lock.lock().unwrap_or_else(PoisonError::into_inner) = true;
        cv.notify_all();
        let sinks = self
            .thread_sinks()
            .unwrap_or_else(|| self.sinks_past_a_stuck_thread());
        let mut last = Pump {
            meter: Arc::clone(&self.meter),
            origin: Arc::clone(&self.origin),
            sinks,
        };
        let taken = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            last.take(unix_now(), true);
        }));
        if taken.is_err() {
            tracing::error!("the stop's round of the events panicked; its events are lost");
        }
        write_at_stop(last.sinks, self.retry);
    }
}

/// Writes each sink on a thread of its own, retrying a failing one for `retry`: a sink that
/// stalls (the file's lock held by another process, a sync that does not come back) holds
/// neither the other sink nor the stop. What a sink has not taken then is dropped and counted.
fn write_at_stop(sinks: Vec<Queue>, retry: Duration) {
    let until = Instant::now() + retry;
    let writers: Vec<_> = sinks
        .into_iter()
        .filter(|q| !q.is_empty())
        .map(|mut q| {
            let (name, waiting) = (q.name(), q.len());
            let writer = std::thread::Builder::new()
                .name("events-stop".into())
                .spawn(move || {
                    q.write();
                    q.finish(until);
                });
            (name, waiting, writer)
        })
        .collect();
    let deadline = until + WRITER_MARGIN;
    for (name, waiting, writer) in writers {
        let finished = match writer {
            Ok(writer) => {
                while !writer.is_finished() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(10));
                }
                writer.is_finished() && writer.join().is_ok()
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot start a thread to write the events at stop");
                false
            }
        };
        if !finished {
            METRICS
                .events_dropped
                .with_label_values(&[name])
                .inc_by(waiting as u64);
            tracing::error!(
                lost = waiting,
                "events lost at stop (at most `lost`): the {name} sink was still inside a write \
                 {retry:?} after the stop began"
            );
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

    fn make_file(dir: &Path) -> MakeSinks {
        let dir = dir.to_owned();
        Arc::new(move || file(&dir))
    }

    #[test]
    fn the_handle_writes_everything_when_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let meter = Arc::new(Meter::default());
        let handle = start(
            Arc::clone(&meter),
            Arc::new(Origin::new("test", "n1")),
            make_file(dir.path()),
        )
        .unwrap();
        usage(&meter, unix_now());
        drop(handle);
        assert_eq!(lines(dir.path()).len(), 1);
    }

    /// A sink that records the lines it takes, and holds every append while `held` (a disk
    /// whose sync does not come back), saying when one has come in.
    struct Stalling {
        held: Arc<(Mutex<bool>, Condvar)>,
        came: std::sync::mpsc::Sender<()>,
        took: Arc<Mutex<Vec<String>>>,
    }

    impl crate::events::queue::Output for Stalling {
        fn name(&self) -> &'static str {
            "test"
        }
        fn describe(&self) -> &'static str {
            "a test sink"
        }
        fn joins(&self, _: &Waiting, _: &Waiting, events: usize, _: usize) -> bool {
            events < 100
        }
        fn append(&mut self, _: &[Arc<Waiting>], lines: &[u8]) -> std::io::Result<()> {
            let _ = self.came.send(());
            let (lock, cv) = &*self.held;
            let mut held = lock.lock().unwrap();
            while *held {
                held = cv.wait(held).unwrap();
            }
            let text = String::from_utf8_lossy(lines);
            self.took
                .lock()
                .unwrap()
                .extend(text.lines().map(str::to_owned));
            Ok(())
        }
    }

    fn notice() -> crate::events::usage::Notice {
        crate::events::usage::Notice {
            kind: crate::events::cloud::THRESHOLD,
            id: "n1".into(),
            time: unix_now(),
            data: serde_json::json!({}),
        }
    }

    fn release(held: &(Mutex<bool>, Condvar)) {
        *held.0.lock().unwrap() = false;
        held.1.notify_all();
    }

    /// The check's three nodes: a threshold's round (a notice) went into a sync that a loaded
    /// disk held past the stop; the stop gave the thread its wait and the process ended with
    /// the open minute still in the meter. The stop now takes it and writes it itself.
    #[test]
    fn a_stop_writes_the_open_minute_while_the_thread_is_held_in_an_earlier_write() {
        let meter = Arc::new(Meter::default());
        let held = Arc::new((Mutex::new(true), Condvar::new()));
        let took = Arc::new(Mutex::new(Vec::new()));
        let (came, come) = std::sync::mpsc::channel();
        let made = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let make: MakeSinks = {
            let (held, took, made) = (Arc::clone(&held), Arc::clone(&took), Arc::clone(&made));
            let came = Mutex::new(came);
            Arc::new(move || {
                // The thread's sink stalls; the stop's own does not.
                let first = made.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
                let out = Stalling {
                    held: if first {
                        Arc::clone(&held)
                    } else {
                        Arc::new((Mutex::new(false), Condvar::new()))
                    },
                    came: came.lock().unwrap().clone(),
                    took: Arc::clone(&took),
                };
                vec![Queue::new(Box::new(out))]
            })
        };
        let mut handle = start(
            Arc::clone(&meter),
            Arc::new(Origin::new("test", "n1")),
            make,
        )
        .unwrap();
        handle.round_wait = Duration::from_millis(200);
        handle.retry = Duration::from_millis(500);
        meter.notify(notice());
        come.recv_timeout(Duration::from_secs(5))
            .expect("the thread's round writes the notice");
        usage(&meter, unix_now());
        let started = Instant::now();
        drop(handle);
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "the stop is bounded"
        );
        let got = took.lock().unwrap().clone();
        assert_eq!(
            got.len(),
            1,
            "the open minute, by the stop's own sink: {got:?}"
        );
        assert!(got[0].contains("pet.usage.v1"), "{got:?}");
        assert!(
            meter.take_before(u64::MAX).is_empty(),
            "nothing left in the meter"
        );
        release(&held);
    }

    /// A sink that stalls at the stop holds neither the other sink nor the stop past its retry.
    #[test]
    fn a_sink_stalled_at_stop_holds_neither_the_other_sink_nor_the_stop() {
        let dir = tempfile::tempdir().unwrap();
        let meter = Arc::new(Meter::default());
        let held = Arc::new((Mutex::new(true), Condvar::new()));
        let (came, _come) = std::sync::mpsc::channel();
        let make: MakeSinks = {
            let (held, dir) = (Arc::clone(&held), dir.path().to_owned());
            let came = Mutex::new(came);
            Arc::new(move || {
                let stalled = Stalling {
                    held: Arc::clone(&held),
                    came: came.lock().unwrap().clone(),
                    took: Arc::default(),
                };
                let mut sinks = vec![Queue::new(Box::new(stalled))];
                sinks.extend(file(&dir));
                sinks
            })
        };
        let mut handle = start(
            Arc::clone(&meter),
            Arc::new(Origin::new("test", "n1")),
            make,
        )
        .unwrap();
        handle.retry = Duration::from_millis(300);
        usage(&meter, unix_now());
        let started = Instant::now();
        drop(handle);
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "the stop is bounded"
        );
        assert_eq!(lines(dir.path()).len(), 1, "the file took the open minute");
        release(&held);
    }
}
