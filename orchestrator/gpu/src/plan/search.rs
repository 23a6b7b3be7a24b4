//! The placement search: give every request a GPU, a profile and a start slot, honouring the
//! start-slot rules, the profiles' maximum counts and the instances that already exist, using
//! as few placement units as possible.
//!
//! The search is exact: a depth-first search over (request, GPU, profile, start) with
//! memoisation on the canonical host state (the multiset of per-GPU occupancies, so identical
//! GPUs and identical requests are explored once), a capacity bound that proves infeasibility
//! early, and an early stop when a branch reaches the lower bound. If it returns no placement,
//! none exists; if it returns one, none uses fewer units. A node budget turns a pathological
//! input into an error instead of an endless run; it never turns into a wrong answer.

use std::collections::HashMap;

use serde::Serialize;
use thiserror::Error;

use crate::mig::{GpuModel, Layout, MigProfile, Sharing, WholeOnly};

/// Normalised cost of a whole GPU; a profile costs `size × WHOLE / placement_units`.
pub const WHOLE: u32 = 120;

/// Default number of search nodes before giving up.
pub const DEFAULT_NODE_BUDGET: u64 = 5_000_000;

/// Errors of the placement search.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SearchError {
    /// The search visited more nodes than its budget.
    #[error("Placement search gave up after {0} nodes: split the tenants over fewer GPUs per plan or raise the budget")]
    Budget(u64),
}

/// One GPU of the host as the planner sees it.
#[derive(Debug, Clone)]
pub struct HostGpu {
    /// GPU index on the host.
    pub index: u32,
    /// Its model.
    pub model: &'static GpuModel,
    /// Whether MIG instances of it may be handed out ([`crate::mig::decide`]); a whole-only
    /// GPU is offered whole or not at all.
    pub sharing: Sharing,
    /// What already exists on it (instances, or handed out whole).
    pub layout: Layout,
}

impl HostGpu {
    /// An empty GPU of a database model: shareable when the model has MIG (a planning host,
    /// where drivers and the vGPU manager are assumed).
    pub fn new(index: u32, model: &'static GpuModel) -> Self {
        HostGpu {
            index,
            model,
            sharing: if model.has_mig() {
                Sharing::Mig
            } else {
                Sharing::WholeOnly(WholeOnly::NoMig)
            },
            layout: Layout::empty(),
        }
    }
}

/// What a request asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Demand {
    /// Any MIG profile, or else a whole GPU, with at least this many bytes.
    Memory(u64),
    /// A named MIG profile (on GPU models that have it).
    Profile(String),
    /// A whole GPU with at least this many bytes.
    WholeGpu(u64),
}

/// One tenant's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Tenant name.
    pub name: String,
    /// What it needs.
    pub demand: Demand,
}

/// The share a tenant gets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Share {
    /// A MIG GPU instance.
    Mig {
        /// Profile id.
        profile_id: u32,
        /// Profile name.
        profile: String,
        /// Start slot.
        start: u32,
        /// Size in placement units.
        size: u32,
        /// Memory in MiB.
        memory_mib: u64,
    },
    /// The whole GPU (MIG disabled).
    WholeGpu {
        /// Memory in MiB.
        memory_mib: u64,
    },
}

/// One tenant's placement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Assignment {
    /// Tenant name.
    pub tenant: String,
    /// GPU index.
    pub gpu: u32,
    /// What it gets there.
    pub share: Share,
}

/// Per GPU, the options of one request with their costs.
type OptsPerGpu = Vec<Vec<(Opt, u32)>>;

/// One way to serve a request on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Opt {
    /// Profile (index into `model.profiles`) at a start slot.
    Mig { profile: usize, start: u32 },
    /// The whole GPU.
    Whole,
}

/// Candidate profiles (indexes into `model.profiles`) or whole, per request and GPU. A
/// whole-only GPU offers no profiles.
pub(crate) fn candidates(demand: &Demand, gpu: &HostGpu) -> (Vec<usize>, bool) {
    let model = gpu.model;
    let (mut profiles, whole) = candidates_of_model(demand, model);
    if !gpu.sharing.can_share() {
        profiles.clear();
    }
    (profiles, whole)
}

