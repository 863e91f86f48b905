//! Entry point shared by the JBD2 fuzz target (fuzz/fuzz_targets/jbd2.rs)
//! and the bounded fuzz tests: arbitrary bytes read as a whole journal
//! image (superblock in block 0), then as single descriptor and revoke
//! blocks under each feature set.
//!
//! Owns no parsing. Any error is a correct outcome; a panic, or a mapping
//! that breaks the invariants asserted here, is a finding.

use crate::{
    FEATURE_64BIT, FEATURE_CSUM_V2, FEATURE_CSUM_V3, SUPERBLOCK_BYTES, Superblock,
    parse_descriptor, parse_revoke, scan,
};

/// Parses `data` every way this crate can.
pub fn exercise_journal(data: &[u8]) {
    if data.len() >= SUPERBLOCK_BYTES
        && let Ok(sb) = Superblock::parse(data)
    {
        let bs = sb.block_size as usize;
        let block = |n: u32| {
            let start = (n as usize).checked_mul(bs)?;
            data.get(start..start.checked_add(bs)?)
        };
        if let Ok(log) = scan(&sb, block) {
            let log_blocks = sb.first..sb.log_end();
            for t in log.committed.iter().chain(&log.uncommitted) {
                for c in &t.copies {
                    assert!(
                        log_blocks.contains(&c.journal_block),
                        "copy outside the log"
                    );
                    assert!(
                        !t.descriptor_blocks.contains(&c.journal_block),
                        "a copy mapped onto its descriptor"
                    );
                    assert_eq!(c.sequence, t.sequence);
                }
            }
            for (target, c) in log.latest_copies() {
                assert_eq!(target, c.target);
            }
        }
    }
    // The same bytes as one descriptor or revoke block of each layout.
    for (version, incompat) in [
        (1, 0),
        (2, 0),
        (2, FEATURE_64BIT),
        (2, FEATURE_CSUM_V2),
        (2, FEATURE_CSUM_V3 | FEATURE_64BIT),
    ] {
        let sb = crate::build::Writer::new(version, 1024, 8, incompat, 1, 1)
            .superblock()
            .clone();
        // Skip the checksum so the parser's layout code runs past it.
        let sb = Superblock {
            incompat: incompat & !(FEATURE_CSUM_V2 | FEATURE_CSUM_V3),
            ..sb
        };
        if let Some(b) = data.get(..1024) {
            if let Ok(tags) = parse_descriptor(&sb, 1, b) {
                assert!(!tags.is_empty() && tags.len() <= (1024 - 12) / sb.tag_bytes());
            }
            if let Ok(r) = parse_revoke(&sb, 1, b) {
                assert!(r.len() <= (1024 - 16) / 4);
            }
        }
    }
}
