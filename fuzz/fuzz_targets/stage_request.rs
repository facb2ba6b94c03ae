#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_invariants::stage_request::check(data));
