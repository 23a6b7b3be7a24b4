//! The binary as the agent runs it: `train`, `serve` with its flags, clear errors for bad
//! arguments, the startup log lines the end-to-end tests look for, and SIGHUP rescans.

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::*;
use serde_json::json;
use tenantvm_ngram::NgramModel;

const BIN: &str = env!("CARGO_BIN_EXE_tenantvm-ngram");

struct Running {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Running {
    fn start(args: &[&str]) -> Self {
        let mut child = Command::new(BIN)
            .args(args)
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self { child, lines }
    }

    /// Waits for a log line containing `needle`; returns it.
    fn wait_line(&self, needle: &str) -> String {
        loop {
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("no log line containing {needle:?}"));
            if line.contains(needle) {
                return line;
            }
        }
    }

    fn addr(&self) -> SocketAddr {
        let line = self.wait_line("serving on http://");
        let rest = line.split("http://").nth(1).unwrap();
        rest.split(' ').next().unwrap().parse().unwrap()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn train_then_serve_with_models_dir_data_dir_and_sighup_rescans() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = tmp.path().join("corpus.txt");
    std::fs::write(
        &corpus,
        "Four score and seven years ago our fathers brought forth.",
    )
    .unwrap();
    let model = tmp.path().join("model.json");
    let out = Command::new(BIN)
        .args(["train", "--order", "3", "--out"])
        .arg(&model)
        .arg(&corpus)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let models_dir = tmp.path().join("data/models");
    let data_dir = tmp.path().join("data");
    std::fs::create_dir_all(&data_dir).unwrap();

    let server = Running::start(&[
        "serve",
        "--model",
        model.to_str().unwrap(),
        "--name",
        "base",
        "--models-dir",
        models_dir.to_str().unwrap(),
        "--data-dir",
        data_dir.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--prefix-cache",
        "on",
        "--max-concurrency",
        "2",
        "--prefill-rounds",
        "16",
    ]);
    // The line the end-to-end tests look for.
    server.wait_line("history: 0 completions on record");
    let addr = server.addr();
    assert!(models_dir.is_dir(), "the models directory is created");
    let serving = get(addr, "/v1/tenantvm/serving");
    assert_eq!(serving["prefix_cache"]["enabled"], true);
    assert_eq!(serving["batching"]["max_concurrency"], 2);
    assert_eq!(serving["prefill"]["rounds_per_token"], 16);
    let v = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "four score", "max_tokens": 3, "temperature": 0}),
    )
    .json();
    assert_eq!(v["choices"][0]["text"], " and seven years");
    assert_eq!(v["model"], "base");

    // Push a model the way `model push` will, then SIGHUP.
    let pushed = NgramModel::train("Zebras juggle purple lanterns.", 2).unwrap();
    write_model(&models_dir.join(".zoo.partial"), &pushed);
    std::fs::rename(models_dir.join(".zoo.partial"), models_dir.join("zoo")).unwrap();
    let status = Command::new("kill")
        .args(["-HUP", &server.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    server.wait_line("SIGHUP: 2 models served, 0 not servable");
    let v = post(
        addr,
        "/v1/completions",
        &json!({"model": "zoo", "prompt": "zebras", "max_tokens": 1, "temperature": 0}),
    )
    .json();
    assert_eq!(v["choices"][0]["text"], " juggle");
}

#[test]
fn bad_arguments_and_models_are_clear_errors() {
    let run = |args: &[&str]| {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} must fail");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(run(&["serve"]).contains("--models-dir"));
    assert!(
        run(&["serve", "--model", "/nonexistent/model.json"]).contains("/nonexistent/model.json")
    );
    assert!(run(&["serve", "--models-dir", "/tmp", "--prefix-cache", "maybe"]).contains("maybe"));
    assert!(
        run(&["serve", "--models-dir", "/tmp", "--max-concurrency", "0"])
            .contains("max-concurrency")
    );
    assert!(run(&["serve", "--models-dir", "/tmp", "--listen", "nowhere"]).contains("nowhere"));
    assert!(run(&["train", "--out", "/tmp/x.json"]).contains("FILES"));
    let tmp = tempfile::tempdir().unwrap();
    let broken = tmp.path().join("broken.json");
    std::fs::write(&broken, "{}").unwrap();
    assert!(
        run(&["serve", "--model", broken.to_str().unwrap()]).contains("not an n-gram model file")
    );
    let help = Command::new(BIN)
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--models-dir",
        "--prefix-cache",
        "--max-concurrency",
        "--max-body-bytes",
        "--read-timeout-ms",
    ] {
        assert!(help.contains(flag), "{flag} missing from --help");
    }
}
