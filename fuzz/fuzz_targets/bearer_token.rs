//! The Authorization header parser: never panics; what it accepts is a bounded token68.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(token) = proxy::http::auth::bearer_token(std::iter::once(data)) {
        assert!(!token.is_empty() && token.len() <= proxy::http::auth::MAX_TOKEN_LEN);
        assert!(token.is_ascii());
    }
});
