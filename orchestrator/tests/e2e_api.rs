//! End to end over the daemon's real Unix socket: every live response is checked against
//! docs/api/openapi.yaml; a tenant's token cannot read or act on another tenant; malformed
//! specs, duplicate names, unknown fields, oversized bodies and path-like names get clear
//! errors and change nothing. Skips without root or /dev/kvm.

mod support;

use std::time::Duration;

use hyper::Method;
use serde_json::{json, Value};
use tenantvm::client::Client;
use tenantvm::domain::lifecycle::LifecycleState;

use support::daemon::{self, eventually, TestDaemon};
use support::openapi::OpenApi;

async fn call(
    c: &Client,
    spec: &OpenApi,
    method: Method,
    path: &str,
    template: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let (status, bytes) = c
        .raw(
            method.clone(),
            path,
            body.map(|b| serde_json::to_vec(&b).unwrap()),
        )
        .await
        .unwrap();
    let value: Value =
        serde_json::from_slice(&bytes).unwrap_or_else(|_| panic!("non-JSON answer: {bytes:?}"));
    spec.check_response(method.as_str(), template, status.as_u16(), &value)
        .unwrap_or_else(|e| panic!("{method} {path} -> {status}: {e}\n{value:#}"));
    (status.as_u16(), value)
}

fn spec_json(name: &str) -> Value {
    json!({"name": name, "memory_mib": 32, "image": {"name": "idle"}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_scoped_and_bad_requests_change_nothing() {
    if daemon::should_skip("tokens_are_scoped_and_bad_requests_change_nothing") {
        return;
    }
    let spec = OpenApi::load();
    let mut d = TestDaemon::new();
    d.start(None);
    let admin = d.admin();
    let alice = daemon::unique("alice");
    let bob = daemon::unique("bob");

    let (s, created) = call(
        &admin,
        &spec,
        Method::POST,
        "/v1/tenants",
        "/v1/tenants",
        Some(spec_json(&alice)),
    )
    .await;
    assert_eq!(s, 202);
    let alice_token = created["token"].as_str().unwrap().to_string();
    let (s, _) = call(
        &admin,
        &spec,
        Method::POST,
        "/v1/tenants",
        "/v1/tenants",
        Some(spec_json(&bob)),
    )
    .await;
    assert_eq!(s, 202);
    for n in [&alice, &bob] {
        let ok = d
            .reaches(n, LifecycleState::Running, Duration::from_secs(60))
            .await;
        assert!(ok, "{n} did not start:\n{}", d.log());
    }
    let path = format!("/v1/tenants/{alice}");
    let (s, _) = call(
        &admin,
        &spec,
        Method::GET,
        &path,
        "/v1/tenants/{name}",
        None,
    )
    .await;
    assert_eq!(s, 200);
    let (s, _) = call(&admin, &spec, Method::GET, "/v1/health", "/v1/health", None).await;
    assert_eq!(s, 200);

    // A tenant token: its own tenant only; the other answers like a missing one.
    let at = d.client(&alice_token);
    let (s, list) = call(&at, &spec, Method::GET, "/v1/tenants", "/v1/tenants", None).await;
    assert_eq!(s, 200);
    assert_eq!(list["tenants"].as_array().unwrap().len(), 1);
    let (s_other, other) = call(
        &at,
        &spec,
        Method::GET,
        &format!("/v1/tenants/{bob}"),
        "/v1/tenants/{name}",
        None,
    )
    .await;
    let (s_none, none) = call(
        &at,
        &spec,
        Method::GET,
        "/v1/tenants/nobody",
        "/v1/tenants/{name}",
        None,
    )
    .await;
    assert_eq!((s_other, s_none), (404, 404));
    assert_eq!(other["error"]["code"], none["error"]["code"]);
    for (m, p, t) in [
        (
            Method::POST,
            format!("/v1/tenants/{bob}/stop"),
            "/v1/tenants/{name}/stop",
        ),
        (
            Method::DELETE,
            format!("/v1/tenants/{bob}"),
            "/v1/tenants/{name}",
        ),
        (
            Method::GET,
            format!("/v1/tenants/{bob}/logs"),
            "/v1/tenants/{name}/logs",
        ),
    ] {
        let (s, _) = call(&at, &spec, m, &p, t, None).await;
        assert_eq!(s, 404, "{p}");
    }
    let (s, _) = call(
        &at,
        &spec,
        Method::POST,
        "/v1/tenants",
        "/v1/tenants",
        Some(spec_json("eve")),
    )
    .await;
    assert_eq!(s, 403);
    let (s, logs) = call(
        &at,
        &spec,
        Method::GET,
        &format!("/v1/tenants/{alice}/logs?stream=events"),
        "/v1/tenants/{name}/logs",
        None,
    )
    .await;
    assert_eq!(s, 200);
    assert!(logs["text"].as_str().unwrap().contains("running"));
    let bad = d.client("tvm_0000000000000000000000000000000000000000000000000000000000000000");
    let (s, _) = call(&bad, &spec, Method::GET, "/v1/tenants", "/v1/tenants", None).await;
    assert_eq!(s, 401);

    // Bad requests: each a clear error, nothing changed.
    let before = d.store().list_tenants(true).unwrap();
    let mut unknown = spec_json("carol");
    unknown["gpus"] = json!(2);
    let mut huge = spec_json("dave");
    huge["image"]["cmdline"] = json!("x".repeat(70 * 1024));
    let cases = [
        (spec_json(&alice), 409, "name_taken"),
        (spec_json("../x"), 400, "invalid_spec"),
        (spec_json("UPPER"), 400, "invalid_spec"),
        (unknown, 400, "invalid_spec"),
        (json!({"name": "erin"}), 400, "invalid_spec"),
        (
            json!({"name": "frank", "vcpus": "two", "image": {"name": "idle"}}),
            400,
            "invalid_spec",
        ),
        (huge, 413, "body_too_large"),
    ];
    for (body, status, code) in cases {
        let (s, v) = call(
            &admin,
            &spec,
            Method::POST,
            "/v1/tenants",
            "/v1/tenants",
            Some(body.clone()),
        )
        .await;
        assert_eq!(
            (s, v["error"]["code"].as_str().unwrap()),
            (status, code),
            "{body}: {v}"
        );
    }
    let (s, _) = call(
        &admin,
        &spec,
        Method::GET,
        "/v1/tenants/..%2F..%2Fetc",
        "/v1/tenants/{name}",
        None,
    )
    .await;
    assert_eq!(s, 404);
    let after = d.store().list_tenants(true).unwrap();
    assert_eq!(before, after, "a refused request changed the store");

    for n in [&alice, &bob] {
        admin.destroy(n).await.unwrap();
    }
    let ok = eventually(Duration::from_secs(60), || {
        let admin = admin.clone();
        async move { admin.list().await.is_ok_and(|l| l.tenants.is_empty()) }
    })
    .await;
    assert!(ok);
    // Destroy revoked alice's token.
    let (s, _) = call(&at, &spec, Method::GET, "/v1/tenants", "/v1/tenants", None).await;
    assert_eq!(s, 401);
    d.stop();
}
