//! Store requests run beside the caller's own: a few long-lived threads
//! that take a job each, so that a write and the journal record its flush
//! needs go to the store together without starting a thread per write
//! (a thread start costs more than a wake-up, and it came once per guest
//! write on the fsync-per-write path).
//!
//! A job gets an idle thread, or a new one up to [`MAX_THREADS`]; beyond
//! that it runs on the caller at once. A job never waits in a queue, so a
//! job that starts jobs of its own (a checkpoint's parallel writes) can
//! never wait for a thread that waits for it.
//!
//! Owns: the threads and the hand-over of one job and its result.
//! Must not: know what a job does, or keep a job's result or panic from
//! the caller that joins it.

use std::sync::mpsc::{Receiver, sync_channel};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::thread;

/// Threads at most; idle ones stay for the next job.
const MAX_THREADS: usize = 64;

type Job = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Threads {
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Default)]
struct State {
    /// A job handed to an idle thread and not yet taken.
    offered: Vec<Job>,
    idle: usize,
    started: usize,
}

fn threads() -> &'static Threads {
    static THREADS: OnceLock<Threads> = OnceLock::new();
    THREADS.get_or_init(Threads::default)
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A job started with [`run`].
pub(crate) enum Running<T> {
    /// It ran on the caller (no thread to spare).
    Done(T),
    Beside(Receiver<thread::Result<T>>),
}

impl<T> Running<T> {
    /// Waits for the job; a panic in it continues in the caller.
    pub(crate) fn join(self) -> T {
        match self {
            Running::Done(v) => v,
            Running::Beside(rx) => match rx.recv() {
                Ok(Ok(v)) => v,
                Ok(Err(panic)) => std::panic::resume_unwind(panic),
                // The job's thread died before sending: only a panic in
                // the sending itself, which cannot happen (the channel
                // has room for the one result).
                Err(_) => panic!("a job beside the caller vanished"),
            },
        }
    }
}

/// Starts `job` on another thread, or runs it now when none can be had.
pub(crate) fn run<T: Send + 'static>(job: impl FnOnce() -> T + Send + 'static) -> Running<T> {
    let (tx, rx) = sync_channel(1);
    let wrapped: Job = Box::new(move || {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
        // The caller may be gone (it panicked itself): nothing to tell.
        let _ = tx.send(result);
    });
    match hand_over(wrapped) {
        Ok(()) => Running::Beside(rx),
        Err(job) => {
            job();
            match rx.recv() {
                Ok(Ok(v)) => Running::Done(v),
                Ok(Err(panic)) => std::panic::resume_unwind(panic),
                Err(_) => panic!("a job run on its caller sent no result"),
            }
        }
    }
}

/// Gives `job` to an idle thread or a new one; gives a job back if
/// neither (it may be another caller's: each job carries its own reply).
fn hand_over(job: Job) -> Result<(), Job> {
    let t = threads();
    let mut st = lock(&t.state);
    let idle_free = st.idle > st.offered.len();
    if !idle_free && st.started >= MAX_THREADS {
        return Err(job);
    }
    st.offered.push(job);
    if idle_free {
        drop(st);
        t.wake.notify_one();
        return Ok(());
    }
    st.started += 1;
    drop(st);
    if thread::Builder::new()
        .name("store-beside".into())
        .spawn(move || serve(t))
        .is_ok()
    {
        return Ok(());
    }
    let mut st = lock(&t.state);
    st.started -= 1;
    // One job too many is offered now, unless a thread that turned idle
    // meanwhile took it.
    st.offered.pop().map_or(Ok(()), Err)
}

/// An idle thread's life: take offered jobs, forever.
fn serve(t: &'static Threads) {
    let mut st = lock(&t.state);
    loop {
        st.idle += 1;
        while st.offered.is_empty() {
            st = t.wake.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st.idle -= 1;
        let Some(job) = st.offered.pop() else {
            continue;
        };
        drop(st);
        job();
        st = lock(&t.state);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_runs_on_another_thread_and_returns_its_result() {
        let caller = thread::current().id();
        let job = run(move || (thread::current().id() != caller, 42));
        assert_eq!(job.join(), (true, 42));
    }

    #[test]
    fn with_every_thread_busy_jobs_and_the_jobs_they_start_still_finish() {
        // Twice the thread limit, each job starting one of its own and
        // waiting for it: beyond the limit jobs run on their callers. A
        // queue instead would leave outer jobs waiting for inner ones
        // queued behind them.
        let n = 2 * MAX_THREADS;
        let nap = std::time::Duration::from_millis(5);
        let outer: Vec<Running<Vec<usize>>> = (0..n)
            .map(|i| {
                run(move || {
                    let inner = run(move || {
                        thread::sleep(nap);
                        n + i
                    });
                    thread::sleep(nap);
                    vec![i, inner.join()]
                })
            })
            .collect();
        let mut seen: Vec<usize> = outer.into_iter().flat_map(Running::join).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..2 * n).collect::<Vec<_>>());
        assert!(lock(&threads().state).started <= MAX_THREADS);
    }

    #[test]
    fn a_panic_in_a_job_continues_in_the_caller_that_joins_it() {
        let job = run(|| -> u32 { panic!("store gone") });
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.join()));
        let panic = caught.expect_err("the panic comes back");
        assert_eq!(panic.downcast_ref::<&str>(), Some(&"store gone"));
        // The thread that ran it is still there for the next job.
        assert_eq!(run(|| 7).join(), 7);
    }
}
