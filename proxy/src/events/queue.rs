//! The events waiting for one sink (the metering file, or the webhook's spool), in order, and
//! how they are handed over: in pieces the sink takes whole, each leaving the queue once the
//! sink has it synced. A failed append keeps the rest for the next round, up to
//! [`MAX_PENDING`] bytes; past that new events are dropped and counted, so a disk that stays
//! full costs memory up to a bound and never a request. A sink that takes what it is given
//! never drops: a round larger than [`WRITE_AT`] (a minute of very many keys, or a stop) is
//! written as it is made rather than held whole first.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::file_sink::DailyFile;
use super::webhook::spool::Spool;
use super::webhook::{BATCH_BYTES, BATCH_EVENTS};
use crate::base::metrics::METRICS;

/// The most bytes of events kept for a sink that fails.
pub const MAX_PENDING: usize = 64 * 1024 * 1024;
/// The most bytes one append hands the metering file.
const PIECE: usize = 1024 * 1024;
/// Waiting bytes past which a push writes what waits first (unless the sink's last write
/// failed: then the round's retry, and the [`MAX_PENDING`] bound, take over).
pub const WRITE_AT: usize = 8 * 1024 * 1024;

/// An event made and not yet taken: its type, the UTC day whose file takes it, the line.
pub struct Waiting {
    pub kind: &'static str,
    pub day: u64,
    pub line: String,
}

/// Where a queue's events go.
pub trait Output: Send {
    /// The sink's name in metrics.
    fn name(&self) -> &'static str;
    /// What it is, for logs.
    fn describe(&self) -> &'static str;
    /// Whether `next` joins a piece that starts with `first` and holds `events` events of
    /// `bytes` bytes so far.
    fn joins(&self, first: &Waiting, next: &Waiting, events: usize, bytes: usize) -> bool;
    /// Takes one piece (the events, and their lines joined) whole, or nothing of it.
    fn append(&mut self, events: &[Arc<Waiting>], lines: &[u8]) -> std::io::Result<()>;
}

pub struct Queue {
    out: Box<dyn Output>,
    pending: VecDeque<Arc<Waiting>>,
    bytes: usize,
    /// The last write failed: pushes no longer write until the next round.
    failing: bool,
}

impl Queue {
    pub fn new(out: Box<dyn Output>) -> Queue {
        Queue {
            out,
            pending: VecDeque::new(),
            bytes: 0,
            failing: false,
        }
    }

    /// The sink's name in metrics.
    pub fn name(&self) -> &'static str {
        self.out.name()
    }

    pub fn len(&self) -> usize {
        self.pending.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// A new round: pushes may write again (the sink may have recovered since it failed).
    pub fn new_round(&mut self) {
        self.failing = false;
    }

    pub fn push(&mut self, event: Arc<Waiting>) {
        let name = self.out.name();
        if self.bytes + event.line.len() > WRITE_AT && !self.failing {
            self.write();
        }
        if self.bytes + event.line.len() > MAX_PENDING {
            METRICS.events_dropped.with_label_values(&[name]).inc();
            return;
        }
        self.bytes += event.line.len();
        self.pending.push_back(event);
        self.gauge();
    }

    fn gauge(&self) {
        METRICS
            .events_pending
            .with_label_values(&[self.out.name()])
            .set(self.pending.len() as i64);
    }

    /// Hands the waiting events over in pieces; false when an append failed.
    pub fn write(&mut self) -> bool {
        let mut ok = true;
        while let Some(first) = self.pending.front() {
            let (mut n, mut bytes) = (0, 0);
            for w in self.pending.iter() {
                if n > 0 && !self.out.joins(first, w, n, bytes) {
                    break;
                }
                n += 1;
                bytes += w.line.len();
            }
            let mut lines = Vec::with_capacity(bytes);
            for w in self.pending.iter().take(n) {
                lines.extend_from_slice(w.line.as_bytes());
            }
            let piece: Vec<_> = self.pending.iter().take(n).cloned().collect();
            if let Err(e) = self.out.append(&piece, &lines) {
                METRICS
                    .events_delivery_failures
                    .with_label_values(&[self.out.name()])
                    .inc();
                tracing::warn!(
                    error = %e,
                    pending = self.pending.len(),
                    "cannot write events to {}; they are kept and written again",
                    self.out.describe()
                );
                ok = false;
                break;
            }
            self.pending.drain(..n);
            self.bytes -= bytes;
        }
        self.failing = !ok;
        self.gauge();
        ok
    }

    /// Retries until `until`; what still cannot be written is dropped and counted.
    pub fn finish(&mut self, until: Instant) {
        while !self.pending.is_empty() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(250));
            self.write();
        }
        if !self.pending.is_empty() {
            METRICS
                .events_dropped
                .with_label_values(&[self.out.name()])
                .inc_by(self.pending.len() as u64);
            tracing::error!(
                lost = self.pending.len(),
                "events lost at stop: {} could not be written",
                self.out.describe()
            );
        }
    }
}

