//! Request understanding: what the router needs from an OpenAI-style request body.
//!
//! Extracts the `model`, the prompt (token IDs when the client sent them) and the salt-bearing
//! fields. `/v1/completions` with a token-ID prompt routes on those tokens; a batch of prompts
//! routes on the first. Text and chat prompts are recognised; until they are tokenized in-process
//! they route on load alone.

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use crate::json::Any;
use kv_epp_core::salt::SaltField;

mod plain;

/// The prompt as the client sent it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// No prompt field (e.g. a GET, or an API without prompts).
    None,
    /// Token IDs (`"prompt": [1, 2, 3]`, or the first of a batch of token-ID prompts).
    TokenIds(Vec<u32>),
    /// A text prompt (or the first of a batch of text prompts).
    Text(String),
    /// Chat messages.
    Chat,
}

/// A parsed request body: the fields routing reads, nothing else kept.
#[derive(Clone, Debug)]
pub struct ParsedBody {
    /// The `model` field.
    pub model: Option<String>,
    /// The prompt.
    pub prompt: Prompt,
    /// The most tokens the client asks to generate (`max_completion_tokens`, else
    /// `max_tokens`), when it says.
    pub max_tokens: Option<u64>,
    nvext_salt: SaltValue,
    body_salt: SaltValue,
    salt_members: bool,
}

impl ParsedBody {
    /// Whether the body has a `cache_salt` member at the top or in an `nvext` object, whatever
    /// its value: without one (and without a resolved salt) the body is forwarded unchanged.
    pub(crate) fn has_salt_member(&self) -> bool {
        self.salt_members
    }

    /// The body's `nvext.cache_salt` field.
    pub(crate) fn nvext_salt(&self) -> SaltField<'_> {
        self.nvext_salt.field()
    }

    /// The body's top-level `cache_salt` field.
    pub(crate) fn body_salt(&self) -> SaltField<'_> {
        self.body_salt.field()
    }

    /// Whether routing this body may tokenize its prompt (any prompt but token IDs).
    pub(crate) fn needs_tokenizer(&self) -> bool {
        !matches!(self.prompt, Prompt::TokenIds(_))
    }

    /// Takes the prompt out, leaving [`Prompt::None`] (the token IDs move, never copied).
    pub(crate) fn take_prompt(&mut self) -> Prompt {
        std::mem::replace(&mut self.prompt, Prompt::None)
    }
}

/// A salt field as the body holds it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) enum SaltValue {
    #[default]
    Absent,
    NotString,
    Str(String),
}

impl SaltValue {
    fn field(&self) -> SaltField<'_> {
        match self {
            SaltValue::Absent => SaltField::Absent,
            SaltValue::NotString => SaltField::NotString,
            SaltValue::Str(s) => SaltField::Str(s),
        }
    }
}

/// Why a body was refused (400 at the edge).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// Not JSON, or not a JSON object.
    #[error("request body is not a JSON object: {0}")]
    NotJson(String),
    /// `model` missing or not a string.
    #[error("request body has no `model` string")]
    MissingModel,
    /// A token-ID prompt with a value that is not a u32.
    #[error("prompt token IDs must be integers in 0..=4294967295")]
    BadTokenIds,
}

/// Parses a request body.
///
/// One pass of serde_json's parser over the body, keeping only the fields routing reads: no
/// tree of the document is built, so a 32k-token prompt costs one `Vec<u32>`, not 32k JSON
/// values. The common shape (plain members, a prompt of plain integers or an unescaped text) is
/// read by `plain`, in one pass; any other body, and any body that fails, by the general parser
/// (serde_json with visitors that keep only those fields). Either way it accepts and refuses exactly what parsing into a `serde_json::Value` and
/// reading that would (the unit tests hold both to the same answers): any syntax error anywhere
/// is [`RequestError::NotJson`], before any field is judged; duplicate keys keep the last value.
pub fn parse(body: &[u8]) -> Result<ParsedBody, RequestError> {
    let fields = match plain::read(body) {
        Some(f) => Some(f),
        None => read(body).map_err(|e| RequestError::NotJson(e.to_string()))?,
    };
    let Some(f) = fields else {
        return Err(RequestError::NotJson("top level is not an object".into()));
    };
    let model = match f.model {
        Some(Scalar::Str(m)) if !m.is_empty() => Some(m),
        _ => return Err(RequestError::MissingModel),
    };
    let prompt = match (f.prompt, f.messages) {
        (Some(p), _) => p?,
        (None, true) => Prompt::Chat,
        (None, false) => Prompt::None,
    };
    Ok(ParsedBody {
        model,
        prompt,
        max_tokens: f.max_completion_tokens.or(f.max_tokens),
        nvext_salt: f.nvext_salt,
        body_salt: f.body_salt,
        salt_members: f.salt_members,
    })
}

