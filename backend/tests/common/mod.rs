//! Starts the backend in-process on a free loopback port with a fresh database, the way
//! `run(listener, store, shutdown)` is meant to be used by tests.

#![allow(dead_code)] // each test target uses its own part of this harness

use std::net::SocketAddr;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub struct TestServer {
    pub addr: SocketAddr,
    pub client: reqwest::Client,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl TestServer {
    pub async fn start() -> TestServer {
        Self::start_with(backend::Settings::default()).await
    }

    pub async fn start_with(settings: backend::Settings) -> TestServer {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = backend::PetStore::open(&dir.path().join("pets.db")).expect("open store");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(backend::run_with(listener, store, settings, async {
            let _ = rx.await;
        }));
        TestServer {
            addr,
            client: reqwest::Client::new(),
            shutdown: Some(tx),
            task: Some(task),
            _dir: dir,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Signals shutdown and returns the server task, which ends once connections have drained.
    pub fn shutdown(&mut self) -> JoinHandle<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.task.take().expect("server still running")
    }

    pub async fn create(&self, body: Value) -> Value {
        let resp = self
            .client
            .post(self.url("/v1/pets"))
            .json(&body)
            .send()
            .await
            .expect("send create");
        assert_eq!(resp.status(), 201, "create {body}");
        resp.json().await.expect("json body")
    }
}

/// Asserts the response is the interface's Error object with this status and code, served as
/// JSON, and returns the parsed body.
pub async fn expect_error(resp: reqwest::Response, status: u16, code: &str) -> Value {
    let what = format!("{} {}", resp.url(), resp.status());
    assert_eq!(resp.status().as_u16(), status, "{what}");
    assert_eq!(
        resp.headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("application/json"),
        "{what}"
    );
    let body: Value = resp.json().await.expect("error body is JSON");
    assert_eq!(body["code"], code, "{what}: {body}");
    assert_eq!(body["status"], status, "{what}: {body}");
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{what}: {body}"
    );
    assert_eq!(body.as_object().map(|o| o.len()), Some(3), "{body}");
    body
}

/// Sends raw bytes and reads one response. For what an HTTP client library will not send
/// (chunked oversize bodies, split writes).
pub async fn raw_exchange(addr: SocketAddr, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request).await.expect("write");
    read_response(&mut stream).await
}

/// Reads until one response with a `content-length` body is complete, or the peer closes.
pub async fn read_response(stream: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let read = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        let mut chunk = [0u8; 4096];
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    buf.extend_from_slice(&chunk[..n]);
                    if response_complete(&buf) {
                        break;
                    }
                }
            }
        }
    })
    .await;
    assert!(read.is_ok(), "no complete response within 10 s");
    String::from_utf8_lossy(&buf).into_owned()
}

fn response_complete(buf: &[u8]) -> bool {
    let text = String::from_utf8_lossy(buf);
    let Some(head_end) = text.find("\r\n\r\n") else {
        return false;
    };
    let length = text[..head_end]
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())
                .flatten()
        })
        .unwrap_or(0);
    buf.len() >= head_end + 4 + length
}
