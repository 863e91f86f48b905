//! `vdcache convert`: copy a chain's guest content into a new raw or qcow2
//! image; with -B, only what differs from the new backing file is written.

use crate::cmd_create::parse_options;
use anyhow::{Context, Result, bail};
use std::path::Path;
use vdcache_image::{
    CreateOptions, ImageFormat, OpenOptions, VirtualDisk, ZeroFlags, create_qcow2, create_raw,
    open_chain,
};

#[derive(clap::Args)]
pub struct Args {
    /// Source format (probed when absent).
    #[arg(short = 'f')]
    source_format: Option<String>,
    /// Output format: raw or qcow2.
    #[arg(short = 'O', default_value = "raw")]
    output_format: String,
    /// Output options (as for create).
    #[arg(short = 'o')]
    options: Vec<String>,
    /// Backing file of the output; only differing data is written.
    #[arg(short = 'B')]
    backing: Option<String>,
    /// Format of the -B backing file (probed when absent).
    #[arg(short = 'F')]
    backing_format: Option<String>,
    /// Show progress on stderr.
    #[arg(short = 'p')]
    progress: bool,
    #[command(flatten)]
    allowed: crate::backing_args::BackingArgs,
    source: String,
    destination: String,
}

const CHUNK: u64 = 1 << 20;

fn parse_format(s: Option<&str>) -> Result<Option<ImageFormat>> {
    s.map(|f| {
        ImageFormat::parse(f).with_context(|| format!("unknown format '{f}' (use qcow2 or raw)"))
    })
    .transpose()
}

fn probe(path: &str) -> Result<ImageFormat> {
    let mut magic = [0u8; 4];
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {path}"))?;
    use std::os::unix::fs::FileExt;
    let n = f.read_at(&mut magic, 0)?;
    Ok(
        if n == 4 && u32::from_be_bytes(magic) == vdcache_qcow2::header::MAGIC {
            ImageFormat::Qcow2
        } else {
            ImageFormat::Raw
        },
    )
}

pub fn run(a: Args) -> Result<u8> {
    let allow_backing = &a.allowed.allow_backing;
    let src = open_chain(
        &a.source,
        &OpenOptions {
            read_only: true,
            format: parse_format(a.source_format.as_deref())?,
            allow_backing: allow_backing.clone(),
            ..OpenOptions::default()
        },
    )?;
    // The output's backing file is the one -B names: its place is allowed.
    let mut dst_allowed = allow_backing.clone();
    let dst_path = Path::new(&a.destination);
    let size = src.size();
    let mut backing_disk: Option<VirtualDisk> = None;
    match a.output_format.as_str() {
        "raw" => {
            if a.backing.is_some() {
                bail!("-B needs -O qcow2");
            }
            create_raw(dst_path, size)?;
        }
        "qcow2" => {
            let mut opts = CreateOptions {
                size: Some(size),
                ..CreateOptions::default()
            };
            parse_options(&a.options, &mut opts)?;
            if let Some(b) = &a.backing {
                let resolved = match dst_path.parent() {
                    Some(dir) if !Path::new(b).is_absolute() => dir.join(b).display().to_string(),
                    _ => b.clone(),
                };
                let fmt = match parse_format(a.backing_format.as_deref())? {
                    Some(f) => f,
                    None => probe(&resolved)?,
                };
                opts.backing = Some((b.clone(), fmt));
                backing_disk = Some(open_chain(
                    &resolved,
                    &OpenOptions {
                        read_only: true,
                        format: Some(fmt),
                        allow_backing: allow_backing.clone(),
                        ..OpenOptions::default()
                    },
                )?);
                dst_allowed.push(if vdcache_backend::is_nbd_uri(&resolved) {
                    resolved.clone()
                } else {
                    Path::new(&resolved)
                        .parent()
                        .map_or_else(String::new, |d| d.display().to_string())
                });
            }
            create_qcow2(dst_path, &opts)?;
        }
        other => bail!("unknown output format '{other}' (use raw or qcow2)"),
    }
    let dst = open_chain(
        &a.destination,
        &OpenOptions {
            format: Some(if a.output_format == "raw" {
                ImageFormat::Raw
            } else {
                ImageFormat::Qcow2
            }),
            allow_backing: dst_allowed,
            ..OpenOptions::default()
        },
    )?;
    copy(&src, &dst, backing_disk.as_ref(), a.progress)?;
    dst.close()?;
    Ok(0)
}

fn copy(
    src: &VirtualDisk,
    dst: &VirtualDisk,
    backing: Option<&VirtualDisk>,
    progress: bool,
) -> Result<()> {
    let size = src.size();
    let mut buf = vec![0u8; CHUNK as usize];
    let mut old = vec![0u8; CHUNK as usize];
    let mut pos = 0;
    let mut last_pct = u64::MAX;
    while pos < size {
        let n = (size - pos).min(CHUNK);
        let status = src.block_status(pos, n)?;
        let all_hole = status.iter().all(|(_, s)| s.zero);
        let data = &mut buf[..n as usize];
        if all_hole {
            data.fill(0);
        } else {
            src.read(pos, data)?;
        }
        let differs = match backing {
            Some(b) => {
                let within = b.size().saturating_sub(pos).min(n) as usize;
                let o = &mut old[..n as usize];
                o.fill(0);
                if within > 0 {
                    b.read(pos, &mut o[..within])?;
                }
                o != data
            }
            None => data.iter().any(|&x| x != 0),
        };
        if differs {
            if data.iter().all(|&x| x == 0) {
                dst.write_zeroes(pos, n, ZeroFlags::default())?;
            } else {
                dst.write(pos, data, false)?;
            }
        }
        pos += n;
        if progress {
            let pct = pos * 100 / size.max(1);
            if pct != last_pct {
                err!("\r    ({pct:>3}.00/100%)");
                last_pct = pct;
            }
        }
    }
    if progress {
        errln!();
    }
    Ok(())
}
