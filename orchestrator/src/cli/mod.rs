//! The `tenantvm` command line: a thin client of tenantvmd's API (see [`crate::client`]).
//! The binary only parses arguments and calls [`run`].

mod args;
mod create;
mod failure;
mod gpu_info;
mod key;
mod model;
mod output;
mod payload;
mod progress;
mod top;
mod verify;

use progress::{logs, op, wait_for};

use std::io::Write;
use std::path::Path;

pub use args::{
    Cli, Command, CreateArgs, GpuCommand, GpuKind, HostCommand, InferArgs, LogsArgs, OpArgs,
    ReadArgs, ReceiptCommand, StreamArg,
};
pub use create::spec_from_args;
pub use failure::CliFailure;
use failure::{fail, gpu_failure, is_broken_pipe};

use crate::client::Client;

/// Exit statuses of `tenantvm` (docs/orchestrator.md lists them too).
pub mod exit {
    /// Success.
    pub const OK: u8 = 0;
    /// Any other failure (I/O, a bad answer).
    pub const OTHER: u8 = 1;
    /// Bad command line (clap's own status).
    pub const USAGE: u8 = 2;
    /// The daemon cannot be reached.
    pub const UNREACHABLE: u8 = 3;
    /// The token was refused (missing, unknown, revoked).
    pub const UNAUTHORIZED: u8 = 4;
    /// No such tenant (or not yours).
    pub const NOT_FOUND: u8 = 5;
    /// Conflict: the name is taken, the tenant is busy or in the wrong state.
    pub const CONFLICT: u8 = 6;
    /// The request was refused as invalid (spec, image, GPU request, size).
    pub const INVALID: u8 = 7;
    /// The operation ran and failed (the tenant is `failed`) or timed out.
    pub const OP_FAILED: u8 = 8;
    /// The daemon hit an internal error.
    pub const DAEMON_ERROR: u8 = 9;
    /// Forbidden: this token may not do that (e.g. a tenant token creating tenants).
    pub const FORBIDDEN: u8 = 10;
    /// `plan`: the tenants do not all fit on the host.
    pub const NO_FIT: u8 = 11;
    /// `host check`: at least one check failed.
    pub const HOST_CHECK_FAILED: u8 = 12;
    /// Over the tenant's request rate or concurrency (429): retry later.
    pub const QUOTA: u8 = 13;
    /// The tenant's disk has no room for it (507, `model push`).
    pub const NO_SPACE: u8 = 15;
    /// `gpu-info`: the guest's view of its GPU does not match what it was given.
    pub const GPU_MISMATCH: u8 = 16;
    /// Whoever read the output went away (`tenantvm ... | head`): the command stopped
    /// quietly, with the status of a command killed by SIGPIPE (128 + 13).
    pub const BROKEN_PIPE: u8 = 141;
}

fn read_token(cli: &Cli) -> Result<String, CliFailure> {
    if let Some(t) = &cli.token {
        return Ok(t.trim().to_string());
    }
    read_token_file(&cli.token_file)
}

fn read_token_file(path: &Path) -> Result<String, CliFailure> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|e| {
            fail(
                exit::UNAUTHORIZED,
                format!(
                    "Cannot read the token file {}: {e}. Pass --token-file (the daemon writes <state-dir>/admin.token) or set TENANTVM_TOKEN",
                    path.display()
                ),
            )
        })
}

/// Runs a parsed command line on standard output and error; returns the exit status.
pub async fn run(cli: Cli) -> u8 {
    run_with(cli, &mut std::io::stdout(), &mut std::io::stderr()).await
}

/// Runs a parsed command line, printing results to `out` and progress and errors to `err`;
/// returns the exit status. A closed `out` (or `err`) ends the command quietly with
/// [`exit::BROKEN_PIPE`].
pub async fn run_with(cli: Cli, out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    match run_inner(cli, out, err).await {
        Ok(()) => exit::OK,
        Err(f) => {
            if !f.message.is_empty() {
                // Nothing more can be said if standard error is gone too.
                let _ = writeln!(err, "tenantvm: {}", f.message);
            }
            f.code
        }
    }
}

