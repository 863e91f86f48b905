//! Deliberate bugs in the stores, for tests only: switched on, they prove
//! that a test (the crash harness's storage-server restarts among them)
//! exercises this crate's code and would notice the bug.
//!
//! Compiled only into this crate's own tests and with the
//! `deliberate-bugs` feature, which only dev-dependencies enable; a
//! production build has neither this module nor the switch. It must
//! never change behaviour while no test has switched a fault on.

use std::sync::atomic::{AtomicBool, Ordering};

/// A step a test can make the stores skip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// After a reconnection, the writes the storage server acknowledged
    /// but no flush covered are dropped instead of written again: the
    /// store serves on as if nothing happened.
    SkipRewrite,
}

static SKIP_REWRITE: AtomicBool = AtomicBool::new(false);

fn switch(fault: Fault) -> &'static AtomicBool {
    match fault {
        Fault::SkipRewrite => &SKIP_REWRITE,
    }
}

/// Whether `fault` is switched on.
pub(crate) fn active(fault: Fault) -> bool {
    switch(fault).load(Ordering::SeqCst)
}

/// Switches `fault` on, process-wide, until the guard drops (a test
/// using it must not share its process with tests that expect correct
/// stores, or must hold [`serial`] as they do).
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

/// Held by this crate's unit tests that rewrite, so that the one that
/// switches a fault on never runs beside them.
#[cfg(test)]
pub(crate) fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}
