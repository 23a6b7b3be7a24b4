//! Check 6: batching does not cross tenants. An engine batches the requests it serves
//! together (its slots, its batch) and keeps one prompt cache: what must hold is that each
//! tenant's requests reach an engine of its own. So the check reads each tenant's engine
//! itself, through that tenant's own agent (never through the daemon's routing), and
//! shows by effect that the daemon's routing gives two tenants two engines:
//!
//! - *Configuration*, read from the engine: llama-server's `GET /props` (slots, i.e. the
//!   requests it batches at once, and the context per slot); the project's n-gram server's
//!   `GET /v1/tenantvm/serving` (its instance id and scopes). Every running tenant is read
//!   (the real ones read-only). A tenant whose guest runs no agent has no engine (a plain
//!   kernel or test guest): listed, nothing to judge. An engine that none of these routes
//!   reads leaves the check inconclusive, never a pass.
//! - *Effect* (two probes A and B): a unique prompt sent as A, then the same as B, then
//!   again as a second principal of A (a second inference key at the front door). A's
//!   repeat must come back with most of its tokens cached (`cached_tokens`, the control:
//!   one engine, two callers, the situation of two tenants routed to one engine); B's
//!   engine must report nearly none (B's own engine never saw it). B with most of the
//!   prompt cached: one engine answers for both, fail. A control that sees nothing cached
//!   (an engine with its prompt cache off) cannot tell engines apart: inconclusive, unless
//!   both are the n-gram server, whose instance ids decide as before.

use std::collections::BTreeMap;

use rand::SeedableRng;
use serde_json::Value;

use crate::domain::lifecycle::LifecycleState;
use crate::verify::callers::{callers, Door, ProbeCaller};
use crate::verify::host::Engine;
use crate::verify::{Check, CheckId, Ctx, HostError, Outcome, Verdict};

/// Check 6.
pub struct BatchingCheck;

/// Words of the effect test's unique prompt (random three-letter words: about 100 tokens
/// for llama-server's test model, two seconds of prefill under QEMU TCG).
pub const EFFECT_WORDS: usize = 32;
/// How long one effect request may wait out a rate refusal.
const PACE_WITHIN: std::time::Duration = std::time::Duration::from_secs(30);

/// What the effect test saw: token counts the engines reported for one unique prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Effect {
    /// Prompt tokens, as A's engine counted them the first time.
    pub prompt_tokens: u64,
    /// Cached tokens A's engine reported for the repeat by A's second principal (the
    /// control); `None`: the answer counts none.
    pub control_cached: Option<u64>,
    /// Cached tokens B's engine reported for the same prompt; `None`: it counts none.
    pub cross_cached: Option<u64>,
    /// Which door the requests went through.
    pub front_door: bool,
}

/// One engine in words (`llama-server b11669-Debian`, `the n-gram server`, ...).
pub fn engine_name(e: &Engine) -> String {
    match e {
        Engine::None => "no engine".into(),
        Engine::LlamaServer(p) => format!(
            "llama-server {}",
            crate::untrusted::one_line(p["build_info"].as_str().unwrap_or("(build unknown)"))
        ),
        Engine::Ngram(_) => "the n-gram server".into(),
    }
}

/// Judges the n-gram servers' descriptions of themselves read from each tenant (name,
/// answer): every tenant answered by an instance of its own, scoped to its VM.
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

/// How each tenant's engine was read: the engine, or why it could not be.
pub type Reads = Vec<(String, Result<Engine, String>)>;

