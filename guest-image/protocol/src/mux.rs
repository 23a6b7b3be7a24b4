//! Stream multiplexing for the one virtio-serial port (QEMU without vhost-vsock): many
//! request streams over one byte stream, each carrying what a vsock connection would (the
//! `TVAG` frames of one request), so concurrent requests need not wait for each other.
//!
//! The host offers it with a [`Request::Mux`](crate::message::Request::Mux) hello, the first
//! request on a fresh serial connection ([`negotiate`]); an agent that accepts answers
//! [`Reply::Mux`](crate::message::Reply::Mux) and both ends then run the `pump` loop: the
//! host's [`MuxChannel`] opens a stream per request, the agent's [`serve_guest`] serves each
//! as it serves a vsock connection. An agent that does not know the hello refuses it and the
//! channel stays one request at a time.
//!
//! A mux frame is a 16-byte header and a payload:
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `TVMX` |
//! | 4..8 | stream id, big endian, never 0 (always 0 for `end`) |
//! | 8 | kind: 1 open, 2 data, 3 window, 4 close, 5 reset, 6 end |
//! | 9 | flags, must be 0 |
//! | 10..12 | reserved, must be 0 |
//! | 12..16 | payload length, big endian |
//!
//! `open`, `close` and `end` carry nothing; `data` 1..=[`MAX_MUX_DATA`] bytes; `window` 4 bytes,
//! the credit in bytes the receiver grants (big endian, 1..=[`MAX_WINDOW`]); `reset` at
//! most [`MAX_RESET_REASON`] bytes of UTF-8. Everything the guest sends is hostile: the
//! decoder checks a header completely before it buffers any payload, so a lying length
//! costs nothing, and it never holds more than one frame.
//!
//! `end` gives the port back. QEMU's chardev takes one client at a time and accepts the
//! next one the moment the current one closes, so the guest cannot tell from the port
//! alone that the client that agreed the mux has gone: a plain request from the next
//! client would be read as mux frames and lost. So the host, before it closes an idle or
//! stopped channel, sends `end` and waits (briefly) for the guest's `end` in answer; the
//! guest answers, closes its streams and serves the port plainly again, and only then does
//! the host close the connection. A host killed without `end` leaves the guest in the
//! session until it reads the next client's plain request; frames of the old session the
//! guest sent before that reach the next client first, and a plain client drops them
//! (bounded: [`FrameDecoder::skip_stale_mux`](crate::frame::FrameDecoder::skip_stale_mux)).

use thiserror::Error;

mod owner;
mod pump;
mod streams;
pub use owner::{
    accept_offer, negotiate, serve_guest, GuestStop, MuxChannel, MuxChannelError, Negotiated,
};
pub use pump::{MuxConfig, PumpEnd};
pub use streams::{StreamError, StreamTable};

/// The mux version this side speaks (the hello's `version`).
pub const MUX_VERSION: u32 = 1;

/// The magic of every mux frame.
pub const MUX_MAGIC: [u8; 4] = *b"TVMX";
/// Header length.
pub const MUX_HEADER_LEN: usize = 16;
/// Largest `data` payload.
pub const MAX_MUX_DATA: usize = 64 * 1024;
/// Largest credit one `window` frame may grant, and the most a stream may have
/// outstanding.
pub const MAX_WINDOW: u32 = 1 << 20;
/// Longest `reset` reason.
pub const MAX_RESET_REASON: usize = 256;

/// One mux frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MuxFrame {
    /// The sender opens `stream` (the host opens; ids are the host's to choose).
    Open {
        /// Stream id.
        stream: u32,
    },
    /// Bytes of `stream`, within the credit the receiver granted.
    Data {
        /// Stream id.
        stream: u32,
        /// The bytes (1..=[`MAX_MUX_DATA`]).
        bytes: Vec<u8>,
    },
    /// The receiver may take `credit` more bytes on `stream`.
    Window {
        /// Stream id.
        stream: u32,
        /// Bytes granted.
        credit: u32,
    },
    /// The sender will send nothing more on `stream`.
    Close {
        /// Stream id.
        stream: u32,
    },
    /// `stream` is abandoned (an error on it); the other streams go on.
    Reset {
        /// Stream id.
        stream: u32,
        /// Why, for logs (sanitise before showing: the guest wrote it).
        reason: String,
    },
    /// The channel ends: the host gives the port back, the guest answers in kind and
    /// serves it plainly again (stream id 0 on the wire).
    End,
}

