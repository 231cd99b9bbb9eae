//! What the gateway reads from a request before any decision about its key: whether its shape
//! is acceptable at all, and the request id it will be known by in logs and at the backend.

use std::cell::Cell;

use pingora::http::RequestHeader;

/// Largest total of request header names and values accepted, and most headers.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
pub const MAX_HEADERS: usize = 100;

/// Requests refused for their shape before anything else looks at them: oversized headers, and
/// a body framed two ways (`Content-Length` with `Transfer-Encoding`), the classic request
/// smuggling vector, which is refused outright rather than resolved.
pub fn refuse_shape(req: &RequestHeader) -> Option<(u16, &'static str)> {
    let headers = &req.headers;
    if headers.len() > MAX_HEADERS {
        return Some((431, "too many request headers"));
    }
    let bytes: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    if bytes > MAX_HEADER_BYTES {
        return Some((431, "request headers exceed 64 KiB"));
    }
    if headers.contains_key("content-length") && headers.contains_key("transfer-encoding") {
        return Some((
            400,
            "Content-Length and Transfer-Encoding together are not accepted",
        ));
    }
    None
}

/// Why a request's path is refused: it is not in the one form the gateway decides the route and
/// the cost on. The path goes to the backend exactly as it came, so any spelling a backend
/// might normalise into another operation (`/v1//pets`, `/v1/./pets`, `/v1/x/../pets`,
/// `/v1/%2e%2e/v1/pets`, `/v1/pets;x`, `/v1/%70ets`) would be served as that operation at the
/// cost of whatever the gateway took it for. Refused rather than normalised: nothing the
/// interface serves is spelled that way, and a refusal leaves no second reading to disagree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathFault {
    /// Not an absolute path (`*`, or no leading `/`).
    NotAbsolute,
    /// `//`, or a `/` at the end (the root `/` itself aside).
    EmptySegment,
    /// A segment that is `.` or `..`, literal or percent-encoded in any case.
    DotSegment,
    /// `%2F` or `%5C`: a separator a backend may decode and split on.
    EncodedSeparator,
    /// `\`, which some servers take for `/`.
    Backslash,
    /// `;`, which servlet containers strip (with what follows) before routing.
    Semicolon,
    /// A control byte (NUL included), literal or percent-encoded.
    Control,
    /// A byte that must be percent-encoded (space, `"`, `<`, `{`, non-ASCII...).
    Unencoded,
    /// An unreserved character percent-encoded (`%70` for `p`, `%2e` in a name): normalisers
    /// decode these (RFC 3986, section 6.2.2.2).
    EncodedUnreserved,
    /// `%` not followed by two hex digits.
    BadPercent,
    /// `%25`: a backend or proxy that decodes twice reads `%252e` as `.`, `%252f` as `/`.
    EncodedPercent,
    /// Percent-encoded bytes that are not UTF-8 in its shortest form: a lax decoder reads the
    /// overlong `%C0%AE` as `.` and `%C0%AF` as `/`.
    BadUtf8,
    /// A percent-encoded character that Unicode's compatibility normalisation (NFKC) turns into
    /// `.`, `/`, `\`, `%` or `;` (`%EF%BC%8E`, the fullwidth full stop, into `.`): a backend that
    /// normalises would read another path.
    Confusable,
}

impl PathFault {
    /// The Error body's message: what is wrong, so a client can fix its request.
    pub fn message(self) -> &'static str {
        match self {
            PathFault::NotAbsolute => "the request path must start with /",
            PathFault::EmptySegment => "the request path has an empty segment (// or a trailing /)",
            PathFault::DotSegment => "the request path has a . or .. segment",
            PathFault::EncodedSeparator => "the request path has an encoded / or \\ (%2F, %5C)",
            PathFault::Backslash => "the request path has a \\",
            PathFault::Semicolon => "the request path has a ; (path parameters are not accepted)",
            PathFault::Control => "the request path has a control byte",
            PathFault::Unencoded => "the request path has a byte that must be percent-encoded",
            PathFault::EncodedUnreserved => {
                "the request path percent-encodes a character that needs none (letters, digits, - . _ ~)"
            }
            PathFault::BadPercent => "the request path has a % not followed by two hex digits",
            PathFault::EncodedPercent => "the request path has an encoded % (%25)",
            PathFault::BadUtf8 => {
                "the request path percent-encodes bytes that are not UTF-8 in its shortest form"
            }
            PathFault::Confusable => {
                "the request path percent-encodes a character that normalises to . / \\ % or ;"
            }
        }
    }
}

