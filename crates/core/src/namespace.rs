//! Tenant namespaces: the one place that says how a salt becomes the namespace its blocks are
//! hashed under, how that namespace travels to the engine, and how it is read back from the
//! engine's events.
//!
//! kv-epp forwards the resolved salt to the engine in the body's top-level `cache_salt` (vLLM and
//! TensorRT-LLM both read it), so the engine isolates its own cache reuse under the same tenant.
//! The engine then publishes the salt (vLLM: untagged, in the first block's extra keys) and every
//! replica must map such an event back to the tenant's namespace from the event alone.
//!
//! The rule:
//! - The *namespace* of a salt ([`Namespace::of`]) is the salt itself (exact Dynamo parity of
//!   routing hashes) when its forwarded form fits vLLM's 128-character limit, and
//!   `#sha256:<hex of SHA-256(salt)>` for longer salts. Routing hashes always use the namespace,
//!   so they equal the hashes computed from the events for every salt kv-epp accepts.
//! - The *hash seed* ([`seed`], [`seed_for`]) is [`HashSeed::new`] of the LoRA name and the
//!   namespace.
//! - The *forwarded form* ([`Namespace::forwarded`]) is `kvepp:` followed by the namespace with
//!   `%`, `@`, `/`, `\` and NUL percent-escaped (`%25`, `%40`, `%2F`, `%5C`, `%00`): always a
//!   vLLM-valid salt (non-empty, at most 128 characters, none of `@ / \ NUL`), and exactly
//!   invertible.
//! - *Decoding* ([`Namespace::decode`]): a string starting with `kvepp:` is a forwarded salt and
//!   is unescaped back to the namespace. Salts equal to a LoRA name, 64-hex salts, salts
//!   containing the tag, unicode salts all round-trip, because the tag is positional (a prefix)
//!   and escaping is total.
//! - *Sequence starts* ([`root_seed`]): the namespace of an event without a parent comes from its
//!   first block's extra keys: skip one leading string equal to the event's LoRA name (vLLM puts
//!   the adapter first); a string carrying the tag is the forwarded salt; no other string means
//!   unsalted; any other string (a salt kv-epp did not forward, an older engine's untagged key)
//!   or a second salt makes the namespace *untrusted*: its blocks are never credited to anyone
//!   (fail closed).
//!
//! Dependency direction: this module uses [`crate::salt`] (a resolved [`CacheSalt`]); `salt`
//! knows nothing of namespaces.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::hashing::HashSeed;
use crate::salt::CacheSalt;

/// Prefix of every salt kv-epp forwards.
pub const TAG: &str = "kvepp:";
/// vLLM 0.33's limit on `cache_salt`, in characters.
pub const ENGINE_MAX_CHARS: usize = 128;

/// The namespace a tenant's block hashes are computed under (see the module rule). A distinct
/// type, so a raw salt can never be passed where a namespace is meant. Like the salt it stems
/// from, it is a tenant secret: `Debug` redacts it and there is no `Display`.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Namespace(String);

impl Namespace {
    /// The namespace of a salt: the salt itself, or `#sha256:<hex>` when its forwarded form would
    /// exceed [`ENGINE_MAX_CHARS`]. Cost: one pass over the salt (plus SHA-256 for long ones).
    pub fn of(salt: &CacheSalt) -> Namespace {
        let s = salt.expose();
        if TAG.len() + escaped_chars(s) <= ENGINE_MAX_CHARS {
            Namespace(s.to_owned())
        } else {
            let digest = Sha256::digest(s.as_bytes());
            let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
            Namespace(format!("#sha256:{hex}"))
        }
    }

    /// The namespace carried by a forwarded salt, or `None` when `value` is not one kv-epp made.
    pub fn decode(value: &str) -> Option<Namespace> {
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
        (!out.is_empty()).then_some(Namespace(out))
    }

    /// The `cache_salt` value forwarded to the engine for this namespace.
    pub fn forwarded(&self) -> String {
        let mut out = String::with_capacity(TAG.len() + self.0.len());
        out.push_str(TAG);
        for c in self.0.chars() {
            if needs_escape(c) {
                out.push_str(&format!("%{:02X}", c as u32));
            } else {
                out.push(c);
            }
        }
        out
    }

    /// The namespace string, for hashing. Never log it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Namespace(<redacted>, {} bytes)", self.0.len())
    }
}

fn escaped_chars(s: &str) -> usize {
    s.chars().map(|c| if needs_escape(c) { 3 } else { 1 }).sum()
}

fn needs_escape(c: char) -> bool {
    matches!(c, '%' | '@' | '/' | '\\' | '\0')
}

/// Whether vLLM 0.33 accepts `value` as a `cache_salt`.
pub fn engine_accepts(value: &str) -> bool {
    let n = value.chars().count();
    n > 0 && n <= ENGINE_MAX_CHARS && !value.chars().any(needs_escape_for_engine)
}

fn needs_escape_for_engine(c: char) -> bool {
    matches!(c, '@' | '/' | '\\' | '\0')
}

/// The hash seed of a namespace (`None`: unsalted) under an optional LoRA adapter.
pub fn seed(namespace: Option<&Namespace>, lora_name: Option<&str>) -> HashSeed {
    HashSeed::new(lora_name, namespace.map(Namespace::expose))
}

/// The local-hash seed of a request with this salt and adapter: the salt enters through its
/// namespace, so routing hashes equal the hashes computed back from the engine's events.
pub fn seed_for(salt: Option<&CacheSalt>, lora_name: Option<&str>) -> HashSeed {
    seed(salt.map(Namespace::of).as_ref(), lora_name)
}

