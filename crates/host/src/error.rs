//! Errors of assembling and recovering a server's storage. Each variant's
//! text is what the user reads (the binary prints the chain of sources
//! after it), so the wording is part of the command line's behaviour.

use std::path::PathBuf;
use vdcache_cache::CacheError;
use vdcache_image::ImageError;

/// Why opening or recovering a cache device failed.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("cache {} does not exist; give its size (--cache-size) to create it", .0.display())]
    NoSizeToCreate(PathBuf),
    #[error("cache path {} names no file", .0.display())]
    NoFileName(PathBuf),
    #[error("cannot create cache {}", path.display())]
    Create {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "cannot allocate cache {} of {size} bytes{}",
        path.display(),
        free.map(|f| format!(" (its file system has {f} bytes free): give a smaller --cache-size or another file system")).unwrap_or_default()
    )]
    Resize {
        path: PathBuf,
        size: u64,
        free: Option<u64>,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{} holds {what}; vdcache formats only its own caches (and block devices given to it), so nothing was changed. Name another path for the cache",
        path.display()
    )]
    FormatRefused { path: PathBuf, what: String },
    #[error(
        "cache {}: it has no vdcache superblock but holds {what}; nothing was changed: {hint}",
        path.display()
    )]
    NotACache {
        path: PathBuf,
        what: String,
        hint: &'static str,
    },
    #[error("cannot format cache {}", path.display())]
    Format {
        path: PathBuf,
        #[source]
        source: CacheError,
    },
    #[error("cannot create cache {} (did another process create it meanwhile?)", path.display())]
    Publish {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot open cache {}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error(
        "cache {} is not a regular file; --cache-size (size) applies only when a cache file is created: remove it",
        .0.display()
    )]
    NotAFile(PathBuf),
    #[error("cannot stat cache {}", path.display())]
    Stat {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "cache {} is {have} bytes, but its size was given as {want} bytes; a cache keeps the size it was created with (omit --cache-size to use it, or remove the file to create a new cache; `vdcache recover --full` writes its dirty data back first)",
        path.display()
    )]
    SizeMismatch { path: PathBuf, have: u64, want: u64 },
    /// The cache on a device (named as the caller named it) failed to open.
    #[error("cache {device}")]
    Cache {
        device: String,
        #[source]
        source: CacheError,
    },
    #[error("{count} image(s) still need the cache {device} (it was left as it is): {failures}")]
    ImagesLeft {
        count: usize,
        device: String,
        /// `image: why` for each, separated by "; ".
        failures: String,
    },
    #[error(
        "salvaged the damaged cache {device}, but the damage took the names of {count} image(s) it held writes of: each image still marked as needing this cache (qemu-img refuses it, naming vdcache) is one, and lost those writes. Check such an image, then give up the cache's part with `vdcache recover --without-cache IMAGE` once this cache file is removed{}",
        if done.is_empty() { String::new() } else { format!(" (written back and standalone: {})", done.join(", ")) }
    )]
    SalvageLostNames {
        device: String,
        count: usize,
        done: Vec<String>,
    },
    #[error("{image}: corrupt after write-back: {}", corruptions.join("; "))]
    CorruptAfterWriteBack {
        image: String,
        corruptions: Vec<String>,
    },
    #[error(transparent)]
    CacheOp(#[from] CacheError),
    #[error(transparent)]
    Image(#[from] ImageError),
}

/// Why one image could not be made standalone by full recovery.
#[derive(Debug, thiserror::Error)]
pub enum ImageRecoveryError {
    #[error("cannot open it through the cache")]
    Open(#[source] ImageError),
    #[error("cannot write it back")]
    WriteBack(#[source] ImageError),
    #[error("{0} bytes of partially valid clusters could not be filled")]
    Unfilled(u64),
    #[error(transparent)]
    Image(#[from] ImageError),
}

pub type Result<T> = std::result::Result<T, HostError>;

/// An error and its causes, outermost first, joined by ": " (as the
/// binary prints them).
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}
