//! Cache salt resolution: the one place that decides a request's tenant salt (which namespace
//! that salt hashes under, and how it travels to the engine, is [`crate::namespace`]'s; this
//! module knows nothing of either).
//!
//! Precedence, first non-empty wins: the `x-tenant-id` header, then the body's
//! `nvext.cache_salt`, then the body's top-level `cache_salt`. Empty strings are absent at every
//! level; non-string values are not salts; a salt longer than [`MAX_SALT_BYTES`] is an error.
//! Which sources are trusted, and whether a salt is required, is a per-deployment
//! [`SaltPolicy`].
//!
//! Every entry point (ext_proc, the query API, the CLI) calls [`resolve`]; none reads salts
//! itself. [`CacheSalt`] never formats its value: logs use [`crate::fingerprint::Fingerprint`].

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::fingerprint::{Fingerprint, FingerprintKey};

/// The header a gateway sets from the authenticated identity.
pub const TENANT_HEADER: &str = "x-tenant-id";
/// Longest salt accepted, in bytes.
pub const MAX_SALT_BYTES: usize = 1024;

/// A non-empty, length-checked cache salt. Its value is a tenant secret: `Debug` redacts it and
/// there is no `Display`.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct CacheSalt(Box<str>);

impl CacheSalt {
    /// Validates a salt value: `Ok(None)` for the empty string (absent), an error when too long.
    pub fn new(value: &str, source: SaltSource) -> Result<Option<CacheSalt>, SaltError> {
        if value.is_empty() {
            return Ok(None);
        }
        if value.len() > MAX_SALT_BYTES {
            return Err(SaltError::TooLong {
                from: source,
                len: value.len(),
            });
        }
        Ok(Some(CacheSalt(value.into())))
    }

    /// The raw value, for hashing and for forwarding to the engine. Never log it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The keyed fingerprint to use wherever the salt must be identified in logs or metrics.
    pub fn fingerprint(&self, key: &FingerprintKey) -> Fingerprint {
        key.fingerprint(self.0.as_bytes())
    }
}

impl fmt::Debug for CacheSalt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CacheSalt(<redacted>, {} bytes)", self.0.len())
    }
}

/// Where a resolved salt came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SaltSource {
    /// The `x-tenant-id` request header.
    Header,
    /// The body's `nvext.cache_salt`.
    Nvext,
    /// The body's top-level `cache_salt`.
    Body,
}

impl SaltSource {
    /// The name used in configuration, metrics and errors.
    pub fn as_str(self) -> &'static str {
        match self {
            SaltSource::Header => "header",
            SaltSource::Nvext => "nvext",
            SaltSource::Body => "body",
        }
    }
}

/// How one salt field of the request body looked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SaltField<'a> {
    /// The field is missing or `null`.
    #[default]
    Absent,
    /// The field holds a number, object, array or boolean: not a salt.
    NotString,
    /// The field holds a string (possibly empty).
    Str(&'a str),
}

/// The raw salt-bearing parts of one request, as the edge found them.
#[derive(Clone, Copy, Debug, Default)]
pub struct SaltInputs<'a> {
    /// Every value of the `x-tenant-id` header (normally zero or one).
    pub header: &'a [&'a [u8]],
    /// The body's `nvext.cache_salt`.
    pub nvext: SaltField<'a>,
    /// The body's top-level `cache_salt`.
    pub body: SaltField<'a>,
}

/// Which salt sources a deployment trusts, and whether a request must carry a salt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SaltPolicy {
    /// Trusted sources, in any order; precedence is always header, nvext, body.
    pub sources: Vec<SaltSource>,
    /// Reject (400) a request that resolves to no salt.
    pub required: bool,
}

impl Default for SaltPolicy {
    fn default() -> Self {
        SaltPolicy {
            sources: vec![SaltSource::Header, SaltSource::Nvext, SaltSource::Body],
            required: false,
        }
    }
}

impl SaltPolicy {
    fn trusts(&self, source: SaltSource) -> bool {
        self.sources.contains(&source)
    }
}

/// A request's resolved salt and its source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedSalt {
    /// The salt.
    pub salt: CacheSalt,
    /// Where it came from.
    pub source: SaltSource,
}

/// Why a request's salt could not be resolved. Each maps to a 400 at the edge.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SaltError {
    /// A salt longer than [`MAX_SALT_BYTES`].
    #[error("cache salt from {} is {len} bytes; at most {MAX_SALT_BYTES} are allowed", from.as_str())]
    TooLong {
        /// Where the salt came from.
        from: SaltSource,
        /// Its length in bytes.
        len: usize,
    },
    /// The `x-tenant-id` header is not valid UTF-8.
    #[error("header x-tenant-id is not valid UTF-8")]
    HeaderNotUtf8,
    /// More than one `x-tenant-id` header value.
    #[error("header x-tenant-id appears more than once")]
    HeaderRepeated,
    /// The policy requires a salt and the request carries none from a trusted source.
    #[error("a cache salt is required (trusted sources: {trusted})")]
    Required {
        /// The trusted sources, comma-separated.
        trusted: String,
    },
}

/// Resolves a request's salt under `policy`. `Ok(None)` means unsalted.
pub fn resolve(
    inputs: &SaltInputs<'_>,
    policy: &SaltPolicy,
) -> Result<Option<ResolvedSalt>, SaltError> {
    let found = first_salt(inputs, policy)?;
    if found.is_none() && policy.required {
        let trusted: Vec<&str> = policy.sources.iter().map(|s| s.as_str()).collect();
        return Err(SaltError::Required {
            trusted: trusted.join(","),
        });
    }
    Ok(found)
}