/// One extra key of an engine block, engine-neutral: decoders map their wire form onto it.
/// A string may be a tenant's salt, so `Debug` shows only its length.
#[derive(Clone, PartialEq, Eq)]
pub enum ExtraKey {
    /// A string: a LoRA name or a cache salt (published untagged by the engine).
    Str(String),
    /// Anything else (a multimodal `[id, offset]` pair, a prompt-embedding digest, ...): carries
    /// no namespace.
    Other,
}

impl fmt::Debug for ExtraKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExtraKey::Str(s) => write!(f, "Str(<redacted>, {} bytes)", s.len()),
            ExtraKey::Other => f.write_str("Other"),
        }
    }
}

/// The seed of a sequence start, from its first block's extra keys and the event's adapter;
/// `None` when the namespace cannot be trusted (the blocks are then never credited). See the
/// module rule.
pub fn root_seed(lora_name: Option<&str>, first_keys: &[ExtraKey]) -> Option<HashSeed> {
    let mut keys = first_keys.iter().peekable();
    if let (Some(lora), Some(ExtraKey::Str(first))) = (lora_name, keys.peek())
        && first == lora
    {
        keys.next();
    }
    let mut namespace = None;
    for k in keys {
        if let ExtraKey::Str(s) = k {
            match Namespace::decode(s) {
                Some(ns) if namespace.is_none() => namespace = Some(ns),
                _ => return None,
            }
        }
    }
    Some(seed(namespace.as_ref(), lora_name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::salt::SaltSource;

    fn salt(s: &str) -> CacheSalt {
        CacheSalt::new(s, SaltSource::Header).unwrap().unwrap()
    }

    fn fwd(s: &str) -> String {
        Namespace::of(&salt(s)).forwarded()
    }

    fn k(s: &str) -> ExtraKey {
        ExtraKey::Str(s.into())
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
            let fwd = fwd(s);
            assert!(engine_accepts(&fwd), "{s:?} -> {fwd:?}");
            assert_eq!(
                Namespace::decode(&fwd),
                Some(Namespace::of(&salt(s))),
                "{s:?}"
            );
        }
    }

    #[test]
    fn ordinary_salts_keep_their_own_namespace() {
        assert_eq!(Namespace::of(&salt("tenant-a")).expose(), "tenant-a");
        assert_eq!(fwd("tenant-a"), "kvepp:tenant-a");
        let long = Namespace::of(&salt(&"y".repeat(200)));
        assert!(long.expose().starts_with("#sha256:"));
        assert_ne!(long, Namespace::of(&salt(&"y".repeat(201))));
        // Near the limit: escaping counts.
        let just = "a".repeat(ENGINE_MAX_CHARS - TAG.len());
        assert_eq!(Namespace::of(&salt(&just)).expose(), just);
        let over = format!("/{}", "a".repeat(ENGINE_MAX_CHARS - TAG.len() - 1));
        assert!(Namespace::of(&salt(&over)).expose().starts_with("#sha256:"));
    }

    #[test]
    fn foreign_values_do_not_decode() {
        assert_eq!(Namespace::decode("tenant-a"), None);
        assert_eq!(Namespace::decode("kvepp:"), None);
        assert_eq!(Namespace::decode("kvepp:%4"), None);
        assert_eq!(
            Namespace::decode("kvepp:%41"),
            None,
            "escapes only what forwarding escapes"
        );
        assert!(!engine_accepts("a/b"));
        assert!(!engine_accepts(&"a".repeat(129)));
        assert!(!engine_accepts(""));
    }

    #[test]
    fn seeds_follow_the_namespace() {
        assert_eq!(seed_for(None, None), HashSeed::UNSALTED);
        assert_eq!(
            seed_for(Some(&salt("t")), Some("ad")),
            HashSeed::new(Some("ad"), Some("t"))
        );
        // A long salt is hashed under its digest namespace, not the raw salt.
        let long = salt(&"z".repeat(300));
        assert_eq!(
            seed_for(Some(&long), None),
            HashSeed::new(None, Some(Namespace::of(&long).expose()))
        );
        assert_ne!(
            seed_for(Some(&long), None),
            HashSeed::new(None, Some(long.expose()))
        );
    }

    #[test]
    fn debug_never_reveals_the_namespace() {
        let shown = format!(
            "{:?} {:?}",
            Namespace::of(&salt("super-secret-tenant")),
            [k(&fwd("super-secret-tenant"))]
        );
        assert!(!shown.contains("secret"), "{shown}");
    }

    #[test]
    fn namespace_rule() {
        // Unsalted, with and without an adapter.
        assert_eq!(root_seed(None, &[]), Some(HashSeed::UNSALTED));
        assert_eq!(
            root_seed(Some("ad"), &[k("ad")]),
            Some(HashSeed::new(Some("ad"), None))
        );
        // Salts, including one equal to the adapter's name and one containing the tag.
        for s in ["tenant-a", "ad", "kvepp:x", "a/b@c"] {
            assert_eq!(
                root_seed(None, &[k(&fwd(s))]),
                Some(seed_for(Some(&salt(s)), None)),
                "{s}"
            );
            assert_eq!(
                root_seed(Some("ad"), &[k("ad"), ExtraKey::Other, k(&fwd(s))]),
                Some(seed_for(Some(&salt(s)), Some("ad"))),
                "{s}"
            );
        }
        // Untrusted: a raw salt, two salts, an unexpected string.
        assert_eq!(root_seed(None, &[k("tenant-a")]), None);
        assert_eq!(root_seed(None, &[k(&fwd("a")), k(&fwd("b"))]), None);
        assert_eq!(root_seed(Some("ad"), &[k("other")]), None);
    }
}
