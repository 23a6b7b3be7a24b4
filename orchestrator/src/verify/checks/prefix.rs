//! Check 5: no prefix cache is shared across tenants, tested by timing (Gu et al.'s audit
//! run across the tenant boundary; docs/verify.md).
//!
//! Samples come in `--samples` pairs of one hit and one miss, back to back, each pair's order
//! random ([`crate::verify::stats::paired_order`]). For each sample the victim sends a fresh prompt
//! of random words; then for a *hit* the attacker sends a prompt that shares the victim's
//! first 95 % and ends freshly, for a *miss* a fresh prompt of the same length; the
//! attacker's time to its answer (one token) is the sample. A one-sided KS test asks whether
//! hits are faster ([`crate::verify::stats::ks_greater`]); the effect is the median of the
//! within-pair differences (miss minus hit), which cancels the host's load drift.
//!
//! The positive control runs first: victim and attacker are the *same* probe tenant, whose
//! payload has its prefix cache on (`--control-image`), so hits must come out faster. If the
//! control does not detect the difference the probe lacked power (prompt too short, noise
//! too high) and the check is inconclusive, never a pass. The test proper has one probe
//! tenant prime and another probe; it passes only when the control detected the cache, the
//! test did not (p >= alpha), and the 95 % bootstrap upper bound of the test's median paired
//! difference is under a tenth of the control's median paired difference (equivalence: any
//! cross-tenant effect is small next to what a shared cache gives).

use rand::{Rng, SeedableRng};

use crate::verify::callers::{callers, Door, ProbeCaller};
use crate::verify::host::Engine;
use crate::verify::stats::{
    ks_greater, median, median_diff_upper_bound, median_upper_bound, paired_differences,
    paired_order, Arm, KsResult,
};
use crate::verify::{Check, CheckId, Ctx, HostError, Outcome, Verdict};

/// Share of the victim's prompt the attacker repeats in a hit.
pub const PREFIX_FRACTION: f64 = 0.95;
/// The upper 95 % bound of the test's median paired difference must stay under this share of
/// the control's median paired difference.
pub const EQUIVALENCE_SHARE: f64 = 0.1;
/// Bootstrap resamples of the equivalence bound.
const BOOTSTRAP_RESAMPLES: usize = 2000;

/// Check 5.
pub struct PrefixCacheCheck;

/// The timing probes' own request rate: high enough that the gateway's token bucket never
/// delays a sample (a delay would be noise in the very times being compared).
const PROBE_RATE: u32 = 1000;
/// Letters of a random word (17,576 distinct words: a fresh prompt never repeats a block).
const WORD_LETTERS: usize = 3;
/// Most words a probe prompt may have. The daemon's infer route takes up to the tenant's
/// `quotas.max_request_bytes` of body, 1 MiB for a probe (the default,
/// [`crate::domain::spec::DEFAULT_MAX_REQUEST_BYTES`]); a word costs four bytes (three
/// letters and a space), and 64 KiB are left for the JSON around the prompt.
pub const MAX_PREFIX_WORDS: usize = 240_000;
const _: () = assert!(
    MAX_PREFIX_WORDS * 4 + 64 * 1024 <= crate::domain::spec::DEFAULT_MAX_REQUEST_BYTES as usize,
    "a probe prompt must fit a probe tenant's request limit"
);
/// Least guest memory of the control probe, MiB. Its payload's prefix cache fills its
/// 64 MiB budget within one run of long prompts, and the cache's heap use is about twice the
/// bytes it charges itself (one small allocation per cached token): in a 256 MiB guest the
/// payload died part-way through 80 samples of 20,000 words.
pub const CONTROL_MEMORY_MIB: u32 = 512;
/// How long one sample may wait out a rate refusal.
const PACE_WITHIN: std::time::Duration = std::time::Duration::from_secs(30);

/// The times of one run of the procedure, ms.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ArmTimes {
    /// Attacker times after the victim sent the same prefix.
    pub hit: Vec<f64>,
    /// Attacker times for fresh prompts.
    pub miss: Vec<f64>,
    /// Within-pair differences, miss minus hit, ms, one per pair of the order.
    pub pairs: Vec<f64>,
}

