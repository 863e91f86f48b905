//! Arbitrary bytes opened, read, written and checked as a qcow2 image.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    vdcache_image::fuzzing::exercise_image(data);
});
