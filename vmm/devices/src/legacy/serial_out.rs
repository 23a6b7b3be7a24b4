//! Batched guest serial output.
//!
//! The UART hands over one byte per THR write and then asks for a flush; passed straight
//! through that is one write(2) per byte of guest console output (a Linux boot log is
//! tens of thousands). [`BatchedOutput`] keeps the bytes and writes them out at a newline,
//! once [`BATCH_BYTES`] have collected, or [`FLUSH_DELAY`] after the first byte still
//! waiting (a prompt without a newline), from a small flusher thread, whichever comes
//! first. [`OutputFlush::flush_now`] writes whatever is left when the VM ends.

use std::io::{self, Write};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::virtio::ThreadInit;

/// Bytes collected before they are written out regardless of newlines.
pub const BATCH_BYTES: usize = 4096;
/// Longest a byte waits for its line to end before it is written anyway.
pub const FLUSH_DELAY: Duration = Duration::from_millis(5);

struct Pending {
    bytes: Vec<u8>,
    stop: bool,
}

struct Shared {
    /// Bytes not yet written; the UART's write only ever takes this lock, so a guest
    /// printing never waits for a slow reader until a line or batch is complete.
    pending: Mutex<Pending>,
    /// The destination. Whoever writes out takes this lock first and only then empties
    /// `pending`, so batches leave in order whoever sends them.
    out: Mutex<Box<dyn Write + Send>>,
    wake: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// Writes out what is pending, waiting for the destination if another write is in
    /// progress. A failed write drops the bytes: a console must not stop the VM (the old
    /// per-byte path lost them the same way).
    fn write_out(&self) {
        let mut out = lock(&self.out);
        self.write_out_locked(&mut out);
    }

    /// As [`Shared::write_out`], but gives up if the destination is busy (a writer blocked
    /// on a reader that no longer reads): used at the end, which must not hang.
    fn try_write_out(&self) {
        if let Ok(mut out) = self.out.try_lock() {
            self.write_out_locked(&mut out);
        }
    }

    fn write_out_locked(&self, out: &mut Box<dyn Write + Send>) {
        let bytes = std::mem::take(&mut lock(&self.pending).bytes);
        if bytes.is_empty() {
            return;
        }
        let _ = out.write_all(&bytes);
        let _ = out.flush();
    }
}

/// The writer the UART writes into.
pub struct BatchedOutput {
    shared: Arc<Shared>,
}

/// Writes out what is left (held by the VMM, used when the VM ends).
#[derive(Clone)]
pub struct OutputFlush {
    shared: Arc<Shared>,
}

impl OutputFlush {
    /// Writes out every pending byte now, unless the destination is blocked by a reader
    /// that stopped reading (then nothing more could be delivered anyway).
    pub fn flush_now(&self) {
        self.shared.try_write_out();
    }
}

impl BatchedOutput {
    /// Wraps `out` and starts its flusher thread (named `serial-output`), which runs
    /// `init` first (its seccomp filter); if `init` fails, partial lines are written
    /// only at the next newline, batch or `flush_now`.
    pub fn new(
        out: Box<dyn Write + Send>,
        init: Option<ThreadInit>,
    ) -> io::Result<(Self, OutputFlush, JoinHandle<()>)> {
        let shared = Arc::new(Shared {
            pending: Mutex::new(Pending {
                bytes: Vec::with_capacity(BATCH_BYTES),
                stop: false,
            }),
            out: Mutex::new(out),
            wake: Condvar::new(),
        });
        let flusher = shared.clone();
        let thread = std::thread::Builder::new()
            .name("serial-output".into())
            .spawn(move || {
                if let Some(Err(e)) = init.map(|init| init()) {
                    tracing::error!("Serial output flusher stays off: {e}");
                    return;
                }
                run_flusher(&flusher);
            })?;
        Ok((
            Self {
                shared: shared.clone(),
            },
            OutputFlush { shared },
            thread,
        ))
    }
}

