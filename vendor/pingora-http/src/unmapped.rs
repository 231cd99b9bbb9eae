// Copyright 2026 Cloudflare, Inc.
//
// Licensed under the Apache License, Version 2.0 (the "License");
// you may not use this file except in compliance with the License.
// You may obtain a copy of the License at
//
// http://www.apache.org/licenses/LICENSE-2.0
//
// Unless required by applicable law or agreed to in writing, software
// distributed under the License is distributed on an "AS IS" BASIS,
// WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
// See the License for the specific language governing permissions and
// limitations under the License.

//! Headers a proxy adds to a message and never reads back, kept beside the header maps rather
//! than in them.
//!
//! An insert into a header (with its case map, two maps) hashes the name twice, probes both
//! tables and may grow them; a proxy that stamps the same few headers on every message (a
//! request id, rate-limit figures, the caller's identity for the upstream) pays that for
//! fields nothing looks up again. These are written after the mapped fields, on HTTP/1 as
//! their lines and on HTTP/2 by joining the map when the message's parts are taken.

use crate::case_header_name::CaseHeaderName;
use crate::{HMap, IntoCaseHeaderName};
use bytes::BufMut;
use http::header::{self, HeaderName, HeaderValue};
use pingora_error::{Error, ErrorType::*, OrErr, Result};

/// The unmapped fields of one message, in the order they were added.
#[derive(Debug, Clone, Default)]
pub(crate) struct Unmapped(Vec<(HeaderName, CaseHeaderName, HeaderValue)>);

impl Unmapped {
    /// Adds a field. Fields that decide a message's framing or connection, or that pingora's
    /// own modules read (compression, ranges, the date), are refused: that code reads the maps
    /// only.
    pub(crate) fn push(
        &mut self,
        name: impl IntoCaseHeaderName,
        value: impl TryInto<HeaderValue>,
    ) -> Result<()> {
        let value = value
            .try_into()
            .explain_err(InvalidHTTPHeader, |_| "invalid value while adding unmapped")?;
        let (name, case) = name.into_header_names()?;
        if read_from_the_maps(&name) {
            return Error::e_explain(
                InvalidHTTPHeader,
                format!("{name} is read from the header map (framing, connection or a module); insert it there"),
            );
        }
        if self.0.capacity() == 0 {
            // Room for a proxy's usual few at once (six: a request id and five rate-limit
            // fields) rather than growing by doubling from one.
            self.0.reserve_exact(6);
        }
        self.0.push((name, case, value));
        Ok(())
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
        self.0.iter().map(|(name, _, value)| (name, value))
    }

    pub(crate) fn case_iter(&self) -> impl Iterator<Item = (&CaseHeaderName, &HeaderValue)> {
        self.0.iter().map(|(_, case, value)| (case, value))
    }

    /// Each field on its own HTTP/1 line, in the case it was added with.
    pub(crate) fn to_h1_wire(&self, buf: &mut impl BufMut) {
        for (_, case, value) in &self.0 {
            buf.put_slice(case.as_slice());
            buf.put_slice(b": ");
            buf.put_slice(value.as_bytes());
            buf.put_slice(b"\r\n");
        }
    }

    /// Appends each field to `headers` (for a form without the case map: HTTP/2, or parts
    /// taken out of the message), after any of the same name already there.
    pub(crate) fn join(&self, headers: &mut HMap) {
        for (name, _, value) in &self.0 {
            headers.append(name.clone(), value.clone());
        }
    }
}

/// The fields pingora reads to frame a message or to manage its connection, and those its
/// modules read (compression, range requests) or add themselves (the date).
fn read_from_the_maps(name: &HeaderName) -> bool {
    name == header::CONTENT_LENGTH
        || name == header::CONTENT_ENCODING
        || name == header::CONTENT_RANGE
        || name == header::CONTENT_TYPE
        || name == header::VARY
        || name == header::ETAG
        || name == header::DATE
        || name == header::TRANSFER_ENCODING
        || name == header::CONNECTION
        || name == header::UPGRADE
        || name == header::TE
        || name == header::TRAILER
        || name == header::HOST
        || name == header::EXPECT
        || name.as_str() == "keep-alive"
        || name.as_str() == "proxy-connection"
}

