//! Property tests for the backend's parsers: whatever bytes arrive, they never panic, and what
//! they accept always satisfies the interface's rules.

use backend::error::ErrorCode;
use backend::pet::{NewPet, PetStatus, NAME_MAX_CHARS};
use backend::query::{parse_pet_id, ListQuery, LIMIT_MAX};
use proptest::prelude::*;

/// Names the interface accepts: 1..=100 characters, no control characters, not blank.
fn valid_name() -> impl Strategy<Value = String> {
    "[^\\p{Cc}]{1,100}".prop_filter("not blank", |s| !s.trim().is_empty())
}

fn status() -> impl Strategy<Value = Option<PetStatus>> {
    prop_oneof![
        Just(None),
        Just(Some(PetStatus::Available)),
        Just(Some(PetStatus::Pending)),
        Just(Some(PetStatus::Sold)),
    ]
}

proptest! {
    #[test]
    fn new_pet_never_panics_and_what_it_accepts_is_valid(body in proptest::collection::vec(any::<u8>(), 0..300)) {
        if let Ok(p) = NewPet::from_json(&body) {
            prop_assert!(p.category_id >= 1);
            prop_assert_eq!(p.name.trim(), p.name.as_str());
            let chars = p.name.chars().count();
            prop_assert!((1..=NAME_MAX_CHARS).contains(&chars));
            prop_assert!(!p.name.chars().any(char::is_control));
        }
    }

    #[test]
    fn new_pet_accepts_every_valid_body(name in valid_name(), category in 1..=i64::MAX, status in status()) {
        let mut body = serde_json::json!({"name": name, "categoryId": category});
        if let Some(s) = &status {
            body["status"] = serde_json::json!(s.as_str());
        }
        let p = NewPet::from_json(body.to_string().as_bytes()).unwrap();
        prop_assert_eq!(p.name, name.trim());
        prop_assert_eq!(p.category_id, category);
        prop_assert_eq!(p.status, status.unwrap_or(PetStatus::Available));
    }

    #[test]
    fn new_pet_refuses_out_of_range_category_ids(category in i64::MIN..=0) {
        let body = serde_json::json!({"name": "Rex", "categoryId": category}).to_string();
        let e = NewPet::from_json(body.as_bytes()).unwrap_err();
        prop_assert_eq!(e.code, ErrorCode::InvalidRequest);
    }

    #[test]
    fn the_query_parser_never_panics_and_keeps_limit_in_range(q in ".{0,200}") {
        if let Ok(parsed) = ListQuery::parse(Some(&q)) {
            prop_assert!((1..=LIMIT_MAX).contains(&parsed.limit));
            prop_assert!(parsed.after >= 0);
        }
    }

    #[test]
    fn every_limit_in_range_is_taken_and_every_other_refused(limit in -1000i64..1000) {
        let parsed = ListQuery::parse(Some(&format!("limit={limit}")));
        if (1..=i64::from(LIMIT_MAX)).contains(&limit) {
            prop_assert_eq!(parsed.unwrap().limit as i64, limit);
        } else {
            prop_assert_eq!(parsed.unwrap_err().code, ErrorCode::InvalidParameter);
        }
    }

    #[test]
    fn pet_ids_are_positive_decimal_int64(raw in ".{0,30}") {
        if let Ok(id) = parse_pet_id(&raw) {
            prop_assert!(id >= 1);
            prop_assert_eq!(id.to_string(), raw.trim_start_matches('0'));
        }
    }
}
