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
//! 1. `tenantvm create` of a tenant (the no_std test guest, `tvm.test=vfio-nvme-hold`) with
//!    `gpu = { profile = "1g.10gb" }` reaches `running`; the PF has its VFs (the kernel's
//!    `sriov_numvfs`, set by the daemon's prepare-gpu-host); exactly one VF is on
//!    vfio-pci, in an IOMMU group of its own, and it is the device in the VMM's config; the
//!    hook brought its secondary controller online (nvme-cli's `list-secondary`); the
//!    guest enabled that controller, got Identify by MSI-X, and its controller id is the
//!    VF's secondary controller id (not the PF's);
//! 2. `tenantvm destroy`: the PF's VFs are disabled again (sriov_numvfs 0, no `virtfn`
//!    link, the VF gone from sysfs); the hook was called `online` then `offline` for that
//!    VF; the receipt: gpu-release names the real parts and the SIMULATED ones, the VF
//!    and its type, the PF's VF count (2) and after release-gpu (0); device-reset carries
//!    the VMM's own reset of the VF at detach; gpu-scrub is `simulated`; the simulated host
//!    has no instance, no VFs and MIG off again.
//!
//! `bench`: N rounds (default 3), each creating the same test guest once with a VF (as
//! above) and once with WHOLE given whole (a SIMULATED whole-only GPU at its address), each
//! on a fresh daemon, and destroying it; create-to-running medians, the ratio and the create
//! steps that differ, as NOTE lines.

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};
use tenantvm_nested_host::gpu_tenant::{
    create, create_step_times, destroy, driver_of, guest_report, median, receipt_step,
    receipt_steps, simulated_scrub, test_guest_image, timed_create, vmm_reset_of, wait_running,
    Setup,
};
use tenantvm_nested_host::scenario::{env_path, note};

/// The tenant's name.
const NAME: &str = "nh-vgpu";
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
    let spec = |gpu: &str| {
        format!(
            "name = \"{NAME}\"\nvcpus = 1\nmemory_mib = 128\ngpu = {{ {gpu} }}\n\
             [image]\nname = \"nvme-guest\"\n"
        )
    };
    std::fs::write(work.join("tenant.toml"), spec("profile = \"1g.10gb\""))
        .map_err(|e| e.to_string())?;
    std::fs::write(work.join("whole.toml"), spec("whole_gpu = true")).map_err(|e| e.to_string())?;
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

/// The VF handed over, checked: one VF of the PF on vfio-pci, alone in its IOMMU group,
/// the device of the VMM's config, its secondary controller online.
fn check_handed_over(pf: &str, state: &Path) -> Result<(String, u32), String> {
    let vfs = vfs_of(pf);
    let numvfs = sysfs(pf, "sriov_numvfs");
    if vfs.is_empty() || numvfs != vfs.len().to_string() {
        return Err(format!(
            "running, but {pf} has sriov_numvfs {numvfs:?} and VFs {vfs:?}"
        ));
    }
    let bound: Vec<&String> = vfs
        .iter()
        .filter(|v| driver_of(v).as_deref() == Some("vfio-pci"))
        .collect();
    let [vf] = bound.as_slice() else {
        return Err(format!(
            "expected one VF of {pf} on vfio-pci, found {bound:?} (VFs {vfs:?})"
        ));
    };
    let vf = vf.to_string();
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
    let config = std::fs::read_to_string(state.join("tenants").join(NAME).join("vmm-config.json"))
        .map_err(|e| format!("the VMM's config: {e}"))?;
    if !config.contains(&format!("/sys/bus/pci/devices/{vf}")) {
        return Err(format!("the VMM's config does not name VF {vf}: {config}"));
    }
    let vfn = vfs.iter().position(|v| *v == vf).unwrap_or(0) + 1;
    let (scid, online) = secondary(pf, vfn)?;
    if !online {
        return Err(format!(
            "VF {vf} (secondary controller {scid}) is not online"
        ));
    }
    println!(
        "ok: VF {vf} of {pf} ({} VFs) on vfio-pci, alone in IOMMU group {group}, secondary controller {scid} online",
        vfs.len()
    );
    Ok((vf, scid))
}

/// After the departure: the VFs disabled and gone, the hook undone, the receipt.
fn check_departed(
    pf: &str,
    vf: &str,
    setup: &Setup,
    steps: &[serde_json::Value],
) -> Result<(), String> {
    let numvfs = sysfs(pf, "sriov_numvfs");
    if numvfs != "0" || !vfs_of(pf).is_empty() {
        return Err(format!(
            "after destroy {pf} has sriov_numvfs {numvfs:?} and VFs {:?}",
            vfs_of(pf)
        ));
    }
    if Path::new(&format!("/sys/bus/pci/devices/{vf}")).exists() {
        return Err(format!("VF {vf} still exists after destroy"));
    }
    let calls = hook_calls(&setup.work);
    let want = [format!("online {pf} {vf}"), format!("offline {pf} {vf}")];
    if calls != want {
        return Err(format!("the hook's calls: {calls:?}, expected {want:?}"));
    }
    let release = receipt_step(steps, "gpu-release")?;
    let ev = &release["evidence"];
    let text = |k: &str| ev[k].as_str().unwrap_or_default().to_string();
    let checks = [
        ("real", "sriov_numvfs"),
        ("simulated", "SIMULATED NVIDIA vGPU driver"),
        ("vf", vf),
        ("vgpu type", "SIMULATED h100-80gb-1-10C"),
        (&format!("vfs of {pf}") as &str, "2 "),
        (&format!("vfs of {pf} after release-gpu") as &str, "0 "),
    ];
    for (key, want) in checks {
        if !text(key).contains(want) {
            return Err(format!(
                "gpu-release's {key:?} should say {want:?}: {release}"
            ));
        }
    }
    let reset = receipt_step(steps, "device-reset")?;
    let vmm = vmm_reset_of(reset, vf)?;
    simulated_scrub(steps)?;
    let host: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&setup.sim).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    let g = &host["gpus"][0];
    let instances = g["instances"].as_array().map_or(0, Vec::len);
    if instances != 0 || g["sriov_vfs"].as_u64().unwrap_or(0) != 0 || g["mig_enabled"] == true {
        return Err(format!("the simulated host after destroy: {g}"));
    }
    println!(
        "ok: receipt: real: {}; simulated: {}; VF {vf}: {}; VMM reset at detach {vmm}; VFs after release-gpu: {}",
        text("real"),
        text("simulated"),
        text("vgpu type"),
        text(&format!("vfs of {pf} after release-gpu"))
    );
    Ok(())
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
    let t = Instant::now();
    create(&cli, &setup.work, &d)?;
    wait_running(&cli, &d, NAME)?;
    let secs = t.elapsed().as_secs_f64();
    let (vf, scid) = check_handed_over(pf, &state)?;
    let line = guest_report(
        &cli,
        &d,
        NAME,
        GUEST_TEST,
        &["pci=8086:5845", &format!("cntlid={scid} ")],
        GUEST_REPORT_TIMEOUT,
    )?;
    println!("ok: the tenant's guest: {line}");
    note(&format!(
        "vGPU tenant on a real VF ({vf}) create to running: {secs:.2} s"
    ));

    destroy(&cli, &d, NAME)?;
    let steps = receipt_steps(&cli, &d, NAME)?;
    check_departed(pf, &vf, &setup, &steps)?;
    drop(d);
    println!("ok: destroyed: {pf}'s VFs disabled, {vf} gone");
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
