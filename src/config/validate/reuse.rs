//! Reading a file one `[[load_balancer]]` table at a time, and taking the
//! tables whose text has not changed since the last read as they were.
//!
//! A controller rewrites the whole file for every change of one Service. At
//! 10,000 load balancers a full parse and validation is 137-344 ms and ~80
//! MB of transient tree, paid on every reload; here a reload parses only
//! the tables that changed, and the rest cost a hash lookup of their text,
//! a copy of their spec and the checks across tables: 23-53 ms with every
//! table reused, 18-28 ms in 4 runs of the code before the checks across
//! tables ran here (`ci` build, a machine at load 2-9, 7 runs;
//! `tests/it/config_reuse.rs`'s FIGURE).
//!
//! The file is cut before each line that is exactly a `[[load_balancer]]`
//! header (indentation and a trailing comment allowed). Everything before
//! the first one (`[admin]`, `[vip]`, `[conntrackd]`...) is read as a
//! document of its own ([`Validator::sections`]), and each piece as a
//! document holding one load balancer ([`Validator::load_balancer`]). Then
//! [`Validator::across`], the same function the full read ends with, runs
//! every check that spans tables over the assembled file, each table
//! standing in as its built spec. The cut is only trusted when it cannot
//! have changed the verdict: each piece must parse on its own and hold
//! exactly what it should, with no unknown key and no problem, and the
//! checks across tables must find nothing (they run on stand-ins without
//! positions, so the full read tells what they find, with its lines). A
//! line that looks like a header inside a multi-line string or array leaves
//! the piece before it unterminated, so it fails to parse. Anything else,
//! including every broken file and every file with `[[network]]` or
//! `[keepalived]` (checked with keys of the tables the stand-ins do not
//! carry), takes the full read of [`super::parse`], whose verdict and
//! messages are the ones the operator sees: `check`'s, the start's and a
//! reload's are one (`tests/it/one_verdict.rs`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use toml::Spanned;
use toml::de::DeTable;

use super::locate::LineIndex;
use super::{Validator, parse};
use crate::config::file::{FileConfig, FileLoadBalancer};
use crate::config::{LoadBalancerSpec, Loaded, Problem};

/// What the last read file's load balancers were, by the exact text of
/// their table.
#[derive(Debug, Default)]
pub(crate) struct Known {
    by_text: HashMap<Box<str>, Arc<LoadBalancerSpec>>,
}

impl Known {
    /// How many load balancers are remembered.
    pub(crate) fn len(&self) -> usize {
        self.by_text.len()
    }
}

/// Like [`super::parse`], reusing `known` and replacing it with this file's
/// tables when the file is read piecewise.
pub(crate) fn parse_reusing(text: &str, known: &mut Known) -> Result<Loaded, Vec<Problem>> {
    if let Some(loaded) = piecewise(text, known) {
        return Ok(loaded);
    }
    let loaded = parse(text)?;
    // Valid, but not cut as expected (e.g. `[proxy]` after the load
    // balancers): nothing of the last file can be matched any more.
    known.by_text = HashMap::new();
    Ok(loaded)
}

/// The piecewise read; `None` whenever the full read must decide.
fn piecewise(text: &str, known: &mut Known) -> Option<Loaded> {
    let (preamble, pieces) = cut(text);
    if pieces.is_empty() {
        return None; // Nothing to reuse; the full read is as fast.
    }
    let preamble_lines = LineIndex::new(preamble);
    let mut v = Validator {
        lines: &preamble_lines,
        problems: Vec::new(),
        warnings: Vec::new(),
        notes: Vec::new(),
        removed: HashSet::new(),
    };
    let mut preamble_file = document(preamble, false)?;
    let sections = v.sections(&preamble_file);
    if !v.problems.is_empty() {
        return None;
    }
    // Load balancers on a `[[network]]` are checked against the networks
    // and `[keepalived]` with their tables' own keys (`network`, `dhcp`),
    // which the stand-ins below do not carry: the full read does that.
    if !sections.config.networks.is_empty() || sections.config.keepalived.is_some() {
        return None;
    }
    let mut warnings = v.warnings;
    let mut next = HashMap::with_capacity(pieces.len());
    let mut specs = Vec::with_capacity(pieces.len());
    let mut reused = 0;
    for (i, piece) in pieces.iter().enumerate() {
        let spec = match known.by_text.get(piece.text) {
            Some(spec) => {
                reused += 1;
                Arc::clone(spec)
            }
            None => {
                let file = document(piece.text, true)?;
                let [lb] = file.load_balancers.as_slice() else {
                    return None;
                };
                if lb.get_ref().network.is_some() {
                    return None; // An unknown network: the full read says so.
                }
                let lines = LineIndex::new(piece.text);
                let mut v = Validator {
                    lines: &lines,
                    problems: Vec::new(),
                    warnings: Vec::new(),
                    notes: Vec::new(),
                    removed: HashSet::new(),
                };
                let spec = v.load_balancer(&format!("load_balancer[{i}]"), lb);
                // Notes (Kubernetes' spellings) are the full read's to tell.
                if !v.problems.is_empty() || !v.notes.is_empty() {
                    return None;
                }
                let spec = Arc::new(spec?);
                if !v.warnings.is_empty() {
                    // Warnings are told on every read, so a table that has
                    // some is read again each time rather than remembered.
                    for mut w in v.warnings {
                        w.line = w.line.map(|l| l + piece.first_line - 1);
                        warnings.push(w);
                    }
                    specs.push(spec);
                    continue;
                }
                spec
            }
        };
        next.insert(Box::from(piece.text), Arc::clone(&spec));
        specs.push(spec);
    }
    // The checks across tables, the very ones the full read runs, over
    // the assembled file: each table stands in as its name (what
    // `cross::conflicts` knows it by) and its built spec. The stand-ins
    // have no positions, so whatever they find (a problem, or a warning
    // told of a load balancer or of a section) is left to the full read,
    // which tells it with its line.
    preamble_file.load_balancers = specs
        .iter()
        .map(|s| {
            Spanned::new(
                0..0,
                FileLoadBalancer {
                    name: Some(Spanned::new(0..0, s.name.clone())),
                    ..FileLoadBalancer::default()
                },
            )
        })
        .collect();
    let mut built: Vec<Option<LoadBalancerSpec>> =
        specs.iter().map(|s| Some((**s).clone())).collect();
    let mut v = Validator {
        lines: &preamble_lines,
        problems: Vec::new(),
        warnings: Vec::new(),
        notes: Vec::new(),
        removed: HashSet::new(),
    };
    let conntrackd = v.across(&preamble_file, &sections, &mut built);
    if !v.problems.is_empty() || !v.warnings.is_empty() {
        return None;
    }
    let mut config = sections.config;
    config.conntrackd = conntrackd;
    config.load_balancers = specs;
    known.by_text = next;
    Some(Loaded {
        config,
        warnings,
        notes: Vec::new(),
        reused,
    })
}

