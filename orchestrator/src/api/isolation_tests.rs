//! One tenant cannot stall the API for others: a tenant whose guest agent never answers,
//! with its whole `max_concurrency` of inference requests hung, leaves the admin's health
//! check, another tenant's requests (its inference included) and its own status answering.
//! The router runs on the daemon's own runtime ([`crate::daemon::runtime`]), over the fake
//! host; the two guests' agent channels are served by this test, each socket listened on
//! as its tenant's uid (what the peer-credential check wants). Needs root for that.

use std::future::Future;
use std::os::unix::net::UnixListener;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::{json, Value};
use tenantvm_agent_protocol::{
    decode_body, encode_frame, read_frame, HttpResponse, Outcome, Reply, Request as AgentRequest,
    RequestFrame, ResponseFrame,
};
use tower::ServiceExt;

use super::router;
use crate::tenant::fault::FaultHook;
use crate::tenant::test_utils::{fake_agent_socket, Harness};

/// How long a request may take while the other tenant hangs: far below the hang (the
/// agent client waits 120 s for an inference), far above any honest latency here.
const GENEROUS: Duration = Duration::from_secs(20);

/// A guest agent that answers every inference with a completion.
fn serve_answering_agent(listener: UnixListener) {
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            std::thread::spawn(move || {
                while let Ok(body) = read_frame(&mut stream) {
                    let Ok(req) = decode_body::<RequestFrame>(&body) else {
                        return;
                    };
                    let outcome = match req.request {
                        AgentRequest::Infer(_) => Outcome::Ok(Reply::Infer(HttpResponse {
                            status: 200,
                            headers: Vec::new(),
                            body: json!({"choices": [{"text": "calm answer"}]}).to_string(),
                        })),
                        // An agent from before the mux: the hello is an unknown command.
                        AgentRequest::Mux { .. } => {
                            Outcome::Err(tenantvm_agent_protocol::AgentFailure {
                                code: tenantvm_agent_protocol::ErrorCode::BadRequest,
                                message: "unknown variant `mux`".into(),
                            })
                        }
                        _ => return,
                    };
                    let frame = encode_frame(&ResponseFrame {
                        id: req.id,
                        outcome,
                    })
                    .unwrap();
                    if std::io::Write::write_all(&mut stream, &frame).is_err() {
                        return;
                    }
                }
            });
        }
    });
}

async fn call(
    app: &axum::Router,
    method: &str,
    uri: &str,
    token: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let req = Request::builder()
        .method(method)
        .uri(uri)
        .header("authorization", format!("Bearer {token}"));
    let req = match body {
        Some(b) => req
            .header("content-type", "application/json")
            .body(Body::from(b.to_string())),
        None => req.body(Body::empty()),
    }
    .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// `f`'s output, or a panic naming `what` if it takes longer than [`GENEROUS`].
async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    match tokio::time::timeout(GENEROUS, f).await {
        Ok(v) => v,
        Err(_) => panic!("{what} did not answer within {GENEROUS:?} while hung's requests hang"),
    }
}

#[test]
fn a_tenant_with_its_whole_concurrency_hung_slows_no_one_else() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        tenantvm_skip::skip!("needs root to serve agent sockets as tenant uids");
    }
    let rt = crate::daemon::runtime().unwrap();
    let h = Harness::new(FaultHook::default());
    let admin = h.admin_token();
    let svc = h.svc.clone();
    // One router, as the daemon serves: its in-flight budgets are shared by every request.
    let app = router(svc.clone());
    rt.block_on(async move {
        let mut tokens = Vec::new();
        for name in ["hung", "calm"] {
            let spec = json!({"name": name, "image": {"name": "hello"},
                "quotas": {"max_concurrency": 16, "requests_per_s": 1000}});
            let (s, created) = call(&app, "POST", "/v1/tenants", &admin, Some(spec)).await;
            assert_eq!(s, StatusCode::ACCEPTED, "{created}");
            tokens.push(created["token"].as_str().unwrap().to_string());
        }
        let (hung, calm) = (tokens[0].clone(), tokens[1].clone());
        let s2 = svc.clone();
        tokio::task::spawn_blocking(move || s2.wait_idle())
            .await
            .unwrap();
        // Both now run a guest image with an agent (as recorded at create for an image set).
        let mut listeners = Vec::new();
        for name in ["hung", "calm"] {
            listeners.push(fake_agent_socket(&svc, name));
        }
        // hung's agent never accepts: its connections wait in the backlog, unanswered.
        let hung_agent = listeners.remove(0);
        serve_answering_agent(listeners.remove(0));

        let prompt = json!({"prompt": "hello", "max_tokens": 4});
        let mut hung_requests = Vec::new();
        for _ in 0..16 {
            let app = app.clone();
            let (token, body) = (hung.clone(), prompt.clone());
            hung_requests.push(tokio::spawn(async move {
                call(&app, "POST", "/v1/tenants/hung/infer", &token, Some(body)).await
            }));
        }
        // Let all sixteen reach the guest (and hang there).
        tokio::time::sleep(Duration::from_secs(2)).await;

        let (s, health) = within(
            "the admin's health check",
            call(&app, "GET", "/v1/health", &admin, None),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{health}");
        let (s, _) = within(
            "the admin's list",
            call(&app, "GET", "/v1/tenants", &admin, None),
        )
        .await;
        assert_eq!(s, StatusCode::OK);
        let (s, view) = within(
            "calm's status",
            call(&app, "GET", "/v1/tenants/calm", &calm, None),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{view}");
        let (s, _) = within(
            "calm's logs",
            call(
                &app,
                "GET",
                "/v1/tenants/calm/logs?stream=events",
                &calm,
                None,
            ),
        )
        .await;
        assert_eq!(s, StatusCode::OK);
        let (s, answer) = within(
            "calm's inference",
            call(
                &app,
                "POST",
                "/v1/tenants/calm/infer",
                &calm,
                Some(prompt.clone()),
            ),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{answer}");
        assert_eq!(answer["choices"][0]["text"], "calm answer");
        // hung itself can still see its own state, and is told at once that it is full.
        let (s, _) = within(
            "hung's own status",
            call(&app, "GET", "/v1/tenants/hung", &hung, None),
        )
        .await;
        assert_eq!(s, StatusCode::OK);
        let (s, refused) = within(
            "hung's seventeenth inference",
            call(&app, "POST", "/v1/tenants/hung/infer", &hung, Some(prompt)),
        )
        .await;
        assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{refused}");
        assert_eq!(refused["error"]["code"], "too_many_in_flight");

        // The guest goes away: the hung requests end (502), none is left behind.
        drop(hung_agent);
        for r in hung_requests {
            let (s, _) = within("a hung request after its guest went away", async {
                r.await.unwrap()
            })
            .await;
            assert_eq!(s, StatusCode::BAD_GATEWAY);
        }
    });
}
