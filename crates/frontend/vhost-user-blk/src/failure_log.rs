//! The log lines of failed requests, bounded: a guest can post malformed
//! requests as fast as the queue takes them, and a line for each would
//! fill the host's disk. Each export logs at most [`LINES_PER_MINUTE`]
//! failures a minute; the others are counted (the guest got its error
//! status either way, and the export's error counter sees them all) and
//! the next line written says how many were left out.
//!
//! Owns: the per-export window and count. Must not: decide what a failure
//! is or what the guest is told (`request` does).

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Failure lines an export writes in one minute at most.
pub const LINES_PER_MINUTE: u32 = 10;
const WINDOW: Duration = Duration::from_secs(60);

#[derive(Default)]
struct Window {
    start: Option<Instant>,
    written: u32,
    left_out: u64,
}

/// One export's failure lines.
#[derive(Default)]
pub struct FailureLog {
    window: Mutex<Window>,
}

impl FailureLog {
    /// Logs `failure` of export `name` unless this minute's lines are spent.
    pub fn note(&self, name: &str, failure: &dyn std::fmt::Display) {
        let mut w = self.window.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        if w.start.is_none_or(|s| now.duration_since(s) >= WINDOW) {
            w.start = Some(now);
            w.written = 0;
        }
        if w.written >= LINES_PER_MINUTE {
            w.left_out += 1;
            return;
        }
        w.written += 1;
        let left_out = std::mem::take(&mut w.left_out);
        let last = w.written == LINES_PER_MINUTE;
        drop(w);
        let mut notes = String::new();
        if left_out > 0 {
            notes.push_str(&format!(
                " ({left_out} failed requests not logged before it)"
            ));
        }
        if last {
            notes.push_str(" (further failures this minute are counted, not logged)");
        }
        tracing::warn!(export = %name, "vhost-user-blk request failed: {failure}{notes}");
    }
}
