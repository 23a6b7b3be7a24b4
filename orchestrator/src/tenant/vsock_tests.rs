//! The guest vsock CID of tenants on a backend that reaches agents over vhost-vsock (QEMU
//! where `/dev/vhost-vsock` exists), over the fake host: allocated at launch, kept across
//! stop and start, a CID held by another VM on the host skipped, released at departure.

use crate::auth::Caller;
use crate::domain::lifecycle::LifecycleState;
use crate::domain::spec::TenantSpec;
use crate::tenant::fault::FaultHook;
use crate::tenant::service::TenantCommand;
use crate::tenant::steps::vm::CID_ATTEMPTS;
use crate::tenant::test_utils::Harness;

fn spec(name: &str) -> TenantSpec {
    TenantSpec::from_toml(&format!("name = \"{name}\"\n[image]\nname = \"hello\"\n")).unwrap()
}

fn run(h: &Harness, command: TenantCommand) {
    h.svc.execute(&Caller::Admin, command).unwrap();
    h.svc.wait_idle();
}

fn vhost_host() -> Harness {
    let h = Harness::new(FaultHook::default());
    h.host.state().vhost_vsock = true;
    h
}

fn cid_of(h: &Harness, name: &str) -> Option<u32> {
    let t = h.svc.store().tenant(name).unwrap().unwrap();
    h.svc.store().vsock_cid(t.id).unwrap()
}

fn view(h: &Harness, name: &str) -> crate::api::types::TenantView {
    let t = h.svc.store().tenant(name).unwrap().unwrap();
    crate::api::project::tenant(h.svc.view(&t).unwrap())
}

fn state(h: &Harness, name: &str) -> Option<LifecycleState> {
    h.svc.store().tenant(name).unwrap().map(|t| t.state)
}

#[test]
fn each_tenant_gets_its_own_cid_kept_across_restarts_and_released_at_departure() {
    let h = vhost_host();
    run(&h, TenantCommand::Create(spec("a")));
    run(&h, TenantCommand::Create(spec("b")));
    assert_eq!(state(&h, "a"), Some(LifecycleState::Running));
    assert_eq!((cid_of(&h, "a"), cid_of(&h, "b")), (Some(3), Some(4)));
    // The VM was launched with it, and the agent is reached at it.
    let shown = view(&h, "a");
    assert_eq!(shown.vsock_cid, Some(3));
    assert_eq!(shown.agent_channel.as_deref(), Some("vhost-vsock (CID 3)"));
    assert_eq!(h.svc.agent_transport(), "vhost-vsock");
    run(&h, TenantCommand::Stop("a".into()));
    assert_eq!(view(&h, "a").agent_channel, None);
    run(&h, TenantCommand::Start("a".into()));
    assert_eq!(cid_of(&h, "a"), Some(3), "the same CID after a restart");
    let launches: Vec<_> = h
        .host
        .state()
        .launched_cids
        .iter()
        .filter(|(t, _)| t == "a")
        .map(|(_, c)| *c)
        .collect();
    assert_eq!(launches, [Some(3), Some(3)]);
    let id = h.svc.store().tenant("a").unwrap().unwrap().id;
    run(&h, TenantCommand::Destroy("a".into()));
    assert_eq!(state(&h, "a"), None);
    assert_eq!(h.svc.store().vsock_cid(id).unwrap(), None);
    // Released: the next tenant gets it.
    run(&h, TenantCommand::Create(spec("c")));
    assert_eq!(cid_of(&h, "c"), Some(3));
}

#[test]
fn a_cid_held_by_another_vm_on_the_host_is_skipped_and_the_new_one_kept() {
    let h = vhost_host();
    h.host.state().foreign_cids.extend([3, 4]);
    run(&h, TenantCommand::Create(spec("a")));
    assert_eq!(state(&h, "a"), Some(LifecycleState::Running));
    assert_eq!(cid_of(&h, "a"), Some(5));
    let tried: Vec<_> = h
        .host
        .state()
        .launched_cids
        .iter()
        .map(|(_, c)| *c)
        .collect();
    assert_eq!(tried, [Some(3), Some(4), Some(5)]);
    // While a is stopped another VM takes its CID: a moves on at start.
    run(&h, TenantCommand::Stop("a".into()));
    h.host.state().foreign_cids.insert(5);
    run(&h, TenantCommand::Start("a".into()));
    assert_eq!(state(&h, "a"), Some(LifecycleState::Running));
    assert_eq!(cid_of(&h, "a"), Some(6));
}

#[test]
fn a_host_whose_cids_are_all_busy_fails_the_create_after_bounded_tries() {
    let h = vhost_host();
    h.host.state().foreign_cids.extend(3..1000);
    run(&h, TenantCommand::Create(spec("a")));
    assert_eq!(state(&h, "a"), Some(LifecycleState::Failed));
    let t = h.svc.store().tenant("a").unwrap().unwrap();
    let error = t.error.unwrap_or_default();
    assert!(error.contains("held by another VM"), "{error}");
    assert_eq!(h.host.state().launched_cids.len(), CID_ATTEMPTS);
    assert!(h.host.state().processes.is_empty());
    // Destroying the failed tenant releases whatever CID it held.
    let id = t.id;
    assert!(h.svc.store().vsock_cid(id).unwrap().is_some());
    run(&h, TenantCommand::Destroy("a".into()));
    assert_eq!(state(&h, "a"), None);
    assert_eq!(h.svc.store().vsock_cid(id).unwrap(), None);
}

#[test]
fn backends_without_vhost_vsock_launch_without_a_cid() {
    let h = Harness::new(FaultHook::default());
    run(&h, TenantCommand::Create(spec("a")));
    assert_eq!(state(&h, "a"), Some(LifecycleState::Running));
    assert_eq!(cid_of(&h, "a"), None);
    assert_eq!(h.host.state().launched_cids, [("a".to_string(), None)]);
    let shown = view(&h, "a");
    assert_eq!(shown.vsock_cid, None);
    assert_eq!(shown.agent_channel.as_deref(), Some("virtio-serial"));
}
