//! The rules a `NewPet` request body must follow (the design's gap table). Validation lives
//! here, away from HTTP, so the rules can be tested as plain functions. The types on the wire
//! ([`Pet`], [`PetStatus`]) are the `pet-api` crate's, shared with the client.

use serde::{Deserialize, Deserializer};
use serde_json::Value;

use crate::error::ApiError;

pub use pet_api::{Pet, PetStatus};

/// Longest accepted name, in characters (Unicode scalar values) after trimming.
pub const NAME_MAX_CHARS: usize = 100;

/// A validated request to create a pet: every field already satisfies the interface's rules,
/// and `status` is one of the interface's values (the default filled in). The body a client
/// sends is `pet_api::NewPet`; the backend never deserializes that type, but reads the raw
/// body with [`NewPet::from_json`] so each rule can name what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewPet {
    pub name: String,
    pub category_id: i64,
    pub status: PetStatus,
}

/// The body as sent, before any rule is applied. Fields are kept as raw JSON values so that each
/// rule can say precisely what is wrong; `deny_unknown_fields` refuses `id` and typos by name.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a JSON object (a NewPet)")]
struct RawNewPet {
    #[serde(default, deserialize_with = "present")]
    name: Option<Value>,
    #[serde(default, rename = "categoryId", deserialize_with = "present")]
    category_id: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    status: Option<Value>,
}

/// Keeps an explicit `null` as `Some(Null)` so it is refused as a wrong type rather than being
/// mistaken for an omitted field.
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

impl NewPet {
    /// Parses and validates a request body. Every failure is a 400 `invalid_request` whose
    /// message names the offending field.
    pub fn from_json(body: &[u8]) -> Result<NewPet, ApiError> {
        // serde would also accept a struct written as an array (`["Rex", 1]`); the interface
        // only knows objects, so anything that does not open with `{` is refused up front.
        let opening = body
            .iter()
            .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'));
        if opening != Some(&b'{') {
            return Err(match serde_json::from_slice::<Value>(body) {
                Ok(v) => ApiError::invalid_request(format!(
                    "request body must be a JSON object (a NewPet), got {}",
                    json_type(&v)
                )),
                Err(e) => ApiError::invalid_request(format!("request body is not valid JSON: {e}")),
            });
        }
        let raw: RawNewPet = serde_json::from_slice(body).map_err(|e| {
            use serde_json::error::Category;
            match e.classify() {
                Category::Syntax | Category::Eof | Category::Io => {
                    ApiError::invalid_request(format!("request body is not valid JSON: {e}"))
                }
                Category::Data => ApiError::invalid_request(format!("invalid NewPet: {e}")),
            }
        })?;

        let name = match raw.name {
            None => return Err(ApiError::invalid_request("field `name` is required")),
            Some(v) => validate_name(&v)?,
        };
        let category_id = match raw.category_id {
            None => return Err(ApiError::invalid_request("field `categoryId` is required")),
            Some(v) => validate_category_id(&v)?,
        };
        let status = match raw.status {
            None => PetStatus::Available,
            Some(v) => validate_status(&v)?,
        };
        Ok(NewPet {
            name,
            category_id,
            status,
        })
    }
}

fn validate_name(v: &Value) -> Result<String, ApiError> {
    let Value::String(s) = v else {
        return Err(ApiError::invalid_request(format!(
            "field `name` must be a string, got {}",
            json_type(v)
        )));
    };
    let trimmed = s.trim();
    let chars = trimmed.chars().count();
    if chars == 0 {
        return Err(ApiError::invalid_request(
            "field `name` must not be empty or only white space",
        ));
    }
    if chars > NAME_MAX_CHARS {
        return Err(ApiError::invalid_request(format!(
            "field `name` must be at most {NAME_MAX_CHARS} characters, got {chars}"
        )));
    }
    if trimmed.chars().any(char::is_control) {
        return Err(ApiError::invalid_request(
            "field `name` must not contain control characters",
        ));
    }
    Ok(trimmed.to_owned())
}

fn validate_category_id(v: &Value) -> Result<i64, ApiError> {
    let out_of_range = || {
        ApiError::invalid_request(format!(
            "field `categoryId` must be an integer from 1 to {}",
            i64::MAX
        ))
    };
    /// Largest integer an f64 holds exactly: above it, `7.0`-style numbers may have been rounded.
    const EXACT_F64: f64 = 9_007_199_254_740_992.0;
    match v {
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(id), _) if id >= 1 => Ok(id),
            (Some(_), _) => Err(out_of_range()),
            // JSON Schema counts `7.0` as the integer 7; so does the interface's document.
            (None, Some(f)) if f.fract() == 0.0 && (1.0..=EXACT_F64).contains(&f) => Ok(f as i64),
            _ => Err(out_of_range()),
        },
        other => Err(ApiError::invalid_request(format!(
            "field `categoryId` must be an integer, got {}",
            json_type(other)
        ))),
    }
}

