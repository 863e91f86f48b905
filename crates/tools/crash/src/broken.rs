//! Deliberately broken I/O, to prove the harness catches ordering bugs:
//! a [`HostIo`] wrapper that either drops flushes or lets metadata reach
//! storage ahead of the data it points to. For tests and self-checks only.
//!
//! This module must never be used on a real disk, and must keep
//! read-your-writes (the live disk looks correct; only a crash shows the
//! bug).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use vdcache_image::DirectIo;
use vdcache_image::hostio::HostError;
use vdcache_image::hostio::{
    FlushKind, HostIo, ImageHandle, IoClass, IoTag, MetaTable, WriteSegment,
};

type HostResult<T> = Result<T, HostError>;
use vdcache_qcow2::HostOffset;

/// Which ordering rule to break.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Breakage {
    /// Flushes return without making anything durable.
    DropFlushes,
    /// Ordering barriers ([`FlushKind::Barrier`]) are ignored; durable
    /// flushes still work (a cache that skips barriers without keeping
    /// its own order).
    DropBarriers,
    /// Guest data and copy-on-write filler are held back (across ordering
    /// barriers) and issued right after the next L2 table write, or before
    /// a durable flush: the L2 entries pointing to new data reach the store
    /// before the data, with no barrier between them.
    DataAfterMetadata,
    /// The durable flush that follows a metadata journal record is
    /// dropped (a journal that skips its sync).
    SkipJournalSync,
    /// A metadata journal record's table updates are written in place
    /// before the record itself (tables ahead of their transaction).
    TablesBeforeRecord,
}

/// A [`HostIo`] that breaks one ordering rule over direct I/O.
#[derive(Debug)]
pub struct BrokenIo {
    inner: DirectIo,
    breakage: Breakage,
    /// Held-back writes per image, in order.
    held: Mutex<Held>,
    /// Images whose last write was a journal record.
    after_record: Mutex<std::collections::HashSet<Arc<str>>>,
}

/// A write not yet issued: offset, bytes, tag.
type HeldWrite = (u64, Vec<u8>, IoTag);
type Held = HashMap<Arc<str>, Vec<HeldWrite>>;

impl BrokenIo {
    pub fn new(breakage: Breakage) -> Arc<BrokenIo> {
        Arc::new(BrokenIo {
            inner: DirectIo::default(),
            breakage,
            held: Mutex::new(HashMap::new()),
            after_record: Mutex::new(std::collections::HashSet::new()),
        })
    }

    /// A factory for [`crate::Qcow2Target::with_io`].
    pub fn factory(breakage: Breakage) -> crate::IoFactory {
        Arc::new(move || BrokenIo::new(breakage) as Arc<dyn HostIo>)
    }

    /// Issues the held-back writes of `image`, in order.
    fn release(&self, image: &ImageHandle) -> HostResult<()> {
        let held = self.held().remove(&image.name).unwrap_or_default();
        for (off, bytes, tag) in held {
            self.inner.write(
                image,
                HostOffset(off),
                &[WriteSegment { data: &bytes, tag }],
            )?;
        }
        Ok(())
    }

    /// Writes the table updates of a journal record in place.
    fn write_tables_early(
        &self,
        image: &ImageHandle,
        segments: &[WriteSegment<'_>],
    ) -> HostResult<()> {
        let bytes: Vec<u8> = segments
            .iter()
            .flat_map(|s| s.data.iter().copied())
            .collect();
        let Some(id) = bytes.get(8..24).and_then(|b| <[u8; 16]>::try_from(b).ok()) else {
            return Ok(());
        };
        let Some(record) = vdcache_qcow2::meta_journal::Record::decode(&bytes, &id) else {
            return Ok(());
        };
        for e in record.entries {
            if let vdcache_qcow2::meta_journal::Entry::Meta { offset, bytes, .. } = e {
                let tag = IoTag::meta(MetaTable::L2, segments[0].tag.disk);
                self.inner.write(
                    image,
                    HostOffset(offset),
                    &[WriteSegment { data: &bytes, tag }],
                )?;
            }
        }
        Ok(())
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn is_data(class: IoClass) -> bool {
    matches!(class, IoClass::GuestData | IoClass::CowFill)
}

impl HostIo for BrokenIo {
    fn read(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        buf: &mut [u8],
        tag: IoTag,
    ) -> HostResult<()> {
        self.inner.read(image, offset, buf, tag)?;
        let held = self.held();
        let start = offset.0;
        let end = start + buf.len() as u64;
        for (off, data, _) in held.get(&image.name).into_iter().flatten() {
            let (a, b) = ((*off).max(start), (off + data.len() as u64).min(end));
            if a < b {
                buf[(a - start) as usize..(b - start) as usize]
                    .copy_from_slice(&data[(a - off) as usize..(b - off) as usize]);
            }
        }
        Ok(())
    }

    fn write(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        segments: &[WriteSegment<'_>],
    ) -> HostResult<()> {
        let record = segments
            .iter()
            .any(|s| s.tag.class == IoClass::Metadata(MetaTable::Journal));
        {
            let mut after = self.after_record.lock().unwrap_or_else(|p| p.into_inner());
            if record {
                after.insert(image.name.clone());
            } else {
                after.remove(&image.name);
            }
        }
        if record && self.breakage == Breakage::TablesBeforeRecord {
            self.write_tables_early(image, segments)?;
        }
        if self.breakage != Breakage::DataAfterMetadata || segments.is_empty() {
            return self.inner.write(image, offset, segments);
        }
        if segments.iter().all(|s| is_data(s.tag.class)) {
            let bytes: Vec<u8> = segments
                .iter()
                .flat_map(|s| s.data.iter().copied())
                .collect();
            self.held().entry(image.name.clone()).or_default().push((
                offset.0,
                bytes,
                segments[0].tag,
            ));
            return Ok(());
        }
        self.inner.write(image, offset, segments)?;
        if segments
            .iter()
            .any(|s| s.tag.class == IoClass::Metadata(MetaTable::L2))
        {
            self.release(image)?;
        }
        Ok(())
    }

    fn discard(
        &self,
        image: &ImageHandle,
        offset: HostOffset,
        len: u64,
        tag: IoTag,
    ) -> HostResult<()> {
        self.inner.discard(image, offset, len, tag)
    }

    fn flush(&self, image: &ImageHandle, kind: FlushKind) -> HostResult<()> {
        let after_record = self
            .after_record
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&image.name);
        match (self.breakage, kind) {
            (Breakage::SkipJournalSync, FlushKind::Durable) if after_record => Ok(()),
            (Breakage::SkipJournalSync | Breakage::TablesBeforeRecord, _) => {
                self.inner.flush(image, kind)
            }
            (Breakage::DropFlushes, _) | (Breakage::DropBarriers, FlushKind::Barrier) => Ok(()),
            (Breakage::DropBarriers, FlushKind::Durable) => self.inner.flush(image, kind),
            (Breakage::DataAfterMetadata, FlushKind::Barrier) => self.inner.flush(image, kind),
            (Breakage::DataAfterMetadata, FlushKind::Durable) => {
                self.release(image)?;
                self.inner.flush(image, kind)
            }
        }
    }

    fn len(&self, image: &ImageHandle) -> HostResult<u64> {
        let store = self.inner.len(image)?;
        let held = self.held();
        Ok(held
            .get(&image.name)
            .into_iter()
            .flatten()
            .map(|(off, data, _)| off + data.len() as u64)
            .fold(store, u64::max))
    }
}
