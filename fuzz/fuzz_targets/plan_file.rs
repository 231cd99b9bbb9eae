//! The plan file parser (operators edit these by hand): never panics; accepted limits are >= 1.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(limits) = proxy::keys::plans::parse_limits(text) {
        assert!(limits.per_minute >= 1 && limits.per_day >= 1);
    }
});
