//! The one parser of client requests: a JSON body for `/v1/completions` or
//! `/v1/chat/completions` becomes a typed [`GenerationRequest`] or an [`ApiError`] naming
//! the parameter at fault, the way OpenAI answers: unknown parameters are refused,
//! parameters OpenAI knows but this model cannot honour are refused unless they carry
//! their neutral value, types and ranges are checked.

use serde_json::{Map, Value};

use super::chat;
use super::error::{type_name, wrong_type, ApiError};
use crate::generate::SamplingParams;

/// Default `max_tokens` of `/v1/completions` (OpenAI's).
pub const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;
/// Default `max_tokens` of `/v1/chat/completions` (the n-gram model rarely reaches an end
/// of text on its own, so "as long as the context allows" would always run to the limit).
pub const DEFAULT_CHAT_MAX_TOKENS: usize = 256;
/// Most prompts in one `/v1/completions` request (`prompt` as an array).
pub const MAX_PROMPTS: usize = 16;
/// Most stop sequences (OpenAI's limit).
pub const MAX_STOPS: usize = 4;

/// Which API a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

/// A validated generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    /// Which API.
    pub endpoint: Endpoint,
    /// `model`; `None` = the default model (a tenantvm extension: OpenAI requires it).
    pub model: Option<String>,
    /// One prompt per choice (chat: the rendered template).
    pub prompts: Vec<String>,
    /// Most tokens to generate per choice.
    pub max_tokens: usize,
    /// Sampling.
    pub sampling: SamplingParams,
    /// Stop sequences.
    pub stop: Vec<String>,
    /// Answer as server-sent events.
    pub stream: bool,
    /// With `stream`: a last chunk with the usage.
    pub include_usage: bool,
    /// Completions: the prompt is repeated before the completion.
    pub echo: bool,
}

/// Request limits from the server's configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// Largest `max_tokens`.
    pub max_tokens: usize,
}

/// The body's parameters, with `null` meaning absent (as OpenAI treats it).
struct Params<'a>(&'a Map<String, Value>);

impl<'a> Params<'a> {
    fn get(&self, name: &str) -> Option<&'a Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(wrong_type(name, "a boolean", v)),
        }
    }

    fn int(&self, name: &str, min: i64, max: i64) -> Result<Option<i64>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let n = match v.as_i64() {
            Some(n) => n,
            None if v.as_u64().is_some() => i64::MAX,
            None => return Err(wrong_type(name, "an integer", v)),
        };
        if n < min {
            return Err(ApiError::param(
                name,
                Some("integer_below_min_value"),
                format!("Invalid '{name}': integer below minimum value. Expected a value >= {min}, but got {n} instead."),
            ));
        }
        if n > max {
            return Err(ApiError::param(
                name,
                Some("integer_above_max_value"),
                format!("Invalid '{name}': integer above maximum value. Expected a value <= {max}, but got {n} instead."),
            ));
        }
        Ok(Some(n))
    }

    fn number(&self, name: &str, min: f64, max: f64) -> Result<Option<f64>, ApiError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let n = v.as_f64().ok_or_else(|| wrong_type(name, "a number", v))?;
        if n < min {
            return Err(ApiError::param(
                name,
                Some("decimal_below_min_value"),
                format!("Invalid '{name}': decimal below minimum value. Expected a value >= {min}, but got {n} instead."),
            ));
        }
        if n > max {
            return Err(ApiError::param(
                name,
                Some("decimal_above_max_value"),
                format!("Invalid '{name}': decimal above maximum value. Expected a value <= {max}, but got {n} instead."),
            ));
        }
        Ok(Some(n))
    }

    fn string(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(wrong_type(name, "a string", v)),
        }
    }

    /// Refuses a parameter this model cannot honour unless it has its neutral value.
    fn neutral_only(&self, name: &str, neutral: impl Fn(&Value) -> bool) -> Result<(), ApiError> {
        match self.get(name) {
            Some(v) if !neutral(v) => Err(ApiError::param(
                name,
                Some("unsupported_parameter"),
                format!("Unsupported parameter: '{name}' is not supported by this model (the tenantvm n-gram payload). Leave it out."),
            )),
            _ => Ok(()),
        }
    }
}

fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::malformed_json(&e.to_string()))?;
    match value {
        Value::Object(map) => Ok(map),
        other => Err(ApiError::invalid(format!(
            "The request body must be a JSON object, but got {} instead.",
            type_name(&other)
        ))),
    }
}

fn refuse_unknown(map: &Map<String, Value>, known: &[&str]) -> Result<(), ApiError> {
    match map.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(ApiError::param(
            k,
            Some("unknown_parameter"),
            format!("Unrecognized request argument supplied: {k}"),
        )),
        None => Ok(()),
    }
}

const COMMON: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "user",
];

const COMPLETIONS_ONLY: &[&str] = &["prompt", "echo", "suffix", "best_of"];

const CHAT_ONLY: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "store",
    "metadata",
    "service_tier",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
    "safety_identifier",
    "prompt_cache_key",
];

/// The parameters both APIs share; the token limit is read from `max_name`.
fn common(
    p: &Params,
    limits: RequestLimits,
    max_name: &str,
    default_max: usize,
    min_max: i64,
) -> Result<GenerationRequest, ApiError> {
    let model = p.string("model")?.map(str::to_string);
    let max_tokens = match p.int(max_name, min_max, i64::MAX)? {
        None => default_max.min(limits.max_tokens),
        Some(n) if n as u64 > limits.max_tokens as u64 => {
            return Err(ApiError::param(
                max_name,
                Some("integer_above_max_value"),
                format!(
                    "{max_name} is too large: {n}. This server generates at most {} tokens per \
                     choice (--max-tokens-limit).",
                    limits.max_tokens
                ),
            ))
        }
        Some(n) => n as usize,
    };
    match p.int("n", 1, 128)? {
        None | Some(1) => {}
        Some(n) => {
            return Err(ApiError::param(
                "n",
                Some("unsupported_value"),
                format!(
                    "Invalid 'n': {n}. This server generates one choice per prompt; n must be 1."
                ),
            ))
        }
    }
    let temperature = p.number("temperature", 0.0, 2.0)?.unwrap_or(1.0);
    let top_p = p.number("top_p", 0.0, 1.0)?.unwrap_or(1.0);
    let presence_penalty = p.number("presence_penalty", -2.0, 2.0)?.unwrap_or(0.0);
    let frequency_penalty = p.number("frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0);
    let seed = p.int("seed", i64::MIN, i64::MAX)?.unwrap_or(0) as u64;
    let stream = p.bool("stream")?.unwrap_or(false);
    let include_usage = match p.get("stream_options") {
        None => false,
        Some(_) if !stream => {
            return Err(ApiError::param(
                "stream_options",
                Some("invalid_value"),
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            ))
        }
        Some(Value::Object(o)) => {
            refuse_unknown(o, &["include_usage", "include_obfuscation"])?;
            Params(o).bool("include_usage")?.unwrap_or(false)
        }
        Some(v) => return Err(wrong_type("stream_options", "an object", v)),
    };
    let stop = match p.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            if a.len() > MAX_STOPS {
                return Err(ApiError::param(
                    "stop",
                    Some("array_above_max_length"),
                    format!("Invalid 'stop': array too long. Expected at most {MAX_STOPS} stop sequences, but got {}.", a.len()),
                ));
            }
            a.iter()
                .map(|s| match s {
                    Value::String(s) => Ok(s.clone()),
                    v => Err(wrong_type("stop", "a string or an array of strings", v)),
                })
                .collect::<Result<_, _>>()?
        }
        Some(v) => return Err(wrong_type("stop", "a string or an array of strings", v)),
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::param(
            "stop",
            Some("invalid_value"),
            "Invalid 'stop': stop sequences must not be empty strings.",
        ));
    }
    p.string("user")?;
    p.neutral_only("logit_bias", |v| v.as_object().is_some_and(Map::is_empty))?;
    Ok(GenerationRequest {
        endpoint: Endpoint::Completions,
        model,
        prompts: Vec::new(),
        max_tokens,
        sampling: SamplingParams {
            temperature,
            top_p,
            seed,
            presence_penalty,
            frequency_penalty,
        },
        stop,
        stream,
        include_usage,
        echo: false,
    })
}

