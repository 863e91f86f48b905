//! The bounded version of the parser fuzzer (the unbounded one is
//! `cargo fuzz run parse_image` in fuzz/): valid images with random bytes
//! flipped must never panic the engine.

use proptest::prelude::*;
use std::path::Path;
use vdcache_image::fuzzing::exercise_image;
use vdcache_image::{CreateOptions, MemFiles, OpenOptions, open_chain, qcow2_image_bytes};

/// A small image with data, so that L1, L2 and refcount structures exist.
fn seed_image(cluster_size: u64, extended_l2: bool) -> Vec<u8> {
    let files = MemFiles::new();
    let opts = CreateOptions {
        cluster_size,
        extended_l2,
        ..CreateOptions::default()
    };
    files.insert(
        "seed.qcow2",
        qcow2_image_bytes(Path::new("seed"), &opts, 1 << 20).expect("create"),
    );
    let disk = open_chain(
        "seed.qcow2",
        &OpenOptions {
            opener: files.clone(),
            ..OpenOptions::default()
        },
    )
    .expect("open");
    for i in 0..8u64 {
        disk.write(i * 70_000, &[i as u8; 9000], false)
            .expect("write");
    }
    disk.close().expect("close");
    files.get("seed.qcow2").expect("image").snapshot()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]
    #[test]
    fn mutated_images_never_panic(
        cs in prop::sample::select(vec![512u64, 4096, 16384]),
        ext in any::<bool>(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..24),
        truncate in prop::option::of(any::<prop::sample::Index>()),
    ) {
        let mut img = seed_image(cs, ext && cs >= 16384);
        // Most flips land in the metadata clusters at the front.
        let meta_span = (cs as usize * 6).min(img.len());
        for (at, value) in flips {
            let i = at.index(meta_span);
            img[i] = value;
        }
        if let Some(t) = truncate {
            img.truncate(t.index(img.len()));
        }
        exercise_image(&img);
    }

    #[test]
    fn random_bytes_never_panic(data in prop::collection::vec(any::<u8>(), 0..4096)) {
        exercise_image(&data);
    }
}
