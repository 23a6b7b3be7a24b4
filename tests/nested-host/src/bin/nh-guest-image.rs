//! The guest-image scenario's program: the product's guest image (guest-image/build.sh)
//! under tenantvm-vmm, with a LUKS2 disk made by the orchestrator's own disk code
//! (`tenantvm::disk::create_image`) as virtio-blk and the agent reached through the VMM's
//! hybrid vsock socket by the agent's host client. Needs /dev/kvm that runs Linux.
//!
//! ```text
//! nh-guest-image [--ready-only]
//! ```
//! env: NH_BIN (tenantvm-vmm), NH_GUEST_IMAGE, NH_WORK; NH_NOTES (optional: figures).
//!
//! Checks: the agent answers `status` over vsock with the disk locked; a wrong key is
//! refused; the right key unlocks, the mount formats ext4 on first use, the payload starts
//! and becomes ready, a completion comes back (greedy decoding of the CI model continues the
//! Gettysburg Address); `shutdown` stops the payload, unmounts, closes the disk and the VMM
//! exits 0 (ACPI power-off); afterwards the host image holds neither the marker sent in the
//! prompt nor the model's text in plaintext. With --ready-only it stops after `status` (the
//! benchmark's boot-to-ready figure).

use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use tenantvm::disk::{create_image, KeyslotCost};
use tenantvm::keys::DiskKey;
use tenantvm_agent_protocol::{AgentClient, AgentEndpoint};
use tenantvm_agent_protocol::{DiskKey as AgentDiskKey, DiskState, HttpRequest};
use tenantvm_nested_host::scenario::{env_path, note};
use tenantvm_nested_host::vm::SerialVm;

const READY_TIMEOUT: Duration = Duration::from_secs(420);
const STEP_TIMEOUT: Duration = Duration::from_secs(300);
const DISK_BYTES: u64 = 64 << 20;
const MEMORY_MIB: u32 = 1024;

/// Whether `needle` occurs in `haystack` (glibc's memmem: a naive scan of a whole disk
/// image takes minutes in a debug build under emulation).
fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    // SAFETY: both pointers are valid for the lengths given; memmem only reads them.
    let found = unsafe {
        libc::memmem(
            haystack.as_ptr().cast(),
            haystack.len(),
            needle.as_ptr().cast(),
            needle.len(),
        )
    };
    !found.is_null()
}