/// One pass of the general parser over the whole body: its fields when it is an object, `None`
/// for another value.
fn read(body: &[u8]) -> Result<Option<Fields>, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let top = de.deserialize_any(TopVisitor)?;
    de.end()?;
    Ok(top)
}

/// The top-level members routing reads (the last of duplicates wins, as in a JSON object).
#[derive(Default)]
struct Fields {
    model: Option<Scalar>,
    prompt: Option<Result<Prompt, RequestError>>,
    messages: bool,
    max_completion_tokens: Option<u64>,
    max_tokens: Option<u64>,
    nvext_salt: SaltValue,
    body_salt: SaltValue,
    /// A `cache_salt` member was seen (top level or in an `nvext` object).
    salt_members: bool,
}

/// A member name routing reads, decoded as a JSON parser decodes it (escapes included).
enum Key {
    Model,
    Prompt,
    Messages,
    MaxCompletionTokens,
    MaxTokens,
    CacheSalt,
    Nvext,
    Other,
}

struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Key;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Key, D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for KeySeed {
    type Value = Key;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a member name")
    }
    fn visit_str<E: de::Error>(self, k: &str) -> Result<Key, E> {
        Ok(match k {
            "model" => Key::Model,
            "prompt" => Key::Prompt,
            "messages" => Key::Messages,
            "max_completion_tokens" => Key::MaxCompletionTokens,
            "max_tokens" => Key::MaxTokens,
            "cache_salt" => Key::CacheSalt,
            "nvext" => Key::Nvext,
            _ => Key::Other,
        })
    }
}

/// The document: `Some` fields for an object, `None` for any other JSON value.
struct TopVisitor;

impl<'de> Visitor<'de> for TopVisitor {
    type Value = Option<Fields>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut f = Fields::default();
        while let Some(key) = map.next_key_seed(KeySeed)? {
            match key {
                Key::Model => f.model = Some(map.next_value_seed(Any(AnyScalar))?),
                Key::Prompt => f.prompt = Some(map.next_value_seed(Any(PromptSeed))?),
                Key::Messages => {
                    map.next_value_seed(Any(Skip))?;
                    f.messages = true;
                }
                Key::MaxCompletionTokens => {
                    f.max_completion_tokens = map.next_value_seed(Any(AnyScalar))?.as_u64();
                }
                Key::MaxTokens => f.max_tokens = map.next_value_seed(Any(AnyScalar))?.as_u64(),
                Key::CacheSalt => {
                    f.body_salt = map.next_value_seed(Any(AnyScalar))?.salt();
                    f.salt_members = true;
                }
                Key::Nvext => {
                    let (salt, member) = map.next_value_seed(Any(NvextSeed))?;
                    f.nvext_salt = salt;
                    f.salt_members |= member;
                }
                Key::Other => map.next_value_seed(Any(Skip))?,
            }
        }
        Ok(Some(f))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        Skip.visit_seq(seq).map(|()| None)
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

/// Consumes any JSON value through the parser's full path (`deserialize_any`), so it is checked
/// exactly as parsing into a `Value` checks it (numbers out of range included).
#[derive(Clone, Copy)]
struct Skip;

impl<'de> Visitor<'de> for Skip {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Any(Skip))?.is_some() {}
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_key_seed(Any(Skip))?.is_some() {
            map.next_value_seed(Any(Skip))?;
        }
        Ok(())
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
}

/// What a scalar-valued field held; arrays and objects are consumed and reported as `Other`.
enum Scalar {
    U64(u64),
    Str(String),
    Null,
    Other,
}

impl Scalar {
    /// What `Value::as_u64` would give.
    fn as_u64(&self) -> Option<u64> {
        match self {
            Scalar::U64(n) => Some(*n),
            _ => None,
        }
    }
    fn salt(self) -> SaltValue {
        match self {
            Scalar::Null => SaltValue::Absent,
            Scalar::Str(s) => SaltValue::Str(s),
            Scalar::U64(_) | Scalar::Other => SaltValue::NotString,
        }
    }
}

