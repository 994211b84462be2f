//! Reading untrusted JSON without building a tree (a `serde_json::Value` costs ~17× the bytes it
//! is read from): visitors run as seeds ([`Any`]), and for engines' JSON, readers that keep the
//! few fields they want and skip the rest unread ([`each_entry`], [`skip!`]), never failing on a
//! value of the wrong type (only on bytes that are not JSON).

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// A visitor as a seed that takes any JSON value (`deserialize_any`).
pub(crate) struct Any<V>(pub V);

impl<'de, V: Visitor<'de>> DeserializeSeed<'de> for Any<V> {
    type Value = V::Value;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<V::Value, D::Error> {
        d.deserialize_any(self.0)
    }
}

/// A JSON value where a reader wants a number: anything else is only told apart, its contents
/// skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scalar {
    Null,
    Unsigned(u64),
    Negative(i64),
    Other,
}

impl<'de> serde::Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Scalar, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Scalar;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_u64<E>(self, v: u64) -> Result<Scalar, E> {
                Ok(Scalar::Unsigned(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Scalar, E> {
                Ok(u64::try_from(v).map_or(Scalar::Negative(v), Scalar::Unsigned))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Scalar, E> {
                Ok(Scalar::Other)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Scalar, E> {
                Ok(Scalar::Other)
            }
            fn visit_str<E>(self, _: &str) -> Result<Scalar, E> {
                Ok(Scalar::Other)
            }
            fn visit_unit<E>(self) -> Result<Scalar, E> {
                Ok(Scalar::Null)
            }
            fn visit_none<E>(self) -> Result<Scalar, E> {
                Ok(Scalar::Null)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Scalar, A::Error> {
                IgnoredAny.visit_seq(seq).map(|_| Scalar::Other)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Scalar, A::Error> {
                IgnoredAny.visit_map(map).map(|_| Scalar::Other)
            }
        }
        d.deserialize_any(V)
    }
}

/// A map key, as its index among the names a reader wants (`None`: skipped), read without
/// allocating.
pub(crate) struct KeyIn(&'static [&'static str]);

impl<'de> DeserializeSeed<'de> for KeyIn {
    type Value = Option<usize>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<usize>, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeyIn {
    type Value = Option<usize>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a key")
    }
    fn visit_str<E>(self, v: &str) -> Result<Option<usize>, E> {
        Ok(self.0.iter().position(|k| *k == v))
    }
}

/// A map's entries, each key looked up in `keys` and handed to `entry` with its index (which
/// reads the value); other keys' values are skipped. A key given twice is read twice: readers
/// let the later value win, as a JSON object's does.
pub(crate) fn each_entry<'de, A: MapAccess<'de>>(
    mut map: A,
    keys: &'static [&'static str],
    mut entry: impl FnMut(usize, &mut A) -> Result<(), A::Error>,
) -> Result<(), A::Error> {
    while let Some(k) = map.next_key_seed(KeyIn(keys))? {
        match k {
            Some(i) => entry(i, &mut map)?,
            None => {
                map.next_value::<IgnoredAny>()?;
            }
        }
    }
    Ok(())
}

/// Visitor methods that skip a value of the wrong type (its contents read and dropped) and
/// yield `$other`: `skip!(value; u64, str, seq, ...)`.
macro_rules! skip {
    ($other:expr; $($kind:ident),*) => { $( skip!(@ $kind $other); )* };
    (@ u64 $o:expr) => { fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> { Ok($o) } };
    (@ i64 $o:expr) => { fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> { Ok($o) } };
    (@ f64 $o:expr) => { fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> { Ok($o) } };
    (@ bool $o:expr) => { fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> { Ok($o) } };
    (@ str $o:expr) => { fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> { Ok($o) } };
    (@ unit $o:expr) => {
        fn visit_unit<E>(self) -> Result<Self::Value, E> { Ok($o) }
        fn visit_none<E>(self) -> Result<Self::Value, E> { Ok($o) }
    };
    (@ seq $o:expr) => {
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
            IgnoredAny.visit_seq(seq).map(|_| $o)
        }
    };
    (@ map $o:expr) => {
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            IgnoredAny.visit_map(map).map(|_| $o)
        }
    };
}
pub(crate) use skip;
