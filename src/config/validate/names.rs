//! Names that reach logs, metric labels and the `status` table: bounded to
//! Kubernetes' own limits and free of control characters.
//!
//! A name is printed for a person in every log line and `status` row and
//! repeated in every series of `/metrics`: a 250 KB cluster name turned one
//! scrape into 126 MB, and a `\n` or an `ESC` forged a log line or hid a
//! row. Every name the controller can write comes from a Kubernetes object
//! whose own API server bounds it, so a longer one is a mistake or an attack.

use toml::Spanned;

use super::Validator;

/// Longest `load_balancer.name`: `<namespace>/<name>`, a namespace being a
/// DNS label (63 bytes) and a name a DNS subdomain (253 bytes).
pub const MAX_NAME_BYTES: usize = 63 + 1 + 253;
/// Longest `load_balancer.cluster`: a guest cluster's name is a Kubernetes
/// object name (a DNS subdomain, 253 bytes).
pub const MAX_CLUSTER_BYTES: usize = 253;
/// Longest `listener.name`: a Service port's name is at most 15 bytes (an
/// IANA service name) and a `LoadBalancer` listener's a DNS label (63).
pub const MAX_LISTENER_NAME_BYTES: usize = 63;

/// Why `name` cannot be a name of at most `max` bytes, without repeating it
/// (it may be huge, or hold the very characters that are refused).
pub(super) fn name_problem(name: &str, max: usize) -> Option<String> {
    if name.len() > max {
        return Some(format!(
            "is {} bytes long; at most {max} are allowed (Kubernetes' own limit for this name)",
            name.len()
        ));
    }
    name.char_indices()
        .find(|(_, c)| c.is_control())
        .map(|(at, c)| {
            format!(
                "holds the control character U+{:04X} at byte {at}; names are printed in logs and the status table, where it could forge a line or hide text",
                u32::from(c)
            )
        })
}

/// Why `word` cannot be written bare into keepalived.conf or
/// conntrackd.conf (an interface name, keepalived's `router_id`), naming
/// the first character either reads specially, or `None`. keepalived and
/// conntrackd read `#` and `!` (keepalived) as the start of a comment, so
/// `interface = "br#1"` put the VIP on `br`; quotes and braces delimit,
/// `$` expands a keepalived definition, a backslash escapes, whitespace
/// splits words and a control character ends the line.
pub fn conf_word_problem(word: &str) -> Option<String> {
    let (at, c) = word.char_indices().find(|(_, c)| {
        c.is_whitespace()
            || c.is_control()
            || matches!(c, '#' | '!' | '"' | '\'' | '{' | '}' | '$' | '\\')
    })?;
    let why = match c {
        '#' | '!' => {
            "keepalived reads it as the start of a comment (conntrackd too, for '#'), cutting the name there"
        }
        '"' | '\'' => "it opens a quoted string in keepalived's file",
        '{' | '}' => "it opens or closes a block in keepalived's and conntrackd's files",
        '$' => "keepalived expands a definition there",
        '\\' => "it escapes the next character",
        _ => "it splits or ends the line",
    };
    let shown = if c.is_control() || c.is_whitespace() {
        format!("U+{:04X}", u32::from(c))
    } else {
        format!("{c:?}")
    };
    Some(format!(
        "holds {shown} at byte {at}, which the daemon would write bare into keepalived.conf or conntrackd.conf, where {why}; use letters, digits, '-', '_' and '.'"
    ))
}

/// Why `name` cannot be conntrackd's `Interface`, or `None`: its parser
/// takes a name of ASCII letters, digits, `.`, `-` and `_` that starts
/// with a letter, and refuses the file on anything else (`1eth` is a
/// syntax error; conntrackd 1.4.7, tried).
pub(super) fn conntrackd_interface_problem(name: &str) -> Option<String> {
    let starts = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic());
    let rest = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'));
    (!(starts && rest)).then(|| {
        format!(
            "{name:?} cannot be conntrackd's Interface: its parser takes only a name that starts with a letter and holds letters, digits, '.', '-' and '_' (anything else makes conntrackd refuse its file); sync over an interface so named"
        )
    })
}

