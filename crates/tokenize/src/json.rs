//! An order-preserving JSON tree for the parts of a request that templates see as data (tools,
//! tool calls, `chat_template_kwargs`).
//!
//! Python dicts keep insertion order and `tojson` prints them in that order, so the tree keeps
//! object members as written (a repeated key keeps its first position and its last value, like
//! `json.loads`). It converts straight into template values. Integers stay integers and floats
//! stay floats (`1.0` renders as `1.0`); integers beyond 64 bits become floats (Python would keep
//! them exact; no real tool schema needs that).

use std::fmt;

use indexmap::IndexMap;
use minijinja::Value;
use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

/// A JSON value with object members in document order.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Json {
    /// `null` (also the value of a missing field).
    #[default]
    Null,
    /// `true` / `false`.
    Bool(bool),
    /// A negative integer.
    Int(i64),
    /// A non-negative integer.
    UInt(u64),
    /// A number with a fraction or exponent.
    Float(f64),
    /// A string.
    Str(String),
    /// An array.
    Array(Vec<Json>),
    /// An object, members in document order.
    Object(IndexMap<String, Json>),
}

impl Json {
    /// The member `key` of an object.
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Object(members) => members.get(key),
            _ => None,
        }
    }

    /// Mutable access to the member `key` of an object.
    pub fn get_mut(&mut self, key: &str) -> Option<&mut Json> {
        match self {
            Json::Object(members) => members.get_mut(key),
            _ => None,
        }
    }

    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::Str(s) => Some(s),
            _ => None,
        }
    }

    /// Whether this is `null`.
    pub fn is_null(&self) -> bool {
        matches!(self, Json::Null)
    }

    /// Converts into a template value (objects become insertion-ordered maps).
    pub fn into_value(self) -> Value {
        match self {
            Json::Null => Value::from(()),
            Json::Bool(b) => Value::from(b),
            Json::Int(i) => Value::from(i),
            Json::UInt(u) => Value::from(u),
            Json::Float(f) => Value::from(f),
            Json::Str(s) => Value::from(s),
            Json::Array(items) => Value::from(
                items
                    .into_iter()
                    .map(Json::into_value)
                    .collect::<Vec<Value>>(),
            ),
            Json::Object(members) => Value::from(
                members
                    .into_iter()
                    .map(|(k, v)| (Value::from(k), v.into_value()))
                    .collect::<IndexMap<Value, Value>>(),
            ),
        }
    }
}

/// Writes the tree back as JSON, members in order (tests and re-parsing a sub-tree).
impl serde::Serialize for Json {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{SerializeMap, SerializeSeq};
        match self {
            Json::Null => s.serialize_unit(),
            Json::Bool(b) => s.serialize_bool(*b),
            Json::Int(i) => s.serialize_i64(*i),
            Json::UInt(u) => s.serialize_u64(*u),
            Json::Float(f) => s.serialize_f64(*f),
            Json::Str(v) => s.serialize_str(v),
            Json::Array(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            Json::Object(members) => {
                let mut map = s.serialize_map(Some(members.len()))?;
                for (k, v) in members {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Json, D::Error> {
        deserializer.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Json, E> {
        Ok(Json::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Json, E> {
        Ok(match u64::try_from(v) {
            Ok(u) => Json::UInt(u),
            Err(_) => Json::Int(v),
        })
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Json, E> {
        Ok(Json::UInt(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Json, E> {
        Ok(Json::Float(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Json, E> {
        Ok(Json::Str(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Json, E> {
        Ok(Json::Str(v))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Json, D::Error> {
        Json::deserialize(d)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut members = IndexMap::new();
        while let Some((key, value)) = map.next_entry::<String, Json>()? {
            // json.loads: a repeated key keeps its first position and takes the last value,
            // which is what IndexMap::insert does.
            members.insert(key, value);
        }
        Ok(Json::Object(members))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_order_and_number_kinds() {
        let j: Json =
            serde_json::from_str(r#"{"z": 1, "a": 1.0, "m": -2, "z": [true, null, "s"]}"#).unwrap();
        assert_eq!(
            j,
            Json::Object(IndexMap::from([
                (
                    "z".to_owned(),
                    Json::Array(vec![Json::Bool(true), Json::Null, Json::Str("s".into())])
                ),
                ("a".to_owned(), Json::Float(1.0)),
                ("m".to_owned(), Json::Int(-2)),
            ]))
        );
        let v = j.into_value();
        let keys: Vec<String> = v.try_iter().unwrap().map(|k| k.to_string()).collect();
        assert_eq!(keys, ["z", "a", "m"]);
    }
}
