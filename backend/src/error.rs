//! The one error shape of the interface: every failure leaves the backend as an `Error` JSON
//! object (`code`, `message`, `status`: `pet_api::ErrorBody`) with
//! `Content-Type: application/json`, so clients and the gateway never have to parse anything
//! else.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use pet_api::ErrorBody;

/// The machine-readable `code` values fixed by the design. Keeping them in one enum means a
/// typo cannot invent a new code that clients do not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    InvalidRequest,
    InvalidParameter,
    NotFound,
    /// 410: the operation existed and has been removed (getPet after its sunset).
    Gone,
    MethodNotAllowed,
    PayloadTooLarge,
    UnsupportedMediaType,
    NotImplemented,
    Internal,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 9] = [
        ErrorCode::InvalidRequest,
        ErrorCode::InvalidParameter,
        ErrorCode::NotFound,
        ErrorCode::Gone,
        ErrorCode::MethodNotAllowed,
        ErrorCode::PayloadTooLarge,
        ErrorCode::UnsupportedMediaType,
        ErrorCode::NotImplemented,
        ErrorCode::Internal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::InvalidParameter => "invalid_parameter",
            ErrorCode::NotFound => "not_found",
            ErrorCode::Gone => "gone",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::UnsupportedMediaType => "unsupported_media_type",
            ErrorCode::NotImplemented => "not_implemented",
            ErrorCode::Internal => "internal",
        }
    }

    fn status(self) -> StatusCode {
        match self {
            ErrorCode::InvalidRequest | ErrorCode::InvalidParameter => StatusCode::BAD_REQUEST,
            ErrorCode::NotFound => StatusCode::NOT_FOUND,
            ErrorCode::Gone => StatusCode::GONE,
            ErrorCode::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorCode::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorCode::NotImplemented => StatusCode::NOT_IMPLEMENTED,
            ErrorCode::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

/// An error on its way to the client. The status is derived from the code so the two can never
/// disagree.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{} ({}): {message}", code.as_str(), code.status())]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
    /// The `Allow` header of a 405, listing what the path does accept.
    pub allow: Option<String>,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
            allow: None,
        }
    }

    pub fn invalid_request(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidRequest, message)
    }

    pub fn invalid_parameter(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidParameter, message)
    }

    pub fn method_not_allowed(allow: &[&str]) -> Self {
        let allow = allow.join(", ");
        ApiError {
            code: ErrorCode::MethodNotAllowed,
            message: format!("method not allowed here; allowed: {allow}"),
            allow: Some(allow),
        }
    }

    pub fn status(&self) -> StatusCode {
        self.code.status()
    }

    pub fn into_response(self) -> Response<Full<Bytes>> {
        let status = self.status();
        let body = serde_json::to_vec(&ErrorBody {
            code: self.code.as_str().to_owned(),
            message: self.message,
            status: status.as_u16(),
        })
        .unwrap_or_else(|_| br#"{"code":"internal","message":"error","status":500}"#.to_vec());
        let mut response = Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(allow) = self.allow.and_then(|a| HeaderValue::from_str(&a).ok()) {
            headers.insert(header::ALLOW, allow);
        }
        response
    }
}
