//! Fake backends for the gateway to forward to: one that echoes what it was sent, one that
//! never answers, one that closes each connection unanswered, one that fails mid-response.

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

/// One HTTP/1 request off a keep-alive connection: its head (without the blank line), its body
/// read and dropped; `None` when the connection ends or breaks.
fn read_request(reader: &mut std::io::BufReader<std::net::TcpStream>) -> Option<String> {
    use std::io::{BufRead, Read};
    let mut head = String::new();
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            length = v.trim().parse().unwrap_or(0);
        }
        if line == "\r\n" {
            break;
        }
        head.push_str(&line);
    }
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body).ok()?;
    Some(head)
}

/// An upstream that answers every request with 200 and the request's head as the body, so tests
/// can see exactly what the gateway forwarded. Thread per connection, keep-alive.
pub struct EchoUpstream {
    pub addr: SocketAddr,
}

impl EchoUpstream {
    pub fn start() -> EchoUpstream {
        Self::start_with_delay(Duration::ZERO)
    }

    /// Like `start`, but every answer waits `delay` first: an in-flight request to hold open.
    pub fn start_with_delay(delay: Duration) -> EchoUpstream {
        Self::start_with(delay, "")
    }

    /// Like `start`, but every answer also carries `extra_head` (header lines, each ending in
    /// CRLF): a backend that sends fields of its own.
    pub fn start_answering_with(extra_head: &'static str) -> EchoUpstream {
        Self::start_with(Duration::ZERO, extra_head)
    }

    /// Like `start`, but a connection left idle for `idle` is closed, as backends with a short
    /// keep-alive timeout do; `connections` counts those it accepted.
    pub fn start_closing_idle_after(
        idle: Duration,
        connections: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ) -> EchoUpstream {
        Self::start_inner(
            Duration::ZERO,
            "",
            Some(idle),
            connections,
            Default::default(),
        )
    }

    /// Like `start`, but the request line of every request it is sent is kept, in order: what
    /// reached the backend, byte for byte.
    pub fn start_recording() -> (EchoUpstream, RequestLines) {
        let lines = RequestLines::default();
        let echo = Self::start_inner(Duration::ZERO, "", None, Default::default(), lines.clone());
        (echo, lines)
    }

    fn start_with(delay: Duration, extra_head: &'static str) -> EchoUpstream {
        Self::start_inner(
            delay,
            extra_head,
            None,
            Default::default(),
            Default::default(),
        )
    }

    fn start_inner(
        delay: Duration,
        extra_head: &'static str,
        idle: Option<Duration>,
        connections: std::sync::Arc<std::sync::atomic::AtomicUsize>,
        lines: RequestLines,
    ) -> EchoUpstream {
        use std::io::{BufReader, Write};
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind echo upstream");
        let addr = listener.local_addr().expect("addr");
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                connections.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                // A read that waits past `idle` fails, and the connection is dropped: closed.
                let _ = stream.set_read_timeout(idle);
                let lines = lines.clone();
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(stream.try_clone().expect("clone stream"));
                    let mut writer = stream;
                    while let Some(head) = read_request(&mut reader) {
                        lines.push(head.lines().next().unwrap_or_default());
                        std::thread::sleep(delay);
                        let response = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n{extra_head}content-length: {}\r\n\r\n{head}",
                            head.len()
                        );
                        if writer.write_all(response.as_bytes()).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        EchoUpstream { addr }
    }
}

/// The request lines an [`EchoUpstream::start_recording`] was sent (`GET /v1/pets HTTP/1.1`).
#[derive(Clone, Default)]
pub struct RequestLines(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl RequestLines {
    fn push(&self, line: &str) {
        self.0.lock().expect("not poisoned").push(line.to_owned());
    }

    /// Every line so far, in the order the requests arrived.
    pub fn taken(&self) -> Vec<String> {
        self.0.lock().expect("not poisoned").clone()
    }
}

/// An upstream that accepts connections and reads requests but never answers: a hung backend.
pub struct SilentUpstream {
    pub addr: SocketAddr,
}

impl SilentUpstream {
    pub fn start() -> SilentUpstream {
        use std::io::Read;
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind silent upstream");
        let addr = listener.local_addr().expect("addr");
        std::thread::spawn(move || {
            for mut stream in listener.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut sink = [0u8; 4096];
                    // Read until the gateway gives up and closes; never write.
                    while matches!(stream.read(&mut sink), Ok(n) if n > 0) {}
                });
            }
        });
        SilentUpstream { addr }
    }
}

