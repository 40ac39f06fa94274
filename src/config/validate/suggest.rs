//! "Did you mean": the nearest allowed key or value to one that is not, and
//! the spellings Kubernetes uses for the same values (`"TCP"`, `"ClientIP"`).
//!
//! The keys a table allows are read from its file type's serde derive (the
//! field list `deserialize_struct` is called with), so a key added to
//! [`super::super::file`] is suggested with no list to keep beside it. Only
//! a broken file pays for any of this.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Visitor};

use crate::config::file::{
    FileAdmin, FileConfig, FileConntrackd, FileDaemon, FileDhcp, FileDhcpSettings, FileHealthCheck,
    FileKeepalived, FileListener, FileLoadBalancer, FileLog, FileMetrics, FileNetwork, FileProxy,
    FileVip,
};

/// `value` written with another case or `_`/`-` (Kubernetes' `"TCP"`,
/// `"ClientIP"`, `"None"` for `"tcp"`, `"client_ip"`, `"none"`): the allowed
/// spelling it means, if exactly one is meant.
pub(super) fn same_spelling<'a>(value: &str, allowed: &[&'a str]) -> Option<&'a str> {
    let wanted = fold(value);
    let mut found = allowed.iter().filter(|a| fold(a) == wanted);
    let first = found.next()?;
    found.next().is_none().then_some(*first)
}

/// The allowed words nearest to `word`, when any is near enough to be a
/// typo of it: the same letters in another case or with `_` (`healthcheck`,
/// `backendport`: that one alone), a letter or two off (`algoritm`), or
/// the start of a longer one (`period` for `period_seconds`). Both when a
/// typo and a start name different words (`prot`: `port` or `protocol`).
pub(super) fn nearest<'a>(word: &str, allowed: &[&'a str]) -> Vec<&'a str> {
    if let Some(same) = same_spelling(word, allowed) {
        return vec![same];
    }
    let folded = fold(word);
    if folded.is_empty() {
        return Vec::new();
    }
    // A typo: at most a third of the letters off (one in a short word),
    // and nearer than any other word (`v3` is as near `v1` as `v2`).
    let bound = (folded.chars().count() / 3).max(1);
    let mut near: Vec<(usize, &str)> = allowed
        .iter()
        .map(|a| (strsim::damerau_levenshtein(&folded, &fold(a)), *a))
        .filter(|(d, _)| *d <= bound)
        .collect();
    near.sort_by_key(|(d, _)| *d);
    let typo = match near.as_slice() {
        [(_, one)] => Some(*one),
        [(d, one), (next, _), ..] if d < next => Some(*one),
        _ => None,
    };
    // The start (or end) of a longer key, of at least four letters, when
    // only one key starts (or ends) so.
    let part = if folded.chars().count() < 4 {
        None
    } else {
        let mut part = allowed.iter().filter(|a| {
            let a = fold(a);
            a.starts_with(&folded) || a.ends_with(&folded) || folded.starts_with(&a)
        });
        match (part.next(), part.next()) {
            (Some(one), None) => Some(*one),
            _ => None,
        }
    };
    let mut out: Vec<&str> = typo.into_iter().collect();
    if let Some(part) = part
        && !out.contains(&part)
    {
        out.push(part);
    }
    out
}

/// "; did you mean `x`?" (or "`x` or `y`") when a key is near, else "".
pub(super) fn did_you_mean_key(word: &str, allowed: &[&str]) -> String {
    let near: Vec<String> = nearest(word, allowed)
        .iter()
        .map(|k| format!("`{k}`"))
        .collect();
    if near.is_empty() {
        String::new()
    } else {
        format!("; did you mean {}?", near.join(" or "))
    }
}

/// Lower case, without `_` and `-`.
fn fold(word: &str) -> String {
    word.chars()
        .filter(|c| *c != '_' && *c != '-')
        .flat_map(char::to_lowercase)
        .collect()
}

