//! The outer guest: the stock kernel under `qemu-system-x86_64 -M q35 -accel tcg -cpu max`
//! (AMD SVM with nested paging, so the guest has /dev/kvm) with an emulated Intel IOMMU
//! (`intel-iommu,intremap=on,caching-mode=on`, `intel_iommu=on`), two `edu` devices, an
//! `nvme` device and an SR-IOV capable `nvme` (each in its own IOMMU group, for vfio), the
//! root file system from
//! build-rootfs.sh, a scratch disk, the console in a file and the results on a virtio-serial
//! port.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::catalog::Scenario;
use crate::heartbeat::HeartbeatPump;
use crate::inputs::{check_kernel, kernel_dir, Inputs};
use crate::watch::{watch_with, Heartbeat, Outcome, Progress, Stop, WatchConfig, Watched};
use crate::HarnessError;

/// The name of the virtio-serial port the results come back on (init.sh looks for it).
pub const RESULTS_PORT: &str = "org.tenantvm.nested.results";

/// The name of the virtio-serial port the outer guest's heartbeat comes on (init.sh).
pub const HEARTBEAT_PORT: &str = "org.tenantvm.nested.heartbeat";

/// The SR-IOV NVMe controller's virtual functions (`sriov_totalvfs` in the outer guest).
pub const SR_IOV_MAX_VFS: u32 = 2;

/// How the outer root file system is packed (build-rootfs.sh --format).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RootFormat {
    /// An ext4 image (mke2fs -d) on a read-only virtio disk, behind a small initramfs.
    Ext4,
    /// One uncompressed initramfs holding everything.
    Initramfs,
}

impl RootFormat {
    fn as_str(self) -> &'static str {
        match self {
            RootFormat::Ext4 => "ext4",
            RootFormat::Initramfs => "initramfs",
        }
    }
}

impl std::str::FromStr for RootFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ext4" => Ok(RootFormat::Ext4),
            "initramfs" => Ok(RootFormat::Initramfs),
            _ => Err(format!("root format must be ext4 or initramfs, got {s:?}")),
        }
    }
}

/// How to boot the outer guest.
#[derive(Clone, Debug)]
pub struct OuterConfig {
    /// The QEMU binary.
    pub qemu: PathBuf,
    /// Guest memory in MiB (inner guests of up to 1 GiB run in it).
    pub memory_mib: u32,
    /// Guest vCPUs (TCG threads).
    pub vcpus: u32,
    /// The root file system's packing.
    pub format: RootFormat,
    /// The scratch disk's size in GiB (sparse).
    pub scratch_gib: u32,
    /// Time to the first scenario's start.
    pub boot_timeout: Duration,
    /// Time beyond a scenario's limit before the outer guest counts as hung.
    pub grace: Duration,
    /// Where the run's files go (console.log, results, the disks).
    pub work_dir: PathBuf,
    /// How long the guest's heartbeat may stay silent before it counts as frozen.
    pub heartbeat_silence: Duration,
    /// How often the host nudges the guest with a device interrupt on the heartbeat port
    /// (none: never). The nudge is the cure for the outer guest's freeze: see
    /// [`crate::heartbeat`] and docs/testing.md.
    pub nudge: Option<Duration>,
    /// How many times the outer guest may be booted for one run: after a freeze, a hang or
    /// a crash, the scenarios that had not started run in a fresh guest.
    pub max_boots: u32,
    /// Extra words for the outer kernel's command line (experiments: timer modes, ...).
    pub extra_append: Vec<String>,
    /// Extra QEMU arguments (experiments: `-accel tcg,...`, `-icount ...`).
    pub extra_qemu_args: Vec<String>,
}

impl OuterConfig {
    /// The defaults: $QEMU or qemu-system-x86_64, 3 GiB, 1 vCPU, ext4 (it boots faster here;
    /// docs/testing.md), an 8 GiB scratch disk, 300 s to boot, 120 s grace.
    ///
    /// One vCPU: with two, QEMU 7.2's multi-threaded TCG now and then froze the whole outer
    /// guest (both vCPUs in its kernel with interrupts off) while inner guests ran under
    /// nested SVM, and on this 2-core machine one vCPU was as fast or faster anyway.
    pub fn new(work_dir: PathBuf) -> Self {
        OuterConfig {
            qemu: std::env::var_os("QEMU")
                .map_or_else(|| "qemu-system-x86_64".into(), PathBuf::from),
            memory_mib: 3072,
            vcpus: 1,
            format: RootFormat::Ext4,
            scratch_gib: 8,
            boot_timeout: Duration::from_secs(300),
            grace: Duration::from_secs(120),
            work_dir,
            heartbeat_silence: Duration::from_secs(30),
            nudge: Some(Duration::from_secs(1)),
            max_boots: 3,
            extra_append: Vec::new(),
            extra_qemu_args: Vec::new(),
        }
    }
}

