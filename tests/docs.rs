//! The reference stays true as it moves: every key the reference config
//! sets is documented in `docs/configuration.md`, and every relative link of
//! the README and `docs/` reaches a file (and a heading) that exists.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The dotted key paths a TOML value sets (`load_balancer.listener.port`;
/// arrays of tables by their key).
fn key_paths(value: &toml::Value, prefix: &str, out: &mut BTreeSet<String>) {
    let path = |k: &str| {
        if prefix.is_empty() {
            k.to_string()
        } else {
            format!("{prefix}.{k}")
        }
    };
    match value {
        toml::Value::Table(t) => {
            for (k, v) in t {
                key_paths(v, &path(k), out);
            }
        }
        toml::Value::Array(items)
            if items.iter().all(toml::Value::is_table) && !items.is_empty() =>
        {
            for item in items {
                key_paths(item, prefix, out);
            }
        }
        _ => {
            out.insert(prefix.to_string());
        }
    }
}

#[test]
fn every_key_of_the_reference_config_is_in_the_configuration_doc() {
    let config: toml::Table = read(&repo().join("config/harvester-lb.toml"))
        .parse()
        .expect("the reference config is TOML");
    let mut keys = BTreeSet::new();
    key_paths(&toml::Value::Table(config), "", &mut keys);
    assert!(keys.len() >= 30, "only {} keys read: {keys:?}", keys.len());
    let doc = read(&repo().join("docs/configuration.md"));
    let missing: Vec<&String> = keys
        .iter()
        .filter(|k| !doc.contains(&format!("`{k}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "keys of config/harvester-lb.toml not in docs/configuration.md: {missing:?}"
    );
}

/// GitHub's anchor of a heading: lower case, spaces to `-`, punctuation
/// other than `-` and `_` dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown file's headings (outside code blocks).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut fenced = false;
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.insert(anchor(line.trim_start_matches('#')));
        }
    }
    out
}

/// The targets of `](target)` links in `text`.
fn links(text: &str) -> Vec<String> {
    text.split("](")
        .skip(1)
        .filter_map(|rest| rest.split_once(')').map(|(t, _)| t.to_string()))
        .filter(|t| !t.contains(' '))
        .collect()
}

#[test]
fn every_link_between_the_pages_reaches_a_file_and_a_heading() {
    let mut pages = vec![repo().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(repo().join("docs"))
        .expect("docs/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    assert!(docs.len() >= 8, "docs/ holds {} pages", docs.len());
    pages.extend(docs);
    let mut checked = 0;
    let mut broken = Vec::new();
    for page in &pages {
        let text = read(page);
        for link in links(&text) {
            if link.starts_with("http") || link.starts_with("mailto:") {
                continue;
            }
            let (file, fragment) = link.split_once('#').unwrap_or((&link, ""));
            let target = if file.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(file)
            };
            checked += 1;
            if !target.exists() {
                broken.push(format!("{}: {link} (no such file)", page.display()));
            } else if !fragment.is_empty() && !anchors(&read(&target)).contains(fragment) {
                broken.push(format!("{}: {link} (no such heading)", page.display()));
            }
        }
    }
    assert!(checked >= 20, "only {checked} links checked");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}
