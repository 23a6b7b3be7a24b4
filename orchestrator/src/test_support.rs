//! The test-only files of `tests/support/` that the library's own unit tests load too, in
//! one place: the listener as a tenant's uid ([`peercred`]) and the self-signed TLS pair
//! with its trusting client ([`tls_pair`]), and a hostile flood of connections ([`flood`]).

#[path = "../tests/support/flood.rs"]
pub mod flood;
#[path = "../tests/support/peercred.rs"]
pub mod peercred;
#[path = "../tests/support/tls_pair.rs"]
pub mod tls_pair;
