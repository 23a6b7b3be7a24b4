//! Where a `Tenant` goes: the exact planner (`tenantvm_gpu::plan::place::place_tenant`, the
//! one `tenantvm plan` and every tenantvmd's `reserve-gpu` use) run over each node's
//! inventory and the tenants already bound there, then one node chosen by the policy. Pure:
//! the operator gathers the inputs and writes the answer; the tests here give it hosts by
//! hand.
//!
//! Per node, in order: the node must be available (lease fresh, tenantvmd reachable,
//! schedulable); tier `host` needs a node with no tenant at all, and a node holding a tier
//! `host` tenant takes no other; memory and vCPUs must fit in what the host gives tenants
//! less what its tenants and the tenants bound but not yet made there reserve; a GPU request
//! is placed by the planner over the node's GPUs with the ledger's shares and the planned
//! shares of tenants bound but not yet made there folded in. A tier `slice` tenant is never
//! given a whole card. Of the nodes that can hold it, `pack` takes the one left with the
//! least room (GPU placement units free, then memory), `spread` the one left with the most;
//! equals go to the first by name. No node: every node's reason, the planner's among them.

use std::fmt;

use tenantvm::domain::spec::TenantSpec as HostSpec;
use tenantvm_gpu::backend::{host_gpus, GpuInfo};
use tenantvm_gpu::plan::place::{fold_held, place_tenant, Held, HeldShare};
use tenantvm_gpu::plan::search::{HostGpu, Share, DEFAULT_NODE_BUDGET, WHOLE};

use crate::crd::{NodeInventory, Tier};

/// How to choose among the nodes that can hold a tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Policy {
    /// Fill nodes before opening others (fewest nodes in use).
    Pack,
    /// Keep the load even (most room left for each).
    Spread,
}

/// A node as the placer sees it.
#[derive(Debug, Clone)]
pub struct Node<'a> {
    /// Its name.
    pub name: &'a str,
    /// What its node agent published.
    pub inventory: &'a NodeInventory,
    /// Why it takes no new tenant now (lease expired, tenantvmd unreachable, cordoned).
    pub unavailable: Option<String>,
}

/// A tenant already bound to a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bound {
    /// The node.
    pub node: String,
    /// Its name on the host.
    pub host_name: String,
    /// Its tier.
    pub tier: Tier,
    /// Guest memory in MiB.
    pub memory_mib: u64,
    /// vCPUs.
    pub vcpus: u64,
    /// Its GPU share: the one the host reserved, else the one planned.
    pub share: Option<Held>,
}

/// The new tenant.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The host's spec (named with its host name, tier applied).
    pub spec: &'a HostSpec,
    /// Its tier.
    pub tier: Tier,
}

/// Where it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// The node.
    pub node: String,
    /// Its GPU share there, named by the GPU's PCI address.
    pub share: Option<Held>,
}

impl Decision {
    /// The share as the ledger labels it: `whole` or `<profile>@<start>`.
    pub fn label(&self) -> Option<String> {
        self.share.as_ref().map(|h| label(&h.share))
    }
}

/// The ledger's label of a share.
pub fn label(share: &HeldShare) -> String {
    match share {
        HeldShare::Whole => "whole".into(),
        HeldShare::Mig { profile, start } => format!("{profile}@{start}"),
    }
}

/// No node can hold the tenant: each node's reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoNode {
    /// (node, why), by node name.
    pub reasons: Vec<(String, String)>,
}

impl fmt::Display for NoNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.reasons.is_empty() {
            return write!(f, "no node has published its inventory yet");
        }
        write!(f, "no node can hold it: ")?;
        for (i, (node, why)) in self.reasons.iter().enumerate() {
            if i > 0 {
                write!(f, "; ")?;
            }
            write!(f, "{node}: {why}")?;
        }
        Ok(())
    }
}

/// Room a node has left after the placement: GPU placement units (in 1/120ths of a GPU),
/// then memory.
type Room = (u64, u64);