/// Parses a `/v1/completions` body.
pub fn parse_completions(
    body: &[u8],
    limits: RequestLimits,
) -> Result<GenerationRequest, ApiError> {
    let map = parse_object(body)?;
    let known: Vec<&str> = COMMON.iter().chain(COMPLETIONS_ONLY).copied().collect();
    refuse_unknown(&map, &known)?;
    let p = Params(&map);
    let mut req = common(&p, limits, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS, 0)?;
    req.prompts = match p.get("prompt") {
        None => {
            return Err(ApiError::param(
                "prompt",
                Some("missing_required_parameter"),
                "Missing required parameter: 'prompt'.",
            ))
        }
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.is_empty() || items.len() > MAX_PROMPTS {
                return Err(ApiError::param(
                    "prompt",
                    Some("invalid_value"),
                    format!(
                        "Invalid 'prompt': send 1 to {MAX_PROMPTS} prompts, got {}.",
                        items.len()
                    ),
                ));
            }
            items
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    Value::Number(_) | Value::Array(_) => Err(ApiError::param(
                        "prompt",
                        Some("unsupported_value"),
                        "Invalid 'prompt': token ids are not supported; this model's tokenizer is word-level, so send text.",
                    )),
                    v => Err(wrong_type("prompt", "a string or an array of strings", v)),
                })
                .collect::<Result<_, _>>()?
        }
        Some(v) => return Err(wrong_type("prompt", "a string or an array of strings", v)),
    };
    req.echo = p.bool("echo")?.unwrap_or(false);
    p.neutral_only("suffix", |v| v.as_str() == Some(""))?;
    p.neutral_only("logprobs", |v| v.as_i64() == Some(0))?;
    match p.int("best_of", 1, 20)? {
        None | Some(1) => {}
        Some(_) => return Err(ApiError::param(
            "best_of",
            Some("unsupported_value"),
            "Invalid 'best_of': this server generates one choice per prompt; best_of must be 1.",
        )),
    }
    Ok(req)
}

