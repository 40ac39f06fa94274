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

impl Validator<'_> {
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
