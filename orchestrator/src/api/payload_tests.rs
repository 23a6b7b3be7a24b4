//! `tenantvm payload restart` from the CLI through the API to a tenant's guest agent: the
//! stand-in guest serves its hybrid-vsock socket (as the tenant's uid: needs root) and
//! answers `restart-payload` and `health` as a real agent would for a server that comes up,
//! one that exits (a model the engine refuses), and an agent that predates the request.

use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use clap::Parser;
use tenantvm_agent_protocol::{
    decode_body, encode_frame, read_frame, AgentFailure, ErrorCode, Outcome, PayloadState, Reply,
    Request, RequestFrame, ResponseFrame,
};

use crate::auth::Caller;
use crate::cli::{exit, run_with, Cli};
use crate::domain::spec::TenantSpec;
use crate::tenant::fault::FaultHook;
use crate::tenant::service::{CommandOutcome, TenantCommand};
use crate::tenant::test_utils::{fake_agent_socket, Harness};

/// How the stand-in's payload behaves.
const COMES_UP: u8 = 0;
const EXITS: u8 = 1;
const OLD_AGENT: u8 = 2;

fn serve_one(mode: &AtomicU8, mut s: UnixStream) {
    let mut line = [0u8; 13];
    std::io::Read::read_exact(&mut s, &mut line).unwrap();
    std::io::Write::write_all(&mut s, b"OK 1\n").unwrap();
    while let Ok(body) = read_frame(&mut s) {
        let req: RequestFrame = decode_body(&body).unwrap();
        let mode = mode.load(Ordering::SeqCst);
        let outcome = match (req.request, mode) {
            (Request::RestartPayload, OLD_AGENT) => Outcome::Err(AgentFailure {
                code: ErrorCode::BadRequest,
                message: "unknown variant `restart-payload`".into(),
            }),
            (Request::RestartPayload, _) => Outcome::Ok(Reply::PayloadStarted { pid: 77 }),
            (Request::Health, COMES_UP) => Outcome::Ok(Reply::Health {
                payload: PayloadState::Running {
                    pid: 77,
                    ready: true,
                    restarts: 0,
                },
            }),
            (Request::Health, _) => Outcome::Ok(Reply::Health {
                payload: PayloadState::Exited {
                    code: 1,
                    restarts: 1,
                    restart_in_ms: Some(2000),
                },
            }),
            _ => return,
        };
        let frame = encode_frame(&ResponseFrame {
            id: req.id,
            outcome,
        })
        .unwrap();
        if std::io::Write::write_all(&mut s, &frame).is_err() {
            return;
        }
    }
}

fn serve_guest(mode: Arc<AtomicU8>, listener: UnixListener) {
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(s) = s else { return };
            let mode = mode.clone();
            std::thread::spawn(move || serve_one(&mode, s));
        }
    });
}

#[test]
fn payload_restart_waits_for_readiness_and_says_why_not() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        tenantvm_skip::skip!("needs root to serve agent sockets as tenant uids");
    }
    let h = Harness::new(FaultHook::default());
    h.host.state().agent_vsock = true;
    let spec = TenantSpec::from_toml("name = \"alice\"\ndisk_gib = 1\n[image]\nname = \"hello\"\n")
        .unwrap();
    let token = match h
        .svc
        .execute(&Caller::Admin, TenantCommand::Create(spec))
        .unwrap()
    {
        CommandOutcome::Created(c) => c.token,
        other => panic!("{other:?}"),
    };
    h.svc.wait_idle();
    let mode = Arc::new(AtomicU8::new(COMES_UP));
    serve_guest(mode.clone(), fake_agent_socket(&h.svc, "alice"));

    let rt = Arc::new(crate::daemon::runtime().unwrap());
    let api_sock = h.dir.path().join("api.sock");
    let listener = rt
        .block_on(async { tokio::net::UnixListener::bind(&api_sock) })
        .unwrap();
    let app = super::router(h.svc.clone());
    rt.spawn(async move { axum::serve(listener, app).await });
    let cli = |args: &[&str]| -> (u8, String) {
        let mut argv = vec![
            "tenantvm",
            "--socket",
            api_sock.to_str().unwrap(),
            "--token",
            token.as_str(),
        ];
        argv.extend_from_slice(args);
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = rt.block_on(run_with(
            Cli::try_parse_from(argv).unwrap(),
            &mut out,
            &mut err,
        ));
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out),
            String::from_utf8_lossy(&err)
        );
        (code, text)
    };

    let (code, text) = cli(&["payload", "restart", "alice", "--json"]);
    assert_eq!(code, exit::OK, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (v["pid"].as_u64(), v["ready"].as_bool()),
        (Some(77), Some(true))
    );
    let spec = super::tests::openapi::OpenApi::load();
    spec.check_response("post", "/v1/tenants/{name}/payload/restart", 200, &v)
        .unwrap();

    // A server that exits: the restart fails with its exit code and where to look.
    mode.store(EXITS, Ordering::SeqCst);
    let (code, text) = cli(&["payload", "restart", "alice"]);
    assert_eq!(code, exit::DAEMON_ERROR, "{text}");
    assert!(text.contains("exited with code 1"), "{text}");
    assert!(text.contains("restarts it in 2.0 s"), "{text}");
    assert!(text.contains("tenantvm logs alice"), "{text}");

    // An agent that predates restart-payload: 409, and what to do instead.
    mode.store(OLD_AGENT, Ordering::SeqCst);
    let (code, text) = cli(&["payload", "restart", "alice"]);
    assert_eq!(code, exit::CONFLICT, "{text}");
    assert!(text.contains("stop and start the tenant instead"), "{text}");

    // Another tenant's name is unknown to this token.
    let (code, text) = cli(&["payload", "restart", "bob"]);
    assert_eq!(code, exit::NOT_FOUND, "{text}");
}