struct AnyScalar;

impl<'de> Visitor<'de> for AnyScalar {
    type Value = Scalar;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Scalar, A::Error> {
        Skip.visit_seq(seq).map(|()| Scalar::Other)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Scalar, A::Error> {
        Skip.visit_map(map).map(|()| Scalar::Other)
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Scalar, E> {
        Ok(Scalar::Other)
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Scalar, E> {
        Ok(Scalar::Other)
    }
    fn visit_u64<E: de::Error>(self, n: u64) -> Result<Scalar, E> {
        Ok(Scalar::U64(n))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Scalar, E> {
        Ok(Scalar::Other)
    }
    fn visit_str<E: de::Error>(self, s: &str) -> Result<Scalar, E> {
        Ok(Scalar::Str(s.to_owned()))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Scalar, E> {
        Ok(Scalar::Null)
    }
}

/// `nvext`: its `cache_salt` when it is an object, else absent; and whether it had that member.
struct NvextSeed;

impl<'de> Visitor<'de> for NvextSeed {
    type Value = (SaltValue, bool);
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let (mut salt, mut member) = (SaltValue::Absent, false);
        while let Some(key) = map.next_key_seed(KeySeed)? {
            match key {
                Key::CacheSalt => {
                    salt = map.next_value_seed(Any(AnyScalar))?.salt();
                    member = true;
                }
                _ => map.next_value_seed(Any(Skip))?,
            }
        }
        Ok((salt, member))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        Skip.visit_seq(seq).map(|()| (SaltValue::Absent, false))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok((SaltValue::Absent, false))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Ok((SaltValue::Absent, false))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Ok((SaltValue::Absent, false))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok((SaltValue::Absent, false))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
        Ok((SaltValue::Absent, false))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok((SaltValue::Absent, false))
    }
}

/// The `prompt` member: a string is text; an array is token IDs when its first item is a
/// number (every item must then be a u32), a batch when its first item is a string or an array
/// (routed on that first prompt); any other value is no prompt.
struct PromptSeed;

impl<'de> Visitor<'de> for PromptSeed {
    type Value = Result<Prompt, RequestError>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
        Ok(Ok(Prompt::Text(s.to_owned())))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        prompt_array(seq)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        Skip.visit_map(map).map(|()| Ok(Prompt::None))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Ok(Prompt::None))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Ok(Prompt::None))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Ok(Prompt::None))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Ok(Prompt::None))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Ok(Prompt::None))
    }
}

/// A prompt array, consumed whole whatever it turns out to be.
fn prompt_array<'de, A: SeqAccess<'de>>(
    mut seq: A,
) -> Result<Result<Prompt, RequestError>, A::Error> {
    let out = match seq.next_element_seed(Any(FirstItem))? {
        None => Ok(Prompt::TokenIds(Vec::new())),
        Some(First::Token(first)) => {
            let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(1024));
            let mut bad = first.is_none();
            ids.extend(first);
            while let Some(item) = seq.next_element_seed(Any(AnyScalar))? {
                match item.as_u64().and_then(|n| u32::try_from(n).ok()) {
                    Some(id) if !bad => ids.push(id),
                    Some(_) => {}
                    None => bad = true,
                }
            }
            return Ok(if bad {
                Err(RequestError::BadTokenIds)
            } else {
                Ok(Prompt::TokenIds(ids))
            });
        }
        Some(First::Prompt(p)) => p,
        Some(First::Other) => Err(RequestError::BadTokenIds),
    };
    while seq.next_element_seed(Any(Skip))?.is_some() {}
    Ok(out)
}

/// The first item of a prompt array, which says what the array is.
enum First {
    /// A number: the token ID, `None` when it is not a u32.
    Token(Option<u32>),
    /// A string or an array: the first prompt of a batch.
    Prompt(Result<Prompt, RequestError>),
    /// `true`, `null`, an object: not a prompt.
    Other,
}

struct FirstItem;

