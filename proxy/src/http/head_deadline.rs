//! A deadline for the whole HTTP/1.x request head (request line and headers), against clients
//! that trickle it a byte at a time (slowloris): pingora's read timeout restarts with every read,
//! so such a client holds a connection for as long as it likes.
//!
//! Pingora offers no hook between accepting a connection and reading the head, so the hook is
//! the smallest one that sits there: [`HeadDeadline`] wraps the proxy's [`ServerApp`] and hands
//! it each connection's stream inside a [`HeadGuard`]. The guard watches the bytes the proxy
//! reads: while a head is arriving (from the connection's start, or for a later keep-alive
//! request from its first byte, so idle keep-alive time does not count) a read that would pass
//! the deadline fails with `TimedOut`, and pingora closes the connection. The blank line that
//! ends a head disarms it; the gateway writing a final response's status line (not a
//! `100 Continue`) re-arms it for the next head, and a `101` disarms it for good. Bodies
//! have their own per-read timeout (`client_read_timeout`). HTTP/2 connections (negotiated by
//! ALPN) pass through untouched: their headers arrive as frames the h2 library assembles.

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use pingora::apps::ServerApp;
use pingora::protocols::tls::TlsRef;
use pingora::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl, Stream,
    TimingDigest, UniqueID, UniqueIDType, ALPN,
};
use pingora::server::ShutdownWatch;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use crate::base::metrics::METRICS;

/// Wraps a [`ServerApp`] so that every HTTP/1.x request head must arrive within `limit`.
pub struct HeadDeadline<A> {
    inner: Arc<A>,
    limit: Duration,
    /// How long after the shutdown begins idle kept-alive connections stay open (`cleanup`).
    idle_open: Duration,
}

impl<A> HeadDeadline<A> {
    pub fn new(inner: A, limit: Duration) -> HeadDeadline<A> {
        HeadDeadline {
            inner: Arc::new(inner),
            limit,
            idle_open: Duration::ZERO,
        }
    }

