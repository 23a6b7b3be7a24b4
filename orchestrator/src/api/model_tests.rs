//! `tenantvm model push|list|rm` from the CLI through the API to a guest agent's model store:
//! the CLI and the router run here (the router on a Unix socket, as the daemon serves it);
//! the tenant's guest is a stand-in serving its hybrid-vsock socket (as the tenant's uid,
//! which the peer check wants: needs root) with the agent's own model store code over a
//! temporary directory.

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Parser;
use tenantvm_agent::models;
use tenantvm_agent_protocol::{
    decode_body, encode_frame, read_frame, AgentFailure, Outcome, Reply, Request, RequestFrame,
    ResponseFrame,
};

use crate::auth::Caller;
use crate::cli::{run_with, Cli};
use crate::domain::spec::TenantSpec;
use crate::tenant::fault::FaultHook;
use crate::tenant::service::{CommandOutcome, TenantCommand};
use crate::tenant::test_utils::{fake_agent_socket, Harness};

/// The stand-in guest's disk: this many bytes free.
const FREE_BYTES: u64 = 3 << 20;

fn reply(s: &mut UnixStream, id: u64, outcome: Outcome) {
    let _ = std::io::Write::write_all(s, &encode_frame(&ResponseFrame { id, outcome }).unwrap());
}

fn failed(e: models::ModelError) -> Outcome {
    Outcome::Err(AgentFailure {
        code: e.code(),
        message: e.to_string(),
    })
}

fn serve_one(dir: &Path, mut s: UnixStream) {
    let mut line = [0u8; 13];
    std::io::Read::read_exact(&mut s, &mut line).unwrap();
    std::io::Write::write_all(&mut s, b"OK 1\n").unwrap();
    let Ok(body) = read_frame(&mut s) else { return };
    let req: RequestFrame = decode_body(&body).unwrap();
    let outcome = match req.request {
        Request::ModelPush { name, size, sha256 } => {
            if let Err(e) = models::check(dir, &name, size, &sha256, FREE_BYTES) {
                return reply(&mut s, req.id, failed(e));
            }
            reply(&mut s, req.id, Outcome::Ok(Reply::ModelReady));
            match models::receive(dir, &name, size, &sha256, &mut s) {
                Ok((bytes, sha256)) => Outcome::Ok(Reply::ModelStored {
                    name,
                    bytes,
                    sha256,
                }),
                Err(e) => failed(e),
            }
        }
        Request::ModelPushDir {
            name,
            files,
            size,
            sha256,
        } => {
            if let Err(e) = models::check_dir(dir, &name, &files, size, &sha256, FREE_BYTES) {
                return reply(&mut s, req.id, failed(e));
            }
            reply(&mut s, req.id, Outcome::Ok(Reply::ModelReady));
            match models::receive_dir(dir, &name, &files, &sha256, &mut s) {
                Ok((bytes, sha256)) => Outcome::Ok(Reply::ModelStored {
                    name,
                    bytes,
                    sha256,
                }),
                Err(e) => failed(e),
            }
        }
        Request::ModelList => match models::list(dir) {
            Ok(models) => Outcome::Ok(Reply::Models { models }),
            Err(e) => failed(e),
        },
        Request::ModelRemove { name } => match models::remove(dir, &name) {
            Ok(()) => Outcome::Ok(Reply::ModelRemoved),
            Err(e) => failed(e),
        },
        // Stop and destroy ask the guest to shut down: this stand-in just goes away.
        _ => return,
    };
    reply(&mut s, req.id, outcome);
}

fn serve_guest(dir: PathBuf, listener: UnixListener) {
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(s) = s else { return };
            let dir = dir.clone();
            std::thread::spawn(move || serve_one(&dir, s));
        }
    });
}

