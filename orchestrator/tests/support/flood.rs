//! A hostile flood against a front door, for the tests and the benchmark: connections from
//! many loopback sources (127.0.0.2 and up) that each hold their place as long as the door
//! lets them and reconnect when it closes them. Three kinds, as an anonymous client would
//! hold a door: idle TCP sockets that never send a byte, sockets that trickle a TLS
//! ClientHello a byte at a time, and TLS connections that trickle a request head a byte at
//! a time. The flood runs on a thread of its own (one async thread: the attacker gets at
//! most one core) until [`Flood::stop`]. Standalone, so that the library's own tests and
//! the benchmarks load it by path too.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What to throw at the door.
#[derive(Clone)]
pub struct FloodPlan {
    /// The door.
    pub addr: SocketAddr,
    /// A client configuration the door's certificate passes (for the head tricklers).
    pub tls: Arc<rustls::ClientConfig>,
    /// Loopback sources used, 127.0.0.2 and up.
    pub sources: u8,
    /// Idle TCP connections.
    pub idle: usize,
    /// Connections trickling a ClientHello.
    pub hello_tricklers: usize,
    /// TLS connections trickling a request head.
    pub head_tricklers: usize,
    /// Pause between a closed connection and its replacement.
    pub reconnect_after: Duration,
    /// Pause between trickled bytes.
    pub trickle_every: Duration,
}

impl FloodPlan {
    /// `n` hostile connections against `addr`, mostly idle, over 40 sources.
    pub fn of(addr: SocketAddr, tls: Arc<rustls::ClientConfig>, n: usize) -> FloodPlan {
        let tricklers = n / 20;
        FloodPlan {
            addr,
            tls,
            sources: 40,
            idle: n - 2 * tricklers,
            hello_tricklers: tricklers,
            head_tricklers: tricklers,
            reconnect_after: Duration::from_millis(250),
            trickle_every: Duration::from_millis(300),
        }
    }
}

/// Counts of a running flood.
#[derive(Debug, Default)]
pub struct FloodStats {
    /// Connections the door accepted (TCP connected), in all.
    pub opened: AtomicU64,
    /// Connections the flood holds right now (connected and not yet seen closed).
    pub holding: AtomicU64,
    /// The most it held at once.
    pub peak: AtomicU64,
    /// Connections the door closed.
    pub closed_by_door: AtomicU64,
}

/// A running flood.
pub struct Flood {
    stop: Arc<AtomicBool>,
    /// Its counts.
    pub stats: Arc<FloodStats>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Clone, Copy)]
enum Kind {
    Idle,
    HelloTrickle,
    HeadTrickle,
}

impl Flood {
    /// Starts `plan` on a thread of its own.
    pub fn start(plan: FloodPlan) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(FloodStats::default());
        let (s, st) = (stop.clone(), stats.clone());
        let thread = std::thread::Builder::new()
            .name("hostile-flood".into())
            .spawn(move || run(plan, s, st))
            .unwrap();
        Flood {
            stop,
            stats,
            thread: Some(thread),
        }
    }

    /// Waits until the flood has opened `n` connections in all; false after `timeout`.
    pub fn wait_opened(&self, n: u64, timeout: Duration) -> bool {
        let until = Instant::now() + timeout;
        while self.stats.opened.load(Ordering::Relaxed) < n {
            if Instant::now() > until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }

    /// Stops the flood and closes its connections.
    pub fn stop(mut self) -> Arc<FloodStats> {
        self.halt();
        self.stats.clone()
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.halt();
    }
}

fn run(plan: FloodPlan, stop: Arc<AtomicBool>, stats: Arc<FloodStats>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let hello = Arc::new(client_hello(&plan.tls));
    let plan = Arc::new(plan);
    let kinds = std::iter::repeat_n(Kind::Idle, plan.idle)
        .chain(std::iter::repeat_n(
            Kind::HelloTrickle,
            plan.hello_tricklers,
        ))
        .chain(std::iter::repeat_n(Kind::HeadTrickle, plan.head_tricklers));
    rt.block_on(async {
        for (i, kind) in kinds.enumerate() {
            let source = Ipv4Addr::new(127, 0, 0, 2 + (i % usize::from(plan.sources)) as u8);
            let (plan, stats, hello) = (plan.clone(), stats.clone(), hello.clone());
            tokio::spawn(async move {
                loop {
                    hold(&plan, kind, source, &stats, &hello).await;
                    tokio::time::sleep(plan.reconnect_after).await;
                }
            });
        }
        while !stop.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    // Dropping the runtime drops every task and closes its connection.
}

/// One connection of `kind` from `source`, held until the door closes it.
async fn hold(plan: &FloodPlan, kind: Kind, source: Ipv4Addr, stats: &FloodStats, hello: &[u8]) {
    let Ok(sock) = tokio::net::TcpSocket::new_v4() else {
        return;
    };
    if sock.bind(SocketAddr::new(IpAddr::V4(source), 0)).is_err() {
        return;
    }
    let Ok(mut tcp) = sock.connect(plan.addr).await else {
        return;
    };
    stats.opened.fetch_add(1, Ordering::Relaxed);
    let now = stats.holding.fetch_add(1, Ordering::Relaxed) + 1;
    stats.peak.fetch_max(now, Ordering::Relaxed);
    match kind {
        Kind::Idle => {
            let mut b = [0u8; 64];
            while matches!(tcp.read(&mut b).await, Ok(n) if n > 0) {}
        }
        Kind::HelloTrickle => {
            let (mut r, mut w) = tcp.split();
            let trickle = async {
                for byte in hello {
                    if w.write_all(&[*byte]).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(plan.trickle_every).await;
                }
                std::future::pending::<()>().await;
            };
            let mut b = [0u8; 512];
            let closed = async { while matches!(r.read(&mut b).await, Ok(n) if n > 0) {} };
            tokio::select! {
                () = trickle => {}
                () = closed => {}
            }
        }
        Kind::HeadTrickle => {
            let connector = tokio_rustls::TlsConnector::from(plan.tls.clone());
            let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
            if let Ok(tls) = connector.connect(name, tcp).await {
                let (mut r, mut w) = tokio::io::split(tls);
                let head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n";
                let trickle = async {
                    for byte in head.iter().cycle() {
                        if w.write_all(&[*byte]).await.is_err() || w.flush().await.is_err() {
                            return;
                        }
                        tokio::time::sleep(plan.trickle_every).await;
                    }
                };
                let mut b = [0u8; 512];
                let closed = async { while matches!(r.read(&mut b).await, Ok(n) if n > 0) {} };
                tokio::select! {
                    () = trickle => {}
                    () = closed => {}
                }
            }
        }
    }
    stats.holding.fetch_sub(1, Ordering::Relaxed);
    stats.closed_by_door.fetch_add(1, Ordering::Relaxed);
}

/// The bytes of a TLS ClientHello for `localhost`.
fn client_hello(tls: &Arc<rustls::ClientConfig>) -> Vec<u8> {
    let mut conn =
        rustls::ClientConnection::new(tls.clone(), "localhost".try_into().unwrap()).unwrap();
    let mut out = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut out).unwrap();
    }
    out
}
