//! The body forwarded to the engine: the resolved salt in the engine's field, client salt fields
//! removed, everything else byte-identical.
//!
//! The engine must cache under the same namespace the router hashed with, so the forwarded body
//! carries `"cache_salt": "<forwarded form>"` (see `namespace`) whenever a salt was resolved,
//! and never a client-sent `cache_salt` or `nvext.cache_salt` (an empty or non-string client salt
//! would make vLLM answer 400; a salt from an untrusted source must not reach the engine). When
//! the body holds no salt field and no salt was resolved, it is forwarded unchanged.
//!
//! The rewrite is surgical: a small scanner finds the byte ranges of the top-level members (and
//! those of `nvext`), keys are decoded exactly as a JSON parser decodes them (so an escaped key
//! like `"cache\u005fsalt"` is caught too), and untouched members are copied byte for byte.

/// A member of a JSON object: its decoded key and its byte range (key through value).
struct Member {
    key: String,
    start: usize,
    end: usize,
    value_start: usize,
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

/// `i` at an opening quote; returns the index after the closing quote.
fn skip_string(b: &[u8], mut i: usize) -> Option<usize> {
    if b.get(i) != Some(&b'"') {
        return None;
    }
    i += 1;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => return Some(i + 1),
            _ => i += 1,
        }
    }
    None
}

