//! Routes and handlers.
//!
//! | route | what |
//! |---|---|
//! | `GET /health` | `{"status":"ok"}` (the agent's readiness probe) |
//! | `GET /v1/models`, `GET /v1/models/{id}` | the built-in and pushed models (rescans) |
//! | `POST /v1/completions` | text completion, streamed with `stream: true` |
//! | `POST /v1/chat/completions` | chat completion through the chat template |
//! | `GET /v1/tenantvm/serving` | serving configuration: models, prefix cache, concurrency |
//! | `GET /v1/tenantvm/stats` | work counters (prefill tokens computed and cached, in flight) |

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde_json::{json, Value};

use crate::http::{Connection, Request};
use crate::inference::{ChoiceSink, Collect, Engine};
use crate::model::tokenize;
use crate::openai::chat::TEMPLATE_NAME;
use crate::openai::request::{self, Endpoint, GenerationRequest, RequestLimits, MAX_PROMPTS};
use crate::openai::response::{sse, Choice, FinishReason, ResponseMeta, Usage, SSE_DONE};
use crate::openai::ApiError;
use crate::prefill::BLOCK_TOKENS;
use crate::registry::{LoadedModel, Lookup};
use crate::state::AppState;

/// What a handler produced.
enum Reply {
    /// A 200 JSON answer to send.
    Json(Value),
    /// A stream, already written; `completed` if it ended normally.
    Streamed { completed: bool },
}

/// Answers one request; returns whether the connection may carry another.
pub fn handle(state: &AppState, req: &Request, conn: &mut Connection) -> bool {
    match route(state, req, conn) {
        Ok(Reply::Json(v)) => {
            state.stats.count_status(200);
            conn.write_response(
                200,
                "application/json",
                &[],
                v.to_string().as_bytes(),
                req.keep_alive,
            )
            .is_ok()
                && req.keep_alive
        }
        Ok(Reply::Streamed { completed }) => {
            state.stats.count_status(200);
            completed && req.keep_alive && req.http11
        }
        Err(e) => {
            state.stats.count_status(e.status);
            let keep = req.keep_alive && !e.close;
            conn.write_response(e.status, "application/json", &e.headers(), &e.body(), keep)
                .is_ok()
                && keep
        }
    }
}

fn route(state: &AppState, req: &Request, conn: &mut Connection) -> Result<Reply, ApiError> {
    let limits = RequestLimits {
        max_tokens: state.config.max_tokens,
    };
    let path = req.path.as_str();
    match (req.method.as_str(), path) {
        ("GET", "/health") => Ok(Reply::Json(json!({"status": "ok"}))),
        ("GET", "/v1/models") => Ok(Reply::Json(list_models(state))),
        ("GET", _) if path.starts_with("/v1/models/") => {
            let name = &path["/v1/models/".len()..];
            let m = resolve_model(state, Some(name))?;
            Ok(Reply::Json(model_object(&m)))
        }
        ("POST", "/v1/completions") => {
            let r = request::parse_completions(&req.body, limits)?;
            generate(state, r, req, conn)
        }
        ("POST", "/v1/chat/completions") => {
            let r = request::parse_chat(&req.body, limits)?;
            generate(state, r, req, conn)
        }
        ("GET", "/v1/tenantvm/serving") => Ok(Reply::Json(serving(state))),
        ("GET", "/v1/tenantvm/stats") => Ok(Reply::Json(stats(state))),
        (m, "/v1/completions" | "/v1/chat/completions") => {
            Err(ApiError::method_not_allowed(m, path, "POST"))
        }
        (m, "/health" | "/v1/models" | "/v1/tenantvm/serving" | "/v1/tenantvm/stats") => {
            Err(ApiError::method_not_allowed(m, path, "GET"))
        }
        (m, _) if path.starts_with("/v1/models/") => {
            Err(ApiError::method_not_allowed(m, path, "GET"))
        }
        (m, _) => Err(ApiError::unknown_path(m, path)),
    }
}

fn model_object(m: &LoadedModel) -> Value {
    json!({
        "id": m.name,
        "object": "model",
        "created": m.created,
        "owned_by": match m.source {
            crate::registry::ModelSource::Builtin => "tenantvm",
            crate::registry::ModelSource::Pushed => "tenant",
        },
    })
}

fn list_models(state: &AppState) -> Value {
    state.registry.rescan();
    let data: Vec<Value> = state
        .registry
        .models()
        .iter()
        .map(|m| model_object(m))
        .collect();
    json!({"object": "list", "data": data})
}

