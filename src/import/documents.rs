//! Kubernetes objects out of `kubectl get … -o json|yaml` text: one object,
//! a `List` (also a typed list such as `LoadBalancerList`, whose items may
//! lack `apiVersion` and `kind`), several YAML documents, or JSON values one
//! after another. Every object remembers where it came from, so a skip line
//! or an error can name the file, the document and the item.
//!
//! JSON is read with `serde_json` (its errors carry line and column); YAML
//! with `serde_yaml_ng`, into the same `serde_json::Value`, so the mappers
//! see one shape whatever the format.

use serde::Deserialize;
use serde_json::Value;

/// The largest input accepted from one source: a cluster with thousands of
/// load balancers prints a few MiB; anything near this is a mistake.
pub const MAX_INPUT_BYTES: usize = 64 * 1024 * 1024;

/// One input: a file's text, or standard input's.
#[derive(Debug, Clone)]
pub struct Source {
    /// How it is named in messages: the path, or `standard input`.
    pub name: String,
    /// Its whole text.
    pub text: String,
}

/// One Kubernetes object and where it was found.
#[derive(Debug, Clone)]
pub struct Object {
    /// The object as parsed.
    pub value: Value,
    /// `FILE, document N[, item M]`: where it was found (1-based).
    pub place: String,
}

impl Object {
    /// `apiVersion` (empty when absent or not a string).
    pub fn api_version(&self) -> &str {
        self.value["apiVersion"].as_str().unwrap_or("")
    }

    /// `kind` (empty when absent or not a string).
    pub fn kind(&self) -> &str {
        self.value["kind"].as_str().unwrap_or("")
    }

    /// `<namespace>/<name>`, or `<name>` for a cluster-scoped object, or
    /// `(no name)`.
    pub fn name(&self) -> String {
        let meta = &self.value["metadata"];
        match (meta["namespace"].as_str(), meta["name"].as_str()) {
            (Some(ns), Some(name)) if !ns.is_empty() => {
                format!("{}/{}", shown(ns), shown(name))
            }
            (_, Some(name)) => shown(name),
            _ => "(no name)".to_string(),
        }
    }

    /// How skip lines and errors name it: `v1beta1 LoadBalancer default/web
    /// (lbs.yaml, document 2)`.
    pub fn describe(&self) -> String {
        let version = shown(self.api_version());
        let kind = if self.kind().is_empty() {
            "(no kind)".to_string()
        } else {
            shown(self.kind())
        };
        if version.is_empty() {
            format!("{kind} {} ({})", self.name(), self.place)
        } else {
            format!("{version} {kind} {} ({})", self.name(), self.place)
        }
    }
}

/// The longest name shown whole in a message: Kubernetes' own limit for
/// an object name. A longer one (which no API server accepts) is cut, so
/// one object cannot make every skip line 250 KB.
const MAX_SHOWN_NAME: usize = 253;

/// A name from an object as messages show it: control characters escaped
/// (a `\n` would forge a line of the log), cut past [`MAX_SHOWN_NAME`].
fn shown(name: &str) -> String {
    match name.char_indices().nth(MAX_SHOWN_NAME) {
        Some((cut, _)) => format!(
            "{}... ({} bytes)",
            crate::text::escape(&name[..cut]),
            name.len()
        ),
        None => crate::text::escape(name).into_owned(),
    }
}

/// Input that is neither JSON nor YAML, or not Kubernetes objects.
#[derive(Debug, thiserror::Error)]
pub enum DocumentError {
    /// The JSON text is malformed.
    #[error("{source_name}: not valid JSON: {message}")]
    Json {
        /// The source.
        source_name: String,
        /// serde_json's message, with line and column.
        message: String,
    },
    /// The YAML text is malformed.
    #[error("{source_name}: not valid YAML (document {document}): {message}")]
    Yaml {
        /// The source.
        source_name: String,
        /// 1-based document number.
        document: usize,
        /// The parser's message, with line and column.
        message: String,
    },
    /// A document is a scalar or a sequence of scalars, not objects.
    #[error(
        "{place}: expected a Kubernetes object (a mapping with apiVersion and kind), found {found}"
    )]
    NotAnObject {
        /// Where.
        place: String,
        /// What was there instead.
        found: &'static str,
    },
}

/// Every object in `source`, in the order written.
pub fn objects(source: &Source) -> Result<Vec<Object>, DocumentError> {
    let trimmed = source.text.trim_start_matches('\u{feff}').trim_start();
    let documents = if trimmed.starts_with('{') || trimmed.starts_with('[') {
        json_documents(source, trimmed)?
    } else {
        yaml_documents(source)?
    };
    let mut out = Vec::new();
    for (i, doc) in documents.into_iter().enumerate() {
        let place = format!("{}, document {}", source.name, i + 1);
        flatten(doc, place, None, &mut out)?;
    }
    Ok(out)
}

fn json_documents(source: &Source, text: &str) -> Result<Vec<Value>, DocumentError> {
    serde_json::Deserializer::from_str(text)
        .into_iter::<Value>()
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| DocumentError::Json {
            source_name: source.name.clone(),
            message: e.to_string(),
        })
}

/// Deeper flow nesting (`[[[…`) than any Kubernetes object has. libyaml
/// parses the whole nest before serde's recursion limit can stop it, in
/// time that grows with the square of the depth (100,000 levels: over a
/// minute), so a deeper one is refused before it is parsed.
const MAX_FLOW_DEPTH: usize = 512;

