//! The error that crosses the boundary between the COW layer and the
//! layers below it, typed by what the COW layer (and a front end above it)
//! must do about it: report a full store, report a failed I/O, refuse
//! corrupt data, or wait for an unreachable storage server.
//!
//! Every variant keeps the words of the layer that failed: its `Display` is
//! exactly that of the `io::Error` the layer would have returned, and
//! converting back to an `io::Error` gives that error again (with its errno
//! and, for store faults, the fault inside), so no message or errno changes
//! on the way through.

use std::io;
use vdcache_backend::StoreFault;

/// ENOSPC on Linux.
const ENOSPC: i32 = 28;
/// EIO: what a failure without an errno of its own reports.
const EIO: i32 = 5;

/// Why an I/O through the contract failed.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// The store (or the layer in between) has no room for the write.
    #[error(transparent)]
    NoSpace(io::Error),
    /// A store that lives elsewhere could not do what was asked (see
    /// [`StoreFault`]).
    /// (Boxed: a fault carries its words, and every result of the COW
    /// layer carries this error.)
    #[error(transparent)]
    Store(Box<StoreFault>),
    /// Data read back does not verify (a damaged cache device, a block
    /// whose only copy is lost).
    #[error("{0}")]
    Corrupt(String),
    /// Any other failure of the I/O itself.
    #[error(transparent)]
    Io(io::Error),
    /// The layer refused for a reason of its own, in its words (an image
    /// that is not the one a cache holds data of, a device of another host).
    #[error("{0}")]
    Refused(String),
}

pub type Result<T> = std::result::Result<T, HostError>;

impl HostError {
    /// The errno a front end reports for this error.
    pub fn errno(&self) -> i32 {
        match self {
            HostError::NoSpace(_) => ENOSPC,
            HostError::Io(e) => e.raw_os_error().unwrap_or(EIO),
            HostError::Store(_) | HostError::Corrupt(_) | HostError::Refused(_) => EIO,
        }
    }

    /// The store fault behind this error, if a store reported one.
    pub fn store_fault(&self) -> Option<&StoreFault> {
        match self {
            HostError::Store(f) => Some(f.as_ref()),
            _ => None,
        }
    }

    /// Whether the store could not be reached (its requests cannot progress
    /// until the storage server is back).
    pub fn is_unreachable(&self) -> bool {
        self.store_fault().is_some_and(StoreFault::stops_requests)
    }
}

impl From<io::Error> for HostError {
    /// Sorts an `io::Error` of a store by what it means: ENOSPC is a full
    /// store, a [`StoreFault`] inside is that fault, anything else an I/O
    /// failure.
    fn from(e: io::Error) -> HostError {
        if e.raw_os_error() == Some(ENOSPC) {
            return HostError::NoSpace(e);
        }
        if StoreFault::find(&e).is_none() {
            return HostError::Io(e);
        }
        match e.into_inner().map(|inner| inner.downcast::<StoreFault>()) {
            Some(Ok(fault)) => HostError::Store(fault),
            // Unreachable: `find` saw a fault inside. Kept total anyway.
            Some(Err(inner)) => HostError::Io(io::Error::other(inner)),
            None => HostError::Io(io::Error::other("store fault without a cause")),
        }
    }
}

impl From<StoreFault> for HostError {
    fn from(f: StoreFault) -> HostError {
        HostError::Store(Box::new(f))
    }
}

impl From<HostError> for io::Error {
    /// The `io::Error` the layer would have returned: the same text, errno
    /// and store fault.
    fn from(e: HostError) -> io::Error {
        match e {
            HostError::NoSpace(e) | HostError::Io(e) => e,
            HostError::Store(f) => (*f).into_io(),
            HostError::Corrupt(s) | HostError::Refused(s) => io::Error::other(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enospc_is_no_space_and_round_trips() {
        let e = HostError::from(io::Error::from_raw_os_error(ENOSPC));
        assert!(matches!(e, HostError::NoSpace(_)), "{e:?}");
        assert_eq!(e.errno(), ENOSPC);
        assert_eq!(io::Error::from(e).raw_os_error(), Some(ENOSPC));
    }

    #[test]
    fn store_faults_stay_reachable() {
        let fault = StoreFault::Unreachable {
            uri: "nbd://x".into(),
            waited_secs: 1.0,
            delay_secs: 1.0,
            last_error: "refused".into(),
        };
        let text = fault.to_string();
        let e = HostError::from(fault.into_io());
        assert!(e.is_unreachable());
        assert_eq!(e.errno(), EIO);
        assert_eq!(e.to_string(), text);
        let back = io::Error::from(e);
        assert!(StoreFault::is_unreachable(&back));
        assert_eq!(back.kind(), io::ErrorKind::NotConnected);
        assert_eq!(back.to_string(), text);
    }

    #[test]
    fn other_errors_keep_errno_and_text() {
        let e = HostError::from(io::Error::from_raw_os_error(5));
        assert!(matches!(e, HostError::Io(_)));
        assert_eq!(e.errno(), 5);
        let e = HostError::from(io::Error::other("boom"));
        assert_eq!(e.errno(), EIO);
        assert_eq!(e.to_string(), "boom");
        let c = HostError::Corrupt("bad block".into());
        assert_eq!(io::Error::from(c).to_string(), "bad block");
    }
}
