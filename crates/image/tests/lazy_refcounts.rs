//! Lazy refcounts: a flush does not persist refcounts, the dirty bit says
//! so, and opening a dirty image rebuilds them (as QEMU does) with all
//! flushed data intact.

use std::path::Path;
use vdcache_image::{
    CreateOptions, ImageFormat, Layer, MemFiles, OpenOptions, VirtualDisk, open_chain,
    qcow2_image_bytes,
};
use vdcache_qcow2::Header;

fn open(files: &std::sync::Arc<MemFiles>) -> VirtualDisk {
    open_chain(
        "img.qcow2",
        &OpenOptions {
            format: Some(ImageFormat::Qcow2),
            opener: files.clone(),
            ..OpenOptions::default()
        },
    )
    .expect("open")
}

fn header(files: &MemFiles) -> Header {
    Header::parse(&files.get("img.qcow2").expect("image").snapshot()).expect("header")
}

#[test]
fn dirty_image_is_repaired_on_open() {
    let files = MemFiles::new();
    let opts = CreateOptions {
        lazy_refcounts: true,
        cluster_size: 4096,
        ..CreateOptions::default()
    };
    let size = 4 << 20;
    files.insert(
        "img.qcow2",
        qcow2_image_bytes(Path::new("img"), &opts, size).expect("create"),
    );
    let disk = open(&files);
    for i in 0..200u64 {
        disk.write(i * 12288 % size, &[i as u8 + 1; 5000], false)
            .expect("write");
    }
    disk.flush().expect("flush");
    // The crash: no close, so refcounts were never written.
    drop(disk);
    assert!(
        header(&files).is_dirty(),
        "lazy refcounts must leave the dirty bit set"
    );
    let unrepaired = open_chain(
        "img.qcow2",
        &OpenOptions {
            read_only: true,
            no_backing: true,
            opener: files.clone(),
            ..OpenOptions::default()
        },
    )
    .expect("open read-only");
    let Layer::Qcow2(img) = &unrepaired.layers()[0] else {
        panic!("not qcow2")
    };
    assert!(
        !img.check().expect("check").is_clean(),
        "without repair the refcounts must be stale"
    );
    drop(unrepaired);

    let disk = open(&files);
    assert!(
        !header(&files).is_dirty(),
        "opening read-write repairs and clears the bit"
    );
    let Layer::Qcow2(img) = &disk.layers()[0] else {
        panic!("not qcow2")
    };
    let report = img.check().expect("check");
    assert!(
        report.is_clean(),
        "{:?} {:?}",
        report.corruptions,
        report.leaks
    );
    let mut model = vec![0u8; size as usize];
    for i in 0..200u64 {
        let off = (i * 12288 % size) as usize;
        model[off..off + 5000].fill(i as u8 + 1);
    }
    let mut all = vec![0u8; size as usize];
    disk.read(0, &mut all).expect("read");
    assert!(all == model, "flushed data must survive the repair");
    disk.close().expect("close");
    assert!(!header(&files).is_dirty());
}
