//! The loop that carries a multiplexed channel, the same on both ends: one thread polls the
//! channel and every stream's local socket, turns [`MuxFrame`]s into bytes on per-stream
//! Unix socket pairs and back, and keeps the credit books.
//!
//! Each stream is a `socketpair(2)`: the user of a stream (the host's [`AgentClient`], the
//! agent's `serve_stream`) holds one end and does plain blocking I/O with its own
//! deadlines, exactly as on a vsock connection; the pump holds the other end, non-blocking.
//!
//! Bounds, against a hostile peer:
//! - bytes received for a stream wait in a buffer no larger than the credit this side
//!   granted ([`MuxConfig::window`]); credit is granted again only as the local user
//!   takes the bytes, so a peer cannot make this side hold more;
//! - at most [`MuxConfig::max_streams`] streams are open ([`StreamTable`]);
//! - a stream that has bytes to send and no credit for [`MuxConfig::stall`] fails the
//!   channel (a peer that never grants credit);
//! - every write to the channel has a deadline ([`MuxConfig::write_timeout`]);
//! - a frame error that loses the frame boundary, or any rule broken by a peer that is
//!   not a per-stream one, fails the channel; a per-stream one resets that stream only.
//!
//! A failed channel ends the loop: every stream's local end is closed (their users see
//! end of stream or a reset) and [`PumpEnd::Failed`] says why.
//!
//! [`AgentClient`]: crate::client::AgentClient

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use super::{MuxDecoder, MuxError, MuxFrame, StreamTable, MAX_MUX_DATA, MAX_WINDOW};

/// Limits of one multiplexed channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MuxConfig {
    /// Most streams open at once (the tenant's `max_concurrency`).
    pub max_streams: usize,
    /// Credit granted per stream, and so the most bytes buffered per stream.
    pub window: u32,
    /// Longest time one frame may take to be written to the channel.
    pub write_timeout: Duration,
    /// Longest time a stream may wait for credit while it has bytes to send.
    pub stall: Duration,
    /// The host's loop ends by itself after this long with no stream (so the port is free
    /// for another client of QEMU's one-client chardev); `None`: never.
    pub idle: Option<Duration>,
}

impl Default for MuxConfig {
    fn default() -> Self {
        Self {
            max_streams: 8,
            window: 256 * 1024,
            write_timeout: Duration::from_secs(10),
            stall: Duration::from_secs(30),
            idle: None,
        }
    }
}

/// Why the loop ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PumpEnd {
    /// Asked to stop, or the peer closed the channel.
    Closed,
    /// (Guest only.) A plain agent request arrived where a mux frame was due: the host's
    /// end of the port changed hands without an `end` (a daemon killed while it held the
    /// channel). The bytes received from that request on, to be read before the port's.
    Plain(Vec<u8>),
    /// The peer broke the channel's rules or stopped taking bytes; drop it, reconnect.
    Failed(String),
}

/// Longest time spent handing streams' users their last bytes once the peer closed.
const FLUSH_LIMIT: Duration = Duration::from_secs(1);
/// Longest time the host waits for the guest's `end` in answer to its own before it closes
/// the channel anyway (a guest that does not answer only risks its own next request).
const RELEASE_LIMIT: Duration = Duration::from_secs(2);

/// Which end the loop serves.
pub(crate) enum Role<'a> {
    /// The host: it opens streams ([`Pending`]); a peer's `open` breaks the rules.
    Host,
    /// The guest: the host opens streams, each is handed (the user's end) to `serve`.
    Guest(&'a mut dyn FnMut(UnixStream)),
}

/// Streams the host asked for and the loop has not announced yet.
pub(crate) type Pending = Arc<Mutex<Vec<(u32, UnixStream)>>>;

/// Shared between the loop and whoever starts streams or stops it.
pub(crate) struct Control {
    /// Set to stop the loop.
    pub stop: AtomicBool,
    /// Host streams to open.
    pub pending: Pending,
    /// The loop's wake-up socket (a byte written to the other end wakes `poll`).
    pub wake_rx: UnixStream,
    /// Set by the loop when it ended.
    pub ended: Mutex<Option<PumpEnd>>,
    /// Streams open, as the loop last counted them.
    pub live: std::sync::atomic::AtomicUsize,
}

struct Stream {
    local: UnixStream,
    /// Bytes from the peer not yet taken by the local user (at most our window).
    inbound: VecDeque<u8>,
    /// Bytes delivered locally since credit was last granted.
    taken: u32,
    /// Credit the peer granted us.
    credit: u32,
    /// The local user shut its writing side; `close` sent.
    local_done: bool,
    /// The peer sent `close`.
    peer_done: bool,
    /// Since when the stream has had bytes to send and no credit.
    stalled_since: Option<Instant>,
}

