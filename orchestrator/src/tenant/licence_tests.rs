//! A tenant's vGPU licence token through the service, over the fake host with a FAKE guest
//! agent: sealed at create (never in plaintext on disk, never in a log, an event or an API
//! answer), delivered to the agent before the payload starts, delivered again at the next
//! boot, and crypto-shredded at departure with the receipt saying so.

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tenantvm_agent_protocol::{
    decode_body, encode_frame, read_frame, AgentFailure, DiskState, ErrorCode, Outcome,
    PayloadState, Reply, Request, RequestFrame, ResponseFrame, ShutdownReport, StatusReply,
};

use crate::auth::Caller;
use crate::domain::lifecycle::LifecycleState;
use crate::domain::spec::TenantSpec;
use crate::receipt::{Assurance, DepartureStep};
use crate::tenant::fault::FaultHook;
use crate::tenant::service::{CommandOutcome, TenantCommand, TenantServiceError};
use crate::tenant::test_utils::Harness;
use crate::test_support::{captured_log, files_holding};

/// The token's text: what must never appear outside the guest.
const SECRET: &str = "licence-plaintext-d41c7b93";

fn token() -> String {
    format!("eyJhbGciOiJSUzI1NiJ9.{SECRET}.c2lnbmF0dXJl\n")
}

/// A FAKE guest image set named `set` in the harness's image directory (a manifest with the
/// files' hashes), so the tenant's guest kind is "runs the agent".
fn image_set(h: &Harness) {
    let dir = h.dir.path().join("images/set");
    std::fs::create_dir_all(&dir).unwrap();
    let mut files = serde_json::Map::new();
    for (name, content) in [
        ("vmlinuz", "kernel"),
        ("vmlinux", "elf kernel"),
        ("initramfs.cpio.gz", "initramfs"),
        ("cmdline", "console=ttyS0\n"),
    ] {
        std::fs::write(dir.join(name), content).unwrap();
        files.insert(
            name.into(),
            serde_json::json!({"sha256": hex::encode(Sha256::digest(content))}),
        );
    }
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::json!({ "files": files }).to_string(),
    )
    .unwrap();
}

fn spec(name: &str, licence: Option<&str>, image: &str) -> TenantSpec {
    let mut text = format!(
        "name = \"{name}\"\ndisk_gib = 1\ngpu = {{ whole_gpu = true }}\n[image]\nname = \"{image}\"\n"
    );
    if let Some(l) = licence {
        text = format!(
            "vgpu_licence = {}\n{text}",
            serde_json::to_string(l).unwrap()
        );
    }
    TenantSpec::from_toml(&text).unwrap()
}

/// What the FAKE agent was handed.
#[derive(Default)]
struct Guest {
    licences: Vec<Vec<u8>>,
}

fn answer(s: &mut UnixStream, id: u64, outcome: Outcome) {
    let frame = encode_frame(&ResponseFrame { id, outcome }).unwrap();
    let _ = s.write_all(&frame);
}

/// Serves one connection as a guest whose disk is mounted and payload ready; `shutdown`
/// powers the fake VM off.
fn serve(mut s: UnixStream, guest: Arc<Mutex<Guest>>, power_off: impl Fn()) {
    while let Ok(body) = read_frame(&mut s) {
        let Ok(req) = decode_body::<RequestFrame>(&body) else {
            return;
        };
        let running = PayloadState::Running {
            pid: 7,
            ready: true,
            restarts: 0,
        };
        let reply = match req.request {
            Request::Status => Reply::Status(StatusReply {
                agent_version: "fake".into(),
                protocol: tenantvm_agent_protocol::PROTOCOL_VERSION,
                channel: "fake".into(),
                uptime_ms: 1,
                disk: DiskState::Mounted,
                payload: running,
            }),
            Request::InstallLicence { token } => {
                guest.lock().unwrap().licences.push(token.expose().to_vec());
                Reply::LicenceInstalled
            }
            Request::Health => Reply::Health { payload: running },
            Request::Shutdown => {
                let report = ShutdownReport {
                    payload_stopped: true,
                    unmounted: true,
                    disk_closed: true,
                };
                answer(&mut s, req.id, Outcome::Ok(Reply::ShuttingDown(report)));
                power_off();
                return;
            }
            _ => {
                answer(
                    &mut s,
                    req.id,
                    Outcome::Err(AgentFailure {
                        code: ErrorCode::BadRequest,
                        message: "not served by this fake".into(),
                    }),
                );
                continue;
            }
        };
        answer(&mut s, req.id, Outcome::Ok(reply));
    }
}

