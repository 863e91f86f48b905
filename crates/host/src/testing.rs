//! Deliberate bugs in recovery, for tests only: switched on, they prove
//! that the crash harness runs this crate's recovery (a harness running a
//! copy of its own would not notice them).
//!
//! Compiled only into this crate's own tests and with the
//! `deliberate-bugs` feature, which only dev-dependencies enable; a
//! production build has neither this module nor the switch. It must
//! never change behaviour while no test has switched a fault on.

use std::sync::atomic::{AtomicBool, Ordering};

/// A step of recovery a test can make it skip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Full recovery leaves every image that needs the cache as it is
    /// (not opened through it, not written back, still marked) and
    /// reports success.
    SkipWriteBack,
}

static SKIP_WRITE_BACK: AtomicBool = AtomicBool::new(false);

fn switch(fault: Fault) -> &'static AtomicBool {
    match fault {
        Fault::SkipWriteBack => &SKIP_WRITE_BACK,
    }
}

/// Whether `fault` is switched on.
pub(crate) fn active(fault: Fault) -> bool {
    switch(fault).load(Ordering::SeqCst)
}

/// Switches `fault` on, process-wide, until the guard drops (a test
/// using it must not share its process with tests that expect a correct
/// recovery).
#[must_use = "the fault is switched off again when the guard drops"]
pub fn inject(fault: Fault) -> Injected {
    switch(fault).store(true, Ordering::SeqCst);
    Injected(fault)
}

/// A switched-on fault; dropping it switches the fault off.
#[derive(Debug)]
pub struct Injected(Fault);

impl Drop for Injected {
    fn drop(&mut self) {
        switch(self.0).store(false, Ordering::SeqCst);
    }
}
