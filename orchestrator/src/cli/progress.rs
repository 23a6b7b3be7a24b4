//! The CLI's long-running commands: stop/start/destroy and create waiting for their
//! operation (printing each step as it finishes), and `logs` (optionally following).

use std::io::Write;
use std::time::Duration;

use super::{exit, fail, output, CliFailure, LogsArgs, OpArgs};
use crate::api::types::{LogQuery, TenantView};
use crate::client::{Client, ClientError};
use crate::domain::lifecycle::LifecycleState;

pub(super) async fn op(
    client: &Client,
    a: OpArgs,
    which: &str,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<(), CliFailure> {
    let t = match which {
        "stop" => client.stop(&a.name).await?,
        "start" => client.start(&a.name).await?,
        _ => client.destroy(&a.name).await?,
    };
    if a.no_wait {
        if a.json {
            output::print_json(out, &t)?;
        }
        return Ok(());
    }
    let progress = (!a.json).then_some(err);
    let end = wait_for(client, &a.name, which, a.timeout_s, progress).await?;
    if a.json {
        match end {
            Some(t) => output::print_json(out, &t)?,
            None => output::print_json(
                out,
                &serde_json::json!({"name": a.name, "state": "destroyed"}),
            )?,
        }
    }
    Ok(())
}

/// Polls the tenant until its operation ends, printing each step to `progress` (if given)
/// as it finishes. Returns the final view (None once destroyed).
pub(super) async fn wait_for(
    client: &Client,
    name: &str,
    op: &str,
    timeout_s: u64,
    mut progress: Option<&mut dyn Write>,
) -> Result<Option<TenantView>, CliFailure> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout_s);
    let mut shown = 0usize;
    loop {
        let t = match client.status(name).await {
            Ok(t) => t,
            Err(ClientError::Api { status, .. }) if status.as_u16() == 404 && op == "destroy" => {
                if let Some(p) = progress.as_mut() {
                    writeln!(p, "{name}: destroyed")?;
                }
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
        };
        if let Some(p) = progress.as_mut() {
            if t.op.as_deref() == Some(op) {
                shown = output::print_new_steps(*p, name, &t, shown)?;
            }
        }
        // A destroy that stopped at a failed step stays `destroying` with its error.
        if op == "destroy"
            && t.state == LifecycleState::Destroying
            && t.error.is_some()
            && t.steps.last().is_some_and(|s| s.status == "failed")
        {
            if let Some(p) = progress.as_mut() {
                output::print_new_steps(*p, name, &t, shown)?;
            }
            return Err(fail(
                exit::OP_FAILED,
                format!(
                    "destroy of {name} stopped: {}; fix the cause and run `tenantvm destroy {name}` again to resume",
                    crate::untrusted::one_line(t.error.as_deref().unwrap_or_default())
                ),
            ));
        }
        let settled = !t.state.is_transient();
        if settled && t.op.as_deref() == Some(op) {
            if let Some(p) = progress.as_mut() {
                output::print_new_steps(*p, name, &t, shown)?;
                writeln!(p, "{name}: {}", t.state)?;
            }
            return match t.state {
                LifecycleState::Failed => Err(fail(
                    exit::OP_FAILED,
                    format!(
                        "{op} of {name} failed: {}",
                        crate::untrusted::one_line(
                            t.error.as_deref().unwrap_or("no reason recorded")
                        )
                    ),
                )),
                _ => Ok(Some(t)),
            };
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(fail(
                exit::OP_FAILED,
                format!(
                    "{op} of {name} still {} after {timeout_s} s; check `tenantvm status {name}`",
                    t.state
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub(super) async fn logs(
    client: &Client,
    a: LogsArgs,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<(), CliFailure> {
    let mut q = LogQuery {
        stream: a.stream.into(),
        tail: Some(a.tail),
        ..Default::default()
    };
    loop {
        let chunk = client.logs(&a.name, &q).await?;
        if a.json {
            output::print_json(out, &chunk)?;
        } else {
            output::print_guest_text(out, &chunk.text)?;
            if chunk.skipped {
                writeln!(err, "tenantvm: (output lost to log rotation)")?;
            }
        }
        if !a.follow {
            return Ok(());
        }
        let idle = chunk.text.is_empty() && chunk.events.is_empty();
        q.tail = None;
        q.generation = Some(chunk.next.generation);
        q.offset = Some(chunk.next.offset);
        if idle {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}
