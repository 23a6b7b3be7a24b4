//! `tenantvm-agent`: PID 1 of the guest initramfs. Mounts the basics, loads the kernel
//! modules named in the image config, serves the control channel, and powers off after
//! `shutdown`. Run outside a VM only with `--config` for inspection (`--check`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tenantvm_agent::agent::Agent;
use tenantvm_agent::config::{AgentConfig, DEFAULT_CONFIG_PATH};
use tenantvm_agent::logbuf::LogBuffer;
use tenantvm_agent::reaper::Reaper;
use tenantvm_agent::{init, kmod, load, server};

/// How long to wait for the virtio-serial port to show up after module loading.
const PORT_WAIT: Duration = Duration::from_secs(30);

fn fatal(msg: &str, is_init: bool) -> ! {
    eprintln!("tenantvm-agent: fatal: {msg}");
    if is_init {
        // PID 1 must not exit (the kernel would panic); power off so the host sees it.
        let e = init::power_off();
        eprintln!("tenantvm-agent: power off failed: {e}");
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    std::process::exit(1);
}

fn kernel_release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn main() {
    let is_init = std::process::id() == 1;
    // A load worker: the agent runs itself as a child for each test load (load.rs).
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if !is_init && argv.first().map(String::as_str) == Some(load::WORKER_ARG) {
        match load::run_worker(&argv[1..]) {
            Ok(()) => std::process::exit(0),
            Err(e) => {
                eprintln!("tenantvm-agent load-worker: {e}");
                std::process::exit(1);
            }
        }
    }
    let mut args = std::env::args().skip(1);
    let mut config_path = PathBuf::from(DEFAULT_CONFIG_PATH);
    let mut check_only = false;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--config" => match args.next() {
                Some(p) => config_path = PathBuf::from(p),
                None => fatal("--config needs a path", is_init),
            },
            "--check" => check_only = true,
            // The kernel passes unknown command-line words to init; ignore them there.
            _ if is_init => {}
            other => fatal(
                &format!(
                    "unknown argument {other:?}; usage: tenantvm-agent [--config PATH] [--check]"
                ),
                false,
            ),
        }
    }

    if is_init {
        if let Err(e) = init::mount_basics() {
            fatal(&e.to_string(), true);
        }
        if let Err(e) = init::attach_console() {
            // Keep going: the channel matters more than the console.
            eprintln!("tenantvm-agent: {e}");
        }
    }
    let cfg = match AgentConfig::load(&config_path) {
        Ok(c) => c,
        Err(e) => fatal(&e.to_string(), is_init),
    };
    if check_only {
        println!("config {} is valid", config_path.display());
        return;
    }
    if !is_init {
        fatal(
            "the agent must run as PID 1 of the guest (use --check to validate a config)",
            false,
        );
    }

    let reaper = match Reaper::start() {
        Ok(r) => r,
        Err(e) => fatal(&format!("cannot start the reaper: {e}"), true),
    };
    let logs = Arc::new(LogBuffer::new(2000));
    let agent = Agent::new(cfg.clone(), reaper, logs);
    agent.log(&format!("starting, kernel {}", kernel_release()));
    if let Err(e) = init::loopback_up() {
        agent.log(&e.to_string());
    }
    let modules_dir = Path::new("/lib/modules").join(kernel_release());
    match kmod::load_modules(&modules_dir, &cfg.modules) {
        Ok(report) => {
            agent.log(&format!("loaded {} kernel modules", report.inserted.len()));
            for (name, e) in &report.failed {
                agent.log(&format!("kernel module {name} not loaded: {e}"));
            }
        }
        Err(e) => agent.log(&format!("module loading stopped: {e}")),
    }
    if let Err(e) = server::serve(&agent, Path::new("/sys"), PORT_WAIT) {
        agent.log(&e.to_string());
        agent.shutdown();
    }
    agent.log("powering off");
    let e = init::power_off();
    fatal(&format!("reboot(RB_POWER_OFF) failed: {e}"), true);
}
