//! The stock-kernel scenario's program: tenantvm-vmm boots the stock Debian kernel with a
//! small initramfs (tenantvm_nested_host::stock) to userspace, and the guest's Linux drives
//! the VMM's devices. Needs /dev/kvm that runs Linux (the nested host's outer guest, or a
//! real host).
//!
//! ```text
//! nh-stock-kernel check              the four boots below
//! nh-stock-kernel bench RUNS QEMU    userspace under tenantvm-vmm and under QEMU -accel kvm
//! nh-stock-kernel vfio SYSFS_DEVICE  the device passed through, listed by the guest with
//!                                    its host ids (tenantvm_nested_host::stock_vfio)
//! ```
//! env: NH_BIN (tenantvm-vmm), NH_KERNEL_DIR, NH_GUEST_TOOLS (nh-vsock-echo), NH_WORK.
//!
//! Each check boot: Linux reaches userspace with the vCPU count asked for; virtio_pci binds
//! the three functions and virtio_blk, virtio_rng and vmw_vsock_virtio_transport bind their
//! devices; the disk's header reads back, a pattern written at sector 8 reads back after the
//! page cache is dropped and is in the host file afterwards; the rng gives 32 bytes that are
//! not all equal; a vsock round trip each way (the host through the VMM's hybrid socket to a
//! guest listener, the guest to a host listener on `<socket>_5000`); then ACPI power-off
//! (VMM exit 0) or a reboot (exit 3, the reset status). Boots: vmlinux through PVH on 1 vCPU
//! and through its 64-bit entry (`--boot linux`) on 2, the bzImage on 1 and on 2; the last
//! one reboots, the others power off.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use tenantvm_nested_host::scenario::env_path;
use tenantvm_nested_host::stock::{self, GUEST_PORT, HOST_PORT, PATTERN_SECTOR};
use tenantvm_nested_host::stock_vfio;
use tenantvm_nested_host::vm::SerialVm;

const BOOT_TIMEOUT: Duration = Duration::from_secs(300);
const MEMORY_MIB: u32 = 512;
/// The exit statuses of tenantvm-vmm (docs/vmm.md).
const EXIT_POWER_OFF: i32 = 0;
const EXIT_RESET: i32 = 3;

struct Env {
    vmm: PathBuf,
    kernel_dir: PathBuf,
    work: PathBuf,
    initramfs: PathBuf,
}

fn setup() -> Result<Env, String> {
    let vmm = env_path("NH_BIN")?.join("tenantvm-vmm");
    let kernel_dir = env_path("NH_KERNEL_DIR")?;
    let work = env_path("NH_WORK")?;
    let busybox = which("busybox").ok_or("busybox is not installed (run scripts/setup.sh)")?;
    let echo = env_path("NH_GUEST_TOOLS")?.join("nh-vsock-echo");
    let image = stock::initramfs(&kernel_dir, &busybox, &echo).map_err(|e| e.to_string())?;
    let initramfs = work.join("stock-initramfs.cpio");
    std::fs::write(&initramfs, &image)
        .map_err(|e| format!("writing {}: {e}", initramfs.display()))?;
    println!(
        "initramfs: {} KiB with busybox, the virtio modules and nh-vsock-echo",
        image.len() >> 10
    );
    Ok(Env {
        vmm,
        kernel_dir,
        work,
        initramfs,
    })
}

fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(tool))
        .find(|p| p.is_file())
}

/// One boot of the check.
struct Boot {
    kernel: &'static str,
    /// `--boot`: auto (PVH for the vmlinux, which has the note) or linux (its 64-bit entry).
    entry: &'static str,
    vcpus: u32,
    reboot: bool,
}

fn line_value(serial: &str, prefix: &str) -> Option<String> {
    serial.lines().find_map(|l| {
        l.trim_end_matches('\r')
            .strip_prefix(prefix)
            .map(str::to_string)
    })
}

