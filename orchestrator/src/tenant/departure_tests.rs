//! Departure over the fake host: receipts, crypto-shred, quarantine, resume after a failed
//! step and after a crash at every destroy step boundary.

use crate::auth::Caller;
use crate::disk::key_opens;
use crate::domain::lifecycle::LifecycleState;
use crate::domain::spec::TenantSpec;
use crate::receipt::{DepartureStep, StepResult};
use crate::reconcile::{reconcile, ReconcileOptions};
use crate::tenant::fault::{Boundary, FaultHook};
use crate::tenant::service::{CommandOutcome, TenantCommand};
use crate::tenant::steps::disk::image_path;
use crate::tenant::steps::Op;
use crate::tenant::test_utils::Harness;

fn spec(name: &str, gpu: &str, disk_gib: u32) -> TenantSpec {
    TenantSpec::from_toml(&format!(
        "name = \"{name}\"\ndisk_gib = {disk_gib}\ngpu = {gpu}\n[image]\nname = \"hello\"\n"
    ))
    .unwrap()
}

fn run(h: &Harness, cmd: TenantCommand) -> CommandOutcome {
    let out = h.svc.execute(&Caller::Admin, cmd).unwrap();
    h.svc.wait_idle();
    out
}

fn state(h: &Harness, name: &str) -> Option<LifecycleState> {
    h.svc.store().tenant(name).unwrap().map(|t| t.state)
}

fn log_intact(h: &Harness) -> bool {
    let kit = h.svc.departure_kit().unwrap();
    kit.log
        .verify(&kit.signer.verifying_key())
        .unwrap()
        .is_intact()
}

#[test]
fn destroy_shreds_the_disk_and_appends_one_complete_receipt() {
    let h = Harness::new(FaultHook::default());
    run(
        &h,
        TenantCommand::Create(spec(
            "alice",
            "{ kind = \"mig\", profile = \"1g.10gb\" }",
            1,
        )),
    );
    assert_eq!(state(&h, "alice"), Some(LifecycleState::Running));
    let image = image_path(h.svc.config(), "alice");
    let kit = h.svc.departure_kit().unwrap();
    let key = kit.keys.unwrap("alice").unwrap();
    assert!(key_opens(&image, &key).unwrap());
    // A hard link keeps the bytes reachable after the unlink, to check the header.
    let keep = h.dir.path().join("alice-image-link");
    std::fs::hard_link(&image, &keep).unwrap();

    run(&h, TenantCommand::Destroy("alice".into()));
    assert_eq!(state(&h, "alice"), None);
    assert!(!image.exists(), "image left");
    assert!(!kit.keys.exists("alice").unwrap(), "wrapped key left");
    assert!(
        !key_opens(&keep, &key).unwrap(),
        "old key still opens the header"
    );

    let entries = h.receipts_of("alice");
    assert_eq!(entries.len(), 1);
    let r = &entries[0].receipt;
    let steps: Vec<_> = r.steps.iter().map(|s| s.step).collect();
    assert_eq!(
        steps,
        [
            DepartureStep::GatewayRouteOff,
            DepartureStep::AgentShutdown,
            DepartureStep::DeviceReset,
            DepartureStep::GpuScrub,
            DepartureStep::GpuRelease,
            DepartureStep::CryptoShred,
            DepartureStep::LogsRemoved,
        ]
    );
    assert!(r.succeeded(), "{r:#?}");
    assert!(r.simulated(), "the fake GPU's scrub must say simulated");
    let shred = r
        .steps
        .iter()
        .find(|s| s.step == DepartureStep::CryptoShred)
        .unwrap();
    assert_eq!(shred.result, StepResult::Ok);
    assert!(log_intact(&h));
}

#[test]
fn tenants_without_disk_or_gpu_get_honest_skips() {
    let h = Harness::new(FaultHook::default());
    run(
        &h,
        TenantCommand::Create(spec("bob", "{ kind = \"none\" }", 0)),
    );
    run(&h, TenantCommand::Destroy("bob".into()));
    let r = &h.receipts_of("bob")[0].receipt;
    for step in [
        DepartureStep::GatewayRouteOff,
        DepartureStep::DeviceReset,
        DepartureStep::GpuScrub,
        DepartureStep::CryptoShred,
    ] {
        let s = r.steps.iter().find(|s| s.step == step).unwrap();
        assert_eq!(s.result, StepResult::Skipped, "{step:?}");
    }
    let reset = r
        .steps
        .iter()
        .find(|s| s.step == DepartureStep::DeviceReset)
        .unwrap();
    assert!(reset.method.contains("no device"), "{}", reset.method);
}