fn have(tool: &Path) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg("command -v \"$0\"")
        .arg(tool)
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Builds (or finds in the cache) the outer root for `scenarios`; returns its folder.
pub fn build_root(
    inputs: &Inputs,
    format: RootFormat,
    scenarios: &[Scenario],
) -> Result<PathBuf, HarnessError> {
    let script = crate::harness_dir().join("build-rootfs.sh");
    let mut cmd = Command::new(&script);
    cmd.args(["--format", format.as_str()]);
    let mut needs: Vec<&String> = scenarios.iter().flat_map(|s| &s.needs).collect();
    needs.sort();
    needs.dedup();
    for need in needs {
        cmd.args(["--need", need]);
    }
    cmd.arg(&inputs.path).stderr(Stdio::inherit());
    let out = cmd
        .output()
        .map_err(|e| HarnessError::Setup(format!("cannot run {}: {e}", script.display())))?;
    if !out.status.success() {
        return Err(HarnessError::Setup(format!(
            "{} failed ({}); see its message above",
            script.display(),
            out.status
        )));
    }
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    Ok(PathBuf::from(dir))
}

/// The QEMU command line for `root` (from [`build_root`]) running `scenarios`.
pub fn qemu_args(
    cfg: &OuterConfig,
    kernel: &Path,
    root: &Path,
    scenarios: &[Scenario],
) -> Vec<OsString> {
    let w = &cfg.work_dir;
    let names: Vec<&str> = scenarios.iter().map(|s| s.name.as_str()).collect();
    // no_timer_check: on a loaded host, TCG can miss the ticks the kernel's early check of
    // the timer through the interrupt-remapped I/O APIC waits for, and the kernel panics
    // ("timer doesn't work through Interrupt-remapped IO-APIC") before init.
    let mut cmdline = format!(
        "console=ttyS0 intel_iommu=on no_timer_check panic=-1 loglevel=4 nh.run={}",
        names.join(",")
    );
    if cfg.format == RootFormat::Initramfs {
        cmdline.push_str(" rdinit=/init");
    }
    for word in &cfg.extra_append {
        cmdline.push(' ');
        cmdline.push_str(word);
    }
    let mut args: Vec<OsString> = Vec::new();
    let mut push = |a: String| args.push(a.into());
    for a in [
        "-M",
        "q35",
        "-accel",
        "tcg",
        "-cpu",
        "max",
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-monitor",
        "none",
        "-no-reboot",
    ] {
        push(a.into());
    }
    push("-m".into());
    push(cfg.memory_mib.to_string());
    push("-smp".into());
    push(cfg.vcpus.to_string());
    // The IOMMU first: devices created after it sit behind it. caching-mode lets vfio in the
    // guest map DMA through it.
    push("-device".into());
    push("intel-iommu,intremap=on,caching-mode=on".into());
    push("-kernel".into());
    push(kernel.display().to_string());
    push("-initrd".into());
    push(root.join("initrd").display().to_string());
    push("-append".into());
    push(cmdline);
    push("-chardev".into());
    push(format!(
        "file,id=console,path={}",
        w.join("console.log").display()
    ));
    push("-serial".into());
    push("chardev:console".into());
    push("-device".into());
    push("virtio-serial-pci,id=vser0".into());
    push("-chardev".into());
    push(format!(
        "file,id=results,path={}",
        w.join("results").display()
    ));
    push("-device".into());
    push(format!(
        "virtserialport,bus=vser0.0,chardev=results,name={RESULTS_PORT}"
    ));
    push("-chardev".into());
    push(format!(
        "socket,id=heartbeat,path={},server=on,wait=off",
        w.join("heartbeat.sock").display()
    ));
    push("-device".into());
    push(format!(
        "virtserialport,bus=vser0.0,chardev=heartbeat,name={HEARTBEAT_PORT}"
    ));
    if cfg.format == RootFormat::Ext4 {
        push("-drive".into());
        push(format!(
            "file={},format=raw,if=none,id=root,readonly=on",
            root.join("root.ext4").display()
        ));
        push("-device".into());
        push("virtio-blk-pci,drive=root,serial=nh-root".into());
    }
    push("-drive".into());
    push(format!(
        "file={},format=raw,if=none,id=scratch,cache=unsafe",
        w.join("scratch.img").display()
    ));
    push("-device".into());
    push("virtio-blk-pci,drive=scratch,serial=nh-scratch".into());
    // Devices for vfio: edu (1234:11e8, no reset method) twice, nvme (1b36:0010, FLR).
    push("-device".into());
    push("edu".into());
    push("-device".into());
    push("edu".into());
    push("-drive".into());
    push(format!(
        "file={},format=raw,if=none,id=nv0",
        w.join("nvme.img").display()
    ));
    push("-device".into());
    push("nvme,serial=nh-nvme,drive=nv0".into());
    // An SR-IOV physical function for the MIG-backed vGPU route (scenario gpu-vgpu-sriov):
    // QEMU's nvme in an NVMe subsystem (SR-IOV needs one) with SR_IOV_MAX_VFS virtual
    // functions, each able to take 2 flexible queues (admin + one I/O) and 1 interrupt; with
    // Intel's ids (8086:5845), so that nothing looking for the nvme above (1b36:0010) finds
    // it. No namespace: the VFs' controllers are what is passed through. Created after the
    // devices above, so their addresses and IOMMU groups stay as they were.
    push("-device".into());
    push("nvme-subsys,id=nh-sriov-subsys,nqn=nh-sriov".into());
    push("-device".into());
    push(format!(
        "nvme,serial=nh-sriov,subsys=nh-sriov-subsys,use-intel-id=on,sriov_max_vfs={SR_IOV_MAX_VFS},\
         sriov_vq_flexible={},sriov_vi_flexible={SR_IOV_MAX_VFS},sriov_max_vq_per_vf=2,sriov_max_vi_per_vf=1",
        2 * SR_IOV_MAX_VFS
    ));
    // QMP, for the CPU state when the guest stops answering.
    push("-qmp".into());
    push(format!(
        "unix:{},server=on,wait=off",
        w.join("qmp.sock").display()
    ));
    for a in &cfg.extra_qemu_args {
        push(a.clone());
    }
    args
}

