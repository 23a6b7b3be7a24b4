//! The body of a streamed inference answer ([`AgentClient::infer_stream`]): the agent's
//! data frames read one at a time, each read under the request's idle time and deadline.

use std::io;
use std::time::{Duration, Instant};

use super::AgentClient;
use crate::channel::{self, ChannelError};
use crate::frame::{FrameError, MAX_DATA_LEN};

/// The body of a streamed answer ([`AgentClient::infer_stream`]): reads return the bytes
/// of the agent's data frames as they arrive. Ends (reads 0) at the agent's empty frame;
/// a connection that closes before it is an `UnexpectedEof` error, a guest silent for
/// longer than the idle time or past the deadline a `TimedOut` one, an oversized or
/// malformed frame an `InvalidData` one. Holds at most one data frame.
pub struct InferBody {
    client: AgentClient,
    frame: Vec<u8>,
    pos: usize,
    idle: Duration,
    deadline: Instant,
    ended: bool,
}

impl std::fmt::Debug for InferBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InferBody")
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl InferBody {
    /// The body of the answer whose head `client` just read.
    pub(super) fn new(client: AgentClient, idle: Duration, deadline: Instant) -> Self {
        Self {
            client,
            frame: Vec::new(),
            pos: 0,
            idle,
            deadline,
            ended: false,
        }
    }

    /// The next data frame's bytes (empty at the end of the stream).
    fn next_frame(&mut self) -> io::Result<Vec<u8>> {
        let invalid = |e: FrameError| io::Error::new(io::ErrorKind::InvalidData, e.to_string());
        let mut buf = [0u8; 16 * 1024];
        loop {
            if let Some(header) = self.client.decoder.peek_header().map_err(invalid)? {
                if header.len > MAX_DATA_LEN {
                    return Err(invalid(FrameError::TooLarge {
                        len: u64::from(header.len),
                        max: MAX_DATA_LEN,
                    }));
                }
                if let Some(body) = self.client.decoder.next_frame().map_err(invalid)? {
                    return Ok(body.to_vec());
                }
            } else {
                // Rejects a wrong magic as soon as it shows.
                self.client.decoder.next_frame().map_err(invalid)?;
            }
            let now = Instant::now();
            if now >= self.deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the guest's answer ran past the request's deadline",
                ));
            }
            let by = self.deadline.min(now + self.idle);
            match channel::read_by(&mut self.client.stream, &mut buf, by) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the guest closed the stream before its end",
                    ))
                }
                Ok(n) => self.client.decoder.push(&buf[..n]),
                Err(ChannelError::TimedOut) => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the guest sent nothing for {:?}", self.idle),
                    ))
                }
                Err(ChannelError::Io(e)) => return Err(e),
            }
        }
    }
}

impl InferBody {
    /// The next data frame if it is already buffered whole (no read from the socket);
    /// None when it is not, or when what is buffered is not a valid data frame (the next
    /// [`io::Read::read`] then reports that).
    fn buffered_frame(&mut self) -> Option<Vec<u8>> {
        let header = self.client.decoder.peek_header().ok()??;
        if header.len > MAX_DATA_LEN {
            return None;
        }
        self.client
            .decoder
            .next_frame()
            .ok()?
            .map(|body| body.to_vec())
    }
}

impl io::Read for InferBody {
    /// The bytes of the next data frame, waiting for it if none is here; then, while
    /// `out` has room, those of the frames already buffered whole behind it (pieces that
    /// queued up while the reader was busy go on together).
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let mut n = self.read_one(out)?;
        while n > 0 && n < out.len() && !self.ended && self.pos >= self.frame.len() {
            let Some(frame) = self.buffered_frame() else {
                break;
            };
            self.ended = frame.is_empty();
            self.frame = frame;
            self.pos = 0;
            let more = (out.len() - n).min(self.frame.len());
            out[n..n + more].copy_from_slice(&self.frame[..more]);
            self.pos = more;
            n += more;
        }
        Ok(n)
    }
}

impl InferBody {
    fn read_one(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while !self.ended && self.pos >= self.frame.len() {
            let frame = match self.next_frame() {
                Ok(f) => f,
                Err(e) => {
                    // A failed stream stays failed: nothing after it can be trusted.
                    self.ended = true;
                    self.frame.clear();
                    return Err(e);
                }
            };
            self.ended = frame.is_empty();
            self.frame = frame;
            self.pos = 0;
        }
        let n = out.len().min(self.frame.len() - self.pos);
        out[..n].copy_from_slice(&self.frame[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}