    /// Keeps idle kept-alive connections open for `drain` after the shutdown begins.
    pub fn idle_open_for(mut self, drain: Duration) -> HeadDeadline<A> {
        self.idle_open = drain;
        self
    }
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> ServerApp for HeadDeadline<A> {
    async fn process_new(
        self: &Arc<Self>,
        stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        if matches!(stream.selected_alpn_proto(), Some(ALPN::H2)) {
            return self.inner.process_new(stream, shutdown).await;
        }
        let guarded: Stream = Box::new(HeadGuard::new(stream, self.limit));
        self.inner.process_new(guarded, shutdown).await
    }

    /// pingora's cleanup, when its shutdown begins, closes every kept-alive connection that is
    /// idle: a request already on its way over one meets a closed socket, and a `POST` is lost
    /// (`http::draining`). It is passed on only after `idle_open` (half the grace period): a
    /// request on an idle connection meanwhile is answered, with `Connection: close` (the
    /// shutdown and the drain both say so), and has the other half to finish before the
    /// runtime's end cuts what is still running. HTTP/2 is unaffected: its connections end by
    /// GOAWAY on the shutdown watch itself.
    async fn cleanup(&self) {
        tokio::time::sleep(self.idle_open).await;
        self.inner.cleanup().await
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// A head is expected: the deadline runs from `started` (`None`: from its first byte).
    Head { started: Option<Instant> },
    /// The head is complete; the body and the response follow.
    AfterHead,
    /// Switched to another protocol (101): never armed again.
    Upgraded,
}

/// A stream whose reads fail once a request head has taken longer than the limit.
pub struct HeadGuard {
    inner: Stream,
    limit: Duration,
    phase: Phase,
    /// The last two bytes of the head so far, to find its end across reads.
    tail: [u8; 2],
    /// The head so far holds more than empty lines.
    saw_content: bool,
    /// A response was written since the last head: the next bytes read start a new head.
    responded: bool,
    /// The next write starts a response (its status line).
    status_next: bool,
    timer: Option<Pin<Box<Sleep>>>,
}

impl HeadGuard {
    pub fn new(inner: Stream, limit: Duration) -> HeadGuard {
        HeadGuard {
            inner,
            limit,
            phase: Phase::Head {
                started: Some(Instant::now()),
            },
            tail: [0; 2],
            saw_content: false,
            responded: false,
            status_next: false,
            timer: None,
        }
    }

    /// Looks for the blank line ending the head (`\r\n\r\n`, or a bare `\n\n`) in `bytes`.
    /// Empty lines before any content (which HTTP lets a server skip) do not end a head, or a
    /// client could send `\r\n\r\n` first and trickle the real head undeadlined.
    ///
    /// Line by line (`memchr` finds each `\n`), not byte by byte: a head's bytes pass here on
    /// every request, and a loop over each of them cost some 3,000 instructions a request.
    fn scan(&mut self, bytes: &[u8]) {
        let mut from = 0;
        for at in memchr::memchr_iter(b'\n', bytes) {
            // Between two line ends there is no `\n`: content is any byte but `\r`.
            if !self.saw_content && bytes[from..at].iter().any(|&b| b != b'\r') {
                self.saw_content = true;
            }
            let [before, last] = self.two_before(bytes, at);
            if self.saw_content && (last == b'\n' || (last == b'\r' && before == b'\n')) {
                self.phase = Phase::AfterHead;
                self.timer = None;
                self.tail = [0; 2];
                self.saw_content = false;
                self.status_next = true;
                return;
            }
            from = at + 1;
        }
        if !self.saw_content && bytes[from..].iter().any(|&b| b != b'\r') {
            self.saw_content = true;
        }
        self.tail = self.two_before(bytes, bytes.len());
    }

    /// The two bytes before `bytes[at]`, reaching back into the last read's when `at` < 2.
    fn two_before(&self, bytes: &[u8], at: usize) -> [u8; 2] {
        match at {
            0 => self.tail,
            1 => [self.tail[1], bytes[0]],
            _ => [bytes[at - 2], bytes[at - 1]],
        }
    }

    /// A final response's status line (not `100 Continue` or another 1xx, after which the
    /// request body still follows) means the next bytes read start a new head. After
    /// `101 Switching Protocols` the connection is no longer HTTP/1: no deadline ever again.
    ///
    /// Only the first write after a head (or after an interim response) can start a response,
    /// so only it is read as a status line: a response body that happens to begin with
    /// `HTTP/1.1 101` changes nothing.
    fn saw_write(&mut self, bytes: &[u8]) {
        if self.phase == Phase::Upgraded || !self.status_next {
            return;
        }
        self.status_next = false;
        let status = bytes
            .strip_prefix(b"HTTP/1.")
            .and_then(|rest| rest.get(2..5));
        match status {
            Some(b"101") => {
                self.phase = Phase::Upgraded;
                self.timer = None;
            }
            // An interim response: the final one follows in a later write.
            Some([b'1', ..]) => self.status_next = true,
            Some(_) => self.responded = true,
            // Not a status line where one was due (a response cut into pieces): the next
            // head then goes without a deadline rather than risking a false close.
            None => {}
        }
    }

    fn deadline(&self) -> Option<Instant> {
        match self.phase {
            Phase::Head {
                started: Some(started),
            } => Some(started + self.limit),
            _ => None,
        }
    }
}

impl fmt::Debug for HeadGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeadGuard")
            .field("inner", &self.inner)
            .field("phase", &self.phase)
            .finish()
    }
}

