//! A virtual disk as an NBD export: every NBD command mapped onto the COW
//! engine, engine errors mapped onto NBD error values, each command's time
//! recorded in the export's latency histograms (the metrics endpoint's).

use super::metrics::Latency;
use std::sync::Arc;
use std::time::Instant;
use vdcache_image::{HostError, ImageError, VirtualDisk, ZeroFlags as DiskZeroFlags};
use vdcache_nbd_server::{BlockSizes, Export, ExportError, Extent, ZeroFlags};

/// Prefetch (NBD_CMD_CACHE) reads at most this much per request.
const PREFETCH_CHUNK: u64 = 4 << 20;

/// One served disk.
pub struct DiskExport {
    pub disk: Arc<VirtualDisk>,
    /// Where the time each command took is recorded, when measured.
    pub latency: Option<Latency>,
}

impl DiskExport {
    /// Runs one command of kind `op` (an index into `metrics::OPS`),
    /// recording how long it took.
    fn timed<T>(
        &self,
        op: usize,
        f: impl FnOnce() -> Result<T, ExportError>,
    ) -> Result<T, ExportError> {
        let Some(l) = &self.latency else {
            return f();
        };
        let start = Instant::now();
        let r = f();
        l.observe(op, start.elapsed());
        r
    }
}

fn to_nbd(e: ImageError) -> ExportError {
    let m = e.to_string();
    match e {
        ImageError::ReadOnly { .. } => ExportError::PermissionDenied(m),
        ImageError::OutOfRange { .. } => ExportError::Invalid(m),
        ImageError::NoSpace { .. } => ExportError::NoSpace(m),
        ImageError::Io {
            cause: HostError::NoSpace(_),
            ..
        } => ExportError::NoSpace(m),
        _ => {
            tracing::error!("I/O error: {m}");
            ExportError::Io(m)
        }
    }
}

impl Export for DiskExport {
    fn size(&self) -> u64 {
        self.disk.size()
    }

    fn read_only(&self) -> bool {
        self.disk.read_only()
    }

    fn block_sizes(&self) -> BlockSizes {
        BlockSizes {
            minimum: 1,
            preferred: self.disk.cluster_size().clamp(4096, 1 << 20) as u32,
            maximum: 32 << 20,
        }
    }

    fn can_multi_conn(&self) -> bool {
        // A flush on any connection makes every completed write durable.
        true
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExportError> {
        self.timed(0, || self.disk.read(offset, buf).map_err(to_nbd))
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ExportError> {
        self.timed(1, || self.disk.write(offset, data, fua).map_err(to_nbd))
    }

    fn flush(&self) -> Result<(), ExportError> {
        self.timed(2, || self.disk.flush().map_err(to_nbd))
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), ExportError> {
        self.timed(3, || {
            self.disk.discard(offset, len).map_err(to_nbd)?;
            if fua {
                self.disk.flush().map_err(to_nbd)?;
            }
            Ok(())
        })
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<(), ExportError> {
        if flags.fast_zero {
            // Zeroing may fall back to writing zeros (partial clusters,
            // version 2 images); never promise it is fast.
            return Err(ExportError::NotSupported(
                "fast zeroing is not guaranteed".into(),
            ));
        }
        self.timed(4, || {
            self.disk
                .write_zeroes(
                    offset,
                    len,
                    DiskZeroFlags {
                        may_unmap: !flags.no_hole,
                        fua: flags.fua,
                    },
                )
                .map_err(to_nbd)
        })
    }

    fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, ExportError> {
        let status = self.disk.block_status(offset, len).map_err(to_nbd)?;
        Ok(status
            .into_iter()
            .map(|(length, s)| Extent {
                length,
                hole: s.hole,
                zero: s.zero,
            })
            .collect())
    }

    fn cache(&self, offset: u64, len: u64) -> Result<(), ExportError> {
        // A prefetch hint: reading pulls the range into the flash cache.
        self.timed(5, || {
            let mut buf = vec![0u8; len.min(PREFETCH_CHUNK) as usize];
            let mut pos = offset;
            while pos < offset + len {
                let n = (offset + len - pos).min(PREFETCH_CHUNK) as usize;
                self.disk.read(pos, &mut buf[..n]).map_err(to_nbd)?;
                pos += n as u64;
            }
            Ok(())
        })
    }
}
