//! The command line's way to a running gateway: one blocking HTTP/1.1 request to its admin
//! listener, with the admin token when one is set.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::time::Duration;

/// A running gateway's admin listener, as the command line reaches it.
#[derive(Debug, Clone)]
pub struct AdminClient {
    pub addr: SocketAddr,
    /// Sent as a bearer token when the gateway requires one (`admin_token`).
    pub token: Option<String>,
}

impl AdminClient {
    pub fn of(config: &crate::config::Config) -> AdminClient {
        AdminClient::at(config.admin_listen, config.admin_token.clone())
    }

    /// The listener bound to `listen`, asked with `token`.
    pub fn at(listen: SocketAddr, token: Option<String>) -> AdminClient {
        AdminClient {
            addr: reachable(listen),
            token,
        }
    }

    /// One request: `(status, body)`.
    pub fn call(&self, method: &str, path: &str) -> Result<(u16, String), String> {
        call(self.addr, self.token.as_deref(), method, path)
    }
}

/// Where a command on the same host reaches a listener bound to `addr`: a wildcard address
/// (`0.0.0.0:9090` in a container, so that probes from outside reach it) is not one to connect
/// to, so its family's loopback address on the same port is used instead.
fn reachable(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => (Ipv4Addr::LOCALHOST, addr.port()).into(),
        IpAddr::V6(ip) if ip.is_unspecified() => (Ipv6Addr::LOCALHOST, addr.port()).into(),
        _ => addr,
    }
}

/// One request to a gateway's admin listener, for the command line: `(status, body)`.
fn call(
    addr: SocketAddr,
    token: Option<&str>,
    method: &str,
    path: &str,
) -> Result<(u16, String), String> {
    let unreachable = |e: std::io::Error| {
        format!(
            "the gateway's admin listener at {addr} does not answer ({e}); is the gateway running?"
        )
    };
    let mut stream =
        TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(unreachable)?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(unreachable)?;
    let authorization = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    // A change is declared JSON, as the admin listener asks of any (its body is empty).
    let json = if method == "GET" {
        ""
    } else {
        "Content-Type: application/json\r\n"
    };
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{authorization}{json}Content-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .map_err(unreachable)?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).map_err(unreachable)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("the admin listener at {addr} sent no complete response"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("the admin listener at {addr} sent no status"))?;
    Ok((status, body.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wildcard_listener_is_reached_on_loopback_and_others_as_they_are() {
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert_eq!(reachable(at("0.0.0.0:9090")), at("127.0.0.1:9090"));
        assert_eq!(reachable(at("[::]:9091")), at("[::1]:9091"));
        assert_eq!(reachable(at("10.1.2.3:9090")), at("10.1.2.3:9090"));
        assert_eq!(reachable(at("127.0.0.1:9")), at("127.0.0.1:9"));
    }
}