fn validate_status(v: &Value) -> Result<PetStatus, ApiError> {
    v.as_str().and_then(PetStatus::parse).ok_or_else(|| {
        ApiError::invalid_request("field `status` must be one of `available`, `pending`, `sold`")
    })
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;

    fn err(body: &str) -> String {
        let e = NewPet::from_json(body.as_bytes()).expect_err(body);
        assert_eq!(e.code, ErrorCode::InvalidRequest, "{body}");
        e.message
    }

    #[test]
    fn minimal_body_defaults_status_to_available() {
        let p = NewPet::from_json(br#"{"name":"Rex","categoryId":1}"#).unwrap();
        assert_eq!(
            p,
            NewPet {
                name: "Rex".into(),
                category_id: 1,
                status: PetStatus::Available
            }
        );
    }

    #[test]
    fn name_is_stored_trimmed_and_counted_in_characters() {
        let p = NewPet::from_json(
            "{\"name\":\"  Ré\u{e9}x \\t\",\"categoryId\":9,\"status\":\"sold\"}".as_bytes(),
        )
        .unwrap();
        assert_eq!(p.name, "Rééx");
        assert_eq!(p.status, PetStatus::Sold);
        let hundred_multibyte = "é".repeat(100);
        let body = format!(r#"{{"name":"{hundred_multibyte}","categoryId":1}}"#);
        assert_eq!(
            NewPet::from_json(body.as_bytes()).unwrap().name,
            hundred_multibyte
        );
    }

    #[test]
    fn category_id_bounds() {
        let max = format!(r#"{{"name":"a","categoryId":{}}}"#, i64::MAX);
        assert_eq!(
            NewPet::from_json(max.as_bytes()).unwrap().category_id,
            i64::MAX
        );
        // JSON Schema counts `7.0` as the integer 7, and so does the interface's document.
        let integral = r#"{"name":"a","categoryId":7.0}"#;
        assert_eq!(
            NewPet::from_json(integral.as_bytes()).unwrap().category_id,
            7
        );
        let exponent = r#"{"name":"a","categoryId":1e3}"#;
        assert_eq!(
            NewPet::from_json(exponent.as_bytes()).unwrap().category_id,
            1000
        );
        for bad in [
            "0",
            "-1",
            "1.5",
            "0.0",
            "-2.0",
            "\"7\"",
            "9223372036854775808",
            "1e300",
            "null",
            "true",
        ] {
            err(&format!(r#"{{"name":"a","categoryId":{bad}}}"#));
        }
    }

    #[test]
    fn messages_name_the_field() {
        assert!(err(r#"{"name":"a","categoryId":1,"id":5}"#).contains("`id`"));
        assert!(err(r#"{"name":"a","categroyId":1}"#).contains("`categroyId`"));
        assert!(err(r#"{"categoryId":1}"#).contains("`name`"));
        assert!(err(r#"{"name":"a"}"#).contains("`categoryId`"));
        assert!(err(r#"{"name":"a","categoryId":1,"status":"Sold"}"#).contains("`status`"));
        assert!(err(r#"{"name":"a","categoryId":1,"status":null}"#).contains("`status`"));
        assert!(err(r#"{"name":null,"categoryId":1}"#).contains("`name`"));
        assert!(err(r#"{"name":"a","name":"b","categoryId":1}"#).contains("`name`"));
    }

    #[test]
    fn bad_names() {
        for bad in [
            "\"   \"",
            "\"\"",
            "\"a\\u0007b\"",
            "\"a\\nb\"",
            "\"a\\u0085b\"",
            "5",
            "[\"a\"]",
        ] {
            err(&format!(r#"{{"name":{bad},"categoryId":1}}"#));
        }
        err(&format!(
            r#"{{"name":"{}","categoryId":1}}"#,
            "x".repeat(101)
        ));
    }

    #[test]
    fn not_an_object_or_not_json() {
        for bad in [
            "5",
            "[]",
            "\"x\"",
            "null",
            "",
            "{",
            "{\"name\":\"a\",}",
            "{\"name\":\"a\"} x",
        ] {
            err(bad);
        }
        // A struct spelled as an array is not a NewPet, however well its elements fit.
        assert!(err(r#"["Rex", 1]"#).contains("got an array"));
        assert!(err(r#" [{"name":"Rex","categoryId":1}]"#).contains("got an array"));
        assert!(NewPet::from_json(b"{\"name\":\"\xff\",\"categoryId\":1}").is_err());
    }
}