#[cfg(test)]
mod tests {
    use crate::{HeaderNameVariant, RequestHeader, ResponseHeader, StaticHeaderName};
    use http::header::HeaderValue;
    use http::response::Parts as RespParts;

    const X_ID: StaticHeaderName = StaticHeaderName::from_static("x-id");

    fn wire(resp: &ResponseHeader) -> String {
        let mut buf = bytes::BytesMut::new();
        resp.header_to_h1_wire(&mut buf);
        String::from_utf8(buf.to_vec()).unwrap()
    }

    #[test]
    fn written_after_the_mapped_fields_with_or_without_case() {
        for mut resp in [
            ResponseHeader::build(200, None).unwrap(),
            ResponseHeader::build_no_case(200, None).unwrap(),
        ] {
            resp.append_header("Server", "s").unwrap();
            resp.add_unmapped_header(&X_ID, "7").unwrap();
            resp.add_unmapped_header("X-Two", "a b").unwrap();
            assert_eq!(wire(&resp), "Server: s\r\nx-id: 7\r\nX-Two: a b\r\n");
            // Not in the map: neither seen nor replaced by the map's own edits.
            assert!(resp.headers.get("x-id").is_none());
            resp.insert_header("x-id", "8").unwrap();
            assert_eq!(resp.headers.get("x-id").unwrap(), "8");
            assert_eq!(resp.unmapped_headers().count(), 2);
        }
    }

    #[test]
    fn carried_by_clones_parts_and_the_iterators() {
        let mut resp = ResponseHeader::build(200, None).unwrap();
        resp.insert_header("x-id", "mapped").unwrap();
        resp.add_unmapped_header(&X_ID, "7").unwrap();

        let clone = resp.clone();
        assert_eq!(wire(&clone), wire(&resp));
        assert_eq!(clone.headers.get_all("x-id").iter().count(), 1);

        // HTTP/2 takes the parts: the field joins the map after the mapped one.
        let parts = resp.as_owned_parts();
        let all: Vec<_> = parts.headers.get_all("x-id").iter().collect();
        assert_eq!(all, ["mapped", "7"]);
        let parts: RespParts = resp.clone().into();
        assert_eq!(parts.headers.get_all("x-id").iter().count(), 2);
        let boxed: Box<RespParts> = Box::new(resp.clone()).into();
        assert_eq!(boxed.headers.get_all("x-id").iter().count(), 2);

        let mut seen = Vec::new();
        resp.map(|name, value| {
            if let HeaderNameVariant::Case(c) = name {
                seen.push((c.as_slice().to_vec(), value.clone()));
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(
            seen.last().unwrap(),
            &(b"x-id".to_vec(), HeaderValue::from(7))
        );
        assert_eq!(resp.case_header_iter().count(), 2);
    }

    #[test]
    fn requests_carry_them_to_the_wire_and_parts() {
        let mut req = RequestHeader::build("GET", b"/", None).unwrap();
        req.insert_header("Host", "h").unwrap();
        req.add_unmapped_header(&X_ID, "k1").unwrap();
        let mut buf = bytes::BytesMut::new();
        req.clone().header_to_h1_wire(&mut buf);
        assert_eq!(&buf[..], b"Host: h\r\nx-id: k1\r\n");
        assert_eq!(req.as_owned_parts().headers.get("x-id").unwrap(), "k1");
        let parts: http::request::Parts = req.into();
        assert_eq!(parts.headers.get("x-id").unwrap(), "k1");
    }

    #[test]
    fn framing_and_connection_fields_and_bad_values_are_refused() {
        let mut resp = ResponseHeader::build(200, None).unwrap();
        for name in [
            "content-length",
            "Transfer-Encoding",
            "connection",
            "upgrade",
            "te",
            "trailer",
            "host",
            "expect",
            "keep-alive",
            "Proxy-Connection",
            "content-encoding",
            "content-range",
            "content-type",
            "vary",
            "etag",
            "date",
        ] {
            assert!(
                resp.add_unmapped_header(name.to_string(), "1").is_err(),
                "{name}"
            );
        }
        assert!(resp.add_unmapped_header(&X_ID, "a\r\nb: c").is_err());
        assert!(resp.add_unmapped_header("bad name", "1").is_err());
        assert_eq!(resp.unmapped_headers().count(), 0);
        assert_eq!(wire(&resp), "");
    }
}
