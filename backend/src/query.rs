//! Query-string and path parameters. Bad values are refused with 400 `invalid_parameter`
//! naming the parameter, never clamped: a client asking for `limit=500` must learn that it
//! gets at most 100 rather than silently receive fewer than it thinks.

use crate::error::ApiError;
use crate::pet::PetStatus;

pub const LIMIT_DEFAULT: u32 = 20;
pub const LIMIT_MAX: u32 = 100;

/// The parameters of `GET /pets`. `after` is the design's backward-compatible cursor extension:
/// only pets with an id greater than it are returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListQuery {
    pub limit: u32,
    pub status: Option<PetStatus>,
    pub after: i64,
}

impl Default for ListQuery {
    fn default() -> Self {
        ListQuery {
            limit: LIMIT_DEFAULT,
            status: None,
            after: 0,
        }
    }
}

impl ListQuery {
    /// Parses the raw (still percent-encoded) query string. Unknown and repeated parameters are
    /// refused too: a typo such as `stauts=sold` would otherwise return every pet unfiltered.
    pub fn parse(query: Option<&str>) -> Result<ListQuery, ApiError> {
        let mut q = ListQuery::default();
        let mut seen = [false; 3];
        for (key, value) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            let slot = match key.as_ref() {
                "limit" => 0,
                "status" => 1,
                "after" => 2,
                other => {
                    return Err(ApiError::invalid_parameter(format!(
                        "unknown query parameter `{}`; allowed: limit, status, after",
                        printable(other)
                    )))
                }
            };
            if std::mem::replace(&mut seen[slot], true) {
                return Err(ApiError::invalid_parameter(format!(
                    "query parameter `{key}` given more than once"
                )));
            }
            match slot {
                0 => q.limit = parse_limit(&value)?,
                1 => {
                    q.status = Some(PetStatus::parse(&value).ok_or_else(|| {
                        ApiError::invalid_parameter(
                        "query parameter `status` must be one of `available`, `pending`, `sold`",
                    )
                    })?)
                }
                _ => {
                    q.after = parse_decimal(&value).filter(|&a| a >= 0).ok_or_else(|| {
                        ApiError::invalid_parameter(format!(
                            "query parameter `after` must be a pet id from 0 to {}",
                            i64::MAX
                        ))
                    })?
                }
            }
        }
        Ok(q)
    }
}

fn parse_limit(value: &str) -> Result<u32, ApiError> {
    match parse_decimal(value) {
        Some(n) if (1..=i64::from(LIMIT_MAX)).contains(&n) => Ok(n as u32),
        _ => Err(ApiError::invalid_parameter(format!(
            "query parameter `limit` must be an integer from 1 to {LIMIT_MAX}"
        ))),
    }
}

/// Parses the `petId` path segment: a positive int64 written in plain decimal digits.
pub fn parse_pet_id(segment: &str) -> Result<i64, ApiError> {
    parse_decimal(segment).filter(|&id| id >= 1).ok_or_else(|| {
        ApiError::invalid_parameter(format!(
            "path parameter `petId` must be an integer from 1 to {}",
            i64::MAX
        ))
    })
}

/// Plain ASCII digits only: `str::parse` would also take `+5`, which is not how an id is written.
/// Negative numbers are rejected here too, which is all the callers need.
fn parse_decimal(s: &str) -> Option<i64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// Echoing client input into a message: keep it short and free of control characters.
fn printable(s: &str) -> String {
    s.chars().filter(|c| !c.is_control()).take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;

    fn bad(q: &str) -> String {
        let e = ListQuery::parse(Some(q)).expect_err(q);
        assert_eq!(e.code, ErrorCode::InvalidParameter, "{q}");
        e.message
    }

    #[test]
    fn defaults() {
        assert_eq!(ListQuery::parse(None).unwrap(), ListQuery::default());
        assert_eq!(ListQuery::parse(Some("")).unwrap(), ListQuery::default());
    }

    #[test]
    fn all_parameters() {
        let q = ListQuery::parse(Some("limit=100&status=pending&after=41")).unwrap();
        assert_eq!(
            q,
            ListQuery {
                limit: 100,
                status: Some(PetStatus::Pending),
                after: 41
            }
        );
        assert_eq!(ListQuery::parse(Some("limit=1")).unwrap().limit, 1);
        assert_eq!(
            ListQuery::parse(Some("status=%73old")).unwrap().status,
            Some(PetStatus::Sold)
        );
    }

    #[test]
    fn bad_values_name_the_parameter() {
        for q in [
            "limit=0",
            "limit=101",
            "limit=abc",
            "limit=",
            "limit=-1",
            "limit=+5",
            "limit=1.0",
        ] {
            assert!(bad(q).contains("`limit`"), "{q}");
        }
        for q in ["status=unknown", "status=Available", "status="] {
            assert!(bad(q).contains("`status`"), "{q}");
        }
        for q in ["after=-1", "after=x", "after=9223372036854775808"] {
            assert!(bad(q).contains("`after`"), "{q}");
        }
        assert!(bad("stauts=sold").contains("`stauts`"));
        assert!(bad("limit=5&limit=6").contains("`limit`"));
    }

    #[test]
    fn pet_ids() {
        assert_eq!(parse_pet_id("1").unwrap(), 1);
        assert_eq!(parse_pet_id("9223372036854775807").unwrap(), i64::MAX);
        for s in [
            "abc",
            "0",
            "-3",
            "9223372036854775808",
            "",
            "+1",
            "1e3",
            "%31",
        ] {
            let e = parse_pet_id(s).expect_err(s);
            assert_eq!(e.code, ErrorCode::InvalidParameter);
            assert!(e.message.contains("`petId`"));
        }
    }
}
