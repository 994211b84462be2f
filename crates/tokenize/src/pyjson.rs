//! `tojson` exactly as transformers configures it: Python's `json.dumps`.
//!
//! transformers replaces Jinja2's HTML-escaping `tojson` with
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, so tool
//! schemas render with `", "` / `": "` separators, `<`, `>`, `&`, `'` unescaped, non-ASCII kept
//! raw, keys in insertion order and floats in Python's `repr` (`1e-06`, `1e+16`, `1.0`). Any
//! difference shifts every token after the tools block, so this is its own module with tests.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// Python's `repr(float)` / `str(float)`: shortest round-trip digits, exponent form when the
/// decimal exponent is < -4 or >= 16, always a `.0` on integral values in fixed form.
/// Non-finite values print as Python does (`inf`, `-inf`, `nan`).
pub fn py_float_repr(x: f64, out: &mut String) {
    if x.is_nan() {
        out.push_str("nan");
    } else if x.is_infinite() {
        out.push_str(if x > 0.0 { "inf" } else { "-inf" });
    } else if x == 0.0 {
        out.push_str(if x.is_sign_negative() { "-0.0" } else { "0.0" });
    } else {
        // Rust's `{:e}` gives the shortest digits that round-trip, like Python's repr.
        let sci = format!("{x:e}");
        let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
        let exp: i32 = exp.parse().unwrap_or(0);
        let (neg, mantissa) = match mantissa.strip_prefix('-') {
            Some(m) => (true, m),
            None => (false, mantissa),
        };
        let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
        if neg {
            out.push('-');
        }
        if !(-4..16).contains(&exp) {
            out.push_str(&digits[..1]);
            if digits.len() > 1 {
                out.push('.');
                out.push_str(&digits[1..]);
            }
            let sign = if exp < 0 { '-' } else { '+' };
            let _ = write!(out, "e{sign}{:02}", exp.unsigned_abs());
        } else if exp < 0 {
            out.push_str("0.");
            for _ in 0..(-exp - 1) {
                out.push('0');
            }
            out.push_str(&digits);
        } else {
            let point = exp as usize + 1;
            if digits.len() <= point {
                out.push_str(&digits);
                for _ in digits.len()..point {
                    out.push('0');
                }
                out.push_str(".0");
            } else {
                out.push_str(&digits[..point]);
                out.push('.');
                out.push_str(&digits[point..]);
            }
        }
    }
}

/// Options of Python's `json.dumps` that templates may pass to `tojson`.
#[derive(Clone, Debug)]
pub struct DumpOptions {
    /// `ensure_ascii`: escape every non-ASCII character as `\uXXXX`.
    pub ensure_ascii: bool,
    /// `indent`: `None` for one line, else the per-level indent string.
    pub indent: Option<String>,
    /// Separator between items.
    pub item_sep: String,
    /// Separator between a key and its value.
    pub key_sep: String,
    /// `sort_keys`.
    pub sort_keys: bool,
}

impl Default for DumpOptions {
    fn default() -> Self {
        DumpOptions {
            ensure_ascii: false,
            indent: None,
            item_sep: ", ".to_owned(),
            key_sep: ": ".to_owned(),
            sort_keys: false,
        }
    }
}

impl DumpOptions {
    /// Reads `tojson`'s keyword arguments with transformers' defaults.
    pub fn from_kwargs(kwargs: &Kwargs) -> Result<DumpOptions, Error> {
        let mut opts = DumpOptions {
            ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
            sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
            ..DumpOptions::default()
        };
        let indent: Option<Value> = kwargs.get("indent")?;
        if let Some(indent) = indent.filter(|v| !v.is_none()) {
            opts.indent = Some(match indent.as_str() {
                Some(s) => s.to_owned(),
                None => {
                    let n = indent.as_i64().ok_or_else(|| {
                        Error::new(ErrorKind::InvalidOperation, "indent must be int or str")
                    })?;
                    " ".repeat(usize::try_from(n).unwrap_or(0))
                }
            });
            // json.dumps: with an indent and no explicit separators, items end with "," only.
            opts.item_sep = ",".to_owned();
        }
        let separators: Option<Value> = kwargs.get("separators")?;
        if let Some(seps) = separators.filter(|v| !v.is_none()) {
            let item = seps.get_item_by_index(0)?;
            let key = seps.get_item_by_index(1)?;
            match (item.as_str(), key.as_str()) {
                (Some(i), Some(k)) => {
                    opts.item_sep = i.to_owned();
                    opts.key_sep = k.to_owned();
                }
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "separators must be a pair of strings",
                    ));
                }
            }
        }
        kwargs.assert_all_used()?;
        Ok(opts)
    }
}

/// The `tojson` filter: `json.dumps` with transformers' defaults and the keyword arguments given.
pub fn tojson_filter(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let opts = DumpOptions::from_kwargs(&kwargs)?;
    let mut out = String::new();
    dump(value, &opts, 0, &mut out)?;
    Ok(Value::from(out))
}

