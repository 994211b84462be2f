//! Every way kv-epp refuses a request, and how each refusal looks to the outside.
//!
//! The HTTP status, the `x-llm-d-request-dropped-reason` value, the OpenAI-style error body and
//! the `kv_epp_requests_total{outcome}` label of a refusal all come from [`Reject`]'s methods, so
//! the ext_proc edge and `POST /explain` cannot answer the same refusal differently. The reason
//! values are what gateways and the conformance suite already match on, so they keep their
//! historical spelling; the metric outcomes are one snake_case set, listed in README.md (a test
//! checks that every outcome is listed there).

use crate::request::RequestError;
use kv_epp_core::salt::SaltError;
use kv_epp_tokenize::TokenizeError;

/// The `outcome` label of a request that was routed.
pub const ROUTED: &str = "routed";
/// The `outcome` label counted (besides `routed`) when tokenization failed on kv-epp's side and
/// the request was routed on load alone.
pub const TOKENIZE_FAILED: &str = "tokenize_failed";

/// Why a request was refused. Each variant is one status, one reason and one metric outcome.
#[derive(Debug, thiserror::Error)]
pub enum Reject {
    /// The body is not a JSON object, has no `model`, or has malformed token IDs: 400.
    #[error(transparent)]
    BadRequest(#[from] RequestError),
    /// The salt is too long, repeated, not UTF-8, or required and missing: 400.
    #[error(transparent)]
    BadSalt(#[from] SaltError),
    /// The request could not be tokenized through the client's fault (bad messages, a template
    /// that raised, ...): 400.
    #[error("{error}")]
    BadPrompt {
        /// The served base model.
        model: String,
        /// What the tokenizer refused.
        error: TokenizeError,
    },
    /// The model is not served here and `unknown_model: reject` is set: 404.
    #[error("model `{0}` is not served here")]
    UnknownModel(String),
    /// The prompt is longer than the model's `max_prompt_tokens`: 400. Found before the
    /// prompt was tokenized whole (a bound from its length, or an early stop).
    #[error(
        "prompt is more than {max} tokens (at least {tokens}); model `{model}` accepts at most {max}"
    )]
    PromptTooLong {
        /// The base model.
        model: String,
        /// Prompt tokens counted before stopping (a lower bound of the prompt's size).
        tokens: usize,
        /// The limit.
        max: usize,
    },
    /// The body is larger than `routing.max_body_bytes`: 413 (found by the edge while buffering).
    #[error("request body exceeds the limit of {limit} bytes")]
    BodyTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// Envoy sent only part of the body (BUFFERED_PARTIAL over its buffer limit): 413 (found by
    /// the edge).
    #[error(
        "Envoy sent only the first part of the request body (BUFFERED_PARTIAL over its buffer \
         limit); kv-epp needs all of it to route and to forward the cache salt: use \
         FULL_DUPLEX_STREAMED, or raise the buffer limit"
    )]
    PartialBody,
    /// Envoy's request body mode (STREAMED, NONE) cannot carry a body-aware decision: 500
    /// (found by the edge at the request headers).
    #[error(
        "the ext_proc filter sends request bodies as {mode}, which cannot carry a routing \
         decision: set request_body_mode to FULL_DUPLEX_STREAMED (or BUFFERED)"
    )]
    UnsupportedBodyMode {
        /// The mode's name in Envoy's configuration.
        mode: &'static str,
    },
    /// Envoy sent nothing for `after_ms` milliseconds before the decision
    /// (`routing.stream_idle_timeout_ms`): 408 (found by the edge while waiting).
    #[error("no request data for {after_ms} ms")]
    StreamIdle {
        /// The idle limit in milliseconds.
        after_ms: u64,
    },
    /// Buffering the body would exceed the process-wide budget of buffered request bytes
    /// (`routing.max_buffered_body_bytes`): 503 (found by the edge while buffering).
    #[error("too many request bytes are buffered (budget {budget} bytes); try again")]
    BufferFull {
        /// The budget in bytes.
        budget: usize,
    },
    /// No ready endpoint serves the model (or none inside the subset hint): 503.
    #[error("no ready endpoint{scope}")]
    NoEndpoints {
        /// The served base model, when the request named one.
        model: Option<String>,
        /// `""`, or `" in the requested subset"` when a subset or conformance list narrowed it.
        scope: &'static str,
    },
    /// Every candidate is at its in-flight limit: 429 with `Retry-After`.
    #[error("every candidate endpoint is at its in-flight limit")]
    Saturated {
        /// The served base model, when the request named one.
        model: Option<String>,
    },
    /// Flow control: the queue is at one of its limits (total or the tenant's, requests or
    /// bytes): 429 with `Retry-After`.
    #[error("the request queue is full ({limit})")]
    QueueFull {
        /// The served base model, when the request named one.
        model: Option<String>,
        /// The configuration field of the limit that was reached.
        limit: &'static str,
    },
    /// Flow control: the request waited `flow_control.queue_timeout_ms` without capacity
    /// freeing up: 429 with `Retry-After`.
    #[error("no capacity freed up within {waited_ms} ms in the queue")]
    QueueTimeout {
        /// The served base model, when the request named one.
        model: Option<String>,
        /// How long it waited.
        waited_ms: u64,
    },
    /// Quota: the tenant already has its `max_inflight` requests in flight: 429 with
    /// `Retry-After`.
    #[error("the tenant has {limit} requests in flight, its limit")]
    TenantInflight {
        /// The served base model, when the request named one.
        model: Option<String>,
        /// The tenant's in-flight limit.
        limit: u32,
    },
    /// Quota: the tenant's token rate (prompt + expected decode tokens per second) is used up:
    /// 429 with `Retry-After` (when the tenant's bucket will hold the request again).
    #[error("the tenant's token rate of {tokens_per_second}/s is used up")]
    TenantRate {
        /// The served base model, when the request named one.
        model: Option<String>,
        /// The tenant's rate.
        tokens_per_second: u64,
        /// Seconds until the request would fit.
        retry_after: u32,
    },
}

