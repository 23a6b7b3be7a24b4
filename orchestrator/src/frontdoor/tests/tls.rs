//! The TLS set-up: a bad, missing or swapped certificate or key is a clear error at start.

#[test]
fn a_bad_certificate_or_key_is_a_clear_error_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let pair = crate::test_support::tls_pair::TlsPair::write(dir.path());
    let (good_cert, good_key) = (pair.cert_pem, pair.key_pem);
    crate::frontdoor::tls_config(&good_cert, &good_key).unwrap();
    let empty = dir.path().join("empty.pem");
    std::fs::write(&empty, "").unwrap();
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a pem file\n").unwrap();
    let missing = dir.path().join("missing.pem");
    for (c, k, what) in [
        (&missing, &good_key, "certificate"),
        (&empty, &good_key, "certificate"),
        (&good_cert, &garbage, "key"),
        (&good_cert, &missing, "key"),
        // A certificate given as the key.
        (&good_cert, &good_cert, "key"),
    ] {
        let e = crate::frontdoor::tls_config(c, k).unwrap_err().to_string();
        assert!(e.contains(what) && e.contains("openssl req"), "{e}");
    }
}
