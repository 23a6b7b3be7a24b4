//! The confinement against the real kernel: a root holding only busybox-static, a data
//! directory bound in, an unprivileged uid. Needs root (mount namespaces, chroot, setuid)
//! and busybox-static on the host; otherwise the tests say SKIP.

use std::process::{Command, Stdio};

use super::*;

fn busybox() -> Option<PathBuf> {
    ["/bin/busybox", "/usr/bin/busybox"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
}

fn blocker() -> Option<String> {
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (mount namespaces, chroot, setuid)".into());
    }
    if busybox().is_none() {
        return Some("busybox-static is not installed (run scripts/setup.sh)".into());
    }
    None
}

/// `cmd`'s stdout and exit code, through the process's [`Reaper`] (other tests in this
/// binary run it: a plain `wait` would lose the child to it); retried while the
/// just-copied busybox is still open for writing in a child another test thread forked
/// meanwhile (ETXTBSY).
fn output(cmd: &mut Command) -> (String, i32) {
    use std::io::Read;
    let reaper = crate::reaper::Reaper::start().unwrap();
    for _ in 0..100 {
        match reaper.spawn(cmd) {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => panic!("spawn: {e}"),
            Ok(mut child) => {
                let mut out = String::new();
                child
                    .stdout
                    .take()
                    .unwrap()
                    .read_to_string(&mut out)
                    .unwrap();
                let code = reaper
                    .wait(child.pid, std::time::Duration::from_secs(60))
                    .expect("the shell did not exit");
                return (out, code);
            }
        }
    }
    panic!("busybox stayed busy");
}

struct World {
    _dir: tempfile::TempDir,
    root: PathBuf,
    data: PathBuf,
    secret: PathBuf,
}

/// A payload root with busybox, a data directory with a file, and a secret beside both.
fn world() -> World {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("payload");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::copy(busybox().unwrap(), root.join("bin/busybox")).unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(data.join("models")).unwrap();
    std::fs::write(data.join("models/m.gguf"), b"GGUF weights").unwrap();
    let secret = dir.path().join("agent-secret");
    std::fs::write(&secret, b"disk key material").unwrap();
    World {
        _dir: dir,
        root,
        data,
        secret,
    }
}

/// Runs `script` under the root's busybox sh, unconfined (the control); its stdout and
/// exit status.
fn run_unconfined(w: &World, script: &str) -> (String, i32) {
    output(&mut shell(&w.root.join("bin/busybox"), script))
}

/// `busybox sh -c script` with a bare environment and its stdout piped.
fn shell(busybox: &Path, script: &str) -> Command {
    let mut cmd = Command::new(busybox);
    cmd.args(["sh", "-c", script])
        .env_clear()
        .env("PATH", "/bin")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    cmd
}

/// Runs `script` under busybox sh confined in `w`'s root as uid 4242, with the world's
/// data directory as the data disk; its stdout and exit status.
fn run_confined(w: &World, script: &str) -> (String, i32) {
    // The path is looked up inside the root, after the chroot.
    let mut cmd = shell(Path::new("/bin/busybox"), script);
    let cfg = ConfineConfig {
        root: w.root.clone(),
        uid: 4242,
    };
    let data = DataMount {
        source: &w.data,
        inside: Path::new("/data"),
    };
    apply(&mut cmd, &cfg, data, Path::new("/"), Path::new("/dev")).unwrap();
    output(&mut cmd)
}

