//! Where every log line goes: a bounded buffer in memory, written to standard error by one
//! thread of its own. Appending a whole line is a short lock and a copy, so a slow or blocked
//! stderr (a full pipe, a stalled journald) never stalls a proxy thread inside a request: when
//! the buffer is full, lines are dropped and counted (`pet_gateway_log_lines_dropped_total`)
//! rather than waited for. One writer for the access log and `tracing`'s lines alike, so lines
//! never interleave mid-line; pieces of at most `PIPE_BUF` bytes cut after a newline, so they do
//! not interleave with another process's on a shared pipe either (an old and a new gateway
//! during `serve --upgrade`). A failed write loses lines, and counts them; a stderr that never
//! comes back delays a stop by at most `STOP_WAIT`.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use crate::base::metrics::METRICS;

/// How long the writer waits for more lines before writing what it has: a line reaches stderr
/// within this much.
const LINGER: Duration = Duration::from_millis(20);
/// Buffered bytes past which the writer is woken at once.
const WAKE_AT: usize = 64 * 1024;
/// The most bytes one write hands the kernel: a pipe keeps writes of up to `PIPE_BUF` (4096 on
/// Linux) whole, however many processes write to it.
const PIPE_BUF: usize = 4096;
/// How long a stop waits for the writer to empty the buffer: a stderr blocked for good must not
/// hold the process past its stop (systemd would kill it, an upgrade would leave it running).
const STOP_WAIT: Duration = Duration::from_secs(1);

struct Inner {
    buf: Mutex<Vec<u8>>,
    ready: Condvar,
    cap: usize,
    stop: AtomicBool,
}

/// The sink; clones share it.
#[derive(Clone)]
pub struct LogSink {
    inner: Arc<Inner>,
}

/// The process's sink, once logging is set up (`serve`); without it the access log goes
/// through `tracing`.
static SINK: OnceLock<LogSink> = OnceLock::new();

/// Keeps the writer thread; dropping it writes what is buffered and stops the thread.
pub struct SinkGuard {
    inner: Arc<Inner>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LogSink {
    /// Starts the writer thread on `out`, holding at most `cap` bytes not yet written. An error
    /// when the thread cannot be made: every line would be dropped.
    pub fn start(
        out: impl Write + Send + 'static,
        cap: usize,
    ) -> std::io::Result<(LogSink, SinkGuard)> {
        let inner = Arc::new(Inner {
            buf: Mutex::new(Vec::with_capacity(64 * 1024)),
            ready: Condvar::new(),
            cap,
            stop: AtomicBool::new(false),
        });
        let writer = Arc::clone(&inner);
        let thread = std::thread::Builder::new()
            .name("log-writer".into())
            .spawn(move || write_out(&writer, out))?;
        let guard = SinkGuard {
            inner: Arc::clone(&inner),
            thread: Some(thread),
        };
        Ok((LogSink { inner }, guard))
    }

    /// Makes this the process's sink (once).
    pub fn install(&self) {
        let _ = SINK.set(self.clone());
    }

    pub fn installed() -> Option<&'static LogSink> {
        SINK.get()
    }

    /// Appends one whole line (or event); false, and counted, when the buffer is full.
    pub fn push(&self, line: &[u8]) -> bool {
        let mut buf = self
            .inner
            .buf
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if buf.len() + line.len() > self.inner.cap {
            drop(buf);
            METRICS.log_lines_dropped.inc();
            return false;
        }
        let before = buf.len();
        buf.extend_from_slice(line);
        drop(buf);
        // The writer comes by every LINGER anyway; waking it for every line would cost a system
        // call per request. Only a buffer filling up fast calls it at once.
        if before < WAKE_AT && before + line.len() >= WAKE_AT {
            self.inner.ready.notify_one();
        }
        true
    }
}

