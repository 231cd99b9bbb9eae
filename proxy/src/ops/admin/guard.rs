//! What keeps web pages away from the admin listener, with or without `admin_token` (the
//! loopback default has none): a browser visiting any site must not be able to act on, or read,
//! the admin API of the operator's own machine.
//!
//! - `Host` must be an IP address, `localhost`, or a name in `admin_hosts`: a page of
//!   `evil.example` whose name was pointed at 127.0.0.1 (DNS rebinding) sends its own name and
//!   is refused, though the browser counts it as same-origin.
//! - A request a browser marks as coming from another site is refused: an `Origin` that is not
//!   this listener's own, or `Sec-Fetch-Site: cross-site` (or `same-site`: a sibling host is
//!   another site's page too). Tools that send neither (the `keys` commands, curl,
//!   Prometheus) are not affected.
//!
//! The `Host` check holds for every path, `/healthz`, `/readyz` and `/metrics` too: a rebound
//! page over plain http sends neither `Origin` (a same-origin `GET`) nor `Sec-Fetch-Site` (only
//! sent to https and localhost), so nothing but the name tells it from a tool. Supervisors and
//! Prometheus reach the listener by an IP address or `localhost`, or by a name listed in
//! `admin_hosts` (or, to the probes only, with no `Host` at all: an HTTP/1.0 health check).
//! A browser following a link to the console's page (a `GET` navigation to its
//! files, which hold no data) is let through from anywhere.

use std::net::IpAddr;

use http::request::Parts;

/// Why a request was refused, for its 403. `probe`: a health or metrics path; `page`: one of
/// the console's files.
pub fn refuse(req: &Parts, hosts: &[String], probe: bool, page: bool) -> Option<&'static str> {
    let header = |name: &str| req.headers.get(name).and_then(|v| v.to_str().ok());
    let navigation =
        page && req.method == http::Method::GET && header("sec-fetch-mode") == Some("navigate");
    let host = header("host").or_else(|| req.uri.authority().map(|a| a.as_str()));
    // An HTTP/1.0 health check (HAProxy's `option httpchk`) sends no Host; a browser always
    // does, so a probe without one, and without a browser's headers, is a tool's.
    let browser = header("origin").is_some() || header("sec-fetch-site").is_some();
    let hostless_tool = probe && host.is_none() && !browser;
    if !hostless_tool && !host.is_some_and(|h| allowed_host(h, hosts)) {
        return Some(
            "the admin listener answers only to its addresses, localhost and the names in \
             admin_hosts (Host header)",
        );
    }
    if navigation {
        return None;
    }
    if matches!(header("sec-fetch-site"), Some("cross-site" | "same-site")) {
        return Some("the admin listener takes no requests from other sites");
    }
    if let Some(origin) = header("origin") {
        let own = host.is_some_and(|h| {
            origin.eq_ignore_ascii_case(&format!("http://{h}"))
                || origin.eq_ignore_ascii_case(&format!("https://{h}"))
        });
        if !own {
            return Some("the admin listener takes no requests from other origins");
        }
    }
    None
}

/// `host[:port]` names an IP address, `localhost`, or one of `hosts`.
fn allowed_host(value: &str, hosts: &[String]) -> bool {
    let name = match value.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((ip, _)) => ip,
            None => return false,
        },
        None => value.rsplit_once(':').map_or(value, |(h, p)| {
            if p.bytes().all(|b| b.is_ascii_digit()) {
                h
            } else {
                value
            }
        }),
    };
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    name.parse::<IpAddr>().is_ok() || name == "localhost" || hosts.contains(&name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(headers: &[(&str, &str)]) -> Parts {
        let mut b = http::Request::builder().uri("/keys");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn hosts_are_addresses_localhost_or_named() {
        let named = vec!["gw1.internal".to_owned()];
        for ok in [
            "127.0.0.1:9090",
            "[::1]:9090",
            "localhost:9090",
            "LOCALHOST",
            "10.0.0.5",
            "gw1.internal:9090",
        ] {
            assert!(allowed_host(ok, &named), "{ok}");
        }
        for bad in [
            "evil.example:9090",
            "127.0.0.1.evil.example",
            "gw2.internal",
            "",
            "[::1",
        ] {
            assert!(!allowed_host(bad, &named), "{bad}");
        }
    }

    #[test]
    fn other_sites_and_rebound_names_are_refused_and_tools_pass() {
        let none: Vec<String> = Vec::new();
        assert!(refuse(&parts(&[("host", "127.0.0.1:9090")]), &none, false, false).is_none());
        let same = [
            ("host", "127.0.0.1:9090"),
            ("origin", "http://127.0.0.1:9090"),
            ("sec-fetch-site", "same-origin"),
        ];
        assert!(refuse(&parts(&same), &none, false, false).is_none());
        let rebound = [
            ("host", "evil.example:9090"),
            ("origin", "http://evil.example:9090"),
        ];
        assert!(refuse(&parts(&rebound), &none, false, false).is_some());
        let cross = [
            ("host", "127.0.0.1:9090"),
            ("origin", "https://evil.example"),
        ];
        assert!(refuse(&parts(&cross), &none, false, false).is_some());
        let fetch = [("host", "127.0.0.1:9090"), ("sec-fetch-site", "cross-site")];
        assert!(refuse(&parts(&fetch), &none, false, false).is_some());
        assert!(
            refuse(&parts(&[]), &none, false, false).is_some(),
            "no Host at all"
        );
        // A rebound page's plain GET (no Origin, no Sec-Fetch-Site over http) is refused by
        // its name alone; a tool by an unlisted name too, by a listed one not.
        let plain = parts(&[("host", "evil.example:9090")]);
        assert!(
            refuse(&plain, &none, false, false).is_some(),
            "a rebound page"
        );
        // A health check with no Host at all (HTTP/1.0), to the probes only.
        assert!(refuse(&parts(&[]), &none, true, false).is_none());
        assert!(refuse(&parts(&[("origin", "http://x")]), &none, true, false).is_some());
        assert!(
            refuse(&plain, &none, true, false).is_some(),
            "a rebound page's probe"
        );
        let listed = vec!["gw9".to_owned()];
        assert!(refuse(&parts(&[("host", "gw9:9090")]), &listed, false, false).is_none());
        // A link followed to the console's page, from anywhere; never to data.
        let link = [
            ("host", "127.0.0.1:9090"),
            ("sec-fetch-site", "cross-site"),
            ("sec-fetch-mode", "navigate"),
        ];
        assert!(refuse(&parts(&link), &none, false, true).is_none());
        assert!(refuse(&parts(&link), &none, false, false).is_some());
    }
}
