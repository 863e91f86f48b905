//! Printing to standard output and standard error that never panics.
//!
//! `println!` panics when stdout is a closed pipe (`vdcache info | head`)
//! or a closed descriptor. A command may be half way through storage work
//! when that happens (a repair, a conversion), and aborting it there would
//! leave the work half done; so the first output error stops further
//! output to that stream and is remembered: the command finishes its work,
//! and `main` then exits non-zero (see [`failure`]), as a command whose
//! output was lost must. Loops that only print (`stats --watch`) ask
//! [`stdout_failed`] and stop.
//!
//! Must not: format anything; callers print through the macros `outln!`,
//! `out!`, `errln!` and `err!`.

use std::fmt::Arguments;
use std::io::Write;
use std::sync::OnceLock;

/// The first error writing to each stream, once there was one.
static STDOUT_ERROR: OnceLock<String> = OnceLock::new();
static STDERR_ERROR: OnceLock<String> = OnceLock::new();

fn emit(gone: &OnceLock<String>, w: &mut dyn Write, args: Arguments<'_>, newline: bool) {
    if gone.get().is_some() {
        return;
    }
    let r = w
        .write_fmt(args)
        .and_then(|()| if newline { w.write_all(b"\n") } else { Ok(()) })
        .and_then(|()| w.flush());
    if let Err(e) = r {
        let _ = gone.set(e.to_string());
    }
}

/// Whether writing to stdout failed (a closed pipe, a full device).
pub fn stdout_failed() -> bool {
    STDOUT_ERROR.get().is_some()
}

/// What went wrong writing standard output or error, if anything did:
/// the command's exit status must then say it failed.
pub fn failure() -> Option<String> {
    match (STDOUT_ERROR.get(), STDERR_ERROR.get()) {
        (Some(e), _) => Some(format!("writing to standard output failed: {e}")),
        (None, Some(e)) => Some(format!("writing to standard error failed: {e}")),
        (None, None) => None,
    }
}

/// Writes to stdout; errors (a closed pipe) silence stdout for good.
pub fn stdout(args: Arguments<'_>, newline: bool) {
    emit(&STDOUT_ERROR, &mut std::io::stdout().lock(), args, newline);
}

/// Writes to stderr; errors silence stderr for good.
pub fn stderr(args: Arguments<'_>, newline: bool) {
    emit(&STDERR_ERROR, &mut std::io::stderr().lock(), args, newline);
}

/// `println!` that survives a closed stdout.
macro_rules! outln {
    () => { $crate::output::stdout(format_args!(""), true) };
    ($($t:tt)*) => { $crate::output::stdout(format_args!($($t)*), true) };
}

/// `print!` that survives a closed stdout.
macro_rules! out {
    ($($t:tt)*) => { $crate::output::stdout(format_args!($($t)*), false) };
}

/// `eprint!` that survives a closed stderr.
macro_rules! err {
    ($($t:tt)*) => { $crate::output::stderr(format_args!($($t)*), false) };
}

/// `eprintln!` that survives a closed stderr.
macro_rules! errln {
    () => { $crate::output::stderr(format_args!(""), true) };
    ($($t:tt)*) => { $crate::output::stderr(format_args!($($t)*), true) };
}
