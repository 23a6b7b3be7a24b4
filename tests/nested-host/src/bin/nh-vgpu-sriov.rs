//! The gpu-vgpu-sriov scenario's program: the daemon's MIG-backed vGPU route on a real
//! SR-IOV physical function, end to end through a real tenantvmd.
//!
//! ```text
//! nh-vgpu-sriov PF HOOK                       the end-to-end checks below
//! nh-vgpu-sriov bench PF HOOK WHOLE [N]       a VF tenant's create-to-running against a
//!                                             whole-device tenant's (a benchmark)
//! ```
//! PF: QEMU's SR-IOV nvme (8086:5845) on the nvme driver, its VFs off, its flexible
//! resources released by the primary controller and `sriov_drivers_autoprobe` 0 (the
//! scenario script prepares it: what installing the vendor's driver does for a GPU);
//! HOOK: the program that brings one of its secondary controllers online or offline
//! (`HOOK online|offline PF VF`, tests/nested-host/nvme-vf.sh); WHOLE: QEMU's plain nvme
//! (1b36:0010) on no driver, given whole as the peer of the benchmark.
//! env: NH_BIN, NH_TEST_GUESTS, NH_WORK; NH_NOTES (optional: figures). Runs as root with
//! cgroup v2 mounted, vfio-pci loaded and nvme-cli installed.
//!
//! The daemon runs with a SIMULATED GPU host file that places an H100 (MIG, SR-IOV vGPU)
//! at the PF's address, naming HOOK as its `vf_hook`, and `--gpu-sysfs-root /`: MIG, the
//! GPU instance, the vGPU type on the VF and the scrub are simulated (the SIMULATED NVIDIA
//! driver, `tenantvm_gpu::backend::sim::vendor`), while enabling and disabling the VFs
//! (`sriov_numvfs`), the VF itself, its IOMMU group, VFIO and the VMM's passthrough are
//! this host's real kernel.
//!
//! Checks, in order:
//! 1. `tenantvm create` of two tenants (the no_std test guest, `tvm.test=vfio-nvme-hold`),
//!    each with `gpu = { profile = "1g.10gb" }`, on one daemon: each reaches `running`;
//!    the PF has its VFs (the kernel's `sriov_numvfs`, set by the first tenant's
//!    prepare-gpu-host); each tenant's VMM config names a VF of its own, on vfio-pci,
//!    alone in its IOMMU group, whose secondary controller the hook brought online
//!    (nvme-cli's `list-secondary`); each guest enabled that controller, got Identify by
//!    MSI-X, and its controller id is that VF's secondary controller id;
//! 2. `tenantvm destroy` of the first: its VF is off vfio-pci, its override cleared, its
//!    controller offline (the hook called `online`, then `offline` for it); the PF keeps
//!    its VFs and the second tenant runs on; the receipt's gpu-release line names the real
//!    parts and the SIMULATED ones, the VF and its type, the PF's VF count (2), and 2 after
//!    release-gpu; device-reset carries the VMM's own reset of the VF at detach; gpu-scrub
//!    is `simulated`;
//! 3. `tenantvm destroy` of the second: the same receipt with 0 VFs after release-gpu; the
//!    PF's VFs are disabled (sriov_numvfs 0, no `virtfn` link, both VFs gone from sysfs);
//!    the simulated host has no instance, no VFs and MIG off again;
//! 4. with a fresh state directory, a daemon armed with `create:bind-gpu:after` SIGKILLs
//!    itself with a VF typed and on vfio-pci and no `tenantvm-vmm` process; restarted, it
//!    converges: the create is resumed (its guest gets Identify from that VF's secondary
//!    controller again; destroyed) or rolled back, and the
//!    PF's VFs end disabled. A tenantvmd without the `test-hooks` feature has no crash
//!    hook: the reason goes to `NH_WORK/crash-check-skipped` and the scenario reports SKIP.
//!
//! `bench`: N rounds (default 3), each creating the same test guest once with a VF (as
//! above) and once with WHOLE given whole (a SIMULATED whole-only GPU at its address), each
//! on a fresh daemon, and destroying it; create-to-running medians, the ratio and the create
//! steps that differ, as NOTE lines.

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};
use tenantvm_nested_host::gpu_tenant::{
    create_step_times, destroy, driver_of, guest_report, median, receipt_step, receipt_steps,
    simulated_scrub, test_guest_image, timed_create, vmm_reset_of, wait_running, Cli, Setup,
    LIFECYCLE_TIMEOUT_S,
};
use tenantvm_nested_host::scenario::{env_path, note, Daemon};