/// The verdict from the engines read and the effect test between probes `a` and `b`.
pub fn judge(reads: &Reads, effect: Result<Effect, String>, (a, b): (&str, &str)) -> Outcome {
    let mut fail = Vec::new();
    let mut unsure = Vec::new();
    let mut seen = Vec::new();
    let mut evidence = Outcome::new(Verdict::Pass);
    let mut ngram = Vec::new();
    let (mut engines, mut no_engine) = (0u32, 0u32);
    for (name, read) in reads {
        match read {
            Ok(Engine::None) => {
                no_engine += 1;
                seen.push(format!(
                    "{name}: no inference engine (its guest runs no agent: a plain kernel or test guest); nothing batched"
                ));
            }
            Ok(e @ Engine::LlamaServer(p)) => {
                let Some(slots) = p["total_slots"].as_u64() else {
                    unsure.push(format!(
                        "{name}: {}'s /props names no total_slots: its batching was not read",
                        engine_name(e)
                    ));
                    continue;
                };
                engines += 1;
                evidence.add(&format!("{name}.slots"), slots as f64, "count");
                let ctx = p["default_generation_settings"]["n_ctx"].as_u64();
                if let Some(n) = ctx {
                    evidence.add(&format!("{name}.n_ctx_per_slot"), n as f64, "tokens");
                }
                seen.push(format!(
                    "{name}: {}, {slots} slots (requests batched together){}; its batch and prompt cache are that engine's, in that VM",
                    engine_name(e),
                    ctx.map(|n| format!(", {n} tokens of context each")).unwrap_or_default()
                ));
            }
            Ok(Engine::Ngram(v)) => {
                engines += 1;
                ngram.push((name.clone(), v.clone()));
            }
            Err(why) => unsure.push(format!(
                "{name}: its engine could not be read, so it is not judged: {}",
                crate::untrusted::one_line(why)
            )),
        }
    }
    let by_instance = judge_serving(&ngram);
    if by_instance.verdict == Verdict::Fail {
        fail.extend(by_instance.findings.iter().cloned());
    }
    let ngram_probes = [a, b].iter().all(|p| ngram.iter().any(|(n, _)| n == p));
    match effect {
        Err(why) => unsure.push(format!(
            "the effect test between {a} and {b} could not run: {}",
            crate::untrusted::one_line(&why)
        )),
        Ok(e) => {
            evidence.add("effect.prompt_tokens", e.prompt_tokens as f64, "tokens");
            evidence.add(
                "effect.front_door",
                f64::from(u8::from(e.front_door)),
                "bool",
            );
            if let Some(c) = e.control_cached {
                evidence.add("effect.control_cached_tokens", c as f64, "tokens");
            }
            if let Some(c) = e.cross_cached {
                evidence.add("effect.cross_cached_tokens", c as f64, "tokens");
            }
            let n = e.prompt_tokens;
            let detected = n > 0 && e.control_cached.is_some_and(|c| 2 * c >= n);
            match (detected, e.cross_cached) {
                (true, Some(cross)) if 2 * cross >= n => fail.push(format!(
                    "one engine answers for {a} and {b}: {b}'s engine had {cross} of the {n} tokens of a prompt only {a} had sent cached; their requests share its batches and its prompt cache: route each tenant to its own VM"
                )),
                (true, Some(cross)) if cross <= (n / 10).max(2) => seen.push(format!(
                    "{a} and {b} reach engines of their own: a prompt {a} sent came back {} of {n} tokens cached to {a}'s second caller (the control) and {cross} to {b}",
                    e.control_cached.unwrap_or(0)
                )),
                (true, Some(cross)) => unsure.push(format!(
                    "{b}'s engine reported {cross} of {n} tokens of {a}'s prompt cached: neither none nor most; run again"
                )),
                (true, None) => unsure.push(format!(
                    "{b}'s engine counts no cached tokens in its answers: the effect test cannot read it"
                )),
                (false, _) if ngram_probes => seen.push(format!(
                    "the probes' engines counted no cached prompt tokens (control {:?} of {n}: their prompt cache is off), so their identity rests on the n-gram server's own instance ids",
                    e.control_cached
                )),
                (false, _) => unsure.push(format!(
                    "the control did not see {a}'s repeated prompt cached ({:?} of {n} tokens): an engine without a prompt cache cannot show by effect that {a} and {b} reach different engines",
                    e.control_cached
                )),
            }
        }
    }
    let mut out = Outcome::new(if !fail.is_empty() {
        Verdict::Fail
    } else if !unsure.is_empty() {
        Verdict::Inconclusive
    } else {
        Verdict::Pass
    });
    out.findings = fail;
    out.findings.extend(unsure);
    out.findings.extend(seen);
    for f in by_instance.findings {
        if !out.findings.contains(&f) {
            out.findings.push(f);
        }
    }
    out.evidence = evidence.evidence;
    if !ngram.is_empty() {
        out.evidence.extend(
            by_instance
                .evidence
                .into_iter()
                .filter(|m| m.name != "tenants_read"),
        );
    }
    out.add("tenants_read", reads.len() as f64, "count");
    out.add("engines_read", f64::from(engines), "count");
    out.add("without_engine", f64::from(no_engine), "count");
    out
}

/// A unique prompt of [`EFFECT_WORDS`] random words from `seed`.
fn unique_prompt(seed: u64) -> String {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    super::prefix::random_words(&mut rng, EFFECT_WORDS).join(" ")
}

/// The effect test: the prompt as `a[0]`, then as `b`, then as `a[1]`.
fn effect(ctx: &Ctx<'_>, a: &[ProbeCaller], b: &ProbeCaller) -> Result<Effect, HostError> {
    let body = serde_json::json!({
        "prompt": unique_prompt(ctx.seed ^ 0xba7c),
        "max_tokens": 1,
        "temperature": 0.0,
    });
    let send = |c: &ProbeCaller| {
        ctx.host
            .completion_paced(&c.name, c.caller(), &body, PACE_WITHIN)
    };
    let first = send(&a[0])?;
    let cross = send(b)?;
    let again = send(&a[1])?;
    Ok(Effect {
        prompt_tokens: first.prompt_tokens().unwrap_or(0),
        control_cached: again.cached_tokens(),
        cross_cached: cross.cached_tokens(),
        front_door: a[0].door == Door::FrontDoor,
    })
}

impl Check for BatchingCheck {
    fn id(&self) -> CheckId {
        CheckId::Batching
    }

    fn run(&self, ctx: &Ctx<'_>) -> Result<Outcome, HostError> {
        let a = ctx.probes.create("batch", |_| {})?;
        let b = ctx.probes.create("batch", |_| {})?;
        let read = |name: &str| ctx.host.engine(name).map_err(|e| e.to_string());
        let mut reads: Reads = vec![
            (a.name.clone(), read(&a.name)),
            (b.name.clone(), read(&b.name)),
        ];
        // The real tenants too, read-only (their engines' configuration; no request is
        // sent to them).
        for t in ctx.host.tenants()? {
            if t.state != LifecycleState::Running || t.name == a.name || t.name == b.name {
                continue;
            }
            let r = read(&t.name);
            reads.push((t.name, r));
        }
        let effect = callers(ctx.host, &a.name, &a.token, 2)
            .and_then(|ca| {
                let cb = callers(ctx.host, &b.name, &b.token, 1)?;
                effect(ctx, &ca, &cb[0])
            })
            .map_err(|e| e.to_string());
        Ok(judge(&reads, effect, (&a.name, &b.name)))
    }
}
