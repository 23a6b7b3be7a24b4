//! The outer guest: the stock kernel under `qemu-system-x86_64 -M q35 -accel tcg -cpu max`
//! (AMD SVM with nested paging, so the guest has /dev/kvm) with an emulated Intel IOMMU
//! (`intel-iommu,intremap=on,caching-mode=on`, `intel_iommu=on`), two `edu` devices and an
//! `nvme` device (each in its own IOMMU group, for vfio), the root file system from
//! build-rootfs.sh, a scratch disk, the console in a file and the results on a virtio-serial
//! port.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::catalog::Scenario;
use crate::inputs::{check_kernel, kernel_dir, Inputs};
use crate::watch::{watch_with, Outcome, Progress, WatchConfig};
use crate::HarnessError;

/// The name of the virtio-serial port the results come back on (init.sh looks for it).
pub const RESULTS_PORT: &str = "org.tenantvm.nested.results";

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
                .map(PathBuf::from)
                .unwrap_or_else(|| "qemu-system-x86_64".into()),
            memory_mib: 3072,
            vcpus: 1,
            format: RootFormat::Ext4,
            scratch_gib: 8,
            boot_timeout: Duration::from_secs(300),
            grace: Duration::from_secs(120),
            work_dir,
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
    // no_timer_check: with interrupt remapping on, the kernel panics when its early check
    // of the IO-APIC timer sees too few ticks, which TCG on a loaded host gives it ("timer
    // doesn't work through Interrupt-remapped IO-APIC", twice in a row at load 10 here).
    let mut cmdline = format!(
        "console=ttyS0 intel_iommu=on no_timer_check panic=-1 loglevel=4 nh.run={}",
        names.join(",")
    );
    if cfg.format == RootFormat::Initramfs {
        cmdline.push_str(" rdinit=/init");
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
    // QMP, for the CPU state when the guest stops answering.
    push("-qmp".into());
    push(format!(
        "unix:{},server=on,wait=off",
        w.join("qmp.sock").display()
    ));
    args
}

/// Asks QEMU (over QMP) for every vCPU's registers and where each is, and writes the answer
/// to `out`: what a hung outer guest was doing.
pub fn save_cpu_state(qmp: &Path, out: &Path) -> std::io::Result<()> {
    use std::io::{BufRead, BufReader, Write};
    let stream = std::os::unix::net::UnixStream::connect(qmp)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    let mut line = String::new();
    reader.read_line(&mut line)?; // the greeting
    let mut text = String::new();
    for cmd in [
        r#"{"execute":"qmp_capabilities"}"#,
        r#"{"execute":"human-monitor-command","arguments":{"command-line":"info cpus"}}"#,
        r#"{"execute":"human-monitor-command","arguments":{"command-line":"info registers -a"}}"#,
    ] {
        writeln!(writer, "{cmd}")?;
        loop {
            line.clear();
            if reader.read_line(&mut line)? == 0 {
                break;
            }
            // Asynchronous events come in between; the answer has "return" or "error".
            if line.contains("\"return\"") || line.contains("\"error\"") {
                break;
            }
        }
        let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
        match v.get("return").and_then(|r| r.as_str()) {
            Some(r) => text.push_str(r),
            None => text.push_str(&line),
        }
        text.push('\n');
    }
    std::fs::write(out, text)
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
    for f in ["console.log", "results"] {
        std::fs::write(cfg.work_dir.join(f), b"").map_err(|e| setup("create the logs", e))?;
    }
    Ok(())
}

/// Boots the outer guest once and runs `scenarios` in it, in order; calls `report` with each
/// outcome as it arrives. The scratch disk is deleted afterwards; console.log and results
/// stay in the work folder.
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
    make_disks(cfg)?;
    let args = qemu_args(cfg, &kdir.join("vmlinuz"), &root, scenarios);
    eprintln!(
        "nested-host: booting the outer guest (root {} ready after {:.1} s; console: {})",
        root.display(),
        started.elapsed().as_secs_f64(),
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
    let watch_cfg = WatchConfig {
        results: cfg.work_dir.join("results"),
        console: cfg.work_dir.join("console.log"),
        boot_timeout: cfg.boot_timeout,
        grace: cfg.grace,
        what: "the outer guest",
    };
    let qmp = cfg.work_dir.join("qmp.sock");
    let cpu_state = cfg.work_dir.join("cpu-state.txt");
    let outcomes =
        watch_with(
            &mut child,
            scenarios,
            &watch_cfg,
            report,
            &mut || match save_cpu_state(&qmp, &cpu_state) {
                Ok(()) => eprintln!(
                    "nested-host: the outer guest's CPU state is in {}",
                    cpu_state.display()
                ),
                Err(e) => eprintln!("nested-host: could not read the CPU state over QMP: {e}"),
            },
        );
    // After DONE the guest powers off; give it a moment, then make sure it is gone.
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline && child.try_wait().ok().flatten().is_none() {
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(cfg.work_dir.join("scratch.img"));
    let _ = std::fs::remove_file(cfg.work_dir.join("nvme.img"));
    eprintln!(
        "nested-host: outer guest done after {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(outcomes)
}
