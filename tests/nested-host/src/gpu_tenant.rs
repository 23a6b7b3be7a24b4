//! A GPU tenant through a real tenantvmd, shared by the scenario programs that hand a real
//! device to a tenant (`nh-gpu-tenant`: QEMU's edu given whole; `nh-vgpu-sriov`: a real
//! SR-IOV VF of QEMU's nvme as a MIG-backed vGPU): tenantvmd over a SIMULATED GPU host file
//! with `--gpu-sysfs-root /` (this host's real sysfs), the `tenantvm` CLI against it, and
//! what the checks read back (drivers, the guest's report, the receipt, step times).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::scenario::Daemon;

/// Writes the image `name` under `images`: the no_std test guest (NH_TEST_GUESTS) told to
/// run `test` (`tvm.test=`). The tenant specs name it as `[image] name = NAME`.
pub fn test_guest_image(images: &Path, name: &str, test: &str) -> Result<(), String> {
    let guests = crate::scenario::env_path("NH_TEST_GUESTS")?;
    let image = images.join(name);
    std::fs::create_dir_all(&image).map_err(|e| e.to_string())?;
    std::fs::copy(guests.join("tvm-testguest"), image.join("kernel"))
        .map_err(|e| format!("{}: {e}", guests.join("tvm-testguest").display()))?;
    std::fs::write(
        image.join("cmdline"),
        format!("console=ttyS0 tvm.test={test}"),
    )
    .map_err(|e| e.to_string())
}

/// Deadline of one CLI command that waits for the guest (create, destroy).
pub const LIFECYCLE_TIMEOUT_S: u64 = 300;

/// What every daemon of a scenario shares.
pub struct Setup {
    /// NH_BIN: tenantvmd, tenantvm, tenantvm-vmm, tenantvm-jail.
    pub bin: PathBuf,
    /// The scenario's folder (NH_WORK): logs, the host KEK, specs.
    pub work: PathBuf,
    /// The SIMULATED GPU host file.
    pub sim: PathBuf,
    /// The image directory (`--image-dir`).
    pub images: PathBuf,
}

impl Setup {
    /// Starts tenantvmd on `state` (its socket inside), with the crash hook armed when
    /// `crash_at` is given; waits until the socket answers.
    pub fn daemon(
        &self,
        state: &Path,
        log_name: &str,
        crash_at: Option<&str>,
    ) -> Result<Daemon, String> {
        let socket = state.join("tenantvmd.sock");
        let log = self.work.join(log_name);
        let log_file = std::fs::File::create(&log).map_err(|e| e.to_string())?;
        let mut cmd = Command::new(self.bin.join("tenantvmd"));
        cmd.arg("--state-dir")
            .arg(state)
            .arg("--socket")
            .arg(&socket)
            .args(["--backend", "vmm"])
            .arg("--image-dir")
            .arg(&self.images)
            .arg("--vmm-binary")
            .arg(self.bin.join("tenantvm-vmm"))
            .arg("--gpu-backend")
            .arg(format!("sim:{}", self.sim.display()))
            .args(["--gpu-sysfs-root", "/"])
            .args(["--boot-timeout-s", "120", "--stop-grace-s", "5"])
            // Nested KVM under TCG on a loaded host: a VMM took over 10 s to answer.
            .args(["--launch-timeout-s", "60"])
            .args([
                "--host-reserved-memory-mib",
                "256",
                "--vcpu-overcommit",
                "8",
            ])
            .env("TENANTVMD_KEK_FILE", self.work.join("host-kek"))
            .env("TENANTVMD_KEYSLOT_COST", "test")
            .env("RUST_LOG", "info")
            .env_remove("TENANTVM_TEST_CRASH_AT")
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().map_err(|e| e.to_string())?)
            .stderr(log_file);
        if let Some(at) = crash_at {
            cmd.env("TENANTVM_TEST_CRASH_AT", at);
        }
        let child = cmd
            .spawn()
            .map_err(|e| format!("starting tenantvmd: {e}"))?;
        let mut d = Daemon { child, log };
        d.wait_ready(&socket)?;
        Ok(d)
    }

    /// The CLI against the daemon on `state`, with its admin token.
    pub fn cli(&self, state: &Path) -> Cli {
        Cli {
            cli: crate::cli::Cli {
                bin: self.bin.join("tenantvm"),
                socket: state.join("tenantvmd.sock"),
            },
            token: state.join("admin.token"),
        }
    }
}

