#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_invariants::checkpoint::check(data));