/// Places `request` on one of `nodes` beside `bound`.
pub fn place(
    nodes: &[Node<'_>],
    bound: &[Bound],
    request: Request<'_>,
    policy: Policy,
) -> Result<Decision, NoNode> {
    let mut fits: Vec<(Room, Decision)> = Vec::new();
    let mut reasons = Vec::new();
    let mut sorted: Vec<&Node<'_>> = nodes.iter().collect();
    sorted.sort_by_key(|n| n.name);
    for node in sorted {
        let here: Vec<&Bound> = bound.iter().filter(|b| b.node == node.name).collect();
        match try_node(node, &here, request) {
            Ok(fit) => fits.push(fit),
            Err(why) => reasons.push((node.name.to_string(), why)),
        }
    }
    // Stable: among equal rooms the first by name stays first.
    let best = match policy {
        Policy::Pack => fits.into_iter().min_by_key(|(room, _)| *room),
        Policy::Spread => fits.into_iter().rev().max_by_key(|(room, _)| *room),
    };
    best.map(|(_, d)| d).ok_or(NoNode { reasons })
}

fn try_node(
    node: &Node<'_>,
    here: &[&Bound],
    request: Request<'_>,
) -> Result<(Room, Decision), String> {
    if let Some(why) = &node.unavailable {
        return Err(why.clone());
    }
    let inv = node.inventory;
    let spec = request.spec;
    // Bound here but not made yet: the host's figures do not count them.
    let pending: Vec<&Bound> = here
        .iter()
        .copied()
        .filter(|b| !inv.tenants.contains(&b.host_name))
        .collect();
    if request.tier == Tier::Host {
        let others = inv.tenants.len() + pending.len();
        if others > 0 {
            return Err(format!(
                "tier host needs a host of its own, and this one has {others} tenant(s)"
            ));
        }
    } else if here.iter().any(|b| b.tier == Tier::Host) {
        return Err("it holds a tier-host tenant, which shares its host with no one".into());
    }
    let overhead = inv.vmm_overhead_mib;
    let need_mib = u64::from(spec.memory_mib) + overhead;
    let pending_mib: u64 = pending.iter().map(|b| b.memory_mib + overhead).sum();
    let free_mib = inv
        .memory_mib
        .saturating_sub(inv.memory_held_mib)
        .saturating_sub(pending_mib);
    if need_mib > free_mib {
        return Err(format!(
            "memory: it needs {need_mib} MiB (guest + VMM), {free_mib} MiB of {} is free",
            inv.memory_mib
        ));
    }
    let need_vcpus = u64::from(spec.vcpus);
    let free_vcpus = inv
        .vcpus
        .saturating_sub(inv.vcpus_held)
        .saturating_sub(pending.iter().map(|b| b.vcpus).sum());
    if need_vcpus > free_vcpus {
        return Err(format!(
            "vCPUs: it needs {need_vcpus}, {free_vcpus} of {} are free",
            inv.vcpus
        ));
    }
    let planned: Vec<Held> = pending.iter().filter_map(|b| b.share.clone()).collect();
    let (gpus, host) = folded(inv, &planned)?;
    let mut share = None;
    let mut gpu_room = free_units(&host);
    if spec.gpu.wants_gpu() {
        let placement = place_tenant(&host, spec.name.as_str(), &spec.gpu, DEFAULT_NODE_BUDGET)
            .map_err(|e| e.to_string())?;
        if request.tier == Tier::Slice && matches!(placement.share, Share::WholeGpu { .. }) {
            return Err("only a whole GPU holds it here, and tier slice takes a share of a card: use tier card".into());
        }
        let pci = gpus
            .iter()
            .find(|g| g.index == placement.gpu)
            .map_or_else(|| placement.gpu.to_string(), |g| g.pci_address.clone());
        share = Some(Held {
            gpu: pci,
            ..placement.held()
        });
        gpu_room = gpu_room.saturating_sub(u64::from(placement.cost));
    }
    Ok((
        (gpu_room, free_mib - need_mib),
        Decision {
            node: node.name.to_string(),
            share,
        },
    ))
}

/// The node's GPUs as the planner sees them: the ledger's shares folded in first (the
/// host's truth), then `planned`, the plans of tenants not made yet. A plan that
/// contradicts the ledger is left out: the host placed something else there, and the tenant
/// it was made for is placed by its host's own planner at create.
fn folded(inv: &NodeInventory, planned: &[Held]) -> Result<(Vec<GpuInfo>, Vec<HostGpu>), String> {
    let gpus = inv.gpu_infos().map_err(|e| e.to_string())?;
    let mut host = host_gpus(&gpus).map_err(|e| e.to_string())?;
    let held = inv.held_shares().map_err(|e| e.to_string())?;
    for h in held.iter().chain(planned) {
        let mut trial = host.clone();
        if fold_held(&mut trial, &gpus, std::slice::from_ref(h)).is_ok() {
            host = trial;
        }
    }
    Ok((gpus, host))
}

/// What is free on each GPU of `inv` (placement units, once the ledger's shares are in),
/// in one line: `0000:10:00.0 h100-80gb 5/7, ...`.
pub fn free_summary(inv: &NodeInventory) -> String {
    let Ok((gpus, host)) = folded(inv, &[]) else {
        return String::new();
    };
    let parts: Vec<String> = host
        .iter()
        .zip(&gpus)
        .map(|(g, info)| {
            let units = g.model.placement_units;
            let free = if g.layout.whole {
                0
            } else {
                units - g.layout.used.count_ones().min(units)
            };
            format!("{} {} {free}/{units}", info.pci_address, g.model.key)
        })
        .collect();
    if parts.is_empty() {
        "no GPUs".into()
    } else {
        parts.join(", ")
    }
}

/// Placement units free on `host`, in 1/120ths of a GPU.
fn free_units(host: &[HostGpu]) -> u64 {
    host.iter()
        .filter(|g| !g.layout.whole)
        .map(|g| {
            let units = g.model.placement_units;
            u64::from((units - g.layout.used.count_ones().min(units)) * WHOLE / units)
        })
        .sum()
}

#[cfg(test)]
mod tests;
