//! Placing one new tenant on a running host, as the daemon's `create` does: the host's GPU
//! instances and reserved shares ([`Held`]) stay where they are, and the new request gets
//! the share the exact planner ([`super::search`]) finds, not the first free candidate.
//!
//! What "re-ordering" can and cannot mean here. MIG instances of running tenants cannot move
//! (there is no live migration of a GPU instance; re-creating one wipes its memory), so the
//! daemon never re-lays out what exists. What the planner can still do for a new tenant, and
//! a first-fit candidate list does not:
//! - look at every (GPU, profile, start) and at whole GPUs together, so a profile at its
//!   maximum count or a fragmented free range is not a refusal while another profile that
//!   holds the need, another start, another GPU or a whole GPU fits;
//! - among the cheapest choices (fewest placement units, the planner's objective), take the one
//!   that leaves the host most room for later tenants: most GPUs still free to give whole,
//!   then most free slots still coverable by some profile, then the largest profiles still
//!   placeable (so a 1g goes to slot 4 or 5 of an empty H100, not to 0 where it would block
//!   the 4g);
//! - when nothing fits, say whether the host is full or only fragmented (the free slots would
//!   hold the tenant if some GPU's instances were laid out differently), and what the largest
//!   share still available is.
//!
//! Re-ordering a whole batch of requests, which can fit more, is what [`super::plan`] does
//! for a tenants file (`tenantvm plan`), before any of them runs.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::search::{
    self, apply_opt, candidates, profile_cost, share_of, Demand, HostGpu, Opt, Request,
    SearchError, Share, WHOLE,
};
use super::{check_demand, describe, shares_by_size, GpuRequest, Largest, Need, PlanError};
use crate::backend::{self, BackendError, GpuInfo};
use crate::mig::Layout;

/// Nodes the "would it fit if laid out differently" diagnosis may spend.
const DIAGNOSIS_BUDGET: u64 = 200_000;

/// A share that exists or is reserved on the host; it does not move.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Held {
    /// The GPU: its PCI address, or its index as text.
    pub gpu: String,
    /// What is held.
    pub share: HeldShare,
}

/// What a [`Held`] holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum HeldShare {
    /// A MIG instance of the profile at the start slot.
    Mig {
        /// Profile name.
        profile: String,
        /// Start slot.
        start: u32,
    },
    /// The whole GPU.
    Whole,
}

impl Held {
    /// From the ledger's label (`whole`, or `<profile>@<start>` as [`Placement::label`]
    /// writes it).
    pub fn from_label(gpu: impl Into<String>, label: &str) -> Result<Held, PlaceError> {
        let gpu = gpu.into();
        let share = match label.split_once('@') {
            None if label == "whole" => HeldShare::Whole,
            Some((profile, start)) if !profile.is_empty() => HeldShare::Mig {
                profile: profile.to_string(),
                start: start
                    .parse()
                    .map_err(|_| PlaceError::BadLabel(label.into()))?,
            },
            _ => return Err(PlaceError::BadLabel(label.into())),
        };
        Ok(Held { gpu, share })
    }
}

/// Where a tenant goes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Placement {
    /// Tenant name.
    pub tenant: String,
    /// GPU index.
    pub gpu: u32,
    /// The GPU's PCI address, when the host says ([`place_on_host`]).
    pub pci_address: Option<String>,
    /// The share.
    pub share: Share,
    /// The placement units it covers (all of them for a whole GPU).
    pub slots: Vec<u32>,
    /// The tenant's sized need, when it names a model.
    pub need: Option<Need>,
    /// Its cost in 1/120ths of a GPU.
    pub cost: u32,
}

impl Placement {
    /// The ledger's label: `whole`, or `<profile>@<start>`.
    pub fn label(&self) -> String {
        match &self.share {
            Share::WholeGpu { .. } => "whole".into(),
            Share::Mig { profile, start, .. } => format!("{profile}@{start}"),
        }
    }

    /// What the placement holds once made, for the next placement.
    pub fn held(&self) -> Held {
        Held {
            gpu: self
                .pci_address
                .clone()
                .unwrap_or_else(|| self.gpu.to_string()),
            share: match &self.share {
                Share::WholeGpu { .. } => HeldShare::Whole,
                Share::Mig { profile, start, .. } => HeldShare::Mig {
                    profile: profile.clone(),
                    start: *start,
                },
            },
        }
    }
}

