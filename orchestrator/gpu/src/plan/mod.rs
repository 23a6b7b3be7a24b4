//! Planning: size each tenant, choose its share and place it on the host's GPUs.
//!
//! [`plan`] places a whole tenants file at once (`tenantvm plan`); [`place::place_tenant`]
//! places one new tenant on a host whose instances and reservations stay where they are (the
//! daemon's `create`). Both read the same [`GpuRequest`], check it with the same rules and
//! search with the same exact planner ([`search`]).

pub mod place;
pub mod request;
pub mod search;
pub mod sizing;
pub mod tenants;

use std::fmt::Write as _;

use serde::Serialize;
use thiserror::Error;

pub use place::{place_tenant, Held, HeldShare, PlaceError, Placement};
pub use request::{GpuRequest, GpuRequestError, OverheadGib};
pub use search::{Assignment, Demand, HostGpu, Request, SearchError, Share, Solution};
pub use sizing::{Need, GIB};
pub use tenants::{TenantSpec, TenantsFile, TenantsFileError};

use crate::mig::{GpuModel, Sharing};
use sizing::gib;

/// Errors of planning.
#[derive(Debug, Error)]
pub enum PlanError {
    /// The placement search gave up.
    #[error(transparent)]
    Search(#[from] SearchError),
    /// A tenant entry is unusable.
    #[error(transparent)]
    Tenant(#[from] TenantsFileError),
    /// A tenant names a profile no GPU of the host has.
    #[error("Tenant `{tenant}` asks for profile `{profile}`, which no GPU of this host has: use one of {known}")]
    UnknownProfile {
        /// Tenant.
        tenant: String,
        /// Profile asked for.
        profile: String,
        /// Profiles the host's GPUs have.
        known: String,
    },
    /// A tenant asks for a share of a GPU the host can only give whole.
    #[error("Tenant `{tenant}` asks for MIG profile `{profile}`, a share of a GPU, but {gpus} cannot be shared: {why}. {fix}")]
    NoPartition {
        /// Tenant.
        tenant: String,
        /// Profile asked for.
        profile: String,
        /// The GPUs in question, in words.
        gpus: String,
        /// Why they cannot be shared.
        why: String,
        /// What to do.
        fix: String,
    },
    /// The host has no GPUs.
    #[error("The host has no GPUs to plan on: give `--gpu MODEL --count N`, a simulated host, or run where NVML sees GPUs")]
    NoGpus,
}

/// Checks a tenant's demand against the host: a named profile must exist on a GPU that can be
/// shared (a profile of a whole-only GPU is refused with the reason), and must hold the
/// tenant's model. The batch planner and the per-tenant placement both call this.
pub fn check_demand(
    gpus: &[HostGpu],
    tenant: &str,
    demand: &Demand,
    need: Option<&Need>,
) -> Result<(), PlanError> {
    let Demand::Profile(p) = demand else {
        return Ok(());
    };
    let has = |g: &HostGpu| {
        g.model
            .profile(p)
            .is_ok_and(|x| x.name.eq_ignore_ascii_case(p))
    };
    if !gpus.iter().any(|g| g.sharing.can_share() && has(g)) {
        let whole_only: Vec<&HostGpu> = gpus.iter().filter(|g| !g.sharing.can_share()).collect();
        let blocked: Vec<&HostGpu> = match whole_only.iter().filter(|g| has(g)).count() {
            0 if !gpus.iter().any(|g| g.sharing.can_share()) => whole_only.clone(),
            0 => Vec::new(),
            _ => whole_only.iter().copied().filter(|g| has(g)).collect(),
        };
        if let Some(first) = blocked.first() {
            let Sharing::WholeOnly(reason) = &first.sharing else {
                unreachable!("filtered on whole-only GPUs")
            };
            let names: Vec<String> = blocked
                .iter()
                .map(|g| format!("GPU {} ({})", g.index, g.model.name))
                .collect();
            return Err(PlanError::NoPartition {
                tenant: tenant.to_string(),
                profile: p.clone(),
                gpus: names.join(", "),
                why: reason.explain(),
                fix: format!("It can only be given whole: {}", reason.fix()),
            });
        }
        let mut names: Vec<&str> = gpus
            .iter()
            .filter(|g| g.sharing.can_share())
            .flat_map(|g| g.model.profiles.iter().map(|p| p.name))
            .collect();
        let mut seen = std::collections::HashSet::new();
        names.retain(|n| seen.insert(*n));
        return Err(PlanError::UnknownProfile {
            tenant: tenant.to_string(),
            profile: p.clone(),
            known: names.join(", "),
        });
    }
    if let Some(n) = need {
        let fits_somewhere = gpus.iter().any(|g| {
            g.sharing.can_share()
                && g.model
                    .profile(p)
                    .is_ok_and(|x| x.memory_bytes() >= n.total)
        });
        if !fits_somewhere {
            return Err(PlanError::Tenant(TenantsFileError::Invalid {
                tenant: tenant.to_string(),
                reason: format!(
                    "needs {} but profile {p} is smaller: drop `profile` to let the planner choose, or shrink context/concurrency",
                    gib(n.total)
                ),
            }));
        }
    }
    Ok(())
}

/// One tenant in the report.
#[derive(Debug, Clone, Serialize)]
pub struct TenantPlan {
    /// Tenant name.
    pub name: String,
    /// The sized need, when the tenant names a model.
    pub need: Option<Need>,
    /// What it asked for, in words.
    pub asks: String,
    /// Where it goes (None when the plan does not fit).
    pub assignment: Option<Assignment>,
}

/// The largest single share the host could still give.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Largest {
    /// GPU index.
    pub gpu: u32,
    /// The share.
    pub share: Share,
}

/// Why a plan does not fit.
#[derive(Debug, Clone, Serialize)]
pub struct NoFit {
    /// The first tenant, in file order, that cannot be added to those before it.
    pub tenant: String,
    /// What it asks for, in words.
    pub needs: String,
    /// The largest share the host can give once the tenants before it are placed.
    pub largest_available: Option<Largest>,
}

/// The plan.
#[derive(Debug, Clone, Serialize)]
pub struct PlanReport {
    /// Whether every tenant was placed.
    pub fits: bool,
    /// Per tenant, in file order.
    pub tenants: Vec<TenantPlan>,
    /// Why it does not fit, when it does not.
    pub no_fit: Option<NoFit>,
    /// Total cost in 1/120ths of a GPU.
    pub cost: u32,
    /// Search nodes visited.
    pub search_nodes: u64,
}

/// What a demand asks for, in words.
pub fn describe(demand: &Demand) -> String {
    match demand {
        Demand::Memory(b) => format!("a MIG instance (or whole GPU) with at least {}", gib(*b)),
        Demand::Profile(p) => format!("MIG profile {p}"),
        Demand::WholeGpu(0) => "a whole GPU".to_string(),
        Demand::WholeGpu(b) => format!("a whole GPU with at least {}", gib(*b)),
    }
}

/// Every share a host's GPU models offer, largest memory first (whole GPUs before 7g).
pub(crate) fn shares_by_size(gpus: &[HostGpu]) -> Vec<(u64, Demand)> {
    let mut models: Vec<&GpuModel> = Vec::new();
    for g in gpus {
        if !models.iter().any(|m| m.key == g.model.key) {
            models.push(g.model);
        }
    }
    let mut out: Vec<(u64, u8, Demand)> = Vec::new();
    for m in models {
        out.push((m.memory_bytes(), 1, Demand::WholeGpu(m.memory_bytes())));
        for p in m.profiles {
            out.push((p.memory_bytes(), 0, Demand::Profile(p.name.to_string())));
        }
    }
    out.sort_by_key(|x| std::cmp::Reverse((x.0, x.1)));
    out.into_iter().map(|(b, _, d)| (b, d)).collect()
}

/// Plans `tenants` on `gpus` (whose layouts already hold existing instances/reservations).
pub fn plan(
    gpus: &[HostGpu],
    tenants: &[TenantSpec],
    budget: u64,
) -> Result<PlanReport, PlanError> {
    if gpus.is_empty() {
        return Err(PlanError::NoGpus);
    }
    let mut requests = Vec::with_capacity(tenants.len());
    let mut plans = Vec::with_capacity(tenants.len());
    for t in tenants {
        let demand = t.demand()?;
        let need = t.need()?;
        check_demand(gpus, &t.name, &demand, need.as_ref())?;
        plans.push(TenantPlan {
            name: t.name.clone(),
            need,
            asks: describe(&demand),
            assignment: None,
        });
        requests.push(Request {
            name: t.name.clone(),
            demand,
        });
    }
    let mut nodes = 0;
    let solution = search::place(gpus, &requests, budget)?;
    if let Some(sol) = solution {
        for (p, a) in plans.iter_mut().zip(sol.assignments) {
            p.assignment = Some(a);
        }
        return Ok(PlanReport {
            fits: true,
            tenants: plans,
            no_fit: None,
            cost: sol.cost,
            search_nodes: sol.nodes,
        });
    }
    // Find the first tenant, in file order, that cannot join the ones before it.
    let mut placed_prefix: Option<Solution> = Some(Solution {
        assignments: Vec::new(),
        cost: 0,
        nodes: 0,
    });
    let mut culprit = requests.len() - 1;
    for k in 1..=requests.len() {
        match search::place(gpus, &requests[..k], budget)? {
            Some(s) => {
                nodes += s.nodes;
                placed_prefix = Some(s);
            }
            None => {
                culprit = k - 1;
                break;
            }
        }
    }
    let prefix = &requests[..culprit];
    let mut largest = None;
    for (_, demand) in shares_by_size(gpus) {
        let mut with = prefix.to_vec();
        with.push(Request {
            name: "\u{0}probe".into(),
            demand,
        });
        if let Some(s) = search::place(gpus, &with, budget)? {
            let a = s.assignments.last().expect("probe was placed");
            largest = Some(Largest {
                gpu: a.gpu,
                share: a.share.clone(),
            });
            break;
        }
    }
    if let Some(s) = placed_prefix {
        for (p, a) in plans.iter_mut().zip(s.assignments) {
            p.assignment = Some(a);
        }
    }
    Ok(PlanReport {
        fits: false,
        no_fit: Some(NoFit {
            tenant: requests[culprit].name.clone(),
            needs: describe(&requests[culprit].demand),
            largest_available: largest,
        }),
        tenants: plans,
        cost: 0,
        search_nodes: nodes,
    })
}

fn share_text(s: &Share) -> String {
    match s {
        Share::Mig {
            profile,
            profile_id,
            start,
            memory_mib,
            ..
        } => {
            format!(
                "{profile} (id {profile_id}) at slot {start}, {}",
                gib(memory_mib * 1024 * 1024)
            )
        }
        Share::WholeGpu { memory_mib } => {
            format!("whole GPU (MIG off), {}", gib(memory_mib * 1024 * 1024))
        }
    }
}

impl PlanReport {
    /// The report as text for people.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        for t in &self.tenants {
            let _ = writeln!(out, "{}:", t.name);
            if let Some(n) = &t.need {
                let _ = writeln!(
                    out,
                    "  need      weights {} + KV cache {} ({} B/token) + overhead {} = {}",
                    gib(n.weights),
                    gib(n.kv_cache),
                    n.kv_per_token,
                    gib(n.overhead),
                    gib(n.total)
                );
            }
            let _ = writeln!(out, "  asks      {}", t.asks);
            match &t.assignment {
                Some(a) => {
                    let _ = writeln!(out, "  placed    GPU {}: {}", a.gpu, share_text(&a.share));
                }
                None => {
                    let _ = writeln!(out, "  placed    no");
                }
            }
        }
        match &self.no_fit {
            None => {
                let _ = writeln!(
                    out,
                    "fits: all {} tenants placed, {:.2} GPUs used ({} search nodes)",
                    self.tenants.len(),
                    f64::from(self.cost) / f64::from(search::WHOLE),
                    self.search_nodes
                );
            }
            Some(nf) => {
                let _ = writeln!(
                    out,
                    "does not fit: tenant `{}` needs {}",
                    nf.tenant, nf.needs
                );
                match &nf.largest_available {
                    Some(l) => {
                        let _ = writeln!(
                            out,
                            "  largest the host can still give after the tenants before it: GPU {}: {}",
                            l.gpu,
                            share_text(&l.share)
                        );
                    }
                    None => {
                        let _ = writeln!(
                            out,
                            "  the host has nothing left after the tenants before it"
                        );
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mig::model_by_key;

    fn gpus(model: &str, n: u32) -> Vec<HostGpu> {
        let m = model_by_key(model).unwrap();
        (0..n).map(|index| HostGpu::new(index, m)).collect()
    }

    fn tenant(name: &str, model: &str, context: u64, concurrency: u64) -> TenantSpec {
        TenantSpec::new(
            name,
            GpuRequest {
                model: Some(model.into()),
                context: Some(context),
                concurrency: Some(concurrency),
                ..GpuRequest::default()
            },
        )
    }

    #[test]
    fn fitting_plan_places_every_tenant_with_its_breakdown() {
        let t = [
            tenant("a", "llama-3-8b", 8192, 4),
            tenant("b", "mistral-7b", 4096, 1),
        ];
        let r = plan(&gpus("h100-80gb", 1), &t, search::DEFAULT_NODE_BUDGET).unwrap();
        assert!(r.fits);
        // a: 14.96 + 4 GiB KV + 1 GiB = 19.96 GiB: a 20gb profile (19.62 GiB) is too small.
        let a = r.tenants[0].assignment.as_ref().unwrap();
        assert!(
            matches!(&a.share, Share::Mig { profile, .. } if profile == "3g.40gb"),
            "{a:?}"
        );
        let text = r.to_text();
        assert!(text.contains("KV cache 4.00 GiB"), "{text}");
        assert!(text.contains("fits: all 2 tenants"), "{text}");
    }

    #[test]
    fn no_fit_names_the_tenant_and_the_largest_share_left() {
        let t = [
            tenant("a", "llama-3-8b", 8192, 4),
            tenant("b", "llama-3-70b", 4096, 1),
            tenant("c", "mistral-7b", 4096, 1),
        ];
        let r = plan(&gpus("h100-80gb", 1), &t, search::DEFAULT_NODE_BUDGET).unwrap();
        assert!(!r.fits);
        let nf = r.no_fit.as_ref().unwrap();
        assert_eq!(nf.tenant, "b");
        let l = nf.largest_available.as_ref().unwrap();
        assert!(
            matches!(
                &l.share,
                Share::Mig {
                    memory_mib: 40_448,
                    ..
                }
            ),
            "{l:?}"
        );
        assert!(r.tenants[0].assignment.is_some());
        assert!(r.to_text().contains("does not fit: tenant `b`"));
    }

    #[test]
    fn explicit_profile_must_exist_and_hold_the_model() {
        let mut t = tenant("a", "llama-3-8b", 4096, 1);
        t.request.profile = Some("3g.20gb".into());
        let e = plan(&gpus("h100-80gb", 1), std::slice::from_ref(&t), 1000).unwrap_err();
        assert!(e.to_string().contains("3g.40gb"), "{e}");
        t.request.profile = Some("1g.10gb".into());
        let e = plan(&gpus("h100-80gb", 1), &[t], 1000).unwrap_err();
        assert!(e.to_string().contains("drop `profile`"), "{e}");
        assert!(matches!(plan(&[], &[], 10), Err(PlanError::NoGpus)));
    }
}
