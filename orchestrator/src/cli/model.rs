//! `tenantvm model push|list|rm`: the tenant's own models, stored on its encrypted disk
//! through its guest agent (docs/frontdoor.md). `push` hashes the file first (SHA-256,
//! checked again in the guest against what was written), then streams it: the file is
//! never held in memory whole.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use clap::Subcommand;
use http_body_util::BodyExt;
use hyper::body::Bytes;
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};

use super::{exit, fail, output, CliFailure};
use crate::api::models::{ModelList, ModelRemoved, ModelStored};
use crate::api::types::ErrorBody;
use crate::channel_body::ChannelBody;
use crate::client::{Client, ClientError};

/// `tenantvm model ...`.
#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Store a model file (or a directory's model.json) on TENANT's encrypted disk, where
    /// its inference server serves it by name. Nothing is visible until the whole model
    /// arrived and its SHA-256 matched.
    Push {
        /// Tenant name.
        tenant: String,
        /// The model file, or a directory holding model.json.
        path: PathBuf,
        /// Its name (default: the file or directory name without extension).
        #[arg(long)]
        name: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List TENANT's stored models.
    List {
        /// Tenant name.
        tenant: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove one of TENANT's models.
    Rm {
        /// Tenant name.
        tenant: String,
        /// The model's name.
        name: String,
    },
}

/// The file to send and its default name.
fn source(path: &Path) -> Result<(PathBuf, String), CliFailure> {
    let file = if path.is_dir() {
        path.join("model.json")
    } else {
        path.to_path_buf()
    };
    if !file.is_file() {
        return Err(fail(
            exit::INVALID,
            format!(
                "{} is not a model file (nor a directory holding model.json)",
                path.display()
            ),
        ));
    }
    let name = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("model")
        .to_string();
    Ok((file, name))
}

fn hash_file(path: &Path) -> Result<(u64, String), CliFailure> {
    let read_err = |e: std::io::Error| {
        fail(
            exit::INVALID,
            format!("Cannot read {}: {e}", path.display()),
        )
    };
    let mut f = std::fs::File::open(path).map_err(read_err)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut n = 0u64;
    loop {
        let got = f.read(&mut buf).map_err(read_err)?;
        if got == 0 {
            return Ok((n, hex::encode(h.finalize())));
        }
        h.update(&buf[..got]);
        n += got as u64;
    }
}

async fn push(
    client: &Client,
    token: &str,
    tenant: &str,
    file: &Path,
    name: &str,
) -> Result<ModelStored, CliFailure> {
    let (size, sha256) = hash_file(file)?;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let path = file.to_path_buf();
    std::thread::spawn(move || {
        let mut f = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) => {
                let _ = tx.blocking_send(Err(e));
                return;
            }
        };
        let mut buf = vec![0u8; 1 << 16];
        loop {
            match f.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    if tx
                        .blocking_send(Ok(Bytes::copy_from_slice(&buf[..n])))
                        .is_err()
                    {
                        return;
                    }
                }
                Err(e) => {
                    let _ = tx.blocking_send(Err(e));
                    return;
                }
            }
        }
    });
    let socket = client.socket().to_path_buf();
    let stream = tokio::net::UnixStream::connect(&socket)
        .await
        .map_err(|source| ClientError::Connect { socket, source })?;
    let http = |e: hyper::Error| CliFailure::from(ClientError::Http(e.to_string()));
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(http)?;
    let conn_task = tokio::spawn(conn);
    let req = Request::builder()
        .method(Method::PUT)
        .uri(format!(
            "http://localhost/v1/tenants/{tenant}/models/{name}"
        ))
        .header("host", "localhost")
        .header("authorization", format!("Bearer {token}"))
        .header("content-length", size)
        .header("x-model-sha256", &sha256)
        .body(ChannelBody::new(rx))
        .map_err(|e| ClientError::Http(e.to_string()))?;
    let resp = sender.send_request(req).await.map_err(|e| {
        CliFailure::from(ClientError::Http(format!(
            "{e}: tenantvmd closed the connection while the model was being sent (it refused the push); \
             check `tenantvm model list {tenant}` and the tenant's free space"
        )))
    })?;
    let status = resp.status();
    let bytes = resp.into_body().collect().await.map_err(http)?.to_bytes();
    conn_task.abort();
    if status.is_success() {
        return serde_json::from_slice(&bytes).map_err(|e| {
            ClientError::Decode {
                status,
                detail: e.to_string(),
            }
            .into()
        });
    }
    Err(match serde_json::from_slice::<ErrorBody>(&bytes) {
        Ok(b) => ClientError::Api {
            status,
            code: b.error.code,
            message: b.error.message,
        },
        Err(_) => ClientError::Decode {
            status,
            detail: String::from_utf8_lossy(&bytes).into_owned(),
        },
    }
    .into())
}

/// Runs a `model` subcommand.
pub async fn run(
    client: &Client,
    token: &str,
    cmd: ModelCommand,
    out: &mut dyn Write,
) -> Result<(), CliFailure> {
    match cmd {
        ModelCommand::Push {
            tenant,
            path,
            name,
            json,
        } => {
            let (file, default_name) = source(&path)?;
            let name = name.unwrap_or(default_name);
            // The guest's rule for names (docs/guest-image.md), checked before any I/O.
            let name_ok = (1..=64).contains(&name.len())
                && !name.starts_with('.')
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
            if !name_ok {
                return Err(fail(
                    exit::INVALID,
                    format!(
                        "Model name {:?} is not 1-64 characters of A-Z a-z 0-9 . _ - starting with a letter, digit or _; pass --name",
                        crate::untrusted::one_line(&name)
                    ),
                ));
            }
            // The tenant is there, yours, and running, before the upload starts.
            let _: ModelList = client
                .call(Method::GET, &format!("/v1/tenants/{tenant}/models"), None)
                .await?;
            let stored = push(client, token, &tenant, &file, &name).await?;
            if json {
                output::print_json(out, &stored)?;
            } else {
                writeln!(
                    out,
                    "tenant {}: model {} stored ({} bytes, sha256 {})",
                    stored.tenant,
                    crate::untrusted::one_line(&stored.name),
                    stored.bytes,
                    crate::untrusted::one_line(&stored.sha256)
                )?;
            }
        }
        ModelCommand::List { tenant, json } => {
            let list: ModelList = client
                .call(Method::GET, &format!("/v1/tenants/{tenant}/models"), None)
                .await?;
            if json {
                output::print_json(out, &list)?;
            } else {
                writeln!(out, "{:<40} {:>14}", "MODEL", "BYTES")?;
                for m in &list.models {
                    // Names come from the guest: one safe line each.
                    writeln!(
                        out,
                        "{:<40} {:>14}",
                        crate::untrusted::one_line(&m.name),
                        m.bytes
                    )?;
                }
            }
        }
        ModelCommand::Rm { tenant, name } => {
            let done: ModelRemoved = client
                .call(
                    Method::DELETE,
                    &format!("/v1/tenants/{tenant}/models/{name}"),
                    None,
                )
                .await?;
            writeln!(out, "tenant {}: model {} removed", done.tenant, done.name)?;
        }
    }
    Ok(())
}