/// A harness with `tenants` (name, disk GiB) created, the first running an inference guest
/// (the stand-in over a model store directory), and the API served on a Unix socket: the
/// harness, the tenants' tokens, the model store directory, the runtime and the socket.
fn serve_tenants(
    tenants: &[(&'static str, u32)],
) -> (
    Harness,
    std::collections::HashMap<&'static str, String>,
    PathBuf,
    tokio::runtime::Runtime,
    PathBuf,
) {
    let h = Harness::new(FaultHook::default());
    h.host.state().agent_vsock = true;
    let mut tokens = std::collections::HashMap::new();
    for (name, disk) in tenants {
        let spec = TenantSpec::from_toml(&format!(
            "name = \"{name}\"\ndisk_gib = {disk}\n[image]\nname = \"hello\"\n"
        ))
        .unwrap();
        match h
            .svc
            .execute(&Caller::Admin, TenantCommand::Create(spec))
            .unwrap()
        {
            CommandOutcome::Created(c) => tokens.insert(*name, c.token),
            other => panic!("{other:?}"),
        };
    }
    h.svc.wait_idle();
    let store_dir = h.dir.path().join("guest-disk/models");
    serve_guest(store_dir.clone(), fake_agent_socket(&h.svc, tenants[0].0));
    let rt = crate::daemon::runtime().unwrap();
    let api_sock = h.dir.path().join("api.sock");
    let listener = rt
        .block_on(async { tokio::net::UnixListener::bind(&api_sock) })
        .unwrap();
    let app = super::router(h.svc.clone());
    rt.spawn(async move { axum::serve(listener, app).await });
    (h, tokens, store_dir, rt, api_sock)
}

#[test]
fn models_are_pushed_listed_and_removed_with_a_distinct_status_for_each_failure() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        tenantvm_skip::skip!("needs root to serve agent sockets as tenant uids");
    }
    // alice runs an inference guest (bob's is plain: no models).
    let (h, tokens, store_dir, rt, api_sock) = serve_tenants(&[("alice", 1), ("bob", 0)]);
    let rt = Arc::new(rt);
    let cli = |token: &str, args: &[&str]| -> (u8, String) {
        let mut argv = vec![
            "tenantvm",
            "--socket",
            api_sock.to_str().unwrap(),
            "--token",
            token,
        ];
        argv.extend_from_slice(args);
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = rt.block_on(run_with(
            Cli::try_parse_from(argv).unwrap(),
            &mut out,
            &mut err,
        ));
        (
            code,
            format!(
                "{}{}",
                String::from_utf8_lossy(&out),
                String::from_utf8_lossy(&err)
            ),
        )
    };
    let files = tempfile::tempdir().unwrap();
    let model: Vec<u8> = (0..700_000u32).map(|i| (i % 251) as u8).collect();
    let model_path = files.path().join("poet.json");
    std::fs::write(&model_path, &model).unwrap();
    let alice = tokens["alice"].clone();

    // Pushed by the tenant's own token: stored whole, under its name, hash checked.
    let (code, text) = cli(
        &alice,
        &["model", "push", "alice", model_path.to_str().unwrap()],
    );
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("model poet stored (700000 bytes"), "{text}");
    assert_eq!(std::fs::read(store_dir.join("poet")).unwrap(), model);
    // A model directory (the n-gram server's layout: model.json inside), under another name.
    let dir_model = files.path().join("bard");
    std::fs::create_dir_all(&dir_model).unwrap();
    std::fs::write(dir_model.join("model.json"), b"{\"small\": true}").unwrap();
    let (code, text) = cli(
        &alice,
        &[
            "model",
            "push",
            "alice",
            dir_model.to_str().unwrap(),
            "--name",
            "bard-2",
        ],
    );
    assert_eq!(code, 0, "{text}");
    let (code, text) = cli(&alice, &["model", "list", "alice", "--json"]);
    assert_eq!(code, 0, "{text}");
    let list: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(list["models"][0]["name"], "bard-2");
    assert_eq!(list["models"][1]["name"], "poet");
    assert_eq!(list["models"][1]["bytes"], 700_000);

    // Failures, each with its own exit status, nothing half-written left visible.
    let big = files.path().join("big.json");
    std::fs::write(&big, vec![b'x'; FREE_BYTES as usize]).unwrap();
    let (code, text) = cli(&alice, &["model", "push", "alice", big.to_str().unwrap()]);
    assert_eq!(
        code,
        crate::cli::exit::NO_SPACE,
        "larger than the disk: {text}"
    );
    assert!(text.contains("disk_gib"), "{text}");
    let (code, text) = cli(
        &alice,
        &[
            "model",
            "push",
            "alice",
            model_path.to_str().unwrap(),
            "--name",
            ".hidden",
        ],
    );
    assert_eq!(code, crate::cli::exit::INVALID, "bad name: {text}");
    let (code, text) = cli(
        &alice,
        &["model", "push", "alice", "/nonexistent/model.json"],
    );
    assert_eq!(code, crate::cli::exit::INVALID, "missing file: {text}");
    let (code, text) = cli(
        &tokens["bob"],
        &["model", "push", "alice", model_path.to_str().unwrap()],
    );
    assert_eq!(
        code,
        crate::cli::exit::NOT_FOUND,
        "another tenant's token: {text}"
    );
    let (code, text) = cli(
        &tokens["bob"],
        &["model", "push", "bob", model_path.to_str().unwrap()],
    );
    assert_eq!(
        code,
        crate::cli::exit::CONFLICT,
        "a tenant without an inference guest: {text}"
    );
    // A hash that does not match what arrives (sent by hand: the CLI hashes the file).
    let admin = h.admin_token();
    let (status, body) = raw_push(
        &rt,
        &api_sock,
        &admin,
        ("alice", "liar"),
        &[("x-model-sha256", &"0".repeat(64))],
        b"hello".to_vec(),
    );
    assert_eq!(status, 422, "{body}");
    let mut visible: Vec<_> = std::fs::read_dir(&store_dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    visible.sort();
    assert_eq!(
        visible,
        ["bard-2", "poet"],
        "a failed push left something behind"
    );

    // Removal, then removing again is "not found".
    let (code, text) = cli(&alice, &["model", "rm", "alice", "bard-2"]);
    assert_eq!(code, 0, "{text}");
    let (code, _) = cli(&alice, &["model", "rm", "alice", "bard-2"]);
    assert_eq!(code, crate::cli::exit::NOT_FOUND);
    // A stopped tenant takes no push.
    h.svc
        .execute(&Caller::Admin, TenantCommand::Stop("alice".into()))
        .unwrap();
    h.svc.wait_idle();
    let (code, text) = cli(
        &alice,
        &["model", "push", "alice", model_path.to_str().unwrap()],
    );
    assert_eq!(code, crate::cli::exit::CONFLICT, "stopped tenant: {text}");

    // Departure: the receipt says the shredded disk held the tenant's pushed models.
    h.svc
        .execute(&Caller::Admin, TenantCommand::Destroy("alice".into()))
        .unwrap();
    h.svc.wait_idle();
    let shred = h.departure_step("alice", crate::receipt::DepartureStep::CryptoShred);
    assert!(
        shred
            .evidence
            .get("tenant_data")
            .is_some_and(|v| v.contains("model push")),
        "{shred:?}"
    );
}

