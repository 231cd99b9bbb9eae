//! The operator console: a web page on the admin listener (`GET /console/`), its three files
//! compiled into the binary (plain HTML, CSS and JavaScript: no toolchain, nothing to build or
//! install at run time). Every figure it shows and every change it makes goes through the admin
//! API, with the admin token the operator types in (kept in the tab's `sessionStorage` only);
//! only these files are served without the token.
//!
//! The page runs no inline script and loads nothing from elsewhere: the Content-Security-Policy
//! allows this listener's own script, style and API and nothing else, and no frame may hold
//! the page. Names, ids and customers are put on the page as text (`textContent`), never as
//! markup.

use http::Response;

const INDEX: &str = include_str!("index.html");
const SCRIPT: &str = include_str!("console.js");
const STYLE: &str = include_str!("console.css");

const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                   img-src 'self' data:; base-uri 'none'; form-action 'none'; \
                   frame-ancestors 'none'";

/// One of the console's files, by path under the admin listener; `None` for any other path.
pub fn file(path: &str) -> Option<Response<Vec<u8>>> {
    let (body, kind) = match path {
        "/console/" | "/console/index.html" => (INDEX, "text/html; charset=utf-8"),
        "/console/console.js" => (SCRIPT, "text/javascript; charset=utf-8"),
        "/console/console.css" => (STYLE, "text/css; charset=utf-8"),
        _ => return None,
    };
    Some(
        with_headers(
            Response::builder()
                .status(200)
                .header("content-type", kind)
                .header("content-length", body.len()),
        )
        .body(body.as_bytes().to_vec())
        .unwrap_or_default(),
    )
}

/// `/console` without its slash: to the page.
pub fn redirect() -> Response<Vec<u8>> {
    with_headers(
        Response::builder()
            .status(308)
            .header("location", "/console/")
            .header("content-length", 0),
    )
    .body(Vec::new())
    .unwrap_or_default()
}

fn with_headers(b: http::response::Builder) -> http::response::Builder {
    b.header("content-security-policy", CSP)
        .header("x-content-type-options", "nosniff")
        .header("referrer-policy", "no-referrer")
        .header("x-frame-options", "DENY")
        .header("cache-control", "no-store")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_files_are_served_with_their_type_and_the_safety_headers() {
        let page = file("/console/").unwrap();
        assert_eq!(page.headers()["content-type"], "text/html; charset=utf-8");
        let csp = page.headers()["content-security-policy"].to_str().unwrap();
        assert!(csp.contains("frame-ancestors 'none'") && csp.contains("script-src 'self'"));
        assert!(!csp.contains("unsafe-inline"));
        assert_eq!(page.headers()["x-content-type-options"], "nosniff");
        assert_eq!(page.headers()["referrer-policy"], "no-referrer");
        assert!(file("/console/console.js").is_some());
        assert!(file("/console/../keys").is_none());
    }

    #[test]
    fn the_page_has_no_inline_script_or_handler() {
        assert!(
            !INDEX.contains("<script>"),
            "scripts come from console.js only"
        );
        let lower = INDEX.to_ascii_lowercase();
        let handler = lower.match_indices(" on").any(|(i, _)| {
            let rest = &lower[i + 3..];
            let name = rest.bytes().take_while(u8::is_ascii_lowercase).count();
            name > 0 && rest[name..].trim_start().starts_with('=')
        });
        assert!(!handler, "no inline handlers");
        assert!(!SCRIPT.contains("innerHTML"), "text goes in as text");
    }
}
