//! The gpu-tenant scenario's program: a GPU tenant end to end through a real tenantvmd,
//! with QEMU's edu device standing in for a whole GPU without MIG.
//!
//! ```text
//! nh-gpu-tenant EDU_ADDRESS            the end-to-end checks below
//! nh-gpu-tenant bench EDU_ADDRESS [N]  the create-to-running time the edu adds (a benchmark)
//! ```
//! env: NH_BIN (tenantvmd, tenantvm, tenantvm-vmm, tenantvm-jail; tenantvm built with the
//! `test-hooks` feature for the crash), NH_TEST_GUESTS, NH_WORK; NH_NOTES (optional:
//! figures). Runs as root with cgroup v2 at /sys/fs/cgroup (the scenario script mounts it),
//! vfio-pci loaded, and the edu at EDU_ADDRESS on no driver.
//!
//! The daemon runs with a SIMULATED GPU host file whose one GPU (an L40S: no MIG, given
//! whole) sits at the edu's PCI address, and `--gpu-sysfs-root /`: placement, inventory and
//! scrub are simulated, while the binding (the real sysfs of this host), the VMM's
//! passthrough (real kernel VFIO), the reset and the rebind are the product's real code.
//!
//! Checks, in order:
//! 1. `tenantvm create` of a plain tenant (the no_std test guest, `tvm.test=vfio-edu-hold`)
//!    with `gpu = { whole_gpu = true }` reaches `running` with the edu on vfio-pci; the
//!    guest's console (`tenantvm logs`) reports the edu's config-space ids (1234:11e8) and
//!    a 256-byte DMA round trip through the IOMMU;
//! 2. `tenantvm destroy`: the edu is on no driver again with its `driver_override` cleared;
//!    the receipt's device-reset line fails saying there is no reset method (no reset is
//!    claimed) and quarantines the card, and carries the VMM's own `Unsupported` reset;
//!    gpu-scrub is `simulated`; gpu-release shows the driver now and before the bind
//!    (`none`) and the quarantine;
//! 3. with a fresh state directory, a daemon armed with `create:bind-gpu:after` SIGKILLs
//!    itself with the edu on vfio-pci and no VM; restarted, it converges: the create is
//!    resumed (running, the guest reports the edu again) or rolled back (the edu unbound);
//!    after a destroy the edu is on no driver again. A tenantvmd built without the
//!    `test-hooks` feature has no crash hook: then the reason is written to
//!    `NH_WORK/crash-check-skipped` and the scenario reports SKIP.
//!
//! `bench`: N rounds (default 3), each creating the same tenant without a GPU and then with
//! the edu whole, alternately, each on a fresh daemon and state directory (a card without a
//! reset method stays quarantined after its tenant leaves), and destroying it; prints the
//! create-to-running times (`tenantvm create` returns once the tenant runs), their medians
//! and the ratio as NOTE lines.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};
use tenantvm_nested_host::gpu_tenant::{
    create, create_step_times, driver_of, median, override_of, receipt_step, receipt_steps,
    simulated_scrub, test_guest_image, timed_create, vmm_reset_of, wait_running, Cli, Setup,
    LIFECYCLE_TIMEOUT_S,
};
use tenantvm_nested_host::scenario::{env_path, note, Daemon};
/// How long the guest may take to report after the tenant is running.
const GUEST_REPORT_TIMEOUT: Duration = Duration::from_secs(120);
/// The tenant's name.
const NAME: &str = "nh-gpu";
/// Written to NH_WORK, with the reason, when the crash check cannot run.
const CRASH_SKIPPED: &str = "crash-check-skipped";

/// Waits for the test guest's report on the tenant's console; returns the PASS line.
fn guest_report(cli: &Cli, d: &Daemon) -> Result<String, String> {
    tenantvm_nested_host::gpu_tenant::guest_report(
        cli,
        d,
        NAME,
        "vfio-edu-hold",
        &["pci=1234:11e8", "dma=256", "id=0x"],
        GUEST_REPORT_TIMEOUT,
    )
}

/// `tenantvm destroy` of the tenant.
fn destroy(cli: &Cli, d: &Daemon) -> Result<(), String> {
    tenantvm_nested_host::gpu_tenant::destroy(cli, d, NAME)
}

