#![no_main]
libfuzzer_sys::fuzz_target!(init: kvroute_invariants::stage_request::init(), |data: &[u8]| {
    kvroute_invariants::stage_request::check(data)
});
