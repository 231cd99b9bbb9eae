//! How the admin listener answers: JSON bodies, Error bodies, and reading a JSON request body.

use http::Response;
use pingora::protocols::http::ServerSession;

use crate::http::responses::{error_body, ErrorCode};

pub fn json_response(status: u16, body: Vec<u8>) -> Response<Vec<u8>> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("content-length", body.len())
        .header("cache-control", "no-store")
        .header("x-content-type-options", "nosniff")
        .body(body)
        .unwrap_or_default()
}

pub fn error(status: u16, code: ErrorCode, message: &str) -> Response<Vec<u8>> {
    json_response(status, error_body(status, code, message).to_vec())
}

/// 415 for a change whose body is not declared JSON: a request other than `GET`, `HEAD` or
/// `OPTIONS` with a `Content-Type` other than `application/json` (parameters such as
/// `; charset=utf-8` allowed), or with a body but no `Content-Type`. An HTML form, or a page's
/// `fetch` without a preflight, can only send `application/x-www-form-urlencoded`,
/// `multipart/form-data` or `text/plain`: so a change from a web page is refused by what it is,
/// not only by the `Origin` and `Sec-Fetch-Site` it carries ([`super::guard`]). A bodiless
/// `POST` with no `Content-Type` (`curl -X POST`, the `keys` and `bans` commands of earlier
/// versions) still passes: it carries nothing to misread, and a browser's carries `Origin`.
pub fn refuse_media_type(req: &http::request::Parts) -> Option<Response<Vec<u8>>> {
    use http::Method;
    if matches!(req.method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return None;
    }
    let header = |name: http::header::HeaderName| req.headers.get(name);
    let json = match header(http::header::CONTENT_TYPE) {
        Some(value) => value.to_str().ok().is_some_and(|v| {
            v.split(';')
                .next()
                .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
        }),
        None => {
            let chunked = header(http::header::TRANSFER_ENCODING).is_some();
            let length = header(http::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .map(str::trim);
            !chunked && length.is_none_or(|l| l == "0")
        }
    };
    (!json).then(|| {
        error(
            415,
            ErrorCode::UnsupportedMediaType,
            "admin changes take JSON: send Content-Type: application/json",
        )
    })
}

/// Largest admin request body: a key's settings are a few fields.
const MAX_ADMIN_BODY: usize = 16 * 1024;

/// Reads the request body as a JSON object; an empty body is `{}`.
pub async fn json_body(
    session: &mut ServerSession,
) -> Result<serde_json::Value, Response<Vec<u8>>> {
    let bad = |m: &str| error(400, ErrorCode::InvalidRequest, m);
    let mut body = Vec::new();
    loop {
        match session.read_request_body().await {
            Ok(Some(chunk)) => {
                body.extend_from_slice(&chunk);
                if body.len() > MAX_ADMIN_BODY {
                    return Err(error(413, ErrorCode::PayloadTooLarge, "body over 16 KiB"));
                }
            }
            Ok(None) => break,
            Err(_) => return Err(bad("the request body could not be read")),
        }
    }
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(serde_json::json!({}));
    }
    match serde_json::from_slice::<serde_json::Value>(&body) {
        Ok(v) if v.is_object() => Ok(v),
        _ => Err(bad("the body must be a JSON object")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(method: &str, headers: &[(&str, &str)]) -> http::request::Parts {
        let mut b = http::Request::builder().method(method).uri("/keys");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn only_json_changes_pass() {
        let refused = |method: &str, headers: &[(&str, &str)]| {
            refuse_media_type(&parts(method, headers)).map(|r| r.status().as_u16())
        };
        for ok in [
            vec![("content-type", "application/json")],
            vec![("content-type", "Application/JSON; charset=utf-8")],
            vec![("content-length", "0")],
            vec![],
        ] {
            assert_eq!(refused("POST", &ok), None, "{ok:?}");
        }
        for bad in [
            vec![("content-type", "application/x-www-form-urlencoded")],
            vec![("content-type", "multipart/form-data; boundary=x")],
            vec![("content-type", "text/plain")],
            vec![("content-type", "application/jsonp")],
            vec![("content-type", "")],
            vec![("content-length", "12")],
            vec![("transfer-encoding", "chunked")],
        ] {
            assert_eq!(refused("POST", &bad), Some(415), "{bad:?}");
            assert_eq!(refused("DELETE", &bad), Some(415), "{bad:?}");
        }
        let form = [("content-type", "text/plain")];
        assert_eq!(refused("GET", &form), None, "reads are not changes");
    }
}
