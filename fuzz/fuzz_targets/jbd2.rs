//! Arbitrary bytes read as a JBD2 journal (superblock, then the log walk)
//! and as single descriptor and revoke blocks of every layout (see
//! `vdcache_jbd2::fuzzing`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    vdcache_jbd2::fuzzing::exercise_journal(data);
});
