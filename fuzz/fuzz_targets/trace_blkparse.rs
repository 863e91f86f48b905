//! Arbitrary bytes read to the end as blkparse text, once per action
//! (Q, D, C).
#![no_main]

use vdcache_eval::trace::{BlkAction, Format, fuzzing::exercise_reader};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    exercise_reader(Format::Blkparse(BlkAction::Queue), data);
});