/// The model a request names (or the default one), rescanning once for an unknown name.
fn resolve_model(state: &AppState, name: Option<&str>) -> Result<Arc<LoadedModel>, ApiError> {
    let broken = |name: &str, e: String| {
        ApiError::param(
            "model",
            Some("model_load_failed"),
            format!("The model `{name}` is in the models directory but cannot be served: {e}"),
        )
    };
    match (state.registry.lookup(name), name) {
        (Lookup::Found(m), _) => Ok(m),
        (Lookup::Broken(e), Some(n)) => Err(broken(n, e)),
        (_, None) => Err(ApiError::param(
            "model",
            Some("missing_required_parameter"),
            "You must provide a model parameter: this server has no built-in model and not \
             exactly one pushed model. GET /v1/models lists them.",
        )),
        (Lookup::Missing, Some(n)) => {
            // Perhaps pushed a moment ago.
            state.registry.rescan();
            match state.registry.lookup(Some(n)) {
                Lookup::Found(m) => Ok(m),
                Lookup::Broken(e) => Err(broken(n, e)),
                Lookup::Missing => Err(ApiError::model_not_found(n)),
            }
        }
    }
}

/// Streams a choice as server-sent events.
struct SseSink<'a> {
    conn: &'a mut Connection,
    meta: &'a ResponseMeta,
    index: usize,
    include_usage: bool,
}

impl SseSink<'_> {
    fn send(&mut self, text: &str, first: bool, finish: Option<FinishReason>) -> io::Result<()> {
        let chunk = self
            .meta
            .chunk(self.index, first, text, finish, self.include_usage);
        self.conn.write_chunk(&sse(&chunk))
    }
}

impl ChoiceSink for SseSink<'_> {
    fn prefilled(&mut self) -> io::Result<()> {
        // Chat streams open with the assistant role, once the first token is near.
        if self.meta.endpoint == Endpoint::Chat {
            self.send("", true, None)?;
        }
        Ok(())
    }

    fn text(&mut self, piece: &str) -> io::Result<()> {
        self.send(piece, false, None)
    }
}

fn generate(
    state: &AppState,
    r: GenerationRequest,
    req: &Request,
    conn: &mut Connection,
) -> Result<Reply, ApiError> {
    state
        .registry
        .rescan_if_older_than(state.config.rescan_interval);
    let model = resolve_model(state, r.model.as_deref())?;
    let tokenized: Vec<Vec<String>> = r.prompts.iter().map(|p| tokenize(p)).collect();
    let prompt_param = match r.endpoint {
        Endpoint::Completions => "prompt",
        Endpoint::Chat => "messages",
    };
    let window = state.config.max_context_tokens;
    if let Some(t) = tokenized.iter().find(|t| t.len() + r.max_tokens > window) {
        return Err(ApiError::param(
            prompt_param,
            Some("context_length_exceeded"),
            format!(
                "This model's maximum context length is {window} tokens (--max-context-tokens). \
                 However, you requested {} tokens ({} in the prompt, {} for the completion). \
                 Please reduce the prompt or max_tokens.",
                t.len() + r.max_tokens,
                t.len(),
                r.max_tokens
            ),
        ));
    }
    let _slot = state.acquire_slot()?;
    let meta = ResponseMeta::new(r.endpoint, &model.name);
    let engine = Engine {
        prefiller: &state.prefiller,
        stats: &state.stats,
    };
    let record = |prompt: &str, text: &str| {
        state.history.record(prompt, text).map_err(|e| {
            ApiError::internal(format!(
                "Recording the completion on the data disk failed: {e}"
            ))
        })
    };
    let mut usage = Usage::default();
    if !r.stream {
        let mut choices = Vec::with_capacity(r.prompts.len());
        for (index, (prompt, tokens)) in r.prompts.iter().zip(&tokenized).enumerate() {
            let run = engine
                .run_choice(&model, prompt, tokens, &r, &mut Collect)
                .map_err(|e| ApiError::internal(format!("Generation failed: {e}")))?;
            record(prompt, &run.text)?;
            usage.prompt_tokens += run.prompt_tokens;
            usage.cached_tokens += run.cached_tokens;
            usage.completion_tokens += run.completion_tokens;
            choices.push(Choice {
                index,
                text: run.text,
                finish: run.finish,
            });
        }
        return Ok(Reply::Json(meta.completion(&choices, usage)));
    }

    let gone = |state: &AppState| {
        state
            .stats
            .client_disconnects
            .fetch_add(1, Ordering::Relaxed);
        Ok(Reply::Streamed { completed: false })
    };
    let extra = [("Cache-Control", "no-cache".to_string())];
    if conn
        .start_stream("text/event-stream", &extra, req.http11, req.keep_alive)
        .is_err()
    {
        return gone(state);
    }
    for (index, (prompt, tokens)) in r.prompts.iter().zip(&tokenized).enumerate() {
        let mut sink = SseSink {
            conn,
            meta: &meta,
            index,
            include_usage: r.include_usage,
        };
        let Ok(run) = engine.run_choice(&model, prompt, tokens, &r, &mut sink) else {
            return gone(state);
        };
        if let Err(e) = record(prompt, &run.text) {
            // The answer is under way: say so in the stream, and end it without [DONE].
            let _ = sink
                .conn
                .write_chunk(&sse(&serde_json::from_slice(&e.body()).unwrap_or_default()));
            let _ = sink.conn.end_stream();
            return Ok(Reply::Streamed { completed: false });
        }
        usage.prompt_tokens += run.prompt_tokens;
        usage.cached_tokens += run.cached_tokens;
        usage.completion_tokens += run.completion_tokens;
        if sink.send("", false, Some(run.finish)).is_err() {
            return gone(state);
        }
    }
    let mut tail = Vec::new();
    if r.include_usage {
        tail.extend(sse(&meta.usage_chunk(usage)));
    }
    tail.extend_from_slice(SSE_DONE);
    if conn.write_chunk(&tail).is_err() || conn.end_stream().is_err() {
        return gone(state);
    }
    Ok(Reply::Streamed { completed: true })
}

