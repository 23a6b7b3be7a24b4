//! `tenantvm gpu-info` from the CLI through the API to a guest agent: the CLI and the router
//! run here (the router on a Unix socket); the daemon's planner is the nested host's edu as
//! a whole card (FAKE sysfs tree, SIMULATED L40S at its address); the tenant's guest is a
//! FAKE agent on its hybrid-vsock socket (as the tenant's uid: needs root) answering
//! `gpu-info` with the agent's own sysfs reader over a FAKE guest tree and its `nvidia-smi`
//! parser over canned output (running the fake scripts is the agent crate's test: its reaper
//! must not run in this process), or as an agent older than `gpu-info`.

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use clap::Parser;
use tenantvm_agent::gpu::{parse_smi_csv, pci_functions};
use tenantvm_agent_protocol::{
    decode_body, encode_frame, read_frame, AgentFailure, ErrorCode, GpuInfoReply, NvidiaSmi,
    Outcome, Reply, Request, RequestFrame, ResponseFrame,
};
use tenantvm_gpu::host::fake::FakeHost;

use crate::auth::Caller;
use crate::cli::{exit, run_with, Cli};
use crate::domain::spec::TenantSpec;
use crate::gpu::BackendPlanner;
use crate::tenant::fault::FaultHook;
use crate::tenant::service::{CommandOutcome, TenantCommand};
use crate::tenant::test_utils::{fake_agent_socket, Harness, EDU_TREE, SIM_AT_EDU};

/// How the FAKE agent answers.
#[derive(Clone)]
enum Guest {
    /// The agent's sysfs reader over this root, and nvidia-smi's output if the image has it.
    Probe(PathBuf, Option<&'static str>),
    /// As an agent that predates gpu-info.
    Older,
}

fn serve_one(mode: &Guest, mut s: UnixStream) {
    let mut line = [0u8; 13];
    std::io::Read::read_exact(&mut s, &mut line).unwrap();
    std::io::Write::write_all(&mut s, b"OK 1\n").unwrap();
    let Ok(body) = read_frame(&mut s) else { return };
    let req: RequestFrame = decode_body(&body).unwrap();
    let outcome = match (req.request, mode) {
        (Request::GpuInfo, Guest::Probe(root, smi)) => {
            let (pci, pci_truncated, pci_unreadable) = pci_functions(root);
            let nvidia_smi = match smi {
                None => NvidiaSmi::Absent {
                    searched: vec!["/usr/bin/nvidia-smi".into()],
                },
                Some(text) => {
                    let (gpus, unparsed_lines) = parse_smi_csv(text);
                    NvidiaSmi::Ran {
                        path: "/usr/bin/nvidia-smi".into(),
                        gpus,
                        unparsed_lines,
                        truncated: false,
                    }
                }
            };
            Outcome::Ok(Reply::GpuInfo(GpuInfoReply {
                pci,
                pci_truncated,
                pci_unreadable,
                nvidia_smi,
            }))
        }
        (Request::GpuInfo, Guest::Older) => Outcome::Err(AgentFailure {
            code: ErrorCode::BadRequest,
            message: "unknown variant `gpu-info`, expected one of `status`, `unlock-disk`".into(),
        }),
        // Stop and destroy ask the guest to shut down: this stand-in just goes away.
        _ => return,
    };
    let frame = encode_frame(&ResponseFrame {
        id: req.id,
        outcome,
    })
    .unwrap();
    let _ = std::io::Write::write_all(&mut s, &frame);
}

fn serve_guest(mode: Arc<Mutex<Guest>>, listener: UnixListener) {
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(s) = s else { return };
            let mode = mode.lock().unwrap().clone();
            std::thread::spawn(move || serve_one(&mode, s));
        }
    });
}

/// A FAKE guest sysfs with a virtio-net function and, if `edu`, the passed-through edu at
/// the guest's own address 0000:00:05.0.
fn guest_tree(root: &Path, edu: bool) {
    let mut functions = vec![("0000:00:01.0", "0x1af4", "0x1041", "0x020000")];
    if edu {
        functions.push(("0000:00:05.0", "0x1234", "0x11e8", "0x00ff00"));
    }
    for (addr, vendor, device, class) in functions {
        let dir = root.join("bus/pci/devices").join(addr);
        std::fs::create_dir_all(&dir).unwrap();
        for (k, v) in [("vendor", vendor), ("device", device), ("class", class)] {
            std::fs::write(dir.join(k), format!("{v}\n")).unwrap();
        }
    }
}

