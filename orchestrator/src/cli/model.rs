//! `tenantvm model push|list|rm`: the tenant's own models, stored on its encrypted disk
//! through its guest agent (docs/frontdoor.md). `push` hashes the file first (SHA-256,
//! checked again in the guest against what was written), then streams it: the file is
//! never held in memory whole. A directory is pushed the same way as one stream: a
//! manifest line (each file's path, size and SHA-256), then the files' bytes in its order.

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
use tenantvm_agent_protocol::{ModelFile, ModelManifest};

/// `tenantvm model ...`.
#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Store a model file, or a model directory (a Hugging-Face layout: config, tokenizer,
    /// safetensors shards, subdirectories), on TENANT's encrypted disk, where its inference
    /// server serves it by name. A directory goes as one stream, every file hashed; its
    /// symbolic links and special files are refused, its .git and .cache left out. The
    /// guest refuses a push past its disk's free space before any byte is written, and
    /// nothing is visible until the whole model arrived and every SHA-256 matched.
    Push {
        /// Tenant name.
        tenant: String,
        /// The model file or directory.
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

/// What a push sends: one file, or a directory's files as one stream after a manifest.
enum Source {
    /// A model file.
    File(PathBuf),
    /// A model directory: its root, the manifest line (JSON and a newline), and the files
    /// in the manifest's order.
    Dir {
        root: PathBuf,
        line: Vec<u8>,
        files: Vec<ModelFile>,
    },
}

/// Entries at the top of a model directory left out of a push: a git clone's history and
/// the Hugging Face tools' download cache, which hold copies of what is pushed.
const LEFT_OUT: [&str; 2] = [".git", ".cache"];

fn invalid(why: String) -> CliFailure {
    fail(exit::INVALID, why)
}

/// The regular files under `root`, as sorted relative paths; a symlink, a special file or
/// a name the guest would refuse is an error that names it (nothing is sent).
fn walk(root: &Path, rel: &str, out: &mut Vec<String>) -> Result<(), CliFailure> {
    let dir = root.join(rel);
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .map_err(|e| invalid(format!("Cannot read {}: {e}", dir.display())))?
        .collect::<Result<_, _>>()
        .map_err(|e| invalid(format!("Cannot read {}: {e}", dir.display())))?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = e.file_name();
        let name = name
            .to_str()
            .ok_or_else(|| invalid(format!("{}: a name that is not UTF-8", e.path().display())))?;
        if rel.is_empty() && LEFT_OUT.contains(&name) {
            continue;
        }
        let path = if rel.is_empty() {
            name.to_string()
        } else {
            format!("{rel}/{name}")
        };
        let kind = e
            .file_type()
            .map_err(|err| invalid(format!("{}: {err}", e.path().display())))?;
        if kind.is_symlink() {
            return Err(invalid(format!(
                "{} is a symbolic link: a model directory is pushed as its own regular files only (copy the file it points to in its place)",
                e.path().display()
            )));
        }
        if !tenantvm_agent_protocol::model::valid_file_path(&path) {
            return Err(invalid(format!(
                "{}: {:?} is not a name the guest stores (components of A-Z a-z 0-9 . _ - +)",
                e.path().display(),
                crate::untrusted::one_line(&path)
            )));
        }
        if kind.is_dir() {
            walk(root, &path, out)?;
        } else if kind.is_file() {
            out.push(path);
        } else {
            return Err(invalid(format!(
                "{} is neither a regular file nor a directory",
                e.path().display()
            )));
        }
    }
    Ok(())
}

