//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the
//! status codes OpenAI uses.

use serde_json::{json, Value};

/// An error answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// Human-readable, says what to do.
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error` or `server_error`.
    pub kind: &'static str,
    /// The request parameter at fault.
    pub param: Option<String>,
    /// OpenAI's machine-readable `code`.
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header.
    pub retry_after_s: Option<u32>,
    /// Methods for an `Allow` header (405).
    pub allow: Option<&'static str>,
    /// Close the connection after answering (the request could not be read whole).
    pub close: bool,
}

const INVALID: &str = "invalid_request_error";
const SERVER: &str = "server_error";

impl ApiError {
    fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after_s: None,
            allow: None,
            close: false,
        }
    }

    /// 400 about the request as a whole.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(400, INVALID, message)
    }

    /// 400 about one parameter.
    pub fn param(param: &str, code: Option<&'static str>, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.to_string()),
            code,
            ..Self::invalid(message)
        }
    }

    /// 400: the body is not JSON.
    pub fn malformed_json(detail: &str) -> Self {
        Self::invalid(format!(
            "We could not parse the JSON body of your request ({detail}). The API expects a \
             JSON object; send it with Content-Type: application/json."
        ))
    }

    /// 404 `model_not_found`.
    pub fn model_not_found(name: &str) -> Self {
        Self {
            code: Some("model_not_found"),
            ..Self::new(
                404,
                INVALID,
                format!(
                    "The model `{name}` does not exist or you do not have access to it. \
                     GET /v1/models lists the models served here."
                ),
            )
        }
    }

    /// 404 for a path this server does not serve (OpenAI: "Invalid URL").
    pub fn unknown_path(method: &str, path: &str) -> Self {
        Self::new(
            404,
            INVALID,
            format!(
                "Invalid URL ({method} {path}): this server serves GET /v1/models, \
                 POST /v1/completions, POST /v1/chat/completions, GET /v1/tenantvm/serving, \
                 GET /v1/tenantvm/stats and GET /health"
            ),
        )
    }

    /// 405 for a known path with the wrong method.
    pub fn method_not_allowed(method: &str, path: &str, allowed: &'static str) -> Self {
        Self {
            allow: Some(allowed),
            ..Self::new(
                405,
                INVALID,
                format!("{method} is not allowed on {path}; use {allowed}"),
            )
        }
    }

    /// 413: the body is over the limit.
    pub fn too_large(size: Option<usize>, max: usize) -> Self {
        let what = size.map_or("The request body".to_string(), |s| {
            format!("The request body ({s} bytes)")
        });
        Self {
            code: Some("request_too_large"),
            close: true,
            ..Self::new(
                413,
                INVALID,
                format!("{what} exceeds this server's limit of {max} bytes (--max-body-bytes)"),
            )
        }
    }

    /// 431: the header block is over the limit.
    pub fn headers_too_large(max: usize) -> Self {
        Self {
            close: true,
            ..Self::new(
                431,
                INVALID,
                format!("The request headers exceed this server's limit of {max} bytes (--max-header-bytes)"),
            )
        }
    }

    /// 408: the request did not arrive in time.
    pub fn timeout(limit_ms: u64) -> Self {
        Self {
            close: true,
            ..Self::new(
                408,
                INVALID,
                format!("The request did not arrive within {limit_ms} ms (--read-timeout-ms)"),
            )
        }
    }

    /// 400: not an HTTP request this server understands.
    pub fn bad_http(detail: &str) -> Self {
        Self {
            close: true,
            ..Self::invalid(format!("Malformed HTTP request: {detail}"))
        }
    }

    /// 503 with `Retry-After`: no capacity now.
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self {
            code: Some("server_overloaded"),
            retry_after_s: Some(1),
            ..Self::new(503, SERVER, message)
        }
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, SERVER, message)
    }

    /// Headers that go with the answer (`Retry-After`, `Allow`).
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut h = Vec::new();
        if let Some(s) = self.retry_after_s {
            h.push(("Retry-After", s.to_string()));
        }
        if let Some(a) = self.allow {
            h.push(("Allow", a.to_string()));
        }
        h
    }

    /// The JSON body.
    pub fn body(&self) -> Vec<u8> {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
        .to_string()
        .into_bytes()
    }
}

/// How OpenAI names the JSON type of `v` in its error messages (`an integer`, `null`, ...).
pub(crate) fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "an integer",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// `Invalid type for 'NAME': expected X, but got Y instead.`
pub(crate) fn wrong_type(name: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::param(
        name,
        Some("invalid_type"),
        format!(
            "Invalid type for '{name}': expected {expected}, but got {} instead.",
            type_name(got)
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_openai_error_shape() {
        let e = ApiError::param("n", Some("unsupported_value"), "n must be 1");
        let v: serde_json::Value = serde_json::from_slice(&e.body()).unwrap();
        assert_eq!(v["error"]["message"], "n must be 1");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "n");
        assert_eq!(v["error"]["code"], "unsupported_value");
        let keys: Vec<&String> = v["error"].as_object().unwrap().keys().collect();
        assert_eq!(keys.len(), 4);
        let v: serde_json::Value =
            serde_json::from_slice(&ApiError::model_not_found("x").body()).unwrap();
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(v["error"]["param"], serde_json::Value::Null);
        assert_eq!(ApiError::overloaded("busy").status, 503);
    }
}