/// Whether a refused tenant would fit if instances were laid out differently.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fragmentation {
    /// This GPU's free slots would hold it with its instances laid out differently.
    OnGpu {
        /// GPU index.
        gpu: u32,
    },
    /// The host's free slots would hold it with instances moved between GPUs.
    AcrossGpus,
    /// No layout of the existing instances leaves room: the host is full for it.
    Full,
    /// The diagnosis gave up (too many instances to try every layout).
    Unknown,
}

/// Why a tenant cannot be placed.
#[derive(Debug, Error)]
pub enum PlaceError {
    /// The request is unusable, or asks for what the host's GPUs cannot give.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The search gave up.
    #[error(transparent)]
    Search(#[from] SearchError),
    /// The host could not be read.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// A ledger label that is not `whole` or `<profile>@<start>`.
    #[error("Unreadable placement label `{0}`: expected `whole` or `<profile>@<start>`")]
    BadLabel(String),
    /// A held share contradicts the host.
    #[error(
        "The host and its reservations disagree on GPU {gpu}: {detail}; run the daemon's reconcile"
    )]
    Inconsistent {
        /// The GPU.
        gpu: String,
        /// How.
        detail: String,
    },
    /// Nothing free holds the tenant.
    #[error("No room for tenant `{tenant}`, which asks for {needs}: {}{}", largest_text(.largest), fragmentation_text(.fragmentation))]
    NoRoom {
        /// Tenant.
        tenant: String,
        /// What it asks for, in words.
        needs: String,
        /// The largest share the host can still give.
        largest: Option<Largest>,
        /// Whether it is fragmentation or a full host.
        fragmentation: Fragmentation,
    },
}

fn largest_text(l: &Option<Largest>) -> String {
    match l {
        None => "the host has nothing free".into(),
        Some(Largest {
            gpu,
            share: Share::WholeGpu { memory_mib },
        }) => format!("the largest share free is GPU {gpu} whole ({memory_mib} MiB)"),
        Some(Largest {
            gpu,
            share: Share::Mig { profile, start, .. },
        }) => format!("the largest share free is {profile} at slot {start} of GPU {gpu}"),
    }
}

fn fragmentation_text(f: &Fragmentation) -> String {
    match f {
        Fragmentation::OnGpu { gpu } => format!(". GPU {gpu}'s free slots would hold it if its instances were laid out differently, but instances of running tenants cannot move (a MIG instance cannot be migrated): it fits once one of them departs"),
        Fragmentation::AcrossGpus => ". The free slots of several GPUs together would hold it, but instances of running tenants cannot move: it fits once tenants depart".into(),
        Fragmentation::Full => ". The host is full for it, not only fragmented".into(),
        Fragmentation::Unknown => String::new(),
    }
}

fn matches_gpu(h: &Held, g: &GpuInfo) -> bool {
    h.gpu.eq_ignore_ascii_case(&g.pci_address) || h.gpu == g.index.to_string()
}

/// Folds held shares into a host's layouts. A held share that is already an instance (a
/// reservation made real) counts once.
pub fn fold_held(host: &mut [HostGpu], gpus: &[GpuInfo], held: &[Held]) -> Result<(), PlaceError> {
    for h in held {
        let Some(info) = gpus.iter().find(|g| matches_gpu(h, g)) else {
            if h.share == HeldShare::Whole {
                // A GPU on vfio-pci is invisible to NVML: nothing to place on it anyway.
                continue;
            }
            return Err(PlaceError::Inconsistent {
                gpu: h.gpu.clone(),
                detail: "a MIG share is reserved on a GPU the host does not list".into(),
            });
        };
        let g = host
            .iter_mut()
            .find(|g| g.index == info.index)
            .expect("host_gpus lists every GPU the backend does");
        fold_one(g, h)?;
    }
    Ok(())
}

