//! `vdcache io`: qemu-io's read, write, discard and flush commands, with
//! its size suffixes and output lines, so a script can run the same
//! commands through qemu-io and vdcache and compare the images.

use crate::size::parse_size;
use anyhow::{Context, Result, bail};
use vdcache_image::{ImageFormat, OpenOptions, VirtualDisk, ZeroFlags, open_chain};

#[derive(clap::Args)]
pub struct Args {
    /// A command: read [-P pat] OFF LEN | write [-P pat | -z [-u]] [-f] OFF LEN | discard OFF LEN | flush.
    #[arg(short = 'c', long = "cmd")]
    commands: Vec<String>,
    /// Format of FILE (probed when absent).
    #[arg(short = 'f', long = "format")]
    format: Option<String>,
    /// Open read-only.
    #[arg(short = 'r', long = "read-only")]
    read_only: bool,
    /// Do not take image locks.
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    #[command(flatten)]
    cache: crate::meta_args::MetaCacheArgs,
    #[command(flatten)]
    backing: crate::backing_args::BackingArgs,
    file: String,
}

/// One parsed command.
#[derive(Debug, PartialEq, Eq)]
pub enum IoCommand {
    Read {
        offset: u64,
        len: u64,
        pattern: Option<u8>,
        quiet: bool,
    },
    Write {
        offset: u64,
        len: u64,
        fill: Fill,
        fua: bool,
        quiet: bool,
    },
    Discard {
        offset: u64,
        len: u64,
        quiet: bool,
    },
    Flush,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Fill {
    Pattern(u8),
    Zeroes { unmap: bool },
}

fn parse_pattern(s: &str) -> Result<u8> {
    let v = if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        u64::from_str_radix(h, 16)
    } else {
        s.parse::<u64>()
    }
    .with_context(|| format!("invalid pattern '{s}'"))?;
    Ok(v as u8)
}

/// Parses one qemu-io command line.
pub fn parse_command(line: &str) -> Result<IoCommand> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let Some((&name, rest)) = words.split_first() else {
        bail!("empty command");
    };
    let mut pattern = None;
    let mut zero = false;
    let mut unmap = false;
    let mut fua = false;
    let mut quiet = false;
    let mut args = Vec::new();
    let mut it = rest.iter();
    while let Some(&w) = it.next() {
        match w {
            "-P" => pattern = Some(parse_pattern(it.next().context("-P needs a pattern")?)?),
            "-z" => zero = true,
            "-u" => unmap = true,
            "-f" | "-F" => fua = true,
            "-q" => quiet = true,
            flag if flag.starts_with('-')
                && flag.len() > 1
                && !flag[1..].starts_with(|c: char| c.is_ascii_digit()) =>
            {
                bail!("{name}: unsupported option '{flag}'")
            }
            arg => args.push(arg),
        }
    }
    let range = |args: &[&str]| -> Result<(u64, u64)> {
        match args {
            [o, l] => Ok((
                parse_size(o).with_context(|| format!("{name}: bad offset"))?,
                parse_size(l).with_context(|| format!("{name}: bad length"))?,
            )),
            _ => bail!("{name}: expected OFFSET LENGTH"),
        }
    };
    match name {
        "read" => {
            let (offset, len) = range(&args)?;
            Ok(IoCommand::Read {
                offset,
                len,
                pattern,
                quiet,
            })
        }
        "write" => {
            let (offset, len) = range(&args)?;
            let fill = match (zero, pattern) {
                (true, Some(_)) => bail!("write: -z and -P cannot be combined"),
                (true, None) => Fill::Zeroes { unmap },
                (false, p) => Fill::Pattern(p.unwrap_or(0xcd)),
            };
            Ok(IoCommand::Write {
                offset,
                len,
                fill,
                fua,
                quiet,
            })
        }
        "discard" | "aio_discard" => {
            let (offset, len) = range(&args)?;
            Ok(IoCommand::Discard { offset, len, quiet })
        }
        "flush" => {
            if !args.is_empty() {
                bail!("flush takes no arguments");
            }
            Ok(IoCommand::Flush)
        }
        other => bail!("unknown command '{other}' (supported: read, write, discard, flush)"),
    }
}

/// Largest single buffer a command uses; longer ranges are done in pieces.
const CHUNK: u64 = 8 << 20;

