//! OpenAI's response objects: `text_completion` and `chat.completion` answers, their
//! streamed chunks (`text_completion` / `chat.completion.chunk`), usage, and server-sent
//! event framing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use super::request::Endpoint;

/// The event that ends every stream.
pub const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

/// Why a choice ended, as OpenAI names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// A stop sequence, or the model had no continuation (end of text).
    Stop,
}

impl FinishReason {
    /// OpenAI's string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Length => "length",
            Self::Stop => "stop",
        }
    }
}

/// Token counts of a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens (all prompts).
    pub prompt_tokens: usize,
    /// Of those, served from the prefix cache.
    pub cached_tokens: usize,
    /// Generated tokens (all choices).
    pub completion_tokens: usize,
}

impl Usage {
    /// OpenAI's `usage` object.
    pub fn to_json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// A finished choice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// Position in `choices`.
    pub index: usize,
    /// The text.
    pub text: String,
    /// Why it ended.
    pub finish: FinishReason,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// What every object of one response shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseMeta {
    /// `cmpl-...` or `chatcmpl-...`, unique per response.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The model's name.
    pub model: String,
    /// Which API.
    pub endpoint: Endpoint,
}

impl ResponseMeta {
    /// A fresh id and timestamp.
    pub fn new(endpoint: Endpoint, model: &str) -> Self {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let n = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let prefix = match endpoint {
            Endpoint::Completions => "cmpl",
            Endpoint::Chat => "chatcmpl",
        };
        Self {
            id: format!(
                "{prefix}-{:x}{:08x}{n:06x}",
                now.as_secs(),
                now.subsec_nanos()
            ),
            created: now.as_secs(),
            model: model.to_string(),
            endpoint,
        }
    }

    fn object(&self, object: &str, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": choices,
        })
    }

    /// The whole (non-streamed) answer.
    pub fn completion(&self, choices: &[Choice], usage: Usage) -> Value {
        let (object, choices): (&str, Vec<Value>) = match self.endpoint {
            Endpoint::Completions => (
                "text_completion",
                choices
                    .iter()
                    .map(|c| json!({"index": c.index, "text": c.text, "logprobs": null, "finish_reason": c.finish.as_str()}))
                    .collect(),
            ),
            Endpoint::Chat => (
                "chat.completion",
                choices
                    .iter()
                    .map(|c| json!({
                        "index": c.index,
                        "message": {"role": "assistant", "content": c.text, "refusal": null},
                        "logprobs": null,
                        "finish_reason": c.finish.as_str(),
                    }))
                    .collect(),
            ),
        };
        let mut v = self.object(object, Value::Array(choices));
        v["usage"] = usage.to_json();
        v
    }

    /// A streamed chunk for choice `index`: its first chunk (`first`: chat sends the role),
    /// a piece of text, or its last chunk (`finish`). With `include_usage` every chunk
    /// carries `"usage": null`, as OpenAI's do.
    pub fn chunk(
        &self,
        index: usize,
        first: bool,
        text: &str,
        finish: Option<FinishReason>,
        include_usage: bool,
    ) -> Value {
        let finish = finish.map(FinishReason::as_str);
        let (object, choice) = match self.endpoint {
            Endpoint::Completions => (
                "text_completion",
                json!({"index": index, "text": text, "logprobs": null, "finish_reason": finish}),
            ),
            Endpoint::Chat => {
                let delta = if first {
                    json!({"role": "assistant", "content": text, "refusal": null})
                } else if finish.is_some() && text.is_empty() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                (
                    "chat.completion.chunk",
                    json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": finish}),
                )
            }
        };
        let mut v = self.object(object, json!([choice]));
        if include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// The last chunk of a stream with `stream_options.include_usage`: no choices, the usage.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        let object = match self.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        };
        let mut v = self.object(object, json!([]));
        v["usage"] = usage.to_json();
        v
    }
}

/// One server-sent event carrying `value`.
pub fn sse(value: &Value) -> Vec<u8> {
    let mut out = b"data: ".to_vec();
    out.extend_from_slice(value.to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_prefixed_by_api() {
        let a = ResponseMeta::new(Endpoint::Completions, "m");
        let b = ResponseMeta::new(Endpoint::Completions, "m");
        assert_ne!(a.id, b.id);
        assert!(a.id.starts_with("cmpl-"));
        assert!(ResponseMeta::new(Endpoint::Chat, "m")
            .id
            .starts_with("chatcmpl-"));
    }

    #[test]
    fn chat_chunks_follow_openais_delta_shapes() {
        let m = ResponseMeta::new(Endpoint::Chat, "m");
        let first = m.chunk(0, true, "", None, false);
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        assert!(first.get("usage").is_none());
        let piece = m.chunk(0, false, "hi", None, true);
        assert_eq!(piece["choices"][0]["delta"], json!({"content": "hi"}));
        assert_eq!(piece["usage"], Value::Null);
        let last = m.chunk(0, false, "", Some(FinishReason::Stop), false);
        assert_eq!(last["choices"][0]["delta"], json!({}));
        assert_eq!(last["choices"][0]["finish_reason"], "stop");
        let usage = m.usage_chunk(Usage {
            prompt_tokens: 3,
            cached_tokens: 1,
            completion_tokens: 2,
        });
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["total_tokens"], 5);
        assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
        assert_eq!(sse(&json!({"a": 1})), b"data: {\"a\":1}\n\n");
    }
}
