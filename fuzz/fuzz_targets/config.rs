//! Arbitrary configurations: validation never panics; valid ones run.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvtier_model::fuzz_config(data));