/// The writer thread: takes what is buffered (swapping in an empty buffer) and writes it.
fn write_out(inner: &Inner, mut out: impl Write) {
    let mut spare = Vec::with_capacity(64 * 1024);
    let mut torn = false;
    loop {
        {
            let mut buf = inner.buf.lock().unwrap_or_else(PoisonError::into_inner);
            if buf.is_empty() && !inner.stop.load(Ordering::Relaxed) {
                buf = inner
                    .ready
                    .wait_timeout(buf, LINGER)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            std::mem::swap(&mut *buf, &mut spare);
        }
        if !spare.is_empty() {
            let lost = write_batch(&mut out, &spare, &mut torn);
            if lost > 0 {
                METRICS.log_lines_dropped.inc_by(lost);
            }
            spare.clear();
        } else if inner.stop.load(Ordering::Relaxed) {
            return;
        }
    }
}

/// Writes `batch` (whole lines) in pieces of at most `PIPE_BUF` bytes, each ending with a
/// newline where a line allows; the number of lines lost to a failed write (there is nowhere
/// else to say so). `torn` carries over a line left half-written: the next write ends it first,
/// so that a torn line does not swallow the next one.
fn write_batch(out: &mut impl Write, batch: &[u8], torn: &mut bool) -> u64 {
    let lines = |bytes: &[u8]| bytes.iter().filter(|b| **b == b'\n').count() as u64;
    if *torn {
        if write_fully(out, b"\n") != 1 {
            return lines(batch);
        }
        *torn = false;
    }
    let mut rest = batch;
    while !rest.is_empty() {
        let piece = &rest[..piece_len(rest)];
        let written = write_fully(out, piece);
        if written < piece.len() {
            // Torn only when the write stopped inside a line.
            *torn = written > 0 && piece[written - 1] != b'\n';
            return lines(&rest[written..]);
        }
        rest = &rest[piece.len()..];
    }
    let _ = out.flush();
    0
}

/// The longest start of `rest` of at most `PIPE_BUF` bytes that ends after a newline; a line
/// longer than that goes whole.
fn piece_len(rest: &[u8]) -> usize {
    if rest.len() <= PIPE_BUF {
        return rest.len();
    }
    match rest[..PIPE_BUF].iter().rposition(|b| *b == b'\n') {
        Some(i) => i + 1,
        None => rest
            .iter()
            .position(|b| *b == b'\n')
            .map_or(rest.len(), |i| i + 1),
    }
}

/// Writes as much of `bytes` as `out` takes, retrying interrupted writes; the bytes written.
fn write_fully(out: &mut impl Write, bytes: &[u8]) -> usize {
    let mut done = 0;
    while done < bytes.len() {
        match out.write(&bytes[done..]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    done
}

impl Drop for SinkGuard {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Relaxed);
        self.inner.ready.notify_one();
        let Some(thread) = self.thread.take() else {
            return;
        };
        // Bounded: polled, since a thread cannot be joined with a deadline.
        let deadline = std::time::Instant::now() + STOP_WAIT;
        while !thread.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if thread.is_finished() {
            let _ = thread.join();
            return;
        }
        // The writer is stuck on stderr: what it has not taken yet is lost, and counted.
        let buf = self
            .inner
            .buf
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let lost = buf.iter().filter(|b| **b == b'\n').count() as u64;
        if lost > 0 {
            METRICS.log_lines_dropped.inc_by(lost);
        }
    }
}

/// `tracing`'s lines into the sink: the fmt layer formats a whole event and writes it once.
impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogSink {
    type Writer = SinkWriter<'a>;

    fn make_writer(&'a self) -> SinkWriter<'a> {
        SinkWriter { sink: self }
    }
}

pub struct SinkWriter<'a> {
    sink: &'a LogSink,
}

impl Write for SinkWriter<'_> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.sink.push(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that blocks until told to go on, then keeps what it was given.
    #[derive(Clone, Default)]
    struct Stalled {
        go: Arc<(Mutex<bool>, Condvar)>,
        got: Arc<Mutex<Vec<u8>>>,
        /// Set once a write is waiting.
        blocked: Arc<AtomicBool>,
    }

    impl Write for Stalled {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.blocked.store(true, Ordering::SeqCst);
            let (go, cv) = &*self.go;
            let mut ok = go.lock().unwrap();
            while !*ok {
                ok = cv.wait(ok).unwrap();
            }
            self.got.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A writer that takes `budget` bytes (a short write at the edge), fails after them until
    /// given more, and records the size of every write.
    #[derive(Default)]
    struct Flaky {
        budget: usize,
        got: Vec<u8>,
        writes: Vec<usize>,
    }

    impl Write for Flaky {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            if self.budget == 0 {
                return Err(std::io::Error::other("no space left on device"));
            }
            let n = bytes.len().min(self.budget);
            self.budget -= n;
            self.got.extend_from_slice(&bytes[..n]);
            self.writes.push(n);
            Ok(n)
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_failed_write_counts_its_lines_and_ends_the_torn_one_first() {
        let mut out = Flaky {
            budget: 15,
            ..Flaky::default()
        };
        let mut torn = false;
        let lost = write_batch(&mut out, b"first line\nsecond line\nthird\n", &mut torn);
        assert_eq!(lost, 2, "the torn second line and the third");
        assert!(torn);
        out.budget = 1000;
        assert_eq!(write_batch(&mut out, b"fourth\n", &mut torn), 0);
        assert!(!torn);
        assert_eq!(out.got, b"first line\nseco\nfourth\n");

        // A write that stops right after a newline leaves nothing torn: no blank line after.
        let mut out = Flaky {
            budget: 11,
            ..Flaky::default()
        };
        let lost = write_batch(&mut out, b"first line\nsecond line\n", &mut torn);
        assert_eq!((lost, torn), (1, false));
        out.budget = 1000;
        assert_eq!(write_batch(&mut out, b"third\n", &mut torn), 0);
        assert_eq!(out.got, b"first line\nthird\n");
    }

    #[test]
    fn batches_go_out_in_pipe_sized_pieces_cut_after_a_newline() {
        let line = format!("{}\n", "x".repeat(99));
        let batch = line.repeat(100);
        let mut out = Flaky {
            budget: usize::MAX,
            ..Flaky::default()
        };
        let mut torn = false;
        assert_eq!(write_batch(&mut out, batch.as_bytes(), &mut torn), 0);
        assert_eq!(out.got, batch.as_bytes());
        assert!(
            out.writes.iter().all(|n| *n <= PIPE_BUF && n % 100 == 0),
            "{:?}",
            out.writes
        );
        let long = format!("{}\nshort\n", "y".repeat(2 * PIPE_BUF));
        assert_eq!(
            piece_len(long.as_bytes()),
            2 * PIPE_BUF + 1,
            "a long line goes whole"
        );
    }

    #[test]
    fn a_stderr_blocked_for_good_delays_a_stop_by_at_most_stop_wait() {
        let out = Stalled::default();
        let (sink, guard) = LogSink::start(out.clone(), 1000).unwrap();
        assert!(sink.push(b"taken by the stuck writer\n"));
        for _ in 0..500 {
            if out.blocked.load(Ordering::SeqCst) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            out.blocked.load(Ordering::SeqCst),
            "the writer took the first line"
        );
        assert!(sink.push(b"still buffered\n"));
        let dropped = METRICS.log_lines_dropped.get();
        let started = std::time::Instant::now();
        drop(guard);
        let took = started.elapsed();
        assert!(took < STOP_WAIT + Duration::from_secs(1), "{took:?}");
        assert!(
            METRICS.log_lines_dropped.get() > dropped,
            "the buffered line is counted"
        );
        // Let the writer thread go, so the test leaves nothing blocked behind it.
        *out.go.0.lock().unwrap() = true;
        out.go.1.notify_all();
    }

    #[test]
    fn a_stalled_writer_drops_and_counts_lines_and_never_blocks() {
        let out = Stalled::default();
        let (sink, guard) = LogSink::start(out.clone(), 100).unwrap();
        let dropped = METRICS.log_lines_dropped.get();
        let started = std::time::Instant::now();
        let mut kept = 0;
        for i in 0..50 {
            if sink.push(format!("line {i:04}\n").as_bytes()) {
                kept += 1;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "never waits on the writer"
        );
        assert!((9..50).contains(&kept), "{kept}");
        assert!(METRICS.log_lines_dropped.get() >= dropped + (50 - kept) as u64);
        *out.go.0.lock().unwrap() = true;
        out.go.1.notify_all();
        drop(guard);
        let got = String::from_utf8(out.got.lock().unwrap().clone()).unwrap();
        assert!(
            got.lines().all(|l| l.starts_with("line ")),
            "whole lines only: {got}"
        );
        assert_eq!(got.lines().count(), kept);
    }
}
