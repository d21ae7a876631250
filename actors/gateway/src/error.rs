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
}

impl ApiError {
    /// 400 for a bad parameter.
    pub fn invalid(param: impl Into<Option<String>>, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.into(),
            code: None,
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
        }
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "service_unavailable_error",
            param: None,
            code: Some("no_workers_available"),
        }
    }
    pub fn too_large(limit: usize) -> Self {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("Request body exceeds the {limit}-byte limit."),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_too_large"),
        }
    }
    pub fn timeout(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::GATEWAY_TIMEOUT,
            message: message.into(),
            kind: "timeout_error",
            param: None,
            code: Some("deadline_exceeded"),
        }
    }
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_GATEWAY,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("worker_failed"),
        }
    }
    pub fn not_found(path: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("Unknown endpoint {path}."),
            kind: "invalid_request_error",
            param: None,
            code: Some("unknown_url"),
        }
    }
    pub fn method_not_allowed() -> Self {
        ApiError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            message: "Method not allowed for this endpoint.".into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
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
        (self.status, axum::Json(self.body())).into_response()
    }
}
