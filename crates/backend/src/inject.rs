//! Fault injection for tests: a backend running hooks before its writes
//! and flushes (to fail them, or hold them), and a gate a hook holds an
//! I/O at until the test opens it.
//!
//! Owns: the hooks; the gate's open flag, who waited, and a timeout after
//! which the gate opens by itself, so that a test whose other requests
//! wait for the held one fails (`opened_by_timeout`) instead of hanging.
//! Must not: be used on a production path.

use crate::{Backend, BackendRef};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a gate stays closed at most, and how long [`eventually`]
/// polls.
pub const GATE_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Default)]
pub struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
    /// Waits that found the gate closed.
    held: AtomicU64,
    opened_by_timeout: AtomicBool,
}

impl Gate {
    /// Waits until the gate is open (or [`GATE_TIMEOUT`] passed).
    pub fn wait(&self) {
        let open = self.lock();
        if !*open {
            self.held.fetch_add(1, Ordering::SeqCst);
        }
        let (mut open, timeout) = self
            .opened
            .wait_timeout_while(open, GATE_TIMEOUT, |open| !*open)
            .unwrap_or_else(|p| p.into_inner());
        if timeout.timed_out() {
            self.opened_by_timeout.store(true, Ordering::SeqCst);
            *open = true;
            self.opened.notify_all();
        }
    }

    pub fn release(&self) {
        *self.lock() = true;
        self.opened.notify_all();
    }

    pub fn is_open(&self) -> bool {
        *self.lock()
    }

    /// Waits that found the gate closed.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::SeqCst)
    }

    pub fn opened_by_timeout(&self) -> bool {
        self.opened_by_timeout.load(Ordering::SeqCst)
    }

    fn lock(&self) -> MutexGuard<'_, bool> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }
}

type Hook = Box<dyn Fn() -> io::Result<()> + Send + Sync>;

/// A backend whose reads, writes and flushes first run a hook (a read's
/// hook is told its length); an error from the hook fails the request
/// without reaching the inner backend. Flushes also
/// run a hook after the inner one (a sync that takes its time after the
/// point it covers). Write-out hints are shown to a hook, then passed on.
pub struct HookedBackend {
    inner: BackendRef,
    before_read: Box<dyn Fn(usize) -> io::Result<()> + Send + Sync>,
    before_write: Hook,
    before_flush: Hook,
    after_flush: Hook,
    on_start_writeback: Box<dyn Fn(u64, u64) + Send + Sync>,
}

impl HookedBackend {
    pub fn new(inner: BackendRef) -> HookedBackend {
        HookedBackend {
            inner,
            before_read: Box::new(|_| Ok(())),
            before_write: Box::new(|| Ok(())),
            before_flush: Box::new(|| Ok(())),
            after_flush: Box::new(|| Ok(())),
            on_start_writeback: Box::new(|_, _| {}),
        }
    }

    pub fn on_read(self, hook: impl Fn(usize) -> io::Result<()> + Send + Sync + 'static) -> Self {
        HookedBackend {
            before_read: Box::new(hook),
            ..self
        }
    }

    pub fn on_write(self, hook: impl Fn() -> io::Result<()> + Send + Sync + 'static) -> Self {
        HookedBackend {
            before_write: Box::new(hook),
            ..self
        }
    }

    pub fn on_flush(self, hook: impl Fn() -> io::Result<()> + Send + Sync + 'static) -> Self {
        HookedBackend {
            before_flush: Box::new(hook),
            ..self
        }
    }

    pub fn after_flush(self, hook: impl Fn() -> io::Result<()> + Send + Sync + 'static) -> Self {
        HookedBackend {
            after_flush: Box::new(hook),
            ..self
        }
    }

    pub fn on_start_writeback(self, hook: impl Fn(u64, u64) + Send + Sync + 'static) -> Self {
        HookedBackend {
            on_start_writeback: Box::new(hook),
            ..self
        }
    }
}

impl std::fmt::Debug for HookedBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HookedBackend")
            .field("inner", &self.inner)
            .finish()
    }
}

impl Backend for HookedBackend {
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        (self.before_read)(buf.len())?;
        self.inner.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        (self.before_write)()?;
        self.inner.write_at(buf, offset)
    }

    fn flush(&self) -> io::Result<()> {
        (self.before_flush)()?;
        self.inner.flush()?;
        (self.after_flush)()
    }

    fn start_writeback(&self, offset: u64, len: u64) {
        (self.on_start_writeback)(offset, len);
        self.inner.start_writeback(offset, len);
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.discard(offset, len)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(len)
    }

    fn can_grow(&self) -> bool {
        self.inner.can_grow()
    }

    fn name(&self) -> &str {
        self.inner.name()
    }

    fn identity(&self) -> io::Result<crate::StoreIdentity> {
        self.inner.identity()
    }
}

/// Polls `cond` every millisecond until it holds (true) or
/// [`GATE_TIMEOUT`] passed (false).
pub fn eventually(cond: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + GATE_TIMEOUT;
    while !cond() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemBackend;
    use std::sync::Arc;

    #[test]
    fn hooks_fail_writes_and_flushes_before_they_reach_the_backend() {
        let mem = Arc::new(MemBackend::fixed("m", 8));
        let failing = Arc::new(AtomicBool::new(true));
        let f = failing.clone();
        let hooked = HookedBackend::new(mem.clone())
            .on_write(move || match f.load(Ordering::SeqCst) {
                true => Err(io::Error::other("injected")),
                false => Ok(()),
            })
            .on_flush(|| Err(io::Error::other("injected")));
        assert!(hooked.write_at(&[7], 0).is_err());
        assert!(hooked.flush().is_err());
        let mut b = [0u8; 1];
        mem.read_at(&mut b, 0).expect("read");
        assert_eq!(b, [0]);
        failing.store(false, Ordering::SeqCst);
        hooked.write_at(&[7], 0).expect("write");
        hooked.read_at(&mut b, 0).expect("read");
        assert_eq!(b, [7]);
    }

    #[test]
    fn a_waiter_passes_once_released_and_is_counted() {
        let gate = Gate::default();
        std::thread::scope(|s| {
            let waiter = s.spawn(|| gate.wait());
            assert!(eventually(|| gate.held() == 1));
            assert!(!waiter.is_finished());
            gate.release();
            waiter.join().expect("waiter");
        });
        gate.wait();
        assert_eq!(gate.held(), 1, "an open gate holds nobody");
        assert!(!gate.opened_by_timeout());
    }
}
