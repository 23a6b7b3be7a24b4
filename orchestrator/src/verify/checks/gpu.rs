//! Checks 2 and 3: the GPUs tenants share are MIG-capable SKUs, and every tenant's sized need
//! fits its slice while the host holds all of them at once. Both read the tenants' recorded
//! GPU slices from the daemon and the GPUs from the backend the operator names
//! (`--gpu-backend nvml` or `sim:FILE`), and reuse the planner's database, sizing and
//! placement search ([`tenantvm_gpu::plan`]), so they judge by the same rules the daemon
//! placed by.
//!
//! With no GPU tenant on the host, both are not applicable: nothing is shared or sized, so
//! nothing is shown either way, and the report says so (never a pass). Check 2 also fails
//! a host whose tenants' GPUs are shared without a hardware partition: an MPS process, or a
//! VF with a time-sliced vGPU type (`tenantvm_gpu::host::soft_sharing`, the rule `host
//! check` uses).

use std::collections::BTreeMap;

use tenantvm_gpu::plan::sizing;
use tenantvm_gpu::plan::{self, HostGpu};

use crate::api::types::TenantView;
use crate::domain::spec::GpuRequest;
use crate::verify::host::GpuView;
use crate::verify::{Check, CheckId, Ctx, HostError, Outcome, Verdict};

/// Check 2.
pub struct MigSkuCheck;

