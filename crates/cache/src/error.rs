//! Errors of the flash cache tier.

/// Why a cache operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("not a vdcache cache device (no superblock); format it first")]
    NotACache,
    #[error("cache device is corrupt: {0}")]
    Corrupt(String),
    #[error("cache device {op} failed: {cause}")]
    Device {
        op: &'static str,
        cause: std::io::Error,
    },
    #[error(
        "cache device belongs to host '{owner}', not this host '{this}'; write its dirty data back with `vdcache recover --full --cache PATH`, which then hands the device to this host"
    )]
    ForeignHost { owner: String, this: String },
    #[error("image {name} does not match what the cache recorded: {reason}")]
    WrongImage { name: String, reason: String },
    #[error("invalid cache setting: {0}")]
    Config(String),
    #[error(transparent)]
    Image(#[from] vdcache_image::ImageError),
}

impl CacheError {
    /// Maps an I/O error of the cache device, naming the operation.
    pub fn device(op: &'static str) -> impl FnOnce(std::io::Error) -> CacheError {
        move |cause| CacheError::Device { op, cause }
    }
}

pub type Result<T> = std::result::Result<T, CacheError>;
