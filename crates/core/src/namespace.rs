//! Tenant namespaces: the one place that says how a salt becomes the namespace its blocks are
//! hashed under, how that namespace travels to the engine, and how it is read back from the
//! engine's events.
//!
//! kv-epp forwards the resolved salt to the engine in the body's top-level `cache_salt` (vLLM,
//! SGLang and TensorRT-LLM all read it; SGLang takes any string, so vLLM's stricter rule, which
//! the forwarded form meets, serves all three), so the engine isolates its own cache reuse under
//! the same tenant. The engine then publishes the salt (vLLM: untagged, in the first block's extra
//! keys; SGLang: in the event's own `cache_salt`) and every replica must map such an event back to
//! the tenant's namespace from the event alone.
//!
//! The rule:
//! - The *namespace* of a salt ([`Namespace::of`]) is either the salt itself (exact Dynamo
//!   parity of routing hashes) when its forwarded form fits vLLM's 128-character limit, or the
//!   SHA-256 digest of a longer salt. The two are different kinds of value, never strings that
//!   could coincide: no literal salt, whatever its characters, shares a namespace with a digest.
//!   Routing hashes always use the namespace, so they equal the hashes computed from the events
//!   for every salt kv-epp accepts.
//! - The *hash seed* ([`seed`], [`seed_for`]) of a salt namespace is [`HashSeed::new`] of the
//!   LoRA name and the salt; of a digest namespace, [`HashSeed::with_salt_digest`] (a seed of its
//!   own, so a digest never hashes like a salt spelled with the same bytes).
//! - The *forwarded form* ([`Namespace::forwarded`]) of a salt namespace is `kvepp:` followed by
//!   the salt with `%`, `@`, `/`, `\` and NUL percent-escaped (`%25`, `%40`, `%2F`, `%5C`, `%00`);
//!   of a digest, `kvepp:%sha256:` and 64 lowercase hex digits. Escaping never writes `%`
//!   followed by `s`, so no salt's forwarded form starts like a digest's. Both are always
//!   vLLM-valid salts (non-empty, at most 128 characters, none of `@ / \ NUL`).
//! - *Decoding* ([`Namespace::decode`]) is the exact inverse: a string starting with `kvepp:` is
//!   a forwarded salt or digest; anything `forwarded` cannot produce decodes to `None`. Salts equal
//!   to a LoRA name, 64-hex salts, salts containing the tag or looking like a digest's form,
//!   unicode salts: all round-trip, because the tag is positional (a prefix) and escaping is
//!   total. Distinct salts therefore get distinct namespaces and distinct forwarded values (up to
//!   SHA-256 collisions among salts longer than the limit).
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
/// What follows [`TAG`] in the forwarded form of a digest namespace (escaping never writes `%s`).
const DIGEST_MARK: &str = "%sha256:";
/// vLLM 0.33's limit on `cache_salt`, in characters.
pub const ENGINE_MAX_CHARS: usize = 128;

/// The namespace a tenant's block hashes are computed under (see the module rule). A distinct
/// type, so a raw salt can never be passed where a namespace is meant. Like the salt it stems
/// from, it is a tenant secret: `Debug` redacts it and there is no `Display`.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Namespace(Form);

/// The two kinds of namespace: they never compare equal to each other.
#[derive(Clone, PartialEq, Eq, Hash)]
enum Form {
    /// A salt whose forwarded form fits the engine's limit: the salt itself.
    Salt(String),
    /// A longer salt: its SHA-256 digest.
    Digest([u8; 32]),
}

impl Namespace {
    /// The namespace of a salt: the salt itself, or its SHA-256 digest when its forwarded form
    /// would exceed [`ENGINE_MAX_CHARS`]. Cost: one pass over the salt (plus SHA-256 for long
    /// ones).
    pub fn of(salt: &CacheSalt) -> Namespace {
        let s = salt.expose();
        if TAG.len() + escaped_chars(s) <= ENGINE_MAX_CHARS {
            Namespace(Form::Salt(s.to_owned()))
        } else {
            Namespace(Form::Digest(Sha256::digest(s.as_bytes()).into()))
        }
    }

