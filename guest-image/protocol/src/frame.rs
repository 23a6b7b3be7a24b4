//! Framing of the control channel: a byte stream (vsock port
//! [`AGENT_VSOCK_PORT`](crate::AGENT_VSOCK_PORT), or the virtio-serial port named
//! [`VIRTIO_SERIAL_PORT_NAME`](crate::VIRTIO_SERIAL_PORT_NAME)) carries frames. A frame is
//! a 12-byte header followed by a UTF-8 JSON body (a [`crate::message`] type):
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `TVAG` |
//! | 4..6 | protocol version, big endian ([`PROTOCOL_VERSION`]) |
//! | 6..8 | flags, big endian, must be 0 |
//! | 8..12 | body length, big endian, at most [`MAX_BODY_LEN`] |
//!
//! Either side treats the other as hostile: a bad header, an oversized body or JSON that
//! does not match the schema is an error value, never a panic. Bodies are held in
//! [`Zeroizing`] buffers because a request may carry the disk key.

use std::io::{self, Read};

use serde::{Deserialize, Serialize};
use thiserror::Error;
use zeroize::Zeroizing;

/// The four bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"TVAG";
/// The protocol version this crate speaks.
pub const PROTOCOL_VERSION: u16 = 1;
/// Length of the fixed frame header.
pub const HEADER_LEN: usize = 12;
/// The largest body either side accepts (4 MiB).
pub const MAX_BODY_LEN: u32 = 4 * 1024 * 1024;

