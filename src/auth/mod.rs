//! Bearer-token guards for the HTTP control ports: the admin API and `/metrics`.
//!
//! A [`Guard`] sits in front of a listener's routes: every request except its open paths must
//! carry `Authorization: Bearer <token>` that the guard's [`Verifier`] accepts, else it is
//! answered 401 (with `WWW-Authenticate: Bearer`), 403 (a Kubernetes user without the right) or
//! 503 (the Kubernetes API could not say), counted by reason and logged without the token.
//! Verifiers: a token file followed as it rotates ([`TokenFile`]), or the Kubernetes
//! TokenReview and SubjectAccessReview APIs behind a short cache (`reviews.rs`).
//!
//! [`constant_time_eq`] is the one token comparison of the crate (the peer API uses it too).

mod reviews;
mod token_file;

pub(crate) use reviews::Reviews;
pub use token_file::{RELOAD_INTERVAL, TokenFile, TokenFileError};

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::metrics::Metrics;

/// Compares two secrets in time that depends only on their lengths, not on where they differ.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Why a request was refused; `label` is the counter's `reason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No `Authorization` header.
    Missing,
    /// An `Authorization` header that is not a bearer token.
    Malformed,
    /// A bearer token that is not the configured one, or that Kubernetes does not authenticate.
    InvalidToken,
    /// A Kubernetes user who may not `get` the guarded path.
    Forbidden,
}

impl Refusal {
    fn label(self) -> &'static str {
        match self {
            Refusal::Missing => "missing",
            Refusal::Malformed => "malformed",
            Refusal::InvalidToken => "invalid_token",
            Refusal::Forbidden => "forbidden",
        }
    }

    fn status(self) -> StatusCode {
        match self {
            Refusal::Forbidden => StatusCode::FORBIDDEN,
            _ => StatusCode::UNAUTHORIZED,
        }
    }

    fn message(self) -> &'static str {
        match self {
            Refusal::Missing => "missing bearer token: send `Authorization: Bearer <token>`",
            Refusal::Malformed => "the Authorization header is not `Bearer <token>`",
            Refusal::InvalidToken => "invalid bearer token",
            Refusal::Forbidden => "this user may not read this path",
        }
    }
}

/// Why a verifier did not let a request through.
#[derive(Debug)]
pub(crate) enum Denied {
    /// 401 or 403.
    Refused(Refusal),
    /// 503: the verifier could not decide (the reason is logged, not sent).
    Unavailable(String),
}

/// A verifier's answer about one token: `Ok` lets the request through.
pub(crate) type Verdict = Result<(), Denied>;

/// What a guard checks tokens against.
pub(crate) enum Verifier {
    /// A static token in a file (followed as it rotates).
    TokenFile(TokenFile),
    /// Kubernetes TokenReview + SubjectAccessReview, cached.
    Kubernetes(Box<Reviews>),
}

impl Verifier {
    async fn verify(&self, token: &str) -> Verdict {
        match self {
            Verifier::TokenFile(file) if file.matches(token) => Ok(()),
            Verifier::TokenFile(_) => Err(Denied::Refused(Refusal::InvalidToken)),
            Verifier::Kubernetes(reviews) => reviews.verify(token).await,
        }
    }
}

/// The bearer token of a request, or why there is none.
fn bearer(headers: &HeaderMap) -> Result<&str, Refusal> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return Err(if headers.contains_key(header::AUTHORIZATION) {
            Refusal::Malformed
        } else {
            Refusal::Missing
        });
    };
    let value = value.to_str().map_err(|_| Refusal::Malformed)?;
    let (scheme, token) = value.split_once(' ').ok_or(Refusal::Malformed)?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() {
        return Err(Refusal::Malformed);
    }
    Ok(token)
}

/// Which listener a guard protects: its name in logs, realm and counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Listener {
    /// The admin API (`kv_epp_admin_unauthenticated_total`).
    Admin,
    /// `/metrics` (`kv_epp_metrics_unauthenticated_total`).
    Metrics,
}

impl Listener {
    fn name(self) -> &'static str {
        match self {
            Listener::Admin => "admin",
            Listener::Metrics => "metrics",
        }
    }
}

