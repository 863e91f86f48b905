//! Errors of the COW layer, each naming the image it concerns.

use vdcache_contract::HostError;
use vdcache_qcow2::FormatError;

/// Why an image or chain operation failed. Each message is complete in
/// itself (the cause is part of the text, not a separate source), so a
/// chain printer does not repeat it.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("{image}: {cause}")]
    Format { image: String, cause: FormatError },
    /// An I/O of the store or the layer below failed; `cause` says how
    /// (a full store, an unreachable server, corrupt data, ...).
    #[error("{image}: {op} failed: {cause}")]
    Io {
        image: String,
        op: &'static str,
        cause: HostError,
    },
    #[error(transparent)]
    Lock(#[from] vdcache_backend::LockError),
    #[error("{image}: backing file '{backing}' cannot be opened: {cause}")]
    BackingMissing {
        image: String,
        backing: String,
        cause: Box<ImageError>,
    },
    /// A name in an image's header that leads outside the places its
    /// chain may reach (see `confine`).
    #[error(transparent)]
    NotAllowed(Box<NotAllowed>),
    #[error("backing chain loops: {0} appears twice")]
    ChainLoop(String),
    #[error("backing chain is longer than {0} images")]
    ChainTooLong(usize),
    #[error(
        "{image}: backing file '{backing}' has no recorded format and looks like qcow2; refusing to probe it (a raw disk could forge a qcow2 header). Record the format with: qemu-img rebase -u -b '{backing}' -F qcow2 '{image}'"
    )]
    UnsafeProbe { image: String, backing: String },
    #[error("{image}: backing format '{format}' is not supported (use qcow2 or raw)")]
    UnsupportedFormat { image: String, format: String },
    #[error("{image}: {reason}")]
    Corrupt { image: String, reason: String },
    #[error("{image}: {reason}")]
    Unsupported { image: String, reason: String },
    #[error("{image} is opened read-only")]
    ReadOnly { image: String },
    #[error("request at offset {offset} length {len} is past the end of the {size}-byte disk")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("{image}: no space left: the store is {capacity} bytes and cannot grow")]
    NoSpace { image: String, capacity: u64 },
    #[error(
        "{image}: its newest data is in the vdcache cache {cache}, so the file alone is out of date. Serve it with that cache (--cache {cache}), or write the data back with `vdcache recover --full --cache {cache}`; if that cache is lost, `vdcache recover --without-cache {image}` makes the file usable again, without what the cache held"
    )]
    InCache { image: String, cache: String },
    #[error(
        "{image}: its newest data is in the vdcache cache that was at {cache}, but the cache there now is another one (its id differs): was the cache file replaced? Put the original back and serve again; if it is lost, `vdcache recover --without-cache {image}` makes the file usable again, without what the cache held"
    )]
    CacheReplaced { image: String, cache: String },
    #[error(
        "{image}: the cache {cache} that holds its newest data is still there and intact, so that data is not lost; nothing was changed. Write it back with `vdcache recover --full --cache {cache}` (or serve the image with that cache). To give that data up anyway, move the cache file away first"
    )]
    CacheStillThere { image: String, cache: String },
    #[error(
        "a write acknowledged before its copy-on-write completed was lost ({cause}); every flush of this disk fails until it is closed (its other writes are flushed regardless)"
    )]
    DeferredWriteLost { cause: String },
}

/// A backing file or external data file outside the places its chain may
/// reach.
#[derive(Debug, thiserror::Error)]
#[error(
    "{image}: {what} '{named}' resolves to {canonical}, outside what its chain may reach ({places}): a chain reaches only its top image's directory tree and storage server unless the operator allows more. If this file is meant, allow its place with --allow-backing {allow} (allow_backing in the [storage] section of a config file); nothing was changed",
    allow = crate::confine::widening(.canonical)
)]
pub struct NotAllowed {
    /// The image whose header names it.
    pub image: String,
    /// `backing file` or `external data file`.
    pub what: &'static str,
    /// The name as the header gives it.
    pub named: String,
    /// What it resolves to (symlinks followed).
    pub canonical: String,
    /// The places the chain may reach, listed.
    pub places: String,
}

impl ImageError {
    pub(crate) fn io(image: &str, op: &'static str, cause: impl Into<HostError>) -> Self {
        ImageError::Io {
            image: image.to_string(),
            op,
            cause: cause.into(),
        }
    }

    pub(crate) fn format(image: &str, cause: FormatError) -> Self {
        ImageError::Format {
            image: image.to_string(),
            cause,
        }
    }

    pub(crate) fn corrupt(image: &str, reason: impl Into<String>) -> Self {
        ImageError::Corrupt {
            image: image.to_string(),
            reason: reason.into(),
        }
    }

    /// The errno an NBD server should report for this error.
    pub fn errno(&self) -> i32 {
        match self {
            ImageError::ReadOnly { .. } => libc_eperm(),
            ImageError::OutOfRange { .. } => 22,
            ImageError::NoSpace { .. } => 28,
            ImageError::Io { cause, .. } => cause.errno(),
            _ => 5,
        }
    }
}

fn libc_eperm() -> i32 {
    1
}

pub type Result<T> = std::result::Result<T, ImageError>;

impl From<ImageError> for std::io::Error {
    /// An I/O failure keeps its own error (and whatever typed fault the
    /// store put in it); anything else becomes an opaque one.
    fn from(e: ImageError) -> std::io::Error {
        match e {
            ImageError::Io { cause, .. } => cause.into(),
            other => std::io::Error::other(other),
        }
    }
}

impl From<ImageError> for HostError {
    /// For the layer below that calls back into the COW layer (see
    /// `BackingFill`): an I/O failure keeps its own cause, corrupt data
    /// stays corrupt, anything else is an I/O failure in the COW layer's
    /// words.
    fn from(e: ImageError) -> HostError {
        match e {
            ImageError::Io { cause, .. } => cause,
            e @ (ImageError::Corrupt { .. } | ImageError::Format { .. }) => {
                HostError::Corrupt(e.to_string())
            }
            other => HostError::Io(std::io::Error::other(other)),
        }
    }
}
