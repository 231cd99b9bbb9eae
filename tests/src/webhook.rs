//! A webhook receiver for the events tests: a real HTTP/1.1 listener on loopback that checks
//! every batch's `Pet-Signature` (HMAC-SHA256 of `"<t>.<body>"`, computed here from SHA-256
//! alone, so it shares no code with the gateway's), records the events of the batches it
//! accepts, and answers as told: an error status for the first batches, then 200.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use sha2::{Digest, Sha256};

#[derive(Default)]
pub struct Received {
    /// Events of the batches answered 2xx, in arrival order (duplicates kept).
    pub events: Vec<Value>,
    /// Every request that came, accepted or not.
    pub requests: usize,
    /// Requests whose signature did not verify (or was missing).
    pub bad_signatures: usize,
    /// Requests whose body was not a JSON array, or had the wrong content type.
    pub malformed: usize,
}

pub struct WebhookReceiver {
    pub addr: SocketAddr,
    pub received: Arc<Mutex<Received>>,
    stop: Arc<AtomicBool>,
}

impl WebhookReceiver {
    /// Listens on a free loopback port; the first `fail_first` requests get `fail_status`,
    /// then every request with a valid signature gets 200 (an invalid one 401).
    pub fn start(secret: &[u8], fail_first: usize, fail_status: u16) -> WebhookReceiver {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        WebhookReceiver::on(listener, secret, fail_first, fail_status)
    }

    /// The same, on `addr` (a receiver that comes back where the gateway was told to post).
    pub fn start_at(addr: SocketAddr, secret: &[u8]) -> WebhookReceiver {
        let listener = TcpListener::bind(addr).expect("bind");
        WebhookReceiver::on(listener, secret, 0, 200)
    }

    fn on(listener: TcpListener, secret: &[u8], fail_first: usize, status: u16) -> WebhookReceiver {
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("addr");
        let received = Arc::new(Mutex::new(Received::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (r, s, secret) = (Arc::clone(&received), Arc::clone(&stop), secret.to_vec());
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => serve(conn, &secret, &r, fail_first, status),
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        WebhookReceiver {
            addr,
            received,
            stop,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}/hooks/pet", self.addr)
    }

    /// Waits up to `timeout` for `done` to hold of what was received.
    pub fn wait_for(&self, timeout: Duration, done: impl Fn(&Received) -> bool) -> bool {
        let until = Instant::now() + timeout;
        while Instant::now() < until {
            if done(&self.received.lock().unwrap()) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        done(&self.received.lock().unwrap())
    }
}

impl Drop for WebhookReceiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn serve(conn: TcpStream, secret: &[u8], r: &Mutex<Received>, fail_first: usize, status: u16) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    let mut reader = BufReader::new(conn);
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        if line == "\r\n" {
            break;
        }
        headers.push(line.trim_end().to_owned());
    }
    let header = |name: &str| {
        headers.iter().find_map(|h| {
            let (k, v) = h.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
        })
    };
    let length: usize = header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let answer = {
        let mut r = r.lock().unwrap();
        r.requests += 1;
        let signed = header("pet-signature").is_some_and(|s| verifies(secret, &s, &body));
        let events = serde_json::from_slice::<Vec<Value>>(&body).ok();
        let typed = header("content-type").as_deref() == Some("application/cloudevents-batch+json");
        if !signed {
            r.bad_signatures += 1;
            401
        } else if events.is_none() || !typed {
            r.malformed += 1;
            400
        } else if r.requests <= fail_first {
            status
        } else {
            r.events.extend(events.unwrap_or_default());
            200
        }
    };
    let mut conn = reader.into_inner();
    let _ = write!(
        conn,
        "HTTP/1.1 {answer} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
}

/// `t=<t>,v1=<hex>[,v1=<hex>…]` against HMAC-SHA256(secret, "<t>.<body>"): any `v1` (there are
/// two during a rotation of the secret).
fn verifies(secret: &[u8], header: &str, body: &[u8]) -> bool {
    let fields: Vec<(&str, &str)> = header
        .split(',')
        .filter_map(|p| p.split_once('='))
        .collect();
    let Some(t) = fields.iter().find(|(k, _)| *k == "t").map(|(_, v)| v) else {
        return false;
    };
    let mut message = format!("{t}.").into_bytes();
    message.extend_from_slice(body);
    let expected = hex::encode(hmac_sha256(secret, &message));
    fields.iter().any(|(k, v)| *k == "v1" && *v == expected)
}

/// RFC 2104 over SHA-256.
pub fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    let mut k = [0u8; 64];
    if key.len() > 64 {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let inner: Vec<u8> = k.iter().map(|b| b ^ 0x36).collect();
    let outer: Vec<u8> = k.iter().map(|b| b ^ 0x5c).collect();
    let h = Sha256::new()
        .chain_update(&inner)
        .chain_update(message)
        .finalize();
    Sha256::new()
        .chain_update(&outer)
        .chain_update(h)
        .finalize()
        .into()
}

#[cfg(test)]
mod tests {
    #[test]
    fn hmac_matches_rfc_4231_case_2() {
        assert_eq!(
            hex::encode(super::hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
