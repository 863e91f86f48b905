//! A disk server's storage, assembled and recovered: the COW layer
//! (`vdcache-image`) over the flash cache (`vdcache-cache`) over the
//! stores (`vdcache-backend`).
//!
//! This crate owns the one recovery every caller runs: opening a cache
//! device for serving ([`device`]: create, format, open with fast
//! recovery, refuse what is not a cache) and full recovery
//! ([`recovery`]: every image the cache holds unwritten or partially
//! valid data of, or that carries its mark, opened through the cache,
//! filled, written back and unmarked, leaks repaired, a foreign device
//! handed to this host). The daemon, `vdcache recover --full` and the
//! crash harness call it; the stores images are opened from are a
//! parameter ([`StoreOpener`]), so the harness passes its recorded
//! in-memory devices and the binary local files.
//!
//! It must not contain front-end code (NBD, configuration files, command
//! line) nor reach into the cache's or the image's internals: it only
//! composes their public APIs. Fast recovery proper (checkpoint and
//! journal replay) belongs to the cache.

pub mod device;
pub mod error;
pub mod recovery;
#[cfg(any(test, feature = "deliberate-bugs"))]
pub mod testing;

pub use device::{
    abandon_cache, check_formattable, images_needing_cache, open_cache_file, open_device,
    open_for_serving, remove_created_cache,
};
pub use error::{HostError, ImageRecoveryError, Result};
pub use recovery::{FullRecovery, recover_full, recover_full_at};
pub use vdcache_image::StoreOpener;
