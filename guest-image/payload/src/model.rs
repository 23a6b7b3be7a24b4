//! A word-level n-gram language model: trained by counting, stored as JSON, indexed once at
//! load for generation ([`IndexedModel`]; sampling lives in `generate`). Deterministic: the
//! same corpus gives the same model file.

use std::collections::{BTreeMap, HashMap};

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

/// Is `token` sentence punctuation (written without a space before it)?
pub fn is_punctuation(token: &str) -> bool {
    token.len() == 1 && ".,;:!?".contains(token)
}

/// Joins tokens back into text (no space before punctuation).
pub fn detokenize(tokens: &[&str]) -> String {
    let mut s = String::new();
    for t in tokens {
        if !s.is_empty() && !is_punctuation(t) {
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

    /// Checks a loaded model's ids and shape: everything generation relies on.
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
            if c.next.iter().any(|&(_, count)| count == 0) {
                return Err(NgramModelError::Corrupt("continuation with a zero count"));
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
        if self.vocab.iter().any(|w| w.is_empty()) {
            return Err(NgramModelError::Corrupt("empty word in the vocabulary"));
        }
        if self.vocab.windows(2).any(|w| w[0] >= w[1]) {
            return Err(NgramModelError::Corrupt(
                "vocabulary not sorted or has duplicates",
            ));
        }
        Ok(())
    }
}

/// A validated model with its contexts indexed for generation; built once per load.
#[derive(Debug)]
pub struct IndexedModel {
    model: NgramModel,
    /// Context token ids -> position in `model.contexts`.
    by_context: HashMap<Vec<u32>, usize>,
}

impl IndexedModel {
    /// Validates `model` and indexes it.
    pub fn new(model: NgramModel) -> Result<Self, NgramModelError> {
        model.validate()?;
        let mut by_context = HashMap::with_capacity(model.contexts.len());
        for (i, c) in model.contexts.iter().enumerate() {
            if by_context.insert(c.context.clone(), i).is_some() {
                return Err(NgramModelError::Corrupt("the same context appears twice"));
            }
        }
        Ok(Self { model, by_context })
    }

    /// The model as stored.
    pub fn model(&self) -> &NgramModel {
        &self.model
    }

    /// Longest n-gram counted.
    pub fn order(&self) -> usize {
        self.model.order
    }

    /// The id of a vocabulary word, if known.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.model
            .vocab
            .binary_search_by(|w| w.as_str().cmp(token))
            .ok()
            .map(|i| i as u32)
    }

    /// The word with id `id` (ids come from this model's continuations).
    pub fn word(&self, id: u32) -> &str {
        &self.model.vocab[id as usize]
    }

    /// The continuations (id, count) of the longest suffix of `history` (at most
    /// order - 1 ids) that the model has seen, backing off to shorter contexts.
    pub fn continuations(&self, history: &[u32]) -> Option<&[(u32, u32)]> {
        let longest = (self.model.order - 1).min(history.len());
        (0..=longest).rev().find_map(|k| {
            self.by_context
                .get(&history[history.len() - k..])
                .map(|&i| self.model.contexts[i].next.as_slice())
        })
    }
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
        assert!(is_punctuation(".") && !is_punctuation("cat"));
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
    fn index_backs_off_to_shorter_contexts() {
        let m = IndexedModel::new(NgramModel::train(TEXT, 3).unwrap()).unwrap();
        let id = |w: &str| m.token_id(w).unwrap();
        // "sat on" -> "the" (seen twice).
        let next = m.continuations(&[id("sat"), id("on")]).unwrap();
        assert_eq!(next, &[(id("the"), 2)]);
        // "fish log" was never seen; "log" alone was: backs off to the bigram.
        let next = m.continuations(&[id("fish"), id("log")]).unwrap();
        assert_eq!(next, &[(id("."), 1)]);
        // No history: the unigram counts.
        assert_eq!(m.continuations(&[]).unwrap().len(), m.model().vocab.len());
        assert_eq!(m.token_id("zebra"), None);
        assert_eq!(m.word(id("cat")), "cat");
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
        let mut m = NgramModel::train(TEXT, 2).unwrap();
        m.vocab.swap(0, 1);
        assert!(
            m.validate().is_err(),
            "an unsorted vocabulary breaks lookups"
        );
        let mut m = NgramModel::train(TEXT, 2).unwrap();
        m.contexts[1].next[0].1 = 0;
        assert!(m.validate().is_err());
        let mut m = NgramModel::train(TEXT, 2).unwrap();
        let dup = m.contexts[1].clone();
        m.contexts.push(dup);
        IndexedModel::new(m).unwrap_err();
    }
}
