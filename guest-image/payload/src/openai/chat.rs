//! The chat template (`tenantvm-plain-v1`): how `messages` become one prompt.
//!
//! ```text
//! {role}: {content}\n        one line group per message, in order
//! assistant:                 the model continues from here
//! ```
//!
//! `content` is the message's string, or its text parts joined with `\n`. Roles: `system`,
//! `developer`, `user`, `assistant` (`tool` and `function` messages belong to tool calling,
//! which this model does not do). The word-level tokenizer keeps the role words and the
//! colons as tokens, so they count in `usage.prompt_tokens`; words outside the model's
//! vocabulary are skipped when choosing the next word, so an order-3 model continues from
//! the last known word of the conversation and the colon of `assistant:`.
//! The reply's leading space is dropped, as chat clients expect.

use serde_json::Value;

use super::error::{wrong_type, ApiError};

/// Name of the template, reported by the serving endpoint.
pub const TEMPLATE_NAME: &str = "tenantvm-plain-v1";

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `developer`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

const ROLES: &[&str] = &["system", "developer", "user", "assistant"];

fn content_text(i: usize, v: Option<&Value>, role: &str) -> Result<String, ApiError> {
    let name = format!("messages[{i}].content");
    match v {
        Some(Value::String(s)) => Ok(s.clone()),
        // An assistant turn may have no content (it made tool calls elsewhere).
        None | Some(Value::Null) if role == "assistant" => Ok(String::new()),
        None | Some(Value::Null) => Err(ApiError::param(
            &name,
            Some("missing_required_parameter"),
            format!("Missing required parameter: '{name}'."),
        )),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                let pname = format!("{name}[{j}]");
                let obj = part
                    .as_object()
                    .ok_or_else(|| wrong_type(&pname, "an object", part))?;
                match (obj.get("type").and_then(Value::as_str), obj.get("text")) {
                    (Some("text"), Some(Value::String(t))) if obj.len() == 2 => {
                        texts.push(t.as_str());
                    }
                    (Some("text"), _) => {
                        return Err(ApiError::param(
                            &pname,
                            Some("invalid_value"),
                            format!("Invalid '{pname}': a text part is {{\"type\": \"text\", \"text\": \"...\"}}."),
                        ))
                    }
                    _ => {
                        return Err(ApiError::param(
                            &pname,
                            Some("unsupported_value"),
                            format!("Invalid '{pname}': only text content parts are supported by this model."),
                        ))
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        Some(v) => Err(wrong_type(
            &name,
            "a string or an array of content parts",
            v,
        )),
    }
}

/// Checks `messages` (a non-empty array of message objects).
pub fn parse_messages(v: &Value) -> Result<Vec<ChatMessage>, ApiError> {
    let items = v
        .as_array()
        .ok_or_else(|| wrong_type("messages", "an array", v))?;
    if items.is_empty() {
        return Err(ApiError::param(
            "messages",
            Some("empty_array"),
            "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty array instead.",
        ));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let name = format!("messages[{i}]");
        let obj = item
            .as_object()
            .ok_or_else(|| wrong_type(&name, "an object", item))?;
        let role = match obj.get("role") {
            Some(Value::String(r)) if ROLES.contains(&r.as_str()) => r.clone(),
            Some(Value::String(r)) => {
                return Err(ApiError::param(
                    &format!("{name}.role"),
                    Some("invalid_value"),
                    format!(
                        "Invalid value: '{r}'. Supported roles are 'system', 'developer', 'user' and 'assistant' (this model does no tool calling)."
                    ),
                ))
            }
            Some(v) => return Err(wrong_type(&format!("{name}.role"), "a string", v)),
            None => {
                return Err(ApiError::param(
                    &format!("{name}.role"),
                    Some("missing_required_parameter"),
                    format!("Missing required parameter: '{name}.role'."),
                ))
            }
        };
        for key in obj.keys() {
            let allowed = match key.as_str() {
                "role" | "content" | "name" => true,
                "refusal" => role == "assistant" && obj[key].is_null(),
                _ => false,
            };
            if !allowed {
                return Err(ApiError::param(
                    &format!("{name}.{key}"),
                    Some("unknown_parameter"),
                    format!("Unrecognized request argument supplied: {name}.{key}"),
                ));
            }
        }
        if let Some(n) = obj.get("name").filter(|n| !n.is_string()) {
            return Err(wrong_type(&format!("{name}.name"), "a string", n));
        }
        let content = content_text(i, obj.get("content"), &role)?;
        out.push(ChatMessage { role, content });
    }
    Ok(out)
}

/// The prompt for `messages` under [`TEMPLATE_NAME`].
pub fn render(messages: &[ChatMessage]) -> String {
    let mut prompt = String::new();
    for m in messages {
        prompt.push_str(&m.role);
        prompt.push_str(": ");
        prompt.push_str(&m.content);
        prompt.push('\n');
    }
    prompt.push_str("assistant:");
    prompt
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn template_renders_roles_in_order_and_ends_with_the_assistant_cue() {
        let m = parse_messages(&json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "four score"}, {"type": "text", "text": "and seven"}]},
            {"role": "assistant", "content": null},
            {"role": "user", "content": "years", "name": "abe"}
        ]))
        .unwrap();
        assert_eq!(
            render(&m),
            "system: Be brief.\nuser: four score\nand seven\nassistant: \nuser: years\nassistant:"
        );
    }

    #[test]
    fn bad_messages_are_refused_with_the_field_named() {
        let cases = [
            (json!("hi"), "messages"),
            (json!([]), "messages"),
            (json!([1]), "messages[0]"),
            (json!([{"content": "x"}]), "messages[0].role"),
            (
                json!([{"role": "tool", "content": "x"}]),
                "messages[0].role",
            ),
            (json!([{"role": "user"}]), "messages[0].content"),
            (
                json!([{"role": "user", "content": 5}]),
                "messages[0].content",
            ),
            (
                json!([{"role": "user", "content": "x", "extra": 1}]),
                "messages[0].extra",
            ),
            (
                json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
                "messages[0].content[0]",
            ),
            (
                json!([{"role": "user", "content": "x", "name": 3}]),
                "messages[0].name",
            ),
        ];
        for (v, param) in cases {
            let e = parse_messages(&v).expect_err("must be refused");
            assert_eq!(e.status, 400);
            assert_eq!(e.param.as_deref(), Some(param), "{v}: {}", e.message);
        }
    }
}
