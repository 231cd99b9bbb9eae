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

use crate::*;
use bytes::Bytes;
use http::header;

#[derive(Debug, Clone)]
pub struct CaseHeaderName(Bytes);

impl CaseHeaderName {
    pub fn new(name: String) -> Self {
        CaseHeaderName(name.into())
    }
}

impl CaseHeaderName {
    pub fn as_slice(&self) -> &[u8] {
        &self.0
    }

    pub fn from_slice(buf: &[u8]) -> Self {
        CaseHeaderName(Bytes::copy_from_slice(buf))
    }
}

/// A trait that converts into case-sensitive header names.
pub trait IntoCaseHeaderName {
    fn into_case_header_name(self) -> CaseHeaderName;

    /// The name as the header maps key it, and as it is written on the wire. By default the
    /// wire form's bytes are parsed into the key (a lookup, a validation and, for a name that
    /// is not a standard one, an allocation, on every insert); a name made once ahead, such as
    /// a [`StaticHeaderName`], gives both as they are.
    fn into_header_names(self) -> Result<(HeaderName, CaseHeaderName)>
    where
        Self: Sized,
    {
        let case = self.into_case_header_name();
        let name = HeaderName::try_from(case.as_slice())
            .or_err(InvalidHTTPHeader, "invalid header name")?;
        Ok((name, case))
    }
}

/// A header name made once, at compile time, with its wire form: inserting it neither parses
/// nor allocates a name, where inserting a `&'static str` does both each time.
///
/// ```
/// use pingora_http::{ResponseHeader, StaticHeaderName};
/// const X_REQUEST_ID: StaticHeaderName = StaticHeaderName::from_static("x-request-id");
/// let mut resp = ResponseHeader::build(200, None).unwrap();
/// resp.insert_header(&X_REQUEST_ID, "abc").unwrap();
/// assert_eq!(resp.headers.get("x-request-id").unwrap(), "abc");
/// ```
#[derive(Debug, Clone)]
pub struct StaticHeaderName {
    name: HeaderName,
    case: &'static str,
}

impl StaticHeaderName {
    /// `name` as it goes on the wire; it must be a valid header name in lower case
    /// ([`HeaderName::from_static`]'s rule, checked at compile time in a `const`).
    pub const fn from_static(name: &'static str) -> Self {
        StaticHeaderName {
            name: HeaderName::from_static(name),
            case: name,
        }
    }

    /// The name as the header maps key it.
    pub fn name(&self) -> &HeaderName {
        &self.name
    }
}

impl IntoCaseHeaderName for &StaticHeaderName {
    fn into_case_header_name(self) -> CaseHeaderName {
        CaseHeaderName(Bytes::from_static(self.case.as_bytes()))
    }

    fn into_header_names(self) -> Result<(HeaderName, CaseHeaderName)> {
        Ok((
            self.name.clone(),
            CaseHeaderName(Bytes::from_static(self.case.as_bytes())),
        ))
    }
}

impl IntoCaseHeaderName for CaseHeaderName {
    fn into_case_header_name(self) -> CaseHeaderName {
        self
    }
}

impl IntoCaseHeaderName for String {
    fn into_case_header_name(self) -> CaseHeaderName {
        CaseHeaderName(self.into())
    }
}

impl IntoCaseHeaderName for &'static str {
    fn into_case_header_name(self) -> CaseHeaderName {
        CaseHeaderName(self.into())
    }
}

impl IntoCaseHeaderName for HeaderName {
    fn into_case_header_name(self) -> CaseHeaderName {
        CaseHeaderName(titled_header_name(&self))
    }

    fn into_header_names(self) -> Result<(HeaderName, CaseHeaderName)> {
        let case = CaseHeaderName(titled_header_name(&self));
        Ok((self, case))
    }
}

impl IntoCaseHeaderName for &HeaderName {
    fn into_case_header_name(self) -> CaseHeaderName {
        CaseHeaderName(titled_header_name(self))
    }

    fn into_header_names(self) -> Result<(HeaderName, CaseHeaderName)> {
        Ok((self.clone(), CaseHeaderName(titled_header_name(self))))
    }
}

impl IntoCaseHeaderName for Bytes {
    fn into_case_header_name(self) -> CaseHeaderName {
        CaseHeaderName(self)
    }
}

fn titled_header_name(header_name: &HeaderName) -> Bytes {
    titled_header_name_str(header_name).map_or_else(
        || Bytes::copy_from_slice(header_name.as_str().as_bytes()),
        |s| Bytes::from_static(s.as_bytes()),
    )
}

pub(crate) fn titled_header_name_str(header_name: &HeaderName) -> Option<&'static str> {
    Some(match *header_name {
        header::ACCEPT_RANGES => "Accept-Ranges",
        header::AGE => "Age",
        header::CACHE_CONTROL => "Cache-Control",
        header::CONNECTION => "Connection",
        header::CONTENT_TYPE => "Content-Type",
        header::CONTENT_ENCODING => "Content-Encoding",
        header::CONTENT_LENGTH => "Content-Length",
        header::DATE => "Date",
        header::TRANSFER_ENCODING => "Transfer-Encoding",
        header::HOST => "Host",
        header::SERVER => "Server",
        header::SET_COOKIE => "Set-Cookie",
        // TODO: add more const header here to map to their titled case
        // TODO: automatically upper case the first letter?
        _ => {
            return None;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_case_header_name() {
        assert_eq!("FoO".into_case_header_name().as_slice(), b"FoO");
        assert_eq!("FoO".to_string().into_case_header_name().as_slice(), b"FoO");
        assert_eq!(header::SERVER.into_case_header_name().as_slice(), b"Server");
    }

    #[test]
    fn test_header_names() {
        const X_ID: StaticHeaderName = StaticHeaderName::from_static("x-id");
        let (name, case) = (&X_ID).into_header_names().unwrap();
        assert_eq!((name.as_str(), case.as_slice()), ("x-id", &b"x-id"[..]));
        let (name, case) = "X-Id".into_header_names().unwrap();
        assert_eq!((name.as_str(), case.as_slice()), ("x-id", &b"X-Id"[..]));
        let (name, case) = header::SERVER.into_header_names().unwrap();
        assert_eq!((name, case.as_slice()), (header::SERVER, &b"Server"[..]));
        assert!("bad name".into_header_names().is_err());
    }
}
