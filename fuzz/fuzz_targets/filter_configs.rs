#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_invariants::filter_configs::check(data));
