//! The `vdcache` command: create, inspect, check, drive and convert qcow2
//! chains with the tools' familiar options (qemu-img, qemu-io), and run the
//! demo and benchmarks. Argument parsing and reporting only; all storage
//! logic lives in the library crates.

#[macro_use]
mod output;
mod backing_args;
mod cmd_bench;
mod cmd_check;
mod cmd_convert;
mod cmd_create;
mod cmd_demo;
mod cmd_docs;
mod cmd_info;
mod cmd_io;
mod cmd_plot;
mod cmd_replay;
mod cmd_serve;
mod cmd_soak;
mod logging;
mod meta_args;
mod serve;
mod soak;

use vdcache::size;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "vdcache",
    version,
    about = "A virtual disk server for qcow2 chains with a COW-aware flash cache"
)]
pub struct Cli {
    /// More log output (repeat for more; RUST_LOG, when set, takes precedence).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    /// Log errors only: a clean run prints nothing on standard error.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    quiet: bool,
    /// Log lines as text (coloured on a terminal) or as JSON objects.
    #[arg(long, global = true, value_enum, default_value_t = logging::LogFormat::Text)]
    log_format: logging::LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create an image (like qemu-img create).
    Create(cmd_create::Args),
    /// Show an image and its backing chain (like qemu-img info).
    Info(cmd_info::Args),
    /// Check an image's consistency (like qemu-img check; exit 0 clean, 2 corrupt, 3 leaks, 1 error).
    Check(cmd_check::Args),
    /// Run qemu-io style commands against an image.
    Io(cmd_io::Args),
    /// Convert an image or chain to raw or qcow2 (like qemu-img convert).
    Convert(cmd_convert::Args),
    /// Create a chain in a scratch directory, write, read back and check it.
    Demo(cmd_demo::Args),
    /// Serve disks over NBD, optionally through a flash cache.
    Serve(Box<cmd_serve::ServeArgs>),
    /// Statistics of a running server.
    Stats(cmd_serve::StatsArgs),
    /// Write every dirty block of a running server back to its images.
    Flush(cmd_serve::FlushArgs),
    /// Change an export's share of a running server's cache (with [cache]
    /// shares on).
    Share(cmd_serve::ShareArgs),
    /// Recover a cache device offline (--full: write everything back).
    Recover(cmd_serve::RecoverArgs),
    /// Benchmarks (not tests): measure the engine next to QEMU's tools.
    Bench(cmd_bench::Args),
    /// Draw a chart described in JSON (what the bench scripts write) as SVG and PNG.
    Plot(cmd_plot::Args),
    /// Replay a block trace (MSR, FIU, blkparse, fio) through the real engine and cache.
    Replay(Box<cmd_replay::Args>),
    /// Kill -9 restarts of `vdcache serve` under a flushing write load; every flushed write must survive.
    Soak(Box<cmd_soak::Args>),
    /// Write a synthetic block trace of a workload class (boot storm, OLTP, file server).
    TraceGen(cmd_replay::GenArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions(cmd_docs::CompletionArgs),
    /// Write man pages (vdcache.1 and one per command) into a directory.
    Man(cmd_docs::ManArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    logging::init(cli.verbose, cli.quiet, cli.log_format);
    let result = match cli.command {
        Command::Create(a) => cmd_create::run(a),
        Command::Info(a) => cmd_info::run(a),
        Command::Check(a) => cmd_check::run(a),
        Command::Io(a) => cmd_io::run(a),
        Command::Convert(a) => cmd_convert::run(a),
        Command::Demo(a) => cmd_demo::run(a),
        Command::Serve(a) => cmd_serve::serve(*a),
        Command::Stats(a) => cmd_serve::stats(a),
        Command::Flush(a) => cmd_serve::flush(a),
        Command::Share(a) => cmd_serve::share(a),
        Command::Recover(a) => cmd_serve::recover(a),
        Command::Bench(a) => cmd_bench::run(a),
        Command::Plot(a) => cmd_plot::run(a),
        Command::Replay(a) => cmd_replay::run(*a),
        Command::TraceGen(a) => cmd_replay::generate(a),
        Command::Soak(a) => cmd_soak::run(*a),
        Command::Completions(a) => cmd_docs::completions(a),
        Command::Man(a) => cmd_docs::man(a),
    };
    let result = result.and_then(|code| match output::failure() {
        // Output that never arrived is a failure, whatever the command did.
        Some(why) if code == 0 => Err(anyhow::anyhow!(why)),
        _ => Ok(code),
    });
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            let chain = logging::error_chain(&e);
            // A JSON log stays all JSON: the final error is its last line.
            if matches!(cli.log_format, logging::LogFormat::Json) {
                tracing::error!("{chain}");
            } else {
                errln!("vdcache: {chain}");
            }
            ExitCode::from(1)
        }
    }
}
