//! The virtual journal device as an operator meets it (issue 22): with
//! `journal_aware` its blocks stay in flash even in write-through mode
//! (its image on an nbdkit storage server is never written while the
//! cache holds them), survive a clean stop and restart, reach the image
//! through `vdcache flush`; a marker next to the cache says the journal
//! lives there, and a cache created anew under it is refused until the
//! operator decides. With `journal_aware = false` the device is cached
//! like any disk and written through.
// Test setup unwraps freely: a failure there is the test's own.
#![allow(clippy::unwrap_used)]

use crate::common;
use crate::serving;

use common::{Scratch, ok};
use serving::{nbdkit, qcow2, qemu_io, serve_config, stats, try_start, uri};
use std::path::{Path, PathBuf};

const JOURNAL_BYTES: usize = 4 << 20;

struct Setup {
    s: Scratch,
    socket: PathBuf,
    config: PathBuf,
    journal: PathBuf,
    cache: PathBuf,
    marker: PathBuf,
    _storage: serving::Proc,
}

impl Setup {
    fn new(aware: bool) -> Setup {
        let s = Scratch::new();
        let dir = s.path("storage");
        std::fs::create_dir(&dir).unwrap();
        let journal = dir.join("vm.journal");
        std::fs::write(&journal, vec![0u8; JOURNAL_BYTES]).unwrap();
        let ksock = s.path("storage.sock");
        let storage = nbdkit(&s, &ksock, &dir);
        let disk = s.path("vm.qcow2");
        qcow2(&s, &disk, 64 << 20, None);
        let socket = s.path("vd.sock");
        let cache = s.path("cache.img");
        let config = s.path("serve.toml");
        std::fs::write(
            &config,
            format!(
                "[server]\nsocket = \"{}\"\n[cache]\npath = \"{}\"\nsize = \"64M\"\nmode = \"writethrough\"\n[[export]]\nname = \"vm\"\nimage = \"{}\"\njournal_size = \"4M\"\njournal_image = \"{}\"\njournal_aware = {aware}\n",
                socket.display(),
                cache.display(),
                disk.display(),
                uri(&ksock, "vm.journal")
            ),
        )
        .unwrap();
        Setup {
            marker: s.path("cache.img.journal-vm.in-cache"),
            s,
            socket,
            config,
            journal,
            cache,
            _storage: storage,
        }
    }

    fn serve(&self) -> serving::Proc {
        serve_config(&self.s, &self.config, &self.socket)
    }

    fn journal_uri(&self) -> String {
        uri(&self.socket, "vm-journal")
    }

    fn io(&self, cmds: &[&str]) {
        let cmds: Vec<String> = cmds.iter().map(|c| c.to_string()).collect();
        qemu_io(&self.s, "raw", &self.journal_uri(), &cmds);
    }

    /// The journal image on the storage server, as its file holds it.
    fn stored(&self) -> Vec<u8> {
        std::fs::read(&self.journal).unwrap()
    }
}

fn all(bytes: &[u8], range: std::ops::Range<usize>, value: u8) -> bool {
    bytes[range].iter().all(|&b| b == value)
}

