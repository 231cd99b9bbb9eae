//! The plan file parser (operators edit these by hand): never panics; what it accepts has at
//! least one enforced window, limits >= 1 and a concurrency, when given, >= 1.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(plan) = proxy::keys::plans::parse_plan(text) {
        assert!(plan.limits.enforced().next().is_some());
        assert!(plan.limits.windows().iter().all(|w| w.limit >= 1));
        assert!(plan.limits.concurrency().is_none_or(|n| n >= 1));
    }
});