/// `n` random three-letter words (17,576 distinct: a fresh prompt never repeats a block).
pub(super) fn random_words(rng: &mut impl Rng, n: usize) -> Vec<String> {
    (0..n)
        .map(|_| {
            (0..WORD_LETTERS)
                .map(|_| char::from(b'a' + rng.random_range(0..26u8)))
                .collect()
        })
        .collect()
}

/// Runs the procedure in `order` (pairs, as [`paired_order`] makes them) with prompts of `words` random words, drawing them from
/// `seed`: `victim` primes, `attacker` is timed (each returns the request's time in ms).
pub fn measure(
    order: &[Arm],
    words: usize,
    seed: u64,
    mut victim: impl FnMut(&str) -> Result<f64, HostError>,
    mut attacker: impl FnMut(&str) -> Result<f64, HostError>,
) -> Result<ArmTimes, HostError> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let words = words.max(2);
    let keep = ((words as f64) * PREFIX_FRACTION).round() as usize;
    let mut out = ArmTimes::default();
    let mut times = Vec::with_capacity(order.len());
    for arm in order {
        let primed = random_words(&mut rng, words);
        victim(&primed.join(" "))?;
        let probe = match arm {
            Arm::Hit => {
                let mut p = primed[..keep].to_vec();
                p.extend(random_words(&mut rng, words - keep));
                p
            }
            Arm::Miss => random_words(&mut rng, words),
        };
        let t = attacker(&probe.join(" "))?;
        times.push(t);
        match arm {
            Arm::Hit => out.hit.push(t),
            Arm::Miss => out.miss.push(t),
        }
    }
    out.pairs = paired_differences(order, &times);
    Ok(out)
}

fn record(out: &mut Outcome, prefix: &str, r: &KsResult) {
    out.add(&format!("{prefix}.ks_statistic"), r.statistic, "D+");
    out.add(&format!("{prefix}.p_value"), r.p_value, "p");
    out.add(&format!("{prefix}.median_diff_ms"), r.median_diff_ms, "ms");
    out.add(&format!("{prefix}.median_hit_ms"), r.median_hit_ms, "ms");
    out.add(&format!("{prefix}.median_miss_ms"), r.median_miss_ms, "ms");
    out.add(
        &format!("{prefix}.hits_below_fastest_miss"),
        r.hits_below_fastest_miss,
        "fraction",
    );
    out.add(
        &format!("{prefix}.samples_per_arm"),
        r.n_hit as f64,
        "count",
    );
}

/// The median within-pair difference (miss minus hit), ms; `NaN` without pairs.
fn paired_effect(times: &ArmTimes) -> f64 {
    if times.pairs.is_empty() {
        return f64::NAN;
    }
    median(&times.pairs)
}