/// Why a frame could not be read, written or decoded.
#[derive(Debug, Error)]
pub enum FrameError {
    /// The underlying stream failed.
    #[error("Channel I/O failed: {0}")]
    Io(#[from] io::Error),
    /// The peer closed the stream between two frames.
    #[error("Channel closed by the peer")]
    Closed,
    /// The peer closed the stream in the middle of a frame.
    #[error("Channel closed in the middle of a frame")]
    Truncated,
    /// The header did not start with `TVAG`: the peer does not speak this protocol or the
    /// stream lost its framing.
    #[error("Frame does not start with the TVAG magic (got {0:02x?}); reconnect to resynchronise")]
    BadMagic([u8; 4]),
    /// The peer speaks another protocol version.
    #[error("Frame has protocol version {0}, this side speaks {PROTOCOL_VERSION}; upgrade the older side")]
    UnsupportedVersion(u16),
    /// Reserved flag bits were set.
    #[error("Frame has reserved flags {0:#06x} set; they must be 0 in version {PROTOCOL_VERSION}")]
    ReservedFlags(u16),
    /// The body is longer than [`MAX_BODY_LEN`].
    #[error("Frame body of {len} bytes exceeds the {max} byte limit; send smaller messages")]
    TooLarge {
        /// The announced or attempted length.
        len: u64,
        /// The limit.
        max: u32,
    },
    /// The body is not valid JSON for the expected message type.
    #[error("Frame body is not a valid message: {0}")]
    Json(#[from] serde_json::Error),
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Body length in bytes (already checked against [`MAX_BODY_LEN`]).
    pub len: u32,
}

/// Checks a 12-byte header and returns the body length.
pub fn parse_header(header: &[u8; HEADER_LEN]) -> Result<FrameHeader, FrameError> {
    let magic: [u8; 4] = [header[0], header[1], header[2], header[3]];
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    let version = u16::from_be_bytes([header[4], header[5]]);
    if version != PROTOCOL_VERSION {
        return Err(FrameError::UnsupportedVersion(version));
    }
    let flags = u16::from_be_bytes([header[6], header[7]]);
    if flags != 0 {
        return Err(FrameError::ReservedFlags(flags));
    }
    let len = u32::from_be_bytes([header[8], header[9], header[10], header[11]]);
    if len > MAX_BODY_LEN {
        return Err(FrameError::TooLarge {
            len: u64::from(len),
            max: MAX_BODY_LEN,
        });
    }
    Ok(FrameHeader { len })
}

/// Serialises `msg` into one complete frame (header and body).
pub fn encode_frame<T: Serialize>(msg: &T) -> Result<Zeroizing<Vec<u8>>, FrameError> {
    // Room up front so that small frames (the key-bearing ones) are never reallocated,
    // which would leave an unzeroized copy behind.
    let mut out = Zeroizing::new(Vec::with_capacity(HEADER_LEN + 4096));
    out.resize(HEADER_LEN, 0);
    serde_json::to_writer(&mut *out, msg)?;
    let body_len = out.len() - HEADER_LEN;
    let len = u32::try_from(body_len)
        .ok()
        .filter(|l| *l <= MAX_BODY_LEN)
        .ok_or(FrameError::TooLarge {
            len: body_len as u64,
            max: MAX_BODY_LEN,
        })?;
    out[0..4].copy_from_slice(&MAGIC);
    out[4..6].copy_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    out[6..8].copy_from_slice(&0u16.to_be_bytes());
    out[8..12].copy_from_slice(&len.to_be_bytes());
    Ok(out)
}

/// The largest data frame of a streamed answer ([`encode_data`]): a host reading a stream
/// holds at most one of these at a time, whatever the guest sends.
pub const MAX_DATA_LEN: u32 = 64 * 1024;

/// One data frame of a streamed answer: the same header, the raw bytes as the body (an
/// empty one ends the stream). Refuses more than [`MAX_DATA_LEN`] bytes.
pub fn encode_data(data: &[u8]) -> Result<Vec<u8>, FrameError> {
    let len = u32::try_from(data.len())
        .ok()
        .filter(|l| *l <= MAX_DATA_LEN)
        .ok_or(FrameError::TooLarge {
            len: data.len() as u64,
            max: MAX_DATA_LEN,
        })?;
    let mut out = Vec::with_capacity(HEADER_LEN + data.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    out.extend_from_slice(&0u16.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(data);
    Ok(out)
}

/// Decodes a frame body into a message.
pub fn decode_body<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, FrameError> {
    Ok(serde_json::from_slice(body)?)
}

/// Reads exactly `buf.len()` bytes; `Ok(false)` when the stream ended before the first byte.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> Result<bool, FrameError> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]) {
            Ok(0) if filled == 0 => return Ok(false),
            Ok(0) => return Err(FrameError::Truncated),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(true)
}

/// Reads one frame body from a blocking stream.
///
/// After [`FrameError::TooLarge`] the body is still in the stream: call
/// [`skip_body`] to stay in sync. After [`FrameError::BadMagic`] (or a version or flags
/// error) the framing is lost: call [`resync`] or drop the connection.
pub fn read_frame(r: &mut impl Read) -> Result<Zeroizing<Vec<u8>>, FrameError> {
    let mut header = [0u8; HEADER_LEN];
    if !read_full(r, &mut header)? {
        return Err(FrameError::Closed);
    }
    let parsed = parse_header(&header)?;
    read_body(r, parsed.len)
}

fn read_body(r: &mut impl Read, len: u32) -> Result<Zeroizing<Vec<u8>>, FrameError> {
    let mut body = Zeroizing::new(vec![0u8; len as usize]);
    if len > 0 && !read_full(r, &mut body)? {
        return Err(FrameError::Truncated);
    }
    Ok(body)
}

/// Discards `len` bytes (the body of a frame refused as too large) without buffering it.
pub fn skip_body(r: &mut impl Read, len: u64) -> Result<(), FrameError> {
    let copied = io::copy(&mut r.take(len), &mut io::sink())?;
    if copied < len {
        return Err(FrameError::Truncated);
    }
    Ok(())
}

/// Discards bytes up to and including the next `TVAG` magic, then reads the frame that
/// follows it. Gives up with [`FrameError::BadMagic`] after `max_skip` bytes.
pub fn resync(r: &mut impl Read, max_skip: usize) -> Result<Zeroizing<Vec<u8>>, FrameError> {
    let mut window = [0u8; 4];
    let mut seen = 0usize;
    let mut byte = [0u8; 1];
    loop {
        if !read_full(r, &mut byte)? {
            return Err(FrameError::Closed);
        }
        window = [window[1], window[2], window[3], byte[0]];
        seen += 1;
        if seen >= 4 && window == MAGIC {
            break;
        }
        if seen > max_skip {
            return Err(FrameError::BadMagic(window));
        }
    }
    let mut rest = [0u8; HEADER_LEN - 4];
    if !read_full(r, &mut rest)? {
        return Err(FrameError::Truncated);
    }
    let mut header = [0u8; HEADER_LEN];
    header[..4].copy_from_slice(&MAGIC);
    header[4..].copy_from_slice(&rest);
    let parsed = parse_header(&header)?;
    read_body(r, parsed.len)
}

/// What [`FrameDecoder::skip_stale_mux`] found at the front of the bytes held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StaleMux {
    /// Not a mux frame: read a frame as usual.
    NotMux,
    /// The start of a mux frame: more bytes are needed.
    NeedMore,
    /// A whole mux frame of this many bytes was dropped.
    Skipped(usize),
}

/// An incremental frame decoder for streams read with timeouts: bytes go in as they
/// arrive, complete frames come out, and a partial frame survives a timed-out read.
#[derive(Default)]
pub struct FrameDecoder {
    buf: Zeroizing<Vec<u8>>,
}

impl FrameDecoder {
    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Returns the next complete frame body, `Ok(None)` if more bytes are needed. An error
    /// means the stream cannot be trusted any more.
    pub fn next_frame(&mut self) -> Result<Option<Zeroizing<Vec<u8>>>, FrameError> {
        if self.buf.len() < HEADER_LEN {
            // Reject a wrong magic as soon as it is visible.
            let n = self.buf.len().min(4);
            if self.buf[..n] != MAGIC[..n] {
                let mut got = [0u8; 4];
                got[..n].copy_from_slice(&self.buf[..n]);
                return Err(FrameError::BadMagic(got));
            }
            return Ok(None);
        }
        let mut header = [0u8; HEADER_LEN];
        header.copy_from_slice(&self.buf[..HEADER_LEN]);
        let parsed = parse_header(&header)?;
        let total = HEADER_LEN + parsed.len as usize;
        if self.buf.len() < total {
            return Ok(None);
        }
        let body = Zeroizing::new(self.buf[HEADER_LEN..total].to_vec());
        self.buf.drain(..total);
        Ok(Some(body))
    }

    /// Drops a whole mux frame (`TVMX`, see [`crate::mux`]) at the front, if one is there:
    /// on a plain channel such a frame is always stale, the tail of a mux session whose
    /// client left without an `end` (a daemon killed while the agent was still streaming)
    /// and that the agent sends until it reads the next client's plain request. The caller
    /// bounds how much it drops. A mux header the mux decoder would refuse (a length past
    /// what its kind allows, reserved bits, a bad kind) is not trusted: `BadMagic`.
    pub fn skip_stale_mux(&mut self) -> Result<StaleMux, FrameError> {
        use crate::mux::{parse_header as parse_mux_header, MUX_HEADER_LEN, MUX_MAGIC};
        let n = self.buf.len().min(4);
        if self.buf[..n] != MUX_MAGIC[..n] {
            return Ok(StaleMux::NotMux);
        }
        if n < 4 {
            // "T" and "TV" begin both magics; "TVM" only the mux one.
            return Ok(if self.buf[..n] == MAGIC[..n] {
                StaleMux::NotMux
            } else {
                StaleMux::NeedMore
            });
        }
        if self.buf.len() < MUX_HEADER_LEN {
            return Ok(StaleMux::NeedMore);
        }
        let mut header = [0u8; MUX_HEADER_LEN];
        header.copy_from_slice(&self.buf[..MUX_HEADER_LEN]);
        let (_, _, len) = parse_mux_header(&header).map_err(|_| FrameError::BadMagic(MUX_MAGIC))?;
        let total = MUX_HEADER_LEN + len;
        if self.buf.len() < total {
            return Ok(StaleMux::NeedMore);
        }
        self.buf.drain(..total);
        Ok(StaleMux::Skipped(total))
    }

    /// The header of the next frame once its 12 bytes are in, checked, before its body
    /// arrives (a reader can refuse a long frame before buffering it).
    pub fn peek_header(&self) -> Result<Option<FrameHeader>, FrameError> {
        if self.buf.len() < HEADER_LEN {
            return Ok(None);
        }
        let mut header = [0u8; HEADER_LEN];
        header.copy_from_slice(&self.buf[..HEADER_LEN]);
        parse_header(&header).map(Some)
    }

    /// Bytes held that do not yet form a frame.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{DiskKey, HttpRequest, Request, RequestFrame, ResponseFrame};

    fn frame_with(len: u32, version: u16, flags: u16, body: &[u8]) -> Vec<u8> {
        let mut v = MAGIC.to_vec();
        v.extend_from_slice(&version.to_be_bytes());
        v.extend_from_slice(&flags.to_be_bytes());
        v.extend_from_slice(&len.to_be_bytes());
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn request_round_trips_through_a_frame() {
        let req = RequestFrame {
            id: 7,
            request: Request::Mount {
                format_if_missing: true,
            },
        };
        let bytes = encode_frame(&req).unwrap();
        let body = read_frame(&mut &bytes[..]).unwrap();
        let back: RequestFrame = decode_body(&body).unwrap();
        assert_eq!(back, req);
    }

    #[test]
    fn oversized_header_is_refused_before_reading_the_body() {
        let bytes = frame_with(MAX_BODY_LEN + 1, PROTOCOL_VERSION, 0, b"");
        match read_frame(&mut &bytes[..]) {
            Err(FrameError::TooLarge { len, .. }) => assert_eq!(len, u64::from(MAX_BODY_LEN) + 1),
            other => panic!("expected TooLarge, got {other:?}"),
        }
        let mut dec = FrameDecoder::default();
        dec.push(&frame_with(u32::MAX, PROTOCOL_VERSION, 0, b""));
        assert!(matches!(dec.next_frame(), Err(FrameError::TooLarge { .. })));
    }

    #[test]
    fn wrong_magic_version_or_flags_are_errors() {
        let mut bad = frame_with(2, PROTOCOL_VERSION, 0, b"{}");
        bad[0] = b'X';
        assert!(matches!(
            read_frame(&mut &bad[..]),
            Err(FrameError::BadMagic(_))
        ));
        let v2 = frame_with(2, 2, 0, b"{}");
        assert!(matches!(
            read_frame(&mut &v2[..]),
            Err(FrameError::UnsupportedVersion(2))
        ));
        let flagged = frame_with(2, PROTOCOL_VERSION, 1, b"{}");
        assert!(matches!(
            read_frame(&mut &flagged[..]),
            Err(FrameError::ReservedFlags(1))
        ));
    }

    #[test]
    fn truncated_and_closed_streams_are_told_apart() {
        assert!(matches!(read_frame(&mut &b""[..]), Err(FrameError::Closed)));
        let short = frame_with(10, PROTOCOL_VERSION, 0, b"{}");
        assert!(matches!(
            read_frame(&mut &short[..]),
            Err(FrameError::Truncated)
        ));
        assert!(matches!(
            read_frame(&mut &MAGIC[..]),
            Err(FrameError::Truncated)
        ));
    }

    #[test]
    fn skip_body_and_resync_recover_the_stream() {
        let good = encode_frame(&RequestFrame {
            id: 9,
            request: Request::Status,
        })
        .unwrap();
        // An oversized frame whose body is then skipped.
        let mut stream = frame_with(MAX_BODY_LEN + 5, PROTOCOL_VERSION, 0, b"");
        let big_len = u64::from(MAX_BODY_LEN) + 5;
        stream.extend(std::iter::repeat_n(b'x', big_len as usize));
        stream.extend_from_slice(&good);
        let mut r = &stream[..];
        let Err(FrameError::TooLarge { len, .. }) = read_frame(&mut r) else {
            panic!("expected TooLarge");
        };
        skip_body(&mut r, len).unwrap();
        let body = read_frame(&mut r).unwrap();
        assert_eq!(decode_body::<RequestFrame>(&body).unwrap().id, 9);

        // Garbage then a good frame: resync finds it.
        let mut stream = b"garbage-TVA-bytes".to_vec();
        stream.extend_from_slice(&good);
        let mut r = &stream[..];
        assert!(matches!(read_frame(&mut r), Err(FrameError::BadMagic(_))));
        let body = resync(&mut r, 1024).unwrap();
        assert_eq!(decode_body::<RequestFrame>(&body).unwrap().id, 9);

        // Resync gives up after its budget.
        let noise = [0u8; 100];
        assert!(matches!(
            resync(&mut &noise[..], 10),
            Err(FrameError::BadMagic(_))
        ));
    }

    #[test]
    fn decoder_assembles_frames_from_fragments() {
        let a = encode_frame(&RequestFrame {
            id: 1,
            request: Request::Status,
        })
        .unwrap();
        let b = encode_frame(&RequestFrame {
            id: 2,
            request: Request::Health,
        })
        .unwrap();
        let mut all = a.to_vec();
        all.extend_from_slice(&b);
        let mut dec = FrameDecoder::default();
        let mut ids = Vec::new();
        for chunk in all.chunks(5) {
            dec.push(chunk);
            while let Some(body) = dec.next_frame().unwrap() {
                ids.push(decode_body::<RequestFrame>(&body).unwrap().id);
            }
        }
        assert_eq!(ids, vec![1, 2]);
        assert_eq!(dec.pending(), 0);
        let mut bad = FrameDecoder::default();
        bad.push(b"HTTP/1.1 200 OK");
        assert!(matches!(bad.next_frame(), Err(FrameError::BadMagic(_))));
    }

    /// SplitMix64, for reproducible random inputs.
    fn rng(seed: &mut u64) -> u64 {
        *seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    #[test]
    fn random_and_mutated_input_never_panics_the_decoders() {
        let good = encode_frame(&RequestFrame {
            id: 3,
            request: Request::UnlockDisk {
                key: DiskKey::new(&[0x5a; 32]).unwrap(),
            },
        })
        .unwrap();
        let mut seed = 42u64;
        for round in 0..3000 {
            let mut bytes = if round % 2 == 0 {
                // Pure noise, sometimes behind a valid header prefix.
                let n = (rng(&mut seed) % 200) as usize;
                let mut v: Vec<u8> = (0..n).map(|_| rng(&mut seed) as u8).collect();
                if round % 4 == 0 {
                    let mut h = good[..HEADER_LEN].to_vec();
                    h[8..12].copy_from_slice(&(v.len() as u32).to_be_bytes());
                    h.append(&mut v);
                    v = h;
                }
                v
            } else {
                // A valid frame with a few bytes flipped.
                let mut v = good.to_vec();
                for _ in 0..1 + rng(&mut seed) % 4 {
                    let i = (rng(&mut seed) as usize) % v.len();
                    v[i] ^= (rng(&mut seed) as u8) | 1;
                }
                v
            };
            let _ = read_frame(&mut &bytes[..])
                .and_then(|b| decode_body::<RequestFrame>(&b).map(|_| ()));
            let _ = resync(&mut &bytes[..], 64);
            let mut dec = FrameDecoder::default();
            for chunk in bytes.chunks(7) {
                dec.push(chunk);
                match dec.next_frame() {
                    Ok(Some(body)) => {
                        let _ = decode_body::<ResponseFrame>(&body);
                    }
                    Ok(None) => {}
                    Err(_) => break,
                }
            }
            bytes.clear();
        }
    }

    #[test]
    fn encoding_refuses_oversized_messages() {
        let req = RequestFrame {
            id: 1,
            request: Request::Infer(HttpRequest {
                method: "POST".into(),
                path: "/".into(),
                headers: vec![],
                body: "a".repeat(MAX_BODY_LEN as usize),
            }),
        };
        assert!(matches!(
            encode_frame(&req),
            Err(FrameError::TooLarge { .. })
        ));
    }
}