#[test]
fn gpu_info_shows_the_guest_beside_the_assignment_and_flags_mismatches() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        tenantvm_skip::skip!("needs root to serve agent sockets as tenant uids");
    }
    let fake = FakeHost::build(&serde_json::from_str(EDU_TREE).unwrap()).unwrap();
    let sim = fake
        .attach_sim(&serde_json::from_str(SIM_AT_EDU).unwrap())
        .unwrap();
    let planner = Arc::new(BackendPlanner::new(Box::new(sim)).with_sysfs(fake.sysfs()));
    let h = Harness::new(FaultHook::default()).with_planner(planner);
    {
        let mut host = h.host.state();
        host.agent_vsock = true;
        host.qemu = true;
    }
    let mut tokens = std::collections::HashMap::new();
    for (name, gpu) in [("g", "gpu = { whole_gpu = true }\n"), ("plain", "")] {
        let spec = TenantSpec::from_toml(&format!(
            "name = \"{name}\"\n{gpu}[image]\nname = \"hello\"\n"
        ))
        .unwrap();
        match h
            .svc
            .execute(&Caller::Admin, TenantCommand::Create(spec))
            .unwrap()
        {
            CommandOutcome::Created(c) => tokens.insert(name, c.token),
            other => panic!("{other:?}"),
        };
    }
    h.svc.wait_idle();
    let files = tempfile::tempdir().unwrap();
    let with_edu = files.path().join("with-edu");
    let without = files.path().join("without");
    guest_tree(&with_edu, true);
    guest_tree(&without, false);
    let mode = Arc::new(Mutex::new(Guest::Probe(with_edu.clone(), None)));
    serve_guest(mode.clone(), fake_agent_socket(&h.svc, "g"));

    let rt = Arc::new(crate::daemon::runtime().unwrap());
    let api_sock = h.dir.path().join("api.sock");
    let listener = rt
        .block_on(async { tokio::net::UnixListener::bind(&api_sock) })
        .unwrap();
    let app = super::router(h.svc.clone());
    rt.spawn(async move { axum::serve(listener, app).await });
    let cli = |token: &str, args: &[&str]| -> (u8, String, String) {
        let mut argv = vec![
            "tenantvm",
            "--socket",
            api_sock.to_str().unwrap(),
            "--token",
            token,
        ];
        argv.extend_from_slice(args);
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = rt.block_on(run_with(
            Cli::try_parse_from(argv).unwrap(),
            &mut out,
            &mut err,
        ));
        (
            code,
            String::from_utf8_lossy(&out).into_owned(),
            String::from_utf8_lossy(&err).into_owned(),
        )
    };
    let g = tokens["g"].clone();

    // The edu in the guest, no nvidia-smi in the image: a match, with a note.
    let (code, out, err) = cli(&g, &["gpu-info", "g"]);
    assert_eq!(code, 0, "{out}{err}");
    for want in [
        "slice:        whole (whole card)",
        "route:        whole-gpu",
        "host devices: 0000:00:03.0",
        "guest ids:    1234:11e8",
        "0000:00:05.0   1234:11e8",
        "GUEST NVIDIA-SMI: not in the image",
        "NOTE      the guest image has no nvidia-smi",
    ] {
        assert!(out.contains(want), "{want:?} in\n{out}");
    }
    // The JSON answer is the API's, and it holds to the spec.
    let (code, out, err) = cli(&g, &["gpu-info", "g", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    super::tests::openapi::OpenApi::load()
        .check_response("GET", "/v1/tenants/{name}/gpu", 200, &v)
        .unwrap();
    assert_eq!(v["assigned"]["vendor"], 0x1234);
    assert_eq!(v["matches"], true);

    // The device missing in the guest: exit 16 and the mismatch listed.
    *mode.lock().unwrap() = Guest::Probe(without.clone(), None);
    let (code, out, err) = cli(&g, &["gpu-info", "g"]);
    assert_eq!(code, exit::GPU_MISMATCH, "{out}{err}");
    assert!(
        out.contains("MISMATCH  the guest sees no PCI function 1234:11e8"),
        "{out}"
    );
    assert!(err.contains("does not match"), "{err}");

    // nvidia-smi listing two GPUs for one card, one with a hostile name: flagged, escaped.
    *mode.lock().unwrap() = Guest::Probe(
        with_edu.clone(),
        Some("0, NVIDIA L40S, GPU-1, 46068, 0, [N/A]\n1, evil\u{1b}[2J, GPU-2, 46068, 0, [N/A]\n"),
    );
    let (code, out, _) = cli(&g, &["gpu-info", "g"]);
    assert_eq!(code, exit::GPU_MISMATCH, "{out}");
    assert!(
        out.contains("lists 2 GPUs; the tenant was given one"),
        "{out}"
    );
    assert!(!out.contains('\u{1b}'), "{out:?}");

    // An agent older than gpu-info: a clear refusal, not a guest failure.
    *mode.lock().unwrap() = Guest::Older;
    let (code, _, err) = cli(&g, &["gpu-info", "g"]);
    assert_eq!(code, exit::CONFLICT, "{err}");
    assert!(err.contains("does not support gpu-info"), "{err}");

    // Another tenant's token sees no such tenant; a tenant without a guest agent is 409.
    let plain = tokens["plain"].clone();
    let (code, _, err) = cli(&plain, &["gpu-info", "g"]);
    assert_eq!(code, exit::NOT_FOUND, "{err}");
    let (code, _, err) = cli(&plain, &["gpu-info", "plain"]);
    assert_eq!(code, exit::CONFLICT, "{err}");
    assert!(err.contains("no guest agent"), "{err}");
}
