//! TLS (X.509): certificates made by the test; qemu-io, nbdinfo and the
//! NBD client of `vdcache_backend::nbd` against the server in FORCEDTLS
//! mode with client certificate checking; that client against
//! `nbdkit --tls=require`.
// Helpers outside #[test] functions unwrap freely too.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;
use std::sync::Arc;

use common::*;
use vdcache_backend::nbd::{ClientError, ClientOptions, NbdClient};
use vdcache_nbd_proto::{NbdUri, TlsClientConfig};
use vdcache_nbd_server::{MemExport, Server, TlsServerConfig};

fn tls_server(pki: &std::path::Path) -> (TestServer, Arc<MemExport>) {
    let disk = Arc::new(MemExport::new(16 << 20));
    let tls = TlsServerConfig::from_x509_dir(pki, true).unwrap();
    let b = Server::builder().export("secure", disk.clone()).tls(tls);
    (TestServer::start_with(b), disk)
}

/// Four threads write and read back 64 KiB blocks from `small` on, then one
/// 3 MiB FUA write at `big` is read back; returns the big pattern.
fn exercise(c: &NbdClient, small: u64, big: u64) -> Vec<u8> {
    std::thread::scope(|sc| {
        for t in 0..4u64 {
            sc.spawn(move || {
                for i in 0..16u64 {
                    let off = small + (t * 16 + i) * 65536;
                    let d = pattern(65536, off);
                    c.write_at(off, &d, false).unwrap();
                    let mut b = vec![0u8; 65536];
                    c.read_at(off, &mut b).unwrap();
                    assert!(b == d);
                }
            });
        }
    });
    let data = pattern(3 << 20, big);
    c.write_at(big, &data, true).unwrap();
    let mut back = vec![0u8; 3 << 20];
    c.read_at(big, &mut back).unwrap();
    assert!(back == data);
    data
}

/// qemu-io on export "secure" of `s` through the TLS credentials object
/// `creds` (id tls0); every command must succeed.
fn qemu_io_tls(s: &TestServer, creds: &str, extra_opts: &str, cmds: &[&str]) {
    let image = format!(
        "driver=nbd,server.type=unix,server.path={},export=secure,tls-creds=tls0{extra_opts}",
        s.socket.display()
    );
    let mut cmd = Command::new("qemu-io");
    cmd.args(["--object", creds, "--image-opts"]);
    for c in cmds {
        cmd.args(["-c", c]);
    }
    let out = run(cmd.arg(&image));
    assert!(!out.contains("failed"), "{out}");
}

#[test]
fn tls_with_qemu_io_nbdinfo_and_own_client() {
    require_tool("qemu-io");
    require_tool("nbdinfo");
    let pki = tempfile::tempdir().unwrap();
    make_pki(pki.path());
    let (s, disk) = tls_server(pki.path());

    // qemu-io over TLS, presenting client-cert.pem from the directory.
    qemu_io_tls(
        &s,
        &format!(
            "tls-creds-x509,id=tls0,endpoint=client,dir={}",
            pki.path().display()
        ),
        ",tls-hostname=localhost",
        &["write -P 0x42 1M 256k", "read -P 0x42 1M 256k", "flush"],
    );
    assert!(
        disk.contents()[1 << 20..(1 << 20) + (256 << 10)]
            .iter()
            .all(|&b| b == 0x42)
    );

    // nbdinfo over TLS.
    let uri = format!(
        "nbds+unix:///secure?socket={}&tls-certificates={}",
        s.socket.display(),
        pki.path().display()
    );
    let info = run(Command::new("nbdinfo").arg(&uri));
    assert!(info.contains("with TLS"), "{info}");
    assert!(info.contains("export-size: 16777216"), "{info}");

    // Without TLS nothing but STARTTLS is answered.
    let plain = output(Command::new("nbdinfo").arg(s.uri("secure")));
    assert!(!plain.status.success());
    assert!(matches!(
        NbdClient::connect(&s.uri("secure")),
        Err(ClientError::TlsRequired)
    ));

    // Own client over TLS, several threads.
    let c = NbdClient::connect(&uri).unwrap();
    exercise(&c, 0, 8 << 20);
    assert!(s.server.stats().connections.iter().any(|x| x.tls));
    drop(c);

    // A client without a certificate is refused (the server verifies peers).
    let ca_only = TlsClientConfig::from_pem_files(&pki.path().join("ca-cert.pem"), None).unwrap();
    let opts = ClientOptions {
        tls: Some(ca_only),
        ..Default::default()
    };
    let r = NbdClient::connect_with(&NbdUri::parse(&uri).unwrap(), &opts);
    assert!(r.is_err(), "client without certificate accepted");

    // A client trusting another CA refuses the server.
    let other = tempfile::tempdir().unwrap();
    make_pki(other.path());
    let wrong_ca = TlsClientConfig::from_x509_dir(other.path()).unwrap();
    let opts = ClientOptions {
        tls: Some(wrong_ca),
        ..Default::default()
    };
    assert!(matches!(
        NbdClient::connect_with(&NbdUri::parse(&uri).unwrap(), &opts),
        Err(ClientError::Tls(_))
    ));
}

