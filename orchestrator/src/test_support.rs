//! The test-only files of `tests/support/` that the library's own unit tests load too, in
//! one place: the listener as a tenant's uid ([`peercred`]) and the self-signed TLS pair
//! with its trusting client ([`tls_pair`]).

#[path = "../tests/support/peercred.rs"]
pub mod peercred;
#[path = "../tests/support/tls_pair.rs"]
pub mod tls_pair;
