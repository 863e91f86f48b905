//! What the command writes to standard error: its log lines (tracing,
//! filtered by `RUST_LOG` or `-v`/`-q`, text or JSON, coloured only on a
//! terminal) and, at the end of a failed run, its error in words.
//!
//! Must not: print to standard output, or decide exit codes.

use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One line of text per event (coloured on a terminal).
    Text,
    /// One JSON object per event, for log collectors.
    Json,
}

/// The crates whose info lines an operator sees at the default verbosity:
/// this command's own (what the daemon opened, served, wrote back) and
/// the host's recovery steps. The others' info lines are detail (`-v`).
const DEFAULT_FILTER: &str = "warn,vdcache=info,vdcache_host=info,vdcache_image=info,\
vdcache_cache=warn,vdcache_backend=warn,vdcache_nbd_server=warn,vdcache_nbd_proto=warn,\
vdcache_qcow2=warn,vdcache_contract=warn,vdcache_eval=warn,vdcache_replay=warn,vdcache_crash=warn";

/// The filter directives for `-v` counted `verbose` times or `-q`.
pub fn directives(verbose: u8, quiet: bool) -> &'static str {
    match (quiet, verbose) {
        (true, _) => "error",
        (false, 0) => DEFAULT_FILTER,
        (false, 1) => "info",
        (false, 2) => "debug",
        _ => "trace",
    }
}

/// Installs the log subscriber. `RUST_LOG`, when set and valid, wins over
/// `-v`/`-q`, as in every tracing-based tool; an invalid one is reported
/// once and the flags are used.
pub fn init(verbose: u8, quiet: bool, format: LogFormat) {
    let mut bad_env = None;
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.trim().is_empty() => match EnvFilter::try_new(&v) {
            Ok(f) => f,
            Err(e) => {
                bad_env = Some(format!(
                    "RUST_LOG='{v}' is not a valid filter ({e}); using the default"
                ));
                EnvFilter::new(directives(verbose, quiet))
            }
        },
        _ => EnvFilter::new(directives(verbose, quiet)),
    };
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(verbose >= 2);
    let installed = match format {
        LogFormat::Text => builder.with_ansi(colour).try_init(),
        LogFormat::Json => builder.json().with_ansi(false).try_init(),
    };
    if installed.is_ok()
        && let Some(msg) = bad_env
    {
        tracing::warn!("{msg}");
    }
}

/// An error and its causes, outermost first, each said once: a cause whose
/// text an outer message already carries (a library error that prints its
/// source, a context repeating the error it wraps) is not said again.
pub fn error_chain(e: &anyhow::Error) -> String {
    let messages: Vec<String> = e.chain().map(|c| c.to_string()).collect();
    let mut text = String::new();
    for m in messages.iter().rev() {
        let m = m.trim();
        if m.is_empty() {
            continue;
        }
        if text.is_empty() || m.contains(text.as_str()) {
            text = m.to_string();
        } else if text.starts_with(m) {
            // The inner message already begins with what this one says.
        } else {
            text = format!("{m}: {text}");
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn a_cause_already_said_is_not_repeated() {
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        let said = io.to_string();
        let e = Err::<(), _>(io)
            .context(format!("cannot listen on /x/s.sock: {said}"))
            .context("cannot listen on /x/s.sock")
            .unwrap_err();
        assert_eq!(
            error_chain(&e),
            format!("cannot listen on /x/s.sock: {said}")
        );
        let e = Err::<(), _>(std::io::Error::from(std::io::ErrorKind::NotFound))
            .context("reading a.toml")
            .unwrap_err();
        assert_eq!(error_chain(&e), format!("reading a.toml: {said}"));
    }

    #[test]
    fn verbosity_maps_to_filters() {
        assert_eq!(directives(0, true), "error");
        assert_eq!(directives(1, false), "info");
        assert!(directives(0, false).contains("vdcache=info"));
        assert!(EnvFilter::try_new(DEFAULT_FILTER).is_ok());
    }
}