fn run(ready_only: bool) -> Result<(), String> {
    let vmm = env_path("NH_BIN")?.join("tenantvm-vmm");
    let image = env_path("NH_GUEST_IMAGE")?;
    let work = env_path("NH_WORK")?;
    let cmdline = std::fs::read_to_string(image.join("cmdline")).map_err(|e| {
        format!(
            "reading {}/cmdline: {e} (run guest-image/build.sh)",
            image.display()
        )
    })?;

    // The tenant disk, exactly as the orchestrator makes it (the test keyslot cost: the
    // production cost's 256 MiB argon2 would only slow the emulated guest's unlock).
    let disk = work.join("tenant.img");
    let key = DiskKey::random().map_err(|e| format!("random key: {e}"))?;
    let t = Instant::now();
    let info =
        create_image(&disk, DISK_BYTES, &key, KeyslotCost::TEST).map_err(|e| e.to_string())?;
    println!(
        "ok: LUKS2 disk by tenantvm::disk: {} {} bits, {} MiB, in {:.1} s",
        info.cipher,
        info.volume_key_bits,
        DISK_BYTES >> 20,
        t.elapsed().as_secs_f64()
    );

    let sock = work.join("agent.vsock");
    let mut cmd = Command::new(&vmm);
    cmd.arg("--kernel")
        .arg(image.join("vmlinux"))
        .arg("--initramfs")
        .arg(image.join("initramfs.cpio.gz"))
        .args(["--memory-mib", &MEMORY_MIB.to_string(), "--vcpus", "1"])
        .args(["--cmdline", cmdline.trim()])
        .arg("--disk")
        .arg(format!("path={}", disk.display()))
        .arg("--vsock")
        .arg(format!("cid=3,socket={}", sock.display()))
        .args(["--rng", "on"]);
    let mut vm = SerialVm::spawn(cmd, &work.join("serial.log"))
        .map_err(|e| format!("starting {}: {e}", vmm.display()))?;
    let tail = |vm: &SerialVm| vm.serial_tail(30);

    let (mut agent, status) =
        AgentClient::wait_for_ready(&AgentEndpoint::vsock(&sock), READY_TIMEOUT)
            .map_err(|e| format!("agent not ready over vsock: {e}; serial:\n{}", tail(&vm)))?;
    let ready = vm.elapsed();
    if status.channel != "vsock" || status.disk != DiskState::Locked {
        return Err(format!(
            "status: channel {}, disk {:?}; want vsock, locked",
            status.channel, status.disk
        ));
    }
    note(&format!(
        "guest image under tenantvm-vmm: agent ready over vsock {ready:.1} s after the VMM started (agent up {} ms)",
        status.uptime_ms
    ));
    if ready_only {
        agent.shutdown(STEP_TIMEOUT).map_err(|e| e.to_string())?;
        vm.wait_exit(Duration::from_secs(120));
        return Ok(());
    }

    let wrong = AgentDiskKey::new(&[0x55; 64]).map_err(|e| e.to_string())?;
    match agent.unlock_disk(&wrong, STEP_TIMEOUT) {
        Err(e) if e.to_string().contains("BadKey") => println!("ok: a wrong key is refused"),
        other => return Err(format!("unlock with a wrong key: {other:?}")),
    }
    let right = AgentDiskKey::new(key.expose()).map_err(|e| e.to_string())?;
    let t = Instant::now();
    agent
        .unlock_disk(&right, STEP_TIMEOUT)
        .map_err(|e| format!("unlock: {e}; serial:\n{}", tail(&vm)))?;
    let formatted = agent
        .mount(true, STEP_TIMEOUT)
        .map_err(|e| format!("mount: {e}; serial:\n{}", tail(&vm)))?;
    if !formatted {
        return Err("a fresh disk must be formatted on first use".into());
    }
    println!(
        "ok: unlocked and mounted (ext4 made) in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    agent
        .start_payload(STEP_TIMEOUT)
        .map_err(|e| e.to_string())?;
    agent
        .wait_payload_ready(STEP_TIMEOUT)
        .map_err(|e| format!("payload: {e}; serial:\n{}", tail(&vm)))?;
    println!("ok: payload ready at {:.1} s", vm.elapsed());

    let marker = format!(
        "NH-MARKER-{:x}-{}",
        std::process::id(),
        vm.elapsed().to_bits()
    );
    let body = serde_json::json!({
        "model": "tenantvm-ngram",
        "prompt": format!("{marker} four score and seven years"),
        "max_tokens": 8,
        "temperature": 0
    });
    let resp = agent
        .infer(
            HttpRequest {
                method: "POST".into(),
                path: "/v1/completions".into(),
                headers: vec![("Content-Type".into(), "application/json".into())],
                body: body.to_string(),
            },
            STEP_TIMEOUT,
        )
        .map_err(|e| format!("inference: {e}"))?;
    if resp.status != 200 {
        return Err(format!("inference answered {}: {}", resp.status, resp.body));
    }
    let v: serde_json::Value = serde_json::from_str(&resp.body).map_err(|e| e.to_string())?;
    let text = v["choices"][0]["text"].as_str().unwrap_or_default();
    if !text.starts_with(" ago our fathers brought forth") {
        return Err(format!("unexpected completion {text:?}"));
    }
    println!("ok: completion {text:?}");

    let report = agent.shutdown(STEP_TIMEOUT).map_err(|e| e.to_string())?;
    if !(report.payload_stopped && report.unmounted && report.disk_closed) {
        return Err(format!("shutdown report {report:?}"));
    }
    let exit = vm
        .wait_exit(Duration::from_secs(120))
        .ok_or("the VM did not power off after shutdown")?;
    if exit.code() != Some(0) {
        return Err(format!(
            "VMM exit status {exit} after the agent's shutdown, want 0; serial:\n{}",
            tail(&vm)
        ));
    }
    println!("ok: clean shutdown, VMM exit 0 at {:.1} s", vm.elapsed());

    let bytes = std::fs::read(&disk).map_err(|e| e.to_string())?;
    if contains(&bytes, marker.as_bytes()) || contains(&bytes, b"four score and seven") {
        return Err("plaintext from the guest reached the host image".into());
    }
    if !contains(&bytes[..4096], b"LUKS\xba\xbe") {
        return Err("the host image lost its LUKS2 header".into());
    }
    println!("ok: the host image holds no plaintext marker");
    Ok(())
}

fn main() -> ExitCode {
    let ready_only = std::env::args().any(|a| a == "--ready-only");
    match run(ready_only) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nh-guest-image: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