fn candidates_of_model(demand: &Demand, model: &GpuModel) -> (Vec<usize>, bool) {
    match demand {
        Demand::Memory(bytes) => {
            let mut c: Vec<usize> = (0..model.profiles.len())
                .filter(|i| model.profiles[*i].memory_bytes() >= *bytes)
                .collect();
            // Cheapest first; among equals the least compute (the more flexible profile), and
            // plain before +me variants.
            c.sort_by_key(|i| {
                let p = &model.profiles[*i];
                (p.size, p.compute_slices, p.max_count == 1 && p.size == 1)
            });
            // A whole GPU (tried after every profile) serves a need between the largest
            // profile and the GPU's full memory.
            (c, model.memory_bytes() >= *bytes)
        }
        Demand::Profile(name) => (
            (0..model.profiles.len())
                .filter(|i| model.profiles[*i].name.eq_ignore_ascii_case(name))
                .collect(),
            false,
        ),
        Demand::WholeGpu(bytes) => (Vec::new(), model.memory_bytes() >= *bytes),
    }
}

/// The placement units an option covers.
pub(crate) fn opt_mask(model: &GpuModel, opt: Opt) -> u32 {
    match opt {
        Opt::Mig { profile, start } => model.profiles[profile].mask_at(start),
        Opt::Whole => (1u32 << model.placement_units) - 1,
    }
}

/// The cost of one instance of `p`.
pub(crate) fn profile_cost(model: &GpuModel, p: &MigProfile) -> u32 {
    p.size * WHOLE / model.placement_units
}

/// Packs a GPU's occupancy into one word: model, whole flag, used mask, per-profile counts.
fn pack(model_idx: usize, model: &GpuModel, l: &Layout) -> u64 {
    let mut key = (model_idx as u64) << 56 | u64::from(l.whole) << 48 | u64::from(l.used) << 32;
    for (i, p) in model.profiles.iter().enumerate() {
        let n = l.instances.iter().filter(|x| x.profile_id == p.id).count() as u64;
        key |= n.min(15) << (4 * i);
    }
    key
}

struct Search<'a> {
    gpus: &'a [HostGpu],
    model_idx: Vec<usize>,
    reqs: Vec<&'a Request>,
    /// Per request, per GPU: (options in order, their costs).
    opts: Vec<OptsPerGpu>,
    suffix_min: Vec<u32>,
    /// Per request `i`, per GPU: the units any option of requests `i..` could cover.
    suffix_reach: Vec<Vec<u32>>,
    /// Per request `i`, per GPU: the distinct option masks of requests `i..`, by end slot.
    suffix_masks: Vec<Vec<Vec<u32>>>,
    memo: HashMap<(usize, Vec<u64>), Option<u32>>,
    nodes: u64,
    budget: u64,
}

impl<'a> Search<'a> {
    fn new(gpus: &'a [HostGpu], requests: &'a [Request], budget: u64) -> Self {
        // GPUs are interchangeable for the memo only when model and sharing agree.
        let mut models: Vec<(&str, bool)> = Vec::new();
        let model_idx = gpus
            .iter()
            .map(|g| {
                let k = (g.model.key, g.sharing.can_share());
                match models.iter().position(|x| *x == k) {
                    Some(i) => i,
                    None => {
                        models.push(k);
                        models.len() - 1
                    }
                }
            })
            .collect();
        let per_request = |r: &Request| -> OptsPerGpu {
            gpus.iter()
                .map(|g| {
                    let (profiles, whole) = candidates(&r.demand, g);
                    let mut o: Vec<(Opt, u32)> = profiles
                        .into_iter()
                        .flat_map(|pi| {
                            let p = &g.model.profiles[pi];
                            let cost = profile_cost(g.model, p);
                            p.starts.iter().map(move |s| {
                                (
                                    Opt::Mig {
                                        profile: pi,
                                        start: *s,
                                    },
                                    cost,
                                )
                            })
                        })
                        .collect();
                    if whole {
                        o.push((Opt::Whole, WHOLE));
                    }
                    o
                })
                .collect()
        };
        let min_cost = |o: &OptsPerGpu| {
            o.iter()
                .flatten()
                .map(|(_, c)| *c)
                .min()
                .unwrap_or(u32::MAX)
        };
        // Biggest first: they have the fewest places to go.
        let mut order: Vec<(usize, OptsPerGpu)> = requests
            .iter()
            .enumerate()
            .map(|(i, r)| (i, per_request(r)))
            .collect();
        order.sort_by_key(|(i, o)| (std::cmp::Reverse(min_cost(o)), *i));
        let reqs = order.iter().map(|(i, _)| &requests[*i]).collect();
        let opts: Vec<_> = order.into_iter().map(|(_, o)| o).collect();
        let mut suffix_min = vec![0u32; opts.len() + 1];
        for i in (0..opts.len()).rev() {
            suffix_min[i] = suffix_min[i + 1].saturating_add(min_cost(&opts[i]));
        }
        let mut suffix_reach = vec![vec![0u32; gpus.len()]; opts.len() + 1];
        for i in (0..opts.len()).rev() {
            for g in 0..gpus.len() {
                let reach = opts[i][g]
                    .iter()
                    .fold(0u32, |m, (o, _)| m | opt_mask(gpus[g].model, *o));
                suffix_reach[i][g] = suffix_reach[i + 1][g] | reach;
            }
        }
        let mut suffix_masks = vec![vec![Vec::new(); gpus.len()]; opts.len() + 1];
        for i in (0..opts.len()).rev() {
            for g in 0..gpus.len() {
                let mut m: Vec<u32> = suffix_masks[i + 1][g].clone();
                m.extend(opts[i][g].iter().map(|(o, _)| opt_mask(gpus[g].model, *o)));
                // Earliest end first (then latest start), as interval scheduling wants.
                m.sort_by_key(|x| {
                    (
                        32 - x.leading_zeros(),
                        std::cmp::Reverse(x.trailing_zeros()),
                    )
                });
                m.dedup();
                suffix_masks[i][g] = m;
            }
        }
        Search {
            gpus,
            model_idx,
            reqs,
            opts,
            suffix_min,
            suffix_reach,
            suffix_masks,
            memo: HashMap::new(),
            nodes: 0,
            budget,
        }
    }

