//! Chat templates rendered with transformers' Jinja semantics on MiniJinja.
//!
//! transformers renders with `ImmutableSandboxedEnvironment(trim_blocks=True,
//! lstrip_blocks=True, extensions=[loopcontrols])`, its own `tojson` filter
//! (`json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
//! sort_keys=sort_keys)`: no HTML escaping, Python's separators), and the globals
//! `raise_exception(msg)` and `strftime_now(fmt)`. Python prints `None`, `True`, `False`
//! where MiniJinja prints `none`, `true`, `false`: the formatter follows Python. Python's
//! string and dict methods (`.strip()`, `.split()`, `.startswith()`, `.items()`, ...) come
//! from minijinja-contrib's pycompat.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State, Value};

use super::{ChatRequest, TokenizeError};

/// A directory's chat templates (`default`, and named ones such as `tool_use`).
pub struct ChatTemplate {
    env: Environment<'static>,
    names: Vec<String>,
    iterates_content: bool,
}

impl ChatTemplate {
    /// Compile every `(name, source)`; the error names the template that failed.
    pub fn new(sources: &[(String, String)]) -> Result<Self, (String, String)> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let mut names = Vec::new();
        let mut iterates_content = false;
        for (name, source) in sources {
            iterates_content |= iterates_over_content(source);
            env.add_template_owned(name.clone(), source.clone())
                .map_err(|e| (name.clone(), error_line(&e)))?;
            names.push(name.clone());
        }
        Ok(ChatTemplate {
            env,
            names,
            iterates_content,
        })
    }

    /// Whether a template loops over a message's content (vLLM's "openai" content format).
    pub fn iterates_content(&self) -> bool {
        self.iterates_content
    }

    /// Render a request; `special` are the tokenizer's special tokens (`bos_token`, ...).
    pub fn render(
        &self,
        req: &ChatRequest,
        special: &[(&'static str, Value)],
    ) -> Result<String, TokenizeError> {
        // transformers: with tools, a template named "tool_use" if there is one; otherwise
        // "default" (or the only one).
        let has = |n: &str| self.names.iter().any(|x| x == n);
        let name = if !req.tools.is_none() && has("tool_use") {
            "tool_use"
        } else if has("default") {
            "default"
        } else {
            self.names.first().map(String::as_str).unwrap_or("default")
        };
        let tmpl = self
            .env
            .get_template(name)
            .map_err(|e| TokenizeError::Template(error_line(&e)))?;
        let mut ctx: Vec<(String, Value)> = special
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect();
        ctx.extend(req.kwargs.iter().cloned());
        ctx.push(("messages".into(), req.messages.clone()));
        ctx.push(("tools".into(), req.tools.clone()));
        ctx.push(("documents".into(), req.documents.clone()));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(req.add_generation_prompt),
        ));
        tmpl.render(Value::from_iter(ctx))
            .map_err(|e| TokenizeError::Template(error_line(&e)))
    }
}

/// vLLM's content-format detection, simplified: does a template loop over `message
/// ['content']` / `message.content`?
fn iterates_over_content(source: &str) -> bool {
    let s: String = source.chars().filter(|c| !c.is_whitespace()).collect();
    [
        "inmessage['content']",
        "inmessage[\"content\"]",
        "inmessage.content",
    ]
    .iter()
    .any(|p| s.contains(p))
}