/// The VMM was told the interface this host offers: iommufd (`/dev/iommu` and edu's cdev)
/// where the outer kernel has it (the iommufd kernel, docs/testing.md), the legacy group
/// otherwise (Debian's). Its jail's nodes are not visible from here (the jail's own mount
/// namespace); a VMM told `iommufd` whose jail lacked them would exit 24 before the guest
/// reported edu (checked above).
fn check_interface(state: &Path, edu: &str) -> Result<(), String> {
    let tenant = state.join("tenants").join(NAME);
    let config = std::fs::read_to_string(tenant.join("vmm-config.json"))
        .map_err(|e| format!("the VMM's config: {e}"))?;
    let cdev = std::fs::read_dir(format!("/sys/bus/pci/devices/{edu}/vfio-dev"))
        .ok()
        .and_then(|mut d| d.next())
        .and_then(|e| e.ok())
        .map(|e| Path::new("/dev/vfio/devices").join(e.file_name()))
        .filter(|node| node.exists());
    let (want, node) = match (&cdev, Path::new("/dev/iommu").exists()) {
        (Some(node), true) => ("iommufd", node.clone()),
        _ => ("legacy", PathBuf::from("/dev/vfio/vfio")),
    };
    let compact: String = config.split_whitespace().collect();
    if !compact.contains(&format!("\"iommu\":\"{want}\"")) {
        return Err(format!(
            "the VMM's config should say iommu={want}: {config}"
        ));
    }
    println!(
        "ok: the VMM was told to open edu through {want} ({})",
        node.display()
    );
    note(&format!("gpu tenant VFIO interface: {want}"));
    Ok(())
}

/// The edu is on no driver and its override is cleared (as it was before the tenant).
fn check_given_back(edu: &str, when: &str) -> Result<(), String> {
    if let Some(driver) = driver_of(edu) {
        return Err(format!("{when}: edu {edu} is still bound to {driver}"));
    }
    let over = override_of(edu);
    if over != "(null)" && !over.is_empty() {
        return Err(format!("{when}: edu {edu} keeps driver_override {over:?}"));
    }
    Ok(())
}

/// The receipt of the departure: no reset claimed, scrub simulated, drivers restored.
fn check_receipt(cli: &Cli, edu: &str, d: &Daemon) -> Result<(), String> {
    let steps = &receipt_steps(cli, d, NAME)?;
    let reset = receipt_step(steps, "device-reset")?;
    let error = reset["error"].as_str().unwrap_or_default();
    if reset["result"] != "failed" || !error.contains("no reset method") {
        return Err(format!(
            "device-reset should fail saying edu has no reset method, not claim a reset: {reset}"
        ));
    }
    if reset["evidence"]["quarantined"] != "true" {
        return Err(format!("device-reset did not quarantine the card: {reset}"));
    }
    let vmm = vmm_reset_of(reset, edu)?;
    if !vmm.contains("Unsupported") {
        return Err(format!(
            "the VMM's reset of edu should be Unsupported: {vmm}"
        ));
    }
    simulated_scrub(steps)?;
    let release = receipt_step(steps, "gpu-release")?;
    let driver = &release["evidence"][format!("driver {edu}")];
    if driver != "none (before the bind: none)" {
        return Err(format!(
            "gpu-release should show edu back on no driver: {release}"
        ));
    }
    if !release["evidence"]["quarantined"]
        .as_str()
        .unwrap_or_default()
        .starts_with("device-reset")
    {
        return Err(format!("gpu-release should show the quarantine: {release}"));
    }
    println!("ok: receipt: device-reset failed ({error}); VMM reset {vmm}; scrub simulated; gpu-release {driver}");
    Ok(())
}

