//! Inference keys: created, listed and revoked through the daemon's API by their own tenant
//! only, and all revoked (with a receipt line) at departure.

use std::collections::HashMap;

use serde_json::Value;

use crate::auth::Caller;
use crate::domain::spec::TenantSpec;
use crate::tenant::fault::FaultHook;
use crate::tenant::service::TenantCommand;
use crate::tenant::test_utils::Harness;

#[test]
fn keys_are_managed_through_the_api_by_their_tenant_and_revoked_at_departure() {
    use axum::body::Body;
    use tower::ServiceExt;
    let h = Harness::new(FaultHook::default());
    let admin = h.admin_token();
    let rt = crate::daemon::runtime().unwrap();
    let app = crate::api::router(h.svc.clone());
    let call = |method: &str, uri: &str, token: &str| -> (u16, Value) {
        let req = axum::http::Request::builder()
            .method(method)
            .uri(uri)
            .header("authorization", format!("Bearer {token}"));
        let body = if method == "POST" {
            req.header("content-type", "application/json")
                .body(Body::from("{}"))
        } else {
            req.body(Body::empty())
        }
        .unwrap();
        rt.block_on(async {
            let resp = app.clone().oneshot(body).await.unwrap();
            let status = resp.status().as_u16();
            let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
                .await
                .unwrap();
            (
                status,
                serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            )
        })
    };
    let mut tokens = HashMap::new();
    for name in ["alice", "bob"] {
        let spec =
            TenantSpec::from_toml(&format!("name = \"{name}\"\n[image]\nname = \"hello\"\n"))
                .unwrap();
        match h
            .svc
            .execute(&Caller::Admin, TenantCommand::Create(spec))
            .unwrap()
        {
            crate::tenant::service::CommandOutcome::Created(c) => tokens.insert(name, c.token),
            other => panic!("{other:?}"),
        };
    }
    h.svc.wait_idle();
    // alice's own token makes a key; the key resolves to alice at the front door.
    let (s, made) = call("POST", "/v1/tenants/alice/keys", &tokens["alice"]);
    assert_eq!(s, 201, "{made}");
    let key = made["key"].as_str().unwrap().to_string();
    assert!(key.starts_with(crate::auth::inference_key::KEY_PREFIX));
    let bearer = format!("Bearer {key}");
    assert_eq!(
        crate::frontdoor::keys::authenticate(h.svc.store(), Some(&bearer))
            .unwrap()
            .name
            .as_str(),
        "alice"
    );
    // The admin makes a second one; the list shows both by id and first characters only.
    let (s, _) = call("POST", "/v1/tenants/alice/keys", &admin);
    assert_eq!(s, 201);
    let (s, list) = call("GET", "/v1/tenants/alice/keys", &tokens["alice"]);
    assert_eq!(s, 200);
    assert_eq!(list["keys"].as_array().unwrap().len(), 2);
    assert!(
        !list.to_string().contains(&key),
        "a listed key must not be the key"
    );
    // bob cannot see, make or revoke alice's keys: the same 404 as a tenant that is not there.
    for (m, uri) in [
        ("GET", "/v1/tenants/alice/keys"),
        ("POST", "/v1/tenants/alice/keys"),
        ("DELETE", "/v1/tenants/alice/keys/1"),
    ] {
        let (s, v) = call(m, uri, &tokens["bob"]);
        assert_eq!(s, 404, "{m} {uri}: {v}");
    }
    // An inference key is no API token: it cannot stop or destroy its tenant.
    let (s, _) = call("POST", "/v1/tenants/alice/stop", &key);
    assert_eq!(s, 401);
    let (s, _) = call("DELETE", "/v1/tenants/alice", &key);
    assert_eq!(s, 401);
    // Revoking a key that is not live is a clear 404; revoking one works once.
    let id = made["id"].as_i64().unwrap();
    assert_eq!(
        call("DELETE", "/v1/tenants/alice/keys/999", &tokens["alice"]).0,
        404
    );
    assert_eq!(
        call(
            "DELETE",
            &format!("/v1/tenants/alice/keys/{id}"),
            &tokens["alice"]
        )
        .0,
        200
    );
    assert_eq!(
        call(
            "DELETE",
            &format!("/v1/tenants/alice/keys/{id}"),
            &tokens["alice"]
        )
        .0,
        404
    );
    crate::frontdoor::keys::authenticate(h.svc.store(), Some(&bearer)).unwrap_err();

    // Departure revokes the rest, and the receipt says so.
    let (_, third) = call("POST", "/v1/tenants/alice/keys", &admin);
    let third = format!("Bearer {}", third["key"].as_str().unwrap());
    let alice_id = h.svc.store().tenant("alice").unwrap().unwrap().id;
    h.svc
        .execute(&Caller::Admin, TenantCommand::Destroy("alice".into()))
        .unwrap();
    h.svc.wait_idle();
    crate::frontdoor::keys::authenticate(h.svc.store(), Some(&third)).unwrap_err();
    assert_eq!(h.svc.store().live_inference_keys(alice_id).unwrap(), 0);
    let route_off = h.departure_step("alice", crate::receipt::DepartureStep::GatewayRouteOff);
    let shown = serde_json::to_string(&route_off).unwrap();
    assert!(
        shown.contains("2 inference key(s) revoked, none left live"),
        "{shown}"
    );
}

#[test]
fn keys_are_checked_without_waiting_behind_a_long_store_write() {
    use std::time::{Duration, Instant};
    let Some(d) = super::door::door(&[("alice", "requests_per_s = 1000")]) else {
        return;
    };
    // A known key, remembered by the door's cache before the write begins.
    assert_eq!(
        d.send("GET", "/v1/models", Some(&d.keys["alice"]), None)
            .status,
        200
    );
    let (release, released) = std::sync::mpsc::channel::<()>();
    let (held_tx, held) = std::sync::mpsc::channel::<()>();
    let svc = d.h.svc.clone();
    let writer = std::thread::spawn(move || {
        svc.store().while_locked(|| {
            held_tx.send(()).unwrap();
            // As a write of a large receipt row would, for up to 10 s.
            let _ = released.recv_timeout(Duration::from_secs(10));
        });
    });
    held.recv().unwrap();
    // Known keys' requests in flight meanwhile (each may wait for the store later, on a
    // thread of its own).
    let waiting: Vec<_> = (0..3)
        .map(|_| {
            let to = (d.addr, d.client.clone(), d.keys["alice"].clone());
            std::thread::spawn(move || {
                super::door::Door::detached(to).status_of(
                    "/v1/completions",
                    r#"{"model": "alice-model", "prompt": "x"}"#,
                )
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    // An unknown key is looked up and refused while the write holds the store.
    let asked = Instant::now();
    let unknown = format!("tvk-{}", "0".repeat(64));
    let status = d.send("GET", "/v1/models", Some(&unknown), None).status;
    let took = asked.elapsed();
    let _ = release.send(());
    writer.join().unwrap();
    assert_eq!(status, 401);
    assert!(
        took < Duration::from_secs(5),
        "the key was checked only after the store's write ended ({took:?})"
    );
    for w in waiting {
        assert_eq!(w.join().unwrap(), 200);
    }
}
