//! The channel owner against a well-behaved guest loop and against hostile fake agents
//! (a raw socket pair end the test writes frames to by hand).

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use super::*;
use crate::frame::{decode_body, encode_frame, read_frame};
use crate::message::{AgentFailure, Outcome, Reply, Request, RequestFrame, ResponseFrame};
use crate::mux::{MuxDecoder, MuxFrame, MAX_WINDOW};

fn cfg(max_streams: usize, window: u32) -> MuxConfig {
    MuxConfig {
        max_streams,
        window,
        write_timeout: Duration::from_secs(2),
        stall: Duration::from_millis(500),
        idle: None,
    }
}

/// A host channel over a socket pair; the other end for the test's fake guest.
fn host_and_raw(c: MuxConfig) -> (MuxChannel, UnixStream) {
    let (host, guest) = UnixStream::pair().unwrap();
    (MuxChannel::start(OwnedFd::from(host), c).unwrap(), guest)
}

/// Waits (bounded) until the channel's loop ended.
fn wait_end(ch: &MuxChannel, within: Duration) -> Option<PumpEnd> {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if let Some(end) = ch.ended() {
            return Some(end);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// Reads frames from the raw guest end until `want` matches one (bounded).
fn read_until(raw: &mut UnixStream, want: impl Fn(&MuxFrame) -> bool) -> MuxFrame {
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut d = MuxDecoder::default();
    let mut buf = [0u8; 65536];
    loop {
        while let Some(f) = d.next_frame().unwrap() {
            if want(&f) {
                return f;
            }
        }
        let n = raw.read(&mut buf).expect("frame before the timeout");
        assert!(n > 0, "channel closed");
        d.push(&buf[..n]);
    }
}

/// An echo guest: every stream's bytes come back, then it closes; each stream waits at
/// `barrier` first so the test proves streams are in flight at once.
fn echo_guest(
    c: MuxConfig,
    barrier: Option<Arc<Barrier>>,
) -> (UnixStream, std::thread::JoinHandle<PumpEnd>) {
    let (host, guest) = UnixStream::pair().unwrap();
    let t = std::thread::spawn(move || {
        serve_guest(OwnedFd::from(guest), c, &mut |mut s: UnixStream, _stop| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                if let Some(b) = barrier {
                    b.wait();
                }
                let mut buf = vec![0u8; 8192];
                loop {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => s.write_all(&buf[..n]).unwrap(),
                    }
                }
            });
        })
    });
    (host, t)
}

fn echo_through(ch: &MuxChannel, data: &[u8]) -> Vec<u8> {
    let mut s = ch.open_stream().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut writer = s.try_clone().unwrap();
    let data = data.to_vec();
    let w = std::thread::spawn(move || {
        writer.write_all(&data).unwrap();
        writer.shutdown(std::net::Shutdown::Write).unwrap();
    });
    let mut back = Vec::new();
    s.read_to_end(&mut back).unwrap();
    w.join().unwrap();
    back
}

#[test]
fn streams_are_in_flight_at_once_and_credit_carries_more_than_a_window() {
    let c = cfg(4, 16 * 1024);
    // Two streams must both be open before either guest handler goes on.
    let (host, guest) = echo_guest(c, Some(Arc::new(Barrier::new(2))));
    let ch = Arc::new(MuxChannel::start(OwnedFd::from(host), c).unwrap());
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let (ch2, d2) = (Arc::clone(&ch), data.clone());
    let other = std::thread::spawn(move || echo_through(&ch2, &d2));
    assert_eq!(echo_through(&ch, &data), data);
    assert_eq!(other.join().unwrap(), data);
    assert_eq!(ch.ended(), None);
    drop(Arc::try_unwrap(ch).unwrap());
    assert_eq!(guest.join().unwrap(), PumpEnd::Closed);
}

#[test]
fn the_stream_cap_refuses_with_busy() {
    let (ch, _raw) = host_and_raw(cfg(2, 4096));
    let _a = ch.open_stream().unwrap();
    let _b = ch.open_stream().unwrap();
    assert!(matches!(ch.open_stream(), Err(MuxChannelError::Busy(2))));
}

