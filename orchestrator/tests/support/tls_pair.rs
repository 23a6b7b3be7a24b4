//! A self-signed `localhost` certificate and key written as PEM files (for `--tls-cert` and
//! `--tls-key`, or `frontdoor::tls_config`), and a rustls client that trusts that certificate
//! and nothing else. Standalone, so that the library's own tests and the benchmarks load it
//! by path too.

use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The files of a fresh pair and a client that trusts it.
pub struct TlsPair {
    /// The certificate (PEM).
    pub cert_pem: PathBuf,
    /// Its private key (PEM).
    pub key_pem: PathBuf,
    /// A client that trusts the certificate and nothing else.
    pub client: Arc<rustls::ClientConfig>,
}

impl TlsPair {
    /// Generates a pair for `localhost` and writes it to `dir` as `c.pem` and `k.pem`.
    pub fn write(dir: &Path) -> TlsPair {
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let (cert_pem, key_pem) = (dir.join("c.pem"), dir.join("k.pem"));
        std::fs::write(&cert_pem, cert.cert.pem()).unwrap();
        std::fs::write(&key_pem, cert.key_pair.serialize_pem()).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert.cert.der().clone()).unwrap();
        let client = Arc::new(
            rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth(),
        );
        TlsPair {
            cert_pem,
            key_pem,
            client,
        }
    }
}