/// The deepest `[`/`{` nesting outside quotes and comments, and where it
/// passed [`MAX_FLOW_DEPTH`] (1-based line), if it did.
fn too_deep(text: &str) -> Option<usize> {
    let (mut depth, mut line) = (0usize, 1usize);
    let mut quote: Option<char> = None;
    let mut comment = false;
    let mut previous = ' ';
    for c in text.chars() {
        match (quote, c) {
            (_, '\n') => {
                line += 1;
                comment = false;
            }
            _ if comment => {}
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '"' | '\'') => quote = Some(c),
            (None, '#') if previous.is_whitespace() => comment = true,
            (None, '[' | '{') => {
                depth += 1;
                if depth > MAX_FLOW_DEPTH {
                    return Some(line);
                }
            }
            (None, ']' | '}') => depth = depth.saturating_sub(1),
            _ => {}
        }
        previous = c;
    }
    None
}

fn yaml_documents(source: &Source) -> Result<Vec<Value>, DocumentError> {
    if let Some(line) = too_deep(&source.text) {
        return Err(DocumentError::Yaml {
            source_name: source.name.clone(),
            document: 1,
            message: format!(
                "nested deeper than {MAX_FLOW_DEPTH} levels at line {line}; no Kubernetes object is"
            ),
        });
    }
    let mut docs = Vec::new();
    for (i, doc) in serde_yaml_ng::Deserializer::from_str(&source.text).enumerate() {
        let value = Value::deserialize(doc).map_err(|e| DocumentError::Yaml {
            source_name: source.name.clone(),
            document: i + 1,
            message: e.to_string(),
        })?;
        // An empty document (a trailing `---`) holds nothing.
        if !value.is_null() {
            docs.push(value);
        }
    }
    Ok(docs)
}

/// The type of an item of a typed list (`LoadBalancerList` → `LoadBalancer`),
/// for items that do not carry their own.
struct ItemType {
    api_version: Value,
    kind: Option<String>,
}

fn flatten(
    value: Value,
    place: String,
    item_type: Option<&ItemType>,
    out: &mut Vec<Object>,
) -> Result<(), DocumentError> {
    let mut value = match value {
        Value::Object(map) => map,
        Value::Array(items) => {
            // A bare JSON array of objects.
            for (i, item) in items.into_iter().enumerate() {
                flatten(item, format!("{place}, item {}", i + 1), item_type, out)?;
            }
            return Ok(());
        }
        other => {
            return Err(DocumentError::NotAnObject {
                place,
                found: kind_of(&other),
            });
        }
    };
    if let Some(t) = item_type {
        if !value.contains_key("apiVersion") {
            value.insert("apiVersion".into(), t.api_version.clone());
        }
        if let (false, Some(kind)) = (value.contains_key("kind"), &t.kind) {
            value.insert("kind".into(), Value::String(kind.clone()));
        }
    }
    let kind = value.get("kind").and_then(Value::as_str).unwrap_or("");
    if let (Some(base), Some(Value::Array(_))) = (kind.strip_suffix("List"), value.get("items")) {
        let inner = ItemType {
            api_version: value.get("apiVersion").cloned().unwrap_or(Value::Null),
            kind: (!base.is_empty()).then(|| base.to_string()),
        };
        let Some(Value::Array(items)) = value.remove("items") else {
            unreachable!("checked above");
        };
        for (i, item) in items.into_iter().enumerate() {
            flatten(item, format!("{place}, item {}", i + 1), Some(&inner), out)?;
        }
        return Ok(());
    }
    out.push(Object {
        value: Value::Object(value),
        place,
    });
    Ok(())
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn src(text: &str) -> Source {
        Source {
            name: "t".into(),
            text: text.into(),
        }
    }

    #[test]
    fn a_typed_list_gives_its_items_their_type() {
        let objs = objects(&src(
            r#"{"apiVersion":"loadbalancer.harvesterhci.io/v1beta1","kind":"LoadBalancerList","items":[{"metadata":{"name":"a","namespace":"n"}}]}"#,
        ))
        .unwrap();
        assert_eq!(objs.len(), 1);
        assert_eq!(objs[0].kind(), "LoadBalancer");
        assert_eq!(
            objs[0].api_version(),
            "loadbalancer.harvesterhci.io/v1beta1"
        );
        assert_eq!(objs[0].place, "t, document 1, item 1");
    }

    #[test]
    fn yaml_documents_and_empty_ones() {
        let objs = objects(&src(
            "---\napiVersion: v1\nkind: Node\nmetadata: {name: a}\n---\n---\napiVersion: v1\nkind: Node\nmetadata: {name: b}\n",
        ))
        .unwrap();
        assert_eq!(objs.len(), 2);
        assert_eq!(objs[1].name(), "b");
    }

    #[test]
    fn flow_nesting_is_bounded_outside_quotes_and_comments() {
        let deep = format!("a: {}", "[".repeat(MAX_FLOW_DEPTH + 1));
        assert_eq!(too_deep(&deep), Some(1));
        let quoted = format!("a: \"{}\" # {}\nb: 1", "[".repeat(2000), "{".repeat(2000));
        assert_eq!(too_deep(&quoted), None);
    }

    #[test]
    fn scalars_and_bad_syntax_are_named_errors() {
        let e = objects(&src("just words")).unwrap_err().to_string();
        assert!(e.contains("expected a Kubernetes object"), "{e}");
        let e = objects(&src("{\"a\": ")).unwrap_err().to_string();
        assert!(e.starts_with("t: not valid JSON"), "{e}");
        let e = objects(&src("a: [1, 2\nb: c")).unwrap_err().to_string();
        assert!(e.starts_with("t: not valid YAML (document 1)"), "{e}");
    }
}
