//! Both ends' handles on a multiplexed channel: [`MuxChannel`], the host's owner of one
//! tenant's channel (a thread runs the [`pump`](super::pump) loop; each request asks it
//! for a stream), and [`serve_guest`], the agent's loop that hands every stream the host
//! opens to a handler.

use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use thiserror::Error;

use super::pump::{self, Control, MuxConfig, PumpEnd, Role};
use super::MUX_VERSION;
use crate::client::{AgentClient, AgentClientError};
use crate::message::{ErrorCode, Reply, Request};

/// Why a stream could not be opened.
#[derive(Debug, Error)]
pub enum MuxChannelError {
    /// The channel ended (closed, or the guest broke its rules); reconnect.
    #[error("The multiplexed agent channel has ended ({0:?}); reconnect")]
    Ended(PumpEnd),
    /// As many streams are open as allowed.
    #[error("The multiplexed agent channel already carries {0} requests, the most allowed")]
    Busy(usize),
    /// A socket pair could not be made.
    #[error("Cannot make a stream for the multiplexed agent channel: {0}")]
    Io(#[from] io::Error),
}

/// The host's owner of one multiplexed channel: one thread reads the channel and carries
/// every stream (see `super::pump`). Dropping it stops the thread and closes the channel.
pub struct MuxChannel {
    control: Arc<Control>,
    wake_tx: UnixStream,
    next_id: AtomicU32,
    cfg: MuxConfig,
    thread: Option<JoinHandle<PumpEnd>>,
}

impl std::fmt::Debug for MuxChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MuxChannel")
            .field("cfg", &self.cfg)
            .field("ended", &self.ended())
            .finish()
    }
}

fn new_control() -> io::Result<(Arc<Control>, UnixStream)> {
    let (wake_tx, wake_rx) = UnixStream::pair()?;
    wake_rx.set_nonblocking(true)?;
    wake_tx.set_nonblocking(true)?;
    Ok((
        Arc::new(Control {
            stop: AtomicBool::new(false),
            pending: Arc::new(Mutex::new(Vec::new())),
            wake_rx,
            ended: Mutex::new(None),
            live: AtomicUsize::new(0),
        }),
        wake_tx,
    ))
}

impl MuxChannel {
    /// Starts carrying `chan` (the agreed hello already exchanged on it) with `cfg`.
    pub fn start(chan: OwnedFd, cfg: MuxConfig) -> io::Result<Self> {
        let (control, wake_tx) = new_control()?;
        let ctl = Arc::clone(&control);
        let thread = std::thread::Builder::new()
            .name("agent-mux".into())
            .spawn(move || pump::run(chan, cfg, Role::Host, &ctl))?;
        Ok(Self {
            control,
            wake_tx,
            next_id: AtomicU32::new(1),
            cfg,
            thread: Some(thread),
        })
    }