/// Returns the index after the JSON value starting at `i`.
fn skip_value(b: &[u8], i: usize) -> Option<usize> {
    match b.get(i)? {
        b'"' => skip_string(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            while j < b.len() {
                match b[j] {
                    b'"' => {
                        j = skip_string(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            None
        }
        _ => {
            let mut j = i;
            while j < b.len() && !matches!(b[j], b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
            {
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

/// The members of the object starting at `i` (which must be `{`), and the index after it.
fn members(b: &[u8], i: usize) -> Option<(Vec<Member>, usize)> {
    if b.get(i) != Some(&b'{') {
        return None;
    }
    let mut out = Vec::new();
    let mut j = skip_ws(b, i + 1);
    if b.get(j) == Some(&b'}') {
        return Some((out, j + 1));
    }
    loop {
        let start = j;
        let key_end = skip_string(b, j)?;
        let key: String = serde_json::from_slice(&b[j..key_end]).ok()?;
        j = skip_ws(b, key_end);
        if b.get(j) != Some(&b':') {
            return None;
        }
        let value_start = skip_ws(b, j + 1);
        let end = skip_value(b, value_start)?;
        out.push(Member {
            key,
            start,
            end,
            value_start,
        });
        j = skip_ws(b, end);
        match b.get(j)? {
            b',' => j = skip_ws(b, j + 1),
            b'}' => return Some((out, j + 1)),
            _ => return None,
        }
    }
}

const SALT: &str = "cache_salt";

/// Rebuilds an object from kept member ranges, with `first` prepended.
fn object(b: &[u8], first: Option<Vec<u8>>, kept: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::with_capacity(b.len() + 64);
    out.push(b'{');
    let mut parts = first.into_iter().chain(kept.iter().map(|k| k.to_vec()));
    if let Some(p) = parts.next() {
        out.extend_from_slice(&p);
    }
    for p in parts {
        out.push(b',');
        out.extend_from_slice(&p);
    }
    out.push(b'}');
    out
}

/// The body to forward, or `None` when the original is forwarded unchanged. `body` must be a
/// JSON object (the request parser already checked it); `salt` is the forwarded form.
pub(crate) fn rewrite_salt(body: &[u8], salt: Option<&str>) -> Option<Vec<u8>> {
    let open = skip_ws(body, 0);
    let (top, end) = members(body, open)?;
    // Every `nvext` member, not only the first: a JSON parser keeps the last of duplicate keys,
    // so a client salt in any of them could reach the engine.
    let nvexts: Vec<Option<Vec<Member>>> = top
        .iter()
        .map(|m| {
            (m.key == "nvext")
                .then(|| members(body, m.value_start).map(|(ms, _)| ms))
                .flatten()
        })
        .collect();
    let salted = |ms: &Option<Vec<Member>>| {
        ms.as_ref()
            .is_some_and(|ms| ms.iter().any(|m| m.key == SALT))
    };
    let top_has_salt = top.iter().any(|m| m.key == SALT);
    if salt.is_none() && !top_has_salt && !nvexts.iter().any(salted) {
        return None;
    }
    let mut kept: Vec<Vec<u8>> = Vec::new();
    for (m, nvext) in top.iter().zip(&nvexts) {
        if m.key == SALT {
            continue;
        }
        if let Some(ms) = nvext
            && salted(nvext)
        {
            let inner: Vec<&[u8]> = ms
                .iter()
                .filter(|x| x.key != SALT)
                .map(|x| &body[x.start..x.end])
                .collect();
            let mut member = body[m.start..m.value_start].to_vec();
            member.extend(object(body, None, &inner));
            kept.push(member);
            continue;
        }
        kept.push(body[m.start..m.end].to_vec());
    }
    let first = salt.map(|s| {
        let mut m = b"\"cache_salt\":".to_vec();
        m.extend(serde_json::to_vec(s).unwrap_or_default());
        m
    });
    let refs: Vec<&[u8]> = kept.iter().map(Vec::as_slice).collect();
    let mut out = object(body, first, &refs);
    out.extend_from_slice(&body[end..]);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn json(b: &[u8]) -> Value {
        serde_json::from_slice(b).unwrap()
    }

    #[test]
    fn untouched_when_nothing_to_change() {
        assert_eq!(rewrite_salt(br#"{"model":"m","prompt":[1,2]}"#, None), None);
        assert_eq!(rewrite_salt(br#" { "nvext" : {"x":1} } "#, None), None);
    }

    #[test]
    fn sets_the_salt_and_keeps_every_other_byte() {
        let body = br#"{"model": "m",  "prompt":[1, 2.50, "x\"}"], "stream" :true}"#;
        let out = rewrite_salt(body, Some("kvepp:t")).unwrap();
        assert_eq!(
            out,
            br#"{"cache_salt":"kvepp:t","model": "m","prompt":[1, 2.50, "x\"}"],"stream" :true}"#
        );
    }

    #[test]
    fn replaces_client_salts_everywhere() {
        let body = br#"{"cache_salt":"evil","model":"m","nvext":{"cache_salt":"evil2","other":5},"cache\u005fsalt":"evil3"}"#;
        let out = rewrite_salt(body, Some("kvepp:good")).unwrap();
        let v = json(&out);
        assert_eq!(v["cache_salt"], "kvepp:good");
        assert_eq!(v["nvext"], serde_json::json!({"other": 5}));
        assert!(!String::from_utf8_lossy(&out).contains("evil"));
        // No resolved salt: client salt fields are removed (an empty one would be a 400 at vLLM).
        let out = rewrite_salt(
            br#"{"model":"m","cache_salt":"","nvext":{"cache_salt":7}}"#,
            None,
        )
        .unwrap();
        assert_eq!(json(&out), serde_json::json!({"model":"m","nvext":{}}));
    }

    #[test]
    fn a_client_salt_in_a_repeated_nvext_never_reaches_the_engine() {
        // A JSON parser keeps the last `nvext`; the salt may sit in any of them.
        for body in [
            &br#"{"model":"m","nvext":{},"nvext":{"cache_salt":"evil","x":1}}"#[..],
            br#"{"nvext":{"cache_salt":"evil"},"model":"m","nvext":{"x":1}}"#,
        ] {
            for salt in [Some("kvepp:good"), None] {
                let out = rewrite_salt(body, salt).expect("a client salt is removed");
                assert!(!String::from_utf8_lossy(&out).contains("evil"), "{salt:?}");
                assert_eq!(
                    json(&out)["cache_salt"],
                    salt.map_or(Value::Null, Value::from)
                );
            }
        }
    }

    #[test]
    fn scanner_survives_odd_input() {
        for bad in [
            &b"{"[..],
            b"{\"a\"",
            b"{\"a\":}",
            b"[1]",
            b"{\"a\":1,}",
            b"{\"a\":\"\\",
        ] {
            let _ = rewrite_salt(bad, Some("kvepp:x"));
        }
        assert_eq!(
            json(&rewrite_salt(b"{}", Some("kvepp:x")).unwrap()),
            serde_json::json!({"cache_salt": "kvepp:x"})
        );
    }
}