/// Why bytes are not a valid mux frame. `Channel` errors leave the byte stream without a
/// known frame boundary: the whole channel must be dropped. `Stream` errors concern one
/// stream's frame, whose bytes were consumed: reset that stream and go on.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MuxError {
    /// The header does not start with `TVMX`.
    #[error("not a mux frame (bad magic {0:02x?}); the channel is out of step")]
    BadMagic([u8; 4]),
    /// Flags or reserved bits set.
    #[error("mux frame with flags {flags:#x} / reserved {reserved:#x} set")]
    Reserved {
        /// Flags byte.
        flags: u8,
        /// Reserved field.
        reserved: u16,
    },
    /// Unknown kind.
    #[error("unknown mux frame kind {0}")]
    BadKind(u8),
    /// Stream id 0.
    #[error("mux frame for stream 0")]
    StreamZero,
    /// An `end` frame naming a stream (it concerns the channel).
    #[error("mux end frame naming stream {0}")]
    EndWithStream(u32),
    /// A payload length outside what the kind allows.
    #[error("mux frame of kind {kind} with a {len}-byte payload (allowed: {allowed})")]
    BadLength {
        /// The kind.
        kind: u8,
        /// Declared length.
        len: u32,
        /// What the kind allows.
        allowed: &'static str,
    },
    /// A window of 0 or above [`MAX_WINDOW`] (the stream's).
    #[error("stream {stream}: window credit {credit} outside 1..={MAX_WINDOW}")]
    BadCredit {
        /// Stream id.
        stream: u32,
        /// The credit.
        credit: u32,
    },
    /// A reset reason that is not UTF-8 (the stream's).
    #[error("stream {0}: reset reason is not UTF-8")]
    BadReason(u32),
    /// An earlier channel-level error left the channel out of step.
    #[error("the mux channel failed earlier and is out of step; drop it")]
    Failed,
}

impl MuxError {
    /// The stream a stream-level error concerns; `None` for errors that lose the frame
    /// boundary (the channel must be dropped).
    pub fn stream(&self) -> Option<u32> {
        match self {
            MuxError::BadCredit { stream, .. } => Some(*stream),
            MuxError::BadReason(stream) => Some(*stream),
            _ => None,
        }
    }
}

const OPEN: u8 = 1;
const DATA: u8 = 2;
const WINDOW: u8 = 3;
const CLOSE: u8 = 4;
const RESET: u8 = 5;
const END: u8 = 6;

impl MuxFrame {
    /// The frame's stream.
    pub fn stream(&self) -> u32 {
        match self {
            MuxFrame::Open { stream }
            | MuxFrame::Data { stream, .. }
            | MuxFrame::Window { stream, .. }
            | MuxFrame::Close { stream }
            | MuxFrame::Reset { stream, .. } => *stream,
            MuxFrame::End => 0,
        }
    }

    /// The frame's bytes. Panics never; a frame the decoder would refuse (stream 0, empty
    /// or oversized data, a credit out of range, a long reason) is encoded as given, so
    /// senders check with [`MuxFrame::validate`] first.
    pub fn encode(&self) -> Vec<u8> {
        let (kind, payload): (u8, Vec<u8>) = match self {
            MuxFrame::Open { .. } => (OPEN, Vec::new()),
            MuxFrame::Data { bytes, .. } => (DATA, bytes.clone()),
            MuxFrame::Window { credit, .. } => (WINDOW, credit.to_be_bytes().to_vec()),
            MuxFrame::Close { .. } => (CLOSE, Vec::new()),
            MuxFrame::Reset { reason, .. } => (RESET, reason.as_bytes().to_vec()),
            MuxFrame::End => (END, Vec::new()),
        };
        let mut out = Vec::with_capacity(MUX_HEADER_LEN + payload.len());
        out.extend_from_slice(&MUX_MAGIC);
        out.extend_from_slice(&self.stream().to_be_bytes());
        out.push(kind);
        out.extend_from_slice(&[0, 0, 0]);
        out.extend_from_slice(
            &u32::try_from(payload.len())
                .unwrap_or(u32::MAX)
                .to_be_bytes(),
        );
        out.extend_from_slice(&payload);
        out
    }

    /// Whether the decoder would accept this frame.
    pub fn validate(&self) -> Result<(), MuxError> {
        let frame = self.encode();
        let mut d = MuxDecoder::default();
        d.push(&frame);
        match d.next_frame()? {
            Some(f) if &f == self => Ok(()),
            _ => Err(MuxError::StreamZero),
        }
    }
}