/// The simulated host, the image and the tenant specs (with and without the edu), in
/// `work`.
fn setup(edu: &str) -> Result<Setup, String> {
    let bin = env_path("NH_BIN")?;
    let work = env_path("NH_WORK")?;
    let group: u32 = std::fs::read_link(format!("/sys/bus/pci/devices/{edu}/iommu_group"))
        .ok()
        .and_then(|t| t.file_name()?.to_str()?.parse().ok())
        .ok_or_else(|| format!("edu {edu} has no IOMMU group"))?;

    // The simulated host: one L40S (no MIG: given whole) at the edu's address.
    let sim = work.join("sim-host.json");
    let host = serde_json::json!({
        "comment": "SIMULATED: one whole-only GPU at the address of QEMU's edu device",
        "gpus": [{"index": 0, "model": "l40s", "pci_address": edu, "driver": "550.54.15",
                  "vgpu": "none", "iommu_group": group}]
    });
    std::fs::write(&sim, host.to_string()).map_err(|e| e.to_string())?;
    // The image: the no_std test guest, told to run edu's test and stay up.
    let images = work.join("img");
    test_guest_image(&images, "edu-guest", "vfio-edu-hold")?;
    std::fs::write(
        work.join("tenant.toml"),
        format!(
            "name = \"{NAME}\"\nvcpus = 1\nmemory_mib = 128\ngpu = {{ whole_gpu = true }}\n\
             [image]\nname = \"edu-guest\"\n"
        ),
    )
    .map_err(|e| e.to_string())?;
    std::fs::write(
        work.join("plain.toml"),
        format!("name = \"{NAME}\"\nvcpus = 1\nmemory_mib = 128\n[image]\nname = \"edu-guest\"\n"),
    )
    .map_err(|e| e.to_string())?;
    Ok(Setup {
        bin,
        work,
        sim,
        images,
    })
}

/// Per step, the median of each arm's times (ms) and the difference, as NOTE lines; steps
/// in the order the edu arm ran them.
fn note_step_split(plain: &[Vec<(String, f64)>], with_edu: &[Vec<(String, f64)>]) {
    let arm = |runs: &[Vec<(String, f64)>], step: &str| {
        let mut v: Vec<f64> = runs
            .iter()
            .filter_map(|r| r.iter().find(|(n, _)| n == step).map(|(_, ms)| *ms))
            .collect();
        if v.is_empty() {
            None
        } else {
            Some(median(&mut v))
        }
    };
    let Some(order) = with_edu.first() else {
        return;
    };
    for (step, _) in order {
        let e = arm(with_edu, step).unwrap_or(0.0);
        let p = arm(plain, step);
        note(&format!(
            "create step {step}: median {e:.0} ms with edu, {} without ({:+.0} ms)",
            p.map_or("not run".to_string(), |p| format!("{p:.0} ms")),
            e - p.unwrap_or(0.0)
        ));
    }
}

/// The benchmark (see the module documentation).
fn bench(edu: &str, rounds: usize) -> Result<(), String> {
    let setup = setup(edu)?;
    let work = setup.work.clone();
    let (mut plain, mut with_edu) = (Vec::new(), Vec::new());
    let (mut plain_steps, mut edu_steps) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        for (spec, times, steps) in [
            ("plain.toml", &mut plain, &mut plain_steps),
            ("tenant.toml", &mut with_edu, &mut edu_steps),
        ] {
            let state = work.join(format!("bench-{round}-{spec}"));
            let log = format!("daemon-bench-{round}-{spec}.log");
            let (d, cli, secs) = timed_create(&setup, &state, &log, &work.join(spec), NAME)?;
            let bound = driver_of(edu);
            if (spec == "tenant.toml") != (bound.as_deref() == Some("vfio-pci")) {
                return Err(format!("{spec}: running with edu on {bound:?}"));
            }
            times.push(secs);
            steps.push(create_step_times(&state)?);
            destroy(&cli, &d)?;
            check_given_back(edu, "after a benchmark round")?;
            drop(d);
            println!("round {round}: {spec}: create to running {secs:.2} s");
        }
    }
    let (p, e) = (median(&mut plain), median(&mut with_edu));
    let list = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    note(&format!(
        "create to running without a GPU: median {p:.2} s of {rounds} ({} s)",
        list(&plain)
    ));
    note(&format!(
        "create to running with edu whole: median {e:.2} s of {rounds} ({} s)",
        list(&with_edu)
    ));
    note(&format!(
        "create to running, edu whole / no GPU: {:.2}x (+{:.2} s)",
        e / p,
        e - p
    ));
    note_step_split(&plain_steps, &edu_steps);
    Ok(())
}

