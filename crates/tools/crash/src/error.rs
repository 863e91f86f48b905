//! Errors of the harness itself (a target that cannot be set up, a
//! workload the engine refuses). Crash-state findings are not errors: they
//! are [`crate::Violation`]s in the report.

use vdcache_image::ImageError;

/// Any error a target returns.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error("{target}: setting up the devices failed: {source}")]
    Create {
        target: String,
        #[source]
        source: BoxError,
    },
    #[error("{target}: opening the disk for the workload failed: {source}")]
    Open {
        target: String,
        #[source]
        source: BoxError,
    },
    #[error("{target}: workload seed {seed:#x}, op #{op} ({desc}) failed: {source}")]
    Workload {
        target: String,
        seed: u64,
        op: usize,
        desc: String,
        #[source]
        source: Box<ImageError>,
    },
    #[error("qemu-img check was requested but qemu-img is not installed")]
    NoQemuImg,
}
