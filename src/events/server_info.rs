//! Where an SGLang worker publishes its KV events, asked of the worker itself: SGLang's
//! `GET /server_info` carries a `kv_events` block (`publisher`, `endpoint_host`,
//! `endpoint_port_base`, `topic`, `block_size`, `dp_size`); rank `r` publishes on
//! `endpoint_port_base + r`. Used when the pool (or the static worker) does not name the
//! endpoints; without an answer the configured convention (`events.zmq.port + r`) stands.
//!
//! The answer is untrusted: it is read up to 1 MiB within 2 s, typed as it is read (never a
//! JSON tree), and only the port and topic are taken from it. kv-epp connects to the worker's own address whatever `endpoint_host` says (a
//! wildcard means exactly that; any other host is ignored, so a worker cannot point kv-epp at
//! another machine).

use std::time::Duration;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::subscriber::FeedEndpoints;
use crate::httpc;
use crate::json::{Any, Scalar, each_entry, skip};
use kv_epp_core::worker::WorkerId;

/// What an SGLang worker advertises for its event publishers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Advertised {
    /// Rank 0's publisher port.
    pub port_base: u16,
    /// The topic.
    pub topic: String,
    /// The engine's block size, when said (checked against the model's by the caller).
    pub block_size: Option<u64>,
    /// Publishers (one per attention data-parallel rank), when said.
    pub dp_size: Option<u64>,
}

/// Why a `/server_info` answer gave no endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ServerInfoError {
    /// Not JSON, or `kv_events` is not an object.
    #[error("malformed /server_info")]
    Malformed,
    /// No `kv_events` block (events off, or an SGLang without it).
    #[error("no kv_events in /server_info")]
    NoEvents,
    /// A publisher other than ZeroMQ.
    #[error("kv_events publisher is not zmq")]
    NotZmq,
    /// `endpoint_port_base` missing or not a port for this rank.
    #[error("kv_events has no port for this rank")]
    NoPort,
}

/// Reads the `kv_events` block of a `/server_info` body, straight into its few fields (the
/// rest of the body is skipped unread, never built into a JSON tree; a later key given twice
/// wins, as in a tree).
pub(crate) fn parse(body: &[u8]) -> Result<Advertised, ServerInfoError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let read = Any(Body)
        .deserialize(&mut de)
        .and_then(|b| de.end().map(|()| b))
        .map_err(|_| ServerInfoError::Malformed)?;
    let kv = match read {
        None | Some(None) => return Err(ServerInfoError::NoEvents),
        Some(Some(KvEvents::NotAnObject)) => return Err(ServerInfoError::Malformed),
        Some(Some(KvEvents::Object(kv))) => kv,
    };
    if !kv.zmq {
        return Err(ServerInfoError::NotZmq);
    }
    let port_base = match kv.port_base {
        Scalar::Unsigned(p) => u16::try_from(p).ok().filter(|p| *p != 0),
        _ => None,
    }
    .ok_or(ServerInfoError::NoPort)?;
    let number = |v: Scalar| match v {
        Scalar::Unsigned(v) => Some(v),
        _ => None,
    };
    Ok(Advertised {
        port_base,
        topic: kv.topic.unwrap_or_default(),
        block_size: number(kv.block_size),
        dp_size: number(kv.dp_size),
    })
}

/// The body: `kv_events` (`None`: absent, or the body is not an object; `Some(None)`: null).
struct Body;

impl<'de> Visitor<'de> for Body {
    type Value = Option<Option<KvEvents>>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a /server_info body")
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        let mut kv = None;
        each_entry(map, &["kv_events"], |_, map| {
            kv = Some(map.next_value_seed(Any(KvEventsSeed))?);
            Ok(())
        })?;
        Ok(kv)
    }
    skip!(None; u64, i64, f64, bool, str, unit, seq);
}

/// A `kv_events` value (`None`: null).
enum KvEvents {
    NotAnObject,
    Object(KvFields),
}

/// The fields of `kv_events` kv-epp reads.
struct KvFields {
    /// `publisher` is the string `zmq`.
    zmq: bool,
    port_base: Scalar,
    /// `topic`, when a string.
    topic: Option<String>,
    block_size: Scalar,
    dp_size: Scalar,
}

struct KvEventsSeed;

