//! The front door's request threads: each forwarded request still runs on a thread of its
//! own for as long as it lasts (so a slow client or guest holds only its own thread and
//! its own tenant's place), but a thread that finished a request waits a while for the
//! next one instead of exiting, so a request does not pay for creating a thread. At most
//! [`MAX_IDLE`] threads wait; one that waits [`IDLE_TIMEOUT`] with nothing to do exits.
//! There is no cap on busy threads here: the tenants' `max_concurrency` quotas bound them.

use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Most idle threads kept waiting for work.
pub const MAX_IDLE: usize = 64;
/// How long an idle thread waits for work before it exits.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

type Job = Box<dyn FnOnce() + Send + 'static>;
/// The idle threads: each one's id and where to hand it a job.
type Idle = Vec<(u64, mpsc::Sender<Job>)>;

/// A set of reusable request threads (see the module's documentation).
#[derive(Clone, Default)]
pub struct Workers {
    idle: Arc<Mutex<Idle>>,
    next_id: Arc<std::sync::atomic::AtomicU64>,
}

impl Workers {
    /// Runs `job` on an idle thread, or on a new one if none is idle.
    pub fn run(&self, job: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
        let mut job: Job = Box::new(job);
        loop {
            let waiting = self.lock().pop();
            let Some((_, tx)) = waiting else { break };
            // A popped thread cannot exit before it receives (it exits only after taking
            // itself off the list); a send fails only if it panicked: try the next one.
            match tx.send(job) {
                Ok(()) => return Ok(()),
                Err(mpsc::SendError(back)) => job = back,
            }
        }
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let workers = self.clone();
        std::thread::Builder::new()
            .name("tenantvmd-frontdoor".into())
            .spawn(move || workers.work(id, job))
            .map(|_| ())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Idle> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Idle threads now waiting.
    #[cfg(test)]
    fn idle(&self) -> usize {
        self.lock().len()
    }

    fn work(&self, id: u64, first: Job) {
        first();
        let (tx, rx) = mpsc::channel::<Job>();
        loop {
            {
                let mut idle = self.lock();
                if idle.len() >= MAX_IDLE {
                    return;
                }
                idle.push((id, tx.clone()));
            }
            let job = match rx.recv_timeout(IDLE_TIMEOUT) {
                Ok(job) => job,
                Err(_) => {
                    let mut idle = self.lock();
                    if let Some(at) = idle.iter().position(|(i, _)| *i == id) {
                        idle.remove(at);
                        return;
                    }
                    drop(idle);
                    // Taken off the list by a sender: its job is on its way.
                    match rx.recv() {
                        Ok(job) => job,
                        Err(_) => return,
                    }
                }
            };
            job();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_finished_thread_takes_the_next_job_and_busy_ones_do_not_block_others() {
        let workers = Workers::default();
        let (done_tx, done_rx) = mpsc::channel();
        let t = done_tx.clone();
        workers
            .run(move || t.send(std::thread::current().id()).unwrap())
            .unwrap();
        let first = done_rx.recv().unwrap();
        // Wait until that thread is back on the idle list, then reuse it.
        while workers.idle() == 0 {
            std::thread::yield_now();
        }
        let t = done_tx.clone();
        workers
            .run(move || t.send(std::thread::current().id()).unwrap())
            .unwrap();
        assert_eq!(done_rx.recv().unwrap(), first);
        // A job that blocks does not hold up the next: it gets a thread of its own.
        let (release_tx, release_rx) = mpsc::channel::<()>();
        workers
            .run(move || {
                let _ = release_rx.recv();
            })
            .unwrap();
        let t = done_tx.clone();
        workers
            .run(move || t.send(std::thread::current().id()).unwrap())
            .unwrap();
        let other = done_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        release_tx.send(()).unwrap();
        let _ = other;
    }
}