/// The tenant's name.
const NAME: &str = "nh-vgpu";
/// The second tenant's name (two vGPU tenants on one card at once).
const NAME_B: &str = "nh-vgpu-b";
/// Written to NH_WORK, with the reason, when the crash check cannot run.
const CRASH_SKIPPED: &str = "crash-check-skipped";
/// How long the guest may take to report after the tenant is running.
const GUEST_REPORT_TIMEOUT: Duration = Duration::from_secs(120);
/// The test the guest runs.
const GUEST_TEST: &str = "vfio-nvme-hold";

fn sysfs(address: &str, attr: &str) -> String {
    std::fs::read_to_string(format!("/sys/bus/pci/devices/{address}/{attr}"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The PF's VFs, from its `virtfnN` links, in VF order (VF number N + 1).
fn vfs_of(pf: &str) -> Vec<String> {
    let mut v: Vec<(u32, String)> = std::fs::read_dir(format!("/sys/bus/pci/devices/{pf}"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let n: u32 = name.strip_prefix("virtfn")?.parse().ok()?;
                    let target = std::fs::read_link(e.path()).ok()?;
                    Some((n, target.file_name()?.to_string_lossy().into_owned()))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v.into_iter().map(|(_, a)| a).collect()
}

fn iommu_group(address: &str) -> Option<u32> {
    std::fs::read_link(format!("/sys/bus/pci/devices/{address}/iommu_group"))
        .ok()?
        .file_name()?
        .to_str()?
        .parse()
        .ok()
}

/// The PF's controller device (`/dev/nvme0`), from sysfs.
fn pf_controller(pf: &str) -> Result<String, String> {
    std::fs::read_dir(format!("/sys/bus/pci/devices/{pf}/nvme"))
        .ok()
        .and_then(|mut d| d.next())
        .and_then(|e| e.ok())
        .map(|e| format!("/dev/{}", e.file_name().to_string_lossy()))
        .ok_or_else(|| format!("{pf} has no NVMe controller (is it on the nvme driver?)"))
}

/// (secondary controller id, online) of VF number `vfn` (1-based), from nvme-cli's
/// `list-secondary` of the PF's controller.
fn secondary(pf: &str, vfn: usize) -> Result<(u32, bool), String> {
    let dev = pf_controller(pf)?;
    let o = std::process::Command::new("nvme")
        .args(["list-secondary", &dev])
        .output()
        .map_err(|e| format!("nvme list-secondary: {e}"))?;
    let text = String::from_utf8_lossy(&o.stdout);
    let field = |line: &str| -> Option<u32> {
        let v = line.rsplit(':').next()?.split_whitespace().next()?;
        u32::from_str_radix(v.trim_start_matches("0x"), 16).ok()
    };
    let (mut scid, mut state) = (None, None);
    for line in text.lines() {
        let l = line.trim_start();
        if l.starts_with("SCID") {
            scid = field(l);
        } else if l.starts_with("SCS") {
            state = field(l);
        } else if l.starts_with("VFN") && field(l) == Some(vfn as u32) {
            if let (Some(id), Some(s)) = (scid, state) {
                return Ok((id, s & 1 == 1));
            }
        }
    }
    Err(format!(
        "nvme list-secondary {dev} names no VF {vfn}:\n{text}{}",
        String::from_utf8_lossy(&o.stderr)
    ))
}

/// The SIMULATED host: an H100 with SR-IOV vGPU at the PF (its VFs prepared by `hook`),
/// or, with `whole`, only a whole-only L40S at that address (the benchmark's peer: its own
/// host file, so that the whole request cannot land on the H100); the image and the specs.
fn write_setup(pf: &str, hook: &str, whole: Option<&str>) -> Result<Setup, String> {
    let bin = env_path("NH_BIN")?;
    let work = env_path("NH_WORK")?;
    let (sim, host) = match whole {
        None => (
            work.join("sim-host.json"),
            serde_json::json!({
                "comment": "SIMULATED: an H100 with MIG-backed vGPU at the address of QEMU's SR-IOV nvme; its VFs are real",
                "gpus": [{"index": 0, "model": "h100-80gb", "pci_address": pf,
                    "driver": "570.124.06", "vgpu": "sriov", "mig_enabled": false,
                    "iommu_group": iommu_group(pf), "vf_hook": [hook]}]
            }),
        ),
        Some(w) => (
            work.join("sim-whole.json"),
            serde_json::json!({
                "comment": "SIMULATED: a whole-only GPU at the address of QEMU's plain nvme",
                "gpus": [{"index": 0, "model": "l40s", "pci_address": w,
                    "driver": "570.124.06", "vgpu": "none", "iommu_group": iommu_group(w)}]
            }),
        ),
    };
    std::fs::write(&sim, host.to_string()).map_err(|e| e.to_string())?;
    let images = work.join("img");
    test_guest_image(&images, "nvme-guest", GUEST_TEST)?;
    let spec = |name: &str, gpu: &str| {
        format!(
            "name = \"{name}\"\nvcpus = 1\nmemory_mib = 128\ngpu = {{ {gpu} }}\n\
             [image]\nname = \"nvme-guest\"\n"
        )
    };
    std::fs::write(
        work.join("tenant.toml"),
        spec(NAME, "profile = \"1g.10gb\""),
    )
    .map_err(|e| e.to_string())?;
    std::fs::write(
        work.join("tenant-b.toml"),
        spec(NAME_B, "profile = \"1g.10gb\""),
    )
    .map_err(|e| e.to_string())?;
    std::fs::write(work.join("whole.toml"), spec(NAME, "whole_gpu = true"))
        .map_err(|e| e.to_string())?;
    Ok(Setup {
        bin,
        work,
        sim,
        images,
    })
}

/// The hook's calls so far (the hook appends `ACTION PF VF` to NH_WORK/vf-hook.log).
fn hook_calls(work: &Path) -> Vec<String> {
    std::fs::read_to_string(work.join("vf-hook.log"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// The VF `tenant` was handed, checked: the VF of the PF its VMM's config names, on
/// vfio-pci, alone in its IOMMU group, its secondary controller online; returns it and
/// its secondary controller's id.
fn check_handed_over(pf: &str, state: &Path, tenant: &str) -> Result<(String, u32), String> {
    let vfs = vfs_of(pf);
    let numvfs = sysfs(pf, "sriov_numvfs");
    if vfs.is_empty() || numvfs != vfs.len().to_string() {
        return Err(format!(
            "running, but {pf} has sriov_numvfs {numvfs:?} and VFs {vfs:?}"
        ));
    }
    let config =
        std::fs::read_to_string(state.join("tenants").join(tenant).join("vmm-config.json"))
            .map_err(|e| format!("{tenant}'s VMM config: {e}"))?;
    let named: Vec<&String> = vfs
        .iter()
        .filter(|v| config.contains(&format!("/sys/bus/pci/devices/{v}\"")))
        .collect();
    let [vf] = named.as_slice() else {
        return Err(format!(
            "{tenant}'s VMM config should name one VF of {pf} ({vfs:?}): {config}"
        ));
    };
    let vf = vf.to_string();
    if driver_of(&vf).as_deref() != Some("vfio-pci") {
        return Err(format!("{tenant}'s VF {vf} is on {:?}", driver_of(&vf)));
    }
    let group = iommu_group(&vf).ok_or_else(|| format!("VF {vf} has no IOMMU group"))?;
    let members: Vec<String> =
        std::fs::read_dir(format!("/sys/kernel/iommu_groups/{group}/devices"))
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
    if members != [vf.clone()] {
        return Err(format!("VF {vf}'s IOMMU group {group} holds {members:?}"));
    }
    let vfn = vfs.iter().position(|v| *v == vf).unwrap_or(0) + 1;
    let (scid, online) = secondary(pf, vfn)?;
    if !online {
        return Err(format!(
            "VF {vf} (secondary controller {scid}) is not online"
        ));
    }
    println!(
        "ok: {tenant}: VF {vf} of {pf} ({} VFs) on vfio-pci, alone in IOMMU group {group}, secondary controller {scid} online",
        vfs.len()
    );
    Ok((vf, scid))
}

/// A VF given back while the card stays in vGPU mode: off vfio-pci, override cleared, its
/// controller offline, the hook called `online` then `offline` for it.
fn check_released(pf: &str, vf: &str, work: &Path) -> Result<(), String> {
    if let Some(driver) = driver_of(vf) {
        return Err(format!(
            "VF {vf} is still on {driver} after its tenant left"
        ));
    }
    let over = sysfs(vf, "driver_override");
    if over != "(null)" && !over.is_empty() {
        return Err(format!("VF {vf} keeps driver_override {over:?}"));
    }
    let vfn = vfs_of(pf).iter().position(|v| v == vf).map_or(0, |i| i + 1);
    let (scid, online) = secondary(pf, vfn)?;
    if online {
        return Err(format!("VF {vf}'s controller {scid} is still online"));
    }
    let calls = hook_calls(work);
    let on = calls.iter().position(|c| *c == format!("online {pf} {vf}"));
    let off = calls
        .iter()
        .rposition(|c| *c == format!("offline {pf} {vf}"));
    if !matches!((on, off), (Some(a), Some(b)) if a < b) {
        return Err(format!(
            "the hook should have brought {vf} online, then offline: {calls:?}"
        ));
    }
    Ok(())
}

/// The gpu-release line of `tenant`'s receipt says what was real and what SIMULATED, its
/// VF and type, and the PF's VF count then (2) and after release-gpu (`after`).
fn check_release_line(
    cli: &Cli,
    d: &Daemon,
    tenant: &str,
    pf: &str,
    vf: &str,
    after: &str,
) -> Result<(), String> {
    let steps = receipt_steps(cli, d, tenant)?;
    let release = receipt_step(&steps, "gpu-release")?;
    let ev = &release["evidence"];
    let text = |k: &str| ev[k].as_str().unwrap_or_default().to_string();
    let (count_key, after_key) = (
        format!("vfs of {pf}"),
        format!("vfs of {pf} after release-gpu"),
    );
    let after = format!("{after} ");
    let checks: [(&str, &str); 6] = [
        ("real", "sriov_numvfs"),
        ("simulated", "SIMULATED NVIDIA vGPU driver"),
        ("vf", vf),
        ("vgpu type", "SIMULATED h100-80gb-1-10C"),
        (&count_key, "2 "),
        (&after_key, &after),
    ];
    for (key, want) in checks {
        if !text(key).contains(want) {
            return Err(format!(
                "{tenant}'s gpu-release {key:?} should say {want:?}: {release}"
            ));
        }
    }
    let vmm = vmm_reset_of(receipt_step(&steps, "device-reset")?, vf)?;
    simulated_scrub(&steps)?;
    println!(
        "ok: {tenant}'s receipt: real: {}; simulated: {}; VF {vf}: {}; VMM reset at detach {vmm}; VFs after release-gpu: {}",
        text("real"),
        text("simulated"),
        text("vgpu type"),
        text(&after_key)
    );
    Ok(())
}

/// After the card's last vGPU tenant left: the VFs disabled and gone, the simulated host
/// without instances, VFs or MIG.
fn check_left_vgpu_mode(pf: &str, gone: &[&str], sim: &Path) -> Result<(), String> {
    let numvfs = sysfs(pf, "sriov_numvfs");
    if numvfs != "0" || !vfs_of(pf).is_empty() {
        return Err(format!(
            "after the last destroy {pf} has sriov_numvfs {numvfs:?} and VFs {:?}",
            vfs_of(pf)
        ));
    }
    for vf in gone {
        if Path::new(&format!("/sys/bus/pci/devices/{vf}")).exists() {
            return Err(format!("VF {vf} still exists after the last destroy"));
        }
    }
    let host: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(sim).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    let g = &host["gpus"][0];
    let instances = g["instances"].as_array().map_or(0, Vec::len);
    if instances != 0 || g["sriov_vfs"].as_u64().unwrap_or(0) != 0 || g["mig_enabled"] == true {
        return Err(format!("the simulated host after the last destroy: {g}"));
    }
    Ok(())
}

/// `tenantvm create SPEC` (in NH_WORK) until `tenant` runs; then the VF of `pf` it got,
/// checked, and its guest's report (Identify from that VF's secondary controller).
fn create_on_vf(
    setup: &Setup,
    (cli, d, state): (&Cli, &Daemon, &Path),
    pf: &str,
    spec: &str,
    tenant: &str,
) -> Result<(String, f64), String> {
    let t = Instant::now();
    let timeout = LIFECYCLE_TIMEOUT_S.to_string();
    let spec = setup.work.join(spec);
    cli.ok(
        &[
            "create",
            spec.to_str().unwrap_or_default(),
            "--timeout-s",
            &timeout,
        ],
        d,
    )?;
    wait_running(cli, d, tenant)?;
    let secs = t.elapsed().as_secs_f64();
    let (vf, scid) = check_handed_over(pf, state, tenant)?;
    let line = guest_report(
        cli,
        d,
        tenant,
        GUEST_TEST,
        &["pci=8086:5845", &format!("cntlid={scid} ")],
        GUEST_REPORT_TIMEOUT,
    )?;
    println!("ok: {tenant}'s guest: {line}");
    Ok((vf, secs))
}

fn check(pf: &str, hook: &str) -> Result<(), String> {
    if sysfs(pf, "sriov_numvfs") != "0" {
        return Err(format!(
            "{pf} has VFs before the scenario: {}",
            sysfs(pf, "sriov_numvfs")
        ));
    }
    let setup = write_setup(pf, hook, None)?;
    let state = setup.work.join("state");
    let d = setup.daemon(&state, "daemon.log", None)?;
    let cli = setup.cli(&state);
    let on = (&cli, &d, state.as_path());

    // 1. Two vGPU tenants at once, each on a VF of its own.
    let (vf_a, secs) = create_on_vf(&setup, on, pf, "tenant.toml", NAME)?;
    note(&format!(
        "vGPU tenant on a real VF ({vf_a}) create to running: {secs:.2} s"
    ));
    let (vf_b, _) = create_on_vf(&setup, on, pf, "tenant-b.toml", NAME_B)?;
    if vf_b == vf_a {
        return Err(format!("both tenants got VF {vf_a}"));
    }
    // The positive control of step 4's "no tenantvm-vmm process": two VMs, two found.
    let vmms = vmm_processes();
    if vmms.len() != 2 {
        return Err(format!(
            "two tenants run, but /proc shows tenantvm-vmm pids {vmms:?}"
        ));
    }

    // 2. The first leaves: its VF is given back, the card stays in vGPU mode for the other.
    destroy(&cli, &d, NAME)?;
    check_release_line(&cli, &d, NAME, pf, &vf_a, "2")?;
    check_released(pf, &vf_a, &setup.work)?;
    if cli.state(NAME_B)?.as_deref() != Some("running")
        || driver_of(&vf_b).as_deref() != Some("vfio-pci")
    {
        return Err(format!(
            "{NAME_B} should still run on {vf_b} (on {:?})",
            driver_of(&vf_b)
        ));
    }
    println!("ok: {NAME} left: {vf_a} released, {pf} keeps its VFs for {NAME_B} on {vf_b}");

    // 3. The last leaves: the VFs are disabled.
    destroy(&cli, &d, NAME_B)?;
    check_release_line(&cli, &d, NAME_B, pf, &vf_b, "0")?;
    check_left_vgpu_mode(pf, &[&vf_a, &vf_b], &setup.sim)?;
    drop(d);
    println!("ok: {NAME_B} left: {pf}'s VFs disabled, {vf_a} and {vf_b} gone");

    // 4. A daemon killed between bind-gpu and attach-gpu (the VF typed and on vfio-pci, no
    //    VM), then restarted: the create resumes or rolls back, and the VFs end disabled.
    crash_and_converge(&setup, pf)
}

/// The pids of the `tenantvm-vmm` processes on this host (from /proc/PID/comm).
fn vmm_processes() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter(|pid| {
                    std::fs::read_to_string(format!("/proc/{pid}/comm"))
                        .is_ok_and(|c| c.trim() == "tenantvm-vmm")
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The crash check of [`check`]'s step 4.
fn crash_and_converge(setup: &Setup, pf: &str) -> Result<(), String> {
    let state = setup.work.join("state-crash");
    let mut d = setup.daemon(&state, "daemon-crash.log", Some("create:bind-gpu:after"))?;
    let armed =
        std::fs::read_to_string(&d.log).is_ok_and(|l| l.contains("TENANTVM_TEST_CRASH_AT is set"));
    if !armed {
        let why = "the two-tenant checks passed; the crash check needs tenantvmd built with \
                   --features tenantvm/test-hooks (a debug nested-host run)";
        std::fs::write(setup.work.join(CRASH_SKIPPED), why).map_err(|e| e.to_string())?;
        println!("SKIP crash check: {why}");
        return Ok(());
    }
    let cli = setup.cli(&state);
    let spec = setup.work.join("tenant.toml");
    let o = cli.run(&[
        "create",
        spec.to_str().unwrap_or_default(),
        "--timeout-s",
        "120",
    ]);
    let st = d.wait_exit(Duration::from_secs(120))?;
    if o.status.success() {
        return Err("create succeeded although the daemon was to die after bind-gpu".into());
    }
    let typed: Vec<String> = vfs_of(pf)
        .into_iter()
        .filter(|v| driver_of(v).as_deref() == Some("vfio-pci"))
        .collect();
    if typed.len() != 1 {
        return Err(format!(
            "the daemon died ({st}) with VFs {typed:?} on vfio-pci: the crash was not after bind-gpu:\n{}",
            d.log_tail()
        ));
    }
    let vmms = vmm_processes();
    if !vmms.is_empty() {
        return Err(format!(
            "the daemon died ({st}) after bind-gpu, but tenantvm-vmm runs (pids {vmms:?}): \
             the crash was not before attach-gpu"
        ));
    }
    println!(
        "ok: tenantvmd died after bind-gpu ({st}), {} on vfio-pci, no tenantvm-vmm process",
        typed[0]
    );
    drop(d);
    let d = setup.daemon(&state, "daemon-restart.log", None)?;
    let deadline = Instant::now() + Duration::from_secs(LIFECYCLE_TIMEOUT_S);
    let outcome = loop {
        match cli.state(NAME)?.as_deref() {
            Some("running") => break "resumed",
            None => break "rolled back",
            Some("failed") => {
                return Err(format!(
                    "after the restart {NAME} failed:\n{}",
                    d.log_tail()
                ))
            }
            _ => {}
        }
        if Instant::now() > deadline {
            return Err(format!(
                "after the restart {NAME} did not settle:\n{}",
                d.log_tail()
            ));
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    if outcome == "resumed" {
        let (vf, scid) = check_handed_over(pf, &state, NAME)?;
        let line = guest_report(
            &cli,
            &d,
            NAME,
            GUEST_TEST,
            &["pci=8086:5845", &format!("cntlid={scid} ")],
            GUEST_REPORT_TIMEOUT,
        )?;
        println!("ok: after the restart the create resumed on {vf}; its guest: {line}");
        destroy(&cli, &d, NAME)?;
    } else {
        println!("ok: after the restart the create was rolled back");
    }
    let gone: Vec<&str> = typed.iter().map(String::as_str).collect();
    check_left_vgpu_mode(pf, &gone, &setup.sim)?;
    println!("ok: converged ({outcome}): {pf}'s VFs disabled");
    drop(d);
    Ok(())
}

/// One create-to-running of `spec` on a fresh daemon, then its destroy; the seconds and
/// the create's step times.
fn one_round(setup: &Setup, spec: &str, round: usize) -> Result<(f64, Vec<(String, f64)>), String> {
    let state = setup.work.join(format!("bench-{round}-{spec}"));
    let log = format!("daemon-bench-{round}-{spec}.log");
    let (d, cli, secs) = timed_create(setup, &state, &log, &setup.work.join(spec), NAME)?;
    guest_report(&cli, &d, NAME, GUEST_TEST, &[], GUEST_REPORT_TIMEOUT)?;
    let steps = create_step_times(&state)?;
    destroy(&cli, &d, NAME)?;
    println!("round {round}: {spec}: create to running {secs:.2} s");
    Ok((secs, steps))
}

fn bench(pf: &str, hook: &str, whole: &str, rounds: usize) -> Result<(), String> {
    let setup = write_setup(pf, hook, None)?;
    let peer = write_setup(pf, hook, Some(whole))?;
    let (mut vf_times, mut whole_times) = (Vec::new(), Vec::new());
    let (mut vf_steps, mut whole_steps) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let (s, st) = one_round(&setup, "tenant.toml", round)?;
        vf_times.push(s);
        vf_steps.push(st);
        let (s, st) = one_round(&peer, "whole.toml", round)?;
        whole_times.push(s);
        whole_steps.push(st);
    }
    let list = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let (v, w) = (
        median(&mut vf_times.clone()),
        median(&mut whole_times.clone()),
    );
    note(&format!(
        "create to running, vGPU on a real VF (SR-IOV nvme, type SIMULATED): median {v:.2} s of {rounds} ({} s)",
        list(&vf_times)
    ));
    note(&format!(
        "create to running, the plain nvme whole: median {w:.2} s of {rounds} ({} s)",
        list(&whole_times)
    ));
    note(&format!(
        "create to running, VF / whole device: {:.2}x ({:+.2} s)",
        v / w,
        v - w
    ));
    let step = |runs: &[Vec<(String, f64)>], name: &str| {
        let mut v: Vec<f64> = runs
            .iter()
            .filter_map(|r| r.iter().find(|(n, _)| n == name).map(|(_, ms)| *ms))
            .collect();
        (!v.is_empty()).then(|| median(&mut v))
    };
    for name in [
        "prepare-gpu-host",
        "create-gpu-instance",
        "bind-gpu",
        "attach-gpu",
        "launch-vm",
        "await-running",
    ] {
        let (a, b) = (step(&vf_steps, name), step(&whole_steps, name));
        let ms = |x: Option<f64>| x.map_or("not run".to_string(), |x| format!("{x:.0} ms"));
        note(&format!(
            "create step {name}: median {} with the VF, {} whole",
            ms(a),
            ms(b)
        ));
    }
    Ok(())
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["bench", pf, hook, whole, rest @ ..] => {
            let rounds = match rest {
                [] => 3,
                [n] => n
                    .parse()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or("N must be a positive count")?,
                _ => return Err("usage: nh-vgpu-sriov bench PF HOOK WHOLE [N]".into()),
            };
            bench(pf, hook, whole, rounds)
        }
        [pf, hook] => check(pf, hook),
        _ => Err("usage: nh-vgpu-sriov PF HOOK | nh-vgpu-sriov bench PF HOOK WHOLE [N]".into()),
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nh-vgpu-sriov: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
