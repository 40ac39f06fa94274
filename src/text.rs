//! Text written for a person (log lines, the `status` table): names come
//! from objects a guest cluster controls, so a control character in one
//! must not forge a log line (`\n`) or hide a row of a terminal table
//! (`ESC[8m`). [`escape`] makes every control character visible instead.
//!
//! This is defence in depth: it holds whatever a name contains, whether or
//! not `check` and `import` accept it. JSON output needs none of it (its
//! strings are escaped by `serde_json`).

use std::borrow::Cow;
use std::fmt;

/// `s` with every control character written as a visible escape: `\n`,
/// `\r`, `\t`, `\\` (so an escape in the input cannot pass for one made
/// here) and `\x1b`-style hex for the rest, including DEL and the C1
/// range (`\u{9b}` is an 8-bit CSI to some terminals). Borrowed when
/// nothing needs escaping, the common case.
pub fn escape(s: &str) -> Cow<'_, str> {
    if !s.chars().any(needs_escape) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    let _ = write_escaped(&mut out, s);
    Cow::Owned(out)
}

/// A [`Display`](fmt::Display) of a string through [`escape`], for log
/// fields (`name = %Escaped(&lb.name)`) and `format!`.
pub struct Escaped<'a>(pub &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_escaped(f, self.0)
    }
}

/// `n` and the noun that goes with it: "1 load balancer", "2 load
/// balancers", "0 load balancers".
pub fn count(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

fn needs_escape(c: char) -> bool {
    c.is_control() || c == '\\'
}

/// Writes `s` to `out` with its control characters escaped as [`escape`]
/// does, but its backslashes left as they are: for text that is already
/// partly escaped, such as a log field's `Debug` form (`"a\"b"`), where
/// doubling the backslash would end the quoted string early and let the
/// rest pass for fields of its own.
pub fn write_controls_escaped(out: &mut impl fmt::Write, s: &str) -> fmt::Result {
    let mut rest = s;
    while let Some(i) = rest.find(char::is_control) {
        out.write_str(&rest[..i])?;
        let c = rest[i..].chars().next().expect("found at i");
        write_escaped(out, c.encode_utf8(&mut [0; 4]))?;
        rest = &rest[i + c.len_utf8()..];
    }
    out.write_str(rest)
}

/// Writes `s` escaped to `out`.
pub fn write_escaped(out: &mut impl fmt::Write, s: &str) -> fmt::Result {
    let mut rest = s;
    while let Some(i) = rest.find(needs_escape) {
        out.write_str(&rest[..i])?;
        let c = rest[i..].chars().next().expect("found at i");
        match c {
            '\n' => out.write_str("\\n")?,
            '\r' => out.write_str("\\r")?,
            '\t' => out.write_str("\\t")?,
            '\\' => out.write_str("\\\\")?,
            c if (c as u32) < 0x100 => write!(out, "\\x{:02x}", c as u32)?,
            c => write!(out, "\\u{{{:x}}}", c as u32)?,
        }
        rest = &rest[i + c.len_utf8()..];
    }
    out.write_str(rest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_become_visible_escapes() {
        assert!(matches!(escape("default/web-1"), Cow::Borrowed(_)));
        assert_eq!(escape("a\nb"), "a\\nb");
        assert_eq!(escape("x\x1b[8my"), "x\\x1b[8my");
        assert_eq!(escape("\r\t\x00\x7f"), "\\r\\t\\x00\\x7f");
        assert_eq!(escape("c1\u{9b}2J"), "c1\\x9b2J");
        assert_eq!(escape("back\\slash"), "back\\\\slash");
        let mut kept = String::new();
        write_controls_escaped(&mut kept, "\"a\\\"b\"\n\x1b").unwrap();
        assert_eq!(kept, "\"a\\\"b\"\\n\\x1b");
        // Non-control Unicode is left as it is.
        assert_eq!(escape("naïve/日本"), "naïve/日本");
        assert_eq!(Escaped("a\nb").to_string(), "a\\nb");
        for c in (0u32..0x20).chain(0x7f..0xa0).filter_map(char::from_u32) {
            let e = escape(&c.to_string()).into_owned();
            assert!(!e.chars().any(char::is_control), "{c:?} -> {e:?}");
        }
    }
}
