//! What the llama.cpp engine's end-to-end tests need, as
//! `guest-image/variants/llama-cpp/prepare.sh` builds it into `.cache`: the variant's image
//! set, the generated test model and the pinned Python tools (the OpenAI client).

use std::path::PathBuf;

use super::daemon::TestDaemon;
use super::guest_image::{have, install_image, repo_root};
use super::tls::FrontDoorTls;

/// What prepare.sh builds.
pub struct Prepared {
    /// The llama-cpp variant's image set.
    pub image: PathBuf,
    /// The test model (a small random llama GGUF).
    pub model: PathBuf,
    /// The Python of the pinned tools' virtual environment.
    pub python: PathBuf,
}

/// What prepare.sh built, or why a test cannot run here (for its SKIP line).
pub fn prepared() -> Result<Prepared, String> {
    let cache = repo_root().join(".cache");
    let p = Prepared {
        image: cache.join("guest-image-llama-cpp"),
        model: cache.join("llama-cpp/test-model.gguf"),
        python: cache.join("llama-cpp/venv/bin/python"),
    };
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root (jails set uids, cgroups and namespaces)".into());
    }
    if !have("qemu-system-x86_64") {
        return Err("qemu-system-x86_64 is not installed (run scripts/setup.sh)".into());
    }
    for (what, path) in [
        ("the llama-cpp image set", p.image.join("manifest.json")),
        ("the test model", p.model.clone()),
        ("the pinned OpenAI client", p.python.clone()),
    ] {
        if !path.is_file() {
            return Err(format!(
                "{what} is not built ({} missing): run guest-image/variants/llama-cpp/prepare.sh",
                path.display()
            ));
        }
    }
    Ok(p)
}

/// A started `tenantvmd --backend qemu-tcg` with the front door at `door` and the variant's
/// image set installed as the named image `llama` (deadlines for TCG boots).
pub fn llama_daemon(p: &Prepared, door: &FrontDoorTls) -> TestDaemon {
    let mut d = TestDaemon::new()
        .with_args(&[
            "--backend",
            "qemu-tcg",
            "--boot-timeout-s",
            "300",
            "--agent-timeout-s",
            "600",
            "--stop-grace-s",
            "30",
        ])
        .with_front_door(door);
    install_image(&p.image, &d.dir.path().join("img"), "llama");
    d.start(None);
    d
}