/// An upstream that accepts each connection, reads the request's head and closes it unanswered:
/// what a backend shutting down does to a connection it accepted just before. Counts the
/// connections it dropped.
pub struct ClosingUpstream {
    pub addr: SocketAddr,
    dropped: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl ClosingUpstream {
    pub fn start() -> ClosingUpstream {
        use std::io::Read;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind closing upstream");
        let addr = listener.local_addr().expect("addr");
        let dropped = std::sync::Arc::new(AtomicUsize::new(0));
        let counter = std::sync::Arc::clone(&dropped);
        std::thread::spawn(move || {
            for mut stream in listener.incoming().flatten() {
                let mut head = [0u8; 4096];
                let _ = stream.read(&mut head);
                counter.fetch_add(1, Ordering::SeqCst);
                drop(stream);
            }
        });
        ClosingUpstream { addr, dropped }
    }

    /// How many connections it has closed unanswered.
    pub fn dropped(&self) -> usize {
        self.dropped.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A backend that fails mid-response: it sends a 200 head promising `Content-Length: 29`, part
/// of the body, then closes the connection.
pub struct TruncatingUpstream {
    pub addr: SocketAddr,
}

impl TruncatingUpstream {
    /// The part of the body that is sent before the connection closes.
    pub const PARTIAL_BODY: &'static str = "[{\"id\":1,";

    pub fn start() -> TruncatingUpstream {
        use std::io::{BufRead, BufReader, Write};
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind truncating upstream");
        let addr = listener.local_addr().expect("addr");
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(stream.try_clone().expect("clone stream"));
                    let mut writer = stream;
                    loop {
                        let mut line = String::new();
                        match reader.read_line(&mut line) {
                            Ok(0) | Err(_) => return,
                            Ok(_) if line == "\r\n" => break,
                            Ok(_) => {}
                        }
                    }
                    let _ = writer.write_all(
                        format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                             content-length: 29\r\n\r\n{}",
                            Self::PARTIAL_BODY
                        )
                        .as_bytes(),
                    );
                    let _ = writer.flush();
                    std::thread::sleep(Duration::from_millis(50));
                    // Dropping the stream closes the connection with the body incomplete.
                });
            }
        });
        TruncatingUpstream { addr }
    }
}

/// A backend that misbehaves by turns, the faults a request can end in: of every ten requests
/// (in arrival order), six answer 200 at once, one answers 500, one answers 200 after
/// `slow` (past a short read timeout: the gateway's 504), one closes its connection
/// unanswered (502), and one answers 200 after a tenth of `slow` (long enough for a client in a
/// hurry to give up). Thread per connection, keep-alive.
pub struct ChaosUpstream {
    pub addr: SocketAddr,
}

impl ChaosUpstream {
    pub fn start(slow: Duration) -> ChaosUpstream {
        use std::io::{BufReader, Write};
        use std::sync::atomic::{AtomicUsize, Ordering};
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind chaos upstream");
        let addr = listener.local_addr().expect("addr");
        let turn = std::sync::Arc::new(AtomicUsize::new(0));
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let turn = std::sync::Arc::clone(&turn);
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(stream.try_clone().expect("clone stream"));
                    let mut writer = stream;
                    while read_request(&mut reader).is_some() {
                        let status = match turn.fetch_add(1, Ordering::Relaxed) % 10 {
                            6 => "500 Internal Server Error",
                            7 => {
                                std::thread::sleep(slow);
                                "200 OK"
                            }
                            8 => return,
                            9 => {
                                std::thread::sleep(slow / 10);
                                "200 OK"
                            }
                            _ => "200 OK",
                        };
                        let response = format!(
                            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n[]"
                        );
                        if writer.write_all(response.as_bytes()).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        ChaosUpstream { addr }
    }
}

/// The bench's backend of fixed capacity (`capacity-backend`, `bench/src/bin`): `workers`
/// requests at a time, each taking `service`, the rest queued inside it; its workers can be
/// changed while it runs, and it says whom it served in which order.
pub struct CapacityBackend {
    pub addr: SocketAddr,
    _process: crate::process::Process,
}

impl CapacityBackend {
    pub fn start(workers: usize, service: Duration) -> CapacityBackend {
        let addr = crate::process::free_addr();
        let process = crate::process::Process::spawn(
            "capacity-backend",
            std::process::Command::new(crate::process::bin_path("capacity-backend"))
                .args(["--listen", &addr.to_string()])
                .args(["--workers", &workers.to_string()])
                .args(["--service-ms", &service.as_millis().to_string()]),
        );
        crate::process::wait_for_listener(addr, Duration::from_secs(10));
        CapacityBackend {
            addr,
            _process: process,
        }
    }

    /// Sets the workers it serves with from now on.
    pub async fn set_workers(&self, n: usize) {
        let resp = reqwest::Client::new()
            .post(format!("http://{}/control/workers/{n}", self.addr))
            .send()
            .await
            .expect("capacity backend answers");
        assert!(resp.status().is_success(), "{resp:?}");
    }

    /// What it has served: `served`, `in_flight`, `most_in_flight` and `keys`, the key ids of
    /// the requests in the order it started serving them.
    pub async fn served(&self) -> serde_json::Value {
        reqwest::get(format!("http://{}/control/served", self.addr))
            .await
            .expect("capacity backend answers")
            .json()
            .await
            .expect("a JSON body")
    }
}