    /// The namespace carried by a forwarded salt, or `None` when `value` is not one kv-epp made.
    pub fn decode(value: &str) -> Option<Namespace> {
        let body = value.strip_prefix(TAG)?;
        if let Some(hex) = body.strip_prefix(DIGEST_MARK) {
            return digest_from_hex(hex).map(|d| Namespace(Form::Digest(d)));
        }
        let mut out = String::with_capacity(body.len());
        let mut chars = body.chars();
        while let Some(c) = chars.next() {
            if c != '%' {
                if needs_escape(c) {
                    return None; // `forwarded` would have escaped it
                }
                out.push(c);
                continue;
            }
            // `forwarded` writes two uppercase hex digits, and only for what it escapes.
            let (hi, lo) = (upper_hex(chars.next())?, upper_hex(chars.next())?);
            let decoded = char::from_u32(hi * 16 + lo)?;
            if !needs_escape(decoded) {
                return None; // not produced by `forwarded`
            }
            out.push(decoded);
        }
        (!out.is_empty() && TAG.len() + escaped_chars(&out) <= ENGINE_MAX_CHARS)
            .then_some(Namespace(Form::Salt(out)))
    }

    /// The `cache_salt` value forwarded to the engine for this namespace.
    pub fn forwarded(&self) -> String {
        match &self.0 {
            Form::Salt(salt) => {
                let mut out = String::with_capacity(TAG.len() + salt.len());
                out.push_str(TAG);
                for c in salt.chars() {
                    if needs_escape(c) {
                        out.push_str(&format!("%{:02X}", c as u32));
                    } else {
                        out.push(c);
                    }
                }
                out
            }
            Form::Digest(d) => {
                let hex: String = d.iter().map(|b| format!("{b:02x}")).collect();
                format!("{TAG}{DIGEST_MARK}{hex}")
            }
        }
    }

    /// The hash seed of this namespace under an optional LoRA adapter.
    pub fn seed(&self, lora_name: Option<&str>) -> HashSeed {
        match &self.0 {
            Form::Salt(salt) => HashSeed::new(lora_name, Some(salt)),
            Form::Digest(d) => HashSeed::with_salt_digest(lora_name, d),
        }
    }
}

/// One digit of an escape as `forwarded` writes it (`0-9`, `A-F`).
fn upper_hex(c: Option<char>) -> Option<u32> {
    match c? {
        c @ ('0'..='9' | 'A'..='F') => c.to_digit(16),
        _ => None,
    }
}

