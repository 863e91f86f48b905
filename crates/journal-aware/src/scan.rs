//! The walk of the log, as the kernel's recovery scan does it: from the
//! superblock's start and sequence, one transaction after another
//! (descriptor blocks and the data blocks their tags name, revoke blocks,
//! then a commit block), wrapping at the end of the log, until a block is
//! not the next expected metadata block.
//!
//! Must not: trust a data block whose checksum fails (it is left out of the
//! mapping and counted), or loop more than once around the log.

use crate::{
    COMMIT, DESCRIPTOR, Header, Jbd2Error, REVOKE, Superblock, TAG_DELETED, commit_checksum_ok,
    parse_descriptor, parse_revoke,
};
use std::collections::BTreeMap;

/// One file-system block's copy in the journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy {
    /// File-system block number.
    pub target: u64,
    /// Journal block holding the copy.
    pub journal_block: u32,
    /// The copy's first four bytes were zeroed (see [`crate::unescape`]).
    pub escaped: bool,
    pub sequence: u32,
}

/// One transaction of the log.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Transaction {
    pub sequence: u32,
    pub descriptor_blocks: Vec<u32>,
    pub copies: Vec<Copy>,
    pub revoked: Vec<u64>,
    /// Where its commit block is; None for the unfinished last one.
    pub commit_block: Option<u32>,
}

/// What the live part of a journal holds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Log {
    /// Committed transactions, oldest first: what recovery replays.
    pub committed: Vec<Transaction>,
    /// A transaction begun but not committed (recovery ignores it).
    pub uncommitted: Option<Transaction>,
    /// The sequence the next transaction will carry.
    pub next_sequence: u32,
    /// Journal copies left out because their checksum failed.
    pub bad_copies: Vec<Jbd2Error>,
}

impl Log {
    /// For each file-system block, its newest committed journal copy that
    /// no later revoke cancels: what recovery would write, and where.
    pub fn latest_copies(&self) -> BTreeMap<u64, Copy> {
        let Some(first) = self.committed.first().map(|t| t.sequence) else {
            return BTreeMap::new();
        };
        let rank = |s: u32| s.wrapping_sub(first);
        let mut revoked: BTreeMap<u64, u32> = BTreeMap::new();
        for t in &self.committed {
            for &b in &t.revoked {
                let r = revoked.entry(b).or_insert(rank(t.sequence));
                *r = (*r).max(rank(t.sequence));
            }
        }
        let mut out = BTreeMap::new();
        for t in &self.committed {
            for c in &t.copies {
                if revoked
                    .get(&c.target)
                    .is_some_and(|&r| r >= rank(t.sequence))
                {
                    continue;
                }
                out.insert(c.target, *c);
            }
        }
        out
    }
}

/// Walks the log of the journal whose superblock is `sb`; `block(n)` hands
/// in journal block `n` (None if it cannot).
pub fn scan<'a>(
    sb: &Superblock,
    block: impl Fn(u32) -> Option<&'a [u8]>,
) -> Result<Log, Jbd2Error> {
    let mut log = Log {
        next_sequence: sb.sequence,
        ..Log::default()
    };
    if sb.start == 0 {
        return Ok(log);
    }
    let get = |n: u32| -> Result<&'a [u8], Jbd2Error> {
        let b = block(n).ok_or(Jbd2Error::Missing(n))?;
        if b.len() != sb.block_size as usize {
            return Err(Jbd2Error::Block {
                block: n,
                reason: format!("{} bytes handed in, blocks are {}", b.len(), sb.block_size),
            });
        }
        Ok(b)
    };
    let room = sb.log_end() - sb.first;
    let mut at = sb.start;
    let mut used = 0u32;
    let mut seq = sb.sequence;
    let mut cur: Option<Transaction> = None;
    let new = |seq| Transaction {
        sequence: seq,
        ..Transaction::default()
    };
    while used < room {
        let b = get(at)?;
        let Some(h) = Header::of(b) else { break };
        if h.sequence != seq {
            break;
        }
        match h.block_type {
            DESCRIPTOR => {
                let tags = parse_descriptor(sb, at, b)?;
                let t = cur.get_or_insert_with(|| new(seq));
                t.descriptor_blocks.push(at);
                at = sb.next(at);
                used += 1;
                for tag in tags {
                    if used >= room {
                        return Err(Jbd2Error::Block {
                            block: *t.descriptor_blocks.last().unwrap_or(&at),
                            reason: "its tags name more blocks than the log holds".into(),
                        });
                    }
                    let data = get(at)?;
                    let computed = sb.data_checksum(seq, data);
                    if sb.csum_v2_or_v3() && computed != tag.checksum {
                        log.bad_copies.push(Jbd2Error::Checksum {
                            block: at,
                            what: "data",
                            found: tag.checksum,
                            computed,
                        });
                    } else if tag.flags & TAG_DELETED == 0 {
                        t.copies.push(Copy {
                            target: tag.target,
                            journal_block: at,
                            escaped: tag.escaped(),
                            sequence: seq,
                        });
                    }
                    at = sb.next(at);
                    used += 1;
                }
            }
            REVOKE => {
                let blocks = parse_revoke(sb, at, b)?;
                cur.get_or_insert_with(|| new(seq)).revoked.extend(blocks);
                at = sb.next(at);
                used += 1;
            }
            COMMIT => {
                if !commit_checksum_ok(sb, b) {
                    // A torn commit: the log ends before it, as in recovery.
                    break;
                }
                let mut t = cur.take().unwrap_or_else(|| new(seq));
                t.commit_block = Some(at);
                log.committed.push(t);
                seq = seq.wrapping_add(1);
                at = sb.next(at);
                used += 1;
            }
            other => {
                return Err(Jbd2Error::Block {
                    block: at,
                    reason: format!("block type {other} inside the log"),
                });
            }
        }
    }
    log.uncommitted = cur;
    log.next_sequence = seq;
    Ok(log)
}