impl<'de> Visitor<'de> for KvEventsSeed {
    type Value = Option<KvEvents>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("kv_events")
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        const KEYS: &[&str] = &[
            "publisher",
            "endpoint_port_base",
            "topic",
            "block_size",
            "dp_size",
        ];
        let mut kv = KvFields {
            zmq: false,
            port_base: Scalar::Null,
            topic: None,
            block_size: Scalar::Null,
            dp_size: Scalar::Null,
        };
        each_entry(map, KEYS, |i, map| {
            match i {
                0 => kv.zmq = map.next_value::<Text>()?.0.as_deref() == Some("zmq"),
                1 => kv.port_base = map.next_value()?,
                2 => kv.topic = map.next_value::<Text>()?.0,
                3 => kv.block_size = map.next_value()?,
                _ => kv.dp_size = map.next_value()?,
            }
            Ok(())
        })?;
        Ok(Some(KvEvents::Object(kv)))
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    skip!(Some(KvEvents::NotAnObject); u64, i64, f64, bool, str, seq);
}

/// A string value (`None`: any other value, skipped).
struct Text(Option<String>);

impl<'de> serde::Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Text, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Text;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E>(self, v: &str) -> Result<Text, E> {
                Ok(Text(Some(v.to_owned())))
            }
            skip!(Text(None); u64, i64, f64, bool, unit, seq, map);
        }
        d.deserialize_any(V)
    }
}

impl Advertised {
    /// `worker`'s publisher from this advertisement, on the worker's own address; `fallback`'s
    /// replay endpoint and dialect are kept (SGLang does not advertise a replay socket).
    pub(crate) fn endpoints(
        &self,
        worker: &WorkerId,
        fallback: &FeedEndpoints,
    ) -> Result<FeedEndpoints, ServerInfoError> {
        let rank = u64::from(worker.dp_rank);
        if self.dp_size.is_some_and(|n| rank >= n) {
            return Err(ServerInfoError::NoPort);
        }
        let port =
            u16::try_from(u64::from(self.port_base) + rank).map_err(|_| ServerInfoError::NoPort)?;
        let host = match worker.endpoint.ip() {
            std::net::IpAddr::V6(v6) => format!("[{v6}]"),
            std::net::IpAddr::V4(v4) => v4.to_string(),
        };
        Ok(FeedEndpoints {
            events: format!("tcp://{host}:{port}"),
            replay: fallback.replay.clone(),
            topic: self.topic.clone(),
            dialect: fallback.dialect,
        })
    }
}

