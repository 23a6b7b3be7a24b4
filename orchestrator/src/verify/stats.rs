//! The statistics of the timing check (5), after Gu et al., "Auditing Prompt Caching in
//! Language Model APIs" (ICML 2025): a one-sided two-sample Kolmogorov-Smirnov test of
//! "hit" times against "miss" times, samples taken in hit/miss pairs whose order is random,
//! and the effect sizes an operator can read (the median within-pair difference and its
//! bootstrap bound, the arms' median difference, the fraction of hits faster than the
//! fastest miss).

use rand::SeedableRng;
use serde::{Deserialize, Serialize};

/// Which arm a sample belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Arm {
    /// The probe repeats a prefix that was sent before (a cache hit if a cache is shared).
    Hit,
    /// The probe sends a fresh prefix of the same length.
    Miss,
}

/// `n` pairs of one hit and one miss, each pair's order drawn at random from `seed`, the
/// pairs back to back: `[Hit, Miss, Miss, Hit, ...]`. Both samples of a pair are taken
/// seconds apart, so the pair's difference cancels whatever drifts more slowly than that
/// (other work on the host, a guest's page cache warming), and which of the two goes first
/// is random, so a within-pair order effect cannot pass for a cache. Balanced (`n` of each)
/// and reproducible (the same seed gives the same order, so a report can be reproduced).
pub fn paired_order(n: usize, seed: u64) -> Vec<Arm> {
    use rand::Rng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .flat_map(|_| {
            if rng.random::<bool>() {
                [Arm::Hit, Arm::Miss]
            } else {
                [Arm::Miss, Arm::Hit]
            }
        })
        .collect()
}

/// The within-pair differences (miss minus hit, ms) of times taken in an order that
/// [`paired_order`] made: `times[i]` belongs to `order[i]`. A chunk of two that is not one
/// hit and one miss (or a trailing single sample) gives no difference.
pub fn paired_differences(order: &[Arm], times: &[f64]) -> Vec<f64> {
    order
        .chunks_exact(2)
        .zip(times.chunks_exact(2))
        .filter_map(|(arms, t)| match (arms[0], arms[1]) {
            (Arm::Hit, Arm::Miss) => Some(t[1] - t[0]),
            (Arm::Miss, Arm::Hit) => Some(t[0] - t[1]),
            _ => None,
        })
        .collect()
}

/// The one-sided upper bootstrap confidence bound, at `level`, of the median of `xs` (e.g.
/// paired differences): `resamples` resamplings with replacement drawn from `seed`. `NaN`
/// when `xs` is empty.
pub fn median_upper_bound(xs: &[f64], level: f64, resamples: usize, seed: u64) -> f64 {
    if xs.is_empty() || resamples == 0 {
        return f64::NAN;
    }
    use rand::Rng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let medians: Vec<f64> = (0..resamples)
        .map(|_| {
            let draw: Vec<f64> = (0..xs.len())
                .map(|_| xs[rng.random_range(0..xs.len())])
                .collect();
            median(&draw)
        })
        .collect();
    quantile(&medians, level)
}

/// The one-sided two-sample KS test's result and the effect sizes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct KsResult {
    /// Samples in the hit arm.
    pub n_hit: usize,
    /// Samples in the miss arm.
    pub n_miss: usize,
    /// D+ = max over t of (F_hit(t) - F_miss(t)): how far the hit CDF lies above the miss
    /// CDF (hits faster).
    pub statistic: f64,
    /// p-value of D+ under "hits are not faster" (asymptotic: exp(-2 n_e D+^2) with
    /// n_e = n m / (n + m)).
    pub p_value: f64,
    /// Median miss time minus median hit time, ms (positive: hits faster).
    pub median_diff_ms: f64,
    /// Median hit time, ms.
    pub median_hit_ms: f64,
    /// Median miss time, ms.
    pub median_miss_ms: f64,
    /// Fraction of hits faster than the fastest miss.
    pub hits_below_fastest_miss: f64,
}

/// Median of a sample (`NaN` when empty).
pub fn median(xs: &[f64]) -> f64 {
    quantile(xs, 0.5)
}

