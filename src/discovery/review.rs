//! Who a bearer token belongs to, and whether that user may read a path: the Kubernetes
//! TokenReview (`authentication.k8s.io/v1`) and SubjectAccessReview (`authorization.k8s.io/v1`,
//! verb `get` on a non-resource URL) APIs, as the API server itself checks a request to
//! `/metrics`. Both are `create` calls on cluster-scoped resources; nothing is stored.

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};

/// The API's answer about one token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Review {
    /// The token is valid and its user may `get` the path.
    Allowed {
        /// The authenticated user name.
        user: String,
    },
    /// The token is not valid (unknown, expired, revoked).
    Unauthenticated,
    /// The token is valid but its user may not `get` the path.
    Forbidden {
        /// The authenticated user name.
        user: String,
        /// The authorizer's reason, when it gave one.
        reason: String,
    },
}

/// A review could not be made (API unreachable, refused our own credentials, bad answer).
#[derive(Debug, thiserror::Error)]
#[error("{step}: {message}")]
pub struct ReviewError {
    /// `TokenReview` or `SubjectAccessReview`.
    pub step: &'static str,
    /// What went wrong.
    pub message: String,
}

/// Reviews tokens presented for one non-resource path (e.g. `/metrics`).
pub struct TokenReviewer {
    client: kube::Client,
    path: &'static str,
}

impl TokenReviewer {
    /// A reviewer for `path` using `client`'s credentials (which need `create` on
    /// `tokenreviews` and `subjectaccessreviews`).
    pub fn new(client: kube::Client, path: &'static str) -> TokenReviewer {
        TokenReviewer { client, path }
    }

    /// The guarded path.
    pub fn path(&self) -> &'static str {
        self.path
    }

    /// Two API calls: TokenReview, then (for a valid token) SubjectAccessReview.
    pub async fn review(&self, token: &str) -> Result<Review, ReviewError> {
        let tokens: Api<TokenReview> = Api::all(self.client.clone());
        let asked = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                ..Default::default()
            },
            ..Default::default()
        };
        let answer = tokens
            .create(&PostParams::default(), &asked)
            .await
            .map_err(|e| ReviewError {
                step: "TokenReview",
                message: e.to_string(),
            })?;
        let status = answer.status.unwrap_or_default();
        let Some(info) = status.user.filter(|_| status.authenticated == Some(true)) else {
            return Ok(Review::Unauthenticated);
        };
        let user = info.username.clone().unwrap_or_default();
        let access: Api<SubjectAccessReview> = Api::all(self.client.clone());
        let asked = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: info.username,
                groups: info.groups,
                uid: info.uid,
                extra: info.extra,
                non_resource_attributes: Some(NonResourceAttributes {
                    path: Some(self.path.to_owned()),
                    verb: Some("get".to_owned()),
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let answer = access
            .create(&PostParams::default(), &asked)
            .await
            .map_err(|e| ReviewError {
                step: "SubjectAccessReview",
                message: e.to_string(),
            })?;
        let status = answer.status.unwrap_or_default();
        if status.allowed {
            Ok(Review::Allowed { user })
        } else {
            Ok(Review::Forbidden {
                user,
                reason: status.reason.unwrap_or_default(),
            })
        }
    }
}
