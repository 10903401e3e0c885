//! Python's `json.dumps` for chat templates: transformers replaces jinja2's `tojson` with
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, so
//! tool definitions and call arguments reach the text as Python writes them: `", "` and
//! `": "` between items (`","` with an indent), no HTML escaping, keys in their order,
//! floats as Python's `repr`. minijinja's own `tojson` differs on all of these.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// The `tojson` filter: `value | tojson(indent=4)`, with transformers' keyword arguments.
pub fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_owned()),
            None => Some(" ".repeat(usize::try_from(v)?)),
        },
    };
    let (item_sep, key_sep) = match kwargs.get::<Option<Value>>("separators")? {
        Some(seps) if !seps.is_none() => {
            let item = seps.get_item(&Value::from(0))?;
            let key = seps.get_item(&Value::from(1))?;
            match (item.as_str(), key.as_str()) {
                (Some(i), Some(k)) => (i.to_owned(), k.to_owned()),
                _ => return Err(invalid("separators must be two strings")),
            }
        }
        _ if indent.is_some() => (",".into(), ": ".into()),
        _ => (", ".into(), ": ".into()),
    };
    let opts = Opts {
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    dump(value, &opts, 0, &mut out)?;
    Ok(Value::from(out))
}

/// jinja2's `iterable` test: anything `iter()` accepts, which `None` is not (minijinja
/// iterates over none as an empty sequence).
pub fn is_iterable(value: &Value) -> bool {
    !value.is_none() && value.try_iter().is_ok()
}

struct Opts {
    ensure_ascii: bool,
    sort_keys: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

fn dump(v: &Value, o: &Opts, depth: usize, out: &mut String) -> Result<(), Error> {
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
        ValueKind::Number => out.push_str(&float_repr(f64::try_from(v.clone())?)),
        ValueKind::String => string(v.as_str().unwrap_or_default(), o.ensure_ascii, out),
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if o.sort_keys {
                keys.sort_by_key(key_text);
            }
            let items = keys
                .into_iter()
                .map(|k| Ok((key_text(&k), v.get_item(&k)?)))
                .collect::<Result<Vec<_>, Error>>()?;
            container(('{', '}'), items.len(), o, depth, out, |i, out| {
                string(&items[i].0, o.ensure_ascii, out);
                out.push_str(&o.key_sep);
                dump(&items[i].1, o, depth + 1, out)
            })?;
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            container(('[', ']'), items.len(), o, depth, out, |i, out| {
                dump(&items[i], o, depth + 1, out)
            })?;
        }
        kind => {
            return Err(invalid(format!(
                "Object of type {kind} is not JSON serializable"
            )));
        }
    }
    Ok(())
}

/// A JSON object key as Python writes it: strings as they are, other scalars as JSON.
fn key_text(k: &Value) -> String {
    match k.kind() {
        ValueKind::String => k.as_str().unwrap_or_default().to_owned(),
        ValueKind::None => "null".into(),
        ValueKind::Bool => (if k.is_true() { "true" } else { "false" }).into(),
        ValueKind::Number if !k.is_integer() => {
            float_repr(f64::try_from(k.clone()).unwrap_or(f64::NAN))
        }
        _ => k.to_string(),
    }
}

/// `n` items between `open` and `close`, written by `item`, with Python's layout.
fn container(
    (open, close): (char, char),
    n: usize,
    o: &Opts,
    depth: usize,
    out: &mut String,
    mut item: impl FnMut(usize, &mut String) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if n == 0 {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(ind) = &o.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    };
    for i in 0..n {
        if i > 0 {
            out.push_str(&o.item_sep);
        }
        newline(out, depth + 1);
        item(i, out)?;
    }
    newline(out, depth);
    out.push(close);
    Ok(())
}

/// A JSON string as Python escapes it (`\uXXXX` in lowercase hex; with `ensure_ascii`,
/// every non-ASCII character too, as UTF-16 units).
fn string(s: &str, ensure_ascii: bool, out: &mut String) {
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
            c if (c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest digits that round-trip, positional for decimal
/// exponents in -4..16 (with `.0` when whole), else `d.ddde+XX`.
fn float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` is the shortest round-trip form: `-1.2345e-7`.
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').expect("`{:e}` writes an exponent");
    let exp: i32 = exp.parse().expect("`{:e}` writes an integer exponent");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let body = if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            format!(
                "{}.{}",
                &digits[..point as usize],
                &digits[point as usize..]
            )
        };
        format!("{sign}{body}")
    } else {
        let frac = if digits.len() > 1 {
            format!(".{}", &digits[1..])
        } else {
            String::new()
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{}{frac}e{esign}{:02}", &digits[..1], exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, ctx: Value) -> String {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson);
        env.add_test("iterable", is_iterable);
        env.render_str(src, ctx).unwrap()
    }

    /// Expected strings are what CPython's `json.dumps` writes for the same values.
    #[test]
    fn dumps_as_python_does() {
        let v: Value = serde_json::from_str(
            r#"{"b": [1, 2.5, 1e-5, 1e16, 100.0, true, null], "a": {"é": "x<y>\n\"\u0001"}, "e": [], "f": {}}"#,
        )
        .unwrap();
        let ctx = minijinja::context! { v };
        assert_eq!(
            render("{{ v | tojson }}", ctx.clone()),
            "{\"b\": [1, 2.5, 1e-05, 1e+16, 100.0, true, null], \"a\": {\"é\": \"x<y>\\n\\\"\\u0001\"}, \"e\": [], \"f\": {}}"
        );
        assert_eq!(
            render(
                "{{ v.a | tojson(indent=2) }}|{{ v.b[:2] | tojson(indent=1) }}",
                ctx.clone()
            ),
            "{\n  \"é\": \"x<y>\\n\\\"\\u0001\"\n}|[\n 1,\n 2.5\n]"
        );
        assert_eq!(
            render(
                "{{ v.a | tojson(ensure_ascii=true) }} {{ {'z': 1, 'y': 2} | tojson(sort_keys=true, separators=[',', ':']) }}",
                ctx
            ),
            "{\"\\u00e9\": \"x<y>\\n\\\"\\u0001\"} {\"y\":2,\"z\":1}"
        );
    }

    #[test]
    fn floats_print_as_python_repr() {
        let cases = [
            (0.1, "0.1"),
            (123.0, "123.0"),
            (-0.0001, "-0.0001"),
            (0.00001234, "1.234e-05"),
            (1e15, "1000000000000000.0"),
            (1.5e16, "1.5e+16"),
            (2.5e-300, "2.5e-300"),
            (1e22, "1e+22"),
        ];
        for (x, want) in cases {
            assert_eq!(float_repr(x), want, "{x}");
        }
    }

    #[test]
    fn strings_are_iterable_and_none_is_not() {
        let ctx = minijinja::context! { s => "ab", n => () };
        assert_eq!(
            render("{{ s is iterable }} {{ n is iterable }}", ctx),
            "True False"
        );
    }
}
