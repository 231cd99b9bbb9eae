//! The NewPet body parser: never panics; what it accepts follows the interface's rules.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(p) = backend::pet::NewPet::from_json(data) {
        assert!(p.category_id >= 1);
        assert_eq!(p.name.trim(), p.name);
        let n = p.name.chars().count();
        assert!((1..=backend::pet::NAME_MAX_CHARS).contains(&n));
        assert!(!p.name.chars().any(char::is_control));
    }
});