/// Once tenant `name`'s VM is recorded, serves its agent channel as the tenant's uid, on
/// a thread, for each VM it gets (a restart makes a new one). A new VM's listener is bound
/// beside the socket and renamed over it, so a connection never finds the path missing;
/// `shutdown` powers off whichever VM the tenant has.
fn fake_agent(h: &Harness, name: &'static str, guest: Arc<Mutex<Guest>>) {
    let svc = h.svc.clone();
    let host = h.host.clone();
    std::thread::spawn(move || {
        let mut served_pid = None;
        let deadline = Instant::now() + Duration::from_secs(300);
        while Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            let Ok(Some(t)) = svc.store().tenant(name) else {
                continue;
            };
            let ctx = svc.ctx();
            let Some(vm) = crate::tenant::context::Tenant::load(&ctx, &t)
                .ok()
                .and_then(|t| t.vm)
            else {
                continue;
            };
            if served_pid == Some(vm.pid) {
                continue;
            }
            let sock = crate::tenant::steps::guest::agent_endpoint(ctx.backend, &vm)
                .path()
                .unwrap()
                .to_path_buf();
            std::fs::create_dir_all(sock.parent().unwrap()).unwrap();
            let fresh = sock.with_extension("new");
            let _ = std::fs::remove_file(&fresh);
            let listener: UnixListener =
                crate::test_support::peercred::listen_as(&fresh, vm.uid).unwrap();
            std::fs::rename(&fresh, &sock).unwrap();
            served_pid = Some(vm.pid);
            let guest = guest.clone();
            let host = host.clone();
            std::thread::spawn(move || {
                for s in listener.incoming() {
                    let Ok(s) = s else { return };
                    let (guest, host) = (guest.clone(), host.clone());
                    std::thread::spawn(move || {
                        serve(s, guest, || {
                            host.state().processes.retain(|_, t| t != name);
                        });
                    });
                }
            });
        }
    });
}

fn run(h: &Harness, command: TenantCommand) -> CommandOutcome {
    let out = h.svc.execute(&Caller::Admin, command).unwrap();
    h.svc.wait_idle();
    out
}

fn state(h: &Harness, name: &str) -> Option<LifecycleState> {
    h.svc.store().tenant(name).unwrap().map(|t| t.state)
}

fn holders(dir: &Path) -> Vec<std::path::PathBuf> {
    files_holding(dir, SECRET.as_bytes())
}

