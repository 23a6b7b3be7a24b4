//! `tenantvm payload restart TENANT`: the guest agent stops the tenant's inference server
//! and starts it again (to serve a model just pushed), and the command waits until it
//! answers its health check (`POST /v1/tenants/{name}/payload/restart`).

use std::io::Write;

use clap::Subcommand;
use hyper::Method;

use super::{output, CliFailure};
use crate::api::payload::{PayloadRestarted, RestartRequest};
use crate::client::Client;

/// `tenantvm payload ...`.
#[derive(Debug, Subcommand)]
pub enum PayloadCommand {
    /// Restart TENANT's inference server in its guest (e.g. after `tenantvm model push`, so
    /// that an engine serving one model at a time serves the new one) and wait until it is
    /// ready. Fails (exit 9) with the server's exit code when it does not come up: read its
    /// log with `tenantvm logs TENANT`.
    Restart {
        /// Tenant name.
        tenant: String,
        /// Seconds to wait for readiness (0: only restart).
        #[arg(long, default_value_t = 600)]
        timeout_s: u64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Runs a `payload` subcommand.
pub async fn run(
    client: &Client,
    cmd: PayloadCommand,
    out: &mut dyn Write,
) -> Result<(), CliFailure> {
    match cmd {
        PayloadCommand::Restart {
            tenant,
            timeout_s,
            json,
        } => {
            let body = serde_json::to_vec(&RestartRequest {
                wait_s: Some(timeout_s),
            })
            .expect("serialisable");
            let done: PayloadRestarted = client
                .call(
                    Method::POST,
                    &format!("/v1/tenants/{tenant}/payload/restart"),
                    Some(body),
                )
                .await?;
            if json {
                output::print_json(out, &done)?;
            } else {
                writeln!(
                    out,
                    "tenant {}: inference server restarted (guest pid {}){} in {:.1} s",
                    done.tenant,
                    done.pid,
                    if done.ready { ", ready" } else { "" },
                    done.seconds
                )?;
            }
        }
    }
    Ok(())
}
