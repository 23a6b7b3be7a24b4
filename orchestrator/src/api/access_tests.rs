//! Every route of docs/api/openapi.yaml, walked with another tenant's token and on a
//! tenant being recovered: the one access rule ([`crate::tenant::access`]) holds on each.
//!
//! A table classifies each operation of the spec; the test fails when the spec has an
//! operation the table lacks (or the reverse), so a new route cannot skip the walk. Each
//! refusal has its control: the same request by the tenant itself (or the admin) is not
//! refused that way, so a walk that reached no handler could not pass.

use std::collections::BTreeSet;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::{json, Value};
use tower::ServiceExt;

use super::router;
use super::tests::openapi::OpenApi;
use crate::domain::GuestKind;
use crate::tenant::fault::FaultHook;
use crate::tenant::test_utils::Harness;

/// Who may call an operation, and what it needs of the tenant it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    /// Any valid token; names no tenant.
    Anyone,
    /// Any valid token; answers with what the caller may see only (checked by name).
    SeesOwn,
    /// The admin token only.
    Admin,
    /// Names a tenant, for reading: the tenant or the admin; answers while recovering.
    TenantRead,
    /// Names a tenant, to change it or reach its guest: the tenant or the admin; refused
    /// (409 `busy`) while the tenant is being recovered.
    TenantAct,
    /// Names a tenant; the admin only (test loads); refused while recovering.
    AdminAct,
}

/// Every operation of the spec, classified.
const ROUTES: &[(&str, &str, Rule)] = &[
    ("GET", "/v1/health", Rule::Anyone),
    ("GET", "/v1/tenants", Rule::SeesOwn),
    ("POST", "/v1/tenants", Rule::Admin),
    ("GET", "/v1/tenants/{name}", Rule::TenantRead),
    ("DELETE", "/v1/tenants/{name}", Rule::TenantAct),
    ("POST", "/v1/tenants/{name}/stop", Rule::TenantAct),
    ("POST", "/v1/tenants/{name}/start", Rule::TenantAct),
    ("POST", "/v1/tenants/{name}/infer", Rule::TenantAct),
    ("GET", "/v1/tenants/{name}/logs", Rule::TenantRead),
    ("GET", "/v1/tenants/{name}/keys", Rule::TenantRead),
    ("POST", "/v1/tenants/{name}/keys", Rule::TenantAct),
    ("DELETE", "/v1/tenants/{name}/keys/{id}", Rule::TenantAct),
    ("GET", "/v1/tenants/{name}/models", Rule::TenantAct),
    (
        "POST",
        "/v1/tenants/{name}/payload/restart",
        Rule::TenantAct,
    ),
    ("GET", "/v1/tenants/{name}/gpu", Rule::TenantAct),
    ("POST", "/v1/tenants/{name}/load", Rule::AdminAct),
    ("GET", "/v1/tenants/{name}/load/{kind}", Rule::AdminAct),
    ("PUT", "/v1/tenants/{name}/models/{model}", Rule::TenantAct),
    (
        "DELETE",
        "/v1/tenants/{name}/models/{model}",
        Rule::TenantAct,
    ),
    ("GET", "/v1/host", Rule::Admin),
    ("GET", "/v1/metrics", Rule::SeesOwn),
    ("GET", "/v1/receipts", Rule::SeesOwn),
    ("GET", "/v1/gpu/quarantine", Rule::Admin),
    ("POST", "/v1/gpu/quarantine/scrub", Rule::Admin),
];

/// An answer: status, error code (if the body is an error), and the body as text.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    code: Option<String>,
    text: String,
}

impl Answer {
    fn is(&self, status: StatusCode, code: &str) -> bool {
        self.status == status && self.code.as_deref() == Some(code)
    }
}

struct Walk {
    h: Harness,
    app: axum::Router,
    admin: String,
    spec: OpenApi,
}