fn check_boot(env: &Env, n: usize, boot: &Boot) -> Result<(), String> {
    let label = format!(
        "{} (--boot {}) on {} vCPU(s), {}",
        boot.kernel,
        boot.entry,
        boot.vcpus,
        if boot.reboot { "reboot" } else { "power-off" }
    );
    let dir = env.work.join(format!("boot{n}"));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let disk = dir.join("disk.img");
    let mut header = b"tenantvm-disk-ok".to_vec();
    header.resize(64 << 20, 0);
    std::fs::write(&disk, &header).map_err(|e| e.to_string())?;
    let pattern = format!("nh-pattern-{}-{}", std::process::id(), n);
    let sock = dir.join("v.sock");
    // The guest-initiated connection: the VMM connects to <socket>_<port>.
    let host_listener = UnixListener::bind(format!("{}_{HOST_PORT}", sock.display()))
        .map_err(|e| format!("binding the host vsock listener: {e}"))?;
    host_listener
        .set_nonblocking(true)
        .map_err(|e| e.to_string())?;
    let host_side = std::thread::spawn(move || -> Result<String, String> {
        let deadline = Instant::now() + BOOT_TIMEOUT;
        let stream = loop {
            match host_listener.accept() {
                Ok((s, _)) => break s,
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => return Err(format!("no guest connection to host port {HOST_PORT}: {e}")),
            }
        };
        stream.set_nonblocking(false).map_err(|e| e.to_string())?;
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .map_err(|e| e.to_string())?;
        let mut line = String::new();
        BufReader::new(&stream)
            .read_line(&mut line)
            .map_err(|e| format!("reading the guest's line: {e}"))?;
        (&stream)
            .write_all(line.as_bytes())
            .map_err(|e| e.to_string())?;
        Ok(line.trim_end().to_string())
    });

    let mut cmd = Command::new(&env.vmm);
    cmd.arg("--kernel")
        .arg(env.kernel_dir.join(boot.kernel))
        .arg("--initramfs")
        .arg(&env.initramfs)
        .args(["--boot", boot.entry])
        .args([
            "--memory-mib",
            &MEMORY_MIB.to_string(),
            "--vcpus",
            &boot.vcpus.to_string(),
        ])
        .arg("--cmdline")
        .arg(format!(
            "console=ttyS0 reboot=k panic=1 quiet rdinit=/init nh.pattern={pattern} nh.end={}",
            if boot.reboot { "reboot" } else { "poweroff" }
        ))
        .arg("--disk")
        .arg(format!("path={}", disk.display()))
        .arg("--vsock")
        .arg(format!("cid=3,socket={}", sock.display()))
        .args(["--rng", "on"]);
    let mut vm = SerialVm::spawn(cmd, &dir.join("serial.log"))
        .map_err(|e| format!("starting {}: {e}", env.vmm.display()))?;
    let userspace = vm.wait_for("NHSK: userspace reached", BOOT_TIMEOUT)?;
    vm.wait_for("NHSK: vsock listening", Duration::from_secs(120))?;

    // Host to guest through the hybrid socket.
    let mut s =
        UnixStream::connect(&sock).map_err(|e| format!("connecting to {}: {e}", sock.display()))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .map_err(|e| e.to_string())?;
    s.write_all(format!("CONNECT {GUEST_PORT}\n").as_bytes())
        .map_err(|e| e.to_string())?;
    let mut reader = BufReader::new(s.try_clone().map_err(|e| e.to_string())?);
    let mut ok_line = String::new();
    reader
        .read_line(&mut ok_line)
        .map_err(|e| format!("reading the CONNECT answer: {e}"))?;
    if !ok_line.starts_with("OK ") {
        return Err(format!("CONNECT {GUEST_PORT} answered {ok_line:?}"));
    }
    let msg = format!("host-hello-{pattern}\n");
    s.write_all(msg.as_bytes()).map_err(|e| e.to_string())?;
    let mut back = vec![0u8; msg.len()];
    reader
        .read_exact(&mut back)
        .map_err(|e| format!("reading the echo from the guest: {e}"))?;
    if back != msg.as_bytes() {
        return Err(format!(
            "the guest echoed {:?} for {msg:?}",
            String::from_utf8_lossy(&back)
        ));
    }
    drop(reader);
    drop(s); // EOF: the guest's echo ends.

    let status = vm.wait_exit(BOOT_TIMEOUT).ok_or_else(|| {
        format!(
            "{label}: the VM did not end; last lines:\n{}\nwhat it is doing:\n{}",
            vm.serial_tail(30),
            vm.diagnose()
        )
    })?;
    let took = vm.elapsed();
    let serial = vm.serial();
    let fail = |what: String| {
        Err(format!(
            "{label}: {what}; last lines:\n{}",
            vm.serial_tail(30)
        ))
    };

    let want_exit = if boot.reboot {
        EXIT_RESET
    } else {
        EXIT_POWER_OFF
    };
    if status.code() != Some(want_exit) {
        return fail(format!("VMM exit status {status}, want {want_exit}"));
    }
    let cpus = format!("NHSK: userspace reached on {} CPUs", boot.vcpus);
    if !serial.contains(&cpus) {
        return fail(format!("no {cpus:?}"));
    }
    for d in ["virtio_blk", "virtio_rng", "vmw_vsock_virtio_transport"] {
        if !serial.contains(&format!("NHSK: bound {d} virtio")) {
            return fail(format!("{d} did not bind a device"));
        }
    }
    if line_value(&serial, "NHSK: virtio-pci functions ").as_deref() != Some("3") {
        return fail("virtio_pci did not bind the three functions".into());
    }
    if line_value(&serial, "NHSK: rng_current ").as_deref() != Some("virtio_rng.0") {
        return fail("the rng is not virtio_rng.0".into());
    }
    if line_value(&serial, "NHSK: disk header ").as_deref() != Some("tenantvm-disk-ok") {
        return fail("the disk header did not read back".into());
    }
    if line_value(&serial, "NHSK: disk readback ").as_deref() != Some(pattern.as_str()) {
        return fail("the pattern did not read back from the disk".into());
    }
    let rng = line_value(&serial, "NHSK: rng ").unwrap_or_default();
    if rng.len() != 64 || rng.chars().all(|c| rng.starts_with(c)) {
        return fail(format!("the rng gave {rng:?}, want 32 varied bytes"));
    }
    let guest_line = host_side
        .join()
        .map_err(|_| "the host listener panicked".to_string())??;
    if guest_line != format!("guest-hello-{pattern}")
        || !serial.contains(&format!(
            "NHSK: nh-vsock-echo: got back guest-hello-{pattern}"
        ))
    {
        return fail(format!(
            "guest-to-host vsock round trip: host got {guest_line:?}"
        ));
    }
    if !serial.contains("NHSK: vsock echo done") {
        return fail("the guest's vsock echo did not finish".into());
    }
    let bytes = std::fs::read(&disk).map_err(|e| e.to_string())?;
    let at = (PATTERN_SECTOR * 512) as usize;
    if bytes.get(at..at + pattern.len()) != Some(pattern.as_bytes()) {
        return fail("the host file does not hold the pattern at sector 8".into());
    }
    println!(
        "ok: {label}: userspace at {userspace:.1} s, devices bound, disk/rng/vsock checked, exit {want_exit} at {took:.1} s"
    );
    let _ = std::fs::remove_file(&disk);
    Ok(())
}

