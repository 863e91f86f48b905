//! Arbitrary bytes read to the end as a SNIA MSR Cambridge CSV trace.
#![no_main]

use vdcache_eval::trace::{Format, fuzzing::exercise_reader};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    exercise_reader(Format::Msr, data);
});