fn run_flusher(shared: &Shared) {
    loop {
        let pending = lock(&shared.pending);
        let pending = shared
            .wake
            .wait_while(pending, |p| p.bytes.is_empty() && !p.stop)
            .unwrap_or_else(PoisonError::into_inner);
        if pending.stop {
            drop(pending);
            shared.try_write_out();
            return;
        }
        // Give the line FLUSH_DELAY to end; a newline or a full batch writes it sooner.
        let (pending, _) = shared
            .wake
            .wait_timeout_while(pending, FLUSH_DELAY, |p| !p.bytes.is_empty() && !p.stop)
            .unwrap_or_else(PoisonError::into_inner);
        drop(pending);
        shared.write_out();
    }
}

impl Write for BatchedOutput {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let mut pending = lock(&self.shared.pending);
        let was_empty = pending.bytes.is_empty();
        pending.bytes.extend_from_slice(data);
        let complete = data.contains(&b'\n') || pending.bytes.len() >= BATCH_BYTES;
        drop(pending);
        if complete {
            // Waits for the destination, as the unbatched UART did on every byte.
            self.shared.write_out();
        } else if was_empty {
            self.shared.wake.notify_one();
        }
        Ok(data.len())
    }

    /// The UART asks after every byte; batching decides instead.
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for BatchedOutput {
    fn drop(&mut self) {
        self.shared.try_write_out();
        lock(&self.shared.pending).stop = true;
        self.shared.wake.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// Records every write it gets.
    #[derive(Clone, Default)]
    struct Recorder(Arc<Mutex<Vec<Vec<u8>>>>);

    impl Write for Recorder {
        fn write(&mut self, data: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().push(data.to_vec());
            Ok(data.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl Recorder {
        fn writes(&self) -> Vec<Vec<u8>> {
            self.0.lock().unwrap().clone()
        }
    }

    fn byte_by_byte(out: &mut BatchedOutput, text: &[u8]) {
        for &b in text {
            out.write_all(&[b]).unwrap();
            out.flush().unwrap();
        }
    }

    #[test]
    fn a_line_written_byte_by_byte_goes_out_in_one_write() {
        let rec = Recorder::default();
        let (mut out, _flush, _thread) = BatchedOutput::new(Box::new(rec.clone()), None).unwrap();
        byte_by_byte(&mut out, b"Linux version 6.1\n");
        assert_eq!(rec.writes(), vec![b"Linux version 6.1\n".to_vec()]);
    }

    #[test]
    fn a_prompt_without_newline_is_written_by_the_flusher() {
        let rec = Recorder::default();
        let (mut out, _flush, _thread) = BatchedOutput::new(Box::new(rec.clone()), None).unwrap();
        byte_by_byte(&mut out, b"login: ");
        let deadline = Instant::now() + Duration::from_secs(10);
        while rec.writes().concat() != b"login: " {
            assert!(Instant::now() < deadline, "the prompt never came out");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn long_output_goes_out_in_batches() {
        let rec = Recorder::default();
        let (mut out, flush, _thread) = BatchedOutput::new(Box::new(rec.clone()), None).unwrap();
        let text = vec![b'x'; 3 * BATCH_BYTES + 10];
        byte_by_byte(&mut out, &text);
        flush.flush_now();
        let writes = rec.writes();
        assert_eq!(writes.concat(), text);
        // Whatever the flusher took on the way, far fewer writes than bytes.
        assert!(writes.len() < 100, "{} writes", writes.len());
    }

    #[test]
    fn flush_now_and_drop_leave_nothing_behind() {
        let rec = Recorder::default();
        let (mut out, flush, thread) = BatchedOutput::new(Box::new(rec.clone()), None).unwrap();
        out.write_all(b"partial").unwrap();
        flush.flush_now();
        assert_eq!(rec.writes().concat(), b"partial");
        out.write_all(b" tail").unwrap();
        drop(out);
        thread.join().unwrap();
        assert_eq!(rec.writes().concat(), b"partial tail");
    }
}
