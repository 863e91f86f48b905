//! An image file that lives on an NBD export (a storage server): reads and
//! writes become NBD requests, several in flight from different threads.
//! An export has a fixed size, so the store cannot grow; writing past its
//! end fails with ENOSPC, which the COW layer reports as a full store.

use crate::Backend;
use std::io;
use vdcache_nbd::{ClientError, NbdClient};

/// Whether a name is an NBD URI rather than a path.
pub fn is_nbd_uri(name: &str) -> bool {
    ["nbd://", "nbd+unix://", "nbds://", "nbds+unix://"]
        .iter()
        .any(|s| name.starts_with(s))
}

/// A store on an NBD export.
pub struct NbdBackend {
    client: NbdClient,
    name: String,
    size: u64,
    chunk: u64,
}

impl std::fmt::Debug for NbdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdBackend")
            .field("uri", &self.name)
            .field("size", &self.size)
            .finish()
    }
}

fn to_io(e: ClientError) -> io::Error {
    match e.errno().map(|n| n.0) {
        Some(28) => io::Error::from_raw_os_error(libc::ENOSPC),
        Some(1) => io::Error::from_raw_os_error(libc::EPERM),
        Some(22) => io::Error::new(io::ErrorKind::InvalidInput, e.to_string()),
        _ => io::Error::other(e.to_string()),
    }
}

impl NbdBackend {
    /// Connects to the export named by `uri`.
    pub fn connect(uri: &str) -> io::Result<NbdBackend> {
        let client =
            NbdClient::connect(uri).map_err(|e| io::Error::other(format!("{uri}: {e}")))?;
        let size = client.size();
        let chunk = u64::from(client.block_sizes().maximum).clamp(4096, 32 << 20);
        Ok(NbdBackend {
            client,
            name: uri.to_string(),
            size,
            chunk,
        })
    }

    fn check_room(&self, offset: u64, len: u64) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(io::Error::from_raw_os_error(libc::ENOSPC)),
        }
    }
}

impl Backend for NbdBackend {
    fn len(&self) -> io::Result<u64> {
        Ok(self.size)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let inside = self.size.saturating_sub(offset).min(buf.len() as u64) as usize;
        buf[inside..].fill(0);
        let mut done = 0usize;
        while done < inside {
            let n = (inside - done).min(self.chunk as usize);
            self.client
                .read_at(offset + done as u64, &mut buf[done..done + n])
                .map_err(to_io)?;
            done += n;
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.check_room(offset, buf.len() as u64)?;
        let mut done = 0usize;
        while done < buf.len() {
            let n = (buf.len() - done).min(self.chunk as usize);
            self.client
                .write_at(offset + done as u64, &buf[done..done + n], false)
                .map_err(to_io)?;
            done += n;
        }
        Ok(())
    }

    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        // One request (one network round trip) for the whole run.
        let joined: Vec<u8> = bufs.concat();
        self.write_at(&joined, offset)
    }

    fn flush(&self) -> io::Result<()> {
        self.client.flush().map_err(to_io)
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        let len = len.min(self.size.saturating_sub(offset));
        if len == 0 {
            return Ok(());
        }
        self.client.trim(offset, len, false).map_err(to_io)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        if len == self.size {
            Ok(())
        } else {
            Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("{}: an NBD export cannot change size", self.name),
            ))
        }
    }

    fn can_grow(&self) -> bool {
        false
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn identity(&self) -> io::Result<crate::StoreIdentity> {
        // An export says nothing of its file but its size.
        Ok(crate::StoreIdentity {
            size: self.size,
            ..crate::StoreIdentity::default()
        })
    }
}
