//! A word-level n-gram language model: trained by counting, generated from with backoff
//! to shorter contexts and seeded sampling (or greedy decoding at temperature 0).
//! Deterministic: the same corpus gives the same model file, and the same prompt, seed
//! and temperature give the same completion.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Why a model could not be built, loaded or used.
#[derive(Debug, Error)]
pub enum NgramModelError {
    /// Order outside 1..=6.
    #[error("N-gram order {0} is out of range; use 1 to 6")]
    BadOrder(usize),
    /// The corpus has no tokens.
    #[error("The training corpus contains no words")]
    EmptyCorpus,
    /// The model file is inconsistent.
    #[error("The model file is inconsistent: {0}")]
    Corrupt(&'static str),
}

/// Splits text into lowercase words and sentence punctuation.
pub fn tokenize(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    for c in text.chars() {
        if c.is_alphanumeric() || (c == '\'' && !word.is_empty()) {
            word.extend(c.to_lowercase());
            continue;
        }
        if !word.is_empty() {
            out.push(std::mem::take(&mut word).trim_end_matches('\'').to_string());
        }
        if ".,;:!?".contains(c) {
            out.push(c.to_string());
        }
    }
    if !word.is_empty() {
        out.push(word.trim_end_matches('\'').to_string());
    }
    out
}

/// Joins tokens back into text (no space before punctuation).
pub fn detokenize(tokens: &[&str]) -> String {
    let mut s = String::new();
    for t in tokens {
        let punct = t.len() == 1 && ".,;:!?".contains(*t);
        if !s.is_empty() && !punct {
            s.push(' ');
        }
        s.push_str(t);
    }
    s
}

/// One context and the counts of the tokens seen after it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContextCounts {
    /// Token ids of the context (0 to order-1 of them).
    pub context: Vec<u32>,
    /// (next token id, count), sorted by id.
    pub next: Vec<(u32, u32)>,
}

/// The trained model, as stored on disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NgramModel {
    /// Longest n-gram counted.
    pub order: usize,
    /// Token strings by id (sorted).
    pub vocab: Vec<String>,
    /// Every context seen, sorted.
    pub contexts: Vec<ContextCounts>,
}

/// A small deterministic PRNG (SplitMix64).
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// No continuation known for any context.
    Stop,
}

/// A generated continuation.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// The text.
    pub text: String,
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Why it stopped.
    pub finish: FinishReason,
}

impl NgramModel {
    /// Counts all n-grams up to `order` in `text`.
    pub fn train(text: &str, order: usize) -> Result<Self, NgramModelError> {
        if !(1..=6).contains(&order) {
            return Err(NgramModelError::BadOrder(order));
        }
        let tokens = tokenize(text);
        if tokens.is_empty() {
            return Err(NgramModelError::EmptyCorpus);
        }
        let vocab: Vec<String> = {
            let mut v = tokens.clone();
            v.sort();
            v.dedup();
            v
        };
        let id_of: BTreeMap<&str, u32> = vocab
            .iter()
            .enumerate()
            .map(|(i, w)| (w.as_str(), i as u32))
            .collect();
        let ids: Vec<u32> = tokens.iter().map(|t| id_of[t.as_str()]).collect();
        let mut table: BTreeMap<Vec<u32>, BTreeMap<u32, u32>> = BTreeMap::new();
        for i in 0..ids.len() {
            for ctx_len in 0..order.min(i + 1) {
                let ctx = ids[i - ctx_len..i].to_vec();
                *table.entry(ctx).or_default().entry(ids[i]).or_default() += 1;
            }
        }
        let contexts = table
            .into_iter()
            .map(|(context, next)| ContextCounts {
                context,
                next: next.into_iter().collect(),
            })
            .collect();
        Ok(Self {
            order,
            vocab,
            contexts,
        })
    }

    /// Checks a loaded model's ids and shape.
    pub fn validate(&self) -> Result<(), NgramModelError> {
        if !(1..=6).contains(&self.order) {
            return Err(NgramModelError::BadOrder(self.order));
        }
        let n = self.vocab.len() as u32;
        for c in &self.contexts {
            if c.context.len() >= self.order {
                return Err(NgramModelError::Corrupt("context longer than order - 1"));
            }
            if c.next.is_empty() {
                return Err(NgramModelError::Corrupt("context with no continuations"));
            }
            if c.context
                .iter()
                .chain(c.next.iter().map(|(t, _)| t))
                .any(|t| *t >= n)
            {
                return Err(NgramModelError::Corrupt("token id outside the vocabulary"));
            }
        }
        if !self.contexts.iter().any(|c| c.context.is_empty()) {
            return Err(NgramModelError::Corrupt("no unigram counts"));
        }
        Ok(())
    }

    /// An index from context to continuations, for generation.
    pub fn index(&self) -> BTreeMap<&[u32], &[(u32, u32)]> {
        self.contexts
            .iter()
            .map(|c| (c.context.as_slice(), c.next.as_slice()))
            .collect()
    }