fn fold_one(g: &mut HostGpu, h: &Held) -> Result<(), PlaceError> {
    let bad = |detail: String| PlaceError::Inconsistent {
        gpu: h.gpu.clone(),
        detail,
    };
    match &h.share {
        HeldShare::Whole => {
            if g.layout.whole {
                return Ok(());
            }
            if !g.layout.can_take_whole() {
                return Err(bad("reserved whole but it holds MIG instances".into()));
            }
            g.layout.whole = true;
        }
        HeldShare::Mig { profile, start } => {
            let p = g.model.profile(profile).map_err(|e| bad(e.to_string()))?;
            let exists = g
                .layout
                .instances
                .iter()
                .any(|i| i.profile_id == p.id && i.start == *start);
            if !exists {
                g.layout
                    .place(p, *start)
                    .map_err(|e| bad(format!("reserved {profile}@{start}: {e}")))?;
            }
        }
    }
    Ok(())
}

/// How much room a GPU leaves for later tenants: (free to give whole, free slots some
/// placeable profile covers, memory of the distinct profiles still placeable).
fn room(g: &HostGpu, l: &Layout) -> (u64, u64, u64) {
    if l.whole {
        return (0, 0, 0);
    }
    let whole = u64::from(l.can_take_whole());
    if !g.sharing.can_share() {
        return (whole, 0, 0);
    }
    let (mut reach, mut memory) = (0u32, 0u64);
    for p in g.model.profiles {
        let free = l.free_starts(p);
        if let Some(_first) = free.first() {
            memory += p.memory_mib;
        }
        for s in free {
            reach |= p.mask_at(s);
        }
    }
    (whole, u64::from((reach & !l.used).count_ones()), memory)
}

/// One feasible choice for the new request.
struct Choice {
    pos: usize,
    opt: Opt,
    cost: u32,
    room: (u64, u64, u64),
}

/// Every feasible (GPU, option) for `demand`, with its cost and the room it leaves.
fn choices(host: &[HostGpu], demand: &Demand) -> Vec<Choice> {
    let rooms: Vec<(u64, u64, u64)> = host.iter().map(|g| room(g, &g.layout)).collect();
    let total = rooms
        .iter()
        .fold((0, 0, 0), |a, r| (a.0 + r.0, a.1 + r.1, a.2 + r.2));
    let mut out = Vec::new();
    for (pos, g) in host.iter().enumerate() {
        let (profiles, whole) = candidates(demand, g);
        let mut opts: Vec<(Opt, u32)> = Vec::new();
        for pi in profiles {
            let p = &g.model.profiles[pi];
            for &start in p.starts {
                opts.push((Opt::Mig { profile: pi, start }, profile_cost(g.model, p)));
            }
        }
        if whole {
            opts.push((Opt::Whole, WHOLE));
        }
        for (opt, cost) in opts {
            let mut l = g.layout.clone();
            if !apply_opt(g, opt, &mut l) {
                continue;
            }
            let after = room(g, &l);
            let before = rooms[pos];
            out.push(Choice {
                pos,
                opt,
                cost,
                room: (
                    total.0 - before.0 + after.0,
                    total.1 - before.1 + after.1,
                    total.2 - before.2 + after.2,
                ),
            });
        }
    }
    out
}

/// Places one tenant's request on `host` (whose layouts already hold every instance and
/// reservation, see [`fold_held`]), with the rules of the module's documentation.
pub fn place_tenant(
    host: &[HostGpu],
    tenant: &str,
    request: &GpuRequest,
    budget: u64,
) -> Result<Placement, PlaceError> {
    if host.is_empty() {
        return Err(PlanError::NoGpus.into());
    }
    let as_plan_error = |e| PlanError::Tenant(super::TenantsFileError::of(tenant, e));
    let need = request.need().map_err(as_plan_error)?;
    let demand = request.demand().map_err(as_plan_error)?;
    check_demand(host, tenant, &demand, need.as_ref())?;
    let req = Request {
        name: tenant.to_string(),
        demand: demand.clone(),
    };
    // The exact search decides feasibility and the least cost; the choices of that cost are
    // then ranked by the room they leave.
    let Some(solution) = search::place(host, std::slice::from_ref(&req), budget)? else {
        return Err(no_room(host, tenant, &demand, budget)?);
    };
    // `min_by_key` keeps the first of equals: the lowest GPU, then the candidates' order.
    let best = choices(host, &demand)
        .into_iter()
        .filter(|c| c.cost == solution.cost)
        .min_by_key(|c| std::cmp::Reverse(c.room))
        .expect("the search found a placement, so a choice of its cost exists");
    let g = &host[best.pos];
    let share = share_of(g, best.opt);
    let slots = match best.opt {
        Opt::Mig { profile, start } => {
            let p = &g.model.profiles[profile];
            (start..start + p.size).collect()
        }
        Opt::Whole => (0..g.model.placement_units).collect(),
    };
    Ok(Placement {
        tenant: tenant.to_string(),
        gpu: g.index,
        pci_address: None,
        share,
        slots,
        need,
        cost: best.cost,
    })
}