/// `tenantvm` against one daemon.
pub struct Cli {
    cli: crate::cli::Cli,
    token: PathBuf,
}

impl Cli {
    /// Runs `tenantvm ARGS` (never fails: a command that cannot start exits 127).
    pub fn run(&self, args: &[&str]) -> Output {
        self.cli.run(&self.token, args)
    }

    /// Runs the command; an error with its output (and the daemon's) when it fails.
    pub fn ok(&self, args: &[&str], d: &Daemon) -> Result<Output, String> {
        self.cli.ok(&self.token, args, d)
    }

    /// The tenant's state, or None when it does not exist.
    pub fn state(&self, tenant: &str) -> Result<Option<String>, String> {
        let o = self.run(&["status", tenant, "--json"]);
        if !o.status.success() {
            let err = String::from_utf8_lossy(&o.stderr).to_lowercase();
            if err.contains("no tenant named") {
                return Ok(None);
            }
            return Err(format!("tenantvm status: {}: {err}", o.status));
        }
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).map_err(|e| e.to_string())?;
        Ok(v["state"].as_str().map(str::to_string))
    }
}

/// The driver `address` is bound to now (None: no driver), from this host's sysfs.
pub fn driver_of(address: &str) -> Option<String> {
    std::fs::read_link(format!("/sys/bus/pci/devices/{address}/driver"))
        .ok()
        .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
}

/// The device's `driver_override` (`(null)` when none is set).
pub fn override_of(address: &str) -> String {
    std::fs::read_to_string(format!("/sys/bus/pci/devices/{address}/driver_override"))
        .map_or_else(|e| format!("unreadable: {e}"), |s| s.trim().to_string())
}

/// Waits until `tenant` runs (an error when it fails or takes longer than a create may).
pub fn wait_running(cli: &Cli, d: &Daemon, tenant: &str) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(LIFECYCLE_TIMEOUT_S);
    loop {
        match cli.state(tenant)?.as_deref() {
            Some("running") => return Ok(()),
            Some("failed") => return Err(format!("{tenant} failed:\n{}", d.log_tail())),
            _ => {}
        }
        if Instant::now() > deadline {
            return Err(format!("{tenant} not running in time:\n{}", d.log_tail()));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// `tenantvm create` of `work/tenant.toml`, its token to `work/tenant.token`.
pub fn create(cli: &Cli, work: &Path, d: &Daemon) -> Result<(), String> {
    let spec = work.join("tenant.toml");
    let timeout = LIFECYCLE_TIMEOUT_S.to_string();
    cli.ok(
        &[
            "create",
            spec.to_str().unwrap_or_default(),
            "--token-out",
            work.join("tenant.token").to_str().unwrap_or_default(),
            "--timeout-s",
            &timeout,
        ],
        d,
    )?;
    Ok(())
}

/// `tenantvm destroy TENANT`, waiting for the departure.
pub fn destroy(cli: &Cli, d: &Daemon, tenant: &str) -> Result<(), String> {
    let timeout = LIFECYCLE_TIMEOUT_S.to_string();
    cli.ok(&["destroy", tenant, "--timeout-s", &timeout], d)?;
    Ok(())
}

/// One receipt line by step name.
pub fn receipt_step<'a>(
    steps: &'a [serde_json::Value],
    name: &str,
) -> Result<&'a serde_json::Value, String> {
    steps
        .iter()
        .find(|s| s["step"] == name)
        .ok_or_else(|| format!("the receipt has no {name} line: {steps:?}"))
}