#[test]
fn the_payload_sees_its_root_and_the_data_disk_only_as_an_unprivileged_user() {
    if let Some(why) = blocker() {
        tenantvm_skip::skip!("{why}");
    }
    let w = world();
    let secret = w.secret.display().to_string();
    // Positive control: unconfined, the same shell reads the secret and runs as root.
    let (out, code) = run_unconfined(&w, &format!("id -u; cat {secret}"));
    assert_eq!(code, 0, "{out}");
    assert_eq!(out, "0\ndisk key material");
    let (out, code) = run_confined(
        &w,
        &format!(
            "echo uid=$(id -u) gid=$(id -g) groups=$(id -G); \
             echo root=$(ls / | tr '\\n' ' '); \
             echo dev=$(ls /dev | tr '\\n' ' '); \
             echo model=$(cat /data/models/m.gguf); \
             cat {secret} 2>/dev/null || echo no-secret; \
             touch /x 2>/dev/null || echo root-read-only; \
             touch /sys/x 2>/dev/null || echo sys-read-only; \
             grep NoNewPrivs /proc/self/status; \
             echo pgid=$(cut -d' ' -f5 /proc/self/stat) sid=$(cut -d' ' -f6 /proc/self/stat) pid=$$"
        ),
    );
    assert_eq!(code, 0, "{out}");
    let line = |key: &str| {
        out.lines()
            .find(|l| l.starts_with(key))
            .unwrap_or_else(|| panic!("no {key} in {out}"))
            .to_string()
    };
    assert_eq!(line("uid="), "uid=4242 gid=4242 groups=4242");
    // The root holds busybox and the mount points, nothing of the host around it.
    let root_line = line("root=");
    let root: Vec<&str> = root_line["root=".len()..].split_whitespace().collect();
    for entry in ["bin", "data", "dev", "proc", "sys", "tmp"] {
        assert!(root.contains(&entry), "{root:?}");
    }
    assert!(!root.contains(&"agent-secret"), "{root:?}");
    assert_eq!(line("dev="), "dev=full null random urandom zero");
    assert_eq!(line("model="), "model=GGUF weights");
    assert!(out.contains("no-secret"), "{out}");
    assert!(out.contains("root-read-only"), "{out}");
    assert!(out.contains("sys-read-only"), "{out}");
    assert!(line("NoNewPrivs").ends_with('1'), "{out}");
    // Its own session and process group (the supervisor signals the group).
    let ids = line("pgid=");
    let f: Vec<&str> = ids.split(' ').collect();
    assert_eq!(f[0]["pgid=".len()..], f[2]["pid=".len()..], "{ids}");
    assert_eq!(f[1]["sid=".len()..], f[2]["pid=".len()..], "{ids}");
    // Nothing leaked into the agent's namespace.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(&w.root.display().to_string()),
        "a confined payload's mount is visible to the agent"
    );
}

#[test]
fn uid_zero_and_the_host_root_are_refused() {
    let mut cmd = Command::new("/bin/true");
    let root0 = ConfineConfig {
        root: "/payload".into(),
        uid: 0,
    };
    assert!(matches!(
        apply(
            &mut cmd,
            &root0,
            DataMount {
                source: Path::new("/data"),
                inside: Path::new("/data"),
            },
            Path::new("/"),
            Path::new("/dev")
        ),
        Err(ConfineError::Invalid(_))
    ));
    let slash = ConfineConfig {
        root: "/".into(),
        uid: 1000,
    };
    assert!(matches!(slash.validate(), Err(ConfineError::Invalid(_))));
    let relative = ConfineConfig {
        root: "payload".into(),
        uid: 1000,
    };
    assert!(matches!(relative.validate(), Err(ConfineError::Invalid(_))));
}

#[test]
fn gpu_device_nodes_are_passed_on_when_the_guest_has_them() {
    let dir = tempfile::tempdir().unwrap();
    for n in ["nvidia0", "nvidiactl", "nvidia-uvm", "sda", "kvm"] {
        std::fs::write(dir.path().join(n), b"").unwrap();
    }
    std::fs::create_dir(dir.path().join("nvidia-caps")).unwrap();
    assert_eq!(
        devices(dir.path()),
        vec![
            "null",
            "zero",
            "full",
            "random",
            "urandom",
            "nvidia-uvm",
            "nvidia0",
            "nvidiactl"
        ]
    );
}