/// The decision from the control's and the test's results at level `alpha`.
pub fn decide(control: &ArmTimes, test: &ArmTimes, alpha: f64) -> Outcome {
    let mut out = Outcome::new(Verdict::Inconclusive);
    out.add("alpha", alpha, "p");
    let (Some(c), Some(t)) = (
        ks_greater(&control.hit, &control.miss),
        ks_greater(&test.hit, &test.miss),
    ) else {
        return out.finding("no samples: nothing to test");
    };
    record(&mut out, "control", &c);
    record(&mut out, "test", &t);
    let effect = paired_effect(control);
    out.add("control.paired_median_diff_ms", effect, "ms");
    out.add("test.paired_median_diff_ms", paired_effect(test), "ms");
    if c.p_value >= alpha || effect.is_nan() || effect <= 0.0 {
        out.findings.push(format!(
            "the positive control did not detect its own prefix cache (p = {:.3e}, median paired difference {effect:.2} ms): the probe lacks power (longer prompts, more samples, a slower model) or the control payload's cache is off",
            c.p_value
        ));
        return out;
    }
    if t.p_value < alpha {
        out.verdict = Verdict::Fail;
        out.findings.push(format!(
            "another tenant's prompts make this tenant's repeats faster (p = {:.3e}, median {:.2} ms faster, {:.0} % of hits faster than the fastest miss): a prefix cache is shared across tenants",
            t.p_value,
            t.median_diff_ms,
            t.hits_below_fastest_miss * 100.0
        ));
        return out;
    }
    let bound = effect * EQUIVALENCE_SHARE;
    let upper = median_upper_bound(&test.pairs, 0.95, BOOTSTRAP_RESAMPLES, 0x5eed);
    out.add("test.median_diff_upper95_ms", upper, "ms");
    // For comparison only: the same bound without pairing (the arms' medians), which host
    // load drift widens.
    out.add(
        "test.unpaired_median_diff_upper95_ms",
        median_diff_upper_bound(&test.hit, &test.miss, 0.95, BOOTSTRAP_RESAMPLES, 0x5eed),
        "ms",
    );
    out.add("equivalence_bound_ms", bound, "ms");
    if upper.is_nan() || upper >= bound {
        out.findings.push(format!(
            "no significant difference across tenants, but the 95 % upper bound of its median paired difference, {upper:.2} ms, is not under a tenth of the control's {effect:.2} ms: rerun with more samples or longer prompts (--prefix-words) on a quieter host"
        ));
        return out;
    }
    out.verdict = Verdict::Pass;
    out.findings.push(format!(
        "the control detected its own cache (p = {:.3e}, median paired difference {effect:.2} ms); across tenants p = {:.3}, median paired difference {:.2} ms, 95 % upper bound {upper:.2} ms < {bound:.2} ms",
        c.p_value, t.p_value, paired_effect(test)
    ));
    out
}

impl Check for PrefixCacheCheck {
    fn id(&self) -> CheckId {
        CheckId::PrefixCache
    }

