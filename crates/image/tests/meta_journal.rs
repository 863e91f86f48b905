//! The metadata journal's full mode and group commit, on in-memory
//! images: writes over data the newest record checksums are held (reads
//! see them) and reach the image at a checkpoint; a held write of a
//! cluster the guest then frees never leaks into the cluster's next
//! owner; concurrent flushes share commits; every flush costs the store
//! one sync.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;
use vdcache_image::{
    CreateOptions, DirectIo, HostIo, ImageFormat, JournalMode, MemFiles, OpenOptions, VirtualDisk,
    open_chain, qcow2_image_bytes,
};

const CLUSTER: u64 = 65536;

fn journaled(size: u64) -> (Arc<MemFiles>, Arc<DirectIo>, VirtualDisk) {
    let files = MemFiles::new();
    files.insert(
        "img.qcow2",
        qcow2_image_bytes(Path::new("img"), &CreateOptions::default(), size).unwrap(),
    );
    let io = DirectIo::new();
    let disk = open_chain(
        "img.qcow2",
        &OpenOptions {
            format: Some(ImageFormat::Qcow2),
            opener: files.clone(),
            io: Some(io.clone() as Arc<dyn HostIo>),
            metadata_journal: JournalMode::Required,
            ..OpenOptions::default()
        },
    )
    .unwrap();
    (files, io, disk)
}

fn read(disk: &VirtualDisk, at: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    disk.read(at, &mut buf).unwrap();
    buf
}

#[test]
fn a_held_write_of_a_freed_cluster_never_reaches_its_next_owner() {
    let (_files, _io, disk) = journaled(64 * CLUSTER);
    disk.write(0, &vec![1u8; CLUSTER as usize], false).unwrap();
    disk.flush().unwrap();
    // Over data the newest record checksums: held, and read back.
    disk.write(4096, &[2u8; 4096], false).unwrap();
    assert_eq!(read(&disk, 4096, 4096), vec![2u8; 4096]);
    assert_eq!(disk.journal_stats().unwrap().held_bytes, 4096);
    // The guest frees the cluster; the commit that frees it is proven by
    // the next, so the cluster may be allocated again: the held write
    // must go with it, not be written into the cluster's next owner.
    disk.discard(0, CLUSTER).unwrap();
    disk.flush().unwrap();
    disk.flush().unwrap();
    assert_eq!(disk.journal_stats().unwrap().held_bytes, 0);
    for i in 1..8u64 {
        disk.write(i * CLUSTER, &vec![3u8; CLUSTER as usize], false)
            .unwrap();
    }
    for i in 1..8u64 {
        assert_eq!(
            read(&disk, i * CLUSTER, CLUSTER as usize),
            vec![3u8; CLUSTER as usize],
            "cluster {i} reads another owner's held bytes"
        );
    }
    disk.flush().unwrap();
    disk.close().unwrap();
}

#[test]
fn held_writes_read_back_and_survive_a_clean_close() {
    let (files, _io, disk) = journaled(64 * CLUSTER);
    disk.write(0, &vec![1u8; 2 * CLUSTER as usize], false)
        .unwrap();
    disk.flush().unwrap();
    for i in 0..16u64 {
        disk.write(i * 8192, &[i as u8 + 10; 512], false).unwrap();
        assert_eq!(read(&disk, i * 8192, 512), vec![i as u8 + 10; 512]);
    }
    disk.close().unwrap();
    drop(disk);
    let again = open_chain(
        "img.qcow2",
        &OpenOptions {
            format: Some(ImageFormat::Qcow2),
            opener: files.clone(),
            read_only: true,
            ..OpenOptions::default()
        },
    )
    .unwrap();
    for i in 0..16u64 {
        assert_eq!(read(&again, i * 8192, 512), vec![i as u8 + 10; 512]);
        assert_eq!(read(&again, i * 8192 + 512, 512), vec![1u8; 512]);
    }
}

#[test]
fn each_guest_flush_costs_one_store_sync_and_concurrent_flushes_share_commits() {
    let (_files, io, disk) = journaled(256 * CLUSTER);
    let disk = Arc::new(disk);
    let before = io.counters.snapshot().flushes;
    for i in 0..20u64 {
        disk.write(i * 3 * CLUSTER, &[5u8; 4096], false).unwrap();
        disk.flush().unwrap();
    }
    let serial = io.counters.snapshot().flushes - before;
    assert_eq!(serial, 20, "one store sync per flush, {serial} for 20");
    let before = io.counters.snapshot().flushes;
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let disk = disk.clone();
            s.spawn(move || {
                for i in 0..10u64 {
                    disk.write((t * 10 + i) * CLUSTER + 4096, &[6u8; 4096], false)
                        .unwrap();
                    disk.flush().unwrap();
                }
            });
        }
    });
    let shared = io.counters.snapshot().flushes - before;
    assert!(
        shared <= 80,
        "80 concurrent flushes cost {shared} store syncs"
    );
}
