//! Fuzzes the stream multiplexer's frame decoder as the pump loop drives it: the input's
//! bytes, cut into chunks, are pushed into a `MuxDecoder`, and after every push frames are
//! taken with `next_frame` until it needs more (a stream-level error resets one stream
//! and the loop goes on; a channel-level one ends it).
//!
//! Input layout: byte 0 gives how many chunk sizes follow (0..=7); those bytes are the
//! sizes, used in turn (0 pushes nothing, 1..=127 that many bytes, 128..=255 that many
//! KiB above 127, as the pump's reads of up to 64 KiB); the rest is the channel's byte
//! stream. Without sizes the whole stream is one push. Whole data frames need inputs over
//! 64 KiB: run with `-max_len=140000` now and then.
//!
//! Checks: nothing panics; after a channel-level error every later call fails and nothing
//! is held, and only a bad magic hands back its bytes (`take_unframed`, once); the decoder never holds more than one frame beyond the last push; every frame
//! consumes exactly its bytes, which are what `MuxFrame::encode` gives for it, and that
//! encoding decodes back to an equal frame.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tenantvm_agent_protocol::mux::{MuxDecoder, MuxError, MuxFrame, MAX_MUX_DATA, MUX_HEADER_LEN};

/// `frame` encodes to `consumed` (the bytes the decoder took for it), and its encoding
/// decodes back to an equal frame.
fn check_round_trip(frame: &MuxFrame, consumed: &[u8]) {
    let bytes = frame.encode();
    assert_eq!(
        bytes, consumed,
        "{frame:?} does not encode to the bytes it came from"
    );
    let mut d = MuxDecoder::default();
    d.push(&bytes);
    assert_eq!(d.next_frame(), Ok(Some(frame.clone())));
    assert_eq!(d.buffered(), 0);
    assert_eq!(frame.validate(), Ok(()));
}

/// The push size a size byte stands for.
fn chunk_len(s: u8) -> usize {
    match s {
        0..=127 => usize::from(s),
        _ => usize::from(s - 127) * 1024,
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let (sizes, stream) = rest.split_at(usize::from(n % 8).min(rest.len()));

    let mut dec = MuxDecoder::default();
    // Every byte pushed, and how many of them the decoder has consumed.
    let mut pushed: Vec<u8> = Vec::with_capacity(stream.len());
    let mut channel_failed = false;
    let mut offset = 0;
    let mut empty_pushes = 0;
    let mut turn = 0;
    while offset < stream.len() {
        let size = match sizes.get(turn % sizes.len().max(1)) {
            // Empty pushes only a few times, so that the loop ends.
            Some(0) if empty_pushes < 4 => {
                empty_pushes += 1;
                0
            }
            Some(&s) if s > 0 => chunk_len(s),
            _ => stream.len() - offset,
        };
        turn += 1;
        let chunk = &stream[offset..(offset + size).min(stream.len())];
        offset += chunk.len();
        let held = dec.buffered();
        dec.push(chunk);
        if channel_failed {
            // A failed channel takes nothing more.
            assert_eq!(dec.buffered(), 0);
        } else {
            assert_eq!(dec.buffered(), held + chunk.len());
            pushed.extend_from_slice(chunk);
        }
        assert!(dec.buffered() <= MUX_HEADER_LEN + MAX_MUX_DATA + chunk.len());

        if channel_failed {
            // Every later call fails, whatever was pushed.
            assert_eq!(dec.next_frame(), Err(MuxError::Failed));
            continue;
        }
        loop {
            let before = dec.buffered();
            let start = pushed.len() - before;
            match dec.next_frame() {
                Ok(Some(frame)) => {
                    let end = pushed.len() - dec.buffered();
                    check_round_trip(&frame, &pushed[start..end]);
                }
                Ok(None) => {
                    assert_eq!(dec.buffered(), before);
                    break;
                }
                Err(e) => match e.stream() {
                    Some(id) => {
                        assert_ne!(id, 0);
                        // The frame's bytes are consumed: its header, then its payload.
                        let taken = before - dec.buffered();
                        assert!(taken > MUX_HEADER_LEN);
                        let header = &pushed[start..start + MUX_HEADER_LEN];
                        assert_eq!(&header[4..8], &id.to_be_bytes());
                        let len =
                            u32::from_be_bytes([header[12], header[13], header[14], header[15]]);
                        assert_eq!(taken, MUX_HEADER_LEN + len as usize);
                    }
                    None => {
                        assert_ne!(e, MuxError::Failed, "Failed before any channel-level error");
                        channel_failed = true;
                        assert_eq!(dec.buffered(), 0);
                        // After a bad magic the bytes from the failed frame on are handed
                        // back once (the guest serves them plainly when they are TVAG);
                        // after any other error, nothing.
                        let unframed = dec.take_unframed();
                        if matches!(e, MuxError::BadMagic(_)) {
                            assert_eq!(unframed, &pushed[start..]);
                        } else {
                            assert!(unframed.is_empty());
                        }
                        assert!(dec.take_unframed().is_empty());
                        break;
                    }
                },
            }
        }
        // Whatever waits is less than one whole frame.
        assert!(dec.buffered() < MUX_HEADER_LEN + MAX_MUX_DATA);
    }
    if channel_failed {
        for _ in 0..2 {
            assert_eq!(dec.next_frame(), Err(MuxError::Failed));
        }
    }
});
