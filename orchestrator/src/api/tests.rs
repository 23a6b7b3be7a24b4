//! API tests: requests through the real router (no socket) over the fake host, every
//! response checked against docs/api/openapi.yaml.

#[path = "../../tests/support/openapi.rs"]
pub(super) mod openapi;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::{json, Value};
use tower::ServiceExt;

use super::*;
use crate::tenant::fault::FaultHook;
use crate::tenant::test_utils::Harness;
use openapi::OpenApi;

struct Api {
    h: Harness,
    admin: String,
    spec: OpenApi,
}

impl Api {
    fn new() -> Api {
        let h = Harness::new(FaultHook::default());
        let admin = h.admin_token();
        Api {
            h,
            admin,
            spec: OpenApi::load(),
        }
    }

    async fn call(
        &self,
        method: &str,
        uri: &str,
        token: Option<&str>,
        body: Option<String>,
    ) -> (StatusCode, Value) {
        let (status, _, value) = self.call_with_headers(method, uri, token, body).await;
        (status, value)
    }

    async fn call_with_headers(
        &self,
        method: &str,
        uri: &str,
        token: Option<&str>,
        body: Option<String>,
    ) -> (StatusCode, axum::http::HeaderMap, Value) {
        let mut req = Request::builder().method(method).uri(uri);
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let req = match body {
            Some(b) => req
                .header("content-type", "application/json")
                .body(Body::from(b)),
            None => req.body(Body::empty()),
        }
        .unwrap();
        let resp = router(self.h.svc.clone()).oneshot(req).await.unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        let value: Value = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| panic!("non-JSON body for {method} {uri}: {bytes:?}"));
        (status, headers, value)
    }

    /// Calls and checks the response against the spec.
    async fn checked(
        &self,
        method: &str,
        uri: &str,
        template: &str,
        token: Option<&str>,
        body: Option<String>,
    ) -> (StatusCode, Value) {
        let (status, value) = self.call(method, uri, token, body).await;
        self.spec
            .check_response(method, template, status.as_u16(), &value)
            .unwrap_or_else(|e| panic!("{method} {uri} -> {status}: {e}\n{value:#}"));
        (status, value)
    }

    async fn idle(&self) {
        let svc = self.h.svc.clone();
        tokio::task::spawn_blocking(move || svc.wait_idle())
            .await
            .unwrap();
    }

    fn tenant_count(&self) -> usize {
        self.h.svc.store().list_tenants(true).unwrap().len()
    }
}

fn spec_json(name: &str) -> String {
    json!({"name": name, "vcpus": 1, "memory_mib": 64, "image": {"name": "hello"}}).to_string()
}