/// The keys the table at `parent` (a key path's segments, without the
/// unknown key itself) allows; empty for a path that is no table.
pub(super) fn keys_of(parent: &[String]) -> &'static [&'static str] {
    let names: Vec<&str> = parent
        .iter()
        .map(String::as_str)
        .filter(|s| s.parse::<usize>().is_err())
        .collect();
    match names.as_slice() {
        [] => fields::<FileConfig>(),
        ["admin"] => fields::<FileAdmin>(),
        ["proxy"] => fields::<FileProxy>(),
        ["metrics"] => fields::<FileMetrics>(),
        ["vip"] => fields::<FileVip>(),
        ["dhcp"] => fields::<FileDhcpSettings>(),
        ["log"] => fields::<FileLog>(),
        ["daemon"] => fields::<FileDaemon>(),
        ["network"] => fields::<FileNetwork>(),
        ["keepalived"] => fields::<FileKeepalived>(),
        ["conntrackd"] => fields::<FileConntrackd>(),
        ["load_balancer"] => fields::<FileLoadBalancer>(),
        ["load_balancer", "listener"] => fields::<FileListener>(),
        ["load_balancer", "health_check"] => fields::<FileHealthCheck>(),
        ["load_balancer", "dhcp"] => fields::<FileDhcp>(),
        _ => &[],
    }
}

/// The field names serde's derive gives `T` (renames applied): the derive
/// hands them to `deserialize_struct`, which this deserializer keeps and
/// then stops.
fn fields<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    let mut found: &'static [&'static str] = &[];
    let _stopped = T::deserialize(FieldNames(&mut found));
    found
}

struct FieldNames<'a>(&'a mut &'static [&'static str]);

/// The error that stops [`FieldNames`] once it has the names.
#[derive(Debug)]
struct Stop;

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("field names read")
    }
}

impl std::error::Error for Stop {}

impl de::Error for Stop {
    fn custom<T: fmt::Display>(_: T) -> Self {
        Stop
    }
}

impl<'de> de::Deserializer<'de> for FieldNames<'_> {
    type Error = Stop;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
        Err(Stop)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Stop> {
        *self.0 = fields;
        Err(Stop)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf option unit unit_struct newtype_struct seq tuple
        tuple_struct map enum identifier ignored_any
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_keys_of_each_table_come_from_its_file_type() {
        assert!(keys_of(&[]).contains(&"load_balancer"));
        let lb = keys_of(&["load_balancer".into(), "0".into()]);
        assert!(lb.contains(&"algorithm") && lb.contains(&"listener"));
        let listener = keys_of(&[
            "load_balancer".into(),
            "0".into(),
            "listener".into(),
            "1".into(),
        ]);
        assert!(listener.contains(&"backend_port"));
        assert!(keys_of(&["nothing".into()]).is_empty());
    }

    #[test]
    fn typos_and_other_spellings_find_the_key_or_value_meant() {
        let lb = keys_of(&["load_balancer".into(), "0".into()]);
        assert_eq!(nearest("algoritm", lb), ["algorithm"]);
        assert_eq!(nearest("healthcheck", lb), ["health_check"]);
        assert_eq!(nearest("sessionAffinity", lb), ["session_affinity"]);
        let listener = keys_of(&["load_balancer".into(), "listener".into()]);
        assert_eq!(nearest("backendport", listener), ["backend_port"]);
        assert_eq!(nearest("prot", listener), ["port", "protocol"]);
        assert!(nearest("targetPort", listener).is_empty());
        let check = keys_of(&["load_balancer".into(), "health_check".into()]);
        assert_eq!(nearest("period", check), ["period_seconds"]);
        assert!(nearest("colour", lb).is_empty());
        assert_eq!(same_spelling("TCP", &["tcp", "udp"]), Some("tcp"));
        assert_eq!(
            same_spelling("ClientIP", &["none", "client_ip"]),
            Some("client_ip")
        );
        assert_eq!(same_spelling("tpc", &["tcp", "udp"]), None);
        assert_eq!(nearest("tpc", &["tcp", "udp"]), ["tcp"]);
        assert!(nearest("v3", &["v1", "v2"]).is_empty());
        assert_eq!(
            nearest("least_conn", &["round_robin", "least_connections"]),
            ["least_connections"]
        );
    }
}
