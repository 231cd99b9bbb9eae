//! `pet-api`: the types of the pet adoption API as they travel on the wire (`openapi.yaml`'s
//! `Pet`, `NewPet`, `PetStatus` and `Error` schemas), and nothing else: no HTTP, no rules.
//!
//! Used by `pet-backend` (which serializes [`Pet`] and [`ErrorBody`]) and by `pet-client`
//! (which serializes [`NewPet`] and reads the others), so the two cannot drift apart and the
//! client needs no dependency on the server.
//!
//! [`PetStatus`] is open: a value this crate does not know (one a newer server may add) reads
//! as [`PetStatus::Other`] and writes back unchanged, so a client keeps working. Whoever must
//! refuse such values (the backend, for requests and query parameters) uses the strict
//! [`PetStatus::parse`], never serde.
//!
//! The backend's request parsing and validation of a `NewPet` body (field by field, naming the
//! offending field) stays in the backend (`backend/src/pet.rs`); [`NewPet`] here is the body a
//! client sends.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// An animal's status. On the wire: a string; the interface's values are `available`,
/// `pending` and `sold`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PetStatus {
    Available,
    Pending,
    Sold,
    /// A status the interface did not have when this crate was written, kept exactly as sent.
    /// [`From`] and deserialization never put a known value here.
    Other(String),
}

impl PetStatus {
    /// The interface's values (never [`PetStatus::Other`]).
    pub const ALL: [PetStatus; 3] = [PetStatus::Available, PetStatus::Pending, PetStatus::Sold];

    /// The value on the wire.
    pub fn as_str(&self) -> &str {
        match self {
            PetStatus::Available => "available",
            PetStatus::Pending => "pending",
            PetStatus::Sold => "sold",
            PetStatus::Other(s) => s,
        }
    }

    /// One of the interface's values only: exact, case-sensitive match (the interface says
    /// "allowed values, exactly"); anything else is `None`.
    pub fn parse(s: &str) -> Option<PetStatus> {
        match s {
            "available" => Some(PetStatus::Available),
            "pending" => Some(PetStatus::Pending),
            "sold" => Some(PetStatus::Sold),
            _ => None,
        }
    }
}

/// Any string: a known value becomes its variant, anything else [`PetStatus::Other`].
impl From<String> for PetStatus {
    fn from(s: String) -> Self {
        PetStatus::parse(&s).unwrap_or(PetStatus::Other(s))
    }
}

impl From<&str> for PetStatus {
    fn from(s: &str) -> Self {
        PetStatus::parse(s).unwrap_or_else(|| PetStatus::Other(s.to_owned()))
    }
}

impl fmt::Display for PetStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<str> for PetStatus {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for PetStatus {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl Serialize for PetStatus {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// Lenient: any string is a status (see [`PetStatus::Other`]); anything but a string is not.
impl<'de> Deserialize<'de> for PetStatus {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer).map(PetStatus::from)
    }
}

/// An animal, as the API returns it (schema `Pet`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pet {
    pub id: i64,
    pub name: String,
    #[serde(rename = "categoryId")]
    pub category_id: i64,
    pub status: PetStatus,
}

/// An animal to create: the body of `POST /v1/pets` (schema `NewPet`). Without a `status` the
/// server uses `available`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NewPet {
    pub name: String,
    #[serde(rename = "categoryId")]
    pub category_id: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<PetStatus>,
}

/// The body of every error answer (schema `Error`): a machine-readable `code` (the design's
/// list, or a newer one), a message for people, and the HTTP status again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub code: String,
    pub message: String,
    pub status: u16,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_read_and_write_as_their_strings() {
        for (status, text) in [
            (PetStatus::Available, "available"),
            (PetStatus::Pending, "pending"),
            (PetStatus::Sold, "sold"),
        ] {
            let json = format!("\"{text}\"");
            assert_eq!(serde_json::to_string(&status).unwrap(), json);
            assert_eq!(serde_json::from_str::<PetStatus>(&json).unwrap(), status);
            assert_eq!(PetStatus::parse(text), Some(status.clone()));
            assert_eq!(status, text);
        }
        assert_eq!(
            PetStatus::ALL.map(|s| s.to_string()),
            ["available", "pending", "sold"]
        );
    }

    #[test]
    fn an_unknown_status_is_kept_and_round_trips_unchanged() {
        for text in ["adopted", "Sold", "", "sold "] {
            let json = serde_json::to_string(text).unwrap();
            let status: PetStatus = serde_json::from_str(&json).unwrap();
            assert_eq!(status, PetStatus::Other(text.to_owned()));
            assert_eq!(serde_json::to_string(&status).unwrap(), json);
            assert_eq!(PetStatus::parse(text), None, "parse is strict");
        }
        assert!(serde_json::from_str::<PetStatus>("null").is_err());
        assert!(serde_json::from_str::<PetStatus>("1").is_err());
        assert_eq!(PetStatus::from("sold"), PetStatus::Sold);
    }

    #[test]
    fn shapes_on_the_wire() {
        let pet = Pet {
            id: 7,
            name: "Rex".into(),
            category_id: 2,
            status: PetStatus::Other("adopted".into()),
        };
        let json = r#"{"id":7,"name":"Rex","categoryId":2,"status":"adopted"}"#;
        assert_eq!(serde_json::to_string(&pet).unwrap(), json);
        assert_eq!(serde_json::from_str::<Pet>(json).unwrap(), pet);

        let new = NewPet {
            name: "Rex".into(),
            category_id: 2,
            status: None,
        };
        assert_eq!(
            serde_json::to_string(&new).unwrap(),
            r#"{"name":"Rex","categoryId":2}"#
        );
        let new = NewPet {
            status: Some(PetStatus::Sold),
            ..new
        };
        assert_eq!(
            serde_json::to_string(&new).unwrap(),
            r#"{"name":"Rex","categoryId":2,"status":"sold"}"#
        );

        let error = ErrorBody {
            code: "not_found".into(),
            message: "no pet with id 9".into(),
            status: 404,
        };
        let json = r#"{"code":"not_found","message":"no pet with id 9","status":404}"#;
        assert_eq!(serde_json::to_string(&error).unwrap(), json);
        assert_eq!(serde_json::from_str::<ErrorBody>(json).unwrap(), error);
    }
}