#[test]
fn own_client_tls_against_nbdkit() {
    let pki = tempfile::tempdir().unwrap();
    make_pki(pki.path());
    let certs = format!("--tls-certificates={}", pki.path().display());
    let k = Nbdkit::start(&["--tls=require", &certs, "--tls-verify-peer", "memory", "8M"]);
    let uri = format!(
        "nbds+unix:///?socket={}&tls-certificates={}",
        k.socket.display(),
        pki.path().display()
    );
    let c = NbdClient::connect(&uri).unwrap();
    let d = pattern(5 << 20, 2);
    c.write_at(1 << 20, &d, false).unwrap();
    c.flush().unwrap();
    let mut b = vec![0u8; 5 << 20];
    c.read_at(1 << 20, &mut b).unwrap();
    assert!(b == d);
    drop(c);
    // Plain connection to a TLS-only nbdkit fails with a clear error.
    assert!(matches!(
        NbdClient::connect(&k.uri()),
        Err(ClientError::TlsRequired)
    ));
}

/// A `keys.psk` file in `dir` holding `user`'s key.
fn write_psk(dir: &std::path::Path, user: &str, key_hex: &str) -> std::path::PathBuf {
    let p = dir.join("keys.psk");
    std::fs::write(&p, format!("{user}:{key_hex}\n")).unwrap();
    p
}

const KEY: &str = "9f2c6f1e7d3a5b8c0e1f2a3b4c5d6e7f00112233445566778899aabbccddeeff";
const OTHER_KEY: &str = "0000000000000000000000000000000000000000000000000000000000000001";

#[test]
fn tls_psk_with_qemu_io_nbdinfo_and_own_client() {
    require_tool("qemu-io");
    require_tool("nbdinfo");
    let keys = tempfile::tempdir().unwrap();
    let keyfile = write_psk(keys.path(), "alice", KEY);
    let disk = Arc::new(MemExport::new(16 << 20));
    let tls = TlsServerConfig::from_psk_file(&keyfile).unwrap();
    let s = TestServer::start_with(Server::builder().export("secure", disk.clone()).tls(tls));

    // qemu-io with qemu's tls-creds-psk object (GnuTLS on the client side).
    qemu_io_tls(
        &s,
        &format!(
            "tls-creds-psk,id=tls0,endpoint=client,dir={},username=alice",
            keys.path().display()
        ),
        "",
        &["write -P 0x5a 2M 128k", "flush"],
    );
    assert!(
        disk.contents()[2 << 20..(2 << 20) + (128 << 10)]
            .iter()
            .all(|&b| b == 0x5a)
    );

    // nbdinfo (libnbd, GnuTLS).
    let uri = format!(
        "nbds+unix://alice@/secure?socket={}&tls-psk-file={}",
        s.socket.display(),
        keyfile.display()
    );
    let info = run(Command::new("nbdinfo").arg(&uri));
    assert!(info.contains("with TLS"), "{info}");

    // Own client (OpenSSL), several threads, large requests.
    let c = NbdClient::connect(&uri).unwrap();
    let big = exercise(&c, 4 << 20, 9 << 20);
    drop(c);

    // A wrong key, an unknown user and a plain connection are all refused,
    // and none of them disturbs the data.
    let wrong = tempfile::tempdir().unwrap();
    let wrong_keys = write_psk(wrong.path(), "alice", OTHER_KEY);
    let bad = output(Command::new("nbdinfo").arg(format!(
        "nbds+unix://alice@/secure?socket={}&tls-psk-file={}",
        s.socket.display(),
        wrong_keys.display()
    )));
    assert!(!bad.status.success(), "wrong key accepted");
    let mallory =
        TlsClientConfig::from_psk_file(&write_psk(wrong.path(), "mallory", KEY), "mallory")
            .unwrap();
    let opts = ClientOptions {
        tls: Some(mallory),
        ..Default::default()
    };
    assert!(matches!(
        NbdClient::connect_with(&NbdUri::parse(&uri).unwrap(), &opts),
        Err(ClientError::Tls(_))
    ));
    assert!(matches!(
        NbdClient::connect(&s.uri("secure")),
        Err(ClientError::TlsRequired)
    ));
    let c = NbdClient::connect(&uri).unwrap();
    let mut b = vec![0u8; 3 << 20];
    c.read_at(9 << 20, &mut b).unwrap();
    assert!(b == big);
}

#[test]
fn own_psk_client_against_nbdkit() {
    let keys = tempfile::tempdir().unwrap();
    let keyfile = write_psk(keys.path(), "bob", KEY);
    let psk = format!("--tls-psk={}", keyfile.display());
    let k = Nbdkit::start(&["--tls=require", &psk, "memory", "8M"]);
    let uri = format!(
        "nbds+unix://bob@/?socket={}&tls-psk-file={}",
        k.socket.display(),
        keyfile.display()
    );
    let c = NbdClient::connect(&uri).unwrap();
    let d = pattern(5 << 20, 3);
    c.write_at(1 << 20, &d, false).unwrap();
    c.flush().unwrap();
    let mut b = vec![0u8; 5 << 20];
    c.read_at(1 << 20, &mut b).unwrap();
    assert!(b == d);
    // Without the user the URI cannot name a key.
    let anonymous = format!(
        "nbds+unix:///?socket={}&tls-psk-file={}",
        k.socket.display(),
        keyfile.display()
    );
    assert!(matches!(
        NbdClient::connect(&anonymous),
        Err(ClientError::Tls(_))
    ));
}
