//! The nested host's CI set, as part of the test command: one boot of the outer guest runs
//! the harness's own checks (a scenario that hangs is killed at its limit and reported with
//! the console tail, a failing one comes back with its reason, and the ones after them still
//! run) and then every scenario of the `ci` set, which must pass.
//!
//! It needs the inputs tests/nested-host/prepare.sh builds (scripts/test.sh runs it first)
//! and QEMU; without them it skips, saying which command makes them. With
//! `TENANTVM_HOST=real` the same scenarios run directly on this host instead, where a
//! scenario may skip (no edu device on a real host).

use tenantvm_nested_host::inputs::{check_kernel, kernel_dir, OPTIONAL_KEYS};
use tenantvm_nested_host::{real, Catalog, Inputs, OuterConfig, Verdict};

#[test]
fn ci_scenarios_pass_on_the_nested_host() {
    if std::env::var("TENANTVM_NESTED").is_ok_and(|v| v == "0") {
        tenantvm_skip::skip!("TENANTVM_NESTED=0 leaves the nested host out");
    }
    let inputs = match Inputs::load(&Inputs::default_path("debug")) {
        Ok(inputs) => inputs,
        Err(e) => tenantvm_skip::skip!("{e}"),
    };
    if let Err(e) = check_kernel(&kernel_dir()) {
        tenantvm_skip::skip!("{e}");
    }
    let real_host = real::requested();
    if !real_host
        && std::process::Command::new("qemu-system-x86_64")
            .arg("--version")
            .output()
            .is_err()
    {
        tenantvm_skip::skip!("qemu-system-x86_64 is not installed (run scripts/setup.sh)");
    }

    let catalog = Catalog::load(&Catalog::default_dir()).unwrap();
    let mut names: Vec<String> = vec!["selftest-hang".into(), "selftest-fail".into()];
    names.extend(catalog.set("ci").unwrap().into_iter().map(|s| s.name));
    let scenarios = catalog.select(&names).unwrap();
    let cfg = OuterConfig::new(tenantvm_nested_host::default_work_dir());
    let outcomes = tenantvm_nested_host::run(&cfg, &inputs, &scenarios, &mut |p| eprintln!("{p}"))
        .unwrap_or_else(|e| panic!("the nested host did not run: {e}"));
    let all: String = outcomes.iter().map(|o| format!("{o}\n")).collect();

    // The harness's own checks.
    let hang = &outcomes[0];
    assert!(
        matches!(&hang.verdict, Verdict::Fail { reason, console_tail }
            if reason.starts_with("timed out after 5 s") && console_tail.contains("selftest-hang")),
        "a hanging scenario must be killed at its limit and reported with the console tail:\n{all}"
    );
    assert!(
        matches!(&outcomes[1].verdict, Verdict::Fail { reason, .. } if reason == "selftest failure reason"),
        "a failing scenario's reason must come back:\n{all}"
    );
    // Every CI scenario passes. On a real host one may skip, saying why; on the nested host
    // only a scenario that needs the llama.cpp variant, where its preparation did not run
    // (no Debian mirror). Each skip is recorded under the scenario's name, so the test
    // command's summary counts it.
    let llama_prepared = OPTIONAL_KEYS.iter().all(|k| !inputs.get(k).is_empty());
    for o in &outcomes[2..] {
        let needs_llama = scenarios
            .iter()
            .any(|s| s.name == o.name && s.needs.iter().any(|n| n == "llama"));
        let ok = match &o.verdict {
            Verdict::Pass => true,
            Verdict::Skip { reason } if real_host || (!llama_prepared && needs_llama) => {
                tenantvm_skip::record(&format!("tenantvm_nested_host::ci::{}", o.name), reason);
                true
            }
            Verdict::Skip { .. } => false,
            Verdict::Fail { .. } => false,
        };
        assert!(ok, "{o}\n\nall outcomes:\n{all}");
    }
    eprintln!("{all}");
}