/// What a request path's bytes are, for [`path_fault`]: one table look-up a byte.
#[derive(Clone, Copy, PartialEq, Eq)]
enum PathByte {
    /// RFC 3986's unreserved: letters, digits, `-`, `.`, `_`, `~`.
    Unreserved,
    /// The other bytes a segment may hold as they are: sub-delims but `;`, `:` and `@`.
    Allowed,
    Refused(PathFault),
}

const PATH_BYTES: [PathByte; 256] = {
    let mut table = [PathByte::Refused(PathFault::Unencoded); 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = match c {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                PathByte::Unreserved
            }
            b'!' | b'$' | b'&' | b'\'' | b'(' | b')' | b'*' | b'+' | b',' | b'=' | b':' | b'@' => {
                PathByte::Allowed
            }
            b'\\' => PathByte::Refused(PathFault::Backslash),
            b';' => PathByte::Refused(PathFault::Semicolon),
            0..=0x1f | 0x7f => PathByte::Refused(PathFault::Control),
            _ => PathByte::Refused(PathFault::Unencoded),
        };
        b += 1;
    }
    table
};

/// Whether the request target as it came (`raw`, what is sent on) is one whose path the
/// parsed URI holds: origin-form (`/…`) or absolute-form (`http://host/…`). Any other target
/// (`v1/pets`, `x:/v1//pets`, `?a`) is parsed as `/` and would be routed and priced as that
/// while the backend reads it otherwise.
pub fn target_fault(raw: &[u8]) -> Option<PathFault> {
    let absolute = |scheme: &[u8]| {
        raw.len() > scheme.len() && raw[..scheme.len()].eq_ignore_ascii_case(scheme)
    };
    if raw.first() == Some(&b'/') || absolute(b"http://") || absolute(b"https://") {
        None
    } else {
        Some(PathFault::NotAbsolute)
    }
}

/// Whether `path` (the request's, without its query) is in the one form the gateway routes,
/// prices and forwards; what is wrong with it otherwise. A single pass over its bytes, without
/// allocating: it runs on every request. The query is not looked at: it is no path, and a
/// backend does not route on it.
pub fn path_fault(path: &[u8]) -> Option<PathFault> {
    match path {
        [b'/'] => None,
        [b'/', rest @ ..] => rest.split(|&b| b == b'/').find_map(segment_fault),
        _ => Some(PathFault::NotAbsolute),
    }
}

/// What is wrong with one segment of a path (between two `/`), if anything.
fn segment_fault(segment: &[u8]) -> Option<PathFault> {
    segment_check(segment).err()
}

fn segment_check(segment: &[u8]) -> Result<(), PathFault> {
    let (mut units, mut dots, mut encoded_dot) = (0usize, 0usize, false);
    let mut utf8 = Utf8::default();
    let mut rest = segment;
    while let [b, tail @ ..] = rest {
        let unit = if *b == b'%' {
            let [hi, lo, after @ ..] = tail else {
                return Err(PathFault::BadPercent);
            };
            let (Some(hi), Some(lo)) = (hex_value(*hi), hex_value(*lo)) else {
                return Err(PathFault::BadPercent);
            };
            rest = after;
            let byte = hi << 4 | lo;
            if byte >= 0x80 {
                utf8.push(byte)?;
                continue;
            }
            match (byte, PATH_BYTES[usize::from(byte)]) {
                (b'/' | b'\\', _) => return Err(PathFault::EncodedSeparator),
                (b'%', _) => return Err(PathFault::EncodedPercent),
                (b';', _) => return Err(PathFault::Semicolon),
                (_, PathByte::Refused(PathFault::Control)) => return Err(PathFault::Control),
                (b'.', _) => encoded_dot = true,
                (_, PathByte::Unreserved) => return Err(PathFault::EncodedUnreserved),
                _ => {}
            }
            byte
        } else {
            if let PathByte::Refused(fault) = PATH_BYTES[usize::from(*b)] {
                return Err(fault);
            }
            rest = tail;
            *b
        };
        utf8.ended()?;
        units += 1;
        dots += usize::from(unit == b'.');
    }
    utf8.ended()?;
    match (units + utf8.chars, dots) {
        (0, _) => Err(PathFault::EmptySegment),
        (1, 1) | (2, 2) => Err(PathFault::DotSegment),
        _ if encoded_dot => Err(PathFault::EncodedUnreserved),
        _ => Ok(()),
    }
}