impl Validator<'_> {
    /// Reports `value` at `key` if it cannot be written bare into
    /// keepalived.conf or conntrackd.conf ([`conf_word_problem`]); whether
    /// it can.
    pub(super) fn conf_word(&mut self, value: &Spanned<String>, key: &str) -> bool {
        match conf_word_problem(value.get_ref()) {
            Some(why) => {
                self.problem(
                    Some(value.span()),
                    key,
                    format!("{:?} {why}", value.get_ref()),
                );
                false
            }
            None => true,
        }
    }

    /// An interface name the daemon writes into keepalived.conf or
    /// conntrackd.conf: one the kernel takes ([`Validator::interface_name`])
    /// and free of what those files read specially ([`conf_word_problem`]).
    pub(super) fn rendered_interface(
        &mut self,
        value: &Spanned<String>,
        key: std::fmt::Arguments<'_>,
    ) -> Option<String> {
        let key = key.to_string();
        let name = self.interface_name(value, format_args!("{key}"))?;
        self.conf_word(value, &key).then_some(name)
    }

    /// Reports `value` at `key` if it is not a usable name; whether it is.
    pub(super) fn bounded_name(&mut self, value: &Spanned<String>, key: &str, max: usize) -> bool {
        match name_problem(value.get_ref(), max) {
            Some(message) => {
                self.problem(Some(value.span()), key, message);
                false
            }
            None => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_word_written_into_keepalived_or_conntrackd_s_file_holds_nothing_they_read_specially() {
        for fine in [
            "mgmt-br",
            "mgmt-br.100",
            "br_ext",
            "h-192.168.0.11",
            "ens3f0np0",
        ] {
            assert_eq!(conf_word_problem(fine), None, "{fine}");
            assert_eq!(conntrackd_interface_problem(fine), None, "{fine}");
        }
        for (bad, shown) in [
            ("br#1", "'#'"),
            ("br!1", "'!'"),
            ("br\"1", "'\"'"),
            ("br'1", "'\\''"),
            ("br{1", "'{'"),
            ("br}1", "'}'"),
            ("br$1", "'$'"),
            ("br\\1", "'\\\\'"),
            ("br 1", "U+0020"),
            ("br\t1", "U+0009"),
            ("br\u{7f}1", "U+007F"),
        ] {
            let p = conf_word_problem(bad).unwrap_or_else(|| panic!("{bad:?} passed"));
            assert!(p.contains(shown) && p.contains("at byte 2"), "{bad:?}: {p}");
        }
        assert!(conf_word_problem("a#b").unwrap().contains("comment"));
        for bad in ["1gbe-br", "br+1", "br@1", "br%1", "br:1"] {
            assert!(conntrackd_interface_problem(bad).is_some(), "{bad}");
        }
    }

    #[test]
    fn names_are_bounded_and_free_of_control_characters() {
        assert_eq!(name_problem("default/web", MAX_NAME_BYTES), None);
        assert_eq!(name_problem("ünïcödé", MAX_NAME_BYTES), None);
        let at_limit = format!("{}/{}", "n".repeat(63), "a".repeat(253));
        assert_eq!(name_problem(&at_limit, MAX_NAME_BYTES), None);
        let long = name_problem(&format!("{at_limit}x"), MAX_NAME_BYTES).unwrap();
        assert!(long.contains("318 bytes long"), "{long}");
        for (bad, code) in [
            ("a\nb", "U+000A"),
            ("a\u{1b}[8m", "U+001B"),
            ("a\u{7f}", "U+007F"),
            ("a\u{85}", "U+0085"),
        ] {
            let p = name_problem(bad, MAX_NAME_BYTES).unwrap();
            assert!(p.contains(code), "{p}");
            assert!(!p.contains(bad), "the message repeats the name: {p}");
        }
    }
}
