//! Where every log line goes: a bounded buffer in memory, written to standard error by one
//! thread of its own. Appending a whole line is a short lock and a copy, so a slow or blocked
//! stderr (a full pipe, a stalled journald) never stalls a proxy thread inside a request: when
//! the buffer is full, lines are dropped and counted (`pet_gateway_log_lines_dropped_total`)
//! rather than waited for. One writer for the access log and `tracing`'s lines alike, so lines
//! never interleave mid-line.

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
    /// Starts the writer thread on `out`, holding at most `cap` bytes not yet written.
    pub fn start(out: impl Write + Send + 'static, cap: usize) -> (LogSink, SinkGuard) {
        let inner = Arc::new(Inner {
            buf: Mutex::new(Vec::with_capacity(64 * 1024)),
            ready: Condvar::new(),
            cap,
            stop: AtomicBool::new(false),
        });
        let writer = Arc::clone(&inner);
        let thread = std::thread::Builder::new()
            .name("log-writer".into())
            .spawn(move || write_out(&writer, out))
            .ok();
        let guard = SinkGuard {
            inner: Arc::clone(&inner),
            thread,
        };
        (LogSink { inner }, guard)
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
            // A failing stderr loses these lines; there is nowhere else to say so.
            let _ = out.write_all(&spare).and_then(|()| out.flush());
            spare.clear();
        } else if inner.stop.load(Ordering::Relaxed) {
            return;
        }
    }
}

impl Drop for SinkGuard {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Relaxed);
        self.inner.ready.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
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
    }

    impl Write for Stalled {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
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

    #[test]
    fn a_stalled_writer_drops_and_counts_lines_and_never_blocks() {
        let out = Stalled::default();
        let (sink, guard) = LogSink::start(out.clone(), 100);
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