    fn run(&self, ctx: &Ctx<'_>) -> Result<Outcome, HostError> {
        let cfg = ctx.config;
        let control_image = cfg
            .control_image
            .clone()
            .or_else(|| cfg.probe_image.clone());
        let control = ctx.probes.create("ctl", |s| {
            s.image.name.clone_from(&control_image);
            s.quotas.requests_per_s = PROBE_RATE;
            s.memory_mib = s.memory_mib.max(CONTROL_MEMORY_MIB);
        })?;
        // The engine itself says what it is; the n-gram server also whether its cache is on.
        // A real engine's cache is shown by the control's own timing, or not at all.
        let engine = ctx.host.engine(&control.name)?;
        match &engine {
            Engine::Ngram(v) if v["prefix_cache"]["enabled"].as_bool() != Some(true) => {
                return Ok(Outcome::inconclusive(format!(
                    "the control probe's payload has its prefix cache off: give --control-image with an image whose payload runs with --prefix-cache on (image {:?})",
                    control_image.unwrap_or_default()
                )));
            }
            Engine::None => {
                return Ok(Outcome::inconclusive(format!(
                    "the control probe runs no inference engine (image {:?} has no guest agent): give an image with one",
                    control_image.unwrap_or_default()
                )));
            }
            _ => {}
        }
        // The control: one engine with its cache on, called by two principals of its
        // tenant (two inference keys at the front door), as two tenants sharing an engine
        // would be.
        let shared = callers(ctx.host, &control.name, &control.token, 2)?;
        let door = shared[0].door;
        let time = |c: &ProbeCaller, prompt: &str| -> Result<f64, HostError> {
            let body = serde_json::json!({"prompt": prompt, "max_tokens": 1, "temperature": 0.0});
            Ok(ctx
                .host
                .completion_paced(&c.name, c.caller(), &body, PACE_WITHIN)?
                .elapsed
                .as_secs_f64()
                * 1e3)
        };
        let order = paired_order(cfg.samples_per_arm, ctx.seed);
        let c = measure(
            &order,
            cfg.prefix_words,
            ctx.seed ^ 0xc0,
            |p| time(&shared[0], p),
            |p| time(&shared[1], p),
        )?;
        // The test: another tenant primes, the attacker is timed. When the control runs the
        // probe image its engine is the victim (its cache is on: the control just showed
        // it), which saves a probe's boot; otherwise a probe of the probe image primes.
        let (_kept, victim) = if control_image == cfg.probe_image {
            (Some(control), shared[0].clone())
        } else {
            drop(control);
            let v = ctx
                .probes
                .create("victim", |s| s.quotas.requests_per_s = PROBE_RATE)?;
            let caller = callers(ctx.host, &v.name, &v.token, 1)?.remove(0);
            (Some(v), caller)
        };
        // The guard keeps the probe alive until the check returns.
        let attacker_probe = ctx
            .probes
            .create("attacker", |s| s.quotas.requests_per_s = PROBE_RATE)?;
        let attacker = callers(ctx.host, &attacker_probe.name, &attacker_probe.token, 1)?.remove(0);
        let order = paired_order(cfg.samples_per_arm, ctx.seed.rotate_left(17));
        let t = measure(
            &order,
            cfg.prefix_words,
            ctx.seed ^ 0x7e,
            |p| time(&victim, p),
            |p| time(&attacker, p),
        )?;
        let mut out = decide(&c, &t, cfg.alpha);
        // The seed itself is in the report (exact; a measure is a float).
        out.add("prefix_words", cfg.prefix_words as f64, "count");
        out.add(
            "timed_through_front_door",
            f64::from(u8::from(door == Door::FrontDoor)),
            "bool",
        );
        out.findings.push(format!(
            "engine: {}; timed {}",
            super::batching::engine_name(&engine),
            door.describe()
        ));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::sync::Mutex;

    /// A fake inference server, named as such: a prompt whose first 90 % of words was sent
    /// before (to this server, or to the one sharing its cache) answers in `hit_ms`, others
    /// in `miss_ms`, plus noise.
    struct FakeServer {
        seen: Mutex<HashSet<String>>,
        hit_ms: f64,
        miss_ms: f64,
        noise_ms: f64,
        rng: Mutex<rand::rngs::StdRng>,
    }

    impl FakeServer {
        fn new(hit_ms: f64, miss_ms: f64, noise_ms: f64, seed: u64) -> FakeServer {
            FakeServer {
                seen: Mutex::default(),
                hit_ms,
                miss_ms,
                noise_ms,
                rng: Mutex::new(rand::rngs::StdRng::seed_from_u64(seed)),
            }
        }

        fn send(&self, prompt: &str) -> Result<f64, HostError> {
            let words: Vec<&str> = prompt.split(' ').collect();
            let key = words[..words.len() * 9 / 10].join(" ");
            let hit = !self.seen.lock().unwrap().insert(key);
            let noise = self.rng.lock().unwrap().random::<f64>() * self.noise_ms;
            Ok(if hit { self.hit_ms } else { self.miss_ms } + noise)
        }
    }

    fn run(shared: bool, control_cache: bool) -> Outcome {
        let n = 60;
        let control = FakeServer::new(if control_cache { 10.0 } else { 100.0 }, 100.0, 30.0, 1);
        let c = measure(
            &paired_order(n, 1),
            100,
            2,
            |p| control.send(p),
            |p| control.send(p),
        )
        .unwrap();
        let victim = FakeServer::new(10.0, 100.0, 30.0, 3);
        let attacker = FakeServer::new(10.0, 100.0, 30.0, 4);
        let t = measure(
            &paired_order(n, 5),
            100,
            6,
            |p| victim.send(p),
            |p| {
                if shared {
                    victim.send(p)
                } else {
                    attacker.send(p)
                }
            },
        )
        .unwrap();
        decide(&c, &t, 1e-3)
    }

    #[test]
    fn a_cache_shared_across_tenants_fails() {
        let o = run(true, true);
        assert_eq!(o.verdict, Verdict::Fail, "{o:?}");
        assert!(o.value("test.p_value").unwrap() < 1e-3);
        assert!(o.value("test.median_diff_ms").unwrap() > 50.0);
    }

    #[test]
    fn isolated_tenants_pass_when_the_control_detects() {
        let o = run(false, true);
        assert_eq!(o.verdict, Verdict::Pass, "{o:?}");
        assert!(o.value("control.p_value").unwrap() < 1e-3);
    }

    #[test]
    fn isolated_tenants_pass_through_host_load_drift() {
        // Every request is 0.5 ms slower than the one before (load rising on the host):
        // 240 requests per phase drift by 120 ms. The pairs cancel it.
        let n = 60;
        let clock = std::cell::Cell::new(0.0);
        let drift = |t: f64| {
            clock.set(clock.get() + 0.5);
            t + clock.get()
        };
        let control = FakeServer::new(10.0, 100.0, 4.0, 1);
        let c = measure(
            &paired_order(n, 1),
            100,
            2,
            |p| control.send(p).map(drift),
            |p| control.send(p).map(drift),
        )
        .unwrap();
        clock.set(0.0);
        let victim = FakeServer::new(10.0, 100.0, 4.0, 3);
        let attacker = FakeServer::new(10.0, 100.0, 4.0, 4);
        let t = measure(
            &paired_order(n, 5),
            100,
            6,
            |p| victim.send(p).map(drift),
            |p| attacker.send(p).map(drift),
        )
        .unwrap();
        let o = decide(&c, &t, 1e-3);
        assert_eq!(o.verdict, Verdict::Pass, "{o:?}");
        // Unpaired, the drift alone would have kept the bound above a tenth of the control.
        let unpaired = median_diff_upper_bound(&t.hit, &t.miss, 0.95, 2000, 1);
        assert!(
            unpaired > o.value("equivalence_bound_ms").unwrap(),
            "{unpaired} {o:?}"
        );
    }

    #[test]
    fn a_control_that_detects_nothing_is_inconclusive_never_pass() {
        let o = run(false, false);
        assert_eq!(o.verdict, Verdict::Inconclusive, "{o:?}");
        // Even a shared cache is not judged without a working control.
        assert_eq!(run(true, false).verdict, Verdict::Inconclusive);
    }

    #[test]
    fn too_noisy_to_bound_the_difference_is_inconclusive() {
        let control = ArmTimes {
            hit: (0..40).map(|i| 10.0 + f64::from(i % 5)).collect(),
            miss: (0..40).map(|i| 100.0 + f64::from(i % 5)).collect(),
            pairs: vec![90.0; 40],
        };
        // No shift, but spread over 300 ms with 20 samples: the bound cannot be small.
        let spread = |k: u32| {
            (0..20)
                .map(|i| f64::from((i * 37 + k) % 300))
                .collect::<Vec<_>>()
        };
        let (hit, miss) = (spread(11), spread(5));
        // Their pairs' differences spread from -150 to +150 ms.
        let pairs = (0..20).map(|i| f64::from((i * 37) % 300) - 150.0).collect();
        let test = ArmTimes { hit, miss, pairs };
        let o = decide(&control, &test, 1e-3);
        assert_eq!(o.verdict, Verdict::Inconclusive, "{o:?}");
        assert!(
            o.value("test.median_diff_upper95_ms").unwrap() > 9.0,
            "{o:?}"
        );
    }

    #[test]
    fn hits_share_the_prefix_and_misses_do_not() {
        let mut primed = Vec::new();
        let mut probes = Vec::new();
        let order = [Arm::Hit, Arm::Miss];
        measure(
            &order,
            40,
            9,
            |p| {
                primed.push(p.to_string());
                Ok(0.0)
            },
            |p| {
                probes.push(p.to_string());
                Ok(0.0)
            },
        )
        .unwrap();
        let prefix = |s: &str, n: usize| s.split(' ').take(n).collect::<Vec<_>>().join(" ");
        assert_eq!(prefix(&primed[0], 38), prefix(&probes[0], 38));
        assert_ne!(primed[0], probes[0]);
        assert_ne!(prefix(&primed[1], 38), prefix(&probes[1], 38));
        assert_eq!(probes[1].split(' ').count(), 40);
    }
}