#[test]
fn garbage_from_the_guest_ends_only_its_channel() {
    let (bad, mut bad_raw) = host_and_raw(cfg(2, 4096));
    let (good_host, _g) = echo_guest(cfg(2, 4096), None);
    let good = MuxChannel::start(OwnedFd::from(good_host), cfg(2, 4096)).unwrap();
    bad_raw.write_all(b"GARBAGE-NOT-A-MUX-FRAME").unwrap();
    assert!(matches!(
        wait_end(&bad, Duration::from_secs(5)),
        Some(PumpEnd::Failed(_))
    ));
    assert!(matches!(bad.open_stream(), Err(MuxChannelError::Ended(_))));
    assert_eq!(echo_through(&good, b"still here"), b"still here");
}

#[test]
fn a_guest_that_opens_streams_breaks_the_channel() {
    let (ch, mut raw) = host_and_raw(cfg(2, 4096));
    raw.write_all(&MuxFrame::Open { stream: 7 }.encode())
        .unwrap();
    assert!(matches!(
        wait_end(&ch, Duration::from_secs(5)),
        Some(PumpEnd::Failed(_))
    ));
}

#[test]
fn a_flood_beyond_credit_resets_that_stream_and_the_channel_goes_on() {
    let (ch, mut raw) = host_and_raw(cfg(2, 4096));
    let mut s = ch.open_stream().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let id = read_until(&mut raw, |f| matches!(f, MuxFrame::Open { .. })).stream();
    raw.write_all(
        &MuxFrame::Data {
            stream: id,
            bytes: vec![b'x'; 5000],
        }
        .encode(),
    )
    .unwrap();
    let reset = read_until(&mut raw, |f| matches!(f, MuxFrame::Reset { .. }));
    assert_eq!(reset.stream(), id);
    // The user's end sees the stream end, not the flood.
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    assert!(got.is_empty());
    assert_eq!(ch.ended(), None);
    let _t = ch.open_stream().unwrap();
    let next = read_until(&mut raw, |f| matches!(f, MuxFrame::Open { .. }));
    assert_ne!(next.stream(), id);
}

