//! The front door of a real tenantvmd (`--listen` with TLS) and the `tenantvm key` commands:
//! keys made, listed and revoked through the CLI, used over HTTPS, refused once revoked,
//! revoked at departure with the receipt saying so; TLS required; inference keys are no
//! API tokens. The tenant boots the idle guest (no inference server), so the front door's
//! answer past the key check is its clear 400. Skips without root or /dev/kvm.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use support::cli::{tenantvm, text};
use support::daemon::{self, TestDaemon};
use support::tls::FrontDoorTls;

/// One HTTPS `GET` with `key`; the status and the JSON body.
fn get(door: &FrontDoorTls, path: &str, key: Option<&str>) -> (u16, serde_json::Value) {
    let (status, body) = door.request(path, key, None, Duration::from_secs(30));
    (status, serde_json::from_slice(&body).unwrap())
}

#[test]
fn keys_from_the_cli_open_the_tls_front_door_until_revoked_or_departed() {
    if daemon::should_skip("keys_from_the_cli_open_the_tls_front_door_until_revoked_or_departed") {
        return;
    }
    let door = FrontDoorTls::new();
    let addr = door.addr;
    let mut d = TestDaemon::new().with_front_door(&door);
    d.start(None);

    let admin = d.admin_token_file();
    let name = daemon::unique("door");
    let tok = d.dir.path().join("t.token");
    let o = tenantvm(
        &d,
        &admin,
        &[
            "create",
            "--name",
            &name,
            "--image",
            "idle",
            "--memory-mib",
            "32",
            "--token-out",
            tok.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));

    // The tenant's own token makes a key, printed once on stdout.
    let o = tenantvm(&d, &tok, &["key", "create", &name]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let key = String::from_utf8(o.stdout.clone())
        .unwrap()
        .trim()
        .to_string();
    assert!(key.starts_with("tvk-"), "{key}");
    let o = tenantvm(&d, &admin, &["key", "list", &name, "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(!text(&o).contains(&key), "the list shows the key itself");
    let listed: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let id = listed["keys"][0]["id"].as_i64().unwrap().to_string();

    // Over TLS: the key passes (the idle guest has no inference server: a clear 400 in
    // OpenAI's shape); no key, and the key as an API token, are refused.
    let (s, v) = get(&door, "/v1/models", Some(&key));
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let (s, v) = get(&door, "/v1/models", None);
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (401, Some("invalid_api_key"))
    );
    let key_file = d.dir.path().join("key.token");
    std::fs::write(&key_file, &key).unwrap();
    let o = tenantvm(&d, &key_file, &["stop", &name]);
    assert_eq!(
        o.status.code(),
        Some(4),
        "an inference key stopped its tenant: {}",
        text(&o)
    );
    // TLS is required.
    let mut plain = TcpStream::connect(addr).unwrap();
    plain
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    plain
        .write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut got = Vec::new();
    let _ = plain.read_to_end(&mut got);
    assert!(!got.starts_with(b"HTTP/"), "plain HTTP was answered");

    // `tenantvm top`: the admin sees the tenant's row with its VM's memory from the cgroup;
    // the tenant's own token sees its row too.
    for token in [&admin, &tok] {
        let o = tenantvm(&d, token, &["top", "--once"]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        let row = out
            .lines()
            .find(|l| l.starts_with(name.as_str()))
            .unwrap_or_else(|| panic!("no row for {name}: {out}"));
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cols[1], "1", "one request answered (the 400): {out}");
        let mem: f64 = cols[10].parse().unwrap();
        assert!(
            mem > 0.0,
            "the VM's memory was not read from its cgroup: {out}"
        );
    }

    // Revoked: refused at once; revoking again, or another tenant's, is "not found" (5).
    let o = tenantvm(&d, &tok, &["key", "revoke", &name, &id]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(get(&door, "/v1/models", Some(&key)).0, 401);
    let o = tenantvm(&d, &tok, &["key", "revoke", &name, &id]);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o));
    let o = tenantvm(&d, &admin, &["key", "create", "nobody"]);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o));

    // Departure revokes the keys left and says so in the receipt.
    let o = tenantvm(&d, &admin, &["key", "create", &name]);
    let second = String::from_utf8(o.stdout.clone())
        .unwrap()
        .trim()
        .to_string();
    assert_eq!(get(&door, "/v1/models", Some(&second)).0, 400);
    let o = tenantvm(&d, &admin, &["destroy", &name]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(get(&door, "/v1/models", Some(&second)).0, 401);
    let o = tenantvm(&d, &admin, &["receipt", "show", &name, "--json"]);
    assert!(
        text(&o).contains("1 inference key(s) revoked, none left live"),
        "{}",
        text(&o)
    );
    d.stop();
}