/// The `q` quantile (0..=1) by linear interpolation between order statistics (`NaN` when
/// empty).
pub fn quantile(xs: &[f64], q: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let pos = q.clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

/// The one-sided KS test of `hit` against `miss` (times in ms), alternative "hit times are
/// stochastically smaller". `None` when either arm is empty.
pub fn ks_greater(hit: &[f64], miss: &[f64]) -> Option<KsResult> {
    if hit.is_empty() || miss.is_empty() {
        return None;
    }
    let mut h = hit.to_vec();
    let mut m = miss.to_vec();
    h.sort_by(f64::total_cmp);
    m.sort_by(f64::total_cmp);
    let (n, k) = (h.len(), m.len());
    // Walk both sorted samples; at each distinct value compare the empirical CDFs.
    let (mut i, mut j) = (0usize, 0usize);
    let mut d = 0.0f64;
    while i < n || j < k {
        let t = match (h.get(i), m.get(j)) {
            (Some(a), Some(b)) => a.min(*b),
            (Some(a), None) => *a,
            (None, Some(b)) => *b,
            (None, None) => break,
        };
        while i < n && h[i] <= t {
            i += 1;
        }
        while j < k && m[j] <= t {
            j += 1;
        }
        d = d.max(i as f64 / n as f64 - j as f64 / k as f64);
    }
    let ne = (n * k) as f64 / (n + k) as f64;
    let p = (-2.0 * ne * d * d).exp().min(1.0);
    let fastest_miss = m[0];
    let below = h.iter().filter(|x| **x < fastest_miss).count() as f64 / n as f64;
    let (mh, mm) = (median(&h), median(&m));
    Some(KsResult {
        n_hit: n,
        n_miss: k,
        statistic: d,
        p_value: p,
        median_diff_ms: mm - mh,
        median_hit_ms: mh,
        median_miss_ms: mm,
        hits_below_fastest_miss: below,
    })
}

/// The one-sided upper bootstrap confidence bound, at `level` (e.g. 0.95), of
/// median(miss) - median(hit): `resamples` resamplings of both arms with replacement, drawn
/// from `seed`. `NaN` when either arm is empty. The equivalence half of the timing check:
/// "no difference" is claimed only when even this bound is small.
pub fn median_diff_upper_bound(
    hit: &[f64],
    miss: &[f64],
    level: f64,
    resamples: usize,
    seed: u64,
) -> f64 {
    if hit.is_empty() || miss.is_empty() || resamples == 0 {
        return f64::NAN;
    }
    use rand::Rng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut draw = |xs: &[f64]| -> Vec<f64> {
        (0..xs.len())
            .map(|_| xs[rng.random_range(0..xs.len())])
            .collect()
    };
    let diffs: Vec<f64> = (0..resamples)
        .map(|_| median(&draw(miss)) - median(&draw(hit)))
        .collect();
    quantile(&diffs, level)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    fn noisy(rng: &mut rand::rngs::StdRng, n: usize, mean: f64, sd: f64) -> Vec<f64> {
        (0..n)
            .map(|_| {
                // Sum of uniforms: roughly normal, bounded, no extra dependency.
                let u: f64 = (0..12).map(|_| rng.random::<f64>()).sum::<f64>() - 6.0;
                (mean + sd * u).max(0.0)
            })
            .collect()
    }

    #[test]
    fn pairs_are_balanced_randomly_ordered_and_reproducible() {
        let a = paired_order(200, 7);
        assert_eq!(a.len(), 400);
        assert_eq!(a, paired_order(200, 7));
        assert_ne!(a, paired_order(200, 8));
        for pair in a.chunks(2) {
            assert_ne!(pair[0], pair[1], "a pair is one hit and one miss");
        }
        let hit_first = a.chunks(2).filter(|p| p[0] == Arm::Hit).count();
        assert!((70..=130).contains(&hit_first), "{hit_first}");
    }

    #[test]
    fn paired_differences_are_miss_minus_hit_and_skip_malformed_pairs() {
        let order = [
            Arm::Hit,
            Arm::Miss,
            Arm::Miss,
            Arm::Hit,
            Arm::Hit,
            Arm::Hit,
            Arm::Miss,
        ];
        let times = [10.0, 50.0, 70.0, 20.0, 1.0, 2.0, 3.0];
        assert_eq!(paired_differences(&order, &times), vec![40.0, 50.0]);
    }

    #[test]
    fn pairing_cancels_a_drift_the_unpaired_bound_cannot() {
        // Host load ramps the times from 100 to 700 ms over the run; no cache anywhere.
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let order = paired_order(100, 5);
        let times: Vec<f64> = order
            .iter()
            .enumerate()
            .map(|(i, _)| 100.0 + 3.0 * i as f64 + rng.random::<f64>() * 10.0)
            .collect();
        let pick = |arm: Arm| -> Vec<f64> {
            order
                .iter()
                .zip(&times)
                .filter(|(a, _)| **a == arm)
                .map(|(_, t)| *t)
                .collect()
        };
        let unpaired = median_diff_upper_bound(&pick(Arm::Hit), &pick(Arm::Miss), 0.95, 1000, 1);
        let paired = median_upper_bound(&paired_differences(&order, &times), 0.95, 1000, 1);
        assert!(unpaired > 50.0, "{unpaired}");
        assert!(paired < 8.0, "{paired}");
        // A real speed-up of 40 ms stays visible through the drift.
        let shifted: Vec<f64> = order
            .iter()
            .zip(&times)
            .map(|(a, t)| if *a == Arm::Hit { t - 40.0 } else { *t })
            .collect();
        let d = paired_differences(&order, &shifted);
        assert!((median(&d) - 40.0).abs() < 8.0, "{}", median(&d));
        assert!(median_upper_bound(&[], 0.95, 10, 1).is_nan());
    }

    #[test]
    fn detects_a_realistic_cache_speed_up() {
        // A cached prefix at a tenth of the cold prefill time, with noise.
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let hit = noisy(&mut rng, 250, 12.0, 4.0);
        let miss = noisy(&mut rng, 250, 120.0, 30.0);
        let r = ks_greater(&hit, &miss).unwrap();
        assert!(r.p_value < 1e-6, "{r:?}");
        assert!(r.statistic > 0.9, "{r:?}");
        assert!((r.median_diff_ms - 108.0).abs() < 10.0, "{r:?}");
        assert!(r.hits_below_fastest_miss > 0.5, "{r:?}");
    }

    #[test]
    fn detects_a_small_shift_with_enough_samples() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        let hit = noisy(&mut rng, 250, 95.0, 10.0);
        let miss = noisy(&mut rng, 250, 100.0, 10.0);
        let r = ks_greater(&hit, &miss).unwrap();
        assert!(r.p_value < 1e-3, "{r:?}");
    }

    #[test]
    fn stays_quiet_when_nothing_is_shared() {
        // Same distribution in both arms, over many seeds: at alpha = 1e-3 a false alarm
        // should essentially never happen.
        let mut alarms = 0;
        for seed in 0..200 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(100 + seed);
            let hit = noisy(&mut rng, 250, 100.0, 20.0);
            let miss = noisy(&mut rng, 250, 100.0, 20.0);
            if ks_greater(&hit, &miss).unwrap().p_value < 1e-3 {
                alarms += 1;
            }
        }
        assert!(alarms <= 1, "{alarms} false alarms in 200 runs");
    }

    #[test]
    fn is_one_sided() {
        // Hits *slower* than misses is not what a shared cache does: no detection.
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let hit = noisy(&mut rng, 250, 120.0, 10.0);
        let miss = noisy(&mut rng, 250, 12.0, 4.0);
        let r = ks_greater(&hit, &miss).unwrap();
        assert_eq!(r.statistic, 0.0);
        assert_eq!(r.p_value, 1.0);
        assert!(r.median_diff_ms < 0.0);
    }

    #[test]
    fn known_small_case() {
        // hit {1,2,3}, miss {4,5,6}: D+ = 1, n_e = 1.5, p = exp(-3).
        let r = ks_greater(&[1.0, 2.0, 3.0], &[4.0, 5.0, 6.0]).unwrap();
        assert_eq!(r.statistic, 1.0);
        assert!((r.p_value - (-3.0f64).exp()).abs() < 1e-12);
        assert_eq!(r.hits_below_fastest_miss, 1.0);
        // Ties count on both sides at once.
        let t = ks_greater(&[1.0, 2.0], &[1.0, 2.0]).unwrap();
        assert_eq!(t.statistic, 0.0);
        assert!(ks_greater(&[], &[1.0]).is_none());
    }

    #[test]
    fn the_bootstrap_bound_is_tight_without_a_difference_and_above_a_real_one() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let a = noisy(&mut rng, 250, 100.0, 20.0);
        let b = noisy(&mut rng, 250, 100.0, 20.0);
        let ub = median_diff_upper_bound(&a, &b, 0.95, 1000, 1);
        assert!(ub > -2.0 && ub < 8.0, "{ub}");
        let fast = noisy(&mut rng, 250, 70.0, 20.0);
        let ub = median_diff_upper_bound(&fast, &b, 0.95, 1000, 1);
        assert!(ub > 30.0, "{ub}");
        assert_eq!(ub, median_diff_upper_bound(&fast, &b, 0.95, 1000, 1));
        assert!(median_diff_upper_bound(&[], &b, 0.95, 10, 1).is_nan());
    }

    #[test]
    fn quantiles_interpolate() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[1.0, 2.0, 3.0, 4.0]), 2.5);
        assert_eq!(quantile(&[0.0, 10.0], 0.99), 9.9);
        assert!(median(&[]).is_nan());
    }
}
