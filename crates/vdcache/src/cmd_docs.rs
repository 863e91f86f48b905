//! `vdcache completions SHELL` and `vdcache man DIR`: shell completion
//! scripts and man pages generated from the command-line definitions, so
//! they can never disagree with `--help`.
//!
//! Must not: describe an option itself; every word comes from the clap
//! definitions in main.rs and cmd_*.rs.

use anyhow::{Context, Result};
use clap::CommandFactory;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct CompletionArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    shell: clap_complete::Shell,
}

#[derive(clap::Args)]
pub struct ManArgs {
    /// Directory to write vdcache.1 and vdcache-COMMAND.1 into (created if
    /// missing), e.g. /usr/local/share/man/man1.
    dir: PathBuf,
}

pub fn completions(a: CompletionArgs) -> Result<u8> {
    let mut cmd = crate::Cli::command();
    let mut text = Vec::new();
    clap_complete::generate(a.shell, &mut cmd, "vdcache", &mut text);
    out!("{}", String::from_utf8_lossy(&text));
    Ok(0)
}

pub fn man(a: ManArgs) -> Result<u8> {
    std::fs::create_dir_all(&a.dir)
        .with_context(|| format!("cannot create the directory {}", a.dir.display()))?;
    clap_mangen::generate_to(crate::Cli::command(), &a.dir)
        .with_context(|| format!("cannot write man pages into {}", a.dir.display()))?;
    let mut pages: Vec<String> = std::fs::read_dir(&a.dir)
        .with_context(|| format!("cannot list {}", a.dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("vdcache") && n.ends_with(".1"))
        .collect();
    pages.sort();
    outln!(
        "wrote {} man pages into {} (read one with: man {}/vdcache.1)",
        pages.len(),
        a.dir.display(),
        a.dir.display()
    );
    Ok(0)
}
