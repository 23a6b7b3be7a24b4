//! `tenantvm verify` checks 5 (prefix cache by timing) and 6 (batching) against a real
//! engine (issue 22): probe tenants from the llama-cpp guest-image variant (Debian's
//! llama-server), each given the generated test model with `--probe-model`, under
//! `tenantvmd --backend qemu-tcg`, timed through the TLS front door with inference keys as
//! clients call.
//!
//! Check 5's positive control is one llama-server with its prompt cache on, called through
//! two inference keys of one probe: the engine's own cache must be detected by timing;
//! then across two probes' engines nothing must be. Check 6 reads each probe's engine
//! configuration from llama-server's `/props` (slots, context), and shows by effect that the
//! probes reach engines of their own: a prompt sent by one probe comes back cached to a
//! second key of the same probe (the control) and not to the other probe. Their failing
//! controls (one engine for two tenants) are in `orchestrator/src/verify/tests.rs`: the
//! daemon cannot be made to misroute.
//!
//! Worth its time (about four minutes under TCG here, most of it four guest boots and the
//! engine's prefill of 2 x 40 prompts of about 100 tokens): it is the only test in which the
//! timing and batching checks meet a real engine rather than the project's own n-gram
//! server.
//!
//! Needs root, QEMU and what `guest-image/variants/llama-cpp/prepare.sh` builds into
//! .cache; otherwise it prints SKIP naming that command.

mod support;

use std::time::Instant;

use support::cli::{tenantvm, text};
use support::llama::{llama_daemon, prepared};
use support::tls::FrontDoorTls;

fn value(check: &serde_json::Value, name: &str) -> f64 {
    check["evidence"]
        .as_array()
        .and_then(|e| e.iter().find(|m| m["name"] == name))
        .and_then(|m| m["value"].as_f64())
        .unwrap_or_else(|| panic!("no measure {name} in {check:#}"))
}

#[test]
fn verify_checks_5_and_6_meet_llama_server_through_the_front_door() {
    let p = match prepared() {
        Ok(p) => p,
        Err(why) => tenantvm_skip::skip!("{why}"),
    };
    let door = FrontDoorTls::new();
    let mut d = llama_daemon(&p, &door);
    let admin = d.admin_token_file();
    let report = d.dir.path().join("verify.json");
    let started = Instant::now();
    let o = tenantvm(
        &d,
        &admin,
        &[
            "verify",
            "--checks",
            "5,6",
            "--probe-image",
            "llama",
            "--probe-model",
            p.model.to_str().unwrap(),
            "--probe-memory-mib",
            "1024",
            "--probe-timeout-s",
            "600",
            "--samples",
            "10",
            "--prefix-words",
            "40",
            "--seed",
            "22",
            "--front-door",
            &door.addr.to_string(),
            "--front-door-ca",
            door.cert_pem.to_str().unwrap(),
            "--state-dir",
            d.state_dir().to_str().unwrap(),
            "--json",
            "--report",
            report.to_str().unwrap(),
        ],
    );
    eprintln!(
        "verify --checks 5,6 on llama-server: {:.1} s, exit {:?}",
        started.elapsed().as_secs_f64(),
        o.status.code()
    );
    let out = text(&o);
    let r: serde_json::Value = match std::fs::read(&report) {
        Ok(b) => serde_json::from_slice(&b).unwrap(),
        Err(e) => panic!("no report ({e}):\n{out}\n{}", d.log()),
    };
    let check = |n: u64| {
        r["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["number"] == n)
            .cloned()
            .unwrap_or_else(|| panic!("no check {n}: {r:#}"))
    };
    let (c5, c6) = (check(5), check(6));
    eprintln!("check 5: {c5:#}\ncheck 6: {c6:#}");

    // Check 5: the control detected llama-server's own prompt cache by timing, through the
    // front door; across the two probes' engines nothing was detected.
    let alpha = value(&c5, "alpha");
    assert_eq!(value(&c5, "timed_through_front_door"), 1.0, "{c5:#}");
    assert!(value(&c5, "control.p_value") < alpha, "{c5:#}");
    assert!(value(&c5, "control.paired_median_diff_ms") > 0.0, "{c5:#}");
    assert!(value(&c5, "test.p_value") >= alpha, "{c5:#}");
    assert!(
        c5["findings"].to_string().contains("llama-server b"),
        "{c5:#}"
    );
    // A pass also needs the 95 % bound of the cross-tenant difference under a tenth of
    // the control's effect: with 10 pairs on this loaded 2-core TCG host it is not
    // (docs/verify.md, check 5: the bound was 552 ms against 127 ms); then the check says
    // it lacked power, and says so, rather than pass.
    let power = c5["findings"][0]
        .as_str()
        .is_some_and(|f| f.contains("is not under a tenth of the control"));
    assert!(
        c5["verdict"] == "pass" || (c5["verdict"] == "inconclusive" && power),
        "{c5:#}"
    );

    // Check 6: both probes' engines read from /props, and told apart by effect.
    assert_eq!(c6["verdict"], "pass", "{c6:#}");
    assert_eq!(value(&c6, "engines_read"), 2.0, "{c6:#}");
    assert_eq!(value(&c6, "effect.front_door"), 1.0, "{c6:#}");
    let n = value(&c6, "effect.prompt_tokens");
    assert!(n > 20.0, "{c6:#}");
    assert!(
        value(&c6, "effect.control_cached_tokens") * 2.0 >= n,
        "{c6:#}"
    );
    assert!(value(&c6, "effect.cross_cached_tokens") <= 2.0, "{c6:#}");
    assert!(
        c6["evidence"].as_array().unwrap().iter().any(|m| m["name"]
            .as_str()
            .unwrap()
            .ends_with(".slots")
            && m["value"] == 2.0),
        "{c6:#}"
    );
    // Exit 0 when both passed, 14 when check 5 lacked power (above).
    assert!(
        matches!(o.status.code(), Some(0 | 14)),
        "verify exited {:?}:\n{out}",
        o.status.code()
    );
    // Every probe went.
    let left = tenantvm(&d, &admin, &["list"]);
    assert!(!text(&left).contains("tvm-verify-"), "{}", text(&left));
    d.stop();
}