/// The PCI addresses of the GPUs tenants hold (a slice names its GPU by address, or by
/// index in older rows).
pub fn tenant_gpu_addresses(tenants: &[TenantView], gpus: &[GpuView]) -> Vec<String> {
    let mut out: Vec<String> = tenants
        .iter()
        .filter_map(|t| t.gpu.as_ref())
        .filter_map(|s| gpus.iter().find(|g| g.is(&s.gpu)))
        .map(|g| g.pci_address.clone())
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Check 2's judgement over the tenants' slices, the host's GPUs, and what shares the
/// tenants' GPUs without a hardware partition (`soft`, in words: MPS processes, time-sliced
/// vGPUs).
pub fn judge_mig_sku(tenants: &[TenantView], gpus: &[GpuView], soft: &[String]) -> Outcome {
    let mut by_gpu: BTreeMap<&str, Vec<&TenantView>> = BTreeMap::new();
    for t in tenants {
        if let Some(slice) = &t.gpu {
            by_gpu.entry(slice.gpu.as_str()).or_default().push(t);
        }
    }
    if by_gpu.is_empty() {
        return Outcome::new(Verdict::NotApplicable)
            .measure("gpus_shared", 0.0, "count")
            .finding("no tenant holds a GPU share: nothing to judge (not a pass: run verify again once GPU tenants run)");
    }
    if gpus.is_empty() {
        return Outcome::inconclusive(
            "tenants hold GPU shares but no GPU backend was named: pass --gpu-backend nvml (or sim:FILE) so the SKUs can be checked",
        );
    }
    let mut out = Outcome::new(Verdict::Pass);
    let mut shared = 0;
    for (gpu, holders) in &by_gpu {
        let partitioned = holders
            .iter()
            .any(|t| t.gpu.as_ref().is_some_and(|s| s.label != "whole"));
        if holders.len() < 2 && !partitioned {
            continue;
        }
        shared += 1;
        let names: Vec<&str> = holders.iter().map(|t| t.name.as_str()).collect();
        match gpus.iter().find(|g| g.is(gpu)) {
            None => {
                out.verdict = Verdict::Fail;
                out.findings.push(format!(
                    "GPU {gpu} (held by {}) is not on this host's GPU list",
                    names.join(", ")
                ));
            }
            Some(g) if !g.model.has_mig() => {
                out.verdict = Verdict::Fail;
                out.findings.push(format!(
                    "GPU {gpu} ({}, {}) has no MIG in this SKU, yet {} tenant(s) share it ({}): they share one memory space; give each its own GPU",
                    g.name,
                    g.model.key,
                    holders.len(),
                    names.join(", ")
                ));
            }
            Some(g) => out.findings.push(format!(
                "GPU {gpu} ({}) is shared by {} through MIG",
                g.model.key,
                names.join(", ")
            )),
        }
    }
    out.add("gpus_shared", shared as f64, "count");
    out.add("gpus", gpus.len() as f64, "count");
    out.add("gpu_soft_sharing", soft.len() as f64, "count");
    for s in soft {
        out.verdict = Verdict::Fail;
        out.findings.push(format!(
            "shared without a hardware partition: {s} (no isolation boundary between tenants, docs/verify.md \"When not to build this\")"
        ));
    }
    out
}

impl Check for MigSkuCheck {
    fn id(&self) -> CheckId {
        CheckId::MigSku
    }

    fn run(&self, ctx: &Ctx<'_>) -> Result<Outcome, HostError> {
        let (tenants, gpus) = (ctx.host.tenants()?, ctx.host.gpus()?);
        let held = tenant_gpu_addresses(&tenants, &gpus);
        let soft = if held.is_empty() {
            Vec::new()
        } else {
            ctx.host.gpu_soft_sharing(&held)?
        };
        Ok(judge_mig_sku(&tenants, &gpus, &soft))
    }
}

/// Check 3.
pub struct PartitionCheck;

/// Memory of a slice `label` (`whole` or `<profile>@<start>`) on `gpu`.
fn slice_bytes(gpu: &GpuView, label: &str) -> Option<u64> {
    if label == "whole" {
        return Some(gpu.model.memory_bytes());
    }
    let profile = label.split('@').next()?;
    gpu.model.profile(profile).ok().map(|p| p.memory_bytes())
}

/// The planner's request for a tenant's GPU request: a spec's `gpu` table is the planner's
/// request (the daemon sizes it the same way).
fn planner_request(r: &GpuRequest) -> Option<plan::GpuRequest> {
    r.wants_gpu().then(|| r.clone())
}

/// Check 3's judgement: each sized need within its slice, no two slices overlapping, and the
/// planner placing every tenant on the host's GPUs at once.
pub fn judge_partitions(tenants: &[TenantView], gpus: &[GpuView]) -> Outcome {
    let with_gpu: Vec<&TenantView> = tenants.iter().filter(|t| t.spec.gpu.wants_gpu()).collect();
    if with_gpu.is_empty() {
        return Outcome::new(Verdict::NotApplicable)
            .measure("tenants_with_gpu", 0.0, "count")
            .finding("no tenant asks for a GPU: nothing to size (not a pass: run verify again once GPU tenants run)");
    }
    if gpus.is_empty() {
        return Outcome::inconclusive(
            "tenants ask for GPUs but no GPU backend was named: pass --gpu-backend nvml (or sim:FILE)",
        );
    }
    let mut out = Outcome::new(Verdict::Pass);
    let mut smallest_headroom = f64::INFINITY;
    for t in &with_gpu {
        let Some(slice) = &t.gpu else {
            out.findings
                .push(format!("{} asks for a GPU but holds none", t.name));
            continue;
        };
        let Some(gpu) = gpus.iter().find(|g| g.is(&slice.gpu)) else {
            out.verdict = Verdict::Fail;
            out.findings.push(format!(
                "{}: its GPU {} is not on this host's GPU list",
                t.name, slice.gpu
            ));
            continue;
        };
        let Some(have) = slice_bytes(gpu, &slice.label) else {
            out.verdict = Verdict::Fail;
            out.findings.push(format!(
                "{}: slice {} is not a profile of {}",
                t.name, slice.label, gpu.model.key
            ));
            continue;
        };
        if t.spec.gpu.model.is_some() || t.spec.gpu.custom.is_some() {
            let preset = t
                .spec
                .gpu
                .model
                .clone()
                .unwrap_or_else(|| "custom model".into());
            match t.spec.gpu.need() {
                Ok(None) => {}
                Ok(Some(need)) => {
                    let headroom = have as f64 - need.total as f64;
                    smallest_headroom = smallest_headroom.min(headroom);
                    if need.total > have {
                        out.verdict = Verdict::Fail;
                        out.findings.push(format!(
                            "{}: {preset} needs {} (weights {}, KV cache {}, overhead {}) but its slice {} has {}",
                            t.name,
                            sizing::gib(need.total),
                            sizing::gib(need.weights),
                            sizing::gib(need.kv_cache),
                            sizing::gib(need.overhead),
                            slice.label,
                            sizing::gib(have)
                        ));
                    }
                }
                Err(e) => {
                    out.verdict = Verdict::Fail;
                    out.findings
                        .push(format!("{}: cannot size {preset}: {e}", t.name));
                }
            }
        }
    }
    // No two tenants on one GPU hold the same slot.
    for (i, a) in with_gpu.iter().enumerate() {
        for b in &with_gpu[i + 1..] {
            if let (Some(x), Some(y)) = (&a.gpu, &b.gpu) {
                if x.gpu == y.gpu && x.slots.iter().any(|s| y.slots.contains(s)) {
                    out.verdict = Verdict::Fail;
                    out.findings.push(format!(
                        "{} ({}) and {} ({}) hold overlapping slots of GPU {}",
                        a.name, x.label, b.name, y.label, x.gpu
                    ));
                }
            }
        }
    }
    // The host holds all of them at once: the planner's search on empty GPUs.
    let host: Vec<HostGpu> = gpus
        .iter()
        .enumerate()
        .map(|(i, g)| HostGpu::new(i as u32, g.model))
        .collect();
    let specs: Vec<plan::TenantSpec> = with_gpu
        .iter()
        .filter_map(|t| {
            planner_request(&t.spec.gpu).map(|r| plan::TenantSpec::new(t.name.clone(), r))
        })
        .collect();
    match plan::plan(&host, &specs, plan::search::DEFAULT_NODE_BUDGET) {
        Ok(report) if report.fits => {
            out.add("plan_cost_gpu_120ths", f64::from(report.cost), "count");
        }
        Ok(report) => {
            out.verdict = Verdict::Fail;
            out.findings.push(format!(
                "the planner cannot place all {} GPU tenants at once on this host: {}",
                specs.len(),
                report
                    .no_fit
                    .map(|n| format!("{} needs {}", n.tenant, n.needs))
                    .unwrap_or_default()
            ));
        }
        Err(e) => {
            out.verdict = Verdict::Fail;
            out.findings.push(format!(
                "the planner refuses these tenants on this host: {e}"
            ));
        }
    }
    out.add("tenants_with_gpu", with_gpu.len() as f64, "count");
    if smallest_headroom.is_finite() {
        out.add("smallest_headroom_bytes", smallest_headroom, "bytes");
    }
    out
}

impl Check for PartitionCheck {
    fn id(&self) -> CheckId {
        CheckId::PartitionArithmetic
    }

    fn run(&self, ctx: &Ctx<'_>) -> Result<Outcome, HostError> {
        Ok(judge_partitions(&ctx.host.tenants()?, &ctx.host.gpus()?))
    }
}