/// What to send from `path` and its default name (the file or directory name without
/// extension).
fn source(path: &Path) -> Result<(Source, String), CliFailure> {
    let meta = std::fs::symlink_metadata(path)
        .map_err(|e| invalid(format!("Cannot read {}: {e}", path.display())))?;
    let name = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("model")
        .to_string();
    if meta.is_dir() {
        let mut paths = Vec::new();
        walk(path, "", &mut paths)?;
        let files = paths
            .into_iter()
            .map(|p| {
                let (size, sha256) = hash_file(&path.join(&p))?;
                Ok(ModelFile {
                    path: p,
                    size,
                    sha256,
                })
            })
            .collect::<Result<Vec<_>, CliFailure>>()?;
        tenantvm_agent_protocol::model::check_files(&files)
            .map_err(|e| invalid(format!("{}: {e}", path.display())))?;
        let mut line = serde_json::to_vec(&ModelManifest {
            files: files.clone(),
        })
        .map_err(|e| invalid(e.to_string()))?;
        line.push(b'\n');
        return Ok((
            Source::Dir {
                root: path.to_path_buf(),
                line,
                files,
            },
            name,
        ));
    }
    if !std::fs::metadata(path).is_ok_and(|m| m.is_file()) {
        return Err(invalid(format!(
            "{} is neither a model file nor a model directory",
            path.display()
        )));
    }
    Ok((Source::File(path.to_path_buf()), name))
}

/// Copies the file at `path` into `tx` in pieces; false when it could not (the error sent).
fn feed_file(path: &Path, tx: &tokio::sync::mpsc::Sender<std::io::Result<Bytes>>) -> bool {
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) => {
            let _ = tx.blocking_send(Err(e));
            return false;
        }
    };
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match f.read(&mut buf) {
            Ok(0) => return true,
            Ok(n) => {
                if tx
                    .blocking_send(Ok(Bytes::copy_from_slice(&buf[..n])))
                    .is_err()
                {
                    return false;
                }
            }
            Err(e) => {
                let _ = tx.blocking_send(Err(e));
                return false;
            }
        }
    }
}

/// Reads the file at `path` into `h`; returns its size.
fn hash_into(path: &Path, h: &mut Sha256) -> Result<u64, CliFailure> {
    let read_err = |e: std::io::Error| invalid(format!("Cannot read {}: {e}", path.display()));
    let mut f = std::fs::File::open(path).map_err(read_err)?;
    let mut buf = vec![0u8; 1 << 16];
    let mut n = 0u64;
    loop {
        let got = f.read(&mut buf).map_err(read_err)?;
        if got == 0 {
            return Ok(n);
        }
        h.update(&buf[..got]);
        n += got as u64;
    }
}

/// The size and SHA-256 of the file at `path`.
fn hash_file(path: &Path) -> Result<(u64, String), CliFailure> {
    let mut h = Sha256::new();
    let n = hash_into(path, &mut h)?;
    Ok((n, hex::encode(h.finalize())))
}

async fn push(
    client: &Client,
    token: &str,
    tenant: &str,
    source: Source,
    name: &str,
) -> Result<ModelStored, CliFailure> {
    let (size, sha256, layout) = match &source {
        Source::File(file) => {
            let (size, sha256) = hash_file(file)?;
            (size, sha256, "file")
        }
        Source::Dir { root, line, files } => {
            // The stream's hash: every file's bytes in order (read again; a file changed
            // since is refused by the guest's per-file check).
            let mut h = Sha256::new();
            let mut total = line.len() as u64;
            for f in files {
                hash_into(&root.join(&f.path), &mut h)?;
                total += f.size;
            }
            (total, hex::encode(h.finalize()), "directory")
        }
    };
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    std::thread::spawn(move || match source {
        Source::File(file) => {
            feed_file(&file, &tx);
        }
        Source::Dir { root, line, files } => {
            if tx.blocking_send(Ok(Bytes::from(line))).is_err() {
                return;
            }
            for f in &files {
                if !feed_file(&root.join(&f.path), &tx) {
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
        .header(crate::api::models::LAYOUT_HEADER, layout)
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
            let (source, default_name) = source(&path)?;
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
            let stored = push(client, token, &tenant, source, &name).await?;
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