/// A push by hand with `announced` bytes in Content-Length, of which only `sent` are sent
/// before the client falls silent (it keeps the connection open): the answer's status and
/// how long it took.
fn silent_push(
    rt: &tokio::runtime::Runtime,
    api_sock: &Path,
    token: &str,
    tenant: &str,
    announced: u64,
    sent: usize,
) -> (u16, std::time::Duration) {
    rt.block_on(async {
        let stream = tokio::net::UnixStream::connect(api_sock).await.unwrap();
        let (mut tx, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(conn);
        let (body_tx, body_rx) = tokio::sync::mpsc::channel(4);
        if sent > 0 {
            body_tx
                .send(Ok(hyper::body::Bytes::from(vec![b'x'; sent])))
                .await
                .unwrap();
        }
        let req = hyper::Request::builder()
            .method("PUT")
            .uri(format!(
                "http://localhost/v1/tenants/{tenant}/models/stalled"
            ))
            .header("authorization", format!("Bearer {token}"))
            .header("content-length", announced)
            .header("x-model-sha256", "0".repeat(64))
            .body(crate::channel_body::ChannelBody::new(body_rx))
            .unwrap();
        let asked = std::time::Instant::now();
        let resp = tokio::time::timeout(std::time::Duration::from_secs(30), tx.send_request(req))
            .await
            .expect("the push was never answered")
            .unwrap();
        drop(body_tx);
        (resp.status().as_u16(), asked.elapsed())
    })
}

#[test]
fn a_stalled_or_bodiless_push_is_answered_and_one_larger_than_the_disk_gets_no_space() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        tenantvm_skip::skip!("needs root to serve agent sockets as tenant uids");
    }
    let (_h, tokens, store_dir, rt, api_sock) = serve_tenants(&[("alice", 1), ("plain", 0)]);

    // Larger than the disk and than what a refused push has drained of its body: the
    // refusal still reaches the CLI (NO_SPACE), not a reset connection.
    let files = tempfile::tempdir().unwrap();
    let big = files.path().join("huge.json");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(super::models::DRAIN_LIMIT + (16 << 20))
        .unwrap();
    let argv = [
        "tenantvm",
        "--socket",
        api_sock.to_str().unwrap(),
        "--token",
        &tokens["alice"],
        "model",
        "push",
        "alice",
        big.to_str().unwrap(),
    ];
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = rt.block_on(run_with(
        Cli::try_parse_from(argv).unwrap(),
        &mut out,
        &mut err,
    ));
    assert_eq!(
        code,
        crate::cli::exit::NO_SPACE,
        "{}{}",
        String::from_utf8_lossy(&out),
        String::from_utf8_lossy(&err)
    );

    // A push whose client falls silent: abandoned after the idle deadline (408), nothing
    // stored.
    let (status, took) = silent_push(&rt, &api_sock, &tokens["alice"], "alice", 1 << 20, 1000);
    assert_eq!(status, 408);
    assert!(took >= super::models::PUSH_IDLE_TIMEOUT, "{took:?}");
    assert!(!store_dir.join("stalled").exists());
    // A push refused before its data (a tenant without models) whose client sends no body
    // at all is answered.
    let (status, _) = silent_push(&rt, &api_sock, &tokens["plain"], "plain", 1 << 20, 0);
    assert_eq!(status, 409);
}

