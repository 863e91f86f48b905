//! Entry point shared by the cargo-fuzz target (fuzz/) and the bounded
//! fuzz test of the test suite: treat arbitrary bytes as an image, open it
//! in memory and exercise every parser and the read, write and check
//! paths. Any outcome but a panic (or a hang) is acceptable.

use crate::chain::{ImageFormat, MemFiles, OpenOptions, open_chain};
use crate::disk::Layer;
use crate::meta_cache::MetaCacheConfig;
use vdcache_qcow2::Header;

/// Largest virtual range the fuzz entry touches, so one input stays fast.
const SPAN: u64 = 1 << 20;

/// Opens `data` as a qcow2 image and reads, writes, checks and closes it.
pub fn exercise_image(data: &[u8]) {
    let _ = Header::parse(data);
    let files = MemFiles::new();
    files.insert("fuzz.qcow2", data.to_vec());
    let opts = OpenOptions {
        format: Some(ImageFormat::Qcow2),
        opener: files.clone(),
        no_backing: true,
        cache: MetaCacheConfig {
            l2_bytes: 4096,
            refcount_bytes: 4096,
            slice_bytes: Some(512),
        },
        ..OpenOptions::default()
    };
    let Ok(disk) = open_chain("fuzz.qcow2", &opts) else {
        return;
    };
    let span = disk.size().min(SPAN);
    let mut buf = vec![0u8; span as usize];
    let _ = disk.read(0, &mut buf);
    let _ = disk.block_status(0, span);
    if span >= 4096 {
        let _ = disk.write(span / 3, &[0xa5; 4096], false);
        let _ = disk.discard(0, span / 2);
        let _ = disk.flush();
    }
    if let Layer::Qcow2(img) = &disk.layers()[0] {
        let _ = img.check();
    }
    let _ = disk.close();
}
