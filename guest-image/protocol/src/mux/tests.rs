use proptest::prelude::*;

use super::*;

fn frame() -> impl Strategy<Value = MuxFrame> {
    let stream = 1u32..=u32::MAX;
    prop_oneof![
        stream.clone().prop_map(|stream| MuxFrame::Open { stream }),
        (
            stream.clone(),
            proptest::collection::vec(any::<u8>(), 1..=2048)
        )
            .prop_map(|(stream, bytes)| MuxFrame::Data { stream, bytes }),
        (stream.clone(), 1..=MAX_WINDOW)
            .prop_map(|(stream, credit)| MuxFrame::Window { stream, credit }),
        stream.clone().prop_map(|stream| MuxFrame::Close { stream }),
        (stream, "[a-z ]{0,64}").prop_map(|(stream, reason)| MuxFrame::Reset { stream, reason }),
        Just(MuxFrame::End),
    ]
}

proptest! {
    /// Any sequence of valid frames, cut into pieces anywhere, decodes to itself.
    #[test]
    fn frames_round_trip_however_the_bytes_are_cut(
        frames in proptest::collection::vec(frame(), 1..16),
        cuts in proptest::collection::vec(1usize..200, 1..64),
    ) {
        let bytes: Vec<u8> = frames.iter().flat_map(MuxFrame::encode).collect();
        let mut d = MuxDecoder::default();
        let mut out = Vec::new();
        let mut at = 0;
        let mut i = 0;
        while at < bytes.len() {
            let n = cuts[i % cuts.len()].min(bytes.len() - at);
            d.push(&bytes[at..at + n]);
            at += n;
            i += 1;
            while let Some(f) = d.next_frame().unwrap() {
                out.push(f);
            }
        }
        prop_assert_eq!(d.buffered(), 0);
        prop_assert_eq!(out, frames);
    }

    /// Hostile bytes: never a panic, never more than one frame held beyond the last push,
    /// and once out of step the decoder stays failed.
    #[test]
    fn arbitrary_bytes_never_panic_or_grow_the_buffer(
        chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..512), 0..32),
        magic_first in any::<bool>(),
    ) {
        let mut d = MuxDecoder::default();
        let mut failed = false;
        for (i, chunk) in chunks.iter().enumerate() {
            let mut chunk = chunk.clone();
            if magic_first && i == 0 && chunk.len() >= 4 {
                chunk[..4].copy_from_slice(&MUX_MAGIC);
            }
            d.push(&chunk);
            loop {
                match d.next_frame() {
                    Ok(Some(f)) => prop_assert!(!failed, "a frame after a channel error: {f:?}"),
                    Ok(None) => break,
                    Err(e) if e.stream().is_some() => {}
                    Err(_) => {
                        failed = true;
                        break;
                    }
                }
            }
            prop_assert!(d.buffered() <= MUX_HEADER_LEN + MAX_MUX_DATA + chunk.len());
            if failed {
                prop_assert_eq!(d.buffered(), 0);
                prop_assert!(d.next_frame().is_err());
            }
        }
    }
}

fn header(stream: u32, kind: u8, flags: u8, len: u32) -> Vec<u8> {
    let mut h = MUX_MAGIC.to_vec();
    h.extend_from_slice(&stream.to_be_bytes());
    h.push(kind);
    h.push(flags);
    h.extend_from_slice(&[0, 0]);
    h.extend_from_slice(&len.to_be_bytes());
    h
}

fn decode(bytes: &[u8]) -> Result<Option<MuxFrame>, MuxError> {
    let mut d = MuxDecoder::default();
    d.push(bytes);
    d.next_frame()
}

#[test]
fn each_malformed_header_is_refused_from_the_header_alone() {
    let mut bad_magic = header(1, 1, 0, 0);
    bad_magic[0] = b'X';
    assert!(matches!(decode(&bad_magic), Err(MuxError::BadMagic(_))));
    assert!(matches!(
        decode(&header(1, 1, 1, 0)),
        Err(MuxError::Reserved { flags: 1, .. })
    ));
    assert_eq!(decode(&header(1, 9, 0, 0)), Err(MuxError::BadKind(9)));
    assert_eq!(decode(&header(0, 1, 0, 0)), Err(MuxError::StreamZero));
    // Lengths each kind refuses, judged before any payload arrives: a 4 GiB data frame
    // costs 16 bytes.
    for (kind, len) in [
        (1, 1),
        (2, 0),
        (2, 65_537),
        (2, u32::MAX),
        (3, 8),
        (4, 3),
        (5, 257),
    ] {
        assert!(
            matches!(
                decode(&header(7, kind, 0, len)),
                Err(MuxError::BadLength { .. })
            ),
            "kind {kind} len {len}"
        );
    }
    // Channel-level: no stream to blame.
    assert_eq!(decode(&header(0, 1, 0, 0)).unwrap_err().stream(), None);
}