    fn key(&self, i: usize, layouts: &[Layout]) -> (usize, Vec<u64>) {
        let mut k: Vec<u64> = layouts
            .iter()
            .enumerate()
            .map(|(g, l)| pack(self.model_idx[g], self.gpus[g].model, l))
            .collect();
        k.sort_unstable();
        (i, k)
    }

    fn apply(&self, g: usize, opt: Opt, l: &mut Layout) -> bool {
        apply_opt(&self.gpus[g], opt, l)
    }

    fn undo(&self, g: usize, opt: Opt, l: &mut Layout) {
        match opt {
            Opt::Mig { profile, start } => {
                l.remove(&self.gpus[g].model.profiles[profile], start);
            }
            Opt::Whole => l.whole = false,
        }
    }

    /// Least cost to place requests `i..` on `layouts`, or `None` when impossible.
    fn solve(&mut self, i: usize, layouts: &mut Vec<Layout>) -> Result<Option<u32>, SearchError> {
        if i == self.reqs.len() {
            return Ok(Some(0));
        }
        let key = self.key(i, layouts);
        if let Some(v) = self.memo.get(&key) {
            return Ok(*v);
        }
        self.nodes += 1;
        if self.nodes > self.budget {
            return Err(SearchError::Budget(self.budget));
        }
        // Capacity bound: only free units that some remaining option can cover count (a 1g
        // never covers slot 7 of an 8-slice GPU, so 57 1g requests on 8 GPUs fail here).
        let free: u32 = layouts
            .iter()
            .enumerate()
            .map(|(g, l)| {
                let model = self.gpus[g].model;
                let usable = if l.whole {
                    0
                } else {
                    (!l.used & self.suffix_reach[i][g]).count_ones()
                };
                usable * WHOLE / model.placement_units
            })
            .sum();
        // Count bound: each request needs its own instance; on each GPU, the most disjoint
        // free option intervals (earliest-end greedy is exact for intervals) caps how many
        // more instances fit.
        let slots: usize = layouts
            .iter()
            .enumerate()
            .map(|(g, l)| {
                if l.whole {
                    return 0;
                }
                let (mut last_end, mut n) = (0u32, 0usize);
                for &m in &self.suffix_masks[i][g] {
                    if m & l.used == 0 && m.trailing_zeros() >= last_end {
                        last_end = 32 - m.leading_zeros();
                        n += 1;
                    }
                }
                n
            })
            .sum();
        let mut best: Option<u32> = None;
        if free >= self.suffix_min[i] && slots >= self.reqs.len() - i {
            let mut tried: Vec<u64> = Vec::new();
            'gpus: for g in 0..self.gpus.len() {
                let packed = pack(self.model_idx[g], self.gpus[g].model, &layouts[g]);
                if tried.contains(&packed) {
                    continue;
                }
                tried.push(packed);
                for oi in 0..self.opts[i][g].len() {
                    let (opt, cost) = self.opts[i][g][oi];
                    if !self.apply(g, opt, &mut layouts[g]) {
                        continue;
                    }
                    let sub = self.solve(i + 1, layouts);
                    self.undo(g, opt, &mut layouts[g]);
                    if let Some(c) = sub? {
                        let total = cost + c;
                        if best.is_none_or(|b| total < b) {
                            best = Some(total);
                        }
                        if total == self.suffix_min[i] {
                            break 'gpus;
                        }
                    }
                }
            }
        }
        self.memo.insert(key, best);
        Ok(best)
    }

    /// Replays the memo to recover the choices of an optimal solution of cost `target`.
    fn reconstruct(&self, layouts: &mut [Layout], target: u32) -> Vec<Assignment> {
        let mut out = Vec::new();
        let mut remaining = target;
        for i in 0..self.reqs.len() {
            let mut chosen = None;
            'search: for g in 0..self.gpus.len() {
                for &(opt, cost) in &self.opts[i][g] {
                    if cost > remaining || !self.apply(g, opt, &mut layouts[g]) {
                        continue;
                    }
                    let sub = if i + 1 == self.reqs.len() {
                        Some(0)
                    } else {
                        self.memo.get(&self.key(i + 1, layouts)).copied().flatten()
                    };
                    if sub == Some(remaining - cost) {
                        chosen = Some((g, opt, cost));
                        break 'search;
                    }
                    self.undo(g, opt, &mut layouts[g]);
                }
            }
            let (g, opt, cost) = chosen.expect("an optimal solution replays from its memo");
            remaining -= cost;
            let gpu = &self.gpus[g];
            out.push(Assignment {
                tenant: self.reqs[i].name.clone(),
                gpu: gpu.index,
                share: share_of(gpu, opt),
            });
        }
        out
    }
}