/// A benchmark round's create: a fresh daemon on `state` (its log `log_name`), then
/// `tenantvm create SPEC` until `tenant` runs; the daemon, its CLI and the seconds from the
/// create command to `running`.
pub fn timed_create(
    setup: &Setup,
    state: &Path,
    log_name: &str,
    spec: &Path,
    tenant: &str,
) -> Result<(Daemon, Cli, f64), String> {
    let d = setup.daemon(state, log_name, None)?;
    let cli = setup.cli(state);
    let timeout = LIFECYCLE_TIMEOUT_S.to_string();
    let t = Instant::now();
    cli.ok(
        &[
            "create",
            spec.to_str().unwrap_or_default(),
            "--timeout-s",
            &timeout,
        ],
        &d,
    )?;
    wait_running(&cli, &d, tenant)?;
    Ok((d, cli, t.elapsed().as_secs_f64()))
}

/// From a receipt's device-reset line, the VMM's own reset of `device` at detach (its exit
/// report, as the daemon recorded it).
pub fn vmm_reset_of(reset: &serde_json::Value, device: &str) -> Result<String, String> {
    reset["evidence"]
        .as_object()
        .and_then(|e| {
            e.iter()
                .find(|(k, _)| k.starts_with("vmm reset at detach") && k.contains(device))
        })
        .map(|(_, v)| v.as_str().unwrap_or_default().to_string())
        .ok_or_else(|| format!("device-reset lacks the VMM's own reset of {device}: {reset}"))
}

/// A receipt's gpu-scrub line, checked to say `simulated` (a simulated host's scrub).
pub fn simulated_scrub(steps: &[serde_json::Value]) -> Result<(), String> {
    let scrub = receipt_step(steps, "gpu-scrub")?;
    if scrub["assurance"] != "simulated" {
        return Err(format!(
            "the scrub of a simulated GPU must say simulated: {scrub}"
        ));
    }
    Ok(())
}

/// The steps of `tenant`'s last departure receipt (`tenantvm receipt show --json`).
pub fn receipt_steps(
    cli: &Cli,
    d: &Daemon,
    tenant: &str,
) -> Result<Vec<serde_json::Value>, String> {
    let o = cli.ok(&["receipt", "show", tenant, "--json"], d)?;
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).map_err(|e| e.to_string())?;
    v["receipts"][0]["receipt"]["steps"]
        .as_array()
        .cloned()
        .ok_or_else(|| format!("no receipt steps: {v}"))
}

/// Waits for the test guest's `TVMTEST <test>` report on `tenant`'s console and returns
/// it; an error unless it says PASS and holds every one of `wants`.
pub fn guest_report(
    cli: &Cli,
    d: &Daemon,
    tenant: &str,
    test: &str,
    wants: &[&str],
    limit: Duration,
) -> Result<String, String> {
    let deadline = Instant::now() + limit;
    let tag = format!("TVMTEST {test} ");
    loop {
        let o = cli.run(&["logs", tenant, "--stream", "serial", "--tail", "200"]);
        let text = String::from_utf8_lossy(&o.stdout).to_string();
        if let Some(line) = text.lines().find(|l| l.contains(&tag)) {
            if !line.contains(&format!("{test} PASS")) {
                return Err(format!("the guest reports: {line}"));
            }
            for want in wants {
                if !line.contains(want) {
                    return Err(format!("the guest's report lacks {want}: {line}"));
                }
            }
            return Ok(line.trim().to_string());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "no report from the test guest in {} s; its console:\n{text}\ndaemon log:\n{}",
                limit.as_secs(),
                d.log_tail()
            ));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The median (the upper one of an even count); sorts `v`.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The steps of a fresh daemon's first operation (the create) and how long each took, ms,
/// read from its store: where a device's cost goes.
pub fn create_step_times(state: &Path) -> Result<Vec<(String, f64)>, String> {
    let store = tenantvm::store::Store::open(&state.join("state.db"))
        .map_err(|e| format!("opening {}: {e}", state.display()))?;
    let steps = store
        .steps(1)
        .map_err(|e| format!("reading the steps: {e}"))?;
    if steps.is_empty() {
        return Err("the daemon recorded no steps for its first operation".into());
    }
    Ok(steps
        .into_iter()
        .filter_map(|s| {
            let ms = s.finished_ms? - s.started_ms;
            Some((s.step, ms as f64))
        })
        .collect())
}