fn plan(args: &tenantvm_gpu::cli::PlanArgs, out: &mut dyn Write) -> Result<(), CliFailure> {
    let report = tenantvm_gpu::cli::run_plan(args, out).map_err(gpu_failure)?;
    if report.fits {
        Ok(())
    } else {
        Err(fail(
            exit::NO_FIT,
            "the tenants do not all fit (see the report above)",
        ))
    }
}

fn host_check(
    args: &tenantvm_gpu::cli::HostCheckArgs,
    out: &mut dyn Write,
) -> Result<(), CliFailure> {
    let results = tenantvm_gpu::cli::run_host_check(args, out).map_err(gpu_failure)?;
    if tenantvm_gpu::cli::host_ok(&results) {
        Ok(())
    } else {
        Err(fail(
            exit::HOST_CHECK_FAILED,
            "host check found failures (see above)",
        ))
    }
}

async fn run_inner(cli: Cli, out: &mut dyn Write, err: &mut dyn Write) -> Result<(), CliFailure> {
    // Commands that read local files only, and need no daemon or token.
    match &cli.command {
        Command::Receipt(ReceiptCommand::Verify(args)) => {
            return crate::receipt::run_verify(args, out)
                .map(|_| ())
                .map_err(CliFailure::from);
        }
        Command::Gpu(GpuCommand::ScrubDevice(args)) => {
            return crate::gpu::scrub::run_scrub(args, out)
                .map(|_| ())
                .map_err(|e| {
                    if is_broken_pipe(&e) {
                        CliFailure::broken_pipe()
                    } else {
                        fail(exit::OTHER, e.to_string())
                    }
                });
        }
        // GPU planning and the host preflight run locally, without the daemon or a token.
        Command::Plan(args) => return plan(args, out),
        Command::Host {
            command: HostCommand::Check(args),
        } => return host_check(args, out),
        Command::Verify(a) => {
            return verify::run(a, cli.socket.clone(), read_token(&cli)?, out, err).await
        }
        _ => {}
    }
    // Validate local input before looking for a token, so a bad spec says so first.
    let spec = match &cli.command {
        Command::Create(a) => Some(spec_from_args(a)?),
        _ => None,
    };
    // The new tenant's token exists once: where it goes is checked before it is made.
    if let Command::Create(a) = &cli.command {
        if let Some(path) = &a.token_out {
            crate::keys::check_secret_path(path).map_err(|e| {
                fail(
                    exit::INVALID,
                    format!(
                        "Cannot write the token to {}: {e}; nothing was created",
                        path.display()
                    ),
                )
            })?;
        }
    }
    let token = read_token(&cli)?;
    let client = Client::new(cli.socket.clone(), token.clone());
    match cli.command {
        Command::Create(a) => {
            let spec = spec.expect("parsed above");
            let created = client.create(&spec).await?;
            if let Some(path) = &a.token_out {
                if let Err(e) = output::write_secret(path, &created.token) {
                    // Never dropped: shown here, once, as without --token-out.
                    writeln!(
                        err,
                        "tenant {}: cannot write its token to {} ({e}); here it is (shown once; keep it secret):",
                        spec.name,
                        path.display()
                    )?;
                    writeln!(out, "{}", created.token)?;
                    return Err(fail(
                        exit::OTHER,
                        format!(
                            "tenant {} was created but its token could not be written to {}: it was printed instead",
                            spec.name,
                            path.display()
                        ),
                    ));
                }
            }
            if a.json {
                output::print_json(out, &created)?;
            } else {
                match &a.token_out {
                    Some(p) => writeln!(
                        err,
                        "tenant {}: token written to {}",
                        spec.name,
                        p.display()
                    )?,
                    None => {
                        writeln!(
                            err,
                            "tenant {}: its token (shown once; keep it secret):",
                            spec.name
                        )?;
                        writeln!(out, "{}", created.token)?;
                    }
                }
            }
            if !a.no_wait {
                let progress = (!a.json).then_some(&mut *err);
                wait_for(&client, &spec.name, "create", a.timeout_s, progress).await?;
            }
            Ok(())
        }
        Command::List(r) => {
            let list = client.list().await?;
            if r.json {
                output::print_json(out, &list)?;
            } else {
                output::print_table(out, &list.tenants)?;
            }
            Ok(())
        }
        Command::Status { name, read } => {
            let t = client.status(&name).await?;
            if read.json {
                output::print_json(out, &t)?;
            } else {
                output::print_status(out, &t)?;
            }
            Ok(())
        }
        Command::Logs(a) => logs(&client, a, out, err).await,
        Command::Infer(a) => {
            let answer = client
                .infer(
                    &a.name,
                    &serde_json::json!({
                        "prompt": a.prompt,
                        "max_tokens": a.max_tokens,
                        "temperature": a.temperature,
                    }),
                )
                .await?;
            if a.json {
                output::print_json(out, &answer)?;
            } else {
                let text = answer["choices"][0]["text"].as_str().ok_or_else(|| {
                    fail(
                        exit::OTHER,
                        "the inference server's answer has no choices[0].text; rerun with --json",
                    )
                })?;
                // Guest output is hostile: no terminal control characters.
                output::print_guest_text(out, text)?;
                writeln!(out)?;
            }
            Ok(())
        }
        Command::Key(k) => key::run(&client, k, out, err).await,
        Command::Top(a) => top::run(&client, a, out).await,
        Command::GpuInfo(a) => gpu_info::run(&client, a, out).await,
        Command::Model(m) => model::run(&client, &token, m, out).await,
        Command::Payload(p) => payload::run(&client, p, out).await,
        Command::Stop(a) => op(&client, a, "stop", out, err).await,
        Command::Start(a) => op(&client, a, "start", out, err).await,
        Command::Destroy(a) => op(&client, a, "destroy", out, err).await,
        Command::Receipt(ReceiptCommand::Show { tenant, json }) => {
            let list = client.receipts(tenant.as_deref()).await?;
            if json {
                output::print_json(out, &list)?;
            } else {
                output::print_receipts(out, &list.receipts)?;
            }
            Ok(())
        }
        Command::Gpu(GpuCommand::Quarantine { json }) => {
            let list = client.quarantine().await?;
            if json {
                output::print_json(out, &list)?;
            } else {
                output::print_quarantine(out, &list.slices)?;
            }
            Ok(())
        }
        Command::Gpu(GpuCommand::Scrub { slice, json }) => {
            let done = client.rescrub(&slice).await?;
            let shown = crate::untrusted::one_line(&done.slice);
            if json {
                output::print_json(out, &done)?;
            } else {
                writeln!(
                    out,
                    "{shown}: scrub {} ({:?}); quarantine {}",
                    if done.scrub.passed {
                        "passed"
                    } else {
                        "FAILED"
                    },
                    done.scrub.assurance,
                    if done.lifted { "lifted" } else { "kept" }
                )?;
            }
            if done.scrub.passed {
                Ok(())
            } else {
                Err(fail(
                    exit::OP_FAILED,
                    format!("the scrub of {shown} did not pass; the slice stays quarantined"),
                ))
            }
        }
        Command::Receipt(ReceiptCommand::Verify(_)) | Command::Gpu(GpuCommand::ScrubDevice(_)) => {
            Err(fail(exit::OTHER, "local command reached the client"))
        }
        Command::Plan(_) | Command::Host { .. } | Command::Verify(_) => Ok(()), // returned above
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::ClientError;
    use crate::domain::spec::GpuRequest;
    use clap::Parser;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("tenantvm").chain(args.iter().copied()))
    }

    #[test]
    fn create_flags_build_a_valid_spec() {
        let cli = parse(&[
            "create",
            "--name",
            "bob",
            "--image",
            "hello",
            "--gpu",
            "mig",
            "--mig-profile",
            "1g.10gb",
        ])
        .unwrap();
        let Command::Create(a) = cli.command else {
            panic!()
        };
        let spec = spec_from_args(&a).unwrap();
        assert_eq!(spec.name, "bob");
        assert_eq!(
            spec.gpu,
            GpuRequest {
                profile: Some("1g.10gb".into()),
                ..Default::default()
            }
        );
    }

    #[test]
    fn create_flags_are_checked_locally() {
        for args in [
            vec!["create", "--name", "../x", "--image", "hello"],
            vec!["create", "--name", "bob"],
            vec![
                "create", "--name", "bob", "--image", "hello", "--gpu", "mig",
            ],
            vec!["create", "--image", "hello"],
        ] {
            let cli = parse(&args).unwrap();
            let Command::Create(a) = cli.command else {
                panic!()
            };
            let err = spec_from_args(&a).unwrap_err();
            assert_eq!(err.code, exit::INVALID, "{args:?}: {}", err.message);
        }
    }

    #[test]
    fn a_vgpu_licence_file_goes_into_the_request_and_nowhere_into_messages() {
        let dir = tempfile::tempdir().unwrap();
        let tok = dir.path().join("client_configuration_token_01.tok");
        std::fs::write(&tok, "eyJ.cli-licence-secret.sig\n").unwrap();
        let tok_arg = tok.to_str().unwrap();
        let cli = parse(&[
            "create",
            "--name",
            "bob",
            "--image",
            "hello",
            "--gpu",
            "whole",
            "--vgpu-licence",
            tok_arg,
        ])
        .unwrap();
        let Command::Create(a) = cli.command else {
            panic!()
        };
        let spec = spec_from_args(&a).unwrap();
        let sent = serde_json::to_string(&spec).unwrap();
        assert!(
            sent.contains("cli-licence-secret"),
            "the request carries it"
        );
        assert!(!format!("{spec:?}").contains("cli-licence-secret"));
        // Without a GPU share, refused here, without quoting the token.
        let cli = parse(&[
            "create",
            "--name",
            "bob",
            "--image",
            "hello",
            "--vgpu-licence",
            tok_arg,
        ])
        .unwrap();
        let Command::Create(a) = cli.command else {
            panic!()
        };
        let err = spec_from_args(&a).unwrap_err();
        assert_eq!(err.code, exit::INVALID);
        assert!(err.message.contains("vgpu_licence"), "{}", err.message);
        assert!(!err.message.contains("cli-licence-secret"));
    }

    #[test]
    fn a_token_out_path_that_cannot_be_written_is_refused_before_anything_is_created() {
        let dir = tempfile::tempdir().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let socket = dir.path().join("no-daemon.sock");
        let create = |token_out: &std::path::Path| -> (u8, String) {
            let cli = parse(&[
                "--socket",
                socket.to_str().unwrap(),
                "--token",
                "x",
                "create",
                "--name",
                "bob",
                "--image",
                "hello",
                "--token-out",
                token_out.to_str().unwrap(),
            ])
            .unwrap();
            let (mut out, mut err) = (Vec::new(), Vec::new());
            let code = rt.block_on(run_with(cli, &mut out, &mut err));
            (code, String::from_utf8_lossy(&err).into_owned())
        };
        // No such directory: refused before the daemon is asked (there is none here).
        let (code, text) = create(&dir.path().join("missing/t.token"));
        assert_eq!(code, exit::INVALID, "{text}");
        assert!(text.contains("nothing was created"), "{text}");
        // A directory in the way, and a symbolic link, likewise.
        let (code, _) = create(dir.path());
        assert_eq!(code, exit::INVALID);
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("link")).unwrap();
        let (code, _) = create(&dir.path().join("link"));
        assert_eq!(code, exit::INVALID);
        // The control: a writable path goes on to the daemon (unreachable here), and the
        // check leaves nothing behind.
        let (code, text) = create(&dir.path().join("t.token"));
        assert_eq!(code, exit::UNREACHABLE, "{text}");
        let mut left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        left.sort();
        assert_eq!(left, ["link"]);
    }

    #[test]
    fn spec_file_and_flags_conflict() {
        parse(&["create", "a.toml", "--name", "x"]).unwrap_err();
    }

    #[test]
    fn http_statuses_map_to_distinct_exit_codes() {
        let codes: Vec<u8> = [401u16, 403, 404, 409, 400, 500]
            .iter()
            .map(|s| {
                CliFailure::from(ClientError::Api {
                    status: hyper::StatusCode::from_u16(*s).unwrap(),
                    code: String::new(),
                    message: String::new(),
                })
                .code
            })
            .collect();
        assert_eq!(codes, vec![4, 10, 5, 6, 7, 9]);
    }
}