/// The characters NFKC turns into a byte the scanner refuses or treats apart (`.`, `/`, `\\`,
/// `%`, `;`): fullwidth and small forms, and the dot leaders.
const CONFUSABLE: [char; 12] = [
    '\u{FF0E}', '\u{FF0F}', '\u{FF3C}', '\u{FF05}', '\u{FF1B}', '\u{FE52}', '\u{FE68}', '\u{FE6A}',
    '\u{FE54}', '\u{2024}', '\u{2025}', '\u{2026}',
];

/// The percent-encoded bytes of a segment at or above 0x80, checked as UTF-8 a character at a
/// time (on the stack: no allocation on the request path).
#[derive(Default)]
struct Utf8 {
    pending: [u8; 4],
    have: usize,
    need: usize,
    chars: usize,
}

impl Utf8 {
    /// Takes the next encoded byte; the fault when no shortest-form character can start or go
    /// on with it.
    fn push(&mut self, byte: u8) -> Result<(), PathFault> {
        if self.have == 0 {
            self.need = match byte {
                0xc2..=0xdf => 2,
                0xe0..=0xef => 3,
                0xf0..=0xf4 => 4,
                _ => return Err(PathFault::BadUtf8),
            };
        }
        self.pending[self.have] = byte;
        self.have += 1;
        if self.have == self.need {
            // The standard library's check refuses overlong forms and surrogates.
            let text =
                std::str::from_utf8(&self.pending[..self.need]).map_err(|_| PathFault::BadUtf8)?;
            match text.chars().next() {
                Some(c) if c.is_control() => return Err(PathFault::Control),
                Some(c) if CONFUSABLE.contains(&c) => return Err(PathFault::Confusable),
                _ => {}
            }
            self.have = 0;
            self.chars += 1;
        }
        Ok(())
    }

    /// Something else comes (or the segment ends): a character begun must have ended.
    fn ended(&self) -> Result<(), PathFault> {
        if self.have == 0 {
            Ok(())
        } else {
            Err(PathFault::BadUtf8)
        }
    }
}

/// A hex digit's value, in either case.
fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Keeps a client's `X-Request-Id` when it is sane (short, visible ASCII), else makes one.
pub fn request_id(req: &RequestHeader) -> String {
    if let Some(v) = req.headers.get("x-request-id") {
        let b = v.as_bytes();
        if !b.is_empty() && b.len() <= 128 && b.iter().all(|c| c.is_ascii_graphic()) {
            if let Ok(s) = v.to_str() {
                return s.to_owned();
            }
        }
    }
    fresh_id()
}

thread_local! {
    /// Each thread's request-id generator (wyrand), seeded once from the OS's randomness.
    static ID_STATE: Cell<u64> = Cell::new(rand::random());
}

/// 32 hex digits for a request that brought no id: two outputs of the thread's generator, so
/// 64 bits of state behind them. Unique with high probability (each thread seeded at random;
/// two ids meet only if two threads' sequences overlap), predictable by whoever sees a few
/// (wyrand is no cryptographic generator): an id is echoed to the client and written to logs,
/// and must never be a secret, an idempotency key or anything trusted (a client may send any
/// id of its own anyway). The thread's ChaCha generator and `hex::encode` cost some 1,400
/// instructions a request; this, a few hundred.
fn fresh_id() -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    ID_STATE.with(|state| {
        let mut id = String::with_capacity(32);
        for _ in 0..2 {
            let s = state.get().wrapping_add(0xa076_1d64_78bd_642f);
            state.set(s);
            let t = u128::from(s) * u128::from(s ^ 0xe703_7ed1_a0b4_28db);
            let word = (t >> 64) as u64 ^ t as u64;
            for byte in word.to_be_bytes() {
                id.push(char::from(HEX[usize::from(byte >> 4)]));
                id.push(char::from(HEX[usize::from(byte & 15)]));
            }
        }
        id
    })
}