#[test]
fn failed_scrub_quarantines_the_slice_until_a_scrub_passes() {
    let h = Harness::new(FaultHook::default());
    // 4g = 4 of the fake GPU's 8 slots: two placements, 4@0 and 4@4.
    let gpu = "{ kind = \"mig\", profile = \"4g.20gb\" }";
    run(&h, TenantCommand::Create(spec("a", gpu, 0)));
    let label = h
        .svc
        .store()
        .gpu_placement(h.svc.store().tenant("a").unwrap().unwrap().id)
        .unwrap()
        .unwrap()
        .label;
    h.fail_scrub.lock().unwrap().insert(label.clone());
    run(&h, TenantCommand::Destroy("a".into()));
    // The departure still finished (the disk would still be shredded), the slice is out.
    assert_eq!(state(&h, "a"), None);
    let scrub = h.receipts_of("a")[0]
        .receipt
        .steps
        .iter()
        .find(|s| s.step == DepartureStep::GpuScrub)
        .cloned()
        .unwrap();
    assert_eq!(scrub.result, StepResult::Failed);
    assert_eq!(scrub.evidence["quarantined"], "true");
    let q = h.svc.store().quarantined().unwrap();
    assert_eq!(q.len(), 1);
    let slice = q[0].id();

    // Two more tenants: one gets the other placement, the next finds nothing.
    run(&h, TenantCommand::Create(spec("b", gpu, 0)));
    assert_eq!(state(&h, "b"), Some(LifecycleState::Running));
    let b = h.svc.store().tenant("b").unwrap().unwrap();
    assert_ne!(
        h.svc.store().gpu_placement(b.id).unwrap().unwrap().label,
        label
    );
    run(&h, TenantCommand::Create(spec("c", gpu, 0)));
    assert_eq!(state(&h, "c"), Some(LifecycleState::Failed));
    run(&h, TenantCommand::Destroy("c".into()));

    // A scrub that fails again keeps it; one that passes lifts it.
    let CommandOutcome::Rescrubbed(out) = run(&h, TenantCommand::Rescrub(slice.clone())) else {
        panic!()
    };
    assert!(!out.lifted && !out.scrub.passed);
    assert_eq!(h.svc.store().quarantined().unwrap().len(), 1);
    h.fail_scrub.lock().unwrap().clear();
    let CommandOutcome::Rescrubbed(out) = run(&h, TenantCommand::Rescrub(slice.clone())) else {
        panic!()
    };
    assert!(out.lifted);
    assert!(h.svc.store().quarantined().unwrap().is_empty());
    run(&h, TenantCommand::Create(spec("c", gpu, 0)));
    assert_eq!(state(&h, "c"), Some(LifecycleState::Running));
    // Unknown slices and tenant tokens are refused.
    h.svc
        .execute(&Caller::Admin, TenantCommand::Rescrub("9/none".into()))
        .unwrap_err();
    h.svc
        .execute(&Caller::Tenant(b.id), TenantCommand::Rescrub(slice))
        .unwrap_err();
}

#[test]
fn a_failed_step_leaves_destroying_and_destroy_again_resumes() {
    let h = Harness::new(FaultHook::default());
    run(
        &h,
        TenantCommand::Create(spec("d", "{ kind = \"none\" }", 1)),
    );
    // An audit log that cannot be opened (a directory in its place) refuses appends:
    // write-receipt fails. (A damaged log no longer does: it is set aside.)
    let log = h.svc.config().departure.audit_log.clone();
    std::fs::create_dir_all(&log).unwrap();
    run(&h, TenantCommand::Destroy("d".into()));
    let t = h.svc.store().tenant("d").unwrap().unwrap();
    assert_eq!(t.state, LifecycleState::Destroying);
    assert!(
        t.error.as_deref().unwrap().contains("write-receipt"),
        "{:?}",
        t.error
    );
    // Everything before the failed step is done: the disk is gone already.
    assert!(!image_path(h.svc.config(), "d").exists());

    std::fs::remove_dir(&log).unwrap();
    run(&h, TenantCommand::Destroy("d".into()));
    assert_eq!(state(&h, "d"), None);
    let entries = h.receipts_of("d");
    assert_eq!(entries.len(), 1);
    let shred = entries[0]
        .receipt
        .steps
        .iter()
        .find(|s| s.step == DepartureStep::CryptoShred)
        .unwrap();
    // The shred's evidence from the first run survived the resume.
    assert_eq!(
        shred.evidence.get("old_key_rejected").map(String::as_str),
        Some("true")
    );
}

