//! The front door against a live server: a real TLS listener on a TCP port, clients that
//! speak HTTP/1.1 over rustls as an OpenAI client would, and tenants on the fake host whose
//! guest agents are served by this test over hybrid-vsock sockets (listened on as each
//! tenant's uid, which the daemon's peer check wants: needs root).
//!
//! Shared pieces: [`guests`] (the fake guest agents) and [`door`] (the running front door and
//! its test client). The tests, by topic: [`routes`], [`keys`], [`quotas`], [`hostile`],
//! [`flood`], [`privacy`], [`tls`].

mod door;
mod guests;

mod flood;
mod hostile;
mod keys;
mod privacy;
mod quotas;
mod routes;
mod tls;