impl<'de> Visitor<'de> for FirstItem {
    type Value = First;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_u64<E: de::Error>(self, n: u64) -> Result<First, E> {
        Ok(First::Token(u32::try_from(n).ok()))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<First, E> {
        Ok(First::Token(None))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<First, E> {
        Ok(First::Token(None))
    }
    fn visit_str<E: de::Error>(self, s: &str) -> Result<First, E> {
        Ok(First::Prompt(Ok(Prompt::Text(s.to_owned()))))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<First, A::Error> {
        prompt_array(seq).map(First::Prompt)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<First, A::Error> {
        Skip.visit_map(map).map(|()| First::Other)
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<First, E> {
        Ok(First::Other)
    }
    fn visit_unit<E: de::Error>(self) -> Result<First, E> {
        Ok(First::Other)
    }
}

/// Model, prompt, max tokens, nvext salt, body salt; or the refusal.
#[doc(hidden)]
pub(crate) type Answer =
    Result<(Option<String>, Prompt, Option<u64>, SaltValue, SaltValue), RequestError>;

/// What `parse` answered before it streamed: the whole body as a `serde_json::Value`, then
/// the fields read from it. `parse` must answer exactly this for every input (held to it by
/// the property tests below and by the `request` fuzz target; not used to route).
#[doc(hidden)]
pub(crate) fn reference(body: &[u8]) -> Answer {
    use serde_json::Value;

    fn salt(v: Option<&Value>) -> SaltValue {
        match v {
            None | Some(Value::Null) => SaltValue::Absent,
            Some(Value::String(s)) => SaltValue::Str(s.clone()),
            Some(_) => SaltValue::NotString,
        }
    }
    fn prompt_of(p: &Value) -> Result<Prompt, RequestError> {
        Ok(match p {
            Value::String(s) => Prompt::Text(s.clone()),
            Value::Array(items) => match items.first() {
                None => Prompt::TokenIds(Vec::new()),
                Some(Value::Number(_)) => Prompt::TokenIds(
                    items
                        .iter()
                        .map(|v| {
                            v.as_u64()
                                .and_then(|n| u32::try_from(n).ok())
                                .ok_or(RequestError::BadTokenIds)
                        })
                        .collect::<Result<_, _>>()?,
                ),
                Some(first @ (Value::String(_) | Value::Array(_))) => prompt_of(first)?,
                Some(_) => return Err(RequestError::BadTokenIds),
            },
            _ => Prompt::None,
        })
    }
    let json: Value =
        serde_json::from_slice(body).map_err(|e| RequestError::NotJson(e.to_string()))?;
    if !json.is_object() {
        return Err(RequestError::NotJson("top level is not an object".into()));
    }
    let model = match json.get("model") {
        Some(Value::String(m)) if !m.is_empty() => Some(m.clone()),
        _ => return Err(RequestError::MissingModel),
    };
    let prompt = match (json.get("prompt"), json.get("messages")) {
        (Some(p), _) => prompt_of(p)?,
        (None, Some(_)) => Prompt::Chat,
        (None, None) => Prompt::None,
    };
    let max_tokens = ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| json.get(*k).and_then(Value::as_u64));
    let nvext = salt(json.get("nvext").and_then(|n| n.get("cache_salt")));
    Ok((
        model,
        prompt,
        max_tokens,
        nvext,
        salt(json.get("cache_salt")),
    ))
}

/// [`parse`]'s answer in the form [`reference`] gives.
#[doc(hidden)]
pub(crate) fn streamed(body: &[u8]) -> Answer {
    parse(body).map(|p| (p.model, p.prompt, p.max_tokens, p.nvext_salt, p.body_salt))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// JSON values of the shapes request fields take, and the traps around them.
    fn value() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("null".to_owned()),
            Just("true".to_owned()),
            Just("\"\"".to_owned()),
            Just("\"m\"".to_owned()),
            Just("\"s\\u0041\"".to_owned()),
            Just("-0".to_owned()),
            Just("1.0".to_owned()),
            Just("1e400".to_owned()),
            Just("-3".to_owned()),
            Just("4294967295".to_owned()),
            Just("4294967296".to_owned()),
            Just("18446744073709551616".to_owned()),
            (0u32..100_000).prop_map(|n| n.to_string()),
        ];
        leaf.prop_recursive(3, 24, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6)
                    .prop_map(|v| format!("[{}]", v.join(","))),
                prop::collection::vec((key(), inner), 0..4).prop_map(|v| {
                    let m: Vec<String> = v.into_iter().map(|(k, v)| format!("{k}:{v}")).collect();
                    format!("{{{}}}", m.join(","))
                }),
            ]
        })
    }

    fn key() -> impl Strategy<Value = String> {
        prop::sample::select(vec![
            "\"model\"",
            "\"prompt\"",
            "\"messages\"",
            "\"max_tokens\"",
            "\"max_completion_tokens\"",
            "\"cache_salt\"",
            "\"cache\\u005fsalt\"",
            "\"nvext\"",
            "\"mod\\u0065l\"",
            "\"stream\"",
        ])
        .prop_map(str::to_owned)
    }

    /// Request-like bodies: objects of those keys (duplicates allowed), sometimes damaged.
    fn body() -> impl Strategy<Value = Vec<u8>> {
        let object = prop::collection::vec((key(), value()), 0..7).prop_map(|v| {
            let m: Vec<String> = v.into_iter().map(|(k, v)| format!(" {k} : {v} ")).collect();
            format!("{{{}}}", m.join(","))
        });
        let whole = prop_oneof![object, value()];
        (whole, 0usize..4, any::<prop::sample::Index>(), any::<u8>()).prop_map(
            |(text, damage, at, byte)| {
                let mut b = text.into_bytes();
                let i = at.index(b.len().max(1)).min(b.len());
                match damage {
                    0 => b.truncate(i),
                    1 if !b.is_empty() => {
                        let last = b.len() - 1;
                        b[i.min(last)] = byte;
                    }
                    _ => {}
                }
                b
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]
        #[test]
        fn parse_answers_as_a_json_value_would(b in body()) {
            prop_assert_eq!(streamed(&b), reference(&b), "{}", String::from_utf8_lossy(&b));
            // A body without a salt member is forwarded unscanned: the rewrite agrees.
            if let Ok(p) = parse(&b) && !p.has_salt_member() {
                prop_assert_eq!(crate::forward::rewrite_salt(&b, None), None);
            }
        }
    }

    /// Token-ID prompts as clients write them, with the numerals and spacing around the plain
    /// reader's edges.
    fn token_prompt() -> impl Strategy<Value = Vec<u8>> {
        let numeral = prop_oneof![
            8 => any::<u32>().prop_map(|n| n.to_string()),
            8 => (0u32..1000).prop_map(|n| n.to_string()),
            1 => prop::sample::select(vec![
                "01", "-1", "-0", "1.0", "1e2", "1E+2", "4294967296", "99999999999", "\"7\"", "[1]",
                "null", "", "0",
            ])
            .prop_map(str::to_owned),
        ];
        let ws = prop::sample::select(vec!["", "", "", "", "", " ", " ", "\n", " \t\r"]);
        (
            prop::collection::vec((numeral, ws.clone(), ws.clone()), 0..40),
            ws.clone(),
            ws,
        )
            .prop_map(|(items, a, b)| {
                let inner: Vec<String> = items
                    .into_iter()
                    .map(|(n, x, y)| format!("{x}{n}{y}"))
                    .collect();
                format!("{{\"model\":\"m\",\"prompt\":{a}[{}]{b}}}", inner.join(",")).into_bytes()
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]
        #[test]
        fn token_id_prompts_parse_as_a_json_value_would(b in token_prompt()) {
            prop_assert_eq!(streamed(&b), reference(&b), "{}", String::from_utf8_lossy(&b));
        }
    }

    #[test]
    fn the_common_shapes_take_the_plain_reader() {
        for b in [
            &br#"{"model":"m","prompt":[1, 2,3],"max_tokens":1,"temperature":0.7,"stream":true}"#[..],
            br#" {"model":"m","prompt":"say \u00e9","x":null} "#,
            br#"{"model":"m","messages":[{"role":"user","content":"a\nb"}],"nvext":{"cache_salt":"s"}}"#,
        ] {
            let plain = plain::read(b).is_some();
            // The second has a \u escape: general path.
            assert_eq!(plain, !b.windows(2).any(|w| w == b"\\u"), "{}", String::from_utf8_lossy(b));
            assert_eq!(streamed(b), reference(b));
        }
    }

    #[test]
    fn long_token_prompts_read_alike_in_every_spacing() {
        let ids: Vec<u32> = (0..5000u32)
            .map(|i| i.wrapping_mul(2_654_435_761) >> (i % 32))
            .collect();
        for sep in [",", ", ", " , ", ",\n"] {
            let list: Vec<String> = ids.iter().map(u32::to_string).collect();
            let b = format!(
                r#"{{"model":"m","prompt":[{}],"max_tokens":1}}"#,
                list.join(sep)
            );
            let p = parse(b.as_bytes()).unwrap();
            assert_eq!(p.prompt, Prompt::TokenIds(ids.clone()), "separator {sep:?}");
            assert!(
                plain::read(b.as_bytes()).is_some(),
                "plain reader, separator {sep:?}"
            );
            assert_eq!(streamed(b.as_bytes()), reference(b.as_bytes()));
        }
    }

    #[test]
    fn parse_answers_as_a_json_value_would_on_edge_cases() {
        for b in [
            &b""[..],
            b"  ",
            b"{}",
            b"[1]",
            b"\"x\"",
            br#"{"model":"m"} x"#,
            br#"{"model":"m","model":5}"#,
            br#"{"model":5,"model":"m"}"#,
            br#"{"model":"m","prompt":[1,2],"prompt":"t"}"#,
            br#"{"model":"m","prompt":null,"messages":[]}"#,
            br#"{"model":"m","prompt":[1,"a",1e400]}"#,
            br#"{"model":"m","prompt":[-0]}"#,
            br#"{"model":"m","prompt":[01]}"#,
            br#"{"model":"m","prompt":[1,]}"#,
            br#"{"model":"m","prompt":[ ]}"#,
            br#"{"model":"m","prompt":[4294967295, 0 ,7]}"#,
            br#"{"model":"m","prompt":[4294967296]}"#,
            br#"{"model":"m","prompt":[1e2]}"#,
            br#"{"model":"m","prompt":[1] , "prompt":[2,3]}"#,
            br#"{"model":"m","prompt":[[[["a"]]],1]}"#,
            br#"{"model":"m","prompt":[{},1]}"#,
            br#"{"model":"m","max_completion_tokens":1.5,"max_tokens":7}"#,
            br#"{"model":"m","nvext":{"cache_salt":"a","cache_salt":null}}"#,
            br#"{"model":"m","nvext":[{"cache_salt":"a"}]}"#,
            b"{\"model\":\"m\",\"x\":\"\xff\"}",
        ] {
            assert_eq!(streamed(b), reference(b), "{}", String::from_utf8_lossy(b));
        }
        let deep = format!(
            "{{\"model\":\"m\",\"x\":{}{}}}",
            "[".repeat(200),
            "]".repeat(200)
        );
        assert_eq!(streamed(deep.as_bytes()), reference(deep.as_bytes()));
    }

    #[test]
    fn token_id_prompts_and_batches() {
        let b = parse(br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!(b.prompt, Prompt::TokenIds(vec![1, 2, 3]));
        let b = parse(br#"{"model":"m","prompt":[[4,5],[6]]}"#).unwrap();
        assert_eq!(b.prompt, Prompt::TokenIds(vec![4, 5]));
        let b = parse(br#"{"model":"m","prompt":["a","b"]}"#).unwrap();
        assert_eq!(b.prompt, Prompt::Text("a".into()));
        let b = parse(br#"{"model":"m","messages":[]}"#).unwrap();
        assert_eq!(b.prompt, Prompt::Chat);
    }

    #[test]
    fn errors() {
        assert!(matches!(parse(b"{"), Err(RequestError::NotJson(_))));
        assert!(matches!(parse(b"[1]"), Err(RequestError::NotJson(_))));
        assert_eq!(
            parse(br#"{"prompt":[1]}"#).unwrap_err(),
            RequestError::MissingModel
        );
        assert_eq!(
            parse(br#"{"model":"m","prompt":[1,-2]}"#).unwrap_err(),
            RequestError::BadTokenIds
        );
        assert_eq!(
            parse(br#"{"model":"m","prompt":[4294967296]}"#).unwrap_err(),
            RequestError::BadTokenIds
        );
    }

    #[test]
    fn salt_fields() {
        let b = parse(br#"{"model":"m","cache_salt":"s","nvext":{"cache_salt":5}}"#).unwrap();
        assert_eq!(b.body_salt(), SaltField::Str("s"));
        assert_eq!(b.nvext_salt(), SaltField::NotString);
        let b = parse(br#"{"model":"m","cache_salt":null}"#).unwrap();
        assert_eq!(b.body_salt(), SaltField::Absent);
    }
}
