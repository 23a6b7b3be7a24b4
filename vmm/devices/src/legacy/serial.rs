//! COM1: a 16550A UART (vm-superio) whose interrupt is an irqfd.
//!
//! Output goes to the VMM's stdout, to a file opened with O_APPEND, or nowhere. Input comes
//! from a host reader (stdin) through [`spawn_input_thread`], which never overfills the
//! UART's receive FIFO: it waits for the guest to drain it.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use vm_superio::serial::SerialEvents;
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::LegacyDeviceError;
use crate::bus::BusDevice;
use crate::virtio::ThreadInit;

use super::serial_out::{BatchedOutput, OutputFlush};

/// An interrupt line backed by an eventfd registered with KVM as an irqfd.
pub struct IrqTrigger(pub EventFd);

impl Trigger for IrqTrigger {
    type E = io::Error;

    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

/// Where the guest's serial output goes.
pub enum SerialOutput {
    /// The VMM's standard output.
    Stdout,
    /// A file opened for appending.
    File(File),
    /// Discarded.
    Sink,
}

impl SerialOutput {
    /// The UART's writer: batched (serial_out.rs) unless output is discarded; `init`
    /// runs on the batching flusher thread first.
    fn into_writer(
        self,
        init: Option<ThreadInit>,
    ) -> io::Result<(Box<dyn Write + Send>, Option<OutputFlush>)> {
        let out: Box<dyn Write + Send> = match self {
            SerialOutput::Stdout => Box::new(io::stdout()),
            SerialOutput::File(file) => Box::new(CappedWriter::new(file, SERIAL_FILE_LIMIT)),
            SerialOutput::Sink => return Ok((Box::new(io::sink()), None)),
        };
        let (batched, flush, _flusher) = BatchedOutput::new(out, init)?;
        Ok((Box::new(batched), Some(flush)))
    }
}

/// Most bytes of guest output one VMM appends to a serial file (64 MiB); a guest must not
/// be able to fill the host's disk through its console.
pub const SERIAL_FILE_LIMIT: u64 = 64 << 20;

/// A writer that passes through up to `limit` bytes, then writes one notice and silently
/// drops the rest.
struct CappedWriter<W: Write> {
    inner: W,
    written: u64,
    limit: u64,
    noticed: bool,
}

impl<W: Write> CappedWriter<W> {
    fn new(inner: W, limit: u64) -> Self {
        Self {
            inner,
            written: 0,
            limit,
            noticed: false,
        }
    }
}

impl<W: Write> Write for CappedWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let room = self.limit.saturating_sub(self.written);
        if room == 0 {
            if !self.noticed {
                self.noticed = true;
                let notice = format!(
                    "\n[tenantvm-vmm: serial output limit of {} bytes reached; the rest is dropped]\n",
                    self.limit
                );
                self.inner.write_all(notice.as_bytes())?;
            }
            return Ok(buf.len());
        }
        let take = buf.len().min(usize::try_from(room).unwrap_or(usize::MAX));
        let n = self.inner.write(&buf[..take])?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Signals the input thread when the guest has emptied the receive FIFO.
struct InputReady(EventFd);

impl SerialEvents for InputReady {
    fn buffer_read(&self) {}
    fn out_byte(&self) {}
    fn tx_lost_byte(&self) {}
    fn in_buffer_empty(&self) {
        // A failed write only delays the input thread until its poll timeout.
        let _ = self.0.write(1);
    }
}

/// The COM1 UART as a bus device.
pub struct SerialDevice {
    uart: Serial<IrqTrigger, InputReady, Box<dyn Write + Send>>,
    flush: Option<OutputFlush>,
}

impl SerialDevice {
    /// Creates the UART; `irq` is the eventfd registered as its irqfd. Output is batched
    /// (serial_out.rs) by a `serial-output` thread that runs `init` first.
    pub fn new(
        irq: EventFd,
        output: SerialOutput,
        init: Option<ThreadInit>,
    ) -> Result<Self, LegacyDeviceError> {
        let ready = EventFd::new(EFD_NONBLOCK).map_err(LegacyDeviceError::EventFd)?;
        let (writer, flush) = output
            .into_writer(init)
            .map_err(LegacyDeviceError::SpawnOutput)?;
        Ok(Self {
            uart: Serial::with_events(IrqTrigger(irq), InputReady(ready), writer),
            flush,
        })
    }

    /// Writes out guest output still waiting in the batch (call when the VM ends).
    pub fn output_flush(&self) -> Option<OutputFlush> {
        self.flush.clone()
    }

    /// Free space in the receive FIFO.
    pub fn fifo_capacity(&self) -> usize {
        self.uart.fifo_capacity()
    }

    /// Queues `input` for the guest; returns how many bytes fitted.
    pub fn enqueue(&mut self, input: &[u8]) -> usize {
        if input.is_empty() || self.uart.fifo_capacity() == 0 {
            return 0;
        }
        self.uart.enqueue_raw_bytes(input).unwrap_or(0)
    }

    fn ready_fd(&self) -> io::Result<EventFd> {
        self.uart.events().0.try_clone()
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, _base: u64, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let (Ok(offset), Some(first)) = (u8::try_from(offset), data.first_mut()) {
            *first = self.uart.read(offset);
        }
    }

