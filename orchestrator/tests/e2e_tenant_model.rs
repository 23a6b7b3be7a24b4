//! The tenant's own weights, end to end on a Linux guest under `tenantvmd` (issue 15): a model trained here on a corpus of its own, pushed with
//! `tenantvm model push` onto the tenant's encrypted disk, is served by name and changes
//! the tenant's completions (the built-in model, asked the same, answers otherwise and its
//! own answers are unchanged); the host's disk image never holds the pushed model's bytes in
//! plaintext, while the same scan finds them in a plaintext copy (positive control);
//! `model rm` takes it away (the payload then refuses the name).
//!
//! `model push` needs a stream of its own to the agent: vsock (tenantvm-vmm,
//! `TENANTVM_E2E_BACKEND=vmm` on a host whose KVM runs Linux, and the nested host's
//! `inference-tenant` scenario) or QEMU's multiplexed virtio-serial port (the default here,
//! `qemu-tcg`, on a host without /dev/vhost-vsock). Skips with a printed reason without
//! root, `.cache/kernel` or the image tools (`TENANTVM_GUEST_IMAGE=DIR`: a prebuilt image
//! set).

mod support;

use std::time::{Duration, Instant};

use support::cli::{must, tenantvm};
use support::daemon::{self, TestDaemon};
use support::guest_image::{file_contains, image_set, image_set_missing, install_image};

/// A word only the pushed model's corpus holds.
const MARKER: &str = "quokkazanzibarmarker";

fn skip_reason() -> Option<String> {
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (jails set uids, cgroups and namespaces)".into());
    }
    image_set_missing()
}

/// A greedy completion by `model` through the daemon's inference route.
fn complete(
    rt: &tokio::runtime::Runtime,
    d: &TestDaemon,
    token: &str,
    tenant: &str,
    model: &str,
    prompt: &str,
) -> Result<String, String> {
    let body =
        serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0});
    let v = rt
        .block_on(d.client(token).infer(tenant, &body))
        .map_err(|e| e.to_string())?;
    v["choices"][0]["text"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| format!("no text in {v}"))
}

/// The pushed model's corpus: words the built-in model (the image's corpus) never saw.
fn tenant_corpus() -> String {
    let line = format!(
        "the lighthouse keeper counted {MARKER} gulls over the harbour every morning \
         while the ferry waited by the old stone pier for the baker's cart."
    );
    [line.as_str(); 4].join("\n")
}

#[test]
fn a_pushed_model_changes_the_completions_and_never_reaches_the_host_in_plaintext() {
    if let Some(why) = skip_reason() {
        tenantvm_skip::skip!("{why}");
    }
    let set = image_set();
    let backend = std::env::var("TENANTVM_E2E_BACKEND").unwrap_or_else(|_| "qemu-tcg".into());
    let mut d = TestDaemon::new().with_args(&[
        "--backend",
        &backend,
        "--boot-timeout-s",
        "120",
        "--agent-timeout-s",
        "600",
        "--stop-grace-s",
        "30",
    ]);
    install_image(&set, &d.dir.path().join("img"), "linux");
    d.start(None);
    let admin = d.admin_token_file();
    let name = daemon::unique("mdl");
    let spec = d.dir.path().join("t.toml");
    std::fs::write(
        &spec,
        format!(
            "name = \"{name}\"\nvcpus = 1\nmemory_mib = 512\ndisk_gib = 1\n[image]\nname = \"linux\"\n"
        ),
    )
    .unwrap();
    let token_file = d.dir.path().join("t.token");
    let started = Instant::now();
    must(
        tenantvm(
            &d,
            &admin,
            &[
                "create",
                spec.to_str().unwrap(),
                "--token-out",
                token_file.to_str().unwrap(),
                "--timeout-s",
                "900",
            ],
        ),
        "create",
        &d,
    );
    eprintln!("create: {:.1} s", started.elapsed().as_secs_f64());
    let token = std::fs::read_to_string(&token_file)
        .unwrap()
        .trim()
        .to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();

    // The built-in model's answers, before anything was pushed (the name the image's
    // payload serves it under: `tenantvm-ngram serve --name`'s default).
    let builtin = "tenantvm-ngram".to_string();
    let gettysburg = "four score and seven years";
    let own_prompt = "the lighthouse keeper counted";
    let before = complete(&rt, &d, &token, &name, &builtin, gettysburg).unwrap();
    assert!(before.starts_with(" ago our fathers"), "{before:?}");
    let builtin_own = complete(&rt, &d, &token, &name, &builtin, own_prompt).unwrap();
    assert!(!builtin_own.contains(MARKER), "{builtin_own:?}");
    // Not pushed yet: the name is refused.
    complete(&rt, &d, &token, &name, "harbour", own_prompt).unwrap_err();

    // Train and push.
    let model = tenantvm_ngram::NgramModel::train(&tenant_corpus(), 3).unwrap();
    let file = d.dir.path().join("harbour.json");
    std::fs::write(&file, serde_json::to_vec(&model).unwrap()).unwrap();
    must(
        tenantvm(
            &d,
            &token_file,
            &[
                "model",
                "push",
                &name,
                file.to_str().unwrap(),
                "--name",
                "harbour",
            ],
        ),
        "model push",
        &d,
    );
    let listed = must(
        tenantvm(&d, &token_file, &["model", "list", &name, "--json"]),
        "model list",
        &d,
    );
    assert!(
        String::from_utf8_lossy(&listed.stdout).contains("harbour"),
        "{}",
        String::from_utf8_lossy(&listed.stdout)
    );

    // Served by name (the payload rescans its models directory about once a second).
    let deadline = Instant::now() + Duration::from_secs(60);
    let own = loop {
        match complete(&rt, &d, &token, &name, "harbour", own_prompt) {
            Ok(text) => break text,
            Err(e) => {
                assert!(Instant::now() < deadline, "the pushed model: {e}");
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    };
    assert!(
        own.contains(MARKER),
        "the pushed model's completion is not from its corpus: {own:?}"
    );
    assert_ne!(
        own, builtin_own,
        "the pushed model answers like the built-in"
    );
    assert_eq!(
        complete(&rt, &d, &token, &name, &builtin, gettysburg).unwrap(),
        before,
        "pushing a model changed the built-in model's answer"
    );

    // The host image: no plaintext of the model; the same scan finds the marker in a
    // plaintext copy (positive control).
    let img = d.state_dir().join("tenants").join(&name).join("disk.img");
    assert!(file_contains(&file, MARKER), "positive control");
    assert!(
        !file_contains(&img, MARKER),
        "the pushed model reached the host image in plaintext"
    );
    assert!(!file_contains(&img, "lighthouse keeper counted"));

    // Removed: the name is refused again.
    must(
        tenantvm(&d, &token_file, &["model", "rm", &name, "harbour"]),
        "model rm",
        &d,
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while complete(&rt, &d, &token, &name, "harbour", own_prompt).is_ok() {
        assert!(Instant::now() < deadline, "a removed model is still served");
        std::thread::sleep(Duration::from_millis(500));
    }
    must(
        tenantvm(&d, &admin, &["destroy", &name, "--timeout-s", "600"]),
        "destroy",
        &d,
    );
    assert!(!img.exists());
    d.stop();
}
