//! Op sequences through the harness: invariants and the differential against `RefModel`.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvtier_model::fuzz_ops(data));
