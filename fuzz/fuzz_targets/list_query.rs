//! The query-string and petId parsers: never panic; accepted values are in range.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(q) = backend::query::ListQuery::parse(Some(text)) {
        assert!((1..=backend::query::LIMIT_MAX).contains(&q.limit));
        assert!(q.after >= 0);
    }
    if let Ok(id) = backend::query::parse_pet_id(text) {
        assert!(id >= 1);
    }
});