/// Asks `worker`'s `/server_info` (2 s, 1 MiB).
pub(crate) async fn fetch(worker: &WorkerId) -> Result<Advertised, String> {
    let limits = httpc::Limits {
        deadline: Duration::from_secs(2),
        max_body: 1 << 20,
    };
    let r = httpc::get(worker.endpoint, "/server_info", limits)
        .await
        .map_err(|e| e.to_string())?;
    if r.status() != httpc::StatusCode::OK {
        return Err(format!("status {}", r.status()));
    }
    parse(r.body()).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::vllm::Dialect;

    fn fallback() -> FeedEndpoints {
        FeedEndpoints {
            events: "tcp://10.0.0.1:5557".into(),
            replay: Some("tcp://10.0.0.1:5558".into()),
            topic: String::new(),
            dialect: Dialect::Sglang,
        }
    }

    #[test]
    fn the_advertised_port_per_rank_on_the_workers_own_address() {
        let body = br#"{"served_model_name": "m", "kv_events": {"publisher": "zmq",
            "endpoint_host": "203.0.113.9", "endpoint_port_base": 6100, "topic": "kv",
            "block_size": 16, "dp_size": 2}}"#;
        let adv = parse(body).unwrap();
        assert_eq!((adv.block_size, adv.dp_size), (Some(16), Some(2)));
        let w1: WorkerId = "10.0.0.1:8000#1".parse().unwrap();
        let ep = adv.endpoints(&w1, &fallback()).unwrap();
        // Another host in the answer is ignored: kv-epp dials the worker's own address.
        assert_eq!(ep.events, "tcp://10.0.0.1:6101");
        assert_eq!(ep.topic, "kv");
        assert_eq!(ep.replay.as_deref(), Some("tcp://10.0.0.1:5558"));
        let w2: WorkerId = "10.0.0.1:8000#2".parse().unwrap();
        assert_eq!(
            adv.endpoints(&w2, &fallback()),
            Err(ServerInfoError::NoPort)
        );
    }

    /// The reading before the typed one, over a JSON tree: the typed reader must agree.
    fn reference(body: &[u8]) -> Result<Advertised, ServerInfoError> {
        use serde_json::Value;
        let v: Value = serde_json::from_slice(body).map_err(|_| ServerInfoError::Malformed)?;
        let kv = match v.get("kv_events") {
            None | Some(Value::Null) => return Err(ServerInfoError::NoEvents),
            Some(Value::Object(kv)) => kv,
            Some(_) => return Err(ServerInfoError::Malformed),
        };
        if kv.get("publisher").and_then(Value::as_str) != Some("zmq") {
            return Err(ServerInfoError::NotZmq);
        }
        let port_base = kv
            .get("endpoint_port_base")
            .and_then(Value::as_u64)
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0)
            .ok_or(ServerInfoError::NoPort)?;
        Ok(Advertised {
            port_base,
            topic: kv
                .get("topic")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            block_size: kv.get("block_size").and_then(Value::as_u64),
            dp_size: kv.get("dp_size").and_then(Value::as_u64),
        })
    }

    mod same_reading {
        use super::*;
        use proptest::prelude::*;
        use serde_json::{Value, json};

        fn any_value() -> impl Strategy<Value = Value> {
            prop_oneof![
                Just(Value::Null),
                prop::sample::select(vec![0u64, 1, 16, 5557, 65535, 65536, u64::MAX])
                    .prop_map(|v| json!(v)),
                Just(json!(-1)),
                Just(json!(16.0)),
                Just(json!(true)),
                prop::sample::select(vec!["zmq", "null", "kv", ""]).prop_map(|s| json!(s)),
                Just(json!([1, "zmq"])),
                Just(json!({"publisher": "zmq"})),
            ]
        }

        fn field(v: impl Strategy<Value = Value>) -> impl Strategy<Value = Option<Value>> {
            prop::option::weighted(0.7, v)
        }

        fn body() -> impl Strategy<Value = Value> {
            let kv = (
                field(prop_oneof![3 => Just(json!("zmq")), 1 => any_value()]),
                field(any_value()),
                field(any_value()),
                field(any_value()),
                field(any_value()),
            )
                .prop_map(|(p, port, topic, bs, dp)| {
                    let mut m = serde_json::Map::new();
                    for (k, v) in [
                        ("publisher", p),
                        ("endpoint_port_base", port),
                        ("topic", topic),
                        ("block_size", bs),
                        ("dp_size", dp),
                        ("endpoint_host", Some(json!("203.0.113.9"))),
                    ] {
                        if let Some(v) = v {
                            m.insert(k.to_string(), v);
                        }
                    }
                    Value::Object(m)
                });
            let events = prop_oneof![4 => kv, 1 => any_value()];
            prop_oneof![
                6 => prop::option::weighted(0.9, events).prop_map(|kv| {
                    let mut m = serde_json::Map::new();
                    m.insert("version".into(), json!("0.5.9"));
                    if let Some(kv) = kv {
                        m.insert("kv_events".into(), kv);
                    }
                    Value::Object(m)
                }),
                1 => any_value(),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]
            #[test]
            fn the_typed_reader_reads_as_the_tree_did(b in body()) {
                for text in [b.to_string(), serde_json::to_string_pretty(&b).unwrap()] {
                    prop_assert_eq!(parse(text.as_bytes()), reference(text.as_bytes()));
                }
            }
        }
    }

    #[test]
    fn a_key_given_twice_is_read_as_its_last_value() {
        for body in [
            &br#"{"kv_events": null, "kv_events": {"publisher": "zmq", "endpoint_port_base": 1}}"#[..],
            br#"{"kv_events": {"publisher": "zmq", "endpoint_port_base": 1}, "kv_events": 3}"#,
            br#"{"kv_events": {"publisher": "zmq", "publisher": "x", "endpoint_port_base": 1}}"#,
            br#"{"kv_events": {"publisher": "zmq", "endpoint_port_base": 1, "topic": "a", "topic": 2}}"#,
            br#"{"kv_events": {"publisher": "zmq", "endpoint_port_base": 1}} x"#,
        ] {
            assert_eq!(parse(body), reference(body), "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn hostile_or_partial_answers_give_no_endpoints() {
        for (body, why) in [
            (&b"not json"[..], ServerInfoError::Malformed),
            (br#"{"kv_events": 3}"#, ServerInfoError::Malformed),
            (br#"{"version": "0.5.9"}"#, ServerInfoError::NoEvents),
            (br#"{"kv_events": null}"#, ServerInfoError::NoEvents),
            (
                br#"{"kv_events": {"publisher": "null"}}"#,
                ServerInfoError::NotZmq,
            ),
            (
                br#"{"kv_events": {"publisher": "zmq", "endpoint_port_base": 70000}}"#,
                ServerInfoError::NoPort,
            ),
            (
                br#"{"kv_events": {"publisher": "zmq", "endpoint_port_base": "5557"}}"#,
                ServerInfoError::NoPort,
            ),
        ] {
            assert_eq!(parse(body), Err(why), "{}", String::from_utf8_lossy(body));
        }
        let top =
            parse(br#"{"kv_events": {"publisher": "zmq", "endpoint_port_base": 65535}}"#).unwrap();
        let w1: WorkerId = "10.0.0.1:8000#1".parse().unwrap();
        assert_eq!(
            top.endpoints(&w1, &fallback()),
            Err(ServerInfoError::NoPort)
        );
    }
}