fn serving(state: &AppState) -> Value {
    state.registry.rescan();
    let c = &state.config;
    let models: Vec<Value> = state
        .registry
        .models()
        .iter()
        .map(|m| {
            json!({
                "id": m.name,
                "source": m.source,
                "path": m.path,
                "created": m.created,
                "order": m.model.order(),
                "vocabulary": m.model.model().vocab.len(),
            })
        })
        .collect();
    let prefix_cache = match state.prefiller.cache_stats() {
        Some(s) => json!({
            "enabled": true,
            "scope": "this server only (one server per VM)",
            "block_tokens": BLOCK_TOKENS,
            "capacity_bytes": s.capacity_bytes,
            "used_bytes": s.used_bytes,
            "entries": s.entries,
        }),
        None => json!({"enabled": false}),
    };
    json!({
        "server": "tenantvm-ngram",
        "version": env!("CARGO_PKG_VERSION"),
        "instance_id": state.instance_id,
        "started": state.started,
        "models": models,
        "model_errors": state.registry.problems(),
        "default_model": state.registry.default_model().map(|m| m.name.clone()),
        "models_dir": state.registry.models_dir(),
        "prefix_cache": prefix_cache,
        "batching": {
            "max_concurrency": c.max_concurrency,
            "max_batch_size": 1,
            "continuous_batching": false,
            "scope": "one server per VM: requests of this VM only",
        },
        "max_connections": c.max_connections,
        "prefill": {"rounds_per_token": state.prefiller.rounds()},
        "chat_template": TEMPLATE_NAME,
        "limits": {
            "max_body_bytes": c.http.max_body_bytes,
            "max_header_bytes": c.http.max_header_bytes,
            "read_timeout_ms": c.http.read_timeout.as_millis() as u64,
            "idle_timeout_ms": c.http.idle_timeout.as_millis() as u64,
            "write_timeout_ms": c.http.write_timeout.as_millis() as u64,
            "queue_timeout_ms": c.queue_timeout.as_millis() as u64,
            "max_tokens": c.max_tokens,
            "max_context_tokens": c.max_context_tokens,
            "max_prompts": MAX_PROMPTS,
        },
        "history": c.data_dir.as_ref().map(|d| d.join(crate::history::HISTORY_FILE)),
    })
}

fn stats(state: &AppState) -> Value {
    let snap = state.stats.snapshot(
        state.prefiller.computed_tokens(),
        state.prefiller.cached_tokens(),
    );
    let mut v = serde_json::to_value(snap).unwrap_or_default();
    v["prefix_cache"] = serde_json::to_value(state.prefiller.cache_stats()).unwrap_or_default();
    v
}
