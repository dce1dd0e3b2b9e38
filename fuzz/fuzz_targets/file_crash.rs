//! Crash scenarios of the file tier against a simulated disk that crashes at any IO operation
//! and tears unsynced writes: nothing served wrong, nothing acknowledged durable lost.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(v) = kvtier_hw::crash::run(data) {
        panic!("{v}");
    }
});
