//! Typed errors for malformed or unsupported images. Each variant names the
//! structure or field at fault so that an operator can act on the message.

/// Why an image (or part of one) cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FormatError {
    #[error("not a qcow2 image: magic is {found:#010x}, expected 0x514649fb (\"QFI\\xfb\")")]
    BadMagic { found: u32 },
    #[error("truncated {what}: needs {need} bytes, only {have} available")]
    Truncated {
        what: &'static str,
        need: u64,
        have: u64,
    },
    #[error("invalid {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error("unsupported {field}: {reason}")]
    Unsupported { field: &'static str, reason: String },
    #[error("image uses incompatible features this implementation does not know: {0}")]
    UnknownIncompatibleFeatures(String),
    #[error("compressed cluster at host offset {offset:#x} does not decompress: {reason}")]
    Decompress { offset: u64, reason: String },
}

impl FormatError {
    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        FormatError::Invalid {
            field,
            reason: reason.into(),
        }
    }

    pub(crate) fn unsupported(field: &'static str, reason: impl Into<String>) -> Self {
        FormatError::Unsupported {
            field,
            reason: reason.into(),
        }
    }
}
