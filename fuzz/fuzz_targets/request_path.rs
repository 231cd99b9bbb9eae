//! The request-path scanner: never panics; a path it passes has no empty or dot segment, no
//! separator but `/`, and no byte outside the printable ASCII a canonical path is made of.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if proxy::http::request::path_fault(data).is_none() {
        assert!(data.first() == Some(&b'/'));
        assert!(data.len() == 1 || !data.ends_with(b"/"));
        assert!(data
            .iter()
            .all(|b| b.is_ascii_graphic() && *b != b'\\' && *b != b';'));
        for segment in data[1..].split(|b| *b == b'/') {
            assert!(data.len() == 1 || !segment.is_empty());
            assert!(segment != b"." && segment != b"..");
        }
        let lower = data.to_ascii_lowercase();
        assert!(!lower
            .windows(3)
            .any(|w| w == b"%2f" || w == b"%5c" || w == b"%2e" || w == b"%00"));
    }
});
