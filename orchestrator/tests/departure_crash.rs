//! A daemon SIGKILLed at every departure step boundary (TENANTVM_TEST_CRASH_AT, both sides of
//! every destroy step) resumes on restart and finishes with exactly one receipt in an intact
//! audit log, the disk image and the wrapped key gone. Tenants have a disk (QEMU backend, TCG)
//! and a MIG slice of the simulated GPU host. Skips without root, /dev/kvm or QEMU.

mod support;

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use support::daemon::{self, TestDaemon};
use support::departure::{image, keys, ok, receipts_of, text, verify};
use tenantvm::tenant::steps::Op;

#[test]
fn departure_resumes_after_sigkill_at_every_step_boundary() {
    if daemon::should_skip("departure_resumes_after_sigkill_at_every_step_boundary")
        || daemon::skip_without_crash_hook("departure_resumes_after_sigkill_at_every_step_boundary")
    {
        return;
    }
    if let Some(why) = support::departure::qemu_skip() {
        tenantvm_skip::skip!("{why}");
    }
    for (i, step) in Op::Destroy.steps().iter().enumerate() {
        for boundary in ["before", "after"] {
            let case = format!("destroy:{}:{boundary}", step.name());
            let (d, _sim) = TestDaemon::new().with_sim_gpu_host();
            let mut d = d.with_args(&["--backend", "qemu-tcg"]);
            d.start(Some(&case));
            let name = daemon::unique(&format!("dc{i}{}", &boundary[..1]));
            ok(
                support::departure::create_qemu(
                    &d,
                    &name,
                    "disk_gib = 1\ngpu = { kind = \"mig\", profile = \"1g.18gb\" }",
                ),
                &case,
                &d,
            );
            let img = image(&d, &name);
            assert!(img.exists(), "{case}: no image");
            // The destroy's answer may or may not arrive before the daemon dies.
            let _ = support::departure::cli(&d, None, &["destroy", &name, "--no-wait"]);
            let status = d.wait_for_death(Duration::from_secs(120));
            assert_eq!(status.signal(), Some(libc::SIGKILL), "{case}\n{}", d.log());
            d.start(None);
            let deadline = Instant::now() + Duration::from_secs(120);
            while d.store().tenant(&name).unwrap().is_some() {
                assert!(
                    Instant::now() < deadline,
                    "{case}: not destroyed\n{}",
                    d.log()
                );
                std::thread::sleep(Duration::from_millis(100));
            }
            let entries = receipts_of(&d, &name);
            assert_eq!(entries.len(), 1, "{case}: {} receipts", entries.len());
            let r = &entries[0].receipt;
            assert_eq!(r.steps.len(), 7, "{case}: {r:#?}");
            assert!(r.succeeded(), "{case}: {r:#?}");
            let v = verify(&d);
            assert!(v.status.success(), "{case}: {}", text(&v));
            assert!(!img.exists(), "{case}: image left");
            assert!(!keys(&d).exists(&name).unwrap(), "{case}: key left");
            d.stop();
        }
    }
}