/// The metering file: pieces of one day, up to [`PIECE`] bytes.
pub struct FileOutput(pub DailyFile);

impl FileOutput {
    pub fn new(base: &Path) -> FileOutput {
        FileOutput(DailyFile::new(base))
    }
}

impl Output for FileOutput {
    fn name(&self) -> &'static str {
        "file"
    }

    fn describe(&self) -> &'static str {
        "the metering file"
    }

    fn joins(&self, first: &Waiting, next: &Waiting, _: usize, bytes: usize) -> bool {
        next.day == first.day && bytes + next.line.len() <= PIECE
    }

    fn append(&mut self, events: &[Arc<Waiting>], lines: &[u8]) -> std::io::Result<()> {
        let Some(first) = events.first() else {
            return Ok(());
        };
        self.0.append(first.day, lines)?;
        for w in events {
            METRICS
                .events_delivered
                .with_label_values(&["file", w.kind])
                .inc();
        }
        Ok(())
    }
}

/// The webhook's spool: a segment a batch, at most [`BATCH_EVENTS`] events of
/// [`BATCH_BYTES`].
pub struct SpoolOutput(pub Spool);

impl Output for SpoolOutput {
    fn name(&self) -> &'static str {
        "spool"
    }

    fn describe(&self) -> &'static str {
        "the webhook's spool"
    }

    fn joins(&self, _: &Waiting, next: &Waiting, events: usize, bytes: usize) -> bool {
        events < BATCH_EVENTS && bytes + next.line.len() <= BATCH_BYTES
    }

    fn append(&mut self, events: &[Arc<Waiting>], lines: &[u8]) -> std::io::Result<()> {
        self.0.write(lines, events.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// Takes every piece while `up`, counting the events it took.
    struct Counting {
        up: Arc<AtomicBool>,
        took: Arc<AtomicUsize>,
    }

    impl Output for Counting {
        fn name(&self) -> &'static str {
            "test"
        }
        fn describe(&self) -> &'static str {
            "a test sink"
        }
        fn joins(&self, _: &Waiting, _: &Waiting, events: usize, _: usize) -> bool {
            events < 1000
        }
        fn append(&mut self, events: &[Arc<Waiting>], _: &[u8]) -> std::io::Result<()> {
            if !self.up.load(Ordering::Relaxed) {
                return Err(std::io::Error::other("down"));
            }
            self.took.fetch_add(events.len(), Ordering::Relaxed);
            Ok(())
        }
    }

    fn queue(up: bool) -> (Queue, Arc<AtomicBool>, Arc<AtomicUsize>) {
        let (up, took) = (Arc::new(AtomicBool::new(up)), Arc::new(AtomicUsize::new(0)));
        let out = Counting {
            up: Arc::clone(&up),
            took: Arc::clone(&took),
        };
        (Queue::new(Box::new(out)), up, took)
    }

    fn event() -> Arc<Waiting> {
        Arc::new(Waiting {
            kind: "pet.usage.v1",
            day: 0,
            line: "x".repeat(4095) + "\n",
        })
    }

    /// Twice the bound in one round: a sink that takes it loses nothing.
    const ROUND: usize = 2 * MAX_PENDING / 4096;

    #[test]
    fn a_round_larger_than_the_bound_is_written_whole_to_a_healthy_sink() {
        let (mut q, _, took) = queue(true);
        for _ in 0..ROUND {
            q.push(event());
        }
        assert!(q.bytes <= WRITE_AT, "written as it was made: {}", q.bytes);
        q.write();
        assert_eq!(took.load(Ordering::Relaxed), ROUND, "nothing dropped");
    }

    #[test]
    fn a_failing_sink_keeps_up_to_the_bound_and_is_tried_again() {
        let (mut q, up, took) = queue(false);
        for _ in 0..ROUND {
            q.push(event());
        }
        assert_eq!(
            q.len(),
            MAX_PENDING / 4096,
            "kept up to the bound, the rest dropped"
        );
        up.store(true, Ordering::Relaxed);
        assert!(q.write());
        assert_eq!(took.load(Ordering::Relaxed), MAX_PENDING / 4096);
        assert!(q.is_empty());
    }

    #[test]
    fn a_sink_that_failed_and_recovered_takes_the_next_large_round_whole() {
        let (mut q, up, took) = queue(false);
        for _ in 0..(WRITE_AT / 4096 + 1) {
            q.push(event());
        }
        assert!(q.failing, "its write failed");
        up.store(true, Ordering::Relaxed);
        q.new_round();
        let kept = q.len();
        for _ in 0..ROUND {
            q.push(event());
        }
        q.write();
        assert_eq!(
            took.load(Ordering::Relaxed),
            kept + ROUND,
            "nothing dropped"
        );
    }
}