#[test]
fn stream_level_errors_name_their_stream_and_the_channel_goes_on() {
    let mut bytes = header(5, 3, 0, 4);
    bytes.extend_from_slice(&0u32.to_be_bytes());
    let mut reason = header(6, 5, 0, 2);
    reason.extend_from_slice(&[0xff, 0xfe]);
    bytes.extend_from_slice(&reason);
    bytes.extend_from_slice(&MuxFrame::Close { stream: 5 }.encode());
    let mut d = MuxDecoder::default();
    d.push(&bytes);
    let e = d.next_frame().unwrap_err();
    assert_eq!(e.stream(), Some(5));
    assert_eq!(d.next_frame().unwrap_err(), MuxError::BadReason(6));
    assert_eq!(d.next_frame().unwrap(), Some(MuxFrame::Close { stream: 5 }));
    assert_eq!(d.next_frame().unwrap(), None);
}

#[test]
fn validate_accepts_what_the_decoder_accepts() {
    MuxFrame::Open { stream: 1 }.validate().unwrap();
    assert!(MuxFrame::Open { stream: 0 }.validate().is_err());
    assert!(MuxFrame::Data {
        stream: 1,
        bytes: vec![]
    }
    .validate()
    .is_err());
    assert!(MuxFrame::Window {
        stream: 1,
        credit: MAX_WINDOW + 1
    }
    .validate()
    .is_err());
}

#[test]
fn the_stream_table_bounds_streams_and_enforces_credit() {
    let mut t = StreamTable::new(2, 100);
    t.open(1).unwrap();
    assert_eq!(t.open(1), Err(StreamError::AlreadyOpen(1)));
    t.open(2).unwrap();
    assert_eq!(t.open(3), Err(StreamError::TooMany { stream: 3, open: 2 }));
    assert_eq!(t.receive(9, 1), Err(StreamError::NotOpen(9)));
    t.receive(1, 60).unwrap();
    t.receive(1, 40).unwrap();
    // Over the credit: the stream is gone, the other one untouched.
    assert_eq!(
        t.receive(1, 1),
        Err(StreamError::OverCredit {
            stream: 1,
            len: 1,
            credit: 0
        })
    );
    assert_eq!(t.len(), 1);
    assert_eq!(t.receive(1, 1), Err(StreamError::NotOpen(1)));
    t.receive(2, 100).unwrap();
    assert_eq!(t.grant(2, 50).unwrap(), 50);
    t.receive(2, 50).unwrap();
    // Outstanding credit never exceeds the window.
    assert_eq!(t.grant(2, u32::MAX).unwrap(), MAX_WINDOW);
    assert_eq!(t.grant(2, 1).unwrap(), 0);
    t.end(2);
    t.end(2);
    assert!(t.is_empty());
    t.open(3).unwrap();
}

#[test]
fn end_is_stream_zero_only_and_carries_nothing() {
    let bytes = MuxFrame::End.encode();
    assert_eq!(&bytes[4..8], &[0, 0, 0, 0]);
    assert_eq!(bytes[8], 6);
    let mut d = MuxDecoder::default();
    d.push(&bytes);
    assert_eq!(d.next_frame().unwrap(), Some(MuxFrame::End));
    // An end naming a stream, or carrying bytes, loses the channel.
    let mut named = bytes.clone();
    named[7] = 3;
    let mut d = MuxDecoder::default();
    d.push(&named);
    assert_eq!(d.next_frame(), Err(MuxError::EndWithStream(3)));
    assert_eq!(d.next_frame(), Err(MuxError::Failed));
    let mut long = bytes;
    long[15] = 1;
    long.push(0);
    let mut d = MuxDecoder::default();
    d.push(&long);
    assert!(matches!(
        d.next_frame(),
        Err(MuxError::BadLength { kind: 6, .. })
    ));
    // Other kinds still refuse stream 0.
    let mut d = MuxDecoder::default();
    let mut open0 = MuxFrame::Open { stream: 1 }.encode();
    open0[7] = 0;
    d.push(&open0);
    assert_eq!(d.next_frame(), Err(MuxError::StreamZero));
}
