//! The orchestrator's layering, checked on its source so that it cannot rot silently
//! (docs/architecture.md, "Layers"). Each rule names the files allowed to break it; a new
//! file that breaks one fails here, with the rule and the line.
//!
//! Test code (`*tests.rs`, `test_utils.rs`, `test_support.rs`, `tests/` folders and the
//! inline `#[cfg(test)] mod tests` blocks) is not held to these rules.

use std::path::{Path, PathBuf};

/// The crate's non-test source files, each with its path under `src/` and its text (inline
/// test modules cut off).
fn sources() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    walk(&root, &mut files);
    let mut out = Vec::new();
    for path in files {
        let rel = path
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let name = path.file_name().unwrap().to_string_lossy();
        if name.ends_with("tests.rs")
            || name == "test_utils.rs"
            || name == "test_support.rs"
            || rel.split('/').any(|part| part == "tests")
        {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        out.push((rel, without_test_module(&text)));
    }
    assert!(
        out.len() > 50,
        "found only {} source files under {root:?}",
        out.len()
    );
    out
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            walk(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `text` up to its inline test module (`#[cfg(test)]` then `mod tests {`).
fn without_test_module(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    for (i, pair) in lines.windows(2).enumerate() {
        if pair[0].trim() == "#[cfg(test)]" && pair[1].trim_start().starts_with("mod tests {") {
            return lines[..i].join("\n");
        }
    }
    text.to_string()
}

/// Lines (file:line: text) of files outside `allowed` whose code contains `needle`
/// (comments skipped).
fn offenders(needle: &str, in_files: impl Fn(&str) -> bool, allowed: &[&str]) -> Vec<String> {
    let mut found = Vec::new();
    for (rel, text) in sources() {
        if !in_files(&rel) || allowed.contains(&rel.as_str()) {
            continue;
        }
        for (n, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            if code.contains(needle) {
                found.push(format!("src/{rel}:{}: {}", n + 1, code));
            }
        }
    }
    found
}

#[test]
fn only_the_access_module_decides_who_sees_a_tenant() {
    // `Caller::may_see` is the rule's one test; the service's access module applies it to
    // a named tenant, the service's list to all of them.
    let found = offenders(
        "may_see(",
        |_| true,
        &["auth/mod.rs", "tenant/access.rs", "tenant/service.rs"],
    );
    assert!(
        found.is_empty(),
        "ask TenantService::tenant_for (tenant/access.rs) instead of Caller::may_see:\n{}",
        found.join("\n")
    );
}

#[test]
fn only_the_service_and_reconciliation_hold_the_step_context() {
    let found = offenders(
        ".ctx()",
        |rel| !rel.starts_with("tenant/"),
        &["reconcile.rs"],
    );
    assert!(
        found.is_empty(),
        "the step context (TenantService::ctx) is the service's and reconciliation's; add a \
         service operation instead:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_api_the_front_door_and_the_metrics_write_nothing_to_the_store() {
    let above = |rel: &str| {
        rel.starts_with("api/") || rel.starts_with("frontdoor/") || rel.starts_with("metrics/")
    };
    let mut found = Vec::new();
    for write in [
        "add_event(",
        "insert_",
        "revoke_",
        "transition(",
        "set_guest(",
        "delete_",
        "record_step",
    ] {
        found.extend(offenders(&format!("store().{write}"), above, &[]));
        found.extend(offenders(&format!("store.{write}"), above, &[]));
    }
    assert!(
        found.is_empty(),
        "a change to a tenant is a service operation (tenant/): write through it:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_tenant_layer_imports_no_layer_above_it_beyond_the_known_back_arrows() {
    // The service answers in its own values (tenant/view.rs, tenant/logs.rs) and the API
    // projects them (api/project.rs). The one known back arrow: the service keeps the
    // metrics registry the layers above write to (a move still to make; none may be added).
    let mut found = offenders("crate::api", |rel| rel.starts_with("tenant/"), &[]);
    found.extend(offenders(
        "crate::frontdoor",
        |rel| rel.starts_with("tenant/"),
        &[],
    ));
    found.extend(offenders(
        "crate::cli",
        |rel| rel.starts_with("tenant/"),
        &[],
    ));
    found.extend(offenders(
        "crate::metrics",
        |rel| rel.starts_with("tenant/"),
        &["tenant/service.rs"],
    ));
    assert!(
        found.is_empty(),
        "tenant/ must not reach up into api/, frontdoor/, cli/ or metrics/:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_store_and_the_domain_import_nothing_above_them() {
    let low = |rel: &str| rel.starts_with("store/") || rel.starts_with("domain/");
    let mut found = Vec::new();
    for above in [
        "crate::tenant",
        "crate::api",
        "crate::frontdoor",
        "crate::backend",
        "crate::cli",
        "crate::metrics",
    ] {
        found.extend(offenders(above, low, &[]));
    }
    assert!(
        found.is_empty(),
        "store/ and domain/ are the bottom layers:\n{}",
        found.join("\n")
    );
}

/// The methods of the GPU wing's seams (`gpu/seam.rs`), as a caller writes them on the
/// planner it holds (`ctx.gpu.…`, `gpu.…`).
const GPU_SEAM_CALLS: &[&str] = &[
    "place",
    "materialize",
    "release",
    "mig_enabled",
    "restore_mig_off",
    "plan_device",
    "prepare_device",
    "plan_bind",
    "bind_device",
    "devices",
    "reset_device",
    "rebind_device",
    "device_drivers",
    "detach_device",
    "leave_device_mode",
    "route_evidence",
    "reset",
    "scrub",
    "describe",
    "usage",
    "gpus",
];

/// Calls of the GPU wing's seams in tenant/ files outside `allowed`.
fn gpu_seam_calls(allowed: &[&str]) -> Vec<String> {
    let mut found = Vec::new();
    for method in GPU_SEAM_CALLS {
        found.extend(offenders(
            &format!("gpu.{method}("),
            |rel| rel.starts_with("tenant/"),
            allowed,
        ));
    }
    found
}

#[test]
fn only_the_gpu_steps_drive_the_gpu_wing() {
    // The service, its access and usage operations and the departure reach the host's GPUs
    // through the GPU's steps (`steps::gpu`, `steps::device`), never the seams themselves.
    let found = gpu_seam_calls(&["tenant/steps/gpu.rs", "tenant/steps/device.rs"]);
    assert!(
        found.is_empty(),
        "call the GPU wing through tenant/steps/gpu.rs or tenant/steps/device.rs:\n{}",
        found.join("\n")
    );
    // The rule sees the calls it is about: the steps make them.
    let steps = gpu_seam_calls(&[]);
    for step in ["src/tenant/steps/gpu.rs:", "src/tenant/steps/device.rs:"] {
        assert!(steps.iter().any(|l| l.starts_with(step)), "{steps:?}");
    }
}

#[test]
fn the_gpu_wing_imports_nothing_above_it() {
    // gpu/ is below the tenant service: the steps call it, it calls none of them.
    let wing = |rel: &str| rel.starts_with("gpu/");
    let mut found = Vec::new();
    for above in [
        "crate::tenant",
        "crate::api",
        "crate::frontdoor",
        "crate::cli",
        "crate::metrics",
        "crate::daemon",
    ] {
        found.extend(offenders(above, wing, &[]));
    }
    assert!(
        found.is_empty(),
        "gpu/ must not reach up into the tenant service or above:\n{}",
        found.join("\n")
    );
}

/// The rules are not vacuous: a file that breaks one is found.
#[test]
fn a_rule_breaker_is_found() {
    let found = offenders("fn tenant_for(", |rel| rel.starts_with("tenant/"), &[]);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("src/tenant/access.rs:"), "{found:?}");
    assert!(
        without_test_module("a\n#[cfg(test)]\nmod tests {\nb\n}\n") == "a",
        "inline test modules are cut off"
    );
}
