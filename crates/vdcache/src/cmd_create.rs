//! `vdcache create`: new qcow2 or raw images.

use crate::size::{human, parse_size};
use anyhow::{Context, Result, bail};
use std::path::PathBuf;
use vdcache_image::{CreateOptions, ImageFormat, create_qcow2, create_raw};
use vdcache_qcow2::header::CompressionType;

#[derive(clap::Args)]
pub struct Args {
    /// Image format: qcow2 (default) or raw.
    #[arg(short = 'f', long = "format", default_value = "qcow2")]
    format: String,
    /// Backing file (stored as given; relative names resolve against FILE's directory).
    #[arg(short = 'b', long = "backing")]
    backing: Option<String>,
    /// Format of the backing file (qcow2 or raw).
    #[arg(short = 'F', long = "backing-format")]
    backing_format: Option<String>,
    /// Options: cluster_size=N, extended_l2=on|off (default: on for an
    /// image with a backing file), refcount_bits=N, compat=0.10|1.1,
    /// lazy_refcounts=on|off, compression_type=zlib|zstd.
    #[arg(short = 'o', long = "options")]
    options: Vec<String>,
    file: PathBuf,
    /// Virtual size (k, M, G, T suffixes); defaults to the backing file's.
    size: Option<String>,
}

fn on_off(key: &str, v: &str) -> Result<bool> {
    match v {
        "on" | "true" | "yes" => Ok(true),
        "off" | "false" | "no" => Ok(false),
        _ => bail!("option {key}: expected on or off, got '{v}'"),
    }
}

/// Parses `-o` option lists into create options.
pub fn parse_options(list: &[String], opts: &mut CreateOptions) -> Result<()> {
    for item in list
        .iter()
        .flat_map(|s| s.split(','))
        .filter(|s| !s.is_empty())
    {
        let (key, value) = item
            .split_once('=')
            .with_context(|| format!("option '{item}' is not key=value"))?;
        match key {
            "cluster_size" => opts.cluster_size = parse_size(value)?,
            "extended_l2" => opts.extended_l2 = on_off(key, value)?,
            "lazy_refcounts" => opts.lazy_refcounts = on_off(key, value)?,
            "refcount_bits" => {
                opts.refcount_bits = value
                    .parse()
                    .with_context(|| format!("refcount_bits: '{value}' is not a number"))?
            }
            "compat" => {
                opts.version = match value {
                    "0.10" | "v2" => 2,
                    "1.1" | "v3" => 3,
                    _ => bail!("compat: expected 0.10 or 1.1, got '{value}'"),
                }
            }
            "compression_type" => {
                opts.compression = match value {
                    "zlib" => CompressionType::Zlib,
                    "zstd" => CompressionType::Zstd,
                    _ => bail!("compression_type: expected zlib or zstd, got '{value}'"),
                }
            }
            _ => bail!(
                "unknown option '{key}' (known: cluster_size, extended_l2, refcount_bits, compat, lazy_refcounts, compression_type)"
            ),
        }
    }
    Ok(())
}

/// Whether `-o` lists set `key` at all.
fn names_option(list: &[String], key: &str) -> bool {
    list.iter()
        .flat_map(|s| s.split(','))
        .any(|item| item.split_once('=').is_some_and(|(k, _)| k == key))
}

/// A delta gets extended L2 entries unless its other options rule them
/// out: a guest write then allocates only the 1/32-cluster subclusters it
/// touches, so nothing is copied from the backing file (no copy-on-write
/// reads, no filler written), where a standard delta copies the rest of
/// every 64 KiB cluster a 4 KiB write starts. QEMU reads them since 5.2.
fn delta_default_extended_l2(opts: &CreateOptions) -> bool {
    opts.version >= 3 && opts.cluster_size >= 16384
}

pub fn run(a: Args) -> Result<u8> {
    let size = a.size.as_deref().map(parse_size).transpose()?;
    match a.format.as_str() {
        "raw" => {
            if a.backing.is_some() {
                bail!("raw images cannot have a backing file");
            }
            let size = size.context("raw images need a size")?;
            let size = create_raw(&a.file, size)?;
            outln!("created {}: raw, {}", a.file.display(), size_text(size));
        }
        "qcow2" => {
            let mut opts = CreateOptions {
                size,
                ..CreateOptions::default()
            };
            parse_options(&a.options, &mut opts)?;
            if let Some(b) = a.backing {
                let fmt = match a.backing_format.as_deref() {
                    Some(f) => ImageFormat::parse(f).with_context(|| {
                        format!("unknown backing format '{f}' (use qcow2 or raw)")
                    })?,
                    None => {
                        bail!("-F BACKING_FORMAT is required with -b (the format is never probed)")
                    }
                };
                opts.backing = Some((b, fmt));
                if !names_option(&a.options, "extended_l2") {
                    opts.extended_l2 = delta_default_extended_l2(&opts);
                }
            }
            create_qcow2(&a.file, &opts)?;
            let size = vdcache_image::open_chain(
                &a.file.display().to_string(),
                &vdcache_image::OpenOptions {
                    read_only: true,
                    no_backing: true,
                    force_share: true,
                    ..vdcache_image::OpenOptions::default()
                },
            )
            .map(|d| d.size())
            .ok();
            outln!(
                "created {}: qcow2{}, {} cluster size{}{}",
                a.file.display(),
                size.map(|s| format!(", {}", size_text(s)))
                    .unwrap_or_default(),
                human(opts.cluster_size),
                if opts.extended_l2 {
                    ", extended L2 (subclusters)"
                } else {
                    ""
                },
                opts.backing
                    .as_ref()
                    .map(|(b, f)| format!(", backing file {b} ({})", f.name()))
                    .unwrap_or_default()
            );
        }
        other => bail!("unknown format '{other}' (use qcow2 or raw)"),
    }
    Ok(0)
}

/// A virtual size as qemu-img says it: human and exact.
fn size_text(bytes: u64) -> String {
    format!("{} ({bytes} bytes)", human(bytes))
}