/// The share an option gives on `gpu`.
pub(crate) fn share_of(gpu: &HostGpu, opt: Opt) -> Share {
    match opt {
        Opt::Mig { profile, start } => {
            let p = &gpu.model.profiles[profile];
            Share::Mig {
                profile_id: p.id,
                profile: p.name.to_string(),
                start,
                size: p.size,
                memory_mib: p.memory_mib,
            }
        }
        Opt::Whole => Share::WholeGpu {
            memory_mib: gpu.model.memory_mib,
        },
    }
}

/// Applies an option to a layout; false (and nothing changed) when it does not fit.
pub(crate) fn apply_opt(gpu: &HostGpu, opt: Opt, l: &mut Layout) -> bool {
    match opt {
        Opt::Mig { profile, start } => l.place(&gpu.model.profiles[profile], start).is_ok(),
        Opt::Whole => {
            if l.can_take_whole() {
                l.whole = true;
                true
            } else {
                false
            }
        }
    }
}

/// A successful placement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Solution {
    /// One entry per request, in the requests' order.
    pub assignments: Vec<Assignment>,
    /// Total normalised cost (a whole GPU is [`WHOLE`]).
    pub cost: u32,
    /// Search nodes visited.
    pub nodes: u64,
}

/// Places every request, or returns `Ok(None)` when no placement exists.
pub fn place(
    gpus: &[HostGpu],
    requests: &[Request],
    budget: u64,
) -> Result<Option<Solution>, SearchError> {
    let mut search = Search::new(gpus, requests, budget);
    let mut layouts: Vec<Layout> = gpus.iter().map(|g| g.layout.clone()).collect();
    let Some(cost) = search.solve(0, &mut layouts)? else {
        return Ok(None);
    };
    let mut assignments = search.reconstruct(&mut layouts, cost);
    let pos = |name: &str| requests.iter().position(|r| r.name == name);
    assignments.sort_by_key(|a| pos(&a.tenant));
    Ok(Some(Solution {
        assignments,
        cost,
        nodes: search.nodes,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mig::model_by_key;
    use crate::plan::sizing::GIB;

    fn host(model: &str, n: u32) -> Vec<HostGpu> {
        let m = model_by_key(model).unwrap();
        (0..n).map(|index| HostGpu::new(index, m)).collect()
    }

    fn req(name: &str, demand: Demand) -> Request {
        Request {
            name: name.into(),
            demand,
        }
    }

    /// Reference: every combination of (GPU, option) per request, checked by replaying onto
    /// fresh layouts. Exponential; only for small cases.
    fn exhaustive(gpus: &[HostGpu], requests: &[Request]) -> Option<u32> {
        fn rec(
            gpus: &[HostGpu],
            requests: &[Request],
            i: usize,
            layouts: &mut Vec<Layout>,
        ) -> Option<u32> {
            if i == requests.len() {
                return Some(0);
            }
            let mut best: Option<u32> = None;
            for g in 0..gpus.len() {
                let (profiles, whole) = candidates(&requests[i].demand, &gpus[g]);
                for pi in profiles {
                    let p = &gpus[g].model.profiles[pi];
                    for s in p.starts {
                        let saved = layouts[g].clone();
                        if layouts[g].place(p, *s).is_ok() {
                            if let Some(c) = rec(gpus, requests, i + 1, layouts) {
                                let t = c + profile_cost(gpus[g].model, p);
                                best = Some(best.map_or(t, |b| b.min(t)));
                            }
                        }
                        layouts[g] = saved;
                    }
                }
                if whole && layouts[g].can_take_whole() {
                    layouts[g].whole = true;
                    if let Some(c) = rec(gpus, requests, i + 1, layouts) {
                        best = Some(best.map_or(c + WHOLE, |b| b.min(c + WHOLE)));
                    }
                    layouts[g].whole = false;
                }
            }
            best
        }
        let mut layouts = gpus.iter().map(|g| g.layout.clone()).collect();
        rec(gpus, requests, 0, &mut layouts)
    }

    /// Checks that a solution is valid: replays it onto the host.
    fn replay(gpus: &[HostGpu], sol: &Solution) -> u32 {
        let mut layouts: Vec<Layout> = gpus.iter().map(|g| g.layout.clone()).collect();
        let mut cost = 0;
        for a in &sol.assignments {
            let g = gpus.iter().position(|x| x.index == a.gpu).unwrap();
            match &a.share {
                Share::Mig {
                    profile_id, start, ..
                } => {
                    let p = gpus[g].model.profile_by_id(*profile_id).unwrap();
                    layouts[g].place(p, *start).expect("solution must be valid");
                    cost += profile_cost(gpus[g].model, p);
                }
                Share::WholeGpu { .. } => {
                    assert!(layouts[g].can_take_whole());
                    layouts[g].whole = true;
                    cost += WHOLE;
                }
            }
        }
        cost
    }

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    #[test]
    fn search_matches_exhaustive_search_on_generated_cases() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let models = ["h100-80gb", "a100-40gb", "rtx-pro-6000"];
        let mut feasible = 0;
        for case in 0..400 {
            // Every fourth host mixes models; the rest have one model.
            let model = model_by_key(models[case % models.len()]).unwrap();
            let n_gpus = 1 + rng.below(if case % 4 == 3 { 3 } else { 2 }) as u32;
            let mut gpus: Vec<HostGpu> = (0..n_gpus)
                .map(|index| {
                    // Mixed hosts may hold a GPU without MIG (whole only).
                    let mixed = ["h100-80gb", "a100-40gb", "rtx-pro-6000", "l40s"];
                    let model = if case % 4 == 3 {
                        model_by_key(mixed[rng.below(mixed.len() as u64) as usize]).unwrap()
                    } else {
                        model
                    };
                    HostGpu::new(index, model)
                })
                .collect();
            // Existing instances, placed at random where they fit.
            for g in gpus.iter_mut().filter(|g| g.model.has_mig()) {
                let model = g.model;
                for _ in 0..rng.below(3) {
                    let p = &model.profiles[rng.below(model.profiles.len() as u64) as usize];
                    let s = p.starts[rng.below(p.starts.len() as u64) as usize];
                    let _ = g.layout.place(p, s);
                }
            }
            let n_req = 1 + rng.below(5) as usize;
            let requests: Vec<Request> = (0..n_req)
                .map(|i| {
                    let demand = match rng.below(6) {
                        0 => Demand::WholeGpu(0),
                        1 => {
                            let p =
                                &model.profiles[rng.below(model.profiles.len() as u64) as usize];
                            Demand::Profile(p.name.to_string())
                        }
                        _ => Demand::Memory(rng.below(model.memory_bytes() / 2) + 1),
                    };
                    req(&format!("t{i}"), demand)
                })
                .collect();
            let expected = exhaustive(&gpus, &requests);
            let got = place(&gpus, &requests, DEFAULT_NODE_BUDGET).unwrap();
            assert_eq!(
                got.as_ref().map(|s| s.cost),
                expected,
                "case {case}: {requests:?}"
            );
            if let Some(sol) = got {
                feasible += 1;
                assert_eq!(replay(&gpus, &sol), sol.cost, "case {case}");
                assert_eq!(sol.assignments.len(), requests.len());
            }
        }
        assert!(
            feasible > 50 && feasible < 300,
            "generator covers both outcomes: {feasible}"
        );
    }

    #[test]
    fn fragmentation_forces_the_exact_start_slots() {
        // 3g at 4 exists; a 4g must take slot 0 and nothing else fits beside it.
        let mut gpus = host("h100-80gb", 1);
        let m = gpus[0].model;
        gpus[0]
            .layout
            .place(m.profile("3g.40gb").unwrap(), 4)
            .unwrap();
        let r = [req("a", Demand::Profile("4g.40gb".into()))];
        let sol = place(&gpus, &r, DEFAULT_NODE_BUDGET).unwrap().unwrap();
        assert!(matches!(
            sol.assignments[0].share,
            Share::Mig { start: 0, .. }
        ));
        let r2 = [r[0].clone(), req("b", Demand::Profile("1g.10gb".into()))];
        assert_eq!(place(&gpus, &r2, DEFAULT_NODE_BUDGET).unwrap(), None);
    }

    #[test]
    fn memory_demand_picks_the_smallest_profile_that_holds_it() {
        let gpus = host("h100-80gb", 1);
        let r = [req("a", Demand::Memory(30 * GIB))];
        let sol = place(&gpus, &r, DEFAULT_NODE_BUDGET).unwrap().unwrap();
        assert!(
            matches!(&sol.assignments[0].share, Share::Mig { profile, .. } if profile == "3g.40gb")
        );
    }

    #[test]
    fn a_need_between_the_7g_profile_and_the_whole_gpu_gets_the_whole_gpu() {
        let gpus = host("h100-80gb", 1);
        let m = gpus[0].model;
        let between = m.profile("7g.80gb").unwrap().memory_bytes() + GIB / 8;
        assert!(between <= m.memory_bytes());
        let sol = place(
            &gpus,
            &[req("a", Demand::Memory(between))],
            DEFAULT_NODE_BUDGET,
        )
        .unwrap()
        .unwrap();
        assert!(matches!(sol.assignments[0].share, Share::WholeGpu { .. }));
        let at_7g = m.profile("7g.80gb").unwrap().memory_bytes();
        let sol = place(
            &gpus,
            &[req("a", Demand::Memory(at_7g))],
            DEFAULT_NODE_BUDGET,
        )
        .unwrap()
        .unwrap();
        assert!(
            matches!(sol.assignments[0].share, Share::Mig { .. }),
            "7g first at equal cost"
        );
        let beyond = m.memory_bytes() + 1;
        assert_eq!(
            place(
                &gpus,
                &[req("a", Demand::Memory(beyond))],
                DEFAULT_NODE_BUDGET
            )
            .unwrap(),
            None
        );
    }

    #[test]
    fn eight_gpus_and_forty_tenants_place_quickly_enough_to_test() {
        let gpus = host("h100-80gb", 8);
        let mut r = Vec::new();
        for i in 0..40 {
            let gib = [5, 9, 18, 5, 9][i % 5];
            r.push(req(&format!("t{i}"), Demand::Memory(gib * GIB)));
        }
        let sol = place(&gpus, &r, DEFAULT_NODE_BUDGET).unwrap().unwrap();
        assert_eq!(sol.assignments.len(), 40);
        assert_eq!(replay(&gpus, &sol), sol.cost);
    }

    #[test]
    fn budget_exhaustion_is_an_error_not_an_answer() {
        let gpus = host("h100-80gb", 4);
        let r: Vec<Request> = (0..20)
            .map(|i| req(&format!("t{i}"), Demand::Memory(GIB)))
            .collect();
        assert_eq!(place(&gpus, &r, 3), Err(SearchError::Budget(3)));
    }
}