    /// How the loop ended, `None` while it runs.
    pub fn ended(&self) -> Option<PumpEnd> {
        self.control
            .ended
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The channel's limits.
    pub fn config(&self) -> MuxConfig {
        self.cfg
    }

    /// Opens a stream: the returned socket carries one request's frames exactly as a
    /// vsock connection would (blocking; set its timeouts, or use it through
    /// [`crate::AgentClient::over_stream`]). Refused when the channel ended or carries
    /// [`MuxConfig::max_streams`] streams.
    pub fn open_stream(&self) -> Result<UnixStream, MuxChannelError> {
        let (ours, theirs) = UnixStream::pair()?;
        {
            let mut pending = self
                .control
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            // Checked under this lock: an idle loop records its end under it too.
            if let Some(end) = self.ended() {
                return Err(MuxChannelError::Ended(end));
            }
            let open = self.control.live.load(Ordering::SeqCst) + pending.len();
            if open >= self.cfg.max_streams {
                return Err(MuxChannelError::Busy(open));
            }
            let id = self.next_id.fetch_add(1, Ordering::SeqCst).max(1);
            pending.push((id, theirs));
        }
        let _ = (&self.wake_tx).write(&[1]);
        Ok(ours)
    }
}

impl Drop for MuxChannel {
    fn drop(&mut self) {
        self.control.stop.store(true, Ordering::SeqCst);
        let _ = (&self.wake_tx).write(&[1]);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The guest's end: carries `chan` until the host closes it (or breaks its rules), handing
/// each stream the host opens to `serve` (which should not block: start a thread). Its
/// [`GuestStop`] ends the loop from a stream's thread (after `shutdown` was answered: what
/// the streams wrote is sent first).
pub fn serve_guest(
    chan: OwnedFd,
    cfg: MuxConfig,
    serve: &mut dyn FnMut(UnixStream, GuestStop),
) -> PumpEnd {
    match new_control() {
        Ok((control, wake_tx)) => {
            let stop = GuestStop {
                control: Arc::clone(&control),
                wake_tx: Arc::new(wake_tx),
            };
            let mut each = |s: UnixStream| serve(s, stop.clone());
            pump::run(chan, cfg, Role::Guest(&mut each), &control)
        }
        Err(e) => PumpEnd::Failed(format!("cannot start the mux loop: {e}")),
    }
}

/// Ends a [`serve_guest`] loop.
#[derive(Clone)]
pub struct GuestStop {
    control: Arc<Control>,
    wake_tx: Arc<UnixStream>,
}

impl GuestStop {
    /// Asks the loop to send what is pending and end.
    pub fn stop(&self) {
        self.control.stop.store(true, Ordering::SeqCst);
        let _ = (&*self.wake_tx).write(&[1]);
    }
}

/// What the agent answered to the mux hello.
pub enum Negotiated {
    /// The channel is multiplexed, with these limits.
    Mux(MuxChannel),
    /// An agent without mux: the connection goes on one request at a time, as it was.
    Plain(AgentClient),
}

/// Offers the mux on a fresh virtio-serial connection (its first request) and, if the
/// agent accepts, starts the channel's owner. Only the agent's answer decides: an agent
/// that refuses with `bad-request` (it does not know the hello) keeps the connection
/// plain; an answer that does not match the offer (another version or window, more
/// streams than offered) is refused and the connection dropped.
pub fn negotiate(
    mut client: AgentClient,
    cfg: MuxConfig,
    timeout: std::time::Duration,
) -> Result<Negotiated, AgentClientError> {
    let offer = Request::Mux {
        version: MUX_VERSION,
        max_streams: u32::try_from(cfg.max_streams).unwrap_or(u32::MAX),
        window: cfg.window,
    };
    match client.call(&offer, timeout) {
        Ok(Reply::Mux {
            version,
            max_streams,
            window,
        }) if version == MUX_VERSION
            && window == cfg.window
            && max_streams >= 1
            && (max_streams as usize) <= cfg.max_streams =>
        {
            let fd = client.into_channel()?;
            let cfg = MuxConfig {
                max_streams: max_streams as usize,
                ..cfg
            };
            Ok(Negotiated::Mux(MuxChannel::start(fd, cfg)?))
        }
        Ok(other) => Err(AgentClientError::Agent {
            what: "mux hello",
            failure: crate::message::AgentFailure {
                code: ErrorCode::BadRequest,
                message: format!(
                    "the agent answered the mux hello with {}, not the offer",
                    reply_name(&other)
                ),
            },
        }),
        Err(AgentClientError::Agent { failure, .. }) if failure.code == ErrorCode::BadRequest => {
            Ok(Negotiated::Plain(client))
        }
        Err(e) => Err(e),
    }
}

impl std::fmt::Debug for Negotiated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Mux(m) => f.debug_tuple("Mux").field(m).finish(),
            Self::Plain(_) => f.write_str("Plain"),
        }
    }
}

fn reply_name(reply: &Reply) -> &'static str {
    match reply {
        Reply::Mux { .. } => "other mux limits",
        _ => "another reply",
    }
}

/// What the agent answers to the host's hello: the version if it is ours, at most the
/// offered streams and at most `own_max` of them, the offered window if it is within
/// the protocol's bounds; `None` to refuse (then the agent answers `bad-request`).
pub fn accept_offer(
    version: u32,
    max_streams: u32,
    window: u32,
    own_max: usize,
) -> Option<MuxConfig> {
    if version != MUX_VERSION || max_streams == 0 || window == 0 || window > super::MAX_WINDOW {
        return None;
    }
    Some(MuxConfig {
        max_streams: (max_streams as usize).min(own_max.max(1)),
        window,
        ..MuxConfig::default()
    })
}

#[cfg(test)]
#[path = "owner_tests.rs"]
mod tests;
