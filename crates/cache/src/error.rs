//! Errors of the flash cache tier.

/// Why a cache operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("not a vdcache cache device (no valid superblock)")]
    NotACache,
    #[error(
        "{device} has no vdcache superblock but holds {what}; refusing to format it (nothing was changed)"
    )]
    NotBlank { device: String, what: String },
    #[error(
        "{device} is a cache that still holds data not written back of {images}; refusing to format it (nothing was changed): write that data back first with `vdcache recover --full --cache {device}`"
    )]
    HoldsDirty { device: String, images: String },
    #[error("cache device is corrupt: {0}")]
    Corrupt(String),
    #[error(
        "the cache device {device} is damaged: {what}. Affected: {affected}. Nothing was changed. Writes the damage touched are lost; `vdcache recover --full --salvage --cache {device}` writes back everything that still verifies and leaves the images standalone (check them afterwards)"
    )]
    Damaged {
        device: String,
        what: String,
        affected: String,
    },
    #[error(
        "cache device {op} failed: {cause}{}",
        full_hint(cause, "the cache device's file system")
    )]
    Device {
        op: &'static str,
        cause: std::io::Error,
    },
    /// An image's store (its file, its storage server) failed, not the
    /// cache device.
    #[error(
        "{op} {image} failed: {cause}{}",
        full_hint(cause, "the file system holding it")
    )]
    Store {
        op: &'static str,
        image: String,
        cause: std::io::Error,
    },
    #[error(
        "cache device belongs to host '{owner}', not this host '{this}'; write its dirty data back with `vdcache recover --full --cache PATH`, which then hands the device to this host"
    )]
    ForeignHost { owner: String, this: String },
    #[error(
        "{name} is not the image the cache {cache} holds unwritten data of: {reason}. Its data in the cache would be lost: put the original file back and serve it (or run `vdcache recover --full --cache {cache}`), or, to give up that data, remove the cache file"
    )]
    WrongImage {
        name: String,
        reason: String,
        cache: String,
    },
    #[error(
        "the cache holds unwritten data of this image from an earlier time: a later session wrote the image back completely, which the cache does not remember (is the cache file a copy, restored from a backup?). Serving or recovering with it would overwrite newer data: put the newest cache file back, or, to give up what this one holds, remove it"
    )]
    StaleCache,
    #[error("invalid cache setting: {0}")]
    Config(String),
    #[error(
        "{image}: the cache block at offset {offset} held data not yet written back, and the cache device no longer returns it intact: that data is lost (the guest gets an I/O error there until it writes the block again)"
    )]
    Unreadable { image: String, offset: u64 },
    #[error(
        "write-back gave up: {fault}; the dirty data stays in the cache and is written back once the storage server is reachable"
    )]
    Unreachable { fault: vdcache_backend::StoreFault },
    #[error(
        "write-back failed {rounds} times in a row, last: {last}; the dirty data stays safe in the cache and is written back once the cause is fixed (a later flush, a restart or `vdcache recover --full` tries again)"
    )]
    WriteBackFailing { rounds: u64, last: String },
}

impl CacheError {
    /// Maps an I/O error of the cache device, naming the operation.
    pub fn device(op: &'static str) -> impl FnOnce(std::io::Error) -> CacheError {
        move |cause| CacheError::Device { op, cause }
    }

    /// Maps an I/O error of an image's store, naming the operation and
    /// the image.
    pub fn store(
        op: &'static str,
        store: &dyn vdcache_backend::Backend,
    ) -> impl FnOnce(std::io::Error) -> CacheError {
        let image = store.name().to_string();
        move |cause| CacheError::Store { op, image, cause }
    }
}

/// " (WHERE is full)" when `cause` says a file system or quota is full.
fn full_hint(cause: &std::io::Error, place: &str) -> String {
    match cause.kind() {
        std::io::ErrorKind::StorageFull => format!(" ({place} is full)"),
        std::io::ErrorKind::QuotaExceeded => format!(" ({place} is over its quota)"),
        _ => String::new(),
    }
}

impl CacheError {
    /// The unreachable store behind this error, if that is what it is: a
    /// backend request that failed because its storage server stayed away
    /// for the whole reconnect delay.
    pub fn unreachable_store(&self) -> Option<&vdcache_backend::StoreFault> {
        let cause = match self {
            CacheError::Unreachable { fault } => return Some(fault),
            CacheError::Device { cause, .. } | CacheError::Store { cause, .. } => cause,
            _ => return None,
        };
        vdcache_backend::StoreFault::find(cause)
            .filter(|_| vdcache_backend::StoreFault::is_unreachable(cause))
    }
}

pub type Result<T> = std::result::Result<T, CacheError>;