impl Stream {
    fn new(local: UnixStream, credit: u32) -> io::Result<Self> {
        local.set_nonblocking(true)?;
        Ok(Self {
            local,
            inbound: VecDeque::new(),
            taken: 0,
            credit,
            local_done: false,
            peer_done: false,
            stalled_since: None,
        })
    }
}

struct Pump<'a> {
    chan: File,
    decoder: MuxDecoder,
    table: StreamTable,
    streams: BTreeMap<u32, Stream>,
    cfg: MuxConfig,
    role: Role<'a>,
    control: &'a Control,
}

/// What a failed step means.
enum Stop {
    Closed,
    Plain(Vec<u8>),
    Failed(String),
}

fn failed(what: impl std::fmt::Display) -> Stop {
    Stop::Failed(what.to_string())
}

/// Sets `O_NONBLOCK` on `fd`.
fn set_nonblocking(fd: &impl AsFd) -> io::Result<()> {
    let flags = OFlag::from_bits_truncate(fcntl(fd.as_fd(), FcntlArg::F_GETFL)?);
    fcntl(fd.as_fd(), FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
    Ok(())
}

/// Runs the loop on `chan` until it is stopped, the peer closes the channel or breaks its
/// rules. Initial credit for each stream is `cfg.window` in both directions (both ends use
/// the same configuration, agreed by the hello).
/// The channel's file status flags are restored at the end (the guest goes back to
/// serving the port without the mux).
pub(crate) fn run<'a>(
    chan: OwnedFd,
    cfg: MuxConfig,
    role: Role<'a>,
    control: &'a Control,
) -> PumpEnd {
    let before = fcntl(chan.as_fd(), FcntlArg::F_GETFL).ok();
    let end = match set_nonblocking(&chan) {
        Ok(()) => {
            let mut pump = Pump {
                chan: File::from(chan),
                decoder: MuxDecoder::default(),
                table: StreamTable::new(cfg.max_streams, cfg.window),
                streams: BTreeMap::new(),
                cfg,
                role,
                control,
            };
            let end = match pump.run() {
                Stop::Closed => PumpEnd::Closed,
                Stop::Plain(bytes) => PumpEnd::Plain(bytes),
                Stop::Failed(why) => PumpEnd::Failed(why),
            };
            if let Some(flags) = before {
                let _ = fcntl(
                    pump.chan.as_fd(),
                    FcntlArg::F_SETFL(OFlag::from_bits_truncate(flags)),
                );
            }
            end
        }
        Err(e) => PumpEnd::Failed(format!("cannot make the channel non-blocking: {e}")),
    };
    *control.ended.lock().unwrap_or_else(|p| p.into_inner()) = Some(end.clone());
    end
}