/// Largest request body the interface accepts (the backend enforces it too, with 413).
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// Why a request body was not read whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyRefusal {
    /// The client stalled for longer than the read timeout.
    Stalled,
    /// More than [`MAX_BODY_BYTES`].
    TooLarge,
}

/// Reads a request body whole before it is forwarded, each read under `timeout` and the whole
/// of it under [`BODY_READS`] times that; returns whether this answered `100 Continue` itself.
///
/// Read here, into pingora's retry buffer (64 KiB, the interface's body limit), the body is
/// sent on from that buffer once the backend connection is up, so a client that uploads slowly
/// (or stalls) holds no place at the backend and no backend connection while it does: only its
/// own key's concurrency. It also puts a read timeout on HTTP/2 bodies, which pingora applies
/// none to (`set_read_timeout` is a no-op there). An HTTP/1.1 client that waits for `100
/// Continue` before sending gets it from here (the backend, reached later, is not asked again),
/// unless its declared length is too large already: then 413 without reading a byte. The
/// deadline on the whole body stops a client that trickles a byte just inside each read's
/// timeout from holding its key's concurrency for hours.
pub async fn read_body(
    session: &mut pingora::proxy::Session,
    timeout: std::time::Duration,
) -> pingora::Result<Result<bool, BodyRefusal>> {
    if session.is_body_done() {
        return Ok(Ok(false));
    }
    if declared_length(session.req_header()).is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return Ok(Err(BodyRefusal::TooLarge));
    }
    let continued = session.as_http2().is_none() && expects_continue(session.req_header());
    if continued {
        session.as_mut().write_continue_response().await?;
    }
    session.enable_retry_buffering();
    let deadline = tokio::time::Instant::now() + timeout * BODY_READS;
    let mut total = 0usize;
    loop {
        let read = tokio::time::timeout(timeout, session.read_request_body());
        match tokio::time::timeout_at(deadline, read).await {
            Err(_) | Ok(Err(_)) => return Ok(Err(BodyRefusal::Stalled)),
            // The session's own read timeout (the same length, set on the session) can fire
            // before ours: the same stall. Any other failure is the client's (it went away),
            // and is said to be, or it would be answered as the gateway's own 500.
            Ok(Ok(Err(e))) if *e.etype() == pingora::ErrorType::ReadTimedout => {
                return Ok(Err(BodyRefusal::Stalled))
            }
            Ok(Ok(chunk)) => match chunk.map_err(|e| e.into_down())? {
                None => return Ok(Ok(continued)),
                Some(bytes) => {
                    total += bytes.len();
                    if total > MAX_BODY_BYTES {
                        return Ok(Err(BodyRefusal::TooLarge));
                    }
                }
            },
        }
    }
}

/// The whole body must arrive within this many times `client_read_timeout_ms` (40 s by
/// default: 64 KiB at 1.6 KiB a second).
pub const BODY_READS: u32 = 4;