fn first_salt(
    inputs: &SaltInputs<'_>,
    policy: &SaltPolicy,
) -> Result<Option<ResolvedSalt>, SaltError> {
    if policy.trusts(SaltSource::Header) {
        match inputs.header {
            [] => {}
            [one] => {
                let text = std::str::from_utf8(one).map_err(|_| SaltError::HeaderNotUtf8)?;
                if let Some(salt) = CacheSalt::new(text, SaltSource::Header)? {
                    return Ok(Some(ResolvedSalt {
                        salt,
                        source: SaltSource::Header,
                    }));
                }
            }
            _ => return Err(SaltError::HeaderRepeated),
        }
    }
    for (source, field) in [
        (SaltSource::Nvext, inputs.nvext),
        (SaltSource::Body, inputs.body),
    ] {
        if !policy.trusts(source) {
            continue;
        }
        if let SaltField::Str(text) = field
            && let Some(salt) = CacheSalt::new(text, source)?
        {
            return Ok(Some(ResolvedSalt { salt, source }));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<'a>(
        header: &'a [&'a [u8]],
        nvext: SaltField<'a>,
        body: SaltField<'a>,
        policy: &SaltPolicy,
    ) -> Result<Option<(String, SaltSource)>, SaltError> {
        let inputs = SaltInputs {
            header,
            nvext,
            body,
        };
        Ok(resolve(&inputs, policy)?.map(|r| (r.salt.expose().to_owned(), r.source)))
    }

    use SaltField::{Absent, NotString, Str};

    #[test]
    fn precedence_header_nvext_body() {
        let p = SaltPolicy::default();
        assert_eq!(
            run(&[b"h"], Str("n"), Str("b"), &p).unwrap(),
            Some(("h".into(), SaltSource::Header))
        );
        assert_eq!(
            run(&[], Str("n"), Str("b"), &p).unwrap(),
            Some(("n".into(), SaltSource::Nvext))
        );
        assert_eq!(
            run(&[], Absent, Str("b"), &p).unwrap(),
            Some(("b".into(), SaltSource::Body))
        );
        assert_eq!(run(&[], Absent, Absent, &p).unwrap(), None);
    }

    #[test]
    fn empty_is_absent_at_every_level() {
        let p = SaltPolicy::default();
        assert_eq!(
            run(&[b""], Str(""), Str("b"), &p).unwrap(),
            Some(("b".into(), SaltSource::Body))
        );
        assert_eq!(
            run(&[b""], Str("n"), Str(""), &p).unwrap(),
            Some(("n".into(), SaltSource::Nvext))
        );
        assert_eq!(run(&[b""], Str(""), Str(""), &p).unwrap(), None);
    }

    #[test]
    fn non_strings_are_not_salts() {
        let p = SaltPolicy::default();
        assert_eq!(
            run(&[], NotString, Str("b"), &p).unwrap(),
            Some(("b".into(), SaltSource::Body))
        );
        assert_eq!(run(&[], NotString, NotString, &p).unwrap(), None);
    }

    #[test]
    fn over_long_salt_is_an_error_naming_the_source() {
        let p = SaltPolicy::default();
        let long = "x".repeat(MAX_SALT_BYTES + 1);
        let exact = "x".repeat(MAX_SALT_BYTES);
        let err = run(&[], Str(&long), Absent, &p).unwrap_err();
        assert_eq!(
            err,
            SaltError::TooLong {
                from: SaltSource::Nvext,
                len: MAX_SALT_BYTES + 1
            }
        );
        assert!(err.to_string().contains("nvext"));
        assert!(run(&[], Str(&exact), Absent, &p).unwrap().is_some());
        // The header wins, so an over-long body salt it replaces is not looked at.
        assert!(run(&[b"h"], Str(&long), Absent, &p).is_ok());
    }

    #[test]
    fn header_errors() {
        let p = SaltPolicy::default();
        assert_eq!(
            run(&[b"\xff"], Absent, Absent, &p).unwrap_err(),
            SaltError::HeaderNotUtf8
        );
        assert_eq!(
            run(&[b"a", b"b"], Absent, Absent, &p).unwrap_err(),
            SaltError::HeaderRepeated
        );
    }

    #[test]
    fn policy_restricts_sources_and_can_require() {
        let header_only = SaltPolicy {
            sources: vec![SaltSource::Header],
            required: true,
        };
        assert_eq!(
            run(&[b"h"], Str("n"), Str("b"), &header_only).unwrap(),
            Some(("h".into(), SaltSource::Header))
        );
        let err = run(&[], Str("n"), Str("b"), &header_only).unwrap_err();
        assert!(matches!(err, SaltError::Required { .. }));
        let body_only = SaltPolicy {
            sources: vec![SaltSource::Body],
            required: false,
        };
        assert_eq!(
            run(&[b"h"], Str("n"), Str("b"), &body_only).unwrap(),
            Some(("b".into(), SaltSource::Body))
        );
    }

    #[test]
    fn debug_never_reveals_the_salt() {
        let s = CacheSalt::new("super-secret-tenant", SaltSource::Header)
            .unwrap()
            .unwrap();
        let shown = format!("{s:?}");
        assert!(!shown.contains("super-secret"));
        let key = FingerprintKey::from_passphrase("k");
        assert!(!format!("{:?} {}", s.fingerprint(&key), s.fingerprint(&key)).contains("secret"));
    }
}
