//! Value types both ends of the protocol exchange: the block size
//! constraints an export advertises, the flags of a WRITE_ZEROES request,
//! and one run of a block status answer.
//!
//! Owns: these types and their mapping onto wire flags.
//! Must not: know about sockets, exports or either end's state.

use crate::proto;

/// Block size constraints advertised with `NBD_INFO_BLOCK_SIZE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizes {
    /// Smallest addressable unit (power of two, 1..=65536).
    pub minimum: u32,
    /// Size at which aligned I/O is efficient (power of two, >= max(minimum, 512)).
    pub preferred: u32,
    /// Largest payload of one READ/WRITE (multiple of `minimum`); the server
    /// caps it at its own payload limit.
    pub maximum: u32,
}

impl Default for BlockSizes {
    fn default() -> Self {
        BlockSizes {
            minimum: 1,
            preferred: 4096,
            maximum: 32 << 20,
        }
    }
}

/// Flags of a WRITE_ZEROES request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZeroFlags {
    /// The area must stay allocated (`NBD_CMD_FLAG_NO_HOLE`): no punching.
    pub no_hole: bool,
    /// Fail with `NBD_ENOTSUP` unless zeroing is faster than
    /// writing zeroes (`NBD_CMD_FLAG_FAST_ZERO`); change nothing on failure.
    pub fast_zero: bool,
    /// Persist before returning (`NBD_CMD_FLAG_FUA`).
    pub fua: bool,
}

/// One run of a block status answer (`base:allocation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Length in bytes, nonzero.
    pub length: u64,
    /// Not allocated in the backing store (`NBD_STATE_HOLE`).
    pub hole: bool,
    /// Reads as zeroes (`NBD_STATE_ZERO`).
    pub zero: bool,
}

impl Extent {
    /// `base:allocation` flags of this extent.
    pub fn flags(&self) -> u32 {
        (if self.hole { proto::STATE_HOLE } else { 0 })
            | (if self.zero { proto::STATE_ZERO } else { 0 })
    }
}