/// Runs one command; Ok(false) when a read pattern did not verify.
pub fn execute(disk: &VirtualDisk, cmd: &IoCommand) -> Result<bool> {
    match *cmd {
        IoCommand::Read {
            offset,
            len,
            pattern,
            quiet,
        } => {
            let mut ok = true;
            let mut buf = vec![0u8; len.min(CHUNK) as usize];
            let mut pos = offset;
            while pos < offset + len {
                let n = (offset + len - pos).min(CHUNK) as usize;
                disk.read(pos, &mut buf[..n])?;
                if let Some(p) = pattern
                    && let Some(bad) = buf[..n].iter().position(|&b| b != p)
                {
                    outln!(
                        "Pattern verification failed at offset {}, {} bytes",
                        pos + bad as u64,
                        len
                    );
                    ok = false;
                }
                pos += n as u64;
            }
            if !quiet {
                outln!("read {len}/{len} bytes at offset {offset}");
            }
            Ok(ok)
        }
        IoCommand::Write {
            offset,
            len,
            ref fill,
            fua,
            quiet,
        } => {
            match fill {
                Fill::Zeroes { unmap } => disk.write_zeroes(
                    offset,
                    len,
                    ZeroFlags {
                        may_unmap: *unmap,
                        fua,
                    },
                )?,
                Fill::Pattern(p) => {
                    let buf = vec![*p; len.min(CHUNK) as usize];
                    let mut pos = offset;
                    while pos < offset + len {
                        let n = (offset + len - pos).min(CHUNK) as usize;
                        disk.write(pos, &buf[..n], fua)?;
                        pos += n as u64;
                    }
                }
            }
            if !quiet {
                outln!("wrote {len}/{len} bytes at offset {offset}");
            }
            Ok(true)
        }
        IoCommand::Discard { offset, len, quiet } => {
            disk.discard(offset, len)?;
            if !quiet {
                outln!("discard {len}/{len} bytes at offset {offset}");
            }
            Ok(true)
        }
        IoCommand::Flush => {
            disk.flush()?;
            Ok(true)
        }
    }
}

pub fn run(a: Args) -> Result<u8> {
    let commands: Vec<IoCommand> = a
        .commands
        .iter()
        .map(|c| parse_command(c).with_context(|| format!("command '{c}'")))
        .collect::<Result<_>>()?;
    let format = a
        .format
        .as_deref()
        .map(|f| {
            ImageFormat::parse(f)
                .with_context(|| format!("unknown format '{f}' (use qcow2 or raw)"))
        })
        .transpose()?;
    let disk = open_chain(
        &a.file,
        &OpenOptions {
            read_only: a.read_only,
            format,
            force_share: a.force_share,
            cache: a.cache.config()?,
            allow_backing: a.backing.allow_backing.clone(),
            ..OpenOptions::default()
        },
    )?;
    let mut failed = false;
    for (line, cmd) in a.commands.iter().zip(&commands) {
        match execute(&disk, cmd) {
            Ok(true) => {}
            Ok(false) => failed = true,
            Err(e) => {
                outln!("{line}: {e:#}");
                failed = true;
            }
        }
    }
    disk.close()?;
    Ok(u8::from(failed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_qemu_io_commands() {
        assert_eq!(
            parse_command("write -P 0xab 4k 1M").unwrap(),
            IoCommand::Write {
                offset: 4096,
                len: 1 << 20,
                fill: Fill::Pattern(0xab),
                fua: false,
                quiet: false
            }
        );
        assert_eq!(
            parse_command("write -z -u 0 64k").unwrap(),
            IoCommand::Write {
                offset: 0,
                len: 65536,
                fill: Fill::Zeroes { unmap: true },
                fua: false,
                quiet: false
            }
        );
        assert_eq!(
            parse_command("read -P 171 0 512").unwrap(),
            IoCommand::Read {
                offset: 0,
                len: 512,
                pattern: Some(171),
                quiet: false
            }
        );
        assert_eq!(parse_command("flush").unwrap(), IoCommand::Flush);
        assert!(parse_command("write -z -P 1 0 4k").is_err());
        assert!(parse_command("read 0").is_err());
        assert!(parse_command("frobnicate 0 1").is_err());
        assert!(parse_command("read -X 0 1").is_err());
    }
}