#[test]
fn a_crash_at_every_destroy_boundary_ends_with_exactly_one_receipt() {
    for step in Op::Destroy.steps() {
        for boundary in [Boundary::Before, Boundary::After] {
            let case = format!("{}:{boundary:?}", step.name());
            let mut h = Harness::new(FaultHook::default());
            run(
                &h,
                TenantCommand::Create(spec("e", "{ kind = \"mig\", profile = \"1g.10gb\" }", 1)),
            );
            let image = image_path(h.svc.config(), "e");
            h.restart(FaultHook::fail_at("destroy", step.name(), boundary));
            run(&h, TenantCommand::Destroy("e".into()));
            h.restart(FaultHook::default());
            reconcile(&h.svc, &ReconcileOptions::default()).unwrap();
            h.svc.wait_idle();
            assert_eq!(state(&h, "e"), None, "{case}");
            assert!(!image.exists(), "{case}: image left");
            let kit = h.svc.departure_kit().unwrap();
            assert!(!kit.keys.exists("e").unwrap(), "{case}: key left");
            let entries = h.receipts_of("e");
            assert_eq!(entries.len(), 1, "{case}");
            assert_eq!(entries[0].receipt.steps.len(), 7, "{case}");
            assert!(
                entries[0].receipt.succeeded(),
                "{case}: {:#?}",
                entries[0].receipt
            );
            assert!(log_intact(&h), "{case}");
        }
    }
}

/// The receipt line of the VM's stop in `name`'s departure.
fn stop_line(h: &Harness, name: &str) -> crate::receipt::StepRecord {
    h.receipts_of(name)[0]
        .receipt
        .steps
        .iter()
        .find(|s| s.step == DepartureStep::AgentShutdown)
        .cloned()
        .unwrap()
}

#[test]
fn the_stop_line_states_what_happened_to_a_vm_that_stopped_on_request() {
    let h = Harness::new(FaultHook::default());
    run(
        &h,
        TenantCommand::Create(spec("bob", "{ kind = \"none\" }", 0)),
    );
    run(&h, TenantCommand::Destroy("bob".into()));
    let line = stop_line(&h, "bob");
    assert_eq!(line.result, StepResult::Ok);
    // The VMM stopped on request: nothing was killed, so nothing says so.
    assert!(!line.method.contains("SIGKILL"), "{}", line.method);
    assert_eq!(line.evidence["found"], "running", "{line:#?}");
    assert!(
        line.evidence["ended"].contains("stopped on request"),
        "{line:#?}"
    );
    assert!(
        line.evidence["elapsed_ms"].parse::<u64>().is_ok(),
        "{line:#?}"
    );
    assert_eq!(line.evidence["grace_ms"], "500", "{line:#?}");
}

#[test]
fn a_running_vm_whose_control_socket_is_silent_is_not_recorded_as_not_running() {
    let h = Harness::new(FaultHook::default());
    run(
        &h,
        TenantCommand::Create(spec("q", "{ kind = \"none\" }", 0)),
    );
    // A guest-image tenant (its agent cannot be reached here) whose VMM stopped answering.
    let t = h.svc.store().tenant("q").unwrap().unwrap();
    h.svc
        .store()
        .set_guest(t.id, crate::domain::GuestKind::Agent)
        .unwrap();
    let pid = *h.host.state().processes.keys().next().unwrap();
    h.host.state().unresponsive.insert(pid);
    run(&h, TenantCommand::Destroy("q".into()));
    assert_eq!(state(&h, "q"), None);
    let line = stop_line(&h, "q");
    assert!(!line.method.contains("not running"), "{line:#?}");
    assert_eq!(line.result, StepResult::Ok, "{line:#?}");
    assert!(
        line.evidence["found"].contains("not answering"),
        "{line:#?}"
    );
    assert!(line.evidence["agent"].contains("not reached"), "{line:#?}");
    assert!(line.evidence["ended"].contains("signal 9"), "{line:#?}");
    assert!(line.method.contains("SIGKILL"), "{line:#?}");
}