/// One `[[load_balancer]]` table's text, from its header line to the next.
struct Piece<'a> {
    text: &'a str,
    /// Its header's line in the whole file, 1-based.
    first_line: usize,
}

/// Cuts `text` before every `[[load_balancer]]` header line.
fn cut(text: &str) -> (&str, Vec<Piece<'_>>) {
    let mut starts = Vec::new();
    let mut offset = 0;
    for (n, line) in text.split_inclusive('\n').enumerate() {
        if is_header(line) {
            starts.push((offset, n + 1));
        }
        offset += line.len();
    }
    let Some(&(first, _)) = starts.first() else {
        return (text, Vec::new());
    };
    let ends = starts.iter().skip(1).map(|&(o, _)| o).chain([text.len()]);
    let pieces = starts
        .iter()
        .zip(ends)
        .map(|(&(start, first_line), end)| Piece {
            text: &text[start..end],
            first_line,
        })
        .collect();
    (&text[..first], pieces)
}

/// `[[load_balancer]]`, indented or not, with nothing after it but a comment.
fn is_header(line: &str) -> bool {
    line.trim_start()
        .strip_prefix("[[load_balancer]]")
        .is_some_and(|rest| {
            let rest = rest.trim();
            rest.is_empty() || rest.starts_with('#')
        })
}

/// One piece as the file layer: `None` on a syntax or type error, an
/// unknown key, or a top-level key the piece should not have (a load
/// balancer in the preamble; anything but one in a table's piece).
fn document(text: &str, load_balancer: bool) -> Option<FileConfig> {
    let root = DeTable::parse(text).ok()?;
    let only_load_balancers = root
        .get_ref()
        .keys()
        .all(|k| k.get_ref() == "load_balancer");
    let has_load_balancers = root
        .get_ref()
        .keys()
        .any(|k| k.get_ref() == "load_balancer");
    let expected = if load_balancer {
        has_load_balancers && only_load_balancers
    } else {
        !has_load_balancers
    };
    if !expected {
        return None;
    }
    let mut unknown = false;
    let file: FileConfig =
        serde_ignored::deserialize(toml::de::Deserializer::from(root), |_| unknown = true).ok()?;
    (!unknown).then_some(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_whole_lines() {
        assert!(is_header("[[load_balancer]]\n"));
        assert!(is_header("  [[load_balancer]]  # svc a\n"));
        assert!(!is_header("[[load_balancer.listener]]\n"));
        assert!(!is_header("[[load_balancer]] x = 1\n"));
        assert!(!is_header("# [[load_balancer]]\n"));
    }

    #[test]
    fn a_file_is_cut_before_each_header() {
        let text = "[proxy]\nbacklog = 1\n[[load_balancer]]\nname = \"a\"\n\n[[load_balancer]]\nname = \"b\"";
        let (preamble, pieces) = cut(text);
        assert_eq!(preamble, "[proxy]\nbacklog = 1\n");
        let got: Vec<(&str, usize)> = pieces.iter().map(|p| (p.text, p.first_line)).collect();
        assert_eq!(
            got,
            [
                ("[[load_balancer]]\nname = \"a\"\n\n", 3),
                ("[[load_balancer]]\nname = \"b\"", 6)
            ]
        );
    }
}