#[test]
fn the_journal_lives_in_flash_until_written_out_and_a_lost_cache_is_noticed() {
    let setup = Setup::new(true);
    let server = setup.serve();
    assert!(
        setup.marker.exists(),
        "serving marks the journal as living in the cache"
    );
    setup.io(&["write -P 0x5a 0 64k", "flush", "read -P 0x5a 0 64k"]);
    assert!(
        all(&setup.stored(), 0..JOURNAL_BYTES, 0),
        "a write-through cache keeps the journal in flash only"
    );
    let st = stats(&setup.s, &setup.socket);
    assert_eq!(st["cache"]["held_bytes"].as_u64(), Some(64 << 10), "{st}");
    let log = server.stop_clean();
    assert!(log.contains("kept in flash only"), "{log}");
    assert!(all(&setup.stored(), 0..JOURNAL_BYTES, 0));
    assert!(
        setup.marker.exists(),
        "the journal still lives only in the cache"
    );

    // A restart serves it from flash; an operator's flush writes it out.
    let server = setup.serve();
    setup.io(&["read -P 0x5a 0 64k"]);
    ok(setup
        .s
        .vdcache()
        .args(["flush", "--socket"])
        .arg(&setup.socket));
    assert!(
        all(&setup.stored(), 0..64 << 10, 0x5a),
        "flushed to its image"
    );
    server.stop_clean();
    assert!(
        !setup.marker.exists(),
        "nothing of the journal is in flash alone"
    );

    // Written again, then the cache is lost: the stale image is refused.
    let server = setup.serve();
    setup.io(&["write -P 0x6b 64k 4k", "flush"]);
    server.stop_clean();
    assert!(setup.marker.exists());
    std::fs::remove_file(&setup.cache).unwrap();
    let mut cmd = setup.s.vdcache();
    cmd.arg("serve").arg("--config").arg(&setup.config);
    let (status, log) = match try_start(&setup.s, cmd, &setup.socket) {
        Err(refused) => refused,
        Ok(p) => panic!("a stale journal was served\n{}", p.log_text()),
    };
    assert!(!status.success(), "{log}");
    common::assert_messages_read_well(&log, "vdcache serve");
    for want in ["stale", "recover --full", setup.marker.to_str().unwrap()] {
        assert!(log.contains(want), "{want}: {log}");
    }
    assert!(
        !setup.cache.exists(),
        "the refused start leaves no cache file"
    );
    // The operator decides: the marker goes, the (stale) journal serves.
    std::fs::remove_file(&setup.marker).unwrap();
    let server = setup.serve();
    setup.io(&["read -P 0x5a 0 64k", "read -P 0 64k 4k"]);
    server.stop_clean();
}

#[test]
fn a_journal_unaware_device_is_written_through_like_any_disk() {
    let setup = Setup::new(false);
    let server = setup.serve();
    assert!(!setup.marker.exists(), "nothing lives only in the cache");
    setup.io(&["write -P 0x5a 0 64k", "flush"]);
    assert!(all(&setup.stored(), 0..64 << 10, 0x5a), "written through");
    let st = stats(&setup.s, &setup.socket);
    assert_eq!(st["cache"]["held_bytes"].as_u64(), Some(0), "{st}");
    server.stop_clean();
    assert!(!setup.marker.exists());
}

/// The size of a journal image on a storage server is checked when it is
/// opened (no file is created for it).
#[test]
fn a_journal_export_of_the_wrong_size_is_refused() {
    let setup = Setup::new(true);
    std::fs::write(&setup.journal, vec![0u8; 1 << 20]).unwrap();
    let mut cmd = setup.s.vdcache();
    cmd.arg("serve").arg("--config").arg(&setup.config);
    let Err((_, log)) = try_start(&setup.s, cmd, &setup.socket) else {
        panic!("a journal image of the wrong size was served");
    };
    assert!(log.contains("not journal_size 4M"), "{log}");
    assert!(!Path::new(&setup.cache).exists(), "nothing was left behind");
}

/// An operator turns journal awareness off after a stop that kept the
/// journal in flash: the next server writes it back like any disk's dirty
/// data, and its stop leaves no marker behind to refuse a later start.
#[test]
fn turning_awareness_off_writes_the_journal_back_and_drops_the_marker() {
    let setup = Setup::new(true);
    let server = setup.serve();
    setup.io(&["write -P 0x5a 0 64k", "flush"]);
    server.stop_clean();
    assert!(setup.marker.exists());
    let text = std::fs::read_to_string(&setup.config).unwrap();
    std::fs::write(
        &setup.config,
        text.replace("journal_aware = true", "journal_aware = false"),
    )
    .unwrap();
    let server = setup.serve();
    setup.io(&["read -P 0x5a 0 64k"]);
    server.stop_clean();
    assert!(
        all(&setup.stored(), 0..64 << 10, 0x5a),
        "written back at the stop"
    );
    assert!(
        !setup.marker.exists(),
        "nothing lives only in the cache now"
    );
}