    /// Continues `prompt` by up to `max_tokens` tokens. `temperature` 0 is greedy.
    pub fn complete(
        &self,
        index: &BTreeMap<&[u32], &[(u32, u32)]>,
        prompt: &str,
        max_tokens: usize,
        temperature: f64,
        seed: u64,
    ) -> Completion {
        let prompt_tokens = tokenize(prompt);
        let mut history: Vec<u32> = prompt_tokens
            .iter()
            .filter_map(|t| self.vocab.binary_search(t).ok().map(|i| i as u32))
            .collect();
        let start = history.len();
        let mut rng = SplitMix64(seed ^ 0x7465_6e61_6e74_766d);
        let mut finish = FinishReason::Length;
        for _ in 0..max_tokens {
            let longest = (self.order - 1).min(history.len());
            let next = (0..=longest).rev().find_map(|k| {
                index
                    .get(&history[history.len() - k..])
                    .filter(|c| !c.is_empty())
            });
            let Some(cands) = next else {
                finish = FinishReason::Stop;
                break;
            };
            history.push(pick(cands, temperature, &mut rng));
        }
        let words: Vec<&str> = history[start..]
            .iter()
            .map(|&i| self.vocab[i as usize].as_str())
            .collect();
        let mut text = detokenize(&words);
        if !text.is_empty() && !text.starts_with(|c: char| ".,;:!?".contains(c)) {
            text.insert(0, ' ');
        }
        Completion {
            text,
            prompt_tokens: prompt_tokens.len(),
            completion_tokens: history.len() - start,
            finish,
        }
    }
}

fn pick(cands: &[(u32, u32)], temperature: f64, rng: &mut SplitMix64) -> u32 {
    if temperature <= 0.0 {
        // Greedy: highest count, lowest id on ties.
        let mut best = cands[0];
        for &c in &cands[1..] {
            if c.1 > best.1 {
                best = c;
            }
        }
        return best.0;
    }
    let weights: Vec<f64> = cands
        .iter()
        .map(|&(_, n)| f64::from(n).powf(1.0 / temperature))
        .collect();
    let total: f64 = weights.iter().sum();
    let mut x = rng.unit() * total;
    for (c, w) in cands.iter().zip(&weights) {
        if x < *w {
            return c.0;
        }
        x -= w;
    }
    cands[cands.len() - 1].0
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "The cat sat on the mat. The cat ate the fish. The dog sat on the log.";

    #[test]
    fn tokenizer_splits_words_and_punctuation() {
        assert_eq!(
            tokenize("Hello, World! It's 4 o'clock."),
            vec!["hello", ",", "world", "!", "it's", "4", "o'clock", "."]
        );
        assert_eq!(detokenize(&["hello", ",", "world", "."]), "hello, world.");
    }

    #[test]
    fn training_is_deterministic_and_counts_ngrams() {
        let a = NgramModel::train(TEXT, 3).unwrap();
        let b = NgramModel::train(TEXT, 3).unwrap();
        assert_eq!(
            serde_json::to_string(&a).unwrap(),
            serde_json::to_string(&b).unwrap()
        );
        a.validate().unwrap();
        let the = a.vocab.binary_search(&"the".to_string()).unwrap() as u32;
        let cat = a.vocab.binary_search(&"cat".to_string()).unwrap() as u32;
        let after_the = a.contexts.iter().find(|c| c.context == vec![the]).unwrap();
        assert!(after_the.next.contains(&(cat, 2)));
    }

    #[test]
    fn greedy_completion_follows_the_most_frequent_path() {
        let m = NgramModel::train(TEXT, 3).unwrap();
        let idx = m.index();
        let c = m.complete(&idx, "the dog sat on", 3, 0.0, 0);
        assert_eq!(c.text, " the log.");
        assert_eq!(c.completion_tokens, 3);
        assert_eq!(c.finish, FinishReason::Length);
    }

    #[test]
    fn sampling_depends_on_the_seed_and_is_reproducible() {
        let m = NgramModel::train(TEXT, 2).unwrap();
        let idx = m.index();
        let a = m.complete(&idx, "the", 30, 1.0, 1);
        assert_eq!(a, m.complete(&idx, "the", 30, 1.0, 1));
        let differs = (2..20).any(|s| m.complete(&idx, "the", 30, 1.0, s).text != a.text);
        assert!(differs);
    }

    #[test]
    fn bad_orders_empty_corpora_and_corrupt_models_are_errors() {
        assert!(matches!(
            NgramModel::train(TEXT, 0),
            Err(NgramModelError::BadOrder(0))
        ));
        assert!(matches!(
            NgramModel::train("  ---  ", 2),
            Err(NgramModelError::EmptyCorpus)
        ));
        let mut m = NgramModel::train(TEXT, 2).unwrap();
        m.contexts[0].next[0].0 = 9999;
        assert!(matches!(m.validate(), Err(NgramModelError::Corrupt(_))));
        let mut m = NgramModel::train(TEXT, 2).unwrap();
        m.contexts.retain(|c| !c.context.is_empty());
        assert!(m.validate().is_err());
    }
}