impl AsyncRead for HeadGuard {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if this.responded && this.phase != Phase::Upgraded {
            // The response to the last head has started: what arrives next is a new head, and
            // its deadline starts with its first byte (idle keep-alive time does not count).
            this.responded = false;
            this.phase = Phase::Head { started: None };
            this.timer = None;
            this.tail = [0; 2];
            this.saw_content = false;
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let read = &buf.filled()[before..];
                if let Phase::Head { started: None } = this.phase {
                    if !read.is_empty() {
                        this.phase = Phase::Head {
                            started: Some(Instant::now()),
                        };
                    }
                }
                if matches!(this.phase, Phase::Head { .. }) {
                    this.scan(read);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                let Some(deadline) = this.deadline() else {
                    return Poll::Pending;
                };
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if timer.deadline() != deadline {
                    timer.as_mut().reset(deadline);
                }
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        METRICS.slow_request_heads.inc();
                        Poll::Ready(Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "request head not complete within the deadline",
                        )))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

use std::future::Future as _;

impl AsyncWrite for HeadGuard {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.saw_write(buf);
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if let Some(first) = bufs.iter().find(|b| !b.is_empty()) {
            self.saw_write(first);
        }
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[async_trait]
impl Shutdown for HeadGuard {
    async fn shutdown(&mut self) {
        self.inner.shutdown().await
    }
}

impl UniqueID for HeadGuard {
    fn id(&self) -> UniqueIDType {
        self.inner.id()
    }
}

impl Ssl for HeadGuard {
    fn get_ssl(&self) -> Option<&TlsRef> {
        self.inner.get_ssl()
    }

    fn get_ssl_digest(&self) -> Option<Arc<pingora::protocols::tls::SslDigest>> {
        self.inner.get_ssl_digest()
    }

    fn selected_alpn_proto(&self) -> Option<ALPN> {
        self.inner.selected_alpn_proto()
    }
}

impl GetTimingDigest for HeadGuard {
    fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
        self.inner.get_timing_digest()
    }

    fn get_read_pending_time(&self) -> Duration {
        self.inner.get_read_pending_time()
    }

    fn get_write_pending_time(&self) -> Duration {
        self.inner.get_write_pending_time()
    }
}

impl GetProxyDigest for HeadGuard {
    fn get_proxy_digest(&self) -> Option<Arc<pingora::protocols::raw_connect::ProxyDigest>> {
        self.inner.get_proxy_digest()
    }

    fn set_proxy_digest(&mut self, digest: pingora::protocols::raw_connect::ProxyDigest) {
        self.inner.set_proxy_digest(digest)
    }
}

impl GetSocketDigest for HeadGuard {
    fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
        self.inner.get_socket_digest()
    }

    fn set_socket_digest(&mut self, digest: SocketDigest) {
        self.inner.set_socket_digest(digest)
    }
}