impl Walk {
    /// A request for `method` on `template` about tenant `name`, with a body the route
    /// accepts (so that a refusal is about who asks, not what was sent).
    async fn call(
        &self,
        method: &str,
        template: &str,
        name: &str,
        key_id: i64,
        token: &str,
    ) -> Answer {
        let uri = template
            .replace("{name}", name)
            .replace("{id}", &key_id.to_string())
            .replace("{model}", "probe.gguf")
            .replace("{kind}", "cpu");
        let uri = match template {
            "/v1/tenants/{name}/logs" => format!("{uri}?stream=events"),
            "/v1/receipts" => format!("{uri}?tenant={name}"),
            _ => uri,
        };
        let req = Request::builder()
            .method(method)
            .uri(&uri)
            .header("authorization", format!("Bearer {token}"));
        let body = match (method, template) {
            ("POST", "/v1/tenants") => {
                Some(json!({"name": "intruder", "image": {"name": "hello"}}).to_string())
            }
            ("POST", "/v1/tenants/{name}/infer") => {
                Some(json!({"prompt": "probe", "max_tokens": 1}).to_string())
            }
            ("POST", "/v1/tenants/{name}/payload/restart") => {
                Some(json!({"wait_s": 0}).to_string())
            }
            ("POST", "/v1/tenants/{name}/load") => {
                Some(json!({"kind": "cpu", "amount": 1, "seconds": 1}).to_string())
            }
            ("POST", "/v1/gpu/quarantine/scrub") => Some(json!({"slice": "0/whole"}).to_string()),
            _ => None,
        };
        let req = if method == "PUT" {
            // A three-byte model and its hash.
            req.header("content-length", "3")
                .header(
                    "x-model-sha256",
                    "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
                )
                .body(Body::from("abc"))
        } else if let Some(b) = body {
            req.header("content-type", "application/json")
                .body(Body::from(b))
        } else {
            req.body(Body::empty())
        }
        .unwrap();
        let resp = self.app.clone().oneshot(req).await.unwrap();
        let status = resp.status();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let json = serde_json::from_str::<Value>(&text).ok();
        if let Some(body) = &json {
            // Every answer of the walk is one the contract documents.
            if let Err(e) = self
                .spec
                .check_response(method, template, status.as_u16(), body)
            {
                panic!("{method} {uri}: {e}: {text}");
            }
        }
        let code = json.and_then(|v| v["error"]["code"].as_str().map(str::to_string));
        Answer { status, code, text }
    }

    /// Waits until no operation runs (one a request started).
    async fn idle(&self) {
        let svc = self.h.svc.clone();
        tokio::task::spawn_blocking(move || svc.wait_idle())
            .await
            .unwrap();
    }

    /// What the admin sees of tenant `name`: its keys and its events, to show that a
    /// refused request changed nothing.
    fn footprint(&self, name: &str) -> (Value, usize) {
        let store = self.h.svc.store();
        let t = store.tenant(name).unwrap().unwrap();
        let keys = serde_json::to_value(store.inference_keys(t.id).unwrap()).unwrap();
        let events = store.events(t.id, 0, 10_000).unwrap().len();
        (keys, events)
    }
}

async fn setup() -> (Walk, String, String, i64) {
    let h = Harness::new(FaultHook::default());
    let admin = h.admin_token();
    let app = router(h.svc.clone());
    let walk = Walk {
        h,
        app,
        admin,
        spec: OpenApi::load(),
    };
    let mut tokens = Vec::new();
    for name in ["alpha", "beta"] {
        let spec = json!({"name": name, "image": {"name": "hello"}});
        let req = Request::builder()
            .method("POST")
            .uri("/v1/tenants")
            .header("authorization", format!("Bearer {}", walk.admin))
            .header("content-type", "application/json")
            .body(Body::from(spec.to_string()))
            .unwrap();
        let resp = walk.app.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::ACCEPTED);
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        let created: Value = serde_json::from_slice(&bytes).unwrap();
        tokens.push(created["token"].as_str().unwrap().to_string());
    }
    walk.idle().await;
    let store = walk.h.svc.store();
    for name in ["alpha", "beta"] {
        let t = store.tenant(name).unwrap().unwrap();
        // Both run a guest image with an agent (no agent answers: a call to it fails at
        // once, which is an answer that is neither "no such tenant" nor "busy").
        store.set_guest(t.id, GuestKind::Agent).unwrap();
    }
    let alpha = store.tenant("alpha").unwrap().unwrap();
    // alpha has served a request at the front door: metrics hold series of alpha's own.
    let metrics = walk.h.svc.metrics();
    metrics.claim("alpha", alpha.id);
    metrics.request("alpha", "/v1/completions", 200);
    let (_, key_id, _) = crate::auth::inference_key::create(store, alpha.id).unwrap();
    let (beta, alpha_token) = (tokens.pop().unwrap(), tokens.pop().unwrap());
    (walk, alpha_token, beta, key_id)
}

