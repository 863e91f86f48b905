//! Arbitrary bytes read to the end as a fio iolog (v2 and v3) trace.
#![no_main]

use vdcache_eval::trace::{Format, fuzzing::exercise_reader};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    exercise_reader(Format::Fio, data);
});
