//! Fuzzes the `TVAG` framing as both ends read it, on the input as one byte stream:
//!
//! - `read_frame`, frame after frame until it fails or the stream ends, each body decoded
//!   as a `ResponseFrame` (what the host parses from the guest) and as a `RequestFrame`
//!   (what the agent parses from the host); a message that decodes must encode again and
//!   decode back to itself;
//! - the host's incremental `FrameDecoder`, fed the same bytes in chunks: it must yield
//!   exactly the bodies `read_frame` did and fail where the stream is broken;
//! - the agent's recovery loop: `skip_body` after an oversized frame, `resync` after a
//!   broken header, as tenantvm-agent's server does.
//!
//! Nothing may panic; a body never exceeds `MAX_BODY_LEN`.
#![no_main]

use std::io::Cursor;

use libfuzzer_sys::fuzz_target;
use serde::{de::DeserializeOwned, Serialize};
use tenantvm_agent_protocol::{
    decode_body, encode_frame, read_frame, resync, salvage_id, skip_body, FrameDecoder, FrameError,
    RequestFrame, ResponseFrame, HEADER_LEN, MAX_BODY_LEN,
};

/// Decodes `body` as `T`; when it decodes, checks that the message survives a round trip
/// through a frame.
fn decode_and_round_trip<T>(body: &[u8])
where
    T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug,
{
    let Ok(msg) = decode_body::<T>(body) else {
        return;
    };
    let frame = match encode_frame(&msg) {
        Ok(f) => f,
        // Only a body near the cap could re-encode past it.
        Err(FrameError::TooLarge { .. }) => return,
        Err(e) => panic!("a decoded message does not encode: {e}"),
    };
    let again = read_frame(&mut &frame[..]).expect("an encoded frame reads back");
    let back: T = decode_body(&again).expect("an encoded message decodes back");
    assert_eq!(back, msg);
}

/// Chunk sizes for the incremental decoder, picked by the input's length so that one
/// input is always cut the same way.
const CHUNKS: [usize; 6] = [1, 3, 5, 12, 50, 4096];

fuzz_target!(|data: &[u8]| {
    // 1. Frame after frame with the blocking reader.
    let mut r = Cursor::new(data);
    let mut bodies = Vec::new();
    let end = loop {
        let before = r.position();
        match read_frame(&mut r) {
            Ok(body) => {
                assert!(body.len() <= MAX_BODY_LEN as usize);
                // A frame consumes exactly its header and its body.
                assert_eq!(r.position() - before, (HEADER_LEN + body.len()) as u64);
                decode_and_round_trip::<ResponseFrame>(&body);
                decode_and_round_trip::<RequestFrame>(&body);
                bodies.push(body);
            }
            Err(e) => break e,
        }
    };
    if let FrameError::TooLarge { len, max } = end {
        assert!(len > u64::from(max));
        assert_eq!(max, MAX_BODY_LEN);
    }
    assert!(!matches!(end, FrameError::Io(_) | FrameError::Json(_)));

    // 2. The same bytes in chunks through the host's decoder.
    let step = CHUNKS[data.len() % CHUNKS.len()];
    let mut dec = FrameDecoder::default();
    let mut got = Vec::new();
    let mut failed = None;
    'feed: for chunk in data.chunks(step) {
        dec.push(chunk);
        loop {
            match dec.next_frame() {
                Ok(Some(body)) => got.push(body),
                Ok(None) => break,
                Err(e) => {
                    failed = Some(e);
                    break 'feed;
                }
            }
        }
        // Whatever waits is less than one whole frame.
        assert!(dec.pending() < HEADER_LEN + MAX_BODY_LEN as usize);
    }
    assert_eq!(
        got, bodies,
        "the decoder and the reader disagree on the frames"
    );
    match (&end, &failed) {
        (FrameError::Closed, None) => assert_eq!(dec.pending(), 0),
        (FrameError::Closed, Some(e)) => panic!("the decoder failed on a clean stream: {e}"),
        // A stream that stops in a frame: the decoder waits for more, or has already seen
        // that the magic is wrong.
        (FrameError::Truncated, None) => assert!(dec.pending() > 0),
        (FrameError::Truncated, Some(e)) => assert!(matches!(e, FrameError::BadMagic(_))),
        (_, None) => panic!("the decoder accepted a header the reader refused: {end}"),
        (_, Some(_)) => {}
    }

    // 3. The agent's loop: skip what is too large, resynchronise after a broken header.
    let mut r = Cursor::new(data);
    let mut lost_sync = false;
    loop {
        let frame = if lost_sync {
            resync(&mut r, 64)
        } else {
            read_frame(&mut r)
        };
        lost_sync = false;
        match frame {
            Ok(body) => {
                assert!(body.len() <= MAX_BODY_LEN as usize);
                if decode_body::<RequestFrame>(&body).is_err() {
                    let _ = salvage_id(&body);
                }
            }
            Err(FrameError::Closed | FrameError::Truncated | FrameError::Io(_)) => break,
            Err(FrameError::TooLarge { len, .. }) => {
                if skip_body(&mut r, len).is_err() {
                    break;
                }
            }
            Err(_) => lost_sync = true,
        }
    }
});
