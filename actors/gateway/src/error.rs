//! The one mapping from failures to HTTP: OpenAI error objects
//! `{"error": {"message", "type", "param", "code"}}` with the right status.
//! Clients never see internal error chains, only the message written here.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds after which a retry may succeed (the `Retry-After` header).
    pub retry_after: Option<u32>,
}

/// `Retry-After` for refusals under load (seconds).
pub const RETRY_AFTER_S: u32 = 1;

impl ApiError {
    /// 400 for a bad parameter.
    pub fn invalid(param: impl Into<Option<String>>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.into(),
            code: None,
            retry_after: None,
        }
    }
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }
    pub fn model_not_found(model: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist or is not served here."),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
            retry_after: None,
        }
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "service_unavailable_error",
            param: None,
            code: Some("no_workers_available"),
            retry_after: Some(RETRY_AFTER_S),
        }
    }
    /// 429: the model's queue is full (admission control).
    pub fn too_many_requests(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: message.into(),
            kind: "rate_limit_error",
            param: None,
            code: Some("queue_full"),
            retry_after: Some(RETRY_AFTER_S),
        }
    }
    /// 503: admitted work waited too long, or every worker is overloaded.
    pub fn overloaded(message: impl Into<String>, code: &'static str) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "service_unavailable_error",
            param: None,
            code: Some(code),
            retry_after: Some(RETRY_AFTER_S),
        }
    }
    pub fn too_large(limit: usize) -> Self {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("Request body exceeds the {limit}-byte limit."),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_too_large"),
            retry_after: None,
        }
    }
    /// A body in an encoding this server does not decode (415).
    pub fn unsupported_encoding(encoding: &str) -> Self {
        ApiError {
            status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
            message: format!(
                "Content-Encoding {encoding:?} is not supported: send the body uncompressed."
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("unsupported_content_encoding"),
            retry_after: None,
        }
    }
    /// The client stopped sending its request body (408).
    pub fn body_stalled(after: std::time::Duration) -> Self {
        ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            message: format!(
                "The request body stalled: nothing arrived for {} ms.",
                after.as_millis()
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("body_timeout"),
            retry_after: None,
        }
    }
    pub fn timeout(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::GATEWAY_TIMEOUT,
            message: message.into(),
            kind: "timeout_error",
            param: None,
            code: Some("deadline_exceeded"),
            retry_after: None,
        }
    }
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_GATEWAY,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("worker_failed"),
            retry_after: None,
        }
    }
    pub fn not_found(path: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("Unknown endpoint {path}."),
            kind: "invalid_request_error",
            param: None,
            code: Some("unknown_url"),
            retry_after: None,
        }
    }
    pub fn method_not_allowed() -> Self {
        ApiError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            message: "Method not allowed for this endpoint.".into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// The OpenAI error object.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }

    /// Label for the errors metric.
    pub fn metric_kind(&self) -> &'static str {
        self.code.unwrap_or(self.kind)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(s),
            );
        }
        r
    }
}
