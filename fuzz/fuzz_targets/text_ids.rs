#![no_main]
libfuzzer_sys::fuzz_target!(init: kvroute_invariants::text_ids::init(), |data: &[u8]| {
    kvroute_invariants::text_ids::check(data)
});