/// Whether the request asks for `100 Continue` before it sends its body (HTTP/1.1 only: an
/// HTTP/1.0 client knows no interim response).
fn expects_continue(req: &pingora::http::RequestHeader) -> bool {
    req.version == http::Version::HTTP_11
        && req
            .headers
            .get_all(http::header::EXPECT)
            .iter()
            .any(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

/// The body's length as the request declares it (`Content-Length`), when it does.
fn declared_length(req: &pingora::http::RequestHeader) -> Option<u64> {
    req.headers
        .get(http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn double_encoding_and_bytes_that_are_not_shortest_form_utf8_are_refused() {
        for (path, fault) in [
            (&b"/v1/%252e%252e/v1/pets"[..], PathFault::EncodedPercent),
            (b"/v1/pets%252f42", PathFault::EncodedPercent),
            (b"/v1/pets%3Bx=1", PathFault::Semicolon),
            (b"/v1/%C0%AE%C0%AE/v1/pets", PathFault::BadUtf8),
            (b"/v1/pets%C0%AF42", PathFault::BadUtf8),
            (b"/v1/%E0%80%AE/pets", PathFault::BadUtf8),
            (b"/v1/%ED%A0%80", PathFault::BadUtf8),
            (b"/v1/%C3", PathFault::BadUtf8),
            (b"/v1/%C3x%A9", PathFault::BadUtf8),
            (b"/v1/%A9", PathFault::BadUtf8),
            (b"/v1/%F5%80%80%80", PathFault::BadUtf8),
        ] {
            assert_eq!(
                path_fault(path),
                Some(fault),
                "{}",
                String::from_utf8_lossy(path)
            );
        }
        for path in [
            &b"/v1/caf%C3%A9"[..],
            b"/v1/%E2%82%AC",
            b"/v1/%F0%9F%90%95",
            b"/v1/%C3%A9",
        ] {
            assert_eq!(path_fault(path), None, "{}", String::from_utf8_lossy(path));
        }
    }

    #[test]
    fn fresh_ids_are_128_bits_of_hex_and_never_repeat() {
        let mine: Vec<String> = (0..100_000).map(|_| fresh_id()).collect();
        let theirs: Vec<String> = std::thread::spawn(|| (0..100_000).map(|_| fresh_id()).collect())
            .join()
            .expect("a thread of its own");
        let mut seen = HashSet::new();
        for id in mine.iter().chain(&theirs) {
            assert_eq!(id.len(), 32, "{id}");
            assert!(id
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
            assert!(seen.insert(id.as_str()), "{id} twice");
        }
    }

    /// A session whose client sent `sent` and then nothing more, with the session's own read
    /// timeout at `session_timeout`; the client's end comes back to keep it open (or drop it).
    async fn session_after(
        sent: &'static [u8],
        session_timeout: std::time::Duration,
    ) -> (pingora::proxy::Session, tokio::io::DuplexStream) {
        use tokio::io::AsyncWriteExt;
        let (mut client, server) = tokio::io::duplex(4096);
        client.write_all(sent).await.expect("written");
        let mut session = pingora::proxy::Session::new_h1(Box::new(server));
        assert!(session.read_request().await.expect("a head"));
        session.set_read_timeout(Some(session_timeout));
        (session, client)
    }

    const HALF_A_BODY: &[u8] =
        b"POST /v1/pets HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{\"name\":";

    #[tokio::test]
    async fn a_stall_is_408_whichever_read_timeout_fires_first() {
        use std::time::Duration;
        for (session_timeout, ours) in [(50, 2_000), (2_000, 50)] {
            let (mut session, _client) =
                session_after(HALF_A_BODY, Duration::from_millis(session_timeout)).await;
            let got = read_body(&mut session, Duration::from_millis(ours)).await;
            assert!(
                matches!(got, Ok(Err(BodyRefusal::Stalled))),
                "session {session_timeout} ms, ours {ours} ms: {got:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_client_gone_mid_body_is_the_clients_failure_not_the_gateways() {
        let (mut session, client) =
            session_after(HALF_A_BODY, std::time::Duration::from_secs(2)).await;
        drop(client);
        let got = read_body(&mut session, std::time::Duration::from_secs(2)).await;
        let e = got.expect_err("the body cannot be read");
        assert_eq!(*e.esource(), pingora::ErrorSource::Downstream, "{e}");
    }

    #[test]
    fn canonical_paths_pass() {
        for path in [
            "/",
            "/v1/pets",
            "/v1/pets/42",
            "/v1/store/orders",
            "/v1/rate_limit",
            "/v1/pets/a.b",
            "/v1/pets/...",
            "/v1/pets/.x",
            "/v1/pets/x..",
            "/v1/pets/%20",
            "/v1/pets/%C3%A9",
            "/v1/pets/%c3%a9",
            "/v1/pets/a~b-c_d!$&'()*+,=:@",
        ] {
            assert_eq!(path_fault(path.as_bytes()), None, "{path}");
        }
    }

    #[test]
    fn each_spelling_a_backend_might_normalise_is_refused_with_its_reason() {
        use PathFault::*;
        let cases: &[(&[u8], PathFault)] = &[
            (b"", NotAbsolute),
            (b"*", NotAbsolute),
            (b"v1/pets", NotAbsolute),
            (b"//v1/pets", EmptySegment),
            (b"/v1//pets", EmptySegment),
            (b"/v1/pets/", EmptySegment),
            (b"/v1/", EmptySegment),
            (b"/v1/./pets", DotSegment),
            (b"/v1/x/../pets", DotSegment),
            (b"/v1/pets/.", DotSegment),
            (b"/v1/pets/..", DotSegment),
            (b"/..", DotSegment),
            (b"/v1/%2e%2e/v1/pets", DotSegment),
            (b"/v1/%2E%2E/v1/pets", DotSegment),
            (b"/v1/.%2e/v1/pets", DotSegment),
            (b"/v1/%2E./v1/pets", DotSegment),
            (b"/v1/%2e/pets", DotSegment),
            (b"/v1/pets/%2ejson", EncodedUnreserved),
            (b"/v1/%70ets", EncodedUnreserved),
            (b"/v1/pets/%34%32", EncodedUnreserved),
            (b"/v1/pets/%7e", EncodedUnreserved),
            (b"/v1%2fpets", EncodedSeparator),
            (b"/v1%2Fpets", EncodedSeparator),
            (b"/v1/pets%5c42", EncodedSeparator),
            (b"/v1/pets%5C42", EncodedSeparator),
            (b"/v1\\pets", Backslash),
            (b"/v1/pets;x=1", Semicolon),
            (b"/v1/x/..;/pets", Semicolon),
            (b"/v1/pets\0", Control),
            (b"/v1/pets\t", Control),
            (b"/v1/pets\x7f", Control),
            (b"/v1/pets%00", Control),
            (b"/v1/pets%0a", Control),
            (b"/v1/pets%7F", Control),
            (b"/v1/pets/\xc3\xa9", Unencoded),
            (b"/v1/pets/a b", Unencoded),
            (b"/v1/pets/{id}", Unencoded),
            (b"/v1/pets/%", BadPercent),
            (b"/v1/pets/%4", BadPercent),
            (b"/v1/pets/%g0", BadPercent),
            (b"/v1/pets/%0g", BadPercent),
            (b"/v1/%%2e", BadPercent),
            (b"/v1/pets/%25", EncodedPercent),
            (b"/v1/pets/%252e%252e", EncodedPercent),
            (b"/v1/pets/%3B", Semicolon),
            (b"/v1/pets/%3bx", Semicolon),
            (b"/v1/pets/%C0%AE", BadUtf8),
            (b"/v1/pets/%80", BadUtf8),
            (b"/v1/pets/%C2%85", Control),
            (b"/v1/pets/%C2%9F", Control),
            (b"/v1/%EF%BC%8E%EF%BC%8E/v1/pets", Confusable),
            (b"/v1/pets%EF%BC%8F42", Confusable),
            (b"/v1/pets/%E2%80%A5", Confusable),
        ];
        for (path, want) in cases {
            let shown = String::from_utf8_lossy(path);
            assert_eq!(path_fault(path), Some(*want), "{shown}");
            assert!(!want.message().is_empty());
        }
    }

    /// The fault in the first segment that has one is the one named, and nothing after the
    /// path (a query is never handed in) changes it.
    #[test]
    fn a_target_not_in_origin_or_absolute_form_is_refused() {
        for raw in [
            &b"/v1/pets"[..],
            b"/",
            b"http://h/v1/pets",
            b"HTTPS://h/v1/pets?x",
        ] {
            assert_eq!(target_fault(raw), None, "{}", String::from_utf8_lossy(raw));
        }
        for raw in [
            &b"v1/pets"[..],
            b"x:/v1//pets",
            b"?a",
            b"*",
            b"",
            b"http:/v1",
        ] {
            assert_eq!(target_fault(raw), Some(PathFault::NotAbsolute), "{raw:?}");
        }
    }

    #[test]
    fn the_first_fault_is_named() {
        assert_eq!(path_fault(b"/v1//./pets"), Some(PathFault::EmptySegment));
        assert_eq!(path_fault(b"/./v1//pets"), Some(PathFault::DotSegment));
    }

    #[test]
    fn a_sane_client_id_is_kept_and_another_replaced() {
        let mut req = RequestHeader::build("GET", b"/v1/pets", None).unwrap();
        req.insert_header("x-request-id", "client-7").unwrap();
        assert_eq!(request_id(&req), "client-7");
        req.insert_header("x-request-id", "has space").unwrap();
        assert_eq!(request_id(&req).len(), 32);
    }
}
