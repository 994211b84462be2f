//! Python string semantics that chat templates rely on.
//!
//! Templates are written for Jinja2, where `s.strip()`, `s.split()` and the `trim` filter are
//! Python's `str` methods. Python's whitespace set is Rust's `char::is_whitespace` plus the four
//! information separators U+001C..U+001F, so `str::trim` is not a drop-in: a user message that
//! starts with `\x1c` would render differently and route to the wrong cache. Everything here
//! follows CPython 3's `str` behaviour; the remaining Python methods come from
//! `minijinja_contrib::pycompat`.

use minijinja::value::from_args;
use minijinja::{Error, ErrorKind, State, Value};

/// Python's `str.isspace()` for one character.
pub fn is_py_whitespace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `s.strip()` (no argument).
pub fn py_strip(s: &str) -> &str {
    s.trim_matches(is_py_whitespace)
}

/// Python's `s.lstrip()` (no argument).
pub fn py_lstrip(s: &str) -> &str {
    s.trim_start_matches(is_py_whitespace)
}

/// Python's `s.rstrip()` (no argument).
pub fn py_rstrip(s: &str) -> &str {
    s.trim_end_matches(is_py_whitespace)
}

/// Which end(s) a strip applies to.
#[derive(Clone, Copy)]
enum Ends {
    Both,
    Start,
    End,
}

/// `strip` / `lstrip` / `rstrip` with Python's optional `chars` argument (`None` = whitespace).
fn strip_with(s: &str, chars: Option<&str>, ends: Ends) -> String {
    let matches = |c: char| match chars {
        Some(set) => set.contains(c),
        None => is_py_whitespace(c),
    };
    match ends {
        Ends::Both => s.trim_matches(matches),
        Ends::Start => s.trim_start_matches(matches),
        Ends::End => s.trim_end_matches(matches),
    }
    .to_owned()
}

/// Python's `s.split(sep=None, maxsplit=-1)`.
///
/// Without `sep`, runs of whitespace separate and leading/trailing whitespace yields no empty
/// pieces; with `sep`, every occurrence separates (empty pieces kept). An empty `sep` is an error,
/// as in Python.
pub fn py_split(s: &str, sep: Option<&str>, maxsplit: i64) -> Result<Vec<String>, Error> {
    let limit = usize::try_from(maxsplit).ok();
    match sep {
        Some("") => Err(Error::new(ErrorKind::InvalidOperation, "empty separator")),
        Some(sep) => Ok(match limit {
            Some(n) => s
                .splitn(n.saturating_add(1), sep)
                .map(str::to_owned)
                .collect(),
            None => s.split(sep).map(str::to_owned).collect(),
        }),
        None => {
            let mut out = Vec::new();
            let mut rest = py_lstrip(s);
            while !rest.is_empty() {
                if limit.is_some_and(|n| out.len() >= n) {
                    out.push(rest.to_owned());
                    break;
                }
                let end = rest.find(is_py_whitespace).unwrap_or(rest.len());
                out.push(rest[..end].to_owned());
                rest = py_lstrip(&rest[end..]);
            }
            Ok(out)
        }
    }
}

/// The Jinja2 `trim` filter: Python's `str.strip(chars)`.
pub fn trim_filter(value: &str, chars: Option<&str>) -> String {
    strip_with(value, chars, Ends::Both)
}

/// The template engine's hook for methods it does not know (`value.method(...)`).
///
/// Whitespace-sensitive string methods are answered here with Python semantics; everything else
/// is delegated to `minijinja_contrib::pycompat` (`startswith`, `upper`, `replace`, `items`,
/// `get`, ...).
pub fn unknown_method(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        let ends = match method {
            "strip" => Some(Ends::Both),
            "lstrip" => Some(Ends::Start),
            "rstrip" => Some(Ends::End),
            _ => None,
        };
        if let Some(ends) = ends {
            let (chars,): (Option<&str>,) = from_args(args)?;
            return Ok(Value::from(strip_with(s, chars, ends)));
        }
        if method == "split" {
            let (sep, maxsplit): (Option<&str>, Option<i64>) = from_args(args)?;
            let parts = py_split(s, sep, maxsplit.unwrap_or(-1))?;
            return Ok(parts.into_iter().map(Value::from).collect());
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whitespace_set_is_pythons() {
        // Exactly the 29 code points for which CPython's str.isspace() is true.
        let python: Vec<u32> = vec![
            0x9, 0xa, 0xb, 0xc, 0xd, 0x1c, 0x1d, 0x1e, 0x1f, 0x20, 0x85, 0xa0, 0x1680, 0x2000,
            0x2001, 0x2002, 0x2003, 0x2004, 0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200a, 0x2028,
            0x2029, 0x202f, 0x205f, 0x3000,
        ];
        let ours: Vec<u32> = (0..=0x10ffffu32)
            .filter_map(char::from_u32)
            .filter(|&c| is_py_whitespace(c))
            .map(u32::from)
            .collect();
        assert_eq!(ours, python);
    }

    #[test]
    fn strip_removes_information_separators() {
        let s = "\x1c\x1f\u{3000}\u{a0} content \u{2028}\x1e\x0b\x0c";
        assert_eq!(py_strip(s), "content");
        assert_eq!(s.trim(), "\x1c\x1f\u{3000}\u{a0} content \u{2028}\x1e"); // why: Rust differs
        assert_eq!(py_lstrip("\x1d a "), "a ");
        assert_eq!(py_rstrip(" a \x1d"), " a");
        assert_eq!(trim_filter("xxaxx", Some("x")), "a");
        assert_eq!(strip_with("\n\nx\n", Some("\n"), Ends::Start), "x\n");
    }

    #[test]
    fn split_follows_python() {
        assert_eq!(py_split(" a b\x1c c ", None, -1).unwrap(), ["a", "b", "c"]);
        assert_eq!(py_split("a,,b", Some(","), -1).unwrap(), ["a", "", "b"]);
        assert_eq!(py_split("a b c", None, 1).unwrap(), ["a", "b c"]);
        assert_eq!(
            py_split("  a  b ", Some(" "), -1).unwrap(),
            ["", "", "a", "", "b", ""]
        );
        assert_eq!(py_split("a.b.c", Some("."), 1).unwrap(), ["a", "b.c"]);
        assert!(py_split("x", Some(""), -1).is_err());
        assert!(py_split("   ", None, -1).unwrap().is_empty());
    }
}