/// A push by hand: `PUT` of `body` as model `model` of `tenant` with `headers` besides the
/// token and the length; the answer's status and body.
fn raw_push(
    rt: &tokio::runtime::Runtime,
    api_sock: &Path,
    token: &str,
    (tenant, model): (&str, &str),
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> (u16, String) {
    rt.block_on(async {
        let stream = tokio::net::UnixStream::connect(api_sock).await.unwrap();
        let (mut tx, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(conn);
        let mut req = hyper::Request::builder()
            .method("PUT")
            .uri(format!(
                "http://localhost/v1/tenants/{tenant}/models/{model}"
            ))
            .header("authorization", format!("Bearer {token}"))
            .header("content-length", body.len());
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req
            .body(http_body_util::Full::new(hyper::body::Bytes::from(body)))
            .unwrap();
        let resp = tx.send_request(req).await.unwrap();
        let status = resp.status().as_u16();
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .unwrap()
            .to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    })
}

/// Every path under `dir`, relative, sorted (to show what a failed push left).
fn tree(dir: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            out.push(p.strip_prefix(root).unwrap().display().to_string());
            if p.is_dir() {
                walk(root, &p, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

#[test]
fn a_model_directory_goes_as_one_stream_and_bad_ones_are_refused_leaving_the_disk_as_it_was() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        tenantvm_skip::skip!("needs root to serve agent sockets as tenant uids");
    }
    let (_h, tokens, store_dir, rt, api_sock) = serve_tenants(&[("alice", 1)]);
    let alice = tokens["alice"].clone();
    let cli = |args: &[&str]| -> (u8, String) {
        let mut argv = vec![
            "tenantvm",
            "--socket",
            api_sock.to_str().unwrap(),
            "--token",
            &alice,
        ];
        argv.extend_from_slice(args);
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = rt.block_on(run_with(
            Cli::try_parse_from(argv).unwrap(),
            &mut out,
            &mut err,
        ));
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out),
            String::from_utf8_lossy(&err)
        );
        (code, text)
    };
    // A Hugging-Face layout: config, tokenizer, two safetensors shards, a subdirectory,
    // and a git clone's history (left out).
    let files = tempfile::tempdir().unwrap();
    let hf = files.path().join("tiny-hf");
    std::fs::create_dir_all(hf.join("1_Pooling")).unwrap();
    std::fs::create_dir_all(hf.join(".git/objects")).unwrap();
    let shard = |n: u32| -> Vec<u8> { (0..300_000u32).map(|i| ((i * n) % 253) as u8).collect() };
    std::fs::write(
        hf.join("config.json"),
        b"{\"architectures\": [\"LlamaForCausalLM\"]}",
    )
    .unwrap();
    std::fs::write(hf.join("tokenizer.json"), b"{\"model\": {}}").unwrap();
    std::fs::write(hf.join("model-00001-of-00002.safetensors"), shard(3)).unwrap();
    std::fs::write(hf.join("model-00002-of-00002.safetensors"), shard(7)).unwrap();
    std::fs::write(hf.join("1_Pooling/config.json"), b"{}").unwrap();
    std::fs::write(hf.join(".git/objects/pack"), b"history").unwrap();
    let (code, text) = cli(&["model", "push", "alice", hf.to_str().unwrap()]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("model tiny-hf stored (600"), "{text}");
    let stored = tree(&store_dir);
    assert_eq!(
        stored,
        [
            "tiny-hf",
            "tiny-hf/1_Pooling",
            "tiny-hf/1_Pooling/config.json",
            "tiny-hf/config.json",
            "tiny-hf/model-00001-of-00002.safetensors",
            "tiny-hf/model-00002-of-00002.safetensors",
            "tiny-hf/tokenizer.json",
        ]
    );
    assert_eq!(
        std::fs::read(store_dir.join("tiny-hf/model-00002-of-00002.safetensors")).unwrap(),
        shard(7)
    );

    // A symbolic link in the directory: refused by the CLI, nothing sent.
    let linked = files.path().join("linked");
    std::fs::create_dir_all(&linked).unwrap();
    std::fs::write(linked.join("config.json"), b"{}").unwrap();
    std::os::unix::fs::symlink("/etc/passwd", linked.join("tokenizer.json")).unwrap();
    let (code, text) = cli(&["model", "push", "alice", linked.to_str().unwrap()]);
    assert_eq!(code, crate::cli::exit::INVALID, "{text}");
    assert!(text.contains("is a symbolic link"), "{text}");
    // A name the guest would not store.
    let spaced = files.path().join("spaced");
    std::fs::create_dir_all(&spaced).unwrap();
    std::fs::write(spaced.join("my config.json"), b"{}").unwrap();
    let (code, text) = cli(&["model", "push", "alice", spaced.to_str().unwrap()]);
    assert_eq!(code, crate::cli::exit::INVALID, "{text}");
    // Oversized (a shard larger than the disk's free space): refused before any byte is
    // written, with the disk's own numbers.
    let huge = files.path().join("huge");
    std::fs::create_dir_all(&huge).unwrap();
    std::fs::write(huge.join("config.json"), b"{}").unwrap();
    std::fs::File::create(huge.join("model.gguf"))
        .unwrap()
        .set_len(FREE_BYTES + 1)
        .unwrap();
    let (code, text) = cli(&["model", "push", "alice", huge.to_str().unwrap()]);
    assert_eq!(code, crate::cli::exit::NO_SPACE, "{text}");
    assert!(text.contains("disk_gib"), "{text}");
    // A manifest made by hand with a path that leaves the directory: the daemon refuses it
    // (400) before the guest is asked.
    let data = b"escaped!".to_vec();
    let sha = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&data));
    let manifest = format!(
        "{{\"files\":[{{\"path\":\"../../escape\",\"size\":{},\"sha256\":\"{sha}\"}}]}}\n",
        data.len()
    );
    let mut body = manifest.into_bytes();
    body.extend_from_slice(&data);
    let (status, answer) = raw_push(
        &rt,
        &api_sock,
        &tokens["alice"],
        ("alice", "evil"),
        &[("x-model-sha256", &sha), ("x-model-layout", "directory")],
        body,
    );
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer.contains("not a path inside the model directory"),
        "{answer}"
    );
    // A manifest whose sizes do not add up to the body.
    let (status, answer) = raw_push(
        &rt,
        &api_sock,
        &tokens["alice"],
        ("alice", "short"),
        &[("x-model-sha256", &sha), ("x-model-layout", "directory")],
        format!(
            "{{\"files\":[{{\"path\":\"a\",\"size\":99,\"sha256\":\"{sha}\"}}]}}\n{}",
            "escaped!"
        )
        .into_bytes(),
    );
    assert_eq!(status, 400, "{answer}");
    // Whatever failed, the tenant's disk holds what it held.
    assert_eq!(tree(&store_dir), stored);
    assert!(!store_dir.join("../../escape").exists());
}