#[tokio::test]
async fn a_body_is_looked_at_only_after_the_token() {
    let api = Api::new();
    // Without a good token, a bad body gets 401 like a good one (it was 400: parsed first).
    for (uri, body) in [
        ("/v1/tenants", "not json".to_string()),
        ("/v1/tenants", spec_json("nobody")),
        ("/v1/tenants/nobody/infer", "not json".to_string()),
        ("/v1/tenants/nobody/payload/restart", "not json".to_string()),
        ("/v1/gpu/quarantine/scrub", "{}".to_string()),
    ] {
        for token in [None, Some("wrong")] {
            let (status, v) = api.call("POST", uri, token, Some(body.clone())).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{uri} {body}: {v}");
        }
    }
    // The control: with the admin token the bad body is what is refused.
    let (status, v) = api
        .call(
            "POST",
            "/v1/tenants",
            Some(&api.admin),
            Some("not json".into()),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(api.tenant_count(), 0);
    // A payload restart's wait is an integer, and 3.0 is one (JSON Schema's `integer`):
    // the admin gets past the body to the unknown tenant; a fraction is still refused.
    let restart = "/v1/tenants/nobody/payload/restart";
    let (status, v) = api
        .call(
            "POST",
            restart,
            Some(&api.admin),
            Some(r#"{"wait_s": 3.0}"#.into()),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    let (status, v) = api
        .call(
            "POST",
            restart,
            Some(&api.admin),
            Some(r#"{"wait_s": 3.5}"#.into()),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
}

#[tokio::test]
async fn lifecycle_responses_match_the_spec() {
    let api = Api::new();
    let admin = api.admin.clone();
    let a = Some(admin.as_str());
    let (s, _) = api
        .checked("GET", "/v1/health", "/v1/health", a, None)
        .await;
    assert_eq!(s, StatusCode::OK);
    let (s, created) = api
        .checked(
            "POST",
            "/v1/tenants",
            "/v1/tenants",
            a,
            Some(spec_json("alice")),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    assert!(created["token"].as_str().unwrap().starts_with("tvm_"));
    api.idle().await;
    let (s, t) = api
        .checked("GET", "/v1/tenants/alice", "/v1/tenants/{name}", a, None)
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(t["state"], "running");
    assert_eq!(
        t["steps"].as_array().unwrap().len(),
        crate::tenant::steps::Op::Create.steps().len()
    );
    let (_, list) = api
        .checked("GET", "/v1/tenants", "/v1/tenants", a, None)
        .await;
    assert_eq!(list["tenants"].as_array().unwrap().len(), 1);
    for stream in ["serial", "vmm", "events"] {
        let uri = format!("/v1/tenants/alice/logs?stream={stream}");
        let (s, chunk) = api
            .checked("GET", &uri, "/v1/tenants/{name}/logs", a, None)
            .await;
        assert_eq!(s, StatusCode::OK, "{chunk}");
    }
    let (_, ev) = api
        .checked(
            "GET",
            "/v1/tenants/alice/logs?stream=events&offset=0",
            "/v1/tenants/{name}/logs",
            a,
            None,
        )
        .await;
    assert!(ev["text"]
        .as_str()
        .unwrap()
        .contains("provisioning -> running"));
    let (s, _) = api
        .checked(
            "POST",
            "/v1/tenants/alice/stop",
            "/v1/tenants/{name}/stop",
            a,
            None,
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    api.idle().await;
    let (s, _) = api
        .checked(
            "POST",
            "/v1/tenants/alice/start",
            "/v1/tenants/{name}/start",
            a,
            None,
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    api.idle().await;
    let (s, _) = api
        .checked("DELETE", "/v1/tenants/alice", "/v1/tenants/{name}", a, None)
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    api.idle().await;
    let (s, _) = api
        .checked("GET", "/v1/tenants/alice", "/v1/tenants/{name}", a, None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn tokens_are_required_and_scoped_to_their_tenant() {
    let api = Api::new();
    let admin = api.admin.clone();
    let a = Some(admin.as_str());
    let (_, alice) = api
        .checked(
            "POST",
            "/v1/tenants",
            "/v1/tenants",
            a,
            Some(spec_json("alice")),
        )
        .await;
    api.checked(
        "POST",
        "/v1/tenants",
        "/v1/tenants",
        a,
        Some(spec_json("bob")),
    )
    .await;
    api.idle().await;
    let alice_token = alice["token"].as_str().unwrap().to_string();
    let at = Some(alice_token.as_str());

    let (s, _) = api
        .checked("GET", "/v1/tenants", "/v1/tenants", None, None)
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let forged = auth::new_token();
    let (s, _) = api
        .checked("GET", "/v1/tenants", "/v1/tenants", Some(&forged), None)
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);

    // Another tenant's existing name and a name that exists nowhere answer the same.
    let (s1, bob) = api
        .checked("GET", "/v1/tenants/bob", "/v1/tenants/{name}", at, None)
        .await;
    let (s2, ghost) = api
        .checked("GET", "/v1/tenants/ghost", "/v1/tenants/{name}", at, None)
        .await;
    assert_eq!((s1, s2), (StatusCode::NOT_FOUND, StatusCode::NOT_FOUND));
    assert_eq!(
        bob["error"]["message"]
            .as_str()
            .unwrap()
            .replace("bob", "X"),
        ghost["error"]["message"]
            .as_str()
            .unwrap()
            .replace("ghost", "X")
    );
    for (m, uri, tpl) in [
        ("POST", "/v1/tenants/bob/stop", "/v1/tenants/{name}/stop"),
        ("DELETE", "/v1/tenants/bob", "/v1/tenants/{name}"),
        ("GET", "/v1/tenants/bob/logs", "/v1/tenants/{name}/logs"),
    ] {
        let (s, _) = api.checked(m, uri, tpl, at, None).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{m} {uri}");
    }
    let (s, _) = api
        .checked(
            "POST",
            "/v1/tenants",
            "/v1/tenants",
            at,
            Some(spec_json("eve")),
        )
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (_, list) = api
        .checked("GET", "/v1/tenants", "/v1/tenants", at, None)
        .await;
    assert_eq!(list["tenants"].as_array().unwrap().len(), 1);
    assert_eq!(
        api.h
            .svc
            .store()
            .tenant("bob")
            .unwrap()
            .unwrap()
            .state
            .as_str(),
        "running"
    );

    // Destroy revokes the tenant's token.
    api.checked(
        "DELETE",
        "/v1/tenants/alice",
        "/v1/tenants/{name}",
        at,
        None,
    )
    .await;
    api.idle().await;
    let (s, _) = api
        .checked("GET", "/v1/tenants", "/v1/tenants", at, None)
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn bad_requests_get_clear_errors_and_change_nothing() {
    let api = Api::new();
    let admin = api.admin.clone();
    let a = Some(admin.as_str());
    api.checked(
        "POST",
        "/v1/tenants",
        "/v1/tenants",
        a,
        Some(spec_json("alice")),
    )
    .await;
    api.idle().await;
    let before = api.tenant_count();
    let huge =
        json!({"name": "big", "image": {"name": "hello", "cmdline": "x".repeat(MAX_BODY_BYTES)}})
            .to_string();
    let cases: Vec<(String, StatusCode, &str, &str)> = vec![
        (
            spec_json("alice"),
            StatusCode::CONFLICT,
            "name_taken",
            "already exists",
        ),
        (
            spec_json("../x"),
            StatusCode::BAD_REQUEST,
            "invalid_spec",
            "Invalid tenant name",
        ),
        (
            spec_json("Alice"),
            StatusCode::BAD_REQUEST,
            "invalid_spec",
            "Invalid tenant name",
        ),
        (
            json!({"name": "a2", "image": {"name": "hello"}, "colour": "red"}).to_string(),
            StatusCode::BAD_REQUEST,
            "invalid_spec",
            "unknown field `colour`",
        ),
        (
            "{\"name\": ".into(),
            StatusCode::BAD_REQUEST,
            "invalid_spec",
            "not valid JSON",
        ),
        (
            json!({"name": "a3", "vcpus": 0, "image": {"name": "hello"}}).to_string(),
            StatusCode::BAD_REQUEST,
            "invalid_spec",
            "vcpus",
        ),
        (
            json!({"name": "a4", "image": {"name": "missing"}}).to_string(),
            StatusCode::BAD_REQUEST,
            "invalid_image",
            "does not exist",
        ),
        (
            huge,
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            "larger than",
        ),
    ];
    for (body, status, code, text) in cases {
        let (s, v) = api
            .checked("POST", "/v1/tenants", "/v1/tenants", a, Some(body))
            .await;
        assert_eq!(s, status, "{v}");
        assert_eq!(v["error"]["code"], code, "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(text), "{msg:?} lacks {text:?}");
        assert!(msg.chars().next().unwrap().is_uppercase(), "{msg}");
    }
    // Path-like names in the URL never reach the store.
    let (s, _) = api
        .checked("GET", "/v1/tenants/..%2Fetc", "/v1/tenants/{name}", a, None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, v) = api
        .checked(
            "POST",
            "/v1/tenants/alice/start",
            "/v1/tenants/{name}/start",
            a,
            None,
        )
        .await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("invalid_state"))
    );
    let (s, _) = api
        .checked(
            "GET",
            "/v1/tenants/alice/logs?stream=nope",
            "/v1/tenants/{name}/logs",
            a,
            None,
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(api.tenant_count(), before);
    assert_eq!(
        api.h
            .svc
            .store()
            .tenant("alice")
            .unwrap()
            .unwrap()
            .state
            .as_str(),
        "running"
    );
}

#[tokio::test]
async fn the_checker_rejects_bodies_that_break_the_spec() {
    let spec = OpenApi::load();
    let good = json!({"status": "ok", "version": "1", "backend": "x", "recovering": false});
    spec.check_response("GET", "/v1/health", 200, &good)
        .unwrap();
    let extra =
        json!({"status": "ok", "version": "1", "backend": "x", "recovering": false, "debug": true});
    assert!(spec
        .check_response("GET", "/v1/health", 200, &extra)
        .is_err());
    let missing = json!({"status": "ok"});
    assert!(spec
        .check_response("GET", "/v1/health", 200, &missing)
        .is_err());
    let wrong = json!({"error": {"code": "teapot", "message": "x"}});
    assert!(spec
        .check_response("GET", "/v1/tenants", 401, &wrong)
        .is_err());
}

#[tokio::test]
async fn departure_endpoints_match_the_spec_and_are_scoped() {
    let api = Api::new();
    let a = Some(api.admin.as_str());
    let (s, created) = api
        .checked(
            "POST",
            "/v1/tenants",
            "/v1/tenants",
            a,
            Some(spec_json("dep")),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let tenant_token = created["token"].as_str().unwrap().to_string();
    api.idle().await;
    let (s, _) = api
        .checked("DELETE", "/v1/tenants/dep", "/v1/tenants/{name}", a, None)
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    api.idle().await;

    let (s, list) = api
        .checked("GET", "/v1/receipts", "/v1/receipts", a, None)
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(list["receipts"].as_array().unwrap().len(), 1);
    let (s, list) = api
        .checked("GET", "/v1/receipts?tenant=nobody", "/v1/receipts", a, None)
        .await;
    assert_eq!(s, StatusCode::OK);
    assert!(list["receipts"].as_array().unwrap().is_empty());
    // The departed tenant's revoked token reads its own receipt, and nothing else.
    let t = Some(tenant_token.as_str());
    let (s, list) = api
        .checked("GET", "/v1/receipts", "/v1/receipts", t, None)
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(list["receipts"][0]["receipt"]["tenant"], "dep");
    let (s, _) = api
        .checked("GET", "/v1/tenants", "/v1/tenants", t, None)
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = api
        .checked("GET", "/v1/gpu/quarantine", "/v1/gpu/quarantine", t, None)
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);

    let (s, q) = api
        .checked("GET", "/v1/gpu/quarantine", "/v1/gpu/quarantine", a, None)
        .await;
    assert_eq!(s, StatusCode::OK);
    assert!(q["slices"].as_array().unwrap().is_empty());
    let (s, e) = api
        .checked(
            "POST",
            "/v1/gpu/quarantine/scrub",
            "/v1/gpu/quarantine/scrub",
            a,
            Some(json!({"slice": "0/none"}).to_string()),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{e}");
    let (s, _) = api
        .checked(
            "POST",
            "/v1/gpu/quarantine/scrub",
            "/v1/gpu/quarantine/scrub",
            a,
            Some("{\"nope\": 1}".to_string()),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn infer_answers_match_the_spec_and_are_scoped() {
    let api = Api::new();
    let admin = api.admin.clone();
    let a = Some(admin.as_str());
    let (_, created) = api
        .checked(
            "POST",
            "/v1/tenants",
            "/v1/tenants",
            a,
            Some(spec_json("alice")),
        )
        .await;
    let alice = created["token"].as_str().unwrap().to_string();
    api.idle().await;
    let t = "/v1/tenants/{name}/infer";
    let body = Some(json!({"prompt": "hello", "max_tokens": 4}).to_string());
    // No token, or another tenant's name: refused before anything reaches a guest.
    let (s, _) = api
        .checked("POST", "/v1/tenants/alice/infer", t, None, body.clone())
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = api
        .checked(
            "POST",
            "/v1/tenants/bob/infer",
            t,
            Some(&alice),
            body.clone(),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    // Not JSON, too large: clear errors.
    let (s, e) = api
        .checked(
            "POST",
            "/v1/tenants/alice/infer",
            t,
            Some(&alice),
            Some("prompt=hi".into()),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(e["error"]["message"]
        .as_str()
        .unwrap()
        .contains("not valid JSON"));
    // Larger than any tenant's quotas.max_request_bytes may be: refused as it is read.
    let huge = json!({ "prompt": "x".repeat(INFER_BODY_LIMIT + 1) }).to_string();
    let (s, _) = api
        .checked(
            "POST",
            "/v1/tenants/alice/infer",
            t,
            Some(&alice),
            Some(huge),
        )
        .await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    // Over alice's own limit (the default, 1 MiB, as at the front door): 413 naming it.
    let limit = crate::domain::spec::DEFAULT_MAX_REQUEST_BYTES as usize;
    let big = json!({ "prompt": "x".repeat(limit) });
    let (s, e) = api
        .checked(
            "POST",
            "/v1/tenants/alice/infer",
            t,
            Some(&alice),
            Some(big.to_string()),
        )
        .await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(e["error"]["code"], "body_too_large");
    let message = e["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("max_request_bytes is {limit}")),
        "{e}"
    );
    assert!(!message.contains("xxxx"), "the body is never quoted: {e}");
    // Far over the 16 KiB this route once cut requests at, within the limit: it goes on
    // to the guest (which here runs no agent, the 400 below).
    let long = json!({ "prompt": "x".repeat(256 * 1024) });
    let (s, e) = api
        .checked(
            "POST",
            "/v1/tenants/alice/infer",
            t,
            Some(&alice),
            Some(long.to_string()),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("does not run a guest image"),
        "{e}"
    );
    // A tenant with a smaller quota is held to it.
    let small = json!({"name": "small", "vcpus": 1, "memory_mib": 64,
        "image": {"name": "hello"}, "quotas": {"max_request_bytes": 4096}});
    let (_, created) = api
        .checked(
            "POST",
            "/v1/tenants",
            "/v1/tenants",
            a,
            Some(small.to_string()),
        )
        .await;
    api.idle().await;
    let small_token = created["token"].as_str().unwrap().to_string();
    let five_k = json!({ "prompt": "x".repeat(5000) }).to_string();
    let (s, e) = api
        .checked(
            "POST",
            "/v1/tenants/small/infer",
            t,
            Some(&small_token),
            Some(five_k),
        )
        .await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(
        e["error"]["message"].as_str().unwrap().contains("is 4096"),
        "{e}"
    );
    // The idle test guest runs no agent: a 400 that says so.
    let (s, e) = api
        .checked("POST", "/v1/tenants/alice/infer", t, Some(&alice), body)
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("does not run a guest image"),
        "{e}"
    );
}

#[tokio::test]
async fn infer_is_held_to_each_tenants_request_rate() {
    let api = Api::new();
    let admin = api.admin.clone();
    let a = Some(admin.as_str());
    let mut tokens = Vec::new();
    for name in ["carol", "dave"] {
        let spec = json!({"name": name, "vcpus": 1, "memory_mib": 64,
                          "image": {"name": "hello"},
                          "quotas": {"requests_per_s": 2, "max_concurrency": 1}});
        let (s, created) = api
            .checked(
                "POST",
                "/v1/tenants",
                "/v1/tenants",
                a,
                Some(spec.to_string()),
            )
            .await;
        assert_eq!(s, StatusCode::ACCEPTED, "{created}");
        tokens.push(created["token"].as_str().unwrap().to_string());
    }
    api.idle().await;
    let t = "/v1/tenants/{name}/infer";
    let body = json!({"prompt": "hello", "max_tokens": 4}).to_string();
    // Two requests a second: both admitted (and then refused further on, since the test
    // guest runs no inference server), the third is over the rate.
    for _ in 0..2 {
        let (s, _) = api
            .checked(
                "POST",
                "/v1/tenants/carol/infer",
                t,
                Some(&tokens[0]),
                Some(body.clone()),
            )
            .await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
    }
    let (s, headers, e) = api
        .call_with_headers(
            "POST",
            "/v1/tenants/carol/infer",
            Some(&tokens[0]),
            Some(body.clone()),
        )
        .await;
    api.spec
        .check_response("POST", t, s.as_u16(), &e)
        .unwrap_or_else(|err| panic!("429 does not match the spec: {err}\n{e:#}"));
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{e}");
    assert_eq!(e["error"]["code"], "rate_limited", "{e}");
    let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=1).contains(&retry), "Retry-After {retry}");
    // Carol's spent budget is hers alone: Dave is admitted.
    let (s, _) = api
        .checked(
            "POST",
            "/v1/tenants/dave/infer",
            t,
            Some(&tokens[1]),
            Some(body),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn test_loads_are_for_the_admin_only_and_bad_loads_are_refused() {
    let api = Api::new();
    let admin = api.admin.clone();
    let a = Some(admin.as_str());
    let (_, alice) = api
        .checked(
            "POST",
            "/v1/tenants",
            "/v1/tenants",
            a,
            Some(spec_json("alice")),
        )
        .await;
    api.idle().await;
    let alice_token = alice["token"].as_str().unwrap().to_string();
    let load = json!({"kind": "memory", "amount": 64, "seconds": 5}).to_string();
    // A tenant's token, even for itself: 403, and nothing reaches the guest.
    let (s, body) = api
        .checked(
            "POST",
            "/v1/tenants/alice/load",
            "/v1/tenants/{name}/load",
            Some(&alice_token),
            Some(load.clone()),
        )
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{body}");
    let (s, _) = api
        .checked(
            "GET",
            "/v1/tenants/alice/load/memory",
            "/v1/tenants/{name}/load/{kind}",
            Some(&alice_token),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (s, _) = api
        .checked(
            "POST",
            "/v1/tenants/alice/load",
            "/v1/tenants/{name}/load",
            None,
            Some(load.clone()),
        )
        .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    // Out of the caps, an unknown kind, an unknown field: 400 before any guest is asked.
    for bad in [
        json!({"kind": "memory", "amount": 0, "seconds": 5}),
        json!({"kind": "cpu", "amount": 65, "seconds": 5}),
        json!({"kind": "disk", "amount": 8, "seconds": 121}),
        json!({"kind": "gpu", "amount": 1, "seconds": 1}),
        json!({"kind": "cpu", "amount": 1, "seconds": 1, "shell": "rm -rf /"}),
    ] {
        let (s, body) = api
            .checked(
                "POST",
                "/v1/tenants/alice/load",
                "/v1/tenants/{name}/load",
                a,
                Some(bad.to_string()),
            )
            .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}: {body}");
    }
    let (s, _) = api
        .checked(
            "GET",
            "/v1/tenants/alice/load/gpu",
            "/v1/tenants/{name}/load/{kind}",
            a,
            None,
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    // The admin on a tenant without an inference guest: 409, not a load.
    let (s, body) = api
        .checked(
            "POST",
            "/v1/tenants/alice/load",
            "/v1/tenants/{name}/load",
            a,
            Some(load),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{body}");
    // An integer written with a zero fraction is the spec's `integer` too: the same 409
    // (it reached the guest check), not a 400 for its type; a real fraction is refused.
    let whole = json!({"kind": "memory", "amount": 64, "seconds": 27.0}).to_string();
    let (s, body) = api
        .checked(
            "POST",
            "/v1/tenants/alice/load",
            "/v1/tenants/{name}/load",
            a,
            Some(whole),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{body}");
    let part = json!({"kind": "memory", "amount": 64, "seconds": 27.5}).to_string();
    let (s, _) = api
        .call("POST", "/v1/tenants/alice/load", a, Some(part))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn what_the_spec_admits_the_server_takes_and_what_it_refuses_is_refused() {
    let api = Api::new();
    let a = Some(api.admin.as_str());
    // `memory_mib: 64.0` is an integer by the spec.
    let spec =
        json!({"name": "whole", "vcpus": 1.0, "memory_mib": 64.0, "image": {"name": "hello"}});
    let (s, body) = api
        .checked(
            "POST",
            "/v1/tenants",
            "/v1/tenants",
            a,
            Some(spec.to_string()),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{body}");
    api.idle().await;
    // `image: {}` (and both name and kernel) break the spec's oneOf, and the server refuses them.
    let spec_doc = &api.spec;
    for image in [json!({}), json!({"name": "hello", "kernel": "/k"})] {
        assert!(
            spec_doc.check_schema("GuestImage", &image).is_err(),
            "the spec admits {image}"
        );
        let bad = json!({"name": "noimage", "memory_mib": 64, "image": image});
        let (s, body) = api
            .call("POST", "/v1/tenants", a, Some(bad.to_string()))
            .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{image}: {body}");
    }
    // The control: each alternative alone is admitted.
    for image in [
        json!({"name": "hello"}),
        json!({"kernel": "/boot/k", "cmdline": "x"}),
    ] {
        spec_doc.check_schema("GuestImage", &image).unwrap();
    }
    // A receipt query's tenant outside the name pattern (empty included): 400, as the spec says.
    for tenant in ["", "..", "UPPER"] {
        let (s, body) = api
            .checked(
                "GET",
                &format!("/v1/receipts?tenant={tenant}"),
                "/v1/receipts",
                a,
                None,
            )
            .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{tenant:?}: {body}");
    }
    let (s, _) = api.call("GET", "/v1/receipts?tenant=whole", a, None).await;
    assert_eq!(s, StatusCode::OK);
}

#[tokio::test]
async fn the_host_inventory_is_the_admins_and_counts_what_tenants_hold() {
    let api = Api::new();
    let a = Some(api.admin.as_str());
    let (s, before) = api.checked("GET", "/v1/host", "/v1/host", a, None).await;
    assert_eq!(s, StatusCode::OK, "{before}");
    assert!(before["tenants"].as_array().unwrap().is_empty());
    let (_, created) = api
        .checked(
            "POST",
            "/v1/tenants",
            "/v1/tenants",
            a,
            Some(spec_json("inv")),
        )
        .await;
    let tenant = created["token"].as_str().unwrap().to_string();
    let (s, after) = api.checked("GET", "/v1/host", "/v1/host", a, None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(after["tenants"], json!(["inv"]));
    let overhead = after["vmm_overhead_mib"].as_u64().unwrap();
    assert_eq!(
        after["memory_held_mib"].as_u64().unwrap(),
        before["memory_held_mib"].as_u64().unwrap() + 64 + overhead
    );
    assert_eq!(after["vcpus_held"].as_u64().unwrap(), 1);
    // A tenant's token may not read the host's.
    let (s, _) = api
        .checked("GET", "/v1/host", "/v1/host", Some(&tenant), None)
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (s, _) = api.checked("GET", "/v1/host", "/v1/host", None, None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    api.idle().await;
}