fn check() -> Result<(), String> {
    let env = setup()?;
    let boot = |kernel, entry, vcpus, reboot| Boot {
        kernel,
        entry,
        vcpus,
        reboot,
    };
    let boots = [
        boot("vmlinux", "auto", 1, false),
        boot("vmlinux", "linux", 2, false),
        boot("vmlinuz", "auto", 1, false),
        boot("vmlinuz", "auto", 2, true),
    ];
    for (n, boot) in boots.iter().enumerate() {
        check_boot(&env, n, boot)?;
    }
    Ok(())
}

/// Time from process start to the guest's first userspace line.
fn to_userspace(cmd: Command, log: &Path) -> Result<f64, String> {
    let mut vm = SerialVm::spawn(cmd, log).map_err(|e| e.to_string())?;
    let t = vm.wait_for("NHSK: userspace reached", BOOT_TIMEOUT)?;
    vm.wait_exit(Duration::from_secs(60));
    Ok(t)
}

fn bench(runs: usize, qemu: &str) -> Result<(), String> {
    let env = setup()?;
    let cmdline = "console=ttyS0 reboot=k panic=1 quiet rdinit=/init nh.mode=bench";
    let kernel = env.kernel_dir.join("vmlinuz");
    let mut tvm = Vec::new();
    let mut qem = Vec::new();
    for run in 0..runs {
        let mut c = Command::new(&env.vmm);
        c.arg("--kernel")
            .arg(&kernel)
            .arg("--initramfs")
            .arg(&env.initramfs);
        c.args([
            "--memory-mib",
            &MEMORY_MIB.to_string(),
            "--cmdline",
            cmdline,
        ]);
        tvm.push(to_userspace(
            c,
            &env.work.join(format!("bench-tvm{run}.log")),
        )?);
        // QEMU's microvm with KVM: the same peer scripts/bench.sh uses, on the same kernel
        // and initramfs.
        let mut q = Command::new(qemu);
        q.args([
            "-M",
            "microvm",
            "-accel",
            "kvm",
            "-cpu",
            "host",
            "-m",
            &MEMORY_MIB.to_string(),
        ]);
        q.args([
            "-smp",
            "1",
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-serial",
            "stdio",
            "-no-reboot",
        ]);
        q.arg("-kernel")
            .arg(&kernel)
            .arg("-initrd")
            .arg(&env.initramfs)
            .args(["-append", cmdline]);
        qem.push(to_userspace(
            q,
            &env.work.join(format!("bench-qemu{run}.log")),
        )?);
        println!(
            "run {run}: tenantvm-vmm {:.2} s, qemu microvm {:.2} s",
            tvm[run], qem[run]
        );
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (t, q) = (median(&mut tvm), median(&mut qem));
    let figure = format!(
        "stock kernel (bzImage, 1 vCPU, {MEMORY_MIB} MiB) to userspace, median of {runs}: tenantvm-vmm {t:.2} s, qemu -M microvm -accel kvm {q:.2} s, ratio qemu/tenantvm {:.2}x",
        q / t
    );
    println!("{figure}");
    if let Ok(notes) = std::env::var("NH_NOTES") {
        let _ = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(notes)
            .and_then(|mut f| writeln!(f, "{figure}"));
    }
    Ok(())
}

/// The stock kernel lists a passed-through device with its host ids.
fn vfio(device: &str) -> Result<(), String> {
    let run = stock_vfio::Run {
        vmm: env_path("NH_BIN")?.join("tenantvm-vmm"),
        kernel: env_path("NH_KERNEL_DIR")?.join("vmlinux"),
        busybox: which("busybox").ok_or("busybox is not installed (run scripts/setup.sh)")?,
        work: env_path("NH_WORK")?,
        device: PathBuf::from(device),
    };
    let start = Instant::now();
    let listing = run.check()?;
    println!("{listing}");
    println!(
        "ok: the stock kernel lists {device} with its host ids ({:.1} s)",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("check") => check(),
        Some("bench") => match (args.get(1).and_then(|r| r.parse().ok()), args.get(2)) {
            (Some(runs), Some(qemu)) if runs > 0 => bench(runs, qemu),
            _ => Err("usage: nh-stock-kernel bench RUNS QEMU".into()),
        },
        Some("vfio") => match args.get(1) {
            Some(device) => vfio(device),
            None => Err("usage: nh-stock-kernel vfio /sys/bus/pci/devices/BDF".into()),
        },
        _ => Err(
            "usage: nh-stock-kernel check | bench RUNS QEMU | vfio /sys/bus/pci/devices/BDF".into(),
        ),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nh-stock-kernel: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