/// A QMP connection to the outer guest's QEMU, for looking inside when it stops answering.
struct Qmp {
    reader: std::io::BufReader<std::os::unix::net::UnixStream>,
    writer: std::os::unix::net::UnixStream,
}

impl Qmp {
    fn connect(path: &Path) -> std::io::Result<Self> {
        use std::io::BufRead;
        let stream = std::os::unix::net::UnixStream::connect(path)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut qmp = Qmp {
            reader: std::io::BufReader::new(stream.try_clone()?),
            writer: stream,
        };
        let mut greeting = String::new();
        qmp.reader.read_line(&mut greeting)?;
        qmp.execute(r#"{"execute":"qmp_capabilities"}"#)?;
        Ok(qmp)
    }

    /// Sends one command; returns its answer's `return` (a string as is, anything else as
    /// JSON) or the error line.
    fn execute(&mut self, cmd: &str) -> std::io::Result<String> {
        use std::io::{BufRead, Write};
        writeln!(self.writer, "{cmd}")?;
        let mut line = String::new();
        loop {
            line.clear();
            if self.reader.read_line(&mut line)? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            // Asynchronous events come in between; the answer has "return" or "error".
            if line.contains("\"return\"") || line.contains("\"error\"") {
                break;
            }
        }
        let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
        Ok(match v.get("return") {
            Some(serde_json::Value::String(text)) => text.clone(),
            Some(other) => other.to_string(),
            None => line.trim().to_string(),
        })
    }

    /// A human monitor command (`info registers -a`, `info lapic`, ...).
    fn hmp(&mut self, command: &str) -> std::io::Result<String> {
        let cmd = serde_json::json!({
            "execute": "human-monitor-command",
            "arguments": {"command-line": command}
        });
        self.execute(&cmd.to_string())
    }
}

/// The monitor commands whose answers say what a stopped outer guest's CPU and interrupt
/// controllers were doing: the registers (HLT, RFLAGS.IF, the SVM state), the local APIC
/// (timer mode and count, IRR/ISR/TPR), the legacy PIC.
const STATE_COMMANDS: [&str; 4] = ["info cpus", "info registers -a", "info lapic", "info pic"];

/// Saves every answer of [`STATE_COMMANDS`] under a heading to `out`.
fn dump_state(qmp: &mut Qmp, out: &mut String) {
    for command in STATE_COMMANDS {
        out.push_str(&format!("==== {command}\n"));
        match qmp.hmp(command) {
            Ok(text) => out.push_str(&text),
            Err(e) => out.push_str(&format!("(no answer: {e})\n")),
        }
        out.push('\n');
    }
}

/// What the outer guest was doing when it stopped answering, written to `dir/cpu-state.txt`:
/// the state of its CPU and interrupt controllers. For a frozen guest, two probes follow,
/// each with the state again: an NMI (does the CPU run at all?), then one device interrupt
/// (a key press on the i8042: QEMU's I/O thread raises it at the local APIC, which makes the
/// vCPU look at the APIC again). A heartbeat that comes back after the device interrupt is
/// the lost interrupt request of docs/testing.md ("A frozen outer guest"). Returns one line
/// for the failure's reason.
pub fn diagnose(dir: &Path, stop: &Stop) -> Option<String> {
    let state = dir.join("cpu-state.txt");
    let mut qmp = match Qmp::connect(&dir.join("qmp.sock")) {
        Ok(qmp) => qmp,
        Err(e) => return Some(format!("its state could not be read over QMP: {e}")),
    };
    let mut text = String::new();
    dump_state(&mut qmp, &mut text);
    let mut found = String::new();
    if matches!(stop, Stop::Froze { .. }) {
        let heartbeat = dir.join("heartbeat");
        let beats = || std::fs::metadata(&heartbeat).map_or(0, |m| m.len());
        let probes = [
            ("an NMI", r#"{"execute":"inject-nmi"}"#),
            (
                "a device interrupt (a key press)",
                r#"{"execute":"send-key","arguments":{"keys":[{"type":"qcode","data":"shift"}]}}"#,
            ),
        ];
        let mut woke_by = None;
        for (what, cmd) in probes {
            let before = beats();
            text.push_str(&format!("==== {what}: {cmd}\n"));
            text.push_str(&qmp.execute(cmd).unwrap_or_else(|e| e.to_string()));
            text.push('\n');
            // The heartbeat beats every 5 s; give it two beats.
            std::thread::sleep(Duration::from_secs(11));
            let woke = beats() > before;
            text.push_str(&format!(
                "==== 11 s after {what}: the heartbeat {}\n",
                if woke { "came back" } else { "stayed silent" }
            ));
            dump_state(&mut qmp, &mut text);
            if woke {
                woke_by = Some(what);
                break;
            }
        }
        found = match woke_by {
            Some(what) => format!("; {what} woke it"),
            None => "; neither an NMI nor a device interrupt woke it".to_string(),
        };
    }
    match std::fs::write(&state, text) {
        Ok(()) => Some(format!("its state is in {}{found}", state.display())),
        Err(e) => Some(format!(
            "its state could not be saved to {}: {e}",
            state.display()
        )),
    }
}

fn make_disks(cfg: &OuterConfig) -> Result<(), HarnessError> {
    let setup = |what: &str, e: std::io::Error| HarnessError::Setup(format!("cannot {what}: {e}"));
    std::fs::create_dir_all(&cfg.work_dir).map_err(|e| setup("create the work folder", e))?;
    let scratch = cfg.work_dir.join("scratch.img");
    let _ = std::fs::remove_file(&scratch);
    std::fs::File::create(&scratch)
        .and_then(|f| f.set_len(u64::from(cfg.scratch_gib) << 30))
        .map_err(|e| setup("create the scratch disk", e))?;
    let status = Command::new("mke2fs")
        .args([
            "-q",
            "-F",
            "-t",
            "ext4",
            "-O",
            "^has_journal",
            "-L",
            "nh-scratch",
        ])
        .arg(&scratch)
        .status()
        .map_err(|e| {
            HarnessError::Setup(format!("cannot run mke2fs ({e}): run scripts/setup.sh"))
        })?;
    if !status.success() {
        return Err(HarnessError::Setup(format!(
            "mke2fs of the scratch disk failed: {status}"
        )));
    }
    std::fs::File::create(cfg.work_dir.join("nvme.img"))
        .and_then(|f| f.set_len(64 << 20))
        .map_err(|e| setup("create the nvme backing file", e))?;
    for f in ["console.log", "results", "heartbeat"] {
        std::fs::write(cfg.work_dir.join(f), b"").map_err(|e| setup("create the logs", e))?;
    }
    Ok(())
}

/// Boots the outer guest and runs `scenarios` in it, in order; calls `report` with each
/// outcome as it arrives. When the guest freezes, hangs or crashes, the scenario it was
/// running fails with the reason (and, for a freeze or a hang, where its state was saved);
/// the scenarios that had not started then run in a fresh guest, up to `cfg.max_boots`
/// boots in all. Nothing is run twice. Each boot's files (console.log, results, heartbeat,
/// cpu-state.txt) stay in the work folder (`boot-N/` for the second and later boots); the
/// disks are deleted.
pub fn run(
    cfg: &OuterConfig,
    inputs: &Inputs,
    scenarios: &[Scenario],
    report: &mut dyn FnMut(&Progress),
) -> Result<Vec<Outcome>, HarnessError> {
    let kdir = kernel_dir();
    check_kernel(&kdir)?;
    if !have(&cfg.qemu) {
        return Err(HarnessError::Setup(format!(
            "{} is not installed: run scripts/setup.sh",
            cfg.qemu.display()
        )));
    }
    let started = Instant::now();
    let root = build_root(inputs, cfg.format, scenarios)?;
    eprintln!(
        "nested-host: outer root {} ready after {:.1} s",
        root.display(),
        started.elapsed().as_secs_f64()
    );
    let mut outcomes: Vec<Outcome> = Vec::new();
    let mut pending: Vec<Scenario> = scenarios.to_vec();
    for boot in 1..=cfg.max_boots.max(1) {
        let mut boot_cfg = cfg.clone();
        if boot > 1 {
            boot_cfg.work_dir = cfg.work_dir.join(format!("boot-{boot}"));
            eprintln!(
                "nested-host: booting a fresh outer guest (boot {boot} of at most {}) for {}",
                cfg.max_boots,
                pending
                    .iter()
                    .map(|s| s.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        let watched = boot_once(&boot_cfg, &kdir, &root, &pending, report)?;
        // A full disk is not cured by another boot (its root file system cannot be made).
        let disk_full = matches!(watched.stop, Some(Stop::HostDiskFull { .. }));
        let last_boot = boot == cfg.max_boots.max(1) || disk_full;
        if watched.not_run.is_empty() || last_boot {
            watched.report_not_run(report);
            outcomes.extend(watched.outcomes);
            break;
        }
        outcomes.extend(
            watched
                .outcomes
                .into_iter()
                .filter(|o| !watched.not_run.contains(&o.name)),
        );
        pending.retain(|s| watched.not_run.contains(&s.name));
    }
    // In the order asked for.
    let ordered = scenarios
        .iter()
        .filter_map(|s| outcomes.iter().find(|o| o.name == s.name).cloned())
        .collect();
    eprintln!(
        "nested-host: outer guest done after {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(ordered)
}

/// One boot of the outer guest running `scenarios`.
fn boot_once(
    cfg: &OuterConfig,
    kdir: &Path,
    root: &Path,
    scenarios: &[Scenario],
    report: &mut dyn FnMut(&Progress),
) -> Result<Watched, HarnessError> {
    let started = Instant::now();
    make_disks(cfg)?;
    let args = qemu_args(cfg, &kdir.join("vmlinuz"), root, scenarios);
    eprintln!(
        "nested-host: booting the outer guest (console: {})",
        cfg.work_dir.join("console.log").display()
    );
    let mut child = Command::new(&cfg.qemu)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(
            std::fs::File::create(cfg.work_dir.join("qemu.stderr"))
                .map_err(|e| HarnessError::Setup(format!("cannot create qemu.stderr: {e}")))?,
        )
        .spawn()
        .map_err(|e| HarnessError::Setup(format!("cannot start {}: {e}", cfg.qemu.display())))?;
    let pump = HeartbeatPump::start(
        cfg.work_dir.join("heartbeat.sock"),
        cfg.work_dir.join("heartbeat"),
        cfg.nudge,
    );
    let watch_cfg = WatchConfig {
        results: cfg.work_dir.join("results"),
        console: cfg.work_dir.join("console.log"),
        boot_timeout: cfg.boot_timeout,
        grace: cfg.grace,
        what: "the outer guest",
        heartbeat: Some(Heartbeat {
            path: cfg.work_dir.join("heartbeat"),
            silence: cfg.heartbeat_silence,
        }),
    };
    let dir = cfg.work_dir.clone();
    let watched = watch_with(&mut child, scenarios, &watch_cfg, report, &mut |stop| {
        let found = diagnose(&dir, stop);
        if let Some(line) = &found {
            eprintln!("nested-host: {line}");
        }
        found
    });
    // After DONE the guest powers off; give it a moment, then make sure it is gone.
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline && child.try_wait().ok().flatten().is_none() {
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    let nudges = pump.nudges();
    drop(pump);
    let _ = std::fs::remove_file(cfg.work_dir.join("scratch.img"));
    let _ = std::fs::remove_file(cfg.work_dir.join("nvme.img"));
    eprintln!(
        "nested-host: the outer guest ran {:.1} s ({nudges} nudges)",
        started.elapsed().as_secs_f64()
    );
    Ok(watched)
}
