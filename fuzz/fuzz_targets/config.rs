//! Arbitrary bytes parsed and validated as `vdcache serve`'s TOML
//! configuration file.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    vdcache::fuzzing::exercise_config(data);
});