#[test]
fn the_route_table_is_the_spec() {
    let spec: BTreeSet<(String, String)> = OpenApi::load().operations().into_iter().collect();
    let table: BTreeSet<(String, String)> = ROUTES
        .iter()
        .map(|(m, p, _)| (m.to_string(), p.to_string()))
        .collect();
    let missing: Vec<_> = spec.difference(&table).collect();
    let stale: Vec<_> = table.difference(&spec).collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "classify every operation of docs/api/openapi.yaml in ROUTES: missing {missing:?}, not in the spec {stale:?}"
    );
}

#[test]
fn another_tenants_token_reaches_nothing_of_alpha_on_any_route() {
    let rt = crate::daemon::runtime().unwrap();
    rt.block_on(async {
        let (walk, alpha, beta, key_id) = setup().await;
        let before = walk.footprint("alpha");
        for &(method, template, rule) in ROUTES {
            let by_beta = walk.call(method, template, "alpha", key_id, &beta).await;
            match rule {
                Rule::Anyone => assert!(
                    by_beta.status.is_success(),
                    "{method} {template}: {by_beta:?}"
                ),
                // A list beta may read, with nothing of alpha in it; or "no such tenant"
                // for the name beta itself sent (receipts of `?tenant=alpha`).
                Rule::SeesOwn if by_beta.status == StatusCode::NOT_FOUND => assert!(
                    by_beta.is(StatusCode::NOT_FOUND, "not_found"),
                    "{method} {template}: {by_beta:?}"
                ),
                Rule::SeesOwn => {
                    assert!(
                        by_beta.status.is_success(),
                        "{method} {template}: {by_beta:?}"
                    );
                    assert!(
                        !by_beta.text.contains("alpha"),
                        "{method} {template} showed beta something of alpha: {}",
                        by_beta.text
                    );
                }
                Rule::Admin | Rule::AdminAct => assert!(
                    by_beta.is(StatusCode::FORBIDDEN, "forbidden"),
                    "{method} {template} by a tenant token: {by_beta:?}"
                ),
                Rule::TenantRead | Rule::TenantAct => {
                    assert!(
                        by_beta.is(StatusCode::NOT_FOUND, "not_found"),
                        "{method} {template} on alpha with beta's token: {by_beta:?}"
                    );
                    // The same as for a tenant that does not exist: no probing by answer.
                    let nobody = walk.call(method, template, "nobody", key_id, &beta).await;
                    assert_eq!(
                        (by_beta.status, &by_beta.code),
                        (nobody.status, &nobody.code),
                        "{method} {template}: alpha and a missing tenant answer apart"
                    );
                }
            }
        }
        assert_eq!(
            walk.footprint("alpha"),
            before,
            "beta's requests changed alpha"
        );
        let state = walk.h.svc.store().tenant("alpha").unwrap().unwrap().state;
        assert_eq!(state, crate::domain::lifecycle::LifecycleState::Running);

        // Controls: alpha itself (the admin for the admin's routes) is not refused so,
        // and what beta must not see is there to see.
        for &(method, template, rule) in ROUTES {
            let own = match rule {
                Rule::Admin | Rule::AdminAct => &walk.admin,
                Rule::SeesOwn => &walk.admin,
                _ => &alpha,
            };
            if (method, template) == ("POST", "/v1/tenants") {
                continue; // a second tenant is not needed to show the admin may create
            }
            if (method, template) == ("DELETE", "/v1/tenants/{name}") {
                continue; // last, below: alpha would be gone for the rest
            }
            let answer = walk.call(method, template, "alpha", key_id, own).await;
            walk.idle().await;
            match rule {
                Rule::TenantRead | Rule::TenantAct => assert!(
                    !answer.is(StatusCode::NOT_FOUND, "not_found"),
                    "control: {method} {template} by alpha itself: {answer:?}"
                ),
                Rule::Admin | Rule::AdminAct => assert!(
                    !answer.is(StatusCode::FORBIDDEN, "forbidden"),
                    "control: {method} {template} by the admin: {answer:?}"
                ),
                Rule::SeesOwn if template != "/v1/receipts" => assert!(
                    answer.text.contains("alpha"),
                    "control: {method} {template} by the admin shows no alpha: {}",
                    answer.text
                ),
                _ => {}
            }
        }
        let destroyed = walk
            .call("DELETE", "/v1/tenants/{name}", "alpha", key_id, &alpha)
            .await;
        assert_eq!(
            destroyed.status,
            StatusCode::ACCEPTED,
            "control: {destroyed:?}"
        );
    });
}

