//! Chat templates rendered the way transformers renders them.
//!
//! transformers compiles a template in a Jinja2 sandbox with `trim_blocks`, `lstrip_blocks`,
//! `keep_trailing_newline=False` and the loop-controls extension, and adds `raise_exception`,
//! `strftime_now` and an HTML-free `tojson`. We compile the source once, at load, into a
//! minijinja environment configured the same way, plus Python's string semantics
//! ([`super::pystr`]) and Python's way of printing values (`None`, `True`, `1e+16`).
//! `continue_final_message` follows transformers' marker technique.
//!
//! Rendering allocates the output string and nothing per template node beyond what minijinja
//! does; no parsing happens per request.

use std::fmt;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::ValueKind;
use minijinja::{Environment, Error, ErrorKind, Output, State, Value};

use super::pystr::{py_rstrip, py_strip, trim_filter, unknown_method};
use super::{pyjson, strftime, vllm};

/// Name of the single template in the environment.
const NAME: &str = "chat_template";
/// Appended to the final message for `continue_final_message`; the rendered text is cut here.
pub(crate) const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// Why a render failed.
#[derive(Debug)]
pub(crate) enum RenderError {
    /// The template called `raise_exception(message)`: the request is invalid for this model.
    Raised(String),
    /// Any other template failure (unknown filter, type error, ...), with minijinja's message.
    Failed(String),
}

/// Marker source attached to errors produced by `raise_exception`, so they can be told apart
/// from other template failures after minijinja wraps them.
#[derive(Debug)]
struct Raised;

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("raised by the chat template")
    }
}

impl std::error::Error for Raised {}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message).with_source(Raised))
}

/// Prints values as Jinja2 under Python does: `None`, `True`/`False`, floats in `repr` form.
fn py_formatter(out: &mut Output, state: &mut State, value: &Value) -> Result<(), Error> {
    let text = match value.kind() {
        ValueKind::None => "None".to_owned(),
        ValueKind::Bool => (if value.is_true() { "True" } else { "False" }).to_owned(),
        ValueKind::Number if !value.is_integer() => {
            let mut s = String::new();
            pyjson::py_float_repr(f64::try_from(value.clone()).unwrap_or(f64::NAN), &mut s);
            s
        }
        _ => return minijinja::escape_formatter(out, state, value),
    };
    out.write_str(&text).map_err(Error::from)
}

/// A compiled chat template and the environment it runs in.
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    /// transformers refuses `continue_final_message` when the source never mentions `content`.
    mentions_content: bool,
    /// The variables the template reads without setting them (vLLM passes only those of the
    /// request's `chat_template_kwargs`).
    variables: std::collections::HashSet<String>,
    /// vLLM keeps `developer` messages for this template (see `vllm::supports_developer_role`).
    supports_developer: bool,
    /// The template iterates over message content (see `vllm::reads_content_parts`).
    reads_content_parts: bool,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles a template source. Errors are syntax errors, with minijinja's message.
    pub(crate) fn compile(source: String) -> Result<ChatTemplate, Error> {
        let mut env = Environment::new();
        env.set_syntax(
            SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .keep_trailing_newline(false)
                .build()?,
        );
        env.set_unknown_method_callback(unknown_method);
        env.set_formatter(py_formatter);
        env.add_filter("tojson", pyjson::tojson_filter);
        env.add_filter("trim", |s: &str, chars: Option<&str>| trim_filter(s, chars));
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", |fmt: &str| strftime::strftime_now(fmt));
        let mentions_content = source.contains("content");
        let supports_developer = vllm::supports_developer_role(&source);
        let reads_content_parts = vllm::reads_content_parts(&source);
        env.add_template_owned(NAME, source)?;
        let variables = env.get_template(NAME)?.undeclared_variables(false);
        Ok(ChatTemplate {
            env,
            mentions_content,
            variables,
            supports_developer,
            reads_content_parts,
        })
    }

    /// Renders with the given variables (a map value).
    pub(crate) fn render(&self, vars: Value) -> Result<String, RenderError> {
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| RenderError::Failed(e.to_string()))?;
        template.render(vars).map_err(classify)
    }

    /// Whether the source mentions `content` (a precondition of `continue_final_message`).
    pub(crate) fn mentions_content(&self) -> bool {
        self.mentions_content
    }

    /// The variables the template reads without setting them.
    pub(crate) fn variables(&self) -> &std::collections::HashSet<String> {
        &self.variables
    }

    /// Whether vLLM keeps `developer` messages for this template.
    pub(crate) fn supports_developer(&self) -> bool {
        self.supports_developer
    }

    /// Whether the template iterates over message content (vLLM's "openai" content format).
    pub(crate) fn reads_content_parts(&self) -> bool {
        self.reads_content_parts
    }
}

