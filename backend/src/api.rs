//! The handlers: HTTP in, HTTP out. Each one turns a request into a call on the store and the
//! result into the interface's response, with every failure as an [`ApiError`].

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Body;
use serde::Serialize;

use crate::error::{ApiError, ErrorCode};
use crate::metrics::METRICS;
use crate::pet::NewPet;
use crate::query::{parse_pet_id, ListQuery};
use crate::routes::{resolve, Operation, Resolved, BASE_PATH};
use crate::store::{PetStore, StoreError};

/// Largest accepted request body: a NewPet is tiny, so anything near this is not one.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// When `GET /pets/{petId}` was deprecated (RFC 9745 `@`-date: 2026-01-01T00:00:00Z). The
/// interface marks it deprecated without a date; this is the date we announce.
pub const DEPRECATION: &str = "@1767225600";
/// Its removal from the interface (RFC 8594 `Sunset`): 2030-12-05T00:00:00Z, the interface's
/// date. From then on it answers 410 Gone.
pub const SUNSET_UNIX: u64 = 1_922_659_200;
pub const SUCCESSOR_LINK: &str = "</v1/pets>; rel=\"successor-version\"";

/// What the handlers are told besides the store.
#[derive(Debug, Clone)]
pub struct Settings {
    /// From this instant `GET /pets/{petId}` answers 410 Gone (`--get-pet-sunset`; tests move it).
    get_pet_sunset: SystemTime,
    /// Its `Sunset` header, formatted once.
    sunset_header: HeaderValue,
    /// The 410's message, naming the date and the successor.
    gone_message: String,
}

impl Settings {
    pub fn new(get_pet_sunset: SystemTime) -> Settings {
        let date = httpdate::fmt_http_date(get_pet_sunset);
        Settings {
            get_pet_sunset,
            sunset_header: HeaderValue::from_str(&date)
                .unwrap_or_else(|_| HeaderValue::from_static("Thu, 05 Dec 2030 00:00:00 GMT")),
            gone_message: format!(
                "GET /v1/pets/{{petId}} was removed on {date}; use its successor, GET /v1/pets \
                 (Link: rel=\"successor-version\")"
            ),
        }
    }

    /// Whether getPet is past its sunset at `now`.
    fn get_pet_gone(&self, now: SystemTime) -> bool {
        now >= self.get_pet_sunset
    }
}

impl Default for Settings {
    fn default() -> Settings {
        Settings::new(UNIX_EPOCH + Duration::from_secs(SUNSET_UNIX))
    }
}

pub type HttpResponse = Response<Full<Bytes>>;

pub async fn handle<B>(store: &PetStore, settings: &Settings, req: Request<B>) -> HttpResponse
where
    B: Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let started = std::time::Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let trace = trace_of(req.headers());
    let request_id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if path == "/metrics" && method == http::Method::GET {
        return metrics_response();
    }
    let (op, result) = match resolve(&method, &path) {
        Resolved::NotFound => (
            None,
            Err(ApiError::new(
                ErrorCode::NotFound,
                "no such resource; see openapi.yaml for the paths this API serves",
            )),
        ),
        Resolved::MethodNotAllowed(route) => {
            (None, Err(ApiError::method_not_allowed(&route.allowed())))
        }
        Resolved::Found(op, param) => {
            let param = param.map(str::to_owned);
            let result = if op == Operation::GetPet && settings.get_pet_gone(SystemTime::now()) {
                Err(ApiError::new(
                    ErrorCode::Gone,
                    settings.gone_message.clone(),
                ))
            } else {
                dispatch(store, op, param, req).await
            };
            (Some(op), result)
        }
    };
    let mut response = result.unwrap_or_else(ApiError::into_response);
    if op == Some(Operation::GetPet) {
        let gone = response.status() == StatusCode::GONE;
        let headers = response.headers_mut();
        headers.insert("deprecation", HeaderValue::from_static(DEPRECATION));
        headers.insert("sunset", settings.sunset_header.clone());
        if gone {
            // Gone until the sunset is moved (it can be): no cache may keep the 410.
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        }
        headers.append(header::LINK, HeaderValue::from_static(SUCCESSOR_LINK));
    }
    let route = op.map_or("other", Operation::id);
    let mut status = itoa::Buffer::new();
    METRICS
        .requests
        .with_label_values(&[route, status.format(response.status().as_u16())])
        .inc();
    METRICS
        .duration
        .with_label_values(&[route])
        .observe(started.elapsed().as_secs_f64());
    tracing::info!(
        target: "access",
        %method,
        %path,
        status = response.status().as_u16(),
        duration_us = started.elapsed().as_micros() as u64,
        request_id,
        trace_id = trace.as_ref().map(|t| t.0.as_str()),
        parent_span_id = trace.as_ref().map(|t| t.1.as_str()),
    );
    response
}

