//! OpenAI's error shape for the front door: `{"error": {"message", "type", "param",
//! "code"}}` with the status OpenAI uses for the same case, so a client written for OpenAI
//! handles ours as it handles theirs. Messages never quote the request body (prompts are
//! the tenant's data) and are bounded.

use hyper::StatusCode;
use serde_json::json;

use crate::tenant::admission::Refused;
use crate::tenant::infer::InferError;

/// An error answer of the front door.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenAiError {
    /// HTTP status.
    pub status: StatusCode,
    /// OpenAI's `type`.
    pub kind: &'static str,
    /// OpenAI's `code` (a stable, machine-readable name).
    pub code: &'static str,
    /// What went wrong and what to do.
    pub message: String,
    /// Seconds for `Retry-After` (429 and 503).
    pub retry_after: Option<u64>,
}

impl OpenAiError {
    fn new(status: StatusCode, kind: &'static str, code: &'static str, message: String) -> Self {
        OpenAiError {
            status,
            kind,
            code,
            message,
            retry_after: None,
        }
    }

    /// No key, or one that is unknown or revoked (the same answer for each, so a client
    /// cannot tell a revoked key from one that never existed).
    pub fn invalid_key() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_api_key",
            "Incorrect API key provided. Send `Authorization: Bearer <key>` with a key from \
             `tenantvm key create TENANT`."
                .into(),
        )
    }

    /// A path the front door does not serve.
    pub fn unknown_route(method: &str, path: &str) -> Self {
        let shown = crate::untrusted::GuestLine::bounded(path, 100).into_string();
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "unknown_url",
            format!(
                "Invalid URL ({method} {shown}); this endpoint serves GET /v1/models, \
                 POST /v1/completions and POST /v1/chat/completions"
            ),
        )
    }

    /// A known path with the wrong method.
    pub fn wrong_method(method: &str, path: &'static str, allowed: &'static str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "method_not_allowed",
            format!("{method} is not allowed on {path}; use {allowed}"),
        )
    }

    /// A body over the tenant's `quotas.max_request_bytes`.
    pub fn too_large(limit: u32) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!(
                "The request body is larger than this tenant's limit of {limit} bytes \
                 (quotas.max_request_bytes); send a shorter prompt"
            ),
        )
    }

    /// A body that is not a JSON object.
    pub fn invalid_json() -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_json",
            "The request body is not a JSON object; send e.g. \
             {\"model\": \"...\", \"prompt\": \"...\", \"max_tokens\": 16}"
                .into(),
        )
    }

    /// The client took too long to send its request.
    pub fn request_timeout() -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "request_timeout",
            "The request body did not arrive in time; send it at once".into(),
        )
    }

    /// The key's tenant already holds its share of connections.
    pub fn too_many_connections(per_tenant: u32) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "requests",
            "too_many_connections",
            format!(
                "This key's tenant already holds {per_tenant} open connections to this endpoint; \
                 reuse one (keep-alive) or close some"
            ),
        );
        e.retry_after = Some(1);
        e
    }

    /// The front door is serving as many authenticated connections as it may (or the
    /// connection was evicted while its request was being checked).
    pub fn overloaded() -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "overloaded",
            "The endpoint is at its connection limit; retry shortly".into(),
        );
        e.retry_after = Some(1);
        e
    }

    /// The body as OpenAI writes it.
    pub fn body(&self) -> String {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": null,
            "code": self.code,
        }})
        .to_string()
    }
}

impl From<Refused> for OpenAiError {
    fn from(r: Refused) -> Self {
        let retry = r.retry_after_secs();
        let mut e = match r {
            Refused::Rate { limit, .. } => OpenAiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "requests",
                "rate_limit_exceeded",
                format!(
                    "Rate limit reached: {limit} requests per second (quotas.requests_per_s); \
                     retry after {retry} s"
                ),
            ),
            Refused::Concurrency { limit, .. } => OpenAiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "requests",
                "concurrency_limit_exceeded",
                format!(
                    "{limit} requests are already in flight (quotas.max_concurrency); retry \
                     when one finishes"
                ),
            ),
            Refused::Closed { .. } => OpenAiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "tenant_departing",
                "This tenant is being destroyed and takes no more requests".into(),
            ),
        };
        e.retry_after = Some(retry);
        e
    }
}

impl From<InferError> for OpenAiError {
    fn from(err: InferError) -> Self {
        match err {
            InferError::Quota(r) => r.into(),
            InferError::BadRequest(m) => OpenAiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "invalid_request",
                m,
            ),
            InferError::TooLarge { limit, .. } => OpenAiError::too_large(limit),
            InferError::NotServing(_) => {
                let mut e = OpenAiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_error",
                    "tenant_not_running",
                    "The tenant's inference server is not running; its operator can start it \
                     with `tenantvm start`"
                        .into(),
                );
                e.retry_after = Some(5);
                e
            }
            InferError::Recovering(_) => {
                let mut e = OpenAiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_error",
                    "tenant_recovering",
                    "The endpoint restarted and is checking this tenant's inference server; \
                     retry in a few seconds"
                        .into(),
                );
                e.retry_after = Some(5);
                e
            }
            InferError::Unavailable(m) => OpenAiError::new(
                StatusCode::BAD_GATEWAY,
                "server_error",
                "upstream_unavailable",
                format!(
                    "The tenant's inference server did not answer: {}",
                    crate::untrusted::GuestLine::bounded(&m, 300).into_string()
                ),
            ),
            InferError::Store(e) => OpenAiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "internal_error",
                format!("The endpoint's state store failed: {e}"),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn errors_have_openais_shape_and_quota_refusals_say_when_to_retry() {
        let e = OpenAiError::invalid_key();
        let v: serde_json::Value = serde_json::from_str(&e.body()).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "invalid_api_key");
        assert!(v["error"]["param"].is_null());
        assert_eq!(e.status, StatusCode::UNAUTHORIZED);
        let rate: OpenAiError = Refused::Rate {
            tenant: "t".into(),
            limit: 2,
            retry_after: Duration::from_millis(1500),
        }
        .into();
        assert_eq!(
            (rate.status, rate.code, rate.retry_after),
            (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_exceeded",
                Some(2)
            )
        );
        let conc: OpenAiError = Refused::Concurrency {
            tenant: "t".into(),
            limit: 3,
        }
        .into();
        assert_eq!(conc.retry_after, Some(1));
        assert_eq!(
            OpenAiError::too_large(10).status,
            StatusCode::PAYLOAD_TOO_LARGE
        );
        // A guest's error text is bounded and made line-safe.
        let long: OpenAiError = InferError::Unavailable(format!("a\nb{}", "x".repeat(5000))).into();
        assert!(long.message.len() < 600, "{}", long.message.len());
        assert!(!long.message.contains('\n'));
    }
}
