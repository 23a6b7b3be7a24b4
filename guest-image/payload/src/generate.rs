//! Generation, one token at a time: backoff over the n-gram contexts, sampling (greedy at
//! temperature 0; otherwise temperature, nucleus `top_p`, presence and frequency
//! penalties), each step seeded by the request's seed and the context state (so the same
//! prompt, seed and parameters give the same completion), and stop sequences that are cut
//! from the text even when they span tokens.

use std::collections::HashMap;

use crate::model::{is_punctuation, IndexedModel};
use crate::prefill::{absorb, mix};

/// How to choose among continuations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy; up to 2.
    pub temperature: f64,
    /// Nucleus: keep the most likely continuations whose probabilities sum to `top_p`.
    pub top_p: f64,
    /// Seed of the sampler.
    pub seed: u64,
    /// Subtracted from a word's logit once it has been generated.
    pub presence_penalty: f64,
    /// Subtracted from a word's logit per time it has been generated.
    pub frequency_penalty: f64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            seed: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

/// Generates from one prompt, token by token.
pub struct Generator<'m> {
    model: &'m IndexedModel,
    params: SamplingParams,
    rounds: u32,
    /// Known-word ids of the prompt and output so far (only the last order-1 are used).
    history: Vec<u32>,
    /// How often each word has been generated, for the penalties.
    generated: HashMap<u32, u32>,
    /// The context state (see `prefill`), advanced by each generated token.
    state: u64,
}

impl<'m> Generator<'m> {
    /// Starts after `prompt_tokens`, whose prefill left `state`. Each generated token costs
    /// `rounds` mixing rounds, like one prompt token.
    pub fn new(
        model: &'m IndexedModel,
        prompt_tokens: &[String],
        state: u64,
        rounds: u32,
        params: SamplingParams,
    ) -> Self {
        let keep = model.order().saturating_sub(1);
        let known: Vec<u32> = prompt_tokens
            .iter()
            .filter_map(|t| model.token_id(t))
            .collect();
        let history = known[known.len().saturating_sub(keep)..].to_vec();
        Self {
            model,
            params,
            rounds,
            history,
            generated: HashMap::new(),
            state,
        }
    }

    /// The next word's id, or `None` when no context continues (end of text).
    pub fn next_token(&mut self) -> Option<u32> {
        let cands = self.model.continuations(&self.history)?;
        let draw = mix(self.params.seed ^ self.state);
        let id = self.pick(cands, draw);
        self.state = absorb(self.state, self.model.word(id), self.rounds);
        *self.generated.entry(id).or_default() += 1;
        self.history.push(id);
        let keep = self.model.order().saturating_sub(1);
        if self.history.len() > keep {
            self.history.drain(..self.history.len() - keep);
        }
        Some(id)
    }

    /// The text a word adds to the output: punctuation as is, a word after a space.
    pub fn piece(&self, id: u32) -> String {
        let w = self.model.word(id);
        if is_punctuation(w) {
            w.to_string()
        } else {
            format!(" {w}")
        }
    }

    fn logit(&self, id: u32, count: u32) -> f64 {
        let seen = self.generated.get(&id).copied().unwrap_or(0);
        let mut l = f64::from(count).ln();
        if seen > 0 {
            l -= self.params.presence_penalty + self.params.frequency_penalty * f64::from(seen);
        }
        l
    }

    fn pick(&self, cands: &[(u32, u32)], draw: u64) -> u32 {
        let logits: Vec<f64> = cands.iter().map(|&(id, n)| self.logit(id, n)).collect();
        if self.params.temperature <= 0.0 {
            // Greedy: highest logit, lowest id on ties (candidates are sorted by id).
            let mut best = 0;
            for (i, l) in logits.iter().enumerate() {
                if *l > logits[best] {
                    best = i;
                }
            }
            return cands[best].0;
        }
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut weighted: Vec<(f64, u32)> = logits
            .iter()
            .zip(cands)
            .map(|(l, &(id, _))| (((l - max) / self.params.temperature).exp(), id))
            .collect();
        if self.params.top_p < 1.0 {
            weighted.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let total: f64 = weighted.iter().map(|w| w.0).sum();
            let mut sum = 0.0;
            let mut keep = 0;
            for w in &weighted {
                keep += 1;
                sum += w.0;
                if sum >= self.params.top_p * total {
                    break;
                }
            }
            weighted.truncate(keep.max(1));
        }
        let total: f64 = weighted.iter().map(|w| w.0).sum();
        let mut x = (draw >> 11) as f64 / (1u64 << 53) as f64 * total;
        for &(w, id) in &weighted {
            if x < w {
                return id;
            }
            x -= w;
        }
        weighted[weighted.len() - 1].1
    }
}