fn run() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let first = args
        .next()
        .ok_or("usage: nh-gpu-tenant [bench] EDU_ADDRESS [N]")?;
    if first == "bench" {
        let edu = args
            .next()
            .ok_or("usage: nh-gpu-tenant bench EDU_ADDRESS [N]")?;
        let rounds = match args.next() {
            Some(n) => n
                .parse()
                .ok()
                .filter(|n| *n > 0)
                .ok_or("N must be a positive count")?,
            None => 3,
        };
        check_given_back(&edu, "before the benchmark")?;
        return bench(&edu, rounds);
    }
    let edu = first;
    check_given_back(&edu, "before the scenario")?;
    let setup = setup(&edu)?;
    let work = setup.work.clone();

    // 1. Create: edu bound to vfio-pci by bind-gpu, passed through by tenantvm-vmm.
    let state = work.join("state");
    let d = setup.daemon(&state, "daemon.log", None)?;
    let cli = setup.cli(&state);
    let t = Instant::now();
    create(&cli, &work, &d)?;
    wait_running(&cli, &d, NAME)?;
    let with_device = t.elapsed();
    match driver_of(&edu).as_deref() {
        Some("vfio-pci") => {}
        other => return Err(format!("running, but edu is on {other:?}, not vfio-pci")),
    }
    let line = guest_report(&cli, &d)?;
    println!("ok: the tenant's guest: {line}");
    check_interface(&state, &edu)?;
    note(&format!(
        "gpu tenant (edu whole) create to running: {:.2} s",
        with_device.as_secs_f64()
    ));

    // 2. Destroy: reset refused honestly, edu unbound again, receipt.
    destroy(&cli, &d)?;
    check_given_back(&edu, "after destroy")?;
    check_receipt(&cli, &edu, &d)?;
    drop(d);
    println!(
        "ok: destroyed: edu {edu} on no driver, driver_override {}",
        override_of(&edu)
    );

    // 3. A crash between bind-gpu and attach-gpu, then a restart.
    let state = work.join("state-crash");
    let mut d = setup.daemon(&state, "daemon-crash.log", Some("create:bind-gpu:after"))?;
    // A daemon built without the `test-hooks` feature has no crash hook (and does not warn
    // that it is armed): the crash check cannot run; the scenario says so (SKIP).
    let armed =
        std::fs::read_to_string(&d.log).is_ok_and(|l| l.contains("TENANTVM_TEST_CRASH_AT is set"));
    if !armed {
        let why = "the create, passthrough and destroy checks passed; the crash check needs \
                   tenantvmd built with --features tenantvm/test-hooks (a debug nested-host run)";
        std::fs::write(work.join(CRASH_SKIPPED), why).map_err(|e| e.to_string())?;
        println!("SKIP crash check: {why}");
        return Ok(());
    }
    let cli = setup.cli(&state);
    let o = cli.run(&[
        "create",
        work.join("tenant.toml").to_str().unwrap_or_default(),
        "--timeout-s",
        "120",
    ]);
    let st = d.wait_exit(Duration::from_secs(120))?;
    if o.status.success() {
        return Err("create succeeded although the daemon was to die after bind-gpu".into());
    }
    match driver_of(&edu).as_deref() {
        Some("vfio-pci") => {}
        other => {
            return Err(format!(
            "the daemon died ({st}) with edu on {other:?}: the crash was not after bind-gpu:\n{}",
            d.log_tail()
        ))
        }
    }
    println!("ok: tenantvmd died after bind-gpu ({st}), edu on vfio-pci, no VM yet");
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
        if driver_of(&edu).as_deref() != Some("vfio-pci") {
            return Err(format!(
                "resumed and running, but edu is on {:?}",
                driver_of(&edu)
            ));
        }
        let line = guest_report(&cli, &d)?;
        println!("ok: after the restart the create resumed; the guest: {line}");
        destroy(&cli, &d)?;
    } else {
        println!("ok: after the restart the create was rolled back");
    }
    check_given_back(&edu, &format!("after the crash and restart ({outcome})"))?;
    println!("ok: converged ({outcome}): edu {edu} on no driver");
    drop(d);
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nh-gpu-tenant: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
