//! An in-memory backend for tests and in-process replay.

use crate::Backend;
use std::io;
use std::sync::RwLock;

/// A growable byte vector behind a lock.
#[derive(Debug)]
pub struct MemBackend {
    name: String,
    data: RwLock<Vec<u8>>,
    growable: bool,
}

impl MemBackend {
    pub fn new(name: impl Into<String>, data: Vec<u8>) -> Self {
        MemBackend {
            name: name.into(),
            data: RwLock::new(data),
            growable: true,
        }
    }

    /// A fixed-size store, like an NBD export.
    pub fn fixed(name: impl Into<String>, len: usize) -> Self {
        Self::fixed_from(name, vec![0; len])
    }

    /// A fixed-size store holding `data` (its length is the store's): no
    /// zeroed store to copy into first.
    pub fn fixed_from(name: impl Into<String>, data: Vec<u8>) -> Self {
        MemBackend {
            name: name.into(),
            data: RwLock::new(data),
            growable: false,
        }
    }

    /// A copy of the current contents.
    pub fn snapshot(&self) -> Vec<u8> {
        self.data.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The contents, without a copy: for callers that reuse the buffer
    /// of a store they are done with.
    pub fn into_data(self) -> Vec<u8> {
        self.data.into_inner().unwrap_or_else(|p| p.into_inner())
    }
}

fn poisoned() -> io::Error {
    io::Error::other("memory backend lock poisoned")
}

impl Backend for MemBackend {
    fn len(&self) -> io::Result<u64> {
        Ok(self.data.read().map_err(|_| poisoned())?.len() as u64)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let data = self.data.read().map_err(|_| poisoned())?;
        let start = (offset.min(data.len() as u64)) as usize;
        let avail = (data.len() - start).min(buf.len());
        buf[..avail].copy_from_slice(&data[start..start + avail]);
        buf[avail..].fill(0);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let mut data = self.data.write().map_err(|_| poisoned())?;
        let end = offset
            .checked_add(buf.len() as u64)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "offset overflow"))?;
        if end > data.len() as u64 {
            if !self.growable {
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
            data.resize(end as usize, 0);
        }
        data[offset as usize..end as usize].copy_from_slice(buf);
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        let mut data = self.data.write().map_err(|_| poisoned())?;
        let start = offset.min(data.len() as u64) as usize;
        let end = offset.saturating_add(len).min(data.len() as u64) as usize;
        data[start..end].fill(0);
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut data = self.data.write().map_err(|_| poisoned())?;
        if len > data.len() as u64 && !self.growable {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        data.resize(len as usize, 0);
        Ok(())
    }

    fn can_grow(&self) -> bool {
        self.growable
    }

    fn name(&self) -> &str {
        &self.name
    }
}
