//! Helpers shared by the integration tests: in-process servers on Unix
//! sockets in temporary directories, external tools, nbdkit processes,
//! certificate generation.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use vdcache_nbd_server::{BlockSizes, Export, ExportError, MemExport, Server, ZeroFlags};

/// Fails the test with a clear message when a required tool is missing
/// (scripts/test-all.sh installs them).
pub fn require_tool(name: &str) {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
        .unwrap_or(false);
    assert!(
        found,
        "{name} is not installed: apt-get install nbdkit libnbd-bin fio qemu-utils"
    );
}

/// Runs a command, asserts success and returns stdout.
pub fn run(cmd: &mut Command) -> String {
    let out = output(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs qemu-io on a raw NBD export with one `-c` per command; asserts
/// success and returns stdout.
pub fn qemu_io(uri: &str, commands: &[&str]) -> String {
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw"]);
    for c in commands {
        cmd.args(["-c", c]);
    }
    run(cmd.arg(uri))
}

pub fn output(cmd: &mut Command) -> Output {
    cmd.stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// An in-process server with one or more exports on a Unix socket.
pub struct TestServer {
    pub server: Server,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
}

impl TestServer {
    pub fn start(exports: Vec<(&str, Arc<dyn Export>)>) -> TestServer {
        let mut b = Server::builder();
        for (name, e) in exports {
            b = b.export(name, e);
        }
        Self::start_with(b)
    }

    pub fn start_with(b: vdcache_nbd_server::ServerBuilder) -> TestServer {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("nbd.sock");
        let server = b.build().expect("build server");
        server.listen_unix(&socket).expect("listen");
        TestServer {
            server,
            dir,
            socket,
        }
    }

    pub fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.socket.display())
    }
}

/// A one-export memory server.
pub fn mem_server(size: u64) -> (TestServer, Arc<MemExport>) {
    let disk = Arc::new(MemExport::new(size));
    let s = TestServer::start(vec![("", disk.clone() as Arc<dyn Export>)]);
    (s, disk)
}

/// Deterministic pseudo-random bytes, different per seed.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    use rand::{Rng as _, SeedableRng};
    let mut v = vec![0u8; len];
    rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

/// An nbdkit process serving on a Unix socket, killed on drop.
pub struct Nbdkit {
    pub child: Child,
    pub socket: PathBuf,
    pub dir: tempfile::TempDir,
}

impl Nbdkit {
    /// Starts `nbdkit <args>` and waits until its pidfile appears (nbdkit
    /// writes it once it accepts connections).
    pub fn start(args: &[&str]) -> Nbdkit {
        require_tool("nbdkit");
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("nbdkit.sock");
        let pidfile = dir.path().join("nbdkit.pid");
        let child = Command::new("nbdkit")
            .arg("-f")
            .arg("--exit-with-parent")
            .arg("-U")
            .arg(&socket)
            .arg("-P")
            .arg(&pidfile)
            .args(args)
            .stdin(Stdio::null())
            .spawn()
            .expect("start nbdkit");
        let mut k = Nbdkit { child, socket, dir };
        wait_for(&pidfile, &mut k.child);
        k
    }

    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.socket.display())
    }
}

