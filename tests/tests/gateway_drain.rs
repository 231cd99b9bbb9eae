//! Draining kept-alive connections, end to end with the real gateway and backend: a stop or an
//! upgrade answers each kept-alive client with `Connection: close`, and never closes an idle
//! connection under a request already on its way (a `POST` there was lost: the fleet soak saw a
//! `createPet` reset, and a load balancer does not send a `POST` twice).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use e2e::{Fixture, GatewayProcess, Process};

/// One request on `s`, kept alive unless the gateway says otherwise: its status and its head.
fn exchange(s: &mut TcpStream, key: &str, create: bool) -> (u16, String) {
    let request = if create {
        let body = r#"{"name":"Rex","categoryId":1}"#;
        format!(
            "POST /v1/pets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    } else {
        format!("GET /v1/pets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n")
    };
    s.write_all(request.as_bytes()).expect("the request sent");
    read_response(s)
}

/// Reads one response with a Content-Length; a closed or reset connection before it fails.
fn read_response(s: &mut TcpStream) -> (u16, String) {
    let (mut raw, mut buf) = (Vec::new(), [0u8; 4096]);
    loop {
        let n = match s.read(&mut buf) {
            Ok(0) => panic!("the connection was closed before an answer"),
            Ok(n) => n,
            Err(e) => panic!("no answer on the kept-alive connection: {e}"),
        };
        raw.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&raw).to_string();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let head = head.to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map(|v| v.trim().parse().expect("a length"))
                .unwrap_or(0);
            if body.len() >= length {
                let status = head.get(9..12).and_then(|c| c.parse().ok());
                return (status.expect("a status line"), head);
            }
        }
    }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connected");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

fn closes(head: &str) -> bool {
    head.lines().any(|l| l == "connection: close")
}

/// Waits (15 s at most) until the gateway's log says `what`.
fn wait_for_log(gw: &GatewayProcess, what: &str) {
    let started = Instant::now();
    while !gw.log_text().contains(what) {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the gateway never logged {what:?}:\n{}",
            gw.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A gateway with `grace_period_secs` and a real backend, a key, and a connection kept alive
/// after one answer.
fn kept_alive(f: &Fixture, grace: u64) -> (GatewayProcess, e2e::Backend, String, TcpStream) {
    let key = f.issue("free");
    let backend = f.backend();
    let mut spec = f.spec(backend.addr);
    spec.extra = format!("grace_period_secs = {grace}\n");
    let gw = f.gateway(&spec);
    let mut conn = connect(gw.addr);
    let (status, head) = exchange(&mut conn, &key, false);
    assert_eq!(status, 200, "{head}");
    assert!(!closes(&head), "kept alive before any signal: {head}");
    (gw, backend, key, conn)
}

/// An upgrade: once the old process has handed its sockets over (it serves on for pingora's
/// five seconds before its shutdown begins), a request on a connection it kept alive is
/// answered with `Connection: close`, so the client's next request goes to the new process.
/// It used to be kept alive until the shutdown closed it, idle or not.
#[test]
fn after_an_upgrade_hands_over_the_sockets_a_kept_alive_client_is_told_to_close() {
    let f = Fixture::new(600, 100_000);
    let (old, _backend, key, mut conn) = kept_alive(&f, 2);
    let new = old.start_upgrade();
    old.process.signal(3); // SIGQUIT: hand the sockets over
    wait_for_log(&old, "listener sockets sent");

    let (status, head) = exchange(&mut conn, &key, true);
    assert_eq!(status, 201, "{head}");
    assert!(closes(&head), "the old process kept the client: {head}");
    let mut rest = [0u8; 1];
    assert_eq!(
        conn.read(&mut rest).ok(),
        Some(0),
        "closed after the answer"
    );

    // The client's next connection is the new process's.
    let (status, _) = exchange(&mut connect(new.addr), &key, false);
    assert_eq!(status, 200);
    assert_eq!(
        Process::wait_exit(old.process, Duration::from_secs(30)),
        Some(0),
        "the old process drained and exited"
    );
}

/// A stop: a connection idle when the shutdown began is left open through the first half of
/// the grace period, and a request on it is answered (`Connection: close`), not met by a closed
/// socket; pingora closed such connections the moment its shutdown began. One that stays idle
/// is closed at that half, and the process exits.
#[test]
fn a_request_on_a_connection_idle_when_the_stop_began_is_answered() {
    let f = Fixture::new(600, 100_000);
    let (gw, _backend, key, mut conn) = kept_alive(&f, 10);
    let mut silent = connect(gw.addr);
    let (status, _) = exchange(&mut silent, &key, false);
    assert_eq!(status, 200);
    gw.process.signal(15); // SIGTERM
    wait_for_log(&gw, "Graceful shutdown started");
    // The shutdown has closed the listener (and, before, the idle connections just after it).
    let started = Instant::now();
    while TcpStream::connect(gw.addr).is_ok() {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "still listening"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));

    let (status, head) = exchange(&mut conn, &key, true);
    assert_eq!(status, 201, "{head}");
    assert!(closes(&head), "a stopping gateway kept the client: {head}");
    // The silent one is closed at half the grace period (5 s), well before the read's 10 s.
    let mut rest = [0u8; 1];
    match silent.read(&mut rest) {
        Ok(0) => {}
        Ok(n) => panic!("{n} bytes on an idle connection"),
        Err(e) => assert!(
            !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "the idle connection was left open: {e}"
        ),
    }
    assert_eq!(
        Process::wait_exit(gw.process, Duration::from_secs(30)),
        Some(0),
        "a graceful stop"
    );
}