#[test]
fn a_guest_that_never_grants_credit_fails_its_channel_by_the_deadline() {
    let (ch, mut raw) = host_and_raw(cfg(2, 4096));
    let mut s = ch.open_stream().unwrap();
    read_until(&mut raw, |f| matches!(f, MuxFrame::Open { .. }));
    s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    // More than the window: the rest waits for credit that never comes.
    let _ = s.write_all(&[7u8; 10_000]);
    let started = Instant::now();
    assert!(matches!(
        wait_end(&ch, Duration::from_secs(5)),
        Some(PumpEnd::Failed(_))
    ));
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_bad_credit_resets_the_stream_only() {
    let (ch, mut raw) = host_and_raw(cfg(2, 4096));
    let _s = ch.open_stream().unwrap();
    let id = read_until(&mut raw, |f| matches!(f, MuxFrame::Open { .. })).stream();
    raw.write_all(
        &MuxFrame::Window {
            stream: id,
            credit: MAX_WINDOW,
        }
        .encode(),
    )
    .unwrap();
    assert_eq!(
        read_until(&mut raw, |f| matches!(f, MuxFrame::Reset { .. })).stream(),
        id
    );
    assert_eq!(ch.ended(), None);
}

/// A fake agent that answers the first request with `answer` and then, if it is a mux
/// reply, serves the port with the guest loop (echo).
fn fake_agent(answer: Outcome) -> (UnixStream, std::thread::JoinHandle<()>) {
    let (host, mut guest) = UnixStream::pair().unwrap();
    let t = std::thread::spawn(move || {
        let body = read_frame(&mut guest).unwrap();
        let req: RequestFrame = decode_body(&body).unwrap();
        assert!(matches!(req.request, Request::Mux { .. }));
        let mux = matches!(answer, Outcome::Ok(Reply::Mux { .. }));
        let frame = encode_frame(&ResponseFrame {
            id: req.id,
            outcome: answer,
        })
        .unwrap();
        guest.write_all(&frame).unwrap();
        if mux {
            serve_guest(
                OwnedFd::from(guest),
                cfg(2, 4096),
                &mut |mut s: UnixStream, _stop| {
                    std::thread::spawn(move || {
                        let mut b = Vec::new();
                        let _ = s.read_to_end(&mut b);
                        let _ = s.write_all(&b);
                    });
                },
            );
        }
    });
    (host, t)
}

#[test]
fn negotiation_follows_the_agents_answer() {
    let t = Duration::from_secs(5);
    let (host, agent) = fake_agent(Outcome::Ok(Reply::Mux {
        version: MUX_VERSION,
        max_streams: 2,
        window: 4096,
    }));
    match negotiate(AgentClient::over_stream(host), cfg(4, 4096), t).unwrap() {
        Negotiated::Mux(ch) => {
            assert_eq!(ch.config().max_streams, 2);
            assert_eq!(echo_through(&ch, b"hello"), b"hello");
        }
        Negotiated::Plain(_) => panic!("the agent accepted"),
    }
    agent.join().unwrap();

    let (host, agent) = fake_agent(Outcome::Err(AgentFailure {
        code: crate::message::ErrorCode::BadRequest,
        message: "unknown variant `mux`".into(),
    }));
    assert!(matches!(
        negotiate(AgentClient::over_stream(host), cfg(4, 4096), t).unwrap(),
        Negotiated::Plain(_)
    ));
    agent.join().unwrap();

    // More streams than offered, or another window: refused, never believed.
    for (max_streams, window) in [(9, 4096), (2, 8192)] {
        let (host, agent) = fake_agent(Outcome::Ok(Reply::Mux {
            version: MUX_VERSION,
            max_streams,
            window,
        }));
        negotiate(AgentClient::over_stream(host), cfg(4, 4096), t).unwrap_err();
        let _ = agent.join();
    }
}

#[test]
fn the_agent_accepts_only_sound_offers() {
    assert_eq!(
        accept_offer(MUX_VERSION, 16, 4096, 4).unwrap().max_streams,
        4
    );
    assert!(accept_offer(MUX_VERSION + 1, 2, 4096, 4).is_none());
    assert!(accept_offer(MUX_VERSION, 0, 4096, 4).is_none());
    assert!(accept_offer(MUX_VERSION, 2, MAX_WINDOW + 1, 4).is_none());
}

#[test]
fn a_guest_stop_sends_the_last_answer_first() {
    let c = cfg(2, 4096);
    let (host, guest) = UnixStream::pair().unwrap();
    let t = std::thread::spawn(move || {
        serve_guest(OwnedFd::from(guest), c, &mut |mut s: UnixStream, stop| {
            std::thread::spawn(move || {
                s.write_all(b"powering off").unwrap();
                stop.stop();
                // Held open: only the drain can deliver the answer.
                std::thread::sleep(Duration::from_millis(500));
            });
        })
    });
    let ch = MuxChannel::start(OwnedFd::from(host), c).unwrap();
    let mut s = ch.open_stream().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = [0u8; 12];
    s.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"powering off");
    assert_eq!(t.join().unwrap(), PumpEnd::Closed);
    assert_eq!(wait_end(&ch, Duration::from_secs(5)), Some(PumpEnd::Closed));
}

#[test]
fn an_idle_host_channel_ends_by_itself_and_never_after_a_stream_was_asked_for() {
    let c = MuxConfig {
        idle: Some(Duration::from_millis(300)),
        ..cfg(2, 4096)
    };
    let (host, _guest) = echo_guest(c, None);
    let ch = MuxChannel::start(OwnedFd::from(host), c).unwrap();
    // Busy streams keep it: one held across the idle time.
    let s = ch.open_stream().unwrap();
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(ch.ended(), None);
    drop(s);
    assert_eq!(wait_end(&ch, Duration::from_secs(5)), Some(PumpEnd::Closed));
    assert!(matches!(ch.open_stream(), Err(MuxChannelError::Ended(_))));
}
