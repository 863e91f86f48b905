//! Serves an in-memory disk over NBD until standard input closes.
//!
//! ```text
//! cargo run -p vdcache-nbd-server --example memserve -- --socket /tmp/mem.sock --size 64M [--export NAME]
//!     [--tcp 127.0.0.1:10809] [--tls-dir DIR] [--read-only]
//! ```
//! Prints `ready` once listening. For manual tests with qemu-io, nbdinfo,
//! nbdcopy and fio; the crate's tests run the server in-process.

use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;

use vdcache_nbd_server::{MemExport, Server, TlsServerConfig};

fn parse_size(s: &str) -> Option<u64> {
    let (num, mul) = match s.as_bytes().last()? {
        b'K' | b'k' => (&s[..s.len() - 1], 1u64 << 10),
        b'M' | b'm' => (&s[..s.len() - 1], 1 << 20),
        b'G' | b'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>().ok()?.checked_mul(mul)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut socket: Option<PathBuf> = None;
    let mut tcp: Option<String> = None;
    let mut size = 64u64 << 20;
    let mut export = String::new();
    let mut tls_dir: Option<PathBuf> = None;
    let mut read_only = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--socket" => socket = Some(val()?.into()),
            "--tcp" => tcp = Some(val()?),
            "--size" => size = parse_size(&val()?).ok_or("bad --size")?,
            "--export" => export = val()?,
            "--tls-dir" => tls_dir = Some(val()?.into()),
            "--read-only" => read_only = true,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let disk = Arc::new(MemExport::new(size).read_only(read_only));
    let mut b = Server::builder().export_with_description(export, "vdcache memserve", disk);
    if let Some(dir) = tls_dir {
        b = b.tls(TlsServerConfig::from_x509_dir(&dir, false)?);
    }
    let server = b.build()?;
    if let Some(p) = &socket {
        server.listen_unix(p)?;
    }
    if let Some(a) = &tcp {
        let addr = server.listen_tcp(a.as_str())?;
        eprintln!("listening on {addr}");
    }
    if socket.is_none() && tcp.is_none() {
        return Err("give --socket PATH and/or --tcp ADDR".into());
    }
    println!("ready");
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    server.shutdown();
    Ok(())
}