/// The refusal: the largest share left, and whether a different layout would have held it.
fn no_room(
    host: &[HostGpu],
    tenant: &str,
    demand: &Demand,
    budget: u64,
) -> Result<PlaceError, PlaceError> {
    let mut largest = None;
    for (_, d) in shares_by_size(host) {
        if let Some(c) = choices(host, &d).into_iter().next() {
            let g = &host[c.pos];
            // The first feasible choice of the largest share: any GPU that has it will do.
            largest = Some(Largest {
                gpu: g.index,
                share: share_of(g, c.opt),
            });
            break;
        }
    }
    Ok(PlaceError::NoRoom {
        tenant: tenant.to_string(),
        needs: describe(demand),
        largest,
        fragmentation: diagnose(host, tenant, demand, budget.min(DIAGNOSIS_BUDGET)),
    })
}

/// Would the existing instances and the new request fit if laid out afresh: on one GPU, or
/// across the host?
fn diagnose(host: &[HostGpu], tenant: &str, demand: &Demand, budget: u64) -> Fragmentation {
    let existing = |g: &HostGpu| -> Vec<Request> {
        let mut v: Vec<Request> = g
            .layout
            .instances
            .iter()
            .filter_map(|i| g.model.profile_by_id(i.profile_id))
            .enumerate()
            .map(|(k, p)| Request {
                name: format!("\u{0}held-{}-{k}", g.index),
                demand: Demand::Profile(p.name.to_string()),
            })
            .collect();
        if g.layout.whole {
            v.push(Request {
                name: format!("\u{0}whole-{}", g.index),
                demand: Demand::WholeGpu(0),
            });
        }
        v
    };
    let new = Request {
        name: tenant.to_string(),
        demand: demand.clone(),
    };
    let fresh = |g: &HostGpu| HostGpu {
        layout: Layout::empty(),
        ..g.clone()
    };
    for g in host {
        if g.layout.instances.is_empty() {
            continue;
        }
        let mut reqs = existing(g);
        reqs.push(new.clone());
        if let Ok(Some(_)) = search::place(&[fresh(g)], &reqs, budget) {
            return Fragmentation::OnGpu { gpu: g.index };
        }
    }
    let all: Vec<HostGpu> = host.iter().map(fresh).collect();
    let mut reqs: Vec<Request> = host.iter().flat_map(existing).collect();
    reqs.push(new);
    match search::place(&all, &reqs, budget) {
        Ok(Some(_)) => Fragmentation::AcrossGpus,
        Ok(None) => Fragmentation::Full,
        Err(_) => Fragmentation::Unknown,
    }
}

/// The daemon's call: the backend's GPUs (with their instances), the shares its ledger holds,
/// and the new tenant's request. The placement names the GPU by index and PCI address.
pub fn place_on_host(
    gpus: &[GpuInfo],
    held: &[Held],
    tenant: &str,
    request: &GpuRequest,
    budget: u64,
) -> Result<Placement, PlaceError> {
    let mut host = backend::host_gpus(gpus)?;
    fold_held(&mut host, gpus, held)?;
    let mut p = place_tenant(&host, tenant, request, budget)?;
    p.pci_address = gpus
        .iter()
        .find(|g| g.index == p.gpu)
        .map(|g| g.pci_address.clone());
    Ok(p)
}

#[cfg(test)]
mod tests;