/// 64 lowercase hex digits → 32 bytes (the only spelling `forwarded` writes).
fn digest_from_hex(hex: &str) -> Option<[u8; 32]> {
    let bytes = hex.as_bytes();
    if bytes.len() != 64 || !bytes.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in bytes.chunks_exact(2).enumerate() {
        let digit = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
        out[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

impl fmt::Debug for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Form::Salt(s) => write!(f, "Namespace(<redacted>, {} bytes)", s.len()),
            Form::Digest(_) => f.write_str("Namespace(<redacted digest>)"),
        }
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
    match namespace {
        Some(ns) => ns.seed(lora_name),
        None => HashSeed::new(lora_name, None),
    }
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

    fn is_digest(ns: &Namespace) -> bool {
        matches!(ns.0, Form::Digest(_))
    }

    #[test]
    fn ordinary_salts_keep_their_own_namespace() {
        assert!(Namespace::of(&salt("tenant-a")).0 == Form::Salt("tenant-a".into()));
        assert_eq!(fwd("tenant-a"), "kvepp:tenant-a");
        let long = Namespace::of(&salt(&"y".repeat(200)));
        assert!(is_digest(&long));
        assert_ne!(long, Namespace::of(&salt(&"y".repeat(201))));
        // Near the limit: escaping counts.
        let just = "a".repeat(ENGINE_MAX_CHARS - TAG.len());
        assert!(Namespace::of(&salt(&just)).0 == Form::Salt(just.clone()));
        let over = format!("/{}", "a".repeat(ENGINE_MAX_CHARS - TAG.len() - 1));
        assert!(is_digest(&Namespace::of(&salt(&over))));
    }

    /// The literal salts an attacker would try against a victim's salt `v`: its digest in every
    /// spelling kv-epp ever used, its forwarded form, and that form's escapes.
    fn lookalikes(v: &str) -> Vec<String> {
        let hex: String = Sha256::digest(v.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let f = fwd(v);
        vec![
            format!("#sha256:{hex}"),
            format!("%sha256:{hex}"),
            format!("{TAG}%sha256:{hex}"),
            format!("\0sha256:{hex}"),
            hex.clone(),
            hex.to_uppercase(),
            f.clone(),
            f.trim_start_matches(TAG).to_owned(),
            f.replace("%2F", "%2f"),
        ]
    }

    #[test]
    fn a_salt_spelled_like_a_digest_never_shares_its_namespace() {
        // The aliasing a security review found: a literal `#sha256:<hex of the victim's salt>`
        // used to get the long victim salt's namespace and forwarded value.
        let victim = "v".repeat(300);
        let ns = Namespace::of(&salt(&victim));
        for fake in lookalikes(&victim) {
            let other = Namespace::of(&salt(&fake));
            assert_ne!(other, ns, "{fake:?}");
            assert_ne!(other.forwarded(), ns.forwarded(), "{fake:?}");
            assert_ne!(other.seed(None), ns.seed(None), "{fake:?}");
            assert_eq!(Namespace::decode(&other.forwarded()), Some(other));
        }
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
        assert_eq!(
            Namespace::decode("kvepp:a%2fb"),
            None,
            "only uppercase escapes"
        );
        assert!(Namespace::decode("kvepp:a%2Fb").is_some());
        let hex = "ab".repeat(32);
        assert!(Namespace::decode(&format!("kvepp:%sha256:{hex}")).is_some());
        for bad in [&hex[..62], &hex.to_uppercase(), &format!("{hex}00")] {
            assert_eq!(Namespace::decode(&format!("kvepp:%sha256:{bad}")), None);
        }
        let too_long = format!("kvepp:{}", "a".repeat(ENGINE_MAX_CHARS));
        assert_eq!(
            Namespace::decode(&too_long),
            None,
            "longer than forwarded can be"
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
        let digest: [u8; 32] = Sha256::digest(long.expose().as_bytes()).into();
        assert_eq!(
            seed_for(Some(&long), None),
            HashSeed::with_salt_digest(None, &digest)
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

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// Distinct salts get distinct namespaces and forwarded values; forwarded values decode
        /// back exactly; what decodes is exactly what `forwarded` would write. Salts are arbitrary
        /// Unicode, short and long, and every lookalike of each.
        #[test]
        fn the_encoding_is_injective_and_round_trips(
            a in "\\PC{1,80}|[%/@\\\\#sa-f0-9:]{1,140}|\\PC{100,200}",
            b in "\\PC{1,80}|[%/@\\\\#sa-f0-9:]{1,140}",
        ) {
            let mut salts = vec![a.clone(), b];
            salts.extend(lookalikes(&a));
            for s in &salts {
                let ns = Namespace::of(&salt(s));
                let f = ns.forwarded();
                proptest::prop_assert!(engine_accepts(&f), "{:?}", f);
                proptest::prop_assert_eq!(Namespace::decode(&f), Some(ns.clone()));
                for t in &salts {
                    if s != t {
                        let other = Namespace::of(&salt(t));
                        proptest::prop_assert_ne!(&other, &ns);
                        proptest::prop_assert_ne!(other.forwarded(), f.clone());
                    }
                }
            }
        }

        #[test]
        fn whatever_decodes_is_what_forwarded_writes(v in "kvepp:[%a-zA-Z0-9/@:]{0,130}|kvepp:%sha256:[0-9a-fA-F]{60,66}") {
            if let Some(ns) = Namespace::decode(&v) {
                proptest::prop_assert_eq!(ns.forwarded(), v);
            }
        }
    }
}
