//! One signed POST of a batch of events to the receiver: a blocking HTTP/1.1 request on the
//! webhook's own thread (never on the request path), `Connection: close`, with a deadline on
//! the connect, on every read and write and on the whole exchange, so a receiver that stalls or
//! trickles costs the thread at most [`DEADLINE`] and never a request.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CONNECT: Duration = Duration::from_secs(5);
/// The most one POST may take, from the first connect to the status line.
pub const DEADLINE: Duration = Duration::from_secs(15);
/// The most of a response read: the status line and headers are all that is used.
const HEAD_LIMIT: usize = 16 * 1024;
/// The most handed to one write, so the deadline is looked at between them.
const PIECE: usize = 16 * 1024;

/// The receiver: an `http://` or `https://` URL, checked when the configuration is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookUrl {
    pub https: bool,
    pub host: String,
    pub port: u16,
    /// `/path?query`, at least `/`.
    pub target: String,
    /// For messages: the scheme, host, port and path, without the query (where a receiver may
    /// want a token) and without user info (refused).
    pub text: String,
}

impl WebhookUrl {
    pub fn parse(text: &str) -> Result<WebhookUrl, String> {
        let uri: http::Uri = text
            .parse()
            .map_err(|e| format!("`{text}` is not a URL ({e})"))?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(format!("`{text}` must start with http:// or https://")),
        };
        let authority = uri
            .authority()
            .ok_or_else(|| format!("`{text}` names no host"))?;
        if authority.as_str().contains('@') {
            return Err(format!(
                "`{text}` carries user info; the receiver authenticates events by their \
                 signature"
            ));
        }
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        if host.is_empty() {
            return Err(format!("`{text}` names no host"));
        }
        // `http` reads a port that is not a number as none at all: refuse it rather than post
        // to the scheme's default port.
        let after_host = authority
            .as_str()
            .rsplit_once(']')
            .map_or(authority.as_str(), |(_, p)| p);
        if after_host.contains(':') && authority.port_u16().is_none_or(|p| p == 0) {
            return Err(format!(
                "`{text}` has a port that is not a number from 1 to 65535"
            ));
        }
        Ok(WebhookUrl {
            https,
            host: host.to_owned(),
            port: authority.port_u16().unwrap_or(if https { 443 } else { 80 }),
            target: uri
                .path_and_query()
                .map_or("/".to_owned(), |p| p.as_str().to_owned()),
            text: format!(
                "{}://{}{}",
                if https { "https" } else { "http" },
                authority.as_str(),
                uri.path()
            ),
        })
    }

    fn host_header(&self) -> String {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        match (self.https, self.port) {
            (true, 443) | (false, 80) => host,
            _ => format!("{host}:{}", self.port),
        }
    }
}

/// Why a POST got no status.
#[derive(Debug, thiserror::Error)]
pub enum PostError {
    #[error("cannot reach {0}")]
    Connect(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("the receiver answered something that is not HTTP: {0:?}")]
    Garbage(String),
    #[error("the receiver took longer than {DEADLINE:?}")]
    Deadline,
}

/// Posts `body` (a JSON array of CloudEvents) with the header lines `signed` that sign it: the
/// receiver's status code. The whole exchange, name lookup included, ends within [`DEADLINE`].
pub fn post(
    url: &WebhookUrl,
    tls: Option<&Arc<rustls::ClientConfig>>,
    signed: &str,
    body: &[u8],
) -> Result<u16, PostError> {
    let until = Instant::now() + DEADLINE;
    let tcp = connect(url, until)?;
    tcp.set_nodelay(true)?;
    // The same socket, kept to shorten its timeouts to what is left before each read and write.
    let control = tcp.try_clone()?;
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: pet-gateway\r\nContent-Type: \
         application/cloudevents-batch+json\r\nContent-Length: {}\r\n{signed}\
         Connection: close\r\n\r\n",
        url.target,
        url.host_header(),
        body.len(),
    );
    match (url.https, tls) {
        (true, Some(config)) => {
            let name = rustls::pki_types::ServerName::try_from(url.host.clone())
                .map_err(|e| PostError::Tls(e.to_string()))?;
            let conn = rustls::ClientConnection::new(Arc::clone(config), name)
                .map_err(|e| PostError::Tls(e.to_string()))?;
            let stream = rustls::StreamOwned::new(conn, tcp);
            exchange(stream, &control, &head, body, until)
        }
        (true, None) => Err(PostError::Tls("no TLS configuration".to_owned())),
        (false, _) => exchange(tcp, &control, &head, body, until),
    }
}

/// What is left before `until`, or the deadline's error.
fn left(until: Instant) -> Result<Duration, PostError> {
    let left = until.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(PostError::Deadline)
    } else {
        Ok(left)
    }
}

fn connect(url: &WebhookUrl, until: Instant) -> Result<TcpStream, PostError> {
    let addrs = resolve(url, until)?;
    let mut last = None;
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, left(until)?.min(CONNECT)) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(format!("{addr} ({e})")),
        }
    }
    Err(PostError::Connect(
        last.unwrap_or_else(|| format!("{}: no address", url.host)),
    ))
}

