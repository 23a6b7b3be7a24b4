//! `tenantvmd`: the tenantvm daemon. See `tenantvmd --help`.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // Each operation runs on its own thread, and glibc gives threads their own malloc arenas
    // that keep memory after it is freed: with 20 tenants created at once the daemon held
    // ~140 MiB, with two arenas ~45 MiB (scripts/bench-orchestrator.sh).
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator tunable; it is called before any thread exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
    if let Err(e) =
        tracing::subscriber::set_global_default(tenantvm::daemon::log_subscriber(std::io::stderr))
    {
        eprintln!("tenantvmd: cannot set up logging: {e}");
        return ExitCode::FAILURE;
    }
    let args = tenantvm::daemon::DaemonArgs::parse();
    let rt = match tenantvm::daemon::runtime() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tenantvmd: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(tenantvm::daemon::run(args));
    // A request or operation still blocked on a guest or VMM must not hold the exit:
    // whatever it was doing is recorded and resumes at the next start.
    rt.shutdown_timeout(std::time::Duration::from_millis(500));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Each cause once, however the error's layers print their sources.
            let e: &(dyn std::error::Error + 'static) = e.as_ref();
            eprintln!("tenantvmd: {}", tenantvm::jail::error_chain(e));
            ExitCode::FAILURE
        }
    }
}
