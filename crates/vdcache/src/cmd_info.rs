//! `vdcache info`: an image and its backing chain, human-readable or JSON
//! (field names follow qemu-img info --output=json).

use crate::size::human;
use anyhow::Result;
use serde::Serialize;
use vdcache_image::{ImageFormat, Layer, OpenOptions, open_chain};
use vdcache_qcow2::features::FeatureKind;

#[derive(clap::Args)]
pub struct Args {
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Format of FILE (probed when absent).
    #[arg(short = 'f', long = "format")]
    format: Option<String>,
    /// Read without taking image locks (like qemu-img -U).
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    #[command(flatten)]
    backing: crate::backing_args::BackingArgs,
    file: String,
}

#[derive(Serialize)]
struct SnapshotInfo {
    id: String,
    name: String,
    #[serde(rename = "date-sec")]
    date_sec: u32,
    #[serde(rename = "vm-state-size")]
    vm_state_size: u64,
}

#[derive(Serialize)]
struct ImageInfo {
    filename: String,
    format: &'static str,
    #[serde(rename = "virtual-size")]
    virtual_size: u64,
    #[serde(rename = "actual-size")]
    actual_size: u64,
    #[serde(rename = "cluster-size", skip_serializing_if = "Option::is_none")]
    cluster_size: Option<u64>,
    #[serde(rename = "backing-filename", skip_serializing_if = "Option::is_none")]
    backing_filename: Option<String>,
    #[serde(
        rename = "backing-filename-format",
        skip_serializing_if = "Option::is_none"
    )]
    backing_format: Option<String>,
    #[serde(rename = "dirty-flag")]
    dirty: bool,
    #[serde(rename = "format-specific", skip_serializing_if = "Option::is_none")]
    specific: Option<Qcow2Info>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    snapshots: Vec<SnapshotInfo>,
}

#[derive(Serialize)]
struct Qcow2Info {
    compat: &'static str,
    #[serde(rename = "compression-type")]
    compression_type: &'static str,
    #[serde(rename = "lazy-refcounts")]
    lazy_refcounts: bool,
    #[serde(rename = "refcount-bits")]
    refcount_bits: u32,
    corrupt: bool,
    #[serde(rename = "extended-l2")]
    extended_l2: bool,
    #[serde(rename = "data-file", skip_serializing_if = "Option::is_none")]
    data_file: Option<String>,
    features: Vec<String>,
    #[serde(rename = "vdcache", skip_serializing_if = "Option::is_none")]
    cache_mark: Option<CacheMarkInfo>,
}

/// vdcache's cache mark, and whether the file alone is out of date.
#[derive(Serialize)]
struct CacheMarkInfo {
    #[serde(rename = "image-id")]
    image_id: String,
    generation: u64,
    #[serde(rename = "cache-id")]
    cache_id: String,
    cache: String,
    /// The cache may hold data the file lacks.
    #[serde(rename = "needs-cache")]
    needs_cache: bool,
}

fn actual_size(name: &str) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(name)
        .map(|m| m.blocks() * 512)
        .unwrap_or(0)
}

fn describe(layer: &Layer) -> ImageInfo {
    match layer {
        Layer::Raw(r) => ImageInfo {
            filename: r.handle.name.to_string(),
            format: ImageFormat::Raw.name(),
            virtual_size: r.size,
            actual_size: actual_size(&r.handle.name),
            cluster_size: None,
            backing_filename: None,
            backing_format: None,
            dirty: false,
            specific: None,
            snapshots: Vec::new(),
        },
        Layer::Qcow2(q) => {
            let h = q.header();
            let features = h
                .feature_list()
                .into_iter()
                .map(|(kind, _, name)| {
                    let k = match kind {
                        FeatureKind::Incompatible => "incompatible",
                        FeatureKind::Compatible => "compatible",
                        FeatureKind::Autoclear => "autoclear",
                    };
                    format!("{name} ({k})")
                })
                .collect();
            ImageInfo {
                filename: q.name().to_string(),
                format: ImageFormat::Qcow2.name(),
                virtual_size: q.virtual_size(),
                actual_size: actual_size(q.name()),
                cluster_size: Some(h.cluster_size()),
                backing_filename: h.backing_file.clone(),
                backing_format: h.extensions.backing_format.clone(),
                dirty: h.is_dirty(),
                specific: Some(Qcow2Info {
                    compat: if h.version >= 3 { "1.1" } else { "0.10" },
                    compression_type: h.compression_type.name(),
                    lazy_refcounts: h.has_lazy_refcounts(),
                    refcount_bits: 1 << h.refcount_order,
                    corrupt: h.is_corrupt(),
                    extended_l2: h.has_extended_l2(),
                    data_file: h.extensions.external_data_file.clone(),
                    features,
                    cache_mark: h
                        .extensions
                        .cache_mark
                        .as_ref()
                        .and_then(|m| m.current())
                        .map(|m| CacheMarkInfo {
                            image_id: m.image_id_hex(),
                            generation: m.generation,
                            cache_id: m.cache_id_hex(),
                            cache: m.cache_path.clone(),
                            needs_cache: h.incompatible_features
                                & vdcache_qcow2::features::incompatible::IN_CACHE
                                != 0,
                        }),
                }),
                snapshots: q
                    .snapshots()
                    .into_iter()
                    .map(|s| SnapshotInfo {
                        id: s.id,
                        name: s.name,
                        date_sec: s.date_sec,
                        vm_state_size: s.vm_state_size,
                    })
                    .collect(),
            }
        }
    }
}

