//! What both programs do around their loop: logging (`TENANTVM_LOG`), a small runtime, a
//! client of the API server as `KUBECONFIG` (or the in-cluster service account) says, and
//! an exit status that says how it ended.

use std::fmt::Display;
use std::future::Future;
use std::process::ExitCode;

/// Runs `run` with a client of the API server; `program` names the program in errors.
pub fn main_with_client<F, Fut, E>(program: &str, run: F) -> ExitCode
where
    F: FnOnce(kube::Client) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: Display,
{
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TENANTVM_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let result = rt.block_on(async {
        let client = kube::Client::try_default()
            .await
            .map_err(|e| format!("cannot reach the API server: {e}"))?;
        run(client).await.map_err(|e| e.to_string())
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{program}: {e}");
            ExitCode::FAILURE
        }
    }
}