fn error_line(e: &Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

fn python_formatter(
    out: &mut minijinja::Output,
    state: &State,
    value: &Value,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.write_str("None").map_err(Error::from),
        ValueKind::Bool if value.is_true() => out.write_str("True").map_err(Error::from),
        ValueKind::Bool => out.write_str("False").map_err(Error::from),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(fmt)`: the current UTC time with the common `strftime` fields.
fn strftime_now(fmt: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(Value::from(strftime(&fmt, secs)))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
];

/// Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

fn strftime(fmt: &str, secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (y, m, d) = civil(days);
    let wd = DAYS[(days.rem_euclid(7)) as usize];
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('a') => out.push_str(&wd[..3]),
            Some('A') => out.push_str(wd),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// transformers' `tojson`: Python's `json.dumps` with `ensure_ascii=False` by default.
fn tojson(value: &Value, args: &[Value], kwargs: Kwargs) -> Result<Value, Error> {
    let mut ensure_ascii = args.first().is_some_and(Value::is_true);
    if let Some(v) = kwargs.get::<Option<bool>>("ensure_ascii")? {
        ensure_ascii = v;
    }
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_owned()),
            None => Some(" ".repeat(i64::try_from(v)?.max(0) as usize)),
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => (
            v.get_item(&Value::from(0))?.to_string(),
            v.get_item(&Value::from(1))?.to_string(),
        ),
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let opts = JsonOpts {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    dump(value, &opts, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn newline(opts: &JsonOpts, level: usize, out: &mut String) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn dump(v: &Value, opts: &JsonOpts, level: usize, out: &mut String) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                let f = f64::try_from(v.clone())?;
                if f.is_nan() {
                    out.push_str("NaN");
                } else if f.is_infinite() {
                    out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
                } else if f.fract() == 0.0 && f.abs() < 1e16 {
                    out.push_str(&format!("{f:.1}"));
                } else {
                    out.push_str(&f.to_string());
                }
            }
        }
        ValueKind::String => dump_str(v.as_str().unwrap_or_default(), opts.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(opts, level + 1, out);
                dump(item, opts, level + 1, out)?;
            }
            newline(opts, level, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(opts, level + 1, out);
                match k.as_str() {
                    Some(s) => dump_str(s, opts.ensure_ascii, out),
                    None => dump_str(&k.to_string(), opts.ensure_ascii, out),
                }
                out.push_str(&opts.key_sep);
                dump(&v.get_item(k)?, opts, level + 1, out)?;
            }
            newline(opts, level, out);
            out.push('}');
        }
        _ => dump_str(&v.to_string(), opts.ensure_ascii, out),
    }
    Ok(())
}

fn dump_str(s: &str, ensure_ascii: bool, out: &mut String) {
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
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
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

    fn render(src: &str, ctx: Value) -> String {
        let t = ChatTemplate::new(&[("default".into(), src.into())]).unwrap();
        t.env.get_template("default").unwrap().render(ctx).unwrap()
    }

    #[test]
    fn tojson_follows_python_json_dumps() {
        let v: Value =
            serde_json::from_str(r#"{"b": [1, 2.0, "x\"<é>"], "a": {}, "c": null}"#).unwrap();
        let ctx = Value::from_iter([("v", v)]);
        assert_eq!(
            render("{{ v | tojson }}", ctx.clone()),
            r#"{"b": [1, 2.0, "x\"<é>"], "a": {}, "c": null}"#
        );
        assert_eq!(
            render("{{ v | tojson(indent=2) }}", ctx.clone()),
            "{\n  \"b\": [\n    1,\n    2.0,\n    \"x\\\"<é>\"\n  ],\n  \"a\": {},\n  \"c\": null\n}"
        );
        assert_eq!(
            render(
                "{{ v | tojson(ensure_ascii=true, sort_keys=true, separators=[',', ':']) }}",
                ctx
            ),
            r#"{"a":{},"b":[1,2.0,"x\"<\u00e9>"],"c":null}"#
        );
    }

    #[test]
    fn python_literals_and_pycompat_methods() {
        let ctx = Value::from_iter([("n", Value::from(())), ("t", Value::from(true))]);
        assert_eq!(
            render("{{ n }} {{ t }} {{ not t }}", ctx),
            "None True False"
        );
        let ctx = Value::from_iter([("s", Value::from("  a</think>\nb  "))]);
        assert_eq!(
            render("{{ s.split('</think>')[-1].lstrip('\\n').strip() }}|{{ s.strip().startswith('a') }}", ctx),
            "b|True"
        );
    }

    #[test]
    fn raise_exception_fails_the_render() {
        let t =
            ChatTemplate::new(&[("default".into(), "{{ raise_exception('no: ' + x) }}".into())])
                .unwrap();
        let err = t
            .env
            .get_template("default")
            .unwrap()
            .render(Value::from_iter([("x", "y")]))
            .unwrap_err();
        assert!(error_line(&err).contains("no: y"), "{}", error_line(&err));
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-07-26 12:34:56 UTC, a Friday.
        assert_eq!(
            strftime("%d %b %Y %A %H:%M:%S %%", 1_721_997_296),
            "26 Jul 2024 Friday 12:34:56 %"
        );
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
    }

    #[test]
    fn content_iteration_is_detected() {
        assert!(iterates_over_content("{% for c in message['content'] %}"));
        assert!(iterates_over_content("{%- for part in message.content -%}"));
        assert!(!iterates_over_content("{{ message['content'] | trim }}"));
    }
}