/// The trace id and the caller's span id of a valid W3C `traceparent` (the gateway always sends
/// one, naming its own span), for the access log; anything else is no trace.
fn trace_of(headers: &http::HeaderMap) -> Option<(String, String)> {
    let value = headers.get("traceparent")?.to_str().ok()?;
    let mut fields = value.trim().split('-');
    let (version, trace, parent) = (fields.next()?, fields.next()?, fields.next()?);
    let hex = |s: &str, len: usize| {
        s.len() == len
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            && s.bytes().any(|b| b != b'0')
    };
    (version.len() == 2 && version != "ff" && hex(trace, 32) && hex(parent, 16))
        .then(|| (trace.to_owned(), parent.to_owned()))
}

fn metrics_response() -> HttpResponse {
    let mut response = Response::new(Full::new(Bytes::from(crate::metrics::render())));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

async fn dispatch<B>(
    store: &PetStore,
    op: Operation,
    param: Option<String>,
    req: Request<B>,
) -> Result<HttpResponse, ApiError>
where
    B: Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    match op {
        Operation::ListPets => list_pets(store, req.uri().query()).await,
        Operation::CreatePet => create_pet(store, req).await,
        Operation::GetPet => get_pet(store, param.as_deref().unwrap_or_default()).await,
        Operation::ListOrders => Err(ApiError::new(
            ErrorCode::NotImplemented,
            "GET /store/orders is not defined by the interface yet",
        )),
    }
}

async fn list_pets(store: &PetStore, query: Option<&str>) -> Result<HttpResponse, ApiError> {
    let q = ListQuery::parse(query)?;
    let page = store.list(q.clone()).await.map_err(internal)?;
    let mut response = json(StatusCode::OK, &page.pets);
    if let (true, Some(last)) = (page.has_more, page.pets.last()) {
        let status = q
            .status
            .as_ref()
            .map(|s| format!("&status={}", s.as_str()))
            .unwrap_or_default();
        let link = format!(
            "<{BASE_PATH}/pets?limit={}&after={}{status}>; rel=\"next\"",
            q.limit, last.id
        );
        if let Ok(v) = HeaderValue::from_str(&link) {
            response.headers_mut().insert(header::LINK, v);
        }
    }
    Ok(response)
}

async fn create_pet<B>(store: &PetStore, req: Request<B>) -> Result<HttpResponse, ApiError>
where
    B: Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (parts, body) = req.into_parts();
    let too_large = || {
        ApiError::new(
            ErrorCode::PayloadTooLarge,
            format!("request body exceeds {MAX_BODY_BYTES} bytes"),
        )
    };
    // Refuse an announced oversize body before reading any of it.
    if body.size_hint().lower() > MAX_BODY_BYTES as u64 {
        return Err(too_large());
    }
    let bytes = match Limited::new(body, MAX_BODY_BYTES).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => return Err(too_large()),
        Err(e) => {
            return Err(ApiError::invalid_request(format!(
                "could not read the request body: {e}"
            )))
        }
    };
    if bytes.is_empty() {
        return Err(ApiError::invalid_request(
            "request body is required: a NewPet JSON object",
        ));
    }
    if !is_json(parts.headers.get(header::CONTENT_TYPE)) {
        return Err(ApiError::new(
            ErrorCode::UnsupportedMediaType,
            "Content-Type must be application/json",
        ));
    }
    let new_pet = NewPet::from_json(&bytes)?;
    let pet = store.create(new_pet).await.map_err(internal)?;
    let mut response = json(StatusCode::CREATED, &pet);
    if let Ok(location) = HeaderValue::from_str(&format!("{BASE_PATH}/pets/{}", pet.id)) {
        response.headers_mut().insert(header::LOCATION, location);
    }
    Ok(response)
}

async fn get_pet(store: &PetStore, raw_id: &str) -> Result<HttpResponse, ApiError> {
    let id = parse_pet_id(raw_id)?;
    match store.get(id).await.map_err(internal)? {
        Some(pet) => Ok(json(StatusCode::OK, &pet)),
        None => Err(ApiError::new(
            ErrorCode::NotFound,
            format!("no pet with id {id}"),
        )),
    }
}

/// `application/json`, in any letter case, with or without parameters such as `charset=utf-8`.
fn is_json(content_type: Option<&HeaderValue>) -> bool {
    content_type
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("application/json"))
}

fn json<T: Serialize>(status: StatusCode, value: &T) -> HttpResponse {
    match serde_json::to_vec(value) {
        Ok(body) => {
            let mut response = Response::new(Full::new(Bytes::from(body)));
            *response.status_mut() = status;
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            response
        }
        Err(e) => internal_message(format!("cannot encode the response: {e}")).into_response(),
    }
}

/// Store failures are logged in full but reported to the client without internals.
fn internal(e: StoreError) -> ApiError {
    METRICS.sqlite_errors.inc();
    tracing::error!(error = %e, "store error");
    internal_message("the pet store failed; try again")
}

fn internal_message(message: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::Internal, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_content_types() {
        let ok = [
            "application/json",
            "Application/JSON",
            "application/json; charset=utf-8",
        ];
        for v in ok {
            assert!(is_json(Some(&HeaderValue::from_static(v))), "{v}");
        }
        let bad = [
            "text/plain",
            "application/jsonx",
            "application/x-www-form-urlencoded",
            "",
        ];
        for v in bad {
            assert!(!is_json(Some(&HeaderValue::from_static(v))), "{v}");
        }
        assert!(!is_json(None));
    }
}
