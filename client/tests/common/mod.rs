//! A scripted server on loopback, for answers the real gateway never gives or for bodies of
//! another gateway version.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Answers every request with `response` (a whole HTTP/1.1 response) and counts the requests.
pub async fn scripted(response: impl Into<String>) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let response: Arc<str> = response.into().into();
    let count = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&count);
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            let seen = Arc::clone(&seen);
            let response = Arc::clone(&response);
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let mut have = 0;
                loop {
                    let Ok(n) = socket.read(&mut buf[have..]).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    have += n;
                    let text = String::from_utf8_lossy(&buf[..have]).to_string();
                    let Some(end) = text.find("\r\n\r\n") else {
                        continue;
                    };
                    let length = text[..end]
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                        })
                        .unwrap_or(0);
                    if have < end + 4 + length {
                        continue;
                    }
                    seen.fetch_add(1, Ordering::SeqCst);
                    have = 0;
                    if socket.write_all(response.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (url, count)
}