/// Bearer-token authentication in front of one listener's routes.
pub(crate) struct Guard {
    listener: Listener,
    verifier: Verifier,
    /// Paths answered without a token (the admin liveness route).
    open: &'static [&'static str],
    refused: Family<Vec<(String, String)>, Counter>,
}

impl Guard {
    /// A guard counting its refusals in `metrics`.
    pub(crate) fn new(
        listener: Listener,
        verifier: Verifier,
        open: &'static [&'static str],
        metrics: &Metrics,
    ) -> Guard {
        let refused = match listener {
            Listener::Admin => metrics.admin_unauthenticated.clone(),
            Listener::Metrics => metrics.metrics_unauthenticated.clone(),
        };
        Guard {
            listener,
            verifier,
            open,
            refused,
        }
    }

    /// `router` with every route behind this guard (the fallback included, so unknown paths do
    /// not reveal which ones exist).
    pub(crate) fn protect(self: Arc<Self>, router: axum::Router) -> axum::Router {
        router.layer(axum::middleware::from_fn_with_state(self, check))
    }

    fn refuse(&self, req: &Request, denied: Denied) -> Response {
        let peer = req
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0.to_string())
            .unwrap_or_default();
        let (reason, status, message) = match &denied {
            Denied::Refused(r) => (r.label(), r.status(), r.message()),
            Denied::Unavailable(_) => (
                "unavailable",
                StatusCode::SERVICE_UNAVAILABLE,
                "cannot check the token now; retry later",
            ),
        };
        self.refused
            .get_or_create(&Metrics::labels(&[("reason", reason)]))
            .inc();
        let listener = self.listener.name();
        let path = req.uri().path();
        match &denied {
            Denied::Unavailable(error) => {
                tracing::warn!(listener, path, %peer, %error, "request refused: the token could not be checked")
            }
            _ => tracing::warn!(listener, path, %peer, reason, "request refused"),
        }
        let body = serde_json::json!({"error": {"message": message, "code": status.as_u16()}});
        let mut response = (status, axum::Json(body)).into_response();
        if status == StatusCode::UNAUTHORIZED {
            let challenge = match denied {
                Denied::Refused(Refusal::InvalidToken) => {
                    format!("Bearer realm=\"kv-epp {listener}\", error=\"invalid_token\"")
                }
                _ => format!("Bearer realm=\"kv-epp {listener}\""),
            };
            if let Ok(v) = HeaderValue::from_str(&challenge) {
                response.headers_mut().insert(header::WWW_AUTHENTICATE, v);
            }
        }
        response
    }
}

async fn check(State(guard): State<Arc<Guard>>, req: Request, next: Next) -> Response {
    if guard.open.contains(&req.uri().path()) {
        return next.run(req).await;
    }
    let verdict = match bearer(req.headers()) {
        Ok(token) => guard.verifier.verify(token).await,
        Err(refusal) => Err(Denied::Refused(refusal)),
    };
    match verdict {
        Ok(()) => next.run(req).await,
        Err(denied) => guard.refuse(&req, denied),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn bearer_tokens_are_read_strictly() {
        assert_eq!(bearer(&headers(&["Bearer abc"])), Ok("abc"));
        assert_eq!(bearer(&headers(&["bearer  abc "])), Ok("abc"));
        assert_eq!(bearer(&headers(&[])), Err(Refusal::Missing));
        for bad in [
            "Basic YWxhZGRpbjpvcGVuc2VzYW1l",
            "Bearer",
            "Bearer   ",
            "abc",
        ] {
            assert_eq!(bearer(&headers(&[bad])), Err(Refusal::Malformed), "{bad}");
        }
        assert_eq!(
            bearer(&headers(&["Bearer a", "Bearer b"])),
            Err(Refusal::Malformed),
            "two credentials are ambiguous"
        );
    }

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"token", b"token"));
        assert!(!constant_time_eq(b"token", b"tokem"));
        assert!(!constant_time_eq(b"token", b"token2"));
        assert!(constant_time_eq(b"", b""));
    }
}
