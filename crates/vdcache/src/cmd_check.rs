//! `vdcache check`: consistency check with qemu-img check's exit codes.

use anyhow::Result;
use vdcache_image::{CheckReport, Layer, OpenOptions, VirtualDisk, open_chain};

#[derive(clap::Args)]
pub struct Args {
    /// Repair: "leaks" or "all" (both rebuild refcounts from the tables).
    #[arg(short = 'r', long = "repair")]
    repair: Option<String>,
    /// Read without taking image locks (like qemu-img -U).
    #[arg(short = 'U', long = "force-share")]
    force_share: bool,
    #[command(flatten)]
    backing: crate::backing_args::BackingArgs,
    file: String,
}

pub fn run(a: Args) -> Result<u8> {
    match check(&a) {
        Ok(code) => Ok(code),
        Err(e) => {
            errln!(
                "vdcache check: could not check {}: {}",
                a.file,
                crate::logging::error_chain(&e)
            );
            Ok(1)
        }
    }
}

fn check(a: &Args) -> Result<u8> {
    let repair = match a.repair.as_deref() {
        None => false,
        Some("leaks") | Some("all") => true,
        Some(other) => anyhow::bail!("unknown repair mode '{other}' (use leaks or all)"),
    };
    // Like qemu-img check, an image whose backing chain cannot be opened
    // (missing file, loop, unsafe format) cannot be checked; and one that
    // a writer holds is in use, whatever else is wrong with it.
    drop(
        open_chain(
            &a.file,
            &OpenOptions {
                read_only: true,
                force_share: a.force_share,
                for_check: true,
                allow_backing: a.backing.allow_backing.clone(),
                ..OpenOptions::default()
            },
        )
        .map_err(|e| crate::cmd_info::force_share_hint(e, "check"))?,
    );
    let open = |writable: bool| {
        open_chain(
            &a.file,
            &OpenOptions {
                read_only: !writable,
                force_share: a.force_share && !writable,
                no_backing: true,
                for_check: true,
                allow_backing: a.backing.allow_backing.clone(),
                ..OpenOptions::default()
            },
        )
    };
    let disk = open(repair)?;
    let Layer::Qcow2(img) = &disk.layers()[0] else {
        outln!("{} is a raw image; there is nothing to check.", a.file);
        return Ok(0);
    };
    let report = if repair {
        let before = img.check()?;
        img.repair()?;
        disk.close()?;
        drop(disk);
        // What the file holds now, read afresh: a repair is judged by the
        // image it left, never by its own state in memory.
        let after = recheck(&open(true)?)?;
        if before.is_clean() {
            outln!("Nothing to repair.");
        } else {
            // Said whatever the outcome: a repair that changed the file
            // must never pass silently.
            outln!(
                "The following inconsistencies were found and repaired:\n\n    {} leaked clusters\n    {} corruptions\n",
                before.leaks.len().saturating_sub(after.leaks.len()),
                before
                    .corruptions
                    .len()
                    .saturating_sub(after.corruptions.len())
            );
        }
        after
    } else {
        img.check()?
    };
    for c in &report.corruptions {
        outln!("{c}");
    }
    for l in &report.leaks {
        outln!("{l}");
    }
    if report.is_clean() {
        outln!("No errors were found on the image.");
    }
    if !report.corruptions.is_empty() {
        outln!(
            "\n{} errors were found on the image.\nData may be corrupted, or further writes to the image may corrupt it.",
            report.corruptions.len()
        );
    }
    if !report.leaks.is_empty() {
        outln!(
            "\n{} leaked clusters were found on the image.\nThis means waste of disk space, but no harm to data.",
            report.leaks.len()
        );
    }
    if report.total_clusters > 0 {
        outln!(
            "{}/{} = {:.2}% allocated",
            report.allocated_clusters,
            report.total_clusters,
            report.allocated_clusters as f64 * 100.0 / report.total_clusters as f64
        );
    }
    outln!("Image end offset: {}", report.image_end);
    Ok(report.exit_code() as u8)
}

/// Checks a freshly opened image after a repair; a clean image loses a
/// corrupt bit (as qemu-img check -r does).
fn recheck(disk: &VirtualDisk) -> Result<CheckReport> {
    let Layer::Qcow2(img) = &disk.layers()[0] else {
        anyhow::bail!("the image is no longer qcow2 after the repair");
    };
    let report = img.check()?;
    if report.is_clean() {
        img.clear_corrupt_bit()?;
    }
    disk.close()?;
    Ok(report)
}
