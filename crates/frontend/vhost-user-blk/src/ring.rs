//! A guest's virtqueue rings, distrusted. The guest driver writes the
//! available ring (its index and entries) and may write anything there:
//! taking a request checks what the virtio-queue library would otherwise
//! log and retry without end, and a ring that breaks virtio's rules stops
//! its queue, the nearest vhost-user comes to virtio's DEVICE_NEEDS_RESET:
//! no request is taken from it, and its kicks are dropped, until the front
//! end stops the queue (GET_VRING_BASE, which QEMU sends when the guest
//! resets the device), resets the device or reconnects.
//!
//! Owns: the per-queue stopped state and why a ring is broken. Must not:
//! parse requests (`request` does), complete them (`inflight` does) or
//! log (the device logs a stop once, with the export's name).

use std::sync::atomic::Ordering;
use std::sync::{Mutex, PoisonError};
use vhost_user_backend::{VringRwLock, VringT};
use virtio_queue::{DescriptorChain, QueueOwnedT, QueueT};
use vm_memory::{
    Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryLoadGuard,
    GuestMemoryMmap,
};

/// A request taken from the available ring, not yet parsed.
pub type Chain = DescriptorChain<GuestMemoryLoadGuard<GuestMemoryMmap>>;

/// Why a queue's rings cannot be served any more.
#[derive(Debug, thiserror::Error)]
pub enum RingFault {
    #[error(
        "the available ring's index {avail} is {pending} requests past the next one to serve \
         ({next}), more than the {size} the queue holds"
    )]
    AvailIndex {
        avail: u16,
        next: u16,
        pending: u16,
        size: u16,
    },
    #[error("the available ring at guest address {addr:#x} cannot be read: {cause}")]
    AvailUnreadable { addr: u64, cause: String },
    #[error(
        "available ring entry {entry} names descriptor {head}, past the {size} the queue holds"
    )]
    HeadIndex { entry: u16, head: u16, size: u16 },
    #[error("the used ring at guest address {addr:#x} cannot be written: {cause}")]
    UsedUnwritable { addr: u64, cause: String },
    #[error("the available ring's index moves back and forth: no request can be taken")]
    Unsteady,
    #[error(
        "the used ring at guest address {used:#x}, which the device writes, overlaps the {what} at {at:#x}"
    )]
    Overlap {
        used: u64,
        what: &'static str,
        at: u64,
    },
}

impl RingFault {
    /// The used ring of `vring` refused a write (a completion, or the
    /// notification fields EVENT_IDX keeps there).
    pub fn used(vring: &VringRwLock, cause: impl std::fmt::Display) -> RingFault {
        RingFault::UsedUnwritable {
            addr: vring.get_ref().get_queue().used_ring(),
            cause: cause.to_string(),
        }
    }
}

/// The next request on `vring`: `None` when the guest made none available
/// or the queue is not started.
pub fn pop(
    vring: &VringRwLock,
    mem: &GuestMemoryAtomic<GuestMemoryMmap>,
) -> Result<Option<Chain>, RingFault> {
    let mut state = vring.get_mut();
    let queue = state.get_queue_mut();
    if !queue.ready() {
        return Ok(None);
    }
    let memory = mem.memory();
    let (size, next, addr) = (queue.size(), queue.next_avail(), queue.avail_ring());
    check_apart(queue.desc_table(), addr, queue.used_ring(), size)?;
    let unreadable = |cause: &dyn std::fmt::Display| RingFault::AvailUnreadable {
        addr,
        cause: cause.to_string(),
    };
    let avail = queue
        .avail_idx(&*memory, Ordering::Acquire)
        .map_err(|e| unreadable(&e))?
        .0;
    let pending = avail.wrapping_sub(next);
    if pending == 0 {
        return Ok(None);
    }
    // virtio 1.2, 2.7.6: the driver never makes more entries available
    // than the queue holds. More means the index is garbage; the library
    // would refuse it (and log) at every try, and the entries it claims
    // would be served twice.
    if pending > size {
        return Err(RingFault::AvailIndex {
            avail,
            next,
            pending,
            size,
        });
    }
    // The entry is read here first: the library logs a line of its own
    // when it cannot read one, at every try.
    let entry = next % size;
    let entry_at = addr
        .checked_add(4 + 2 * u64::from(entry))
        .ok_or_else(|| unreadable(&format_args!("entry {entry} wraps around")))?;
    memory
        .load::<u16>(GuestAddress(entry_at), Ordering::Acquire)
        .map_err(|e| unreadable(&format_args!("entry {entry}: {e}")))?;
    let mut entries = queue.iter(memory).map_err(|e| unreadable(&e))?;
    // None only when the guest moved the index back meanwhile.
    let Some(chain) = entries.next() else {
        return Err(RingFault::Unsteady);
    };
    if chain.head_index() >= size {
        return Err(RingFault::HeadIndex {
            entry,
            head: chain.head_index(),
            size,
        });
    }
    Ok(Some(chain))
}

/// The used ring must lie apart from what the device reads and trusts:
/// on the available ring, each completion would make more requests
/// "available", and the queue would serve itself for ever.
fn check_apart(desc: u64, avail: u64, used: u64, size: u16) -> Result<(), RingFault> {
    let size = u64::from(size);
    // virtio 1.2, 2.7: the areas' sizes (with the EVENT_IDX fields).
    let areas = [
        ("descriptor table", desc, 16 * size),
        ("available ring", avail, 6 + 2 * size),
    ];
    let used_end = used.saturating_add(6 + 8 * size);
    for (what, at, len) in areas {
        if at < used_end && used < at.saturating_add(len) {
            return Err(RingFault::Overlap { used, what, at });
        }
    }
    Ok(())
}

/// Whether the front end has started `vring` (and not stopped it since).
pub fn started(vring: &VringRwLock) -> bool {
    vring.get_ref().get_queue().ready()
}

#[derive(Default)]
struct QueueState {
    /// Counts the front end's restarts of the queue: a fault seen before
    /// one must not stop the queue it configured afresh.
    epoch: u64,
    stopped: bool,
}

/// Which queues are stopped for a broken ring.
pub struct Stops {
    queues: Vec<Mutex<QueueState>>,
}

impl Stops {
    pub fn new(queues: usize) -> Stops {
        Stops {
            queues: (0..queues).map(|_| Mutex::default()).collect(),
        }
    }

    fn state(&self, queue: usize) -> Option<std::sync::MutexGuard<'_, QueueState>> {
        self.queues
            .get(queue)
            .map(|q| q.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The queue's epoch while it may be served; `None` while it is
    /// stopped (or is no queue of this device).
    pub fn serving(&self, queue: usize) -> Option<u64> {
        self.state(queue)
            .and_then(|s| (!s.stopped).then_some(s.epoch))
    }

    /// Stops `queue` unless the front end restarted it after `epoch`;
    /// true when this call stopped it (the caller logs why, once).
    pub fn stop(&self, queue: usize, epoch: u64) -> bool {
        let Some(mut s) = self.state(queue) else {
            return false;
        };
        if s.stopped || s.epoch != epoch {
            return false;
        }
        s.stopped = true;
        true
    }

    /// The front end stopped `queue` (it configures it afresh next).
    pub fn restart(&self, queue: usize) {
        if let Some(mut s) = self.state(queue) {
            s.epoch += 1;
            s.stopped = false;
        }
    }

    /// A device reset or a new connection: every queue starts afresh.
    pub fn restart_all(&self) {
        for queue in 0..self.queues.len() {
            self.restart(queue);
        }
    }
}
