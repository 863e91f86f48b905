//! Printing to standard output and standard error that never panics.
//!
//! `println!` panics when stdout is a closed pipe (`vdcache info | head`)
//! or a closed descriptor. A command may be half way through storage work
//! when that happens (a repair, a conversion), and aborting it there would
//! leave the work half done; so output errors are swallowed: the first one
//! stops further output to that stream, and the command finishes its work
//! and exits with the code it would have had.
//!
//! Must not: decide exit codes or format anything; callers print through
//! the macros `outln!`, `out!`, `errln!` and `err!`.

use std::fmt::Arguments;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

static STDOUT_GONE: AtomicBool = AtomicBool::new(false);
static STDERR_GONE: AtomicBool = AtomicBool::new(false);

fn emit(gone: &AtomicBool, w: &mut dyn Write, args: Arguments<'_>, newline: bool) {
    if gone.load(Ordering::Relaxed) {
        return;
    }
    let r = w
        .write_fmt(args)
        .and_then(|()| if newline { w.write_all(b"\n") } else { Ok(()) })
        .and_then(|()| w.flush());
    if r.is_err() {
        gone.store(true, Ordering::Relaxed);
    }
}

/// Writes to stdout; errors (a closed pipe) silence stdout for good.
pub fn stdout(args: Arguments<'_>, newline: bool) {
    emit(&STDOUT_GONE, &mut std::io::stdout().lock(), args, newline);
}

/// Writes to stderr; errors silence stderr for good.
pub fn stderr(args: Arguments<'_>, newline: bool) {
    emit(&STDERR_GONE, &mut std::io::stderr().lock(), args, newline);
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