fn classify(err: Error) -> RenderError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if e.is::<Raised>() {
            return RenderError::Raised(err.detail().unwrap_or_default().to_owned());
        }
        source = e.source();
    }
    RenderError::Failed(err.to_string())
}

/// Cuts a render of a conversation whose final content had [`CONTINUE_TAG`] appended, the way
/// transformers does: at the tag when the template kept it intact, else at the tag with trailing
/// whitespace removed. `None` when the final message (stripped) or the tag is not in the text.
pub(crate) fn cut_at_continue_tag(rendered: &str, final_content: &str) -> Option<String> {
    let tag = py_strip(CONTINUE_TAG);
    if !rendered.contains(py_strip(final_content)) {
        return None;
    }
    let at = rendered.rfind(tag)?;
    let before = &rendered[..at];
    Some(if rendered[at..].starts_with(CONTINUE_TAG) {
        before.to_owned()
    } else {
        py_rstrip(before).to_owned()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use indexmap::IndexMap;

    fn render(src: &str, vars: &[(&str, Value)]) -> Result<String, RenderError> {
        let t = ChatTemplate::compile(src.to_owned()).unwrap();
        let map: IndexMap<Value, Value> = vars
            .iter()
            .map(|(k, v)| (Value::from(*k), v.clone()))
            .collect();
        t.render(Value::from(map))
    }

    #[test]
    fn python_printing_and_methods() {
        let out = render(
            "{{ x }} {{ y }} {{ n }} {{ f }} {{ s.strip() }}|{{ s | trim }}|{{ 'a b'.split() | length }}\n",
            &[
                ("x", Value::from(())),
                ("y", Value::from(true)),
                ("n", Value::from(3)),
                ("f", Value::from(1e16)),
                ("s", Value::from("\x1c hi \x1f")),
            ],
        )
        .unwrap();
        // The single trailing newline of the source is dropped (keep_trailing_newline=False).
        assert_eq!(out, "None True 3 1e+16 hi|hi|2");
    }

    #[test]
    fn block_whitespace_and_loop_controls() {
        let src = "{% for i in range(5) %}\n  {% if i == 3 %}{% break %}{% endif %}\n{{ i }},\n{% endfor %}\n";
        assert_eq!(render(src, &[]).unwrap(), "0,\n1,\n2,\n");
    }

    #[test]
    fn raise_exception_is_told_apart() {
        match render("{{ raise_exception('nope') }}", &[]) {
            Err(RenderError::Raised(m)) => assert_eq!(m, "nope"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            render("{{ 1 + 'a' }}", &[]),
            Err(RenderError::Failed(_))
        ));
    }

    #[test]
    fn continue_tag_cut() {
        let t = CONTINUE_TAG;
        assert_eq!(
            cut_at_continue_tag(&format!("<a>hi{t}</a>"), "hi").as_deref(),
            Some("<a>hi")
        );
        // The template stripped the tag's trailing space: cut and rstrip.
        assert_eq!(
            cut_at_continue_tag("<a>hi \nCONTINUE_FINAL_MESSAGE_TAG</a>", "hi ").as_deref(),
            Some("<a>hi")
        );
        assert_eq!(cut_at_continue_tag("<a>hi</a>", "hi"), None);
    }
}

#[cfg(test)]
mod variable_tests {
    use super::*;

    /// The variables vLLM's `_resolve_chat_template_kwargs` (jinja2's
    /// `find_undeclared_variables`) finds in these templates; kwargs outside them are dropped.
    #[test]
    fn undeclared_variables_as_jinja2_finds_them() {
        let cases: [(&str, &[&str]); 5] = [
            (
                "{% macro f(a) %}{{ a }}{{ in_macro }}{% endmacro %}{{ f(1) }}",
                &["in_macro"],
            ),
            (
                "{% if flag is defined and flag %}{{ x }}{% endif %}{% set y = 1 %}{{ y }}",
                &["flag", "x"],
            ),
            (
                "{% set ns = namespace(a=seed) %}{% for m in messages %}{{ m.content }}{% endfor %}",
                &["seed", "messages"],
            ),
            (
                "{% if date is not defined %}{% set date = 'd' %}{% endif %}{{ date }}",
                &["date"],
            ),
            (
                "{% for i in items %}{{ loop.index }}{% endfor %}",
                &["items"],
            ),
        ];
        for (src, want) in cases {
            let t = ChatTemplate::compile(src.to_owned()).unwrap();
            for name in want {
                assert!(t.variables().contains(*name), "{src}: {name} missing");
            }
            for name in ["y", "a", "m", "i", "loop"] {
                assert!(
                    !t.variables().contains(name),
                    "{src}: {name} is not undeclared"
                );
            }
        }
    }
}