/// Checks a header and returns (stream, kind, payload length). Also used by a plain
/// channel's decoder to drop a previous session's stale frames whole
/// ([`crate::frame::FrameDecoder::skip_stale_mux`]).
pub(crate) fn parse_header(h: &[u8; MUX_HEADER_LEN]) -> Result<(u32, u8, usize), MuxError> {
    let magic = [h[0], h[1], h[2], h[3]];
    if magic != MUX_MAGIC {
        return Err(MuxError::BadMagic(magic));
    }
    let stream = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
    let kind = h[8];
    let flags = h[9];
    let reserved = u16::from_be_bytes([h[10], h[11]]);
    if flags != 0 || reserved != 0 {
        return Err(MuxError::Reserved { flags, reserved });
    }
    let len = u32::from_be_bytes([h[12], h[13], h[14], h[15]]);
    if !(OPEN..=END).contains(&kind) {
        return Err(MuxError::BadKind(kind));
    }
    if kind == END && stream != 0 {
        return Err(MuxError::EndWithStream(stream));
    }
    if stream == 0 && kind != END {
        return Err(MuxError::StreamZero);
    }
    let (ok, allowed) = match kind {
        OPEN | CLOSE | END => (len == 0, "0"),
        DATA => ((1..=MAX_MUX_DATA as u32).contains(&len), "1 to 65536 bytes"),
        WINDOW => (len == 4, "4"),
        _ => (len as usize <= MAX_RESET_REASON, "at most 256 bytes"),
    };
    if !ok {
        return Err(MuxError::BadLength { kind, len, allowed });
    }
    Ok((stream, kind, len as usize))
}

/// Incremental decoder: [`MuxDecoder::push`] bytes as they arrive, then take frames with
/// [`MuxDecoder::next_frame`] until it returns `Ok(None)`. It buffers at most one frame
/// ([`MUX_HEADER_LEN`] + [`MAX_MUX_DATA`] bytes) beyond what `push` was given and not yet
/// decoded: callers push at most what they read in one call.
#[derive(Debug, Default)]
pub struct MuxDecoder {
    buf: Vec<u8>,
    /// Set after a channel-level error: everything after it is refused.
    failed: bool,
    /// After a bad magic: the bytes from where the frame should have started (what
    /// [`MuxDecoder::take_unframed`] hands back).
    unframed: Vec<u8>,
}

impl MuxDecoder {
    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        if !self.failed {
            self.buf.extend_from_slice(bytes);
        }
    }

    /// Bytes held and not yet decoded.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// After a [`MuxError::BadMagic`]: the bytes received from where the bad frame should
    /// have started (at most one read's worth plus one frame), taken once. The guest uses
    /// them when they are the start of a plain request: the host's end of the port changed
    /// hands without an `end` (a daemon killed while it held the channel), and the new
    /// client speaks plainly.
    pub fn take_unframed(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.unframed)
    }

    /// The next whole frame, `Ok(None)` if more bytes are needed. After a channel-level
    /// error ([`MuxError::stream`] is `None`) every later call fails the same way and the
    /// buffer is dropped: the channel is out of step for good.
    pub fn next_frame(&mut self) -> Result<Option<MuxFrame>, MuxError> {
        if self.failed {
            return Err(MuxError::Failed);
        }
        if self.buf.len() < MUX_HEADER_LEN {
            return Ok(None);
        }
        let mut header = [0u8; MUX_HEADER_LEN];
        header.copy_from_slice(&self.buf[..MUX_HEADER_LEN]);
        let (stream, kind, len) = match parse_header(&header) {
            Ok(h) => h,
            Err(e) => {
                self.failed = true;
                let buf = std::mem::take(&mut self.buf);
                if matches!(e, MuxError::BadMagic(_)) {
                    self.unframed = buf;
                }
                return Err(e);
            }
        };
        if self.buf.len() < MUX_HEADER_LEN + len {
            return Ok(None);
        }
        let payload: Vec<u8> = self.buf[MUX_HEADER_LEN..MUX_HEADER_LEN + len].to_vec();
        self.buf.drain(..MUX_HEADER_LEN + len);
        Ok(Some(match kind {
            OPEN => MuxFrame::Open { stream },
            DATA => MuxFrame::Data {
                stream,
                bytes: payload,
            },
            WINDOW => {
                let credit = u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
                if credit == 0 || credit > MAX_WINDOW {
                    return Err(MuxError::BadCredit { stream, credit });
                }
                MuxFrame::Window { stream, credit }
            }
            CLOSE => MuxFrame::Close { stream },
            END => MuxFrame::End,
            _ => MuxFrame::Reset {
                stream,
                reason: String::from_utf8(payload).map_err(|_| MuxError::BadReason(stream))?,
            },
        }))
    }
}

#[cfg(test)]
mod tests;