#[async_trait]
impl Peek for HeadGuard {
    async fn try_peek(&mut self, buf: &mut [u8]) -> std::io::Result<bool> {
        self.inner.try_peek(buf).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    /// The scan as it was, byte by byte: the reference the line-by-line one must agree with.
    fn scan_bytewise(tail: &mut [u8; 2], saw_content: &mut bool, bytes: &[u8]) -> Option<usize> {
        for (i, &b) in bytes.iter().enumerate() {
            let [before, last] = *tail;
            if b == b'\n' && *saw_content && (last == b'\n' || (last == b'\r' && before == b'\n')) {
                return Some(i);
            }
            if b != b'\r' && b != b'\n' {
                *saw_content = true;
            }
            *tail = [last, b];
        }
        None
    }

    /// Every head made of the bytes that matter (CR, LF, content), cut into reads at every
    /// place: the line-by-line scan ends the head in the same read as the byte-by-byte one,
    /// and keeps the same state between reads.
    #[test]
    fn the_scan_by_lines_agrees_with_the_scan_by_bytes() {
        let alphabet = [b'\r', b'\n', b'a'];
        let mut heads: Vec<Vec<u8>> = Vec::new();
        for len in 0..=7u32 {
            for n in 0..3usize.pow(len) {
                let mut digits = n;
                let head = (0..len)
                    .map(|_| {
                        let c = alphabet[digits % 3];
                        digits /= 3;
                        c
                    })
                    .collect();
                heads.push(head);
            }
        }
        let mut checked = 0;
        for head in &heads {
            for cut in 0..=head.len() {
                let (first, second) = head.split_at(cut);
                let (server, _client) = tokio::io::duplex(64);
                let mut guard = HeadGuard::new(Box::new(server), LIMIT);
                let (mut tail, mut saw) = ([0u8; 2], false);
                for read in [first, second] {
                    let want = scan_bytewise(&mut tail, &mut saw, read);
                    guard.scan(read);
                    let ended = guard.phase == Phase::AfterHead;
                    assert_eq!(ended, want.is_some(), "{head:?} cut at {cut}");
                    if ended {
                        break;
                    }
                    assert_eq!(
                        (guard.tail, guard.saw_content),
                        (tail, saw),
                        "{head:?} at {cut}"
                    );
                }
                checked += 1;
            }
        }
        assert!(checked > 3_000, "{checked}");
    }

    const LIMIT: Duration = Duration::from_millis(200);

    fn guarded() -> (HeadGuard, DuplexStream) {
        let (server, client) = tokio::io::duplex(4096);
        (HeadGuard::new(Box::new(server), LIMIT), client)
    }

    /// What a read on the guard gives within `wait`: `Some(Ok(n))`, `Some(Err(kind))`, or
    /// `None` when it is still waiting.
    async fn read(
        guard: &mut HeadGuard,
        wait: Duration,
    ) -> Option<Result<usize, std::io::ErrorKind>> {
        let mut buf = [0u8; 256];
        tokio::time::timeout(wait, guard.read(&mut buf))
            .await
            .ok()
            .map(|r| r.map_err(|e| e.kind()))
    }

    #[tokio::test]
    async fn an_unfinished_head_times_out_and_a_finished_one_disarms() {
        let (mut guard, mut client) = guarded();
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        assert!(matches!(read(&mut guard, LIMIT).await, Some(Ok(_))));
        assert_eq!(
            read(&mut guard, LIMIT * 3).await,
            Some(Err(std::io::ErrorKind::TimedOut))
        );

        let (mut guard, mut client) = guarded();
        client
            .write_all(b"\r\n\r\nGET / HTTP/1.1\r\n")
            .await
            .unwrap();
        assert!(matches!(read(&mut guard, LIMIT).await, Some(Ok(_))));
        assert_eq!(
            read(&mut guard, LIMIT * 3).await,
            Some(Err(std::io::ErrorKind::TimedOut)),
            "leading empty lines do not end a head"
        );

        let (mut guard, mut client) = guarded();
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        assert!(matches!(read(&mut guard, LIMIT).await, Some(Ok(_))));
        assert_eq!(
            read(&mut guard, LIMIT * 3).await,
            None,
            "a body may take its time"
        );
    }

    #[tokio::test]
    async fn only_a_final_status_line_rearms_and_101_disarms_for_good() {
        let (mut guard, mut client) = guarded();
        client
            .write_all(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\n\r\n")
            .await
            .unwrap();
        read(&mut guard, LIMIT).await;
        guard
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .await
            .unwrap();
        client.write_all(b"{\"a\":1}").await.unwrap();
        assert!(matches!(read(&mut guard, LIMIT).await, Some(Ok(_))));
        assert_eq!(
            read(&mut guard, LIMIT * 3).await,
            None,
            "the body is not a head"
        );
        guard.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
        // A later body write that looks like a status line changes nothing.
        guard.write_all(b"HTTP/1.1 101 not really").await.unwrap();
        // Idle keep-alive time does not count; the next head's first byte starts the clock.
        assert_eq!(read(&mut guard, LIMIT * 2).await, None);
        client.write_all(b"G").await.unwrap();
        assert!(matches!(read(&mut guard, LIMIT).await, Some(Ok(1))));
        assert_eq!(
            read(&mut guard, LIMIT * 3).await,
            Some(Err(std::io::ErrorKind::TimedOut))
        );

        let (mut guard, mut client) = guarded();
        client
            .write_all(b"GET / HTTP/1.1\r\nUpgrade: x\r\n\r\n")
            .await
            .unwrap();
        read(&mut guard, LIMIT).await;
        guard
            .write_all(b"HTTP/1.1 101 Switching Protocols\r\n\r\n")
            .await
            .unwrap();
        client.write_all(b"raw").await.unwrap();
        assert!(matches!(read(&mut guard, LIMIT).await, Some(Ok(3))));
        assert_eq!(
            read(&mut guard, LIMIT * 3).await,
            None,
            "no deadline after 101"
        );
    }
}
