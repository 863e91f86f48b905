//! Arbitrary bytes fed to each pure parser of the qcow2 format crate.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    vdcache_qcow2::fuzzing::exercise_structures(data);
});
