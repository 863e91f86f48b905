//! Arbitrary bytes opened as a trace file of unknown kind: decompression by
//! magic bytes, format detection, then the detected reader to the end.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    vdcache_eval::trace::fuzzing::exercise_detection(data);
});