/// The receiver's addresses: an address as given, else a name lookup on a thread of its own,
/// waited for at most [`CONNECT`] (the system's resolver has no deadline to pass).
fn resolve(url: &WebhookUrl, until: Instant) -> Result<Vec<SocketAddr>, PostError> {
    if let Ok(ip) = url.host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, url.port)]);
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let (host, port) = (url.host.clone(), url.port);
    std::thread::Builder::new()
        .name("events-dns".into())
        .spawn(move || {
            let _ = tx.send((host.as_str(), port).to_socket_addrs().map(Vec::from_iter));
        })?;
    match rx.recv_timeout(left(until)?.min(CONNECT)) {
        Ok(Ok(addrs)) => Ok(addrs),
        Ok(Err(e)) => Err(PostError::Connect(format!(
            "{}:{} ({e})",
            url.host, url.port
        ))),
        Err(_) => Err(PostError::Connect(format!(
            "{}: the name lookup took longer than {CONNECT:?}",
            url.host
        ))),
    }
}

/// Sends the request in pieces and reads the status line, each step under what is left of
/// the deadline, however slowly the receiver reads or trickles its answer.
fn exchange<S: Read + Write>(
    mut s: S,
    control: &TcpStream,
    head: &str,
    body: &[u8],
    until: Instant,
) -> Result<u16, PostError> {
    for piece in head.as_bytes().chunks(PIECE).chain(body.chunks(PIECE)) {
        control.set_write_timeout(Some(left(until)?))?;
        control.set_read_timeout(Some(left(until)?))?;
        s.write_all(piece)?;
    }
    s.flush()?;
    let mut got = Vec::with_capacity(256);
    let mut buf = [0u8; 1024];
    loop {
        if let Some(end) = got.windows(2).position(|w| w == b"\r\n") {
            let code = status(&got[..end])?;
            if !(100..200).contains(&code) {
                return Ok(code);
            }
            // An interim answer (`100 Continue`, `103 Early Hints`): the final one follows
            // its empty line.
            if let Some(head) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                got.drain(..head + 4);
                continue;
            }
        }
        if got.len() > HEAD_LIMIT {
            return Err(PostError::Garbage("no status line".to_owned()));
        }
        control.set_read_timeout(Some(left(until)?))?;
        let n = s.read(&mut buf)?;
        if n == 0 {
            return Err(PostError::Garbage(
                String::from_utf8_lossy(&got).chars().take(80).collect(),
            ));
        }
        got.extend_from_slice(&buf[..n]);
    }
}

/// `HTTP/1.x NNN reason` → NNN.
fn status(line: &[u8]) -> Result<u16, PostError> {
    let text = String::from_utf8_lossy(line);
    let mut parts = text.split(' ');
    let version = parts.next().unwrap_or_default();
    let code = parts.next().and_then(|c| c.parse::<u16>().ok());
    match code {
        Some(code) if version.starts_with("HTTP/1.") && (100..600).contains(&code) => Ok(code),
        _ => Err(PostError::Garbage(text.chars().take(80).collect())),
    }
}

/// The client TLS settings for an `https://` receiver: the system's roots.
pub fn tls_config() -> Result<Arc<rustls::ClientConfig>, String> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut roots = rustls::RootCertStore::empty();
    let found = rustls_native_certs::load_native_certs();
    for cert in found.certs {
        let _ = roots.add(cert);
    }
    if roots.is_empty() {
        return Err("no trusted root certificates found on this system".to_owned());
    }
    Ok(Arc::new(
        rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked() {
        let u = WebhookUrl::parse("https://billing.example.com/hooks/pet?x=1").unwrap();
        assert!(u.https);
        assert_eq!((u.host.as_str(), u.port), ("billing.example.com", 443));
        assert_eq!(u.target, "/hooks/pet?x=1");
        let u = WebhookUrl::parse("http://127.0.0.1:9000").unwrap();
        assert_eq!((u.port, u.target.as_str()), (9000, "/"));
        assert_eq!(u.host_header(), "127.0.0.1:9000");
        let u = WebhookUrl::parse("http://[::1]:9000/x").unwrap();
        assert_eq!(u.host_header(), "[::1]:9000");
        let u = WebhookUrl::parse("https://h.example:8443/x?token=secret").unwrap();
        assert_eq!(u.text, "https://h.example:8443/x", "no query in messages");
        for bad in [
            "https://h:8443x/",
            "http://h:99999/",
            "billing.example.com",
            "ftp://x/",
            "http://",
            "http://u:p@x/",
            "not a url",
        ] {
            assert!(WebhookUrl::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_interim_answer_is_passed_over_for_the_final_one() {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url =
            WebhookUrl::parse(&format!("http://{}/", listener.local_addr().unwrap())).unwrap();
        let receiver = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf).unwrap();
            s.write_all(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\nHTTP/1.1 422 Unprocessable\r\nContent-Length: 0\r\n\r\n")
                .unwrap();
        });
        assert_eq!(
            post(&url, None, "Pet-Signature: t=1,v1=00\r\n", b"[]").unwrap(),
            422
        );
        receiver.join().unwrap();
    }

    #[test]
    fn status_lines_are_read_and_garbage_is_refused() {
        assert_eq!(status(b"HTTP/1.1 204 No Content").unwrap(), 204);
        assert_eq!(status(b"HTTP/1.0 500").unwrap(), 500);
        assert!(status(b"SSH-2.0-OpenSSH").is_err());
        assert!(status(b"HTTP/1.1 99999 x").is_err());
    }
}