    fn write(&mut self, _base: u64, offset: u64, data: &[u8]) {
        if let (Ok(offset), Some(&value)) = (u8::try_from(offset), data.first()) {
            // The only error is a failed interrupt trigger; the guest sees a lost interrupt,
            // as on real hardware with a stuck line, and the VMM carries on.
            let _ = self.uart.write(offset, value);
        }
    }
}

/// How long the input thread waits for the guest to drain the FIFO before retrying
/// (the UART in loopback mode never reports an empty FIFO).
const INPUT_RETRY_MS: i32 = 100;

/// Starts a thread that copies `input` into the UART's receive FIFO until end of file.
/// `init` runs on the thread first (its seccomp filter); if it fails the thread logs
/// why and ends without reading anything.
pub fn spawn_input_thread(
    serial: Arc<Mutex<SerialDevice>>,
    mut input: Box<dyn Read + Send>,
    init: Option<ThreadInit>,
) -> Result<JoinHandle<()>, LegacyDeviceError> {
    let ready = lock(&serial)
        .ready_fd()
        .map_err(LegacyDeviceError::EventFd)?;
    std::thread::Builder::new()
        .name("serial-input".into())
        .spawn(move || {
            if let Some(Err(e)) = init.map(|init| init()) {
                tracing::error!("Serial input stays off: {e}");
                return;
            }
            let mut buf = [0u8; 256];
            loop {
                let n = match input.read(&mut buf) {
                    Ok(0) => return,
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(_) => return,
                };
                let mut pending = &buf[..n];
                while !pending.is_empty() {
                    let taken = lock(&serial).enqueue(pending);
                    pending = &pending[taken..];
                    if !pending.is_empty() {
                        wait_readable(&ready, INPUT_RETRY_MS);
                        let _ = ready.read();
                    }
                }
            }
        })
        .map_err(LegacyDeviceError::SpawnInput)
}

fn lock(serial: &Mutex<SerialDevice>) -> std::sync::MutexGuard<'_, SerialDevice> {
    serial
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn wait_readable(fd: &EventFd, timeout_ms: i32) {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `pfd` is a valid pollfd for the duration of the call and nfds is 1.
    unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Seek;

    const RBR_THR: u64 = 0;
    const IER: u64 = 1;
    const LSR: u64 = 5;

    #[test]
    fn guest_writes_reach_the_output_file() {
        let mut file = tempfile::tempfile().unwrap();
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let mut dev =
            SerialDevice::new(irq, SerialOutput::File(file.try_clone().unwrap()), None).unwrap();
        for b in b"hi\n" {
            dev.write(0x3f8, RBR_THR, &[*b]);
        }
        let mut out = String::new();
        file.rewind().unwrap();
        file.read_to_string(&mut out).unwrap();
        assert_eq!(out, "hi\n");
    }

    #[test]
    fn file_output_stops_at_the_limit_with_one_notice() {
        let mut out = CappedWriter::new(Vec::new(), 4);
        out.write_all(b"abcdef").unwrap();
        out.write_all(b"gh").unwrap();
        let text = String::from_utf8(out.inner).unwrap();
        assert_eq!(
            text,
            "abcd\n[tenantvm-vmm: serial output limit of 4 bytes reached; the rest is dropped]\n"
        );
    }

    #[test]
    fn input_is_readable_by_guest_and_raises_interrupt() {
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let irq_seen = irq.try_clone().unwrap();
        let mut dev = SerialDevice::new(irq, SerialOutput::Sink, None).unwrap();
        dev.write(0x3f8, IER, &[0x01]); // receive-data interrupt on
        assert_eq!(dev.enqueue(b"ab"), 2);
        assert_eq!(irq_seen.read().unwrap(), 1);
        let mut lsr = [0u8];
        dev.read(0x3f8, LSR, &mut lsr);
        assert_eq!(lsr[0] & 1, 1, "data ready");
        let mut byte = [0u8];
        dev.read(0x3f8, RBR_THR, &mut byte);
        assert_eq!(byte, [b'a']);
    }

    #[test]
    fn enqueue_never_overfills_the_fifo() {
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let mut dev = SerialDevice::new(irq, SerialOutput::Sink, None).unwrap();
        let big = [b'x'; 1000];
        let first = dev.enqueue(&big);
        assert!(first < big.len());
        assert_eq!(dev.enqueue(&big), 0);
    }

    #[test]
    fn out_of_range_offsets_and_empty_accesses_do_not_panic() {
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let mut dev = SerialDevice::new(irq, SerialOutput::Sink, None).unwrap();
        dev.write(0x3f8, 300, &[1]);
        dev.write(0x3f8, 0, &[]);
        let mut empty: [u8; 0] = [];
        dev.read(0x3f8, 300, &mut empty);
        let mut wide = [0xffu8; 4];
        dev.read(0x3f8, 7, &mut wide);
        assert_eq!(&wide[1..], &[0, 0, 0]);
    }

    #[test]
    fn input_thread_delivers_all_bytes_as_guest_drains() {
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let dev = Arc::new(Mutex::new(
            SerialDevice::new(irq, SerialOutput::Sink, None).unwrap(),
        ));
        let data: Vec<u8> = (0..200u8).collect();
        let handle =
            spawn_input_thread(dev.clone(), Box::new(io::Cursor::new(data.clone())), None).unwrap();
        let mut got = Vec::new();
        while got.len() < data.len() {
            let mut lsr = [0u8];
            let mut d = dev.lock().unwrap();
            d.read(0x3f8, LSR, &mut lsr);
            if lsr[0] & 1 == 1 {
                let mut b = [0u8];
                d.read(0x3f8, RBR_THR, &mut b);
                got.push(b[0]);
            }
            drop(d);
            std::thread::yield_now();
        }
        handle.join().unwrap();
        assert_eq!(got, data);
    }
}