fn print_human(i: &ImageInfo, depth: usize) {
    let pad = "  ".repeat(depth);
    outln!("{pad}image: {}", i.filename);
    outln!("{pad}file format: {}", i.format);
    outln!(
        "{pad}virtual size: {} ({} bytes)",
        human(i.virtual_size),
        i.virtual_size
    );
    outln!("{pad}disk size: {}", human(i.actual_size));
    if let Some(cs) = i.cluster_size {
        outln!("{pad}cluster_size: {cs}");
    }
    if let Some(b) = &i.backing_filename {
        outln!("{pad}backing file: {b}");
    }
    if let Some(f) = &i.backing_format {
        outln!("{pad}backing file format: {f}");
    }
    if !i.snapshots.is_empty() {
        outln!("{pad}Snapshot list:");
        for s in &i.snapshots {
            outln!(
                "{pad}  {:<4} {:<20} vm-state {}",
                s.id,
                s.name,
                human(s.vm_state_size)
            );
        }
    }
    if let Some(q) = &i.specific {
        outln!("{pad}Format specific information:");
        outln!("{pad}    compat: {}", q.compat);
        outln!("{pad}    compression type: {}", q.compression_type);
        outln!("{pad}    lazy refcounts: {}", q.lazy_refcounts);
        outln!("{pad}    refcount bits: {}", q.refcount_bits);
        outln!("{pad}    corrupt: {}", q.corrupt);
        outln!("{pad}    extended l2: {}", q.extended_l2);
        outln!("{pad}    dirty: {}", i.dirty);
        if let Some(d) = &q.data_file {
            outln!("{pad}    data file: {d}");
        }
        if !q.features.is_empty() {
            outln!("{pad}    features: {}", q.features.join(", "));
        }
        if let Some(m) = &q.cache_mark {
            outln!(
                "{pad}    vdcache: image {} generation {}, cache {} ({})",
                m.image_id,
                m.generation,
                m.cache,
                m.cache_id
            );
            if m.needs_cache {
                outln!(
                    "{pad}    NEEDS ITS CACHE: newer data may be in {}; serve it with that cache or run `vdcache recover --full --cache {}`",
                    m.cache,
                    m.cache
                );
            }
        }
    }
}

pub fn run(a: Args) -> Result<u8> {
    let format = a
        .format
        .as_deref()
        .map(|f| {
            ImageFormat::parse(f)
                .ok_or_else(|| anyhow::anyhow!("unknown format '{f}' (use qcow2 or raw)"))
        })
        .transpose()?;
    let disk = open_chain(
        &a.file,
        &OpenOptions {
            read_only: true,
            format,
            force_share: a.force_share,
            inspect: true,
            allow_backing: a.backing.allow_backing.clone(),
            ..OpenOptions::default()
        },
    )
    .map_err(|e| force_share_hint(e, "info"))?;
    let chain: Vec<ImageInfo> = disk.layers().iter().map(describe).collect();
    if a.json {
        #[derive(Serialize)]
        struct Out<'a> {
            #[serde(flatten)]
            top: &'a ImageInfo,
            #[serde(rename = "backing-chain")]
            chain: &'a [ImageInfo],
        }
        let out = Out {
            top: &chain[0],
            chain: &chain[1..],
        };
        outln!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        for (d, i) in chain.iter().enumerate() {
            if d == 1 {
                outln!("Backing chain:");
            }
            print_human(i, d.min(1));
        }
    }
    Ok(0)
}

/// An image another process writes (a server, a VM) is refused, as
/// qemu-img refuses it; the error says how to look anyway.
pub fn force_share_hint(e: vdcache_image::ImageError, command: &str) -> anyhow::Error {
    let in_use = matches!(
        e,
        vdcache_image::ImageError::Lock(vdcache_backend::LockError::Conflict { .. })
    );
    if in_use {
        anyhow::anyhow!(
            "{e}; `vdcache {command} -U` reads it anyway without the lock, as qemu-img -U does (what it shows may change while it is written)"
        )
    } else {
        e.into()
    }
}
