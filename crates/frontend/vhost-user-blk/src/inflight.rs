//! Requests of a queue served in parallel, completed in order: a pool of
//! worker threads per connection carries out the requests the queue's
//! thread pops (a backend read of 1 ms must not hold up the requests
//! behind it), and each request's used-ring entry is published only after
//! every request popped before it.
//!
//! In order because a vhost-user front end that loses its back end (kill
//! -9) resumes the queue at the used index: QEMU then hands the back end
//! every request past it again. Were a later request published before an
//! earlier one, a restart would skip the earlier one forever.
//!
//! Owns: the pool, the per-queue sequence numbers and reorder buffers, and
//! the count of requests in flight (what `stop_vring` waits for). Must
//! not: parse requests (`request` does) or hold a queue's reorder lock
//! while popping from its vring (the lock order is reorder, then vring).

use crate::ring::Chain;
use std::collections::BTreeMap;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;
use vhost_user_backend::{VringRwLock, VringT};

/// A popped request and where its completion goes.
pub struct Job {
    pub queue: usize,
    /// The queue's epoch when the request was taken (see `ring::Stops`).
    pub epoch: u64,
    pub seq: u64,
    pub chain: Chain,
    pub vring: VringRwLock,
}

#[derive(Default)]
struct Order {
    /// Sequence number of the next request popped.
    next_seq: u64,
    /// Sequence number of the next completion to publish.
    next_publish: u64,
    /// Completed, not yet published: seq -> (head, used length).
    done: BTreeMap<u64, (u16, u32)>,
}

/// Sequence numbers and reorder buffers of every queue.
pub struct InOrder {
    queues: Vec<(Mutex<Order>, Condvar)>,
}

impl InOrder {
    pub fn new(queues: usize) -> InOrder {
        InOrder {
            queues: (0..queues)
                .map(|_| (Mutex::new(Order::default()), Condvar::new()))
                .collect(),
        }
    }

    fn order(&self, queue: usize) -> Option<std::sync::MutexGuard<'_, Order>> {
        self.queues
            .get(queue)
            .map(|q| q.0.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Numbers a request just popped from `queue`.
    pub fn next_seq(&self, queue: usize) -> u64 {
        self.order(queue).map_or(0, |mut o| {
            o.next_seq += 1;
            o.next_seq - 1
        })
    }

    /// Records a completed request and publishes every completion now in
    /// order; true when something was published (the guest may need a
    /// notification). An error: the used ring refused a completion (the
    /// ring is broken; the completions are accounted for all the same, so
    /// that a stop does not wait for them).
    pub fn complete(
        &self,
        job_queue: usize,
        seq: u64,
        head: u16,
        len: u32,
        vring: &VringRwLock,
    ) -> Result<bool, virtio_queue::Error> {
        let Some(mut o) = self.order(job_queue) else {
            return Ok(false);
        };
        o.done.insert(seq, (head, len));
        let mut published = false;
        let mut refused = None;
        loop {
            let next = o.next_publish;
            let Some((head, len)) = o.done.remove(&next) else {
                break;
            };
            if refused.is_none()
                && let Err(e) = vring.add_used(head, len)
            {
                refused = Some(e);
            }
            o.next_publish += 1;
            published = true;
        }
        drop(o);
        if published {
            self.queues[job_queue].1.notify_all();
        }
        refused.map_or(Ok(published), Err)
    }

    /// Waits until every request popped from `queue` was published (or
    /// `limit` passed); false on time-out.
    pub fn wait_idle(&self, queue: usize, limit: Duration) -> bool {
        let Some((lock, cv)) = self.queues.get(queue) else {
            return true;
        };
        let o = lock.lock().unwrap_or_else(PoisonError::into_inner);
        let (o, timeout) = cv
            .wait_timeout_while(o, limit, |o| o.next_publish != o.next_seq)
            .unwrap_or_else(PoisonError::into_inner);
        drop(o);
        !timeout.timed_out()
    }

    /// Forgets every queue's numbers (a new connection starts its vrings
    /// afresh).
    pub fn reset(&self) {
        for (lock, _) in &self.queues {
            *lock.lock().unwrap_or_else(PoisonError::into_inner) = Order::default();
        }
    }
}

/// Worker threads of one connection.
pub struct Pool {
    tx: Option<mpsc::Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    /// `workers` threads running `serve` on each job.
    pub fn start(workers: usize, serve: Arc<dyn Fn(Job) + Send + Sync>) -> std::io::Result<Pool> {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let mut threads = Vec::with_capacity(workers);
        for _ in 0..workers.max(1) {
            let (rx, serve) = (rx.clone(), serve.clone());
            threads.push(
                std::thread::Builder::new()
                    .name("vdcache-vub-io".into())
                    .spawn(move || {
                        loop {
                            let job = rx.lock().unwrap_or_else(PoisonError::into_inner).recv();
                            match job {
                                Ok(job) => serve(job),
                                Err(_) => return,
                            }
                        }
                    })?,
            );
        }
        Ok(Pool {
            tx: Some(tx),
            threads,
        })
    }

    /// Hands a job to a worker; gives it back if the pool is closed.
    pub fn submit(&self, job: Job) -> Result<(), Box<Job>> {
        match &self.tx {
            Some(tx) => tx.send(job).map_err(|e| Box::new(e.0)),
            None => Err(Box::new(job)),
        }
    }
}

impl Drop for Pool {
    /// Lets the workers finish every job handed to them, then joins them.
    fn drop(&mut self) {
        self.tx.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
