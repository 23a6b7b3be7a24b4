//! `tenantvm`: the command-line client of tenantvmd. See `tenantvm --help`.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = tenantvm::cli::Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tenantvm: cannot start the async runtime: {e}");
            return ExitCode::from(tenantvm::cli::exit::OTHER);
        }
    };
    ExitCode::from(rt.block_on(tenantvm::cli::run(cli)))
}
