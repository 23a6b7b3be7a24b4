//! One choice, start to end: prefill the prompt (through the prefix cache when it is on),
//! then generate token by token, handing each piece of visible text to a sink as soon as
//! it exists (a stream writes it to the client at once) and cutting at stop sequences.

use std::io;
use std::sync::atomic::Ordering;

use crate::generate::{Generator, StopMatcher};
use crate::openai::request::{Endpoint, GenerationRequest};
use crate::openai::response::FinishReason;
use crate::prefill::Prefiller;
use crate::registry::LoadedModel;
use crate::stats::Stats;

/// Receives a choice's progress.
pub trait ChoiceSink {
    /// The prompt is prefilled; the first token comes next.
    fn prefilled(&mut self) -> io::Result<()>;
    /// Visible text, in order (never empty).
    fn text(&mut self, piece: &str) -> io::Result<()>;
}

/// A sink that only keeps the answer (non-streamed responses).
pub struct Collect;

impl ChoiceSink for Collect {
    fn prefilled(&mut self) -> io::Result<()> {
        Ok(())
    }
    fn text(&mut self, _piece: &str) -> io::Result<()> {
        Ok(())
    }
}

/// A finished choice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChoiceRun {
    /// All visible text (the echoed prompt included).
    pub text: String,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Of those, prefilled from the prefix cache.
    pub cached_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Why it ended.
    pub finish: FinishReason,
}

/// The context this server runs choices in.
pub struct Engine<'a> {
    /// Prefill and its cache.
    pub prefiller: &'a Prefiller,
    /// Counters.
    pub stats: &'a Stats,
}

impl Engine<'_> {
    /// Runs one choice for `prompt` (already split into `tokens`).
    pub fn run_choice(
        &self,
        model: &LoadedModel,
        prompt: &str,
        tokens: &[String],
        req: &GenerationRequest,
        sink: &mut dyn ChoiceSink,
    ) -> io::Result<ChoiceRun> {
        let prefill = self.prefiller.prefill(model.load_id, tokens);
        sink.prefilled()?;
        let mut text = String::new();
        let mut emit = |piece: &str, sink: &mut dyn ChoiceSink| -> io::Result<()> {
            if piece.is_empty() {
                return Ok(());
            }
            text.push_str(piece);
            sink.text(piece)
        };
        if req.echo {
            emit(prompt, sink)?;
        }
        let mut generator = Generator::new(
            &model.model,
            tokens,
            prefill.state,
            self.prefiller.rounds(),
            req.sampling,
        );
        let mut stop = StopMatcher::new(req.stop.clone());
        let mut generated = 0;
        let mut finish = FinishReason::Length;
        let mut stopped = false;
        while generated < req.max_tokens {
            let Some(id) = generator.next_token() else {
                finish = FinishReason::Stop;
                break;
            };
            generated += 1;
            self.stats.decode_tokens.fetch_add(1, Ordering::Relaxed);
            let mut piece = generator.piece(id);
            if req.endpoint == Endpoint::Chat && generated == 1 && piece.starts_with(' ') {
                // A chat reply does not start with the space that separates words.
                piece.remove(0);
            }
            let (visible, hit) = stop.push(&piece);
            emit(&visible, sink)?;
            if hit {
                finish = FinishReason::Stop;
                stopped = true;
                break;
            }
        }
        if !stopped {
            emit(&stop.finish(), sink)?;
        }
        Ok(ChoiceRun {
            text,
            prompt_tokens: tokens.len(),
            cached_tokens: prefill.cached_tokens,
            completion_tokens: generated,
            finish,
        })
    }
}