/// Serializes a template value the way Python's `json.dumps` would serialize the same data.
/// Values with no JSON form (undefined, functions, namespaces, ...) are errors, as in Python.
pub fn dump(
    value: &Value,
    opts: &DumpOptions,
    depth: usize,
    out: &mut String,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => dump_number(value, out),
        ValueKind::String => dump_str(value.as_str().unwrap_or_default(), opts.ensure_ascii, out),
        ValueKind::Seq => {
            let items: Vec<Value> = value.try_iter()?.collect();
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(opts, depth + 1, out);
                dump(item, opts, depth + 1, out)?;
            }
            if !items.is_empty() {
                newline_indent(opts, depth, out);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if opts.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(opts, depth + 1, out);
                dump_key(key, opts, out)?;
                out.push_str(&opts.key_sep);
                dump(&value.get_item(key)?, opts, depth + 1, out)?;
            }
            if !keys.is_empty() {
                newline_indent(opts, depth, out);
            }
            out.push('}');
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("Object of type {kind} is not JSON serializable"),
            ));
        }
    }
    Ok(())
}

/// Python converts non-string keys: numbers to their text, booleans to true/false, None to null.
fn dump_key(key: &Value, opts: &DumpOptions, out: &mut String) -> Result<(), Error> {
    match key.kind() {
        ValueKind::String => dump_str(key.as_str().unwrap_or_default(), opts.ensure_ascii, out),
        ValueKind::Number | ValueKind::Bool | ValueKind::None => {
            let mut text = String::new();
            dump(key, opts, 0, &mut text)?;
            dump_str(&text, opts.ensure_ascii, out);
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("keys must be str, int, float, bool or None, not {kind}"),
            ));
        }
    }
    Ok(())
}

fn newline_indent(opts: &DumpOptions, depth: usize, out: &mut String) {
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

fn dump_number(value: &Value, out: &mut String) {
    if value.is_integer() {
        let _ = write!(out, "{value}");
        return;
    }
    let x = f64::try_from(value.clone()).unwrap_or(f64::NAN);
    if x.is_nan() {
        out.push_str("NaN");
    } else if x.is_infinite() {
        out.push_str(if x > 0.0 { "Infinity" } else { "-Infinity" });
    } else {
        py_float_repr(x, out);
    }
}

/// A JSON string literal as Python's encoder writes it (lowercase `\u00XX` escapes).
fn dump_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.reserve(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use indexmap::IndexMap;

    fn repr(x: f64) -> String {
        let mut s = String::new();
        py_float_repr(x, &mut s);
        s
    }

    #[test]
    fn floats_print_like_python_repr() {
        // Right-hand sides are CPython 3 `repr()` outputs.
        for (x, py) in [
            (1e-06, "1e-06"),
            (1e-05, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (1.0, "1.0"),
            (-0.5, "-0.5"),
            (0.25, "0.25"),
            (123456789012345678.0, "1.2345678901234568e+17"),
            (1.5e-7, "1.5e-07"),
            (-0.0, "-0.0"),
            (2.5e300, "2.5e+300"),
            (0.1 + 0.2, "0.30000000000000004"),
            (12.5, "12.5"),
            (100.0, "100.0"),
            (f64::INFINITY, "inf"),
        ] {
            assert_eq!(repr(x), py, "{x:?}");
        }
    }

    fn dumps(v: &Value) -> String {
        let mut s = String::new();
        dump(v, &DumpOptions::default(), 0, &mut s).unwrap();
        s
    }

    #[test]
    fn dumps_like_python_json() {
        let mut inner = IndexMap::new();
        inner.insert(Value::from("z"), Value::from(1.0));
        inner.insert(
            Value::from("a"),
            Value::from(vec![Value::from(1), Value::from(())]),
        );
        let mut map = IndexMap::new();
        map.insert(
            Value::from("desc"),
            Value::from("<city> & 'unit' \"x\" 東京\n\x1c"),
        );
        map.insert(Value::from("eps"), Value::from(1e-06));
        map.insert(Value::from("inner"), Value::from(inner));
        map.insert(Value::from("ok"), Value::from(true));
        map.insert(Value::from("empty"), Value::from(Vec::<Value>::new()));
        let v = Value::from(map);
        assert_eq!(
            dumps(&v),
            r#"{"desc": "<city> & 'unit' \"x\" 東京\n\u001c", "eps": 1e-06, "inner": {"z": 1.0, "a": [1, null]}, "ok": true, "empty": []}"#
        );
    }

    #[test]
    fn dumps_options() {
        let mut map = IndexMap::new();
        map.insert(Value::from("b"), Value::from("é😀"));
        map.insert(Value::from("a"), Value::from(vec![Value::from(1)]));
        let v = Value::from(map);
        let opts = DumpOptions {
            ensure_ascii: true,
            indent: Some("  ".to_owned()),
            item_sep: ",".to_owned(),
            sort_keys: true,
            ..DumpOptions::default()
        };
        let mut s = String::new();
        dump(&v, &opts, 0, &mut s).unwrap();
        assert_eq!(
            s,
            "{\n  \"a\": [\n    1\n  ],\n  \"b\": \"\\u00e9\\ud83d\\ude00\"\n}"
        );
        assert!(dump(&Value::UNDEFINED, &opts, 0, &mut String::new()).is_err());
    }
}