/// Parses a `/v1/chat/completions` body; the messages become one prompt through the chat
/// template (see [`chat`]).
pub fn parse_chat(body: &[u8], limits: RequestLimits) -> Result<GenerationRequest, ApiError> {
    let map = parse_object(body)?;
    let known: Vec<&str> = COMMON.iter().chain(CHAT_ONLY).copied().collect();
    refuse_unknown(&map, &known)?;
    let p = Params(&map);
    if p.get("max_tokens").is_some() && p.get("max_completion_tokens").is_some() {
        return Err(ApiError::param(
            "max_completion_tokens",
            Some("invalid_value"),
            "Send either 'max_tokens' or 'max_completion_tokens', not both.",
        ));
    }
    // max_completion_tokens is the newer name of the same limit.
    let max_name = if p.get("max_completion_tokens").is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let mut req = common(&p, limits, max_name, DEFAULT_CHAT_MAX_TOKENS, 1)?;
    req.endpoint = Endpoint::Chat;
    let messages = match p.get("messages") {
        None => {
            return Err(ApiError::param(
                "messages",
                Some("missing_required_parameter"),
                "Missing required parameter: 'messages'.",
            ))
        }
        Some(v) => chat::parse_messages(v)?,
    };
    req.prompts = vec![chat::render(&messages)];
    p.neutral_only("logprobs", |v| v.as_bool() == Some(false))?;
    p.neutral_only("top_logprobs", |v| v.as_i64() == Some(0))?;
    p.neutral_only("response_format", |v| {
        v.get("type").and_then(Value::as_str) == Some("text")
    })?;
    p.neutral_only("tools", |v| v.as_array().is_some_and(Vec::is_empty))?;
    p.neutral_only("tool_choice", |v| v.as_str() == Some("none"))?;
    p.neutral_only("functions", |v| v.as_array().is_some_and(Vec::is_empty))?;
    p.neutral_only("function_call", |v| v.as_str() == Some("none"))?;
    p.neutral_only("modalities", |v| *v == serde_json::json!(["text"]))?;
    for name in [
        "audio",
        "prediction",
        "reasoning_effort",
        "web_search_options",
    ] {
        p.neutral_only(name, |_| false)?;
    }
    p.bool("parallel_tool_calls")?;
    p.bool("store")?;
    p.string("service_tier")?;
    p.string("safety_identifier")?;
    p.string("prompt_cache_key")?;
    if let Some(v) = p.get("metadata") {
        if !v.is_object() {
            return Err(wrong_type("metadata", "an object", v));
        }
    }
    Ok(req)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: RequestLimits = RequestLimits { max_tokens: 512 };

    fn completions(body: &str) -> Result<GenerationRequest, ApiError> {
        parse_completions(body.as_bytes(), LIMITS)
    }

    fn chat(body: &str) -> Result<GenerationRequest, ApiError> {
        parse_chat(body.as_bytes(), LIMITS)
    }

    fn err(r: Result<GenerationRequest, ApiError>) -> ApiError {
        r.expect_err("must be refused")
    }

    #[test]
    fn the_daemons_request_still_parses_with_defaults() {
        // What `tenantvm infer` sends today: no model.
        let r = completions(r#"{"prompt":"four score","max_tokens":8,"temperature":0}"#).unwrap();
        assert_eq!(r.model, None);
        assert_eq!(r.prompts, ["four score"]);
        assert_eq!(r.max_tokens, 8);
        assert_eq!(r.sampling.temperature, 0.0);
        assert!(!r.stream && !r.echo && r.stop.is_empty());
        let r = completions(r#"{"prompt":"x"}"#).unwrap();
        assert_eq!(r.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS);
    }

    #[test]
    fn every_supported_parameter_is_read() {
        let r = completions(
            r#"{"model":"m","prompt":["a","b"],"max_tokens":3,"temperature":0.5,"top_p":0.9,
                "n":1,"stream":true,"stream_options":{"include_usage":true},"stop":["x","y"],
                "seed":-1,"presence_penalty":1,"frequency_penalty":-1,"logit_bias":{},
                "logprobs":null,"user":"u","echo":true,"suffix":"","best_of":1}"#,
        )
        .unwrap();
        assert_eq!(r.model.as_deref(), Some("m"));
        assert_eq!(r.prompts, ["a", "b"]);
        assert!(r.stream && r.include_usage && r.echo);
        assert_eq!(r.stop, ["x", "y"]);
        assert_eq!(r.sampling.seed, u64::MAX);
        assert_eq!(r.sampling.top_p, 0.9);
        assert_eq!(r.sampling.presence_penalty, 1.0);
        let r = chat(r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":4,"stop":"."}"#).unwrap();
        assert_eq!(r.endpoint, Endpoint::Chat);
        assert_eq!(r.max_tokens, 4);
        assert_eq!(r.stop, ["."]);
        assert_eq!(r.prompts, ["user: hi\nassistant:"]);
        let r = chat(r#"{"messages":[{"role":"user","content":"hi"}]}"#).unwrap();
        assert_eq!(r.max_tokens, DEFAULT_CHAT_MAX_TOKENS);
    }

    #[test]
    fn bad_requests_name_the_parameter_and_code() {
        let cases: &[(&str, Option<&str>, Option<&str>)] = &[
            ("not json", None, None),
            ("[1]", None, None),
            (
                r#"{"prompt":"a","bogus":1}"#,
                Some("bogus"),
                Some("unknown_parameter"),
            ),
            (
                r#"{"max_tokens":3}"#,
                Some("prompt"),
                Some("missing_required_parameter"),
            ),
            (
                r#"{"prompt":"a","max_tokens":"3"}"#,
                Some("max_tokens"),
                Some("invalid_type"),
            ),
            (
                r#"{"prompt":"a","max_tokens":1.5}"#,
                Some("max_tokens"),
                Some("invalid_type"),
            ),
            (
                r#"{"prompt":"a","max_tokens":100000}"#,
                Some("max_tokens"),
                Some("integer_above_max_value"),
            ),
            (
                r#"{"prompt":"a","max_tokens":-1}"#,
                Some("max_tokens"),
                Some("integer_below_min_value"),
            ),
            (
                r#"{"prompt":"a","n":2}"#,
                Some("n"),
                Some("unsupported_value"),
            ),
            (
                r#"{"prompt":"a","n":0}"#,
                Some("n"),
                Some("integer_below_min_value"),
            ),
            (
                r#"{"prompt":"a","temperature":9}"#,
                Some("temperature"),
                Some("decimal_above_max_value"),
            ),
            (
                r#"{"prompt":"a","top_p":-0.1}"#,
                Some("top_p"),
                Some("decimal_below_min_value"),
            ),
            (
                r#"{"prompt":"a","stream":"yes"}"#,
                Some("stream"),
                Some("invalid_type"),
            ),
            (
                r#"{"prompt":"a","stream_options":{"include_usage":true}}"#,
                Some("stream_options"),
                Some("invalid_value"),
            ),
            (
                r#"{"prompt":"a","stop":["a","b","c","d","e"]}"#,
                Some("stop"),
                Some("array_above_max_length"),
            ),
            (
                r#"{"prompt":"a","stop":""}"#,
                Some("stop"),
                Some("invalid_value"),
            ),
            (
                r#"{"prompt":[1,2,3]}"#,
                Some("prompt"),
                Some("unsupported_value"),
            ),
            (r#"{"prompt":[]}"#, Some("prompt"), Some("invalid_value")),
            (
                r#"{"prompt":{"a":1}}"#,
                Some("prompt"),
                Some("invalid_type"),
            ),
            (
                r#"{"prompt":"a","model":7}"#,
                Some("model"),
                Some("invalid_type"),
            ),
            (
                r#"{"prompt":"a","logprobs":2}"#,
                Some("logprobs"),
                Some("unsupported_parameter"),
            ),
            (
                r#"{"prompt":"a","suffix":"end"}"#,
                Some("suffix"),
                Some("unsupported_parameter"),
            ),
            (
                r#"{"prompt":"a","best_of":3}"#,
                Some("best_of"),
                Some("unsupported_value"),
            ),
            (
                r#"{"prompt":"a","logit_bias":{"1":5}}"#,
                Some("logit_bias"),
                Some("unsupported_parameter"),
            ),
            (
                r#"{"prompt":"a","messages":[]}"#,
                Some("messages"),
                Some("unknown_parameter"),
            ),
        ];
        for (body, param, code) in cases {
            let e = err(completions(body));
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), *param, "{body}: {}", e.message);
            assert_eq!(e.code, *code, "{body}: {}", e.message);
        }
        let chat_cases: &[(&str, &str)] = &[
            (r#"{"model":"m"}"#, "messages"),
            (
                r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":0}"#,
                "max_tokens",
            ),
            (
                r#"{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function"}]}"#,
                "tools",
            ),
            (
                r#"{"messages":[{"role":"user","content":"hi"}],"prompt":"x"}"#,
                "prompt",
            ),
            (
                r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":1,"max_completion_tokens":1}"#,
                "max_completion_tokens",
            ),
            (
                r#"{"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_object"}}"#,
                "response_format",
            ),
            (
                r#"{"messages":[{"role":"user","content":"hi"}],"logprobs":true}"#,
                "logprobs",
            ),
        ];
        for (body, param) in chat_cases {
            let e = err(chat(body));
            assert_eq!(e.param.as_deref(), Some(*param), "{body}: {}", e.message);
        }
    }
}
