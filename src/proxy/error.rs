//! Every way a request can fail, mapped in one place to an HTTP status, an OpenAI-shaped
//! error body (`{"error": {"message", "type", "param", "code"}}`) and a metric label.

use thiserror::Error;

/// A request-level failure the client is told about.
#[derive(Debug, Error)]
pub enum GatewayError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("method {0} is not allowed on this path")]
    MethodNotAllowed(String),
    #[error("request body exceeds the limit of {limit} bytes")]
    PayloadTooLarge { limit: usize },
    #[error("request body not received within {0} ms")]
    ClientBodyTimeout(u64),
    #[error("request header not received within {0} ms")]
    ClientHeaderTimeout(u64),
    #[error("request header section exceeds the limit of {limit} bytes")]
    HeaderTooLarge { limit: usize },
    #[error("the gateway is at its limit of {limit} requests in flight; retry later")]
    Overloaded { limit: usize },
    #[error("the gateway holds its limit of {limit} bytes of request bodies; retry later")]
    BodiesOverBudget { limit: usize },
    #[error("no eligible upstream for model '{0}'; retry later")]
    NoEligibleTarget(String),
    /// The replica holding a stored response (Responses API) cannot be used.
    #[error("the replica holding response '{id}' ({target}) is unavailable: {reason}")]
    ResponseHomeUnavailable {
        id: String,
        target: String,
        reason: &'static str,
    },
    #[error("upstream {target} unreachable: {reason}")]
    UpstreamConnect { target: String, reason: String },
    #[error("upstream {target} failed: {reason}")]
    UpstreamBroken { target: String, reason: String },
    #[error("upstream {target} timed out: {reason}")]
    UpstreamTimeout { target: String, reason: String },
    /// The upstream answered 502 or 503 and no other target could be tried after it.
    #[error("upstream {target} answered {status}")]
    UpstreamStatus { target: String, status: u16 },
    /// No valid client key (`[auth]`).
    #[error("Incorrect API key provided. Send a valid key as 'Authorization: Bearer <key>'.")]
    Unauthorized,
    /// The client went away; nothing can be sent.
    #[error("client disconnected: {0}")]
    ClientGone(String),
    /// A write to the client blocked past `limits.client_write_timeout_ms`: it stopped
    /// reading (a stalled or hostile reader); the exchange is cut.
    #[error("client stopped reading: {0}")]
    ClientWriteTimeout(String),
}

impl GatewayError {
    /// [`GatewayError::kind`] of [`GatewayError::ClientGone`].
    pub const CLIENT_GONE: &'static str = "client_disconnect";
    /// [`GatewayError::kind`] of [`GatewayError::ClientWriteTimeout`].
    pub const CLIENT_WRITE_TIMEOUT: &'static str = "client_write_timeout";

    /// A failed write to the client: it stopped reading (the write timed out), or it left.
    pub fn client_write(e: &pingora::Error) -> Self {
        if e.etype() == &pingora::ErrorType::WriteTimedout {
            GatewayError::ClientWriteTimeout(e.to_string())
        } else {
            GatewayError::ClientGone(e.to_string())
        }
    }

    /// Whether the client can be told nothing more (it left, or stopped reading).
    pub fn client_unreachable(&self) -> bool {
        matches!(
            self,
            GatewayError::ClientGone(_) | GatewayError::ClientWriteTimeout(_)
        )
    }

    /// HTTP status for the client.
    pub fn status(&self) -> u16 {
        match self {
            GatewayError::BadRequest(_) => 400,
            GatewayError::NotFound(_) => 404,
            GatewayError::MethodNotAllowed(_) => 405,
            GatewayError::ClientBodyTimeout(_) | GatewayError::ClientHeaderTimeout(_) => 408,
            GatewayError::HeaderTooLarge { .. } => 431,
            GatewayError::PayloadTooLarge { .. } => 413,
            GatewayError::NoEligibleTarget(_)
            | GatewayError::ResponseHomeUnavailable { .. }
            | GatewayError::Overloaded { .. }
            | GatewayError::BodiesOverBudget { .. } => 503,
            GatewayError::UpstreamConnect { .. } | GatewayError::UpstreamBroken { .. } => 502,
            GatewayError::UpstreamTimeout { .. } => 504,
            GatewayError::UpstreamStatus { status, .. } => *status,
            GatewayError::Unauthorized => 401,
            // 499 (nginx's "client closed request") is only ever logged, never sent.
            GatewayError::ClientGone(_) | GatewayError::ClientWriteTimeout(_) => 499,
        }
    }

    /// Stable label for `rolter_request_errors_total{kind}` and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            GatewayError::BadRequest(_) => "bad_request",
            GatewayError::NotFound(_) => "not_found",
            GatewayError::MethodNotAllowed(_) => "method_not_allowed",
            GatewayError::ClientBodyTimeout(_) => "client_body_timeout",
            GatewayError::ClientHeaderTimeout(_) => "client_header_timeout",
            GatewayError::HeaderTooLarge { .. } => "header_too_large",
            GatewayError::PayloadTooLarge { .. } => "body_too_large",
            GatewayError::NoEligibleTarget(_) => "no_eligible_target",
            GatewayError::ResponseHomeUnavailable { .. } => "response_home_unavailable",
            GatewayError::Overloaded { .. } | GatewayError::BodiesOverBudget { .. } => "overloaded",
            GatewayError::UpstreamConnect { .. } => "upstream_connect",
            GatewayError::UpstreamBroken { .. } => "upstream_broken",
            GatewayError::UpstreamTimeout { .. } => "upstream_timeout",
            GatewayError::UpstreamStatus { .. } => "upstream_status",
            GatewayError::Unauthorized => "invalid_api_key",
            GatewayError::ClientGone(_) => Self::CLIENT_GONE,
            GatewayError::ClientWriteTimeout(_) => Self::CLIENT_WRITE_TIMEOUT,
        }
    }

    /// OpenAI's error `type` field.
    fn openai_type(&self) -> &'static str {
        match self.status() {
            400..=499 => "invalid_request_error",
            503 => "service_unavailable",
            _ => "upstream_error",
        }
    }

    /// The OpenAI-shaped JSON body.
    pub fn body(&self) -> String {
        serde_json::json!({
            "error": {
                "message": self.to_string(),
                "type": self.openai_type(),
                "param": serde_json::Value::Null,
                "code": self.kind(),
            }
        })
        .to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_shape() {
        let e = GatewayError::PayloadTooLarge { limit: 10 };
        let v: serde_json::Value = serde_json::from_str(&e.body()).unwrap();
        assert_eq!(e.status(), 413);
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "body_too_large");
        assert!(v["error"]["message"].as_str().unwrap().contains("10 bytes"));
        assert!(v["error"]["param"].is_null());
        let t = GatewayError::UpstreamTimeout {
            target: "a/m".into(),
            reason: "read".into(),
        };
        assert_eq!(t.status(), 504);
        assert_eq!(GatewayError::NoEligibleTarget("m".into()).status(), 503);
        let o = GatewayError::Overloaded { limit: 4 };
        assert_eq!((o.status(), o.kind()), (503, "overloaded"));
    }
}