fn wait_for(pidfile: &Path, child: &mut Child) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !pidfile.exists() {
        if let Ok(Some(st)) = child.try_wait() {
            panic!("nbdkit exited early: {st}");
        }
        assert!(Instant::now() < deadline, "nbdkit did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Generates a CA, a server certificate (localhost, 127.0.0.1) and a client
/// certificate in the qemu/nbdkit/libnbd file layout.
pub fn make_pki(dir: &Path) {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, KeyUsagePurpose,
    };
    let ca_key = KeyPair::generate().expect("key");
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("params");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "vdcache test CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key).expect("ca");
    let issuer = Issuer::new(ca, ca_key);

    let leaf = |eku: ExtendedKeyUsagePurpose, cn: &str| {
        let key = KeyPair::generate().expect("key");
        let mut p = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .expect("params");
        p.distinguished_name.push(DnType::CommonName, cn);
        p.extended_key_usages = vec![eku];
        let cert = p.signed_by(&key, &issuer).expect("sign");
        (cert.pem(), key.serialize_pem())
    };
    let (scert, skey) = leaf(ExtendedKeyUsagePurpose::ServerAuth, "localhost");
    let (ccert, ckey) = leaf(ExtendedKeyUsagePurpose::ClientAuth, "vdcache test client");
    std::fs::write(dir.join("ca-cert.pem"), ca_cert.pem()).expect("write");
    std::fs::write(dir.join("server-cert.pem"), scert).expect("write");
    std::fs::write(dir.join("server-key.pem"), skey).expect("write");
    std::fs::write(dir.join("client-cert.pem"), ccert).expect("write");
    std::fs::write(dir.join("client-key.pem"), ckey).expect("write");
}

/// Waits (bounded) until `cond` holds; for counters updated by threads
/// that finish asynchronously after a peer closed its socket.
pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// What a [`Hooked`] memory export does before each read and write.
pub trait Hook: Send + Sync {
    fn before_read(&self) {}
    fn before_write(&self) {}
}

/// A memory export that runs its hook before each read and write; the
/// hook's own methods are reached through it.
pub struct Hooked<H> {
    pub mem: MemExport,
    pub hook: H,
}

impl<H> std::ops::Deref for Hooked<H> {
    type Target = H;
    fn deref(&self) -> &H {
        &self.hook
    }
}

impl<H: Hook> Export for Hooked<H> {
    fn size(&self) -> u64 {
        self.mem.size()
    }
    fn read_only(&self) -> bool {
        false
    }
    fn block_sizes(&self) -> BlockSizes {
        BlockSizes::default()
    }
    fn read(&self, o: u64, b: &mut [u8]) -> Result<(), ExportError> {
        self.hook.before_read();
        self.mem.read(o, b)
    }
    fn write(&self, o: u64, d: &[u8], f: bool) -> Result<(), ExportError> {
        self.hook.before_write();
        self.mem.write(o, d, f)
    }
    fn flush(&self) -> Result<(), ExportError> {
        Ok(())
    }
    fn trim(&self, o: u64, l: u64, f: bool) -> Result<(), ExportError> {
        self.mem.trim(o, l, f)
    }
    fn write_zeroes(&self, o: u64, l: u64, f: ZeroFlags) -> Result<(), ExportError> {
        self.mem.write_zeroes(o, l, f)
    }
}

/// A memory export whose writes (and reads, if asked) wait at a gate until
/// the test opens it; it counts the calls that reached the gate.
pub type Gated = Hooked<Gate>;

pub struct Gate {
    gate_reads: bool,
    /// (calls that reached the gate, gate open)
    state: Mutex<(usize, bool)>,
    cv: Condvar,
}

impl Gated {
    pub fn new(mem: MemExport, gate_reads: bool) -> Gated {
        Hooked {
            mem,
            hook: Gate {
                gate_reads,
                state: Mutex::new((0, false)),
                cv: Condvar::new(),
            },
        }
    }
}

impl Gate {
    /// Waits (bounded) until `n` calls reached the gate.
    pub fn wait_entered(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut g = self.state.lock().expect("gate");
        while g.0 < n {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "only {} of {n} calls reached the gate",
                g.0
            );
            g = self.cv.wait_timeout(g, left).expect("gate").0;
        }
    }

    /// Opens the gate when dropped, so a failing assertion does not leave
    /// calls waiting at it (and the test hanging on them).
    pub fn open_on_drop(&self) -> OpenOnDrop<'_> {
        OpenOnDrop(self)
    }

    /// Lets every waiting and later call through.
    pub fn open(&self) {
        self.state.lock().expect("gate").1 = true;
        self.cv.notify_all();
    }

    fn pass(&self) {
        let mut g = self.state.lock().expect("gate");
        g.0 += 1;
        self.cv.notify_all();
        while !g.1 {
            g = self.cv.wait(g).expect("gate");
        }
    }
}

impl Hook for Gate {
    fn before_read(&self) {
        if self.gate_reads {
            self.pass();
        }
    }
    fn before_write(&self) {
        self.pass();
    }
}

pub struct OpenOnDrop<'a>(&'a Gate);

impl Drop for OpenOnDrop<'_> {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// A request header as a client sends it.
pub fn request_bytes(flags: u16, kind: u16, cookie: u64, offset: u64, length: u32) -> Vec<u8> {
    vdcache_nbd_proto::proto::Request {
        flags,
        kind,
        cookie,
        offset,
        length,
    }
    .encode()
    .to_vec()
}