#[test]
fn a_recovering_tenant_answers_reads_and_refuses_the_rest_on_every_route() {
    let rt = crate::daemon::runtime().unwrap();
    rt.block_on(async {
        let (walk, alpha, _beta, key_id) = setup().await;
        let token_for = |rule| match rule {
            Rule::AdminAct => walk.admin.clone(),
            _ => alpha.clone(),
        };
        let named = |rule| matches!(rule, Rule::TenantRead | Rule::TenantAct | Rule::AdminAct);
        // Control first: not recovering, nothing answers busy.
        let mut control = Vec::new();
        for &(method, template, rule) in ROUTES.iter().filter(|r| named(r.2)) {
            if method == "DELETE" && template == "/v1/tenants/{name}" {
                continue; // would start the departure; its guard is the busy one below
            }
            let answer = walk
                .call(method, template, "alpha", key_id, &token_for(rule))
                .await;
            walk.idle().await;
            assert!(
                !answer.is(StatusCode::CONFLICT, "busy"),
                "control: {method} {template} answered busy on a tenant nobody holds: {answer:?}"
            );
            control.push((method, template));
        }
        let _recovery = walk.h.svc.mark_recovering("alpha").unwrap();
        let before = walk.footprint("alpha");
        for &(method, template, rule) in ROUTES.iter().filter(|r| named(r.2)) {
            let answer = walk
                .call(method, template, "alpha", key_id, &token_for(rule))
                .await;
            match rule {
                Rule::TenantRead => assert!(
                    answer.status.is_success(),
                    "{method} {template} (a read) on a recovering tenant: {answer:?}"
                ),
                _ => assert!(
                    answer.is(StatusCode::CONFLICT, "busy") && answer.text.contains("recovered"),
                    "{method} {template} on a recovering tenant: {answer:?}"
                ),
            }
        }
        assert_eq!(
            walk.footprint("alpha"),
            before,
            "requests on a recovering tenant changed it"
        );
        assert!(control.len() >= 10, "the control walked only {control:?}");

        // The front door holds the same guard.
        let record = walk.h.svc.store().tenant("alpha").unwrap().unwrap();
        let refused = walk.h.svc.admit_front_door(record.clone()).unwrap_err();
        assert!(
            matches!(refused, crate::tenant::infer::InferError::Recovering(_)),
            "{refused:?}"
        );
        drop(_recovery);
        walk.h
            .svc
            .admit_front_door(record)
            .expect("admitted once recovered");
    });
}