impl Pump<'_> {
    fn run(&mut self) -> Stop {
        let mut buf = vec![0u8; MAX_MUX_DATA + super::MUX_HEADER_LEN];
        let mut idle_since = Instant::now();
        loop {
            if !self.streams.is_empty() {
                idle_since = Instant::now();
            } else if self.idle_out(idle_since) {
                self.release();
                return Stop::Closed;
            }
            if self.control.stop.load(Ordering::SeqCst) {
                self.drain();
                self.release();
                return Stop::Closed;
            }
            if let Err(stop) = self.open_pending() {
                return stop;
            }
            self.control
                .live
                .store(self.streams.len(), Ordering::SeqCst);
            let ids: Vec<u32> = self.streams.keys().copied().collect();
            let (chan_ready, wake_ready, ready) = {
                let mut fds = vec![
                    PollFd::new(self.chan.as_fd(), PollFlags::POLLIN),
                    PollFd::new(self.control.wake_rx.as_fd(), PollFlags::POLLIN),
                ];
                for id in &ids {
                    let s = &self.streams[id];
                    let mut flags = PollFlags::empty();
                    if !s.local_done && s.stalled_since.is_none() {
                        flags |= PollFlags::POLLIN;
                    }
                    if !s.inbound.is_empty() {
                        flags |= PollFlags::POLLOUT;
                    }
                    fds.push(PollFd::new(s.local.as_fd(), flags));
                }
                match poll(&mut fds, PollTimeout::from(100u16)) {
                    Ok(_) | Err(Errno::EINTR) => {}
                    Err(e) => return failed(format!("poll failed: {e}")),
                }
                let ev = |f: &PollFd| f.revents().unwrap_or(PollFlags::empty());
                let ready: Vec<PollFlags> = fds[2..].iter().map(ev).collect();
                (ev(&fds[0]), ev(&fds[1]), ready)
            };
            if !wake_ready.is_empty() {
                let mut sink = [0u8; 64];
                let _ = (&self.control.wake_rx).read(&mut sink);
            }
            if !chan_ready.is_empty() {
                match self.chan.read(&mut buf) {
                    Ok(0) => {
                        self.flush_inbound();
                        return Stop::Closed;
                    }
                    Ok(n) => {
                        self.decoder.push(&buf[..n]);
                        if let Err(stop) = self.take_frames() {
                            return stop;
                        }
                    }
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                        ) => {}
                    Err(e) => return failed(format!("reading the channel failed: {e}")),
                }
            }
            for (id, revents) in ids.iter().zip(ready) {
                if let Err(stop) = self.service(*id, revents, &mut buf) {
                    return stop;
                }
            }
            if let Err(stop) = self.check_stalls() {
                return stop;
            }
        }
    }

    /// Whether the host loop has been idle long enough to end; if so the end is recorded
    /// under the lock of the pending streams, so no stream is asked for after it.
    fn idle_out(&self, since: Instant) -> bool {
        let Some(idle) = self.cfg.idle else {
            return false;
        };
        if since.elapsed() < idle {
            return false;
        }
        let pending = self
            .control
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if !pending.is_empty() {
            return false;
        }
        *self.control.ended.lock().unwrap_or_else(|p| p.into_inner()) = Some(PumpEnd::Closed);
        true
    }

    /// Writes one frame within the write deadline.
    fn send(&mut self, frame: &MuxFrame) -> Result<(), Stop> {
        let bytes = frame.encode();
        let deadline = Instant::now() + self.cfg.write_timeout;
        let mut rest = &bytes[..];
        while !rest.is_empty() {
            match self.chan.write(rest) {
                Ok(0) => return Err(Stop::Closed),
                Ok(n) => rest = &rest[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(failed(format!(
                            "the peer took no bytes for {:?}",
                            self.cfg.write_timeout
                        )));
                    }
                    let mut fds = [PollFd::new(self.chan.as_fd(), PollFlags::POLLOUT)];
                    let wait = PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX);
                    match poll(&mut fds, wait) {
                        Ok(_) | Err(Errno::EINTR) => {}
                        Err(e) => return Err(failed(format!("poll failed: {e}"))),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::BrokenPipe => return Err(Stop::Closed),
                Err(e) => return Err(failed(format!("writing the channel failed: {e}"))),
            }
        }
        Ok(())
    }

    /// Announces the host's new streams.
    fn open_pending(&mut self) -> Result<(), Stop> {
        let new: Vec<(u32, UnixStream)> = {
            let mut pending = self
                .control
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            std::mem::take(&mut *pending)
        };
        for (id, local) in new {
            // The host's own cap is checked when the stream is asked for; a refusal here
            // (an id reused) only drops the stream.
            if self.table.open(id).is_err() {
                continue;
            }
            match Stream::new(local, self.cfg.window) {
                Ok(s) => {
                    self.streams.insert(id, s);
                    self.send(&MuxFrame::Open { stream: id })?;
                }
                Err(_) => self.table.end(id),
            }
        }
        Ok(())
    }

    /// Ends `id` locally and tells the peer with a reset.
    fn reset(&mut self, id: u32, why: &str) -> Result<(), Stop> {
        self.table.end(id);
        self.streams.remove(&id);
        let mut reason = why.to_string();
        reason.truncate(super::MAX_RESET_REASON);
        while !reason.is_char_boundary(reason.len()) {
            reason.pop();
        }
        self.send(&MuxFrame::Reset { stream: id, reason })
    }

    fn take_frames(&mut self) -> Result<(), Stop> {
        loop {
            let frame = match self.decoder.next_frame() {
                Ok(Some(f)) => f,
                Ok(None) => return Ok(()),
                Err(e) => match e.stream() {
                    Some(id) => {
                        self.reset(id, &e.to_string())?;
                        continue;
                    }
                    None => return Err(self.channel_error(e)),
                },
            };
            self.on_frame(frame)?;
        }
    }

    fn on_frame(&mut self, frame: MuxFrame) -> Result<(), Stop> {
        match frame {
            MuxFrame::Open { stream } => match &mut self.role {
                Role::Host => Err(failed(format!("the guest opened stream {stream}"))),
                Role::Guest(serve) => {
                    if let Err(e) = self.table.open(stream) {
                        return self.reset(stream, &e.to_string());
                    }
                    let (ours, theirs) = match UnixStream::pair() {
                        Ok(p) => p,
                        Err(e) => return self.reset(stream, &format!("no socket pair: {e}")),
                    };
                    match Stream::new(ours, self.cfg.window) {
                        Ok(s) => {
                            self.streams.insert(stream, s);
                            serve(theirs);
                            Ok(())
                        }
                        Err(e) => self.reset(stream, &e.to_string()),
                    }
                }
            },
            MuxFrame::Data { stream, bytes } => {
                if let Err(e) = self.table.receive(stream, bytes.len()) {
                    return self.reset(stream, &e.to_string());
                }
                match self.streams.get_mut(&stream) {
                    Some(s) if !s.peer_done => {
                        s.inbound.extend(bytes);
                        Ok(())
                    }
                    _ => self.reset(stream, "data after close"),
                }
            }
            MuxFrame::Window { stream, credit } => {
                if let Some(s) = self.streams.get_mut(&stream) {
                    let total = u64::from(s.credit) + u64::from(credit);
                    if total > u64::from(MAX_WINDOW) {
                        return self
                            .reset(stream, &MuxError::BadCredit { stream, credit }.to_string());
                    }
                    s.credit = total as u32;
                    s.stalled_since = None;
                }
                // A window for a stream that just ended crossed its end: nothing to do.
                Ok(())
            }
            MuxFrame::Close { stream } => {
                match self.streams.get_mut(&stream) {
                    Some(s) => s.peer_done = true,
                    None => return Ok(()),
                }
                self.finish_if_done(stream);
                Ok(())
            }
            MuxFrame::Reset { stream, .. } => {
                self.table.end(stream);
                self.streams.remove(&stream);
                Ok(())
            }
            MuxFrame::End => {
                if let Role::Guest(_) = self.role {
                    // The host gives the port back: answer, so that it closes only once
                    // this side reads the port plainly again, and end the loop.
                    let _ = self.send(&MuxFrame::End);
                }
                Err(Stop::Closed)
            }
        }
    }

    /// How a channel-level decode error ends the loop. On the guest, a plain agent frame
    /// where a mux frame was due means a new client holds the host's end of the port (the
    /// one that agreed the mux went without an `end`): its bytes are handed back to be
    /// served plainly. Anything else, and anything on the host, fails the channel.
    fn channel_error(&mut self, e: MuxError) -> Stop {
        if let (Role::Guest(_), MuxError::BadMagic(magic)) = (&self.role, &e) {
            if *magic == crate::frame::MAGIC {
                return Stop::Plain(self.decoder.take_unframed());
            }
        }
        failed(e)
    }

    /// The host gives the port back before closing it: sends `end` and waits, within
    /// [`RELEASE_LIMIT`], for the guest's `end` in answer (frames before it are dropped),
    /// so that the guest serves the port plainly before QEMU's chardev can pass it to
    /// the next client. Nothing on the guest's side.
    fn release(&mut self) {
        if !matches!(self.role, Role::Host) || self.send(&MuxFrame::End).is_err() {
            return;
        }
        let deadline = Instant::now() + RELEASE_LIMIT;
        let mut buf = vec![0u8; MAX_MUX_DATA + super::MUX_HEADER_LEN];
        loop {
            loop {
                match self.decoder.next_frame() {
                    Ok(Some(MuxFrame::End)) => return,
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(e) if e.stream().is_some() => {}
                    Err(_) => return,
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            let mut fds = [PollFd::new(self.chan.as_fd(), PollFlags::POLLIN)];
            let wait = PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX);
            match poll(&mut fds, wait) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(_) => return,
            }
            match self.chan.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => self.decoder.push(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) => {}
                Err(_) => return,
            }
        }
    }

    /// Shuts the local end's reading side once the peer closed and everything was
    /// delivered; forgets the stream once both sides are done.
    fn finish_if_done(&mut self, id: u32) {
        let Some(s) = self.streams.get(&id) else {
            return;
        };
        if s.peer_done && s.inbound.is_empty() {
            let _ = s.local.shutdown(std::net::Shutdown::Write);
            if s.local_done {
                self.table.end(id);
                self.streams.remove(&id);
            }
        }
    }

    /// Moves bytes between the stream's local end and the channel.
    fn service(&mut self, id: u32, revents: PollFlags, buf: &mut [u8]) -> Result<(), Stop> {
        if revents.is_empty() {
            return Ok(());
        }
        let window = self.cfg.window;
        let Some(s) = self.streams.get_mut(&id) else {
            return Ok(());
        };
        // Deliver what the peer sent.
        let mut grant = 0;
        let mut gone = false;
        while !s.inbound.is_empty() {
            let (front, _) = s.inbound.as_slices();
            match (&s.local).write(front) {
                Ok(n) => {
                    s.inbound.drain(..n);
                    s.taken += n as u32;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    gone = true;
                    break;
                }
            }
        }
        if s.taken >= window / 2 && !s.peer_done {
            grant = std::mem::take(&mut s.taken);
        }
        if gone {
            return self.reset(id, "the stream's user went away");
        }
        if grant > 0 {
            if let Ok(credit) = self.table.grant(id, grant) {
                if credit > 0 {
                    self.send(&MuxFrame::Window { stream: id, credit })?;
                }
            }
        }
        // Send what the local user wrote, within credit.
        let Some(s) = self.streams.get_mut(&id) else {
            return Ok(());
        };
        if !s.local_done && revents.intersects(PollFlags::POLLIN | PollFlags::POLLHUP) {
            if s.credit == 0 {
                s.stalled_since.get_or_insert_with(Instant::now);
            } else {
                let want = (s.credit as usize).min(MAX_MUX_DATA).min(buf.len());
                match (&s.local).read(&mut buf[..want]) {
                    Ok(0) => {
                        s.local_done = true;
                        self.send(&MuxFrame::Close { stream: id })?;
                    }
                    Ok(n) => {
                        s.credit -= n as u32;
                        let bytes = buf[..n].to_vec();
                        self.send(&MuxFrame::Data { stream: id, bytes })?;
                    }
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                        ) => {}
                    Err(_) => return self.reset(id, "the stream's user went away"),
                }
            }
        }
        // The user closed its end completely after its `close` went out: forget the
        // stream (the peer's later frames for it are refused as not open).
        if let Some(s) = self.streams.get(&id) {
            if s.local_done && s.inbound.is_empty() && revents.contains(PollFlags::POLLHUP) {
                self.table.end(id);
                self.streams.remove(&id);
                return Ok(());
            }
        }
        self.finish_if_done(id);
        Ok(())
    }

    /// The peer closed the channel: hands the streams' users what already arrived, within
    /// [`FLUSH_LIMIT`] in all (a user that does not read loses the rest).
    fn flush_inbound(&mut self) {
        let deadline = Instant::now() + FLUSH_LIMIT;
        for s in self.streams.values_mut() {
            while !s.inbound.is_empty() {
                let (front, _) = s.inbound.as_slices();
                match (&s.local).write(front) {
                    Ok(n) => {
                        s.inbound.drain(..n);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        let left = deadline.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            return;
                        }
                        let mut fds = [PollFd::new(s.local.as_fd(), PollFlags::POLLOUT)];
                        let wait = PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX);
                        let _ = poll(&mut fds, wait);
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        }
    }

    /// On stop: sends what the streams' users already wrote (within credit) and closes
    /// them, so a last answer (the agent's to `shutdown`) reaches the peer.
    fn drain(&mut self) {
        let ids: Vec<u32> = self.streams.keys().copied().collect();
        let mut buf = vec![0u8; MAX_MUX_DATA];
        for id in ids {
            while let Some(s) = self.streams.get_mut(&id) {
                if s.local_done || s.credit == 0 {
                    break;
                }
                let want = (s.credit as usize).min(buf.len());
                let frame = match (&s.local).read(&mut buf[..want]) {
                    Ok(0) => {
                        s.local_done = true;
                        MuxFrame::Close { stream: id }
                    }
                    Ok(n) => {
                        s.credit -= n as u32;
                        MuxFrame::Data {
                            stream: id,
                            bytes: buf[..n].to_vec(),
                        }
                    }
                    Err(_) => break,
                };
                if self.send(&frame).is_err() {
                    return;
                }
            }
        }
    }

    fn check_stalls(&mut self) -> Result<(), Stop> {
        let stall = self.cfg.stall;
        if let Some((id, _)) = self
            .streams
            .iter()
            .find(|(_, s)| s.stalled_since.is_some_and(|t| t.elapsed() >= stall))
        {
            return Err(failed(format!(
                "stream {id} waited {stall:?} for credit the peer never granted"
            )));
        }
        Ok(())
    }
}
