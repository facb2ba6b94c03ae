//! Python's `json.dumps`, byte for byte: what transformers' `tojson` filter writes into a
//! chat template's output (tool schemas, tool-call arguments), so it must match exactly.
//! Separators `", "` and `": "` (`","` with an indent), no HTML escaping, key order kept,
//! floats as Python's `repr` (`1.0`, `1e-07`, `1e+16`), `NaN`/`Infinity` allowed.

use serde_json::Value;

#[derive(Debug, Clone, Default)]
pub struct Options {
    pub ensure_ascii: bool,
    /// The indent string per level (`indent=2` is two spaces); `None`: one line.
    pub indent: Option<String>,
    /// (item, key) separators; `None`: Python's defaults for the indent.
    pub separators: Option<(String, String)>,
    pub sort_keys: bool,
}

pub fn dumps(v: &Value, o: &Options) -> String {
    let (item, key) = match &o.separators {
        Some((i, k)) => (i.as_str(), k.as_str()),
        None if o.indent.is_some() => (",", ": "),
        None => (", ", ": "),
    };
    let mut out = String::new();
    write(&mut out, v, o, item, key, 0);
    out
}

fn newline(out: &mut String, o: &Options, level: usize) {
    if let Some(ind) = &o.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn write(out: &mut String, v: &Value, o: &Options, item: &str, key: &str, level: usize) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => out.push_str(&i.to_string()),
            (_, Some(u), _) => out.push_str(&u.to_string()),
            (_, _, Some(f)) if n.is_f64() => out.push_str(&float_repr(f)),
            _ => out.push_str(&n.to_string()), // an arbitrary-precision integer
        },
        Value::String(s) => string(out, s, o.ensure_ascii),
        Value::Array(a) => {
            if a.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(item);
                }
                newline(out, o, level + 1);
                write(out, x, o, item, key, level + 1);
            }
            newline(out, o, level);
            out.push(']');
        }
        Value::Object(m) => {
            if m.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &Value)> = m.iter().collect();
            if o.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, x)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item);
                }
                newline(out, o, level + 1);
                string(out, k, o.ensure_ascii);
                out.push_str(key);
                write(out, x, o, item, key, level + 1);
            }
            newline(out, o, level);
            out.push('}');
        }
    }
}

fn string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
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

/// Python's `repr(float)`: the shortest digits that round-trip, in fixed notation when the
/// decimal exponent is in [-4, 16), else as `d.ddde±XX`; always a `.0` or an exponent.
pub fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // Rust's `{:e}` is the shortest round-trip form too: "1.2345e-5".
    let e = format!("{:e}", f.abs());
    let (mantissa, exp) = e.split_once('e').unwrap_or((&e, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let decpt = exp + 1; // value = 0.DIGITS × 10^decpt
    let sign = if f < 0.0 { "-" } else { "" };
    let n = digits.len() as i32;
    if (-4 < decpt) && (decpt <= 16) {
        if decpt <= 0 {
            format!("{sign}0.{}{digits}", "0".repeat((-decpt) as usize))
        } else if decpt >= n {
            format!("{sign}{digits}{}.0", "0".repeat((decpt - n) as usize))
        } else {
            format!("{sign}{}.{}", &digits[..decpt as usize], &digits[decpt as usize..])
        }
    } else {
        let rest = &digits[1..];
        let dot = if rest.is_empty() { String::new() } else { format!(".{rest}") };
        let x = decpt - 1;
        format!("{sign}{}{dot}e{}{:02}", &digits[..1], if x < 0 { '-' } else { '+' }, x.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn floats_are_pythons_repr() {
        // Each pair checked against CPython 3.11's repr().
        for (f, want) in [
            (1.0, "1.0"),
            (1.5, "1.5"),
            (100.0, "100.0"),
            (123.456, "123.456"),
            (0.1, "0.1"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1e-7, "1e-07"),
            (1.5e-7, "1.5e-07"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.2345678901234568e17, "1.2345678901234568e+17"),
            (1e20, "1e+20"),
            (-2.5, "-2.5"),
            (-0.0, "-0.0"),
            (0.30000000000000004, "0.30000000000000004"),
            (f64::MAX, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
        ] {
            assert_eq!(float_repr(f), want, "{f:e}");
        }
    }

    #[test]
    fn dumps_matches_json_dumps() {
        let v = json!({"name": "get_weather", "n": [1, -2, 3.25], "s": "tab\t\"q\" \u{1}é 😀", "e": {}, "l": []});
        assert_eq!(
            dumps(&v, &Options::default()),
            r#"{"name": "get_weather", "n": [1, -2, 3.25], "s": "tab\t\"q\" \u0001é 😀", "e": {}, "l": []}"#
        );
        let o = Options { ensure_ascii: true, ..Options::default() };
        assert_eq!(dumps(&json!("é😀"), &o), r#""\u00e9\ud83d\ude00""#);
        let o = Options { separators: Some((",".into(), ":".into())), ..Options::default() };
        assert_eq!(dumps(&json!({"a": [1, 2]}), &o), r#"{"a":[1,2]}"#);
    }
}
