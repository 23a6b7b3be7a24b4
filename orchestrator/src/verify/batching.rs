//! Check 6: batching does not cross tenants. Each tenant's serving configuration is read
//! through its own agent (`GET /v1/tenantvm/serving` of the payload in its VM) rather than
//! assumed: every tenant must answer from a server instance of its own (distinct
//! `instance_id`), and a server that says its batch or prefix cache spans more than its VM
//! fails. Two tenants answered by one server instance share an endpoint: fail.

use std::collections::BTreeMap;

use serde_json::Value;

use super::{Check, CheckId, Ctx, HostError, Outcome, Verdict};
use crate::domain::lifecycle::LifecycleState;

/// Check 6.
pub struct BatchingCheck;

/// Judges the serving configurations read from each tenant (name, answer).
pub fn judge_serving(configs: &[(String, Value)]) -> Outcome {
    let mut out = Outcome::new(Verdict::Pass);
    let mut by_instance: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for (name, v) in configs {
        let Some(instance) = v["instance_id"].as_str().filter(|s| !s.is_empty()) else {
            out.verdict = Verdict::Fail;
            out.findings.push(format!(
                "{name}: its server does not say which instance it is (no instance_id): cannot show it is its own"
            ));
            continue;
        };
        by_instance
            .entry(instance.to_string())
            .or_default()
            .push(name);
        let batch_scope = v["batching"]["scope"].as_str().unwrap_or("");
        if !batch_scope.contains("one server per VM") {
            out.verdict = Verdict::Fail;
            out.findings.push(format!(
                "{name}: batching scope is {:?}, not one server per VM",
                crate::untrusted::one_line(batch_scope)
            ));
        }
        if let Some(n) = v["batching"]["max_concurrency"].as_f64() {
            out.add(&format!("{name}.max_concurrency"), n, "count");
        }
        if v["prefix_cache"]["enabled"].as_bool() == Some(true) {
            let scope = v["prefix_cache"]["scope"].as_str().unwrap_or("");
            if !scope.contains("this server only") {
                out.verdict = Verdict::Fail;
                out.findings.push(format!(
                    "{name}: its prefix cache scope is {:?}, not this server only",
                    crate::untrusted::one_line(scope)
                ));
            }
        }
    }
    for (instance, names) in &by_instance {
        if names.len() > 1 {
            out.verdict = Verdict::Fail;
            out.findings.push(format!(
                "one server instance {} answers for {}: their requests share an endpoint (and its batches and cache)",
                crate::untrusted::one_line(instance),
                names.join(", ")
            ));
        }
    }
    out.add("tenants_read", configs.len() as f64, "count");
    out.add("server_instances", by_instance.len() as f64, "count");
    out
}

impl Check for BatchingCheck {
    fn id(&self) -> CheckId {
        CheckId::Batching
    }

    fn run(&self, ctx: &Ctx<'_>) -> Result<Outcome, HostError> {
        let a = ctx.probes.create("batch", |_| {})?;
        let b = ctx.probes.create("batch", |_| {})?;
        let mut configs = vec![
            (a.name.clone(), ctx.host.serving(&a.name)?),
            (b.name.clone(), ctx.host.serving(&b.name)?),
        ];
        // The real tenants too, read-only: a shared endpoint among them fails as well.
        let mut unread = Vec::new();
        for t in ctx.host.tenants()? {
            if t.state != LifecycleState::Running || t.name == a.name || t.name == b.name {
                continue;
            }
            match ctx.host.serving(&t.name) {
                Ok(v) => configs.push((t.name, v)),
                Err(e) => unread.push(format!("{}: {e}", t.name)),
            }
        }
        let mut out = judge_serving(&configs);
        for u in unread {
            out.findings
                .push(format!("not read (no inference server?): {u}"));
        }
        Ok(out)
    }
}
