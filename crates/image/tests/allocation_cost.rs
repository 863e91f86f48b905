//! Allocating a cluster looks up a bounded number of refcounts, however
//! many clusters the image already holds: the free-cluster search resumes
//! where the last one ended instead of rescanning every cluster in use.

use std::path::Path;
use vdcache_image::{
    CreateOptions, ImageFormat, MemFiles, OpenOptions, open_chain, qcow2_image_bytes,
};

#[test]
fn refcount_lookups_per_allocation_stay_bounded() {
    let files = MemFiles::new();
    let cluster = 65536u64;
    let clusters = 3000u64;
    files.insert(
        "img.qcow2",
        qcow2_image_bytes(
            Path::new("img"),
            &CreateOptions::default(),
            clusters * cluster,
        )
        .expect("create"),
    );
    let disk = open_chain(
        "img.qcow2",
        &OpenOptions {
            format: Some(ImageFormat::Qcow2),
            opener: files.clone(),
            ..OpenOptions::default()
        },
    )
    .expect("open");
    let lookups = |d: &vdcache_image::VirtualDisk| {
        let s = d.meta_stats().expect("qcow2").refcount;
        s.hits + s.misses
    };
    let before = lookups(&disk);
    // Every write allocates one new cluster, in an order unrelated to the
    // allocation order.
    for i in 0..clusters {
        let c = (i * 7919) % clusters;
        disk.write(c * cluster, &[1u8; 4096], false).expect("write");
    }
    let per_allocation = (lookups(&disk) - before) as f64 / clusters as f64;
    assert!(
        per_allocation < 8.0,
        "{per_allocation:.1} refcount lookups per allocated cluster"
    );
    disk.close().expect("close");
}
