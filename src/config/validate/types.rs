//! Every type error of a file, not only the first (`port = 80.0` in one
//! load balancer must not hide a bad VIP in another, nor a second type error).
//!
//! serde stops at the first value of the wrong type. Only when the whole
//! document failed (a valid file never comes here) it is taken apart: the
//! top-level settings are one piece and each `[[load_balancer]]` table one
//! more, each deserialized on its own. A piece that fails has the value its
//! error points at removed and is tried again, until it deserializes; each
//! removal is one problem, with its key path and line. A value inside a list
//! takes the whole list with it (the list's indices must stay those of the
//! file), so the list's other items are checked once it is fixed. The usual
//! validation then runs over what did deserialize, and a key removed here is
//! not reported a second time as missing.

use std::collections::HashSet;
use std::ops::Range;

use toml::Spanned;
use toml::de::{DeArray, DeTable, DeValue};

use super::locate::{LineIndex, display_path, path_at, segments};
use crate::config::Problem;
use crate::config::file::FileConfig;

/// Type errors looked for in one piece, and in the whole file: each costs
/// one more deserialization of its piece, so these bound the work a hostile
/// 16 MiB file can cause; a file a person or a controller wrote has far fewer.
const MAX_PER_PIECE: usize = 16;
const MAX_PER_FILE: usize = 100;

/// The file layer of a document with type errors, and those errors.
pub(super) struct Typed {
    /// What deserialized: the settings and the load balancers up to the first
    /// one that could not be read at all (so the key paths stay the file's).
    pub(super) file: FileConfig,
    /// One problem per value of the wrong type.
    pub(super) problems: Vec<Problem>,
    /// Key paths of the values removed for them.
    pub(super) removed: HashSet<String>,
    /// Unknown keys, as `serde_ignored` paths (the file's indices).
    pub(super) unknown: Vec<Vec<String>>,
}

/// Deserializes `text` piece by piece; `first` is the whole document's
/// error, kept should the pieces (unexpectedly) all pass.
pub(super) fn each_piece(text: &str, lines: &LineIndex, first: Problem) -> Typed {
    let mut typed = Typed {
        file: FileConfig::default(),
        problems: Vec::new(),
        removed: HashSet::new(),
        unknown: Vec::new(),
    };
    // Two trees: one taken apart, one to name the keys of what is found.
    let (Ok(whole), Ok(original)) = (DeTable::parse(text), DeTable::parse(text)) else {
        typed.problems.push(first);
        return typed;
    };
    let mut reader = Reader {
        lines,
        original: original.get_ref(),
        typed: &mut typed,
        gave_up: false,
    };
    let span = whole.span();
    let mut root = whole.into_inner();
    let mut tables = None;
    if let Some((key, value)) = root.remove_entry("load_balancer") {
        let value_span = value.span();
        match value.into_inner() {
            DeValue::Array(items) => tables = Some((key, items)),
            // Anything else is the preamble's type error.
            other => {
                root.insert(key, Spanned::new(value_span, other));
            }
        }
    }
    let preamble = reader.piece(Spanned::new(span.clone(), root), None);
    let mut load_balancers = Vec::new();
    if let Some((key, items)) = tables {
        for (i, item) in items.into_iter().enumerate() {
            let mut one = DeArray::new();
            let item_span = item.span();
            one.push(item);
            let mut piece = DeTable::new();
            piece.insert(key.clone(), Spanned::new(item_span, DeValue::Array(one)));
            let lb = reader
                .piece(Spanned::new(span.clone(), piece), Some(i))
                .and_then(|f| <[_; 1]>::try_from(f.load_balancers).ok());
            match lb {
                Some([lb]) => load_balancers.push(lb),
                // Not a table at all: the ones after it would be validated
                // under the wrong index, so they wait for the fix.
                None => break,
            }
        }
    }
    typed.file = preamble.unwrap_or_default();
    typed.file.load_balancers = load_balancers;
    if typed.problems.is_empty() {
        typed.problems.push(first);
    }
    typed
}

struct Reader<'a, 't> {
    lines: &'a LineIndex,
    original: &'a DeTable<'t>,
    typed: &'a mut Typed,
    /// A bound was reached: nothing more is read.
    gave_up: bool,
}

impl Reader<'_, '_> {
    /// One piece, with the values of the wrong type removed one by one;
    /// `None` when it cannot be read at all. `index`: the load balancer
    /// the piece holds (as `load_balancer[0]` in it).
    fn piece(
        &mut self,
        mut piece: Spanned<DeTable<'_>>,
        index: Option<usize>,
    ) -> Option<FileConfig> {
        if self.gave_up {
            return None;
        }
        for attempt in 0..=MAX_PER_PIECE {
            let mut unknown = Vec::new();
            let deserializer = toml::de::Deserializer::from(piece.clone());
            let error = match serde_ignored::deserialize(deserializer, |path| {
                unknown.push(segments(&path))
            }) {
                Ok(file) => {
                    for mut path in unknown {
                        if let (Some(i), Some(at)) = (index, path.get_mut(1)) {
                            *at = i.to_string();
                        }
                        self.typed.unknown.push(path);
                    }
                    return Some(file);
                }
                Err(e) => e,
            };
            if self.typed.problems.len() >= MAX_PER_FILE || attempt == MAX_PER_PIECE {
                self.typed.problems.push(Problem {
                    line: None,
                    key: String::new(),
                    message: format!(
                        "more values of the wrong type may follow (at most {MAX_PER_PIECE} are looked for in one table, {MAX_PER_FILE} in the file): fix these and check again"
                    ),
                });
                self.gave_up = true;
                return None;
            }
            let Some(at) = error.span() else {
                self.typed
                    .problems
                    .push(self.lines.toml_error(&error, String::new()));
                return None;
            };
            let key = display_path(&path_at(self.original, at.start));
            self.typed.problems.push(self.lines.toml_error(&error, key));
            let removed = remove_at(piece.get_mut(), at.start)?;
            self.typed
                .removed
                .insert(display_path(&path_at(self.original, removed.start)));
        }
        None
    }
}

/// Removes the innermost key whose value (or key) holds byte `offset`,
/// searching every table as [`locate::find_path`] does; the removed key's span.
fn remove_at(table: &mut DeTable<'_>, offset: usize) -> Option<Range<usize>> {
    let mut hit = None;
    for (key, value) in table.iter_mut() {
        let here = value.span().contains(&offset) || key.span().contains(&offset);
        let deeper = match value.get_mut() {
            DeValue::Table(t) => remove_at(t, offset),
            DeValue::Array(items) => items.iter_mut().find_map(|item| match item.get_mut() {
                DeValue::Table(t) => remove_at(t, offset),
                _ => None,
            }),
            _ => None,
        };
        if deeper.is_some() {
            return deeper;
        }
        if here {
            hit = Some(key.clone());
            break;
        }
    }
    let key = hit?;
    table.remove(key.get_ref().as_ref());
    Some(key.span())
}