/// Holds back output that might begin a stop sequence, and cuts the text at the first one.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

impl StopMatcher {
    /// Stops at any of `stops` (non-empty strings).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            pending: String::new(),
        }
    }

    /// Adds generated text; returns what may be shown now and whether a stop sequence was
    /// met (then the text before it is all that remains to show).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.pending.push_str(piece);
        let first_stop = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = first_stop {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Keep the longest tail that is the start of some stop sequence.
        let keep = self
            .pending
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.pending[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .map_or(0, |i| self.pending.len() - i);
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// Generation ended without a stop sequence: the held-back text.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{tokenize, NgramModel};
    use crate::prefill::Prefiller;

    const TEXT: &str = "The cat sat on the mat. The cat ate the fish. The dog sat on the log.";

    fn model(order: usize) -> IndexedModel {
        IndexedModel::new(NgramModel::train(TEXT, order).unwrap()).unwrap()
    }

    fn complete(m: &IndexedModel, prompt: &str, n: usize, params: SamplingParams) -> String {
        let tokens = tokenize(prompt);
        let state = Prefiller::new(4, None).prefill(1, &tokens).state;
        let mut g = Generator::new(m, &tokens, state, 4, params);
        let mut text = String::new();
        for _ in 0..n {
            let Some(id) = g.next_token() else { break };
            text.push_str(&g.piece(id));
        }
        text
    }

    fn greedy() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn greedy_completion_follows_the_most_frequent_path() {
        let m = model(3);
        assert_eq!(complete(&m, "the dog sat on", 3, greedy()), " the log.");
    }

    #[test]
    fn sampling_depends_on_the_seed_and_is_reproducible() {
        let m = model(2);
        let p = |seed| SamplingParams {
            seed,
            ..SamplingParams::default()
        };
        let a = complete(&m, "the", 30, p(1));
        assert_eq!(a, complete(&m, "the", 30, p(1)));
        assert!((2..20).any(|s| complete(&m, "the", 30, p(s)) != a));
    }

    #[test]
    fn sampling_depends_on_the_whole_prompt_through_the_context_state() {
        // Same last words, different earlier words: the n-gram context is the same, the
        // context state is not, so sampled continuations differ for some seed.
        let m = model(2);
        let p = |seed| SamplingParams {
            seed,
            ..SamplingParams::default()
        };
        assert!(
            (0..20).any(|s| complete(&m, "cat the", 20, p(s)) != complete(&m, "dog the", 20, p(s)))
        );
    }

    #[test]
    fn a_small_top_p_keeps_only_the_most_likely_word() {
        let m = model(2);
        // After "the": cat (2), mat, fish, dog, log (1 each). top_p 0.1 leaves "cat".
        let params = SamplingParams {
            top_p: 0.1,
            ..SamplingParams::default()
        };
        for seed in 0..10 {
            let text = complete(&m, "the", 1, SamplingParams { seed, ..params });
            assert_eq!(text, " cat");
        }
    }

    #[test]
    fn penalties_steer_greedy_decoding_away_from_repeats() {
        let m = model(2);
        let plain = complete(&m, "the", 12, greedy());
        let penalised = complete(
            &m,
            "the",
            12,
            SamplingParams {
                frequency_penalty: 2.0,
                presence_penalty: 2.0,
                ..greedy()
            },
        );
        assert_ne!(plain, penalised);
    }

    #[test]
    fn stop_sequences_are_cut_even_across_pieces() {
        let mut s = StopMatcher::new(vec!["the log".into()]);
        // A trailing "t" could start "the log": held back until it cannot.
        assert_eq!(s.push(" sat"), (" sa".into(), false));
        assert_eq!(s.push(" on"), ("t on".into(), false));
        // " the" could start "the log": held back.
        assert_eq!(s.push(" the"), (" ".into(), false));
        assert_eq!(s.push(" log"), (String::new(), true));

        let mut s = StopMatcher::new(vec!["the log".into()]);
        s.push(" the");
        assert_eq!(s.push(" mat"), ("the ma".into(), false));
        assert_eq!(s.finish(), "t");

        let mut s = StopMatcher::new(vec![]);
        assert_eq!(s.push(" x"), (" x".into(), false));

        let mut s = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(s.push("aé"), ("a".into(), false));
        assert_eq!(s.finish(), "é");
    }
}
