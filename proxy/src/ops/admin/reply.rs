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
