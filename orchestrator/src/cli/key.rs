//! `tenantvm key create|list|revoke TENANT`: inference keys for the front door
//! (docs/frontdoor.md), through the daemon's API with the admin token or the tenant's own.

use std::io::Write;

use clap::Subcommand;
use hyper::Method;

use super::{output, CliFailure};
use crate::api::keys::{KeyCreated, KeyList, KeyRevoked};
use crate::client::Client;

/// `tenantvm key ...`.
#[derive(Debug, Subcommand)]
pub enum KeyCommand {
    /// Make an inference key for TENANT: printed once on standard output (only its hash is
    /// kept). Clients use it as their OpenAI API key at the front door.
    Create {
        /// Tenant name.
        tenant: String,
        /// Print JSON (id, key, shown).
        #[arg(long)]
        json: bool,
    },
    /// List TENANT's keys by id and first characters, revoked ones too.
    List {
        /// Tenant name.
        tenant: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Revoke one of TENANT's keys (its id from `key list`); it stops working at once.
    Revoke {
        /// Tenant name.
        tenant: String,
        /// The key's id.
        id: i64,
    },
}

fn path(tenant: &str) -> String {
    // Tenant names are [a-z0-9-]; anything else is refused by the daemon as not found.
    format!("/v1/tenants/{tenant}/keys")
}

fn when(ms: i64) -> String {
    let t =
        std::time::UNIX_EPOCH + std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    humantime::format_rfc3339_seconds(t).to_string()
}

/// Runs a `key` subcommand.
pub async fn run(
    client: &Client,
    cmd: KeyCommand,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<(), CliFailure> {
    match cmd {
        KeyCommand::Create { tenant, json } => {
            let made: KeyCreated = client
                .call(Method::POST, &path(&tenant), Some(b"{}".to_vec()))
                .await?;
            if json {
                output::print_json(out, &made)?;
            } else {
                writeln!(
                    err,
                    "tenant {}: inference key {} (shown once; keep it secret):",
                    made.tenant, made.id
                )?;
                writeln!(out, "{}", made.key)?;
            }
        }
        KeyCommand::List { tenant, json } => {
            let list: KeyList = client.call(Method::GET, &path(&tenant), None).await?;
            if json {
                output::print_json(out, &list)?;
            } else {
                writeln!(out, "{:<6} {:<16} {:<22} REVOKED", "ID", "KEY", "CREATED")?;
                for k in &list.keys {
                    writeln!(
                        out,
                        "{:<6} {:<16} {:<22} {}",
                        k.id,
                        format!("{}...", k.shown),
                        when(k.created_ms),
                        k.revoked_ms.map_or_else(|| "-".into(), when)
                    )?;
                }
            }
        }
        KeyCommand::Revoke { tenant, id } => {
            let done: KeyRevoked = client
                .call(Method::DELETE, &format!("{}/{id}", path(&tenant)), None)
                .await?;
            writeln!(
                out,
                "tenant {}: inference key {} revoked",
                done.tenant, done.id
            )?;
        }
    }
    Ok(())
}
