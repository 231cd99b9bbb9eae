//! The admin listener's endpoints as one table: method, path pattern, handler. A path segment
//! `{key id}` matches a valid key id (anything else there is 404). A path that matches with
//! another method is 405, naming the methods it takes. The book's admin table lists the same
//! endpoints; a test holds the two together.

use http::Method;

/// What answers a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handler {
    Healthz,
    Readyz,
    Metrics,
    ListBans,
    LiftBan,
    Reload,
    ListKeys,
    IssueKey,
    ShowKey,
    ResetUsage,
    RevokeKey,
    RotateKey,
    UsageTop,
    Overview,
    OverviewHistory,
    Plans,
    KeyHistory,
    KeySearch,
    /// The console's files: served without the token (they hold no data).
    Console,
}

/// One endpoint.
#[derive(Debug)]
pub struct Route {
    pub method: &'static str,
    /// `/`-separated; a `{key id}` segment is a key id.
    pub path: &'static str,
    pub handler: Handler,
}

const fn route(method: &'static str, path: &'static str, handler: Handler) -> Route {
    Route {
        method,
        path,
        handler,
    }
}

/// Every admin endpoint.
pub const ROUTES: &[Route] = &[
    route("GET", "/healthz", Handler::Healthz),
    route("GET", "/readyz", Handler::Readyz),
    route("GET", "/metrics", Handler::Metrics),
    route("GET", "/bans", Handler::ListBans),
    route("POST", "/bans/{key id}/lift", Handler::LiftBan),
    route("POST", "/reload", Handler::Reload),
    route("GET", "/keys", Handler::ListKeys),
    route("POST", "/keys", Handler::IssueKey),
    route("GET", "/keys/{key id}", Handler::ShowKey),
    route("POST", "/keys/{key id}/reset-usage", Handler::ResetUsage),
    route("POST", "/keys/{key id}/revoke", Handler::RevokeKey),
    route("POST", "/keys/{key id}/rotate", Handler::RotateKey),
    route("GET", "/usage/top", Handler::UsageTop),
    route("GET", "/keys/{key id}/audit", Handler::KeyHistory),
    route("GET", "/key-search", Handler::KeySearch),
    route("GET", "/overview", Handler::Overview),
    route("GET", "/overview/history", Handler::OverviewHistory),
    route("GET", "/plans", Handler::Plans),
    route("GET", "/console", Handler::Console),
    route("GET", "/console/", Handler::Console),
    route("GET", "/console/console.js", Handler::Console),
    route("GET", "/console/console.css", Handler::Console),
];

/// What a request's method and path come to.
#[derive(Debug, PartialEq, Eq)]
pub enum Resolved<'p> {
    /// The handler, and the key id of a `{key id}` path (else empty).
    Route(Handler, &'p str),
    /// The path is an endpoint, but not for this method: the methods it takes.
    WrongMethod(Vec<&'static str>),
    NotFound,
}

pub fn resolve<'p>(method: &Method, path: &'p str) -> Resolved<'p> {
    let mut allowed = Vec::new();
    for r in ROUTES {
        let Some(id) = matches(r.path, path) else {
            continue;
        };
        if method.as_str() == r.method {
            return Resolved::Route(r.handler, id);
        }
        if !allowed.contains(&r.method) {
            allowed.push(r.method);
        }
    }
    if allowed.is_empty() {
        Resolved::NotFound
    } else {
        Resolved::WrongMethod(allowed)
    }
}

/// `Some(key id)` (empty where the pattern has none) when `path` fits `pattern`.
fn matches<'p>(pattern: &str, path: &'p str) -> Option<&'p str> {
    let mut id = "";
    let mut given = path.split('/');
    for want in pattern.split('/') {
        let seg = given.next()?;
        if want == "{key id}" {
            if !crate::keys::record::valid_key_id(seg) {
                return None;
            }
            id = seg;
        } else if want != seg {
            return None;
        }
    }
    given.next().is_none().then_some(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(path: &str) -> Resolved<'_> {
        resolve(&Method::GET, path)
    }

    fn post(path: &str) -> Resolved<'_> {
        resolve(&Method::POST, path)
    }

    #[test]
    fn each_endpoint_resolves_to_its_handler_with_its_key_id() {
        assert_eq!(get("/healthz"), Resolved::Route(Handler::Healthz, ""));
        assert_eq!(get("/keys"), Resolved::Route(Handler::ListKeys, ""));
        assert_eq!(get("/usage/top"), Resolved::Route(Handler::UsageTop, ""));
        assert_eq!(post("/keys"), Resolved::Route(Handler::IssueKey, ""));
        assert_eq!(
            get("/keys/key_01"),
            Resolved::Route(Handler::ShowKey, "key_01")
        );
        assert_eq!(
            post("/keys/key_01/rotate"),
            Resolved::Route(Handler::RotateKey, "key_01")
        );
        assert_eq!(
            post("/bans/a-b/lift"),
            Resolved::Route(Handler::LiftBan, "a-b")
        );
    }

    #[test]
    fn another_method_is_405_naming_the_methods_and_anything_else_404() {
        assert_eq!(post("/healthz"), Resolved::WrongMethod(vec!["GET"]));
        assert_eq!(get("/reload"), Resolved::WrongMethod(vec!["POST"]));
        assert_eq!(
            resolve(&Method::DELETE, "/keys"),
            Resolved::WrongMethod(vec!["GET", "POST"])
        );
        assert_eq!(
            get("/keys/key_01/revoke"),
            Resolved::WrongMethod(vec!["POST"])
        );
        for path in [
            "/",
            "/bans/lift",
            "/keys/",
            "/keys/a{b}",
            "/keys/key_01/",
            "/keys/key_01/other",
            "/healthz/",
            "/nothing",
        ] {
            assert_eq!(get(path), Resolved::NotFound, "{path}");
            assert_eq!(post(path), Resolved::NotFound, "{path}");
        }
    }

    /// The book's admin table names exactly the endpoints of [`ROUTES`], as `METHOD path` in
    /// backticks, and nothing else.
    #[test]
    fn the_books_admin_table_lists_every_route_and_no_other() {
        let section = crate::config::repo_file("docs/src/operating/admin-api.md");
        let table: Vec<&str> = section
            .lines()
            .skip_while(|l| !l.starts_with("| request | answer |"))
            .skip(2)
            .take_while(|l| l.starts_with('|'))
            .collect();
        assert!(!table.is_empty(), "no admin table in the book");
        let mut named = Vec::new();
        for row in &table {
            let request = row.split('|').nth(1).unwrap_or_default();
            for part in request.split('`').skip(1).step_by(2) {
                named.push(part.to_owned());
            }
        }
        let mut routes: Vec<String> = ROUTES
            .iter()
            .map(|r| format!("{} {}", r.method, r.path))
            .collect();
        named.sort();
        routes.sort();
        assert_eq!(named, routes, "the book's admin table and ROUTES differ");
    }
}
