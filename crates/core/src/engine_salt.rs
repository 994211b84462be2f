//! How a tenant's salt travels to the engine and back.
//!
//! kv-epp forwards the resolved salt to the engine in the body's top-level `cache_salt` (vLLM and
//! TensorRT-LLM both read it), so the engine isolates its own cache reuse under the same tenant.
//! The engine then publishes the salt (vLLM: untagged, in the first block's extra keys) and every
//! replica must map such an event back to the tenant's namespace from the event alone.
//!
//! The rule:
//! - The *namespace* of a salt is the salt itself (exact Dynamo parity of routing hashes) when its
//!   forwarded form fits vLLM's 128-character limit, and `#sha256:<hex of SHA-256(salt)>` for
//!   longer salts. Routing hashes always use the namespace, so they equal the hashes computed from
//!   the events for every salt kv-epp accepts.
//! - The *forwarded form* is `kvepp:` followed by the namespace with `%`, `@`, `/`, `\` and NUL
//!   percent-escaped (`%25`, `%40`, `%2F`, `%5C`, `%00`): always a vLLM-valid salt (non-empty, at
//!   most 128 characters, none of `@ / \ NUL`), and exactly invertible.
//! - Decoding: a string extra key starting with `kvepp:` is a salt and is unescaped back to the
//!   namespace. Salts equal to a LoRA name, 64-hex salts, salts containing the tag, unicode salts
//!   all round-trip, because the tag is positional (a prefix) and escaping is total.

use sha2::{Digest, Sha256};

use crate::salt::CacheSalt;

/// Prefix of every salt kv-epp forwards.
pub const TAG: &str = "kvepp:";
/// vLLM 0.33's limit on `cache_salt`, in characters.
pub const ENGINE_MAX_CHARS: usize = 128;

/// The namespace string a salt's hashes are computed under (see the module rule).
pub fn namespace(salt: &CacheSalt) -> String {
    let s = salt.expose();
    if TAG.len() + escaped_chars(s) <= ENGINE_MAX_CHARS {
        s.to_owned()
    } else {
        let digest = Sha256::digest(s.as_bytes());
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        format!("#sha256:{hex}")
    }
}

fn escaped_chars(s: &str) -> usize {
    s.chars().map(|c| if needs_escape(c) { 3 } else { 1 }).sum()
}

fn needs_escape(c: char) -> bool {
    matches!(c, '%' | '@' | '/' | '\\' | '\0')
}

/// The `cache_salt` value forwarded to the engine for a salt.
pub fn forwarded(salt: &CacheSalt) -> String {
    let ns = namespace(salt);
    let mut out = String::with_capacity(TAG.len() + ns.len());
    out.push_str(TAG);
    for c in ns.chars() {
        if needs_escape(c) {
            out.push_str(&format!("%{:02X}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

/// The namespace carried by a forwarded salt, or `None` when `value` is not one kv-epp made.
pub fn decode(value: &str) -> Option<String> {
    let body = value.strip_prefix(TAG)?;
    let mut out = String::with_capacity(body.len());
    let mut chars = body.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let hi = chars.next()?.to_digit(16)?;
        let lo = chars.next()?.to_digit(16)?;
        let decoded = char::from_u32(hi * 16 + lo)?;
        if !needs_escape(decoded) {
            return None; // not produced by `forwarded`
        }
        out.push(decoded);
    }
    (!out.is_empty()).then_some(out)
}

/// Whether vLLM 0.33 accepts `value` as a `cache_salt`.
pub fn engine_accepts(value: &str) -> bool {
    let n = value.chars().count();
    n > 0 && n <= ENGINE_MAX_CHARS && !value.chars().any(needs_escape_for_engine)
}

fn needs_escape_for_engine(c: char) -> bool {
    matches!(c, '@' | '/' | '\\' | '\0')
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::salt::SaltSource;

    fn salt(s: &str) -> CacheSalt {
        CacheSalt::new(s, SaltSource::Header).unwrap().unwrap()
    }

    #[test]
    fn round_trips_every_kind_of_salt() {
        let long = "x".repeat(1024);
        let cases = [
            "tenant-a",
            "adapter-a", // equal to a LoRA name
            "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", // 64-hex
            "kvepp:tenant", // contains the tag
            "org/team@corp\\x",
            "100%",
            "ünïcødé 租户 🚀",
            "nul\0byte",
            &long,
        ];
        for s in cases {
            let fwd = forwarded(&salt(s));
            assert!(engine_accepts(&fwd), "{s:?} -> {fwd:?}");
            assert_eq!(decode(&fwd), Some(namespace(&salt(s))), "{s:?}");
        }
    }

    #[test]
    fn ordinary_salts_keep_their_own_namespace() {
        assert_eq!(namespace(&salt("tenant-a")), "tenant-a");
        assert_eq!(forwarded(&salt("tenant-a")), "kvepp:tenant-a");
        let long = salt(&"y".repeat(200));
        assert!(namespace(&long).starts_with("#sha256:"));
        assert_ne!(namespace(&long), namespace(&salt(&"y".repeat(201))));
        // Near the limit: escaping counts.
        let just = "a".repeat(ENGINE_MAX_CHARS - TAG.len());
        assert_eq!(namespace(&salt(&just)), just);
        let over = format!("/{}", "a".repeat(ENGINE_MAX_CHARS - TAG.len() - 1));
        assert!(namespace(&salt(&over)).starts_with("#sha256:"));
    }

    #[test]
    fn foreign_values_do_not_decode() {
        assert_eq!(decode("tenant-a"), None);
        assert_eq!(decode("kvepp:"), None);
        assert_eq!(decode("kvepp:%4"), None);
        assert_eq!(
            decode("kvepp:%41"),
            None,
            "escapes only what forwarding escapes"
        );
        assert!(!engine_accepts("a/b"));
        assert!(!engine_accepts(&"a".repeat(129)));
        assert!(!engine_accepts(""));
    }
}