impl Reject {
    /// The HTTP status of the local reply.
    pub fn status(&self) -> u16 {
        match self {
            Reject::BadRequest(_)
            | Reject::BadSalt(_)
            | Reject::BadPrompt { .. }
            | Reject::PromptTooLong { .. } => 400,
            Reject::UnknownModel(_) => 404,
            Reject::StreamIdle { .. } => 408,
            Reject::BodyTooLarge { .. } | Reject::PartialBody => 413,
            Reject::UnsupportedBodyMode { .. } => 500,
            Reject::Saturated { .. }
            | Reject::QueueFull { .. }
            | Reject::QueueTimeout { .. }
            | Reject::TenantInflight { .. }
            | Reject::TenantRate { .. } => 429,
            Reject::NoEndpoints { .. } | Reject::BufferFull { .. } => 503,
        }
    }

    /// The `x-llm-d-request-dropped-reason` header value (also the error body's `type`).
    pub fn reason(&self) -> &'static str {
        match self {
            Reject::BadRequest(_) | Reject::BadPrompt { .. } => "bad-request",
            Reject::BadSalt(_) => "bad-cache-salt",
            Reject::UnknownModel(_) => "model-not-found",
            Reject::PromptTooLong { .. } => "prompt-too-long",
            Reject::BodyTooLarge { .. } | Reject::PartialBody => "body-too-large",
            Reject::UnsupportedBodyMode { .. } => "unsupported-body-mode",
            Reject::StreamIdle { .. } => "stream-idle-timeout",
            Reject::BufferFull { .. } => "rejected-buffer-full",
            Reject::NoEndpoints { .. } => "rejected-no-endpoints",
            Reject::Saturated { .. } => "rejected-saturated",
            Reject::QueueFull { .. } => "rejected-queue-full",
            Reject::QueueTimeout { .. } => "rejected-queue-timeout",
            Reject::TenantInflight { .. } => "rejected-tenant-inflight-limit",
            Reject::TenantRate { .. } => "rejected-tenant-rate-limit",
        }
    }

    /// The `outcome` label of `kv_epp_requests_total`.
    pub fn outcome(&self) -> &'static str {
        match self {
            Reject::BadRequest(_) | Reject::BadPrompt { .. } => "rejected_bad_request",
            Reject::BadSalt(_) => "rejected_bad_salt",
            Reject::UnknownModel(_) => "rejected_unknown_model",
            Reject::PromptTooLong { .. } => "rejected_prompt_too_long",
            Reject::BodyTooLarge { .. } | Reject::PartialBody => "rejected_too_large",
            Reject::UnsupportedBodyMode { .. } => "rejected_body_mode",
            Reject::StreamIdle { .. } => "rejected_idle_timeout",
            Reject::BufferFull { .. } => "rejected_buffer_full",
            Reject::NoEndpoints { .. } => "rejected_no_endpoints",
            Reject::Saturated { .. } => "rejected_saturated",
            Reject::QueueFull { .. } => "rejected_queue_full",
            Reject::QueueTimeout { .. } => "rejected_queue_timeout",
            Reject::TenantInflight { .. } => "rejected_tenant_inflight",
            Reject::TenantRate { .. } => "rejected_tenant_rate",
        }
    }

    /// The `model` label of `kv_epp_requests_total`: the served base model the request resolved
    /// to, `unknown` for a model that is not served, or empty when the body was not read. Never
    /// the client's own string, so clients cannot mint metric series.
    pub(crate) fn model_label(&self) -> &str {
        match self {
            Reject::BadPrompt { model, .. } | Reject::PromptTooLong { model, .. } => model,
            Reject::UnknownModel(_) => "unknown",
            Reject::NoEndpoints { model, .. }
            | Reject::Saturated { model }
            | Reject::QueueFull { model, .. }
            | Reject::QueueTimeout { model, .. }
            | Reject::TenantInflight { model, .. }
            | Reject::TenantRate { model, .. } => model.as_deref().unwrap_or(""),
            Reject::BadRequest(_)
            | Reject::BadSalt(_)
            | Reject::BodyTooLarge { .. }
            | Reject::PartialBody
            | Reject::UnsupportedBodyMode { .. }
            | Reject::StreamIdle { .. }
            | Reject::BufferFull { .. } => "",
        }
    }

    /// Whether the reply carries `Retry-After` (the client may try again shortly).
    pub(crate) fn retry_later(&self) -> bool {
        self.status() == 429
    }

    /// The reply's headers besides the body's content type: the dropped reason, and
    /// `Retry-After: retry_after_seconds` when the client may try again shortly. Every edge
    /// answers with exactly these.
    pub fn headers(&self, retry_after_seconds: u32) -> Vec<(&'static str, String)> {
        let mut h = vec![("x-llm-d-request-dropped-reason", self.reason().to_owned())];
        if self.retry_later() {
            let seconds = match self {
                Reject::TenantRate { retry_after, .. } => retry_after_seconds.max(*retry_after),
                _ => retry_after_seconds,
            };
            h.push(("retry-after", seconds.to_string()));
        }
        h
    }

    /// The OpenAI-style error body: `{"error": {"message", "type", "code"}}`.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {"message": self.to_string(), "type": self.reason(), "code": self.status()}
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One value of every variant. The match below stops compiling when a variant is added, so
    /// a new refusal cannot skip the README check.
    fn every_variant() -> Vec<Reject> {
        let all = vec![
            Reject::BadRequest(RequestError::MissingModel),
            Reject::BadSalt(SaltError::HeaderRepeated),
            Reject::BadPrompt {
                model: "m".into(),
                error: TokenizeError::UnknownModel("m".into()),
            },
            Reject::UnknownModel("m".into()),
            Reject::PromptTooLong {
                model: "m".into(),
                tokens: 9,
                max: 8,
            },
            Reject::BodyTooLarge { limit: 1 },
            Reject::PartialBody,
            Reject::UnsupportedBodyMode { mode: "STREAMED" },
            Reject::StreamIdle { after_ms: 1 },
            Reject::BufferFull { budget: 1 },
            Reject::NoEndpoints {
                model: None,
                scope: "",
            },
            Reject::Saturated { model: None },
            Reject::QueueFull {
                model: None,
                limit: "flow_control.max_queued_requests",
            },
            Reject::QueueTimeout {
                model: None,
                waited_ms: 1,
            },
            Reject::TenantInflight {
                model: None,
                limit: 1,
            },
            Reject::TenantRate {
                model: None,
                tokens_per_second: 1,
                retry_after: 1,
            },
        ];
        for r in &all {
            match r {
                Reject::BadRequest(_)
                | Reject::BadSalt(_)
                | Reject::BadPrompt { .. }
                | Reject::UnknownModel(_)
                | Reject::PromptTooLong { .. }
                | Reject::BodyTooLarge { .. }
                | Reject::PartialBody
                | Reject::UnsupportedBodyMode { .. }
                | Reject::StreamIdle { .. }
                | Reject::BufferFull { .. }
                | Reject::NoEndpoints { .. }
                | Reject::Saturated { .. }
                | Reject::QueueFull { .. }
                | Reject::QueueTimeout { .. }
                | Reject::TenantInflight { .. }
                | Reject::TenantRate { .. } => {}
            }
        }
        all
    }

    /// The README's list of outcome labels: the `` `label` `` items of the section that
    /// documents `kv_epp_requests_total{outcome}`.
    fn readme_outcomes() -> Vec<String> {
        let readme = include_str!("../../README.md");
        let start = readme
            .find("<!-- outcomes -->")
            .expect("README.md marks the outcome list with <!-- outcomes -->");
        let end = start
            + readme[start..]
                .find("<!-- /outcomes -->")
                .expect("README.md closes the outcome list with <!-- /outcomes -->");
        readme[start..end]
            .lines()
            .filter_map(|l| l.trim().strip_prefix("- `"))
            .filter_map(|l| l.split('`').next())
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn every_outcome_is_documented_in_the_readme_in_one_style() {
        let listed = readme_outcomes();
        let mut labels: Vec<&str> = every_variant().iter().map(Reject::outcome).collect();
        labels.extend([ROUTED, TOKENIZE_FAILED]);
        for label in &labels {
            assert!(
                listed.iter().any(|l| l == label),
                "outcome `{label}` is not in README.md's list {listed:?}"
            );
            assert!(
                label.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
                "outcome `{label}` is not snake_case"
            );
        }
        for l in &listed {
            assert!(
                labels.contains(&l.as_str()),
                "README lists `{l}`, never counted"
            );
        }
    }

    #[test]
    fn status_reason_and_body_agree() {
        for r in every_variant() {
            let body = r.body();
            assert_eq!(body["error"]["code"], r.status());
            assert_eq!(body["error"]["type"], r.reason());
            assert_eq!(body["error"]["message"], r.to_string());
            assert!((400..600).contains(&r.status()));
        }
        assert!(Reject::Saturated { model: None }.retry_later());
    }

    #[test]
    fn headers_carry_the_reason_and_retry_after_only_when_retrying_helps() {
        for r in every_variant() {
            let h = r.headers(7);
            assert_eq!(
                h[0],
                ("x-llm-d-request-dropped-reason", r.reason().to_owned())
            );
            let retry = h.iter().find(|(k, _)| *k == "retry-after");
            assert_eq!(retry.is_some(), r.status() == 429, "{r}");
            if let Some((_, v)) = retry {
                assert_eq!(v, "7");
            }
        }
    }

    #[test]
    fn a_client_chosen_model_name_never_becomes_a_metric_label() {
        let r = Reject::UnknownModel("anything-a-client-sends-0001".into());
        assert_eq!(r.model_label(), "unknown");
        assert!(r.to_string().contains("anything-a-client-sends-0001"));
    }
}
