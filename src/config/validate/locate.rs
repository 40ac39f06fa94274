//! Where in the file a problem is: key paths from serde's and the parser's
//! positions, and line numbers from byte offsets. Only a broken file pays
//! for these searches.

use std::ops::Range;

use toml::de::{DeTable, DeValue};

use crate::config::Problem;

/// Turns serde_ignored's path into plain key segments, dropping the wrapper
/// levels that `Spanned` and `Option` add.
pub(super) fn segments(path: &serde_ignored::Path<'_>) -> Vec<String> {
    use serde_ignored::Path;
    let mut out = match path {
        Path::Root => return Vec::new(),
        Path::Seq { parent, .. }
        | Path::Map { parent, .. }
        | Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => segments(parent),
    };
    match path {
        Path::Seq { index, .. } => out.push(index.to_string()),
        Path::Map { key, .. } if !key.starts_with("$__serde_spanned") => out.push(key.clone()),
        _ => {}
    }
    out
}

/// `["load_balancer", "0", "listener", "1", "prot"]` -> `load_balancer[0].listener[1].prot`.
pub(super) fn display_path(segments: &[String]) -> String {
    let mut out = String::new();
    for segment in segments {
        if segment.parse::<usize>().is_ok() {
            out.push_str(&format!("[{segment}]"));
        } else {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(segment);
        }
    }
    out
}

/// Finds where a key path sits in the parsed document (the key's own span).
pub(super) fn span_of(table: &DeTable<'_>, segments: &[String]) -> Option<Range<usize>> {
    let (first, rest) = segments.split_first()?;
    let (key, value) = table.iter().find(|(k, _)| k.get_ref().as_ref() == first)?;
    let mut value = value;
    let mut rest = rest;
    let mut span = key.span();
    loop {
        match (value.get_ref(), rest.split_first()) {
            (_, None) => return Some(span),
            (DeValue::Table(t), Some(_)) => return span_of(t, rest).or(Some(span)),
            (DeValue::Array(items), Some((index, tail))) => {
                let item = items.get(index.parse::<usize>().ok()?)?;
                span = item.span();
                value = item;
                rest = tail;
            }
            _ => return Some(span),
        }
    }
}

/// The key path of the value at byte `offset` (the innermost one), for
/// naming the key of a type error.
pub(super) fn path_at(table: &DeTable<'_>, offset: usize) -> Vec<String> {
    find_path(table, offset).unwrap_or_default()
}

/// Depth first: a `[table]`'s own span covers only its header, so every
/// table is searched, not only the one whose span holds `offset`.
pub(super) fn find_path(table: &DeTable<'_>, offset: usize) -> Option<Vec<String>> {
    for (key, value) in table.iter() {
        let here = value.span().contains(&offset) || key.span().contains(&offset);
        let deeper = match value.get_ref() {
            DeValue::Table(t) => find_path(t, offset),
            DeValue::Array(items) => items.iter().enumerate().find_map(|(i, item)| {
                let inner = match item.get_ref() {
                    DeValue::Table(t) => find_path(t, offset),
                    _ => None,
                };
                match inner {
                    Some(mut rest) => {
                        rest.insert(0, i.to_string());
                        Some(rest)
                    }
                    None if item.span().contains(&offset) => Some(vec![i.to_string()]),
                    None => None,
                }
            }),
            _ => None,
        };
        match deeper {
            Some(mut rest) => {
                rest.insert(0, key.get_ref().to_string());
                return Some(rest);
            }
            None if here => return Some(vec![key.get_ref().to_string()]),
            None => {}
        }
    }
    None
}

/// Byte offset -> 1-based line number.
pub(super) struct LineIndex {
    starts: Vec<usize>,
}

impl LineIndex {
    pub(super) fn new(text: &str) -> Self {
        let mut starts = vec![0];
        starts.extend(text.match_indices('\n').map(|(i, _)| i + 1));
        Self { starts }
    }

    pub(super) fn line(&self, offset: usize) -> usize {
        self.starts.partition_point(|&s| s <= offset)
    }

    pub(super) fn toml_error(&self, e: &toml::de::Error, key: String) -> Problem {
        Problem {
            line: e.span().map(|s| self.line(s.start)),
            key,
            message: plain_types(e.message().trim_end()),
        }
    }
}

/// serde's type names in an operator's words: `expected i64` becomes
/// `expected an integer`, `a sequence` a list.
pub(super) fn plain_types(message: &str) -> String {
    message
        .replace("expected i64", "expected an integer")
        .replace("expected a sequence", "expected a list ([...])")
        .replace("expected a boolean", "expected true or false")
}