#[test]
fn the_licence_is_sealed_delivered_at_each_boot_never_shown_and_shredded_at_departure() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        tenantvm_skip::skip!("needs root to serve the agent socket as the tenant's uid");
    }
    let log = captured_log();
    let h = Harness::new(FaultHook::default());
    image_set(&h);
    let guest = Arc::new(Mutex::new(Guest::default()));
    fake_agent(&h, "lic", guest.clone());
    let created = run(
        &h,
        TenantCommand::Create(spec("lic", Some(&token()), "set")),
    );
    assert_eq!(
        state(&h, "lic"),
        Some(LifecycleState::Running),
        "{:?}",
        h.svc.store().tenant("lic").unwrap().and_then(|t| t.error)
    );
    // Delivered, byte for byte, once.
    assert_eq!(guest.lock().unwrap().licences, [token().into_bytes()]);
    // Nowhere in plaintext on the host's disk: the store (and its WAL), the key directory,
    // the tenant's directory and its disk image, the logs. The control: the scan finds
    // what is there.
    assert_eq!(holders(h.dir.path()), Vec::<std::path::PathBuf>::new());
    std::fs::write(h.dir.path().join("control"), token()).unwrap();
    assert_eq!(holders(h.dir.path()).len(), 1);
    std::fs::remove_file(h.dir.path().join("control")).unwrap();
    // Sealed in the key directory.
    let kit = h.svc.departure_kit().unwrap();
    assert!(kit.keys.has_licence("lic").unwrap());
    // Not in the API's answers, nor the stored spec.
    let CommandOutcome::Created(c) = created else {
        panic!("{created:?}")
    };
    // What the API sends: the answer as projected onto the wire.
    let wire = serde_json::to_string(&crate::api::project::created(c)).unwrap();
    assert!(!wire.contains(SECRET));
    let t = h.svc.store().tenant("lic").unwrap().unwrap();
    assert_eq!(t.spec.vgpu_licence, None);
    let CommandOutcome::Tenant(shown) = run(&h, TenantCommand::Status("lic".into())) else {
        panic!("status answers a tenant")
    };
    let wire = serde_json::to_string(&crate::api::project::tenant(shown)).unwrap();
    assert!(!wire.contains(SECRET));

    // A restart of the VM: the guest's RAM is new, the token is delivered again.
    run(&h, TenantCommand::Stop("lic".into()));
    run(&h, TenantCommand::Start("lic".into()));
    assert_eq!(
        state(&h, "lic"),
        Some(LifecycleState::Running),
        "{:?}",
        h.svc.store().tenant("lic").unwrap().and_then(|t| t.error)
    );
    assert_eq!(guest.lock().unwrap().licences.len(), 2);

    // Departure: the sealed copy destroyed, and the receipt says so.
    run(&h, TenantCommand::Destroy("lic".into()));
    assert_eq!(state(&h, "lic"), None);
    assert!(!kit.keys.has_licence("lic").unwrap());
    let shred = h.departure_step("lic", DepartureStep::CryptoShred);
    assert!(
        shred.evidence["vgpu_licence"].contains("overwritten and removed"),
        "{shred:?}"
    );
    assert_eq!(shred.evidence["vgpu_licence_absent"], "true");
    assert_eq!(shred.assurance, Assurance::Verified, "{shred:?}");
    // Never in any log line the daemon wrote, nor any file after departure either.
    let logged = String::from_utf8_lossy(&log.lock().unwrap()).to_string();
    assert!(!logged.contains(SECRET), "the token reached the log");
    assert!(logged.contains("vGPU licence token delivered"), "{logged}");
    assert_eq!(holders(h.dir.path()), Vec::<std::path::PathBuf>::new());
}

#[test]
fn a_licence_needs_a_gpu_and_an_agent_and_a_refused_create_leaves_nothing() {
    let h = Harness::new(FaultHook::default());
    image_set(&h);
    // A plain kernel has no agent to install it.
    let err = h
        .svc
        .execute(
            &Caller::Admin,
            TenantCommand::Create(spec("plain", Some(&token()), "hello")),
        )
        .unwrap_err();
    assert!(
        matches!(&err, TenantServiceError::Image(m) if m.contains("vgpu_licence")),
        "{err}"
    );
    assert!(!err.to_string().contains(SECRET));
    assert_eq!(state(&h, "plain"), None);
    // Without a GPU, the spec itself is refused.
    let no_gpu = format!(
        "vgpu_licence = {}\nname = \"x\"\n[image]\nname = \"set\"\n",
        serde_json::to_string(&token()).unwrap()
    );
    let err = TenantSpec::from_toml(&no_gpu).unwrap_err();
    assert!(err.to_string().contains("GPU share"), "{err}");
    assert!(!err.to_string().contains(SECRET));
    assert!(holders(h.dir.path()).is_empty());
    // A name already taken keeps its own sealed licence: a second create is refused
    // before anything is sealed.
    let kit = h.svc.departure_kit().unwrap();
    h.svc
        .execute(
            &Caller::Admin,
            TenantCommand::Create(spec("taken", Some(&token()), "set")),
        )
        .unwrap();
    let err = h
        .svc
        .execute(
            &Caller::Admin,
            TenantCommand::Create(spec("taken", Some("another-token"), "set")),
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            TenantServiceError::Store(crate::store::StoreError::DuplicateName(_))
                | TenantServiceError::Busy(_)
        ),
        "{err}"
    );
    assert_eq!(
        kit.keys.licence("taken").unwrap().unwrap().as_slice(),
        token().as_bytes()
    );
    h.svc.request_stop();
    h.svc.wait_idle();
}

#[test]
fn a_stale_sealed_licence_from_a_crashed_create_never_reaches_a_new_tenant_of_that_name() {
    let h = Harness::new(FaultHook::default());
    let kit = h.svc.departure_kit().unwrap();
    // What a create killed between sealing and recording leaves.
    kit.keys.store_licence("fresh", b"stale-token").unwrap();
    run(&h, TenantCommand::Create(spec("fresh", None, "hello")));
    assert!(!kit.keys.has_licence("fresh").unwrap());
}