/// A FAKE agent for `name` that answers every request with an error of `bytes` bytes of
/// text (newlines and escapes included), as a hostile guest would at its departure.
fn serve_a_verbose_agent(h: &Harness, name: &str, bytes: usize) {
    use tenantvm_agent_protocol::{
        encode_frame, read_frame, AgentFailure, ErrorCode, Outcome, RequestFrame, ResponseFrame,
    };
    let listener = crate::tenant::test_utils::fake_agent_socket(&h.svc, name);
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(mut s) = s else { return };
            std::thread::spawn(move || {
                let mut line = [0u8; 13];
                if std::io::Read::read_exact(&mut s, &mut line).is_err() {
                    return;
                }
                let _ = std::io::Write::write_all(&mut s, b"OK 1\n");
                while let Ok(body) = read_frame(&mut s) {
                    let Ok(req) = tenantvm_agent_protocol::decode_body::<RequestFrame>(&body)
                    else {
                        return;
                    };
                    let message = "mallory says:\n\x1b[2K".repeat(bytes / 20);
                    let frame = encode_frame(&ResponseFrame {
                        id: req.id,
                        outcome: Outcome::Err(AgentFailure {
                            code: ErrorCode::BadRequest,
                            message,
                        }),
                    })
                    .unwrap();
                    if std::io::Write::write_all(&mut s, &frame).is_err() {
                        return;
                    }
                }
            });
        }
    });
}

#[test]
fn a_departing_guest_that_answers_with_megabytes_of_text_gets_a_bounded_receipt_row() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        tenantvm_skip::skip!("needs root to serve agent sockets as tenant uids");
    }
    let h = Harness::new(FaultHook::default());
    h.host.state().agent_vsock = true;
    run(
        &h,
        TenantCommand::Create(spec("verbose", "{ kind = \"none\" }", 0)),
    );
    let t = h.svc.store().tenant("verbose").unwrap().unwrap();
    // Within one 4 MiB frame of the agent protocol.
    serve_a_verbose_agent(&h, "verbose", 3 << 20);
    run(&h, TenantCommand::Destroy("verbose".into()));
    let (receipt, _) = h.svc.store().departure(t.id).unwrap().unwrap();
    let row = serde_json::to_string(&receipt).unwrap();
    let line = stop_line(&h, "verbose");
    // The control: the guest's text did reach the stop's record.
    assert!(line.method.contains("mallory says"), "{line:#?}");
    assert!(
        row.len() < 64 * 1024,
        "the stored receipt is {} bytes",
        row.len()
    );
    // Escaped where it was recorded, not only in the audit log.
    let stored_line = receipt
        .steps
        .iter()
        .find(|s| s.step == DepartureStep::AgentShutdown)
        .unwrap();
    assert!(
        !stored_line.method.contains('\n') && !stored_line.method.contains('\x1b'),
        "{:?}",
        &stored_line.method[..200.min(stored_line.method.len())]
    );
}

#[test]
fn the_receipt_a_tenant_reads_names_no_host_path() {
    let h = Harness::new(FaultHook::default());
    run(
        &h,
        TenantCommand::Create(spec(
            "alice",
            "{ kind = \"mig\", profile = \"1g.10gb\" }",
            1,
        )),
    );
    let id = h.svc.store().tenant("alice").unwrap().unwrap().id;
    run(&h, TenantCommand::Destroy("alice".into()));
    let CommandOutcome::Receipts(entries) = h
        .svc
        .execute(&Caller::Tenant(id), TenantCommand::Receipts(None))
        .unwrap()
    else {
        panic!("not receipts")
    };
    assert_eq!(entries.len(), 1);
    let text = serde_json::to_string(&entries).unwrap();
    // The control: the shred's evidence names the image it destroyed.
    assert!(text.contains("disk.img"), "{text}");
    let state = h.svc.config().state_dir.display().to_string();
    let root = h.dir.path().display().to_string();
    assert!(
        !text.contains(&state) && !text.contains(&root),
        "a host path in the tenant's receipt: {text}"
    );
}
