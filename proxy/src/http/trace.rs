//! W3C Trace Context (`traceparent`): the gateway joins a trace the client started, or starts
//! one, and is a span of it. The backend gets a `traceparent` naming the gateway's span as its
//! parent, so a tracing system puts the backend's work under the gateway's, and both access logs
//! carry the trace id. `tracestate` is forwarded untouched, as the specification asks of a
//! participant that adds nothing to it.

/// One request's place in a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    /// The caller's span, when the request came with a valid `traceparent`.
    pub parent_id: Option<[u8; 8]>,
    /// This gateway's span for the request.
    pub span_id: [u8; 8],
    pub flags: u8,
}

impl TraceContext {
    /// Joins the trace of a valid `traceparent`, or starts a new one (absent or invalid: the
    /// specification says to start afresh rather than to repair).
    pub fn from_header(traceparent: Option<&[u8]>) -> TraceContext {
        let span_id = nonzero(rand::random());
        match traceparent.and_then(parse) {
            Some((trace_id, parent_id, flags)) => TraceContext {
                trace_id,
                parent_id: Some(parent_id),
                span_id,
                // Only `sampled` is defined; other bits are not passed on from the edge.
                flags: flags & 0x01,
            },
            None => TraceContext {
                trace_id: nonzero(rand::random()),
                parent_id: None,
                span_id,
                // Not sampled: the gateway records its span in its access log only.
                flags: 0,
            },
        }
    }

    /// The `traceparent` the backend gets: this trace, with the gateway's span as the parent.
    pub fn traceparent(&self) -> String {
        self.traceparent_under(self.span_id)
    }

    /// The same with `span_id` (an upstream attempt's span, when the request is sampled) as
    /// the backend's parent.
    pub fn traceparent_under(&self, span_id: [u8; 8]) -> String {
        let mut s = String::with_capacity(55);
        s.push_str("00-");
        hex_into(&mut s, &self.trace_id);
        s.push('-');
        hex_into(&mut s, &span_id);
        s.push('-');
        hex_into(&mut s, &[self.flags]);
        s
    }

    pub fn trace_id_hex(&self) -> String {
        hex::encode(self.trace_id)
    }

    pub fn span_id_hex(&self) -> String {
        hex::encode(self.span_id)
    }

    pub fn parent_id_hex(&self) -> Option<String> {
        self.parent_id.map(hex::encode)
    }
}

/// A fresh span id.
pub fn new_span_id() -> [u8; 8] {
    nonzero(rand::random())
}

/// Ids may not be all zeros; a random one is, once in 2^64 or 2^128 draws.
fn nonzero<const N: usize>(mut id: [u8; N]) -> [u8; N] {
    if id.iter().all(|b| *b == 0) {
        id[N - 1] = 1;
    }
    id
}

/// Lowercase hex by table: through `write!` a byte at a time, the `traceparent` of every
/// forwarded request cost about 6,000 instructions (bench/instructions.py).
fn hex_into(s: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        s.push(char::from(HEX[usize::from(b >> 4)]));
        s.push(char::from(HEX[usize::from(b & 15)]));
    }
}

/// `version-traceid-parentid-flags`, lowercase hex. Version 00 is exactly these four fields;
/// a later version may append fields after a `-`, which are ignored (the specification's rule
/// for versions this code does not know); version ff is invalid.
fn parse(value: &[u8]) -> Option<([u8; 16], [u8; 8], u8)> {
    let value = std::str::from_utf8(value).ok()?.trim_matches([' ', '\t']);
    let head = value.get(..55)?;
    let rest = &value[55..];
    let version = lower_hex::<1>(head.get(0..2)?)?[0];
    if version == 0xff
        || (version == 0 && !rest.is_empty())
        || (!rest.is_empty() && !rest.starts_with('-'))
    {
        return None;
    }
    let bytes = head.as_bytes();
    if bytes[2] != b'-' || bytes[35] != b'-' || bytes[52] != b'-' {
        return None;
    }
    let trace_id = lower_hex::<16>(&head[3..35])?;
    let parent_id = lower_hex::<8>(&head[36..52])?;
    let flags = lower_hex::<1>(&head[53..55])?[0];
    if trace_id == [0; 16] || parent_id == [0; 8] {
        return None;
    }
    Some((trace_id, parent_id, flags))
}

/// Exactly `2 * N` lowercase hex digits (the specification forbids uppercase).
fn lower_hex<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != 2 * N
        || !text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return None;
    }
    let mut out = [0u8; N];
    hex::decode_to_slice(text, &mut out).ok()?;
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_is_joined_with_the_gateway_as_the_new_parent() {
        let t = TraceContext::from_header(Some(VALID.as_bytes()));
        assert_eq!(t.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(t.parent_id_hex().as_deref(), Some("00f067aa0ba902b7"));
        assert_eq!(t.flags, 1);
        let odd = TraceContext::from_header(Some(
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-ff".as_slice(),
        ));
        assert_eq!(odd.flags, 1, "unknown flag bits are not passed on");
        let forwarded = t.traceparent();
        assert_eq!(forwarded.len(), 55);
        assert!(forwarded.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"));
        assert!(forwarded.ends_with("-01"));
        assert_eq!(&forwarded[36..52], t.span_id_hex());
        assert_ne!(t.span_id_hex(), "00f067aa0ba902b7");
        assert_eq!(parse(forwarded.as_bytes()).map(|p| p.0), Some(t.trace_id));
    }

    #[test]
    fn invalid_or_absent_traceparents_start_a_new_trace() {
        for bad in [
            "",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            "0x-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(parse(bad.as_bytes()), None, "{bad}");
            let t = TraceContext::from_header(Some(bad.as_bytes()));
            assert_eq!(t.parent_id, None, "{bad}");
            assert_ne!(t.trace_id, [0; 16]);
        }
        let a = TraceContext::from_header(None);
        let b = TraceContext::from_header(None);
        assert_ne!(a.trace_id, b.trace_id, "each request its own trace");
        assert_eq!(
            parse(a.traceparent().as_bytes()).map(|p| p.0),
            Some(a.trace_id)
        );
    }

    #[test]
    fn a_later_version_with_more_fields_is_understood() {
        let v = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes-next";
        assert!(parse(v.as_bytes()).is_some());
        assert!(parse(b"cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x").is_none());
    }
}
