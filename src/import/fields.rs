//! Reading fields of a Kubernetes object with their path in every error
//! (`spec.listeners[1].port: expected an integer, found "80"`), so a skip
//! line tells the operator exactly which field of which object is wrong.
//!
//! Absent and `null` fields are `None` (Kubernetes omits empty ones); a field
//! of the wrong type is an error, never a silent default.

use std::net::IpAddr;

use serde_json::Value;

/// A value and the path that led to it.
#[derive(Clone)]
pub struct At<'a> {
    value: Option<&'a Value>,
    path: String,
}

/// A reason to skip an object (or part of it), in the operator's words.
pub type Reason = String;

impl<'a> At<'a> {
    /// The object itself, at the root.
    pub fn root(value: &'a Value) -> Self {
        Self {
            value: Some(value),
            path: String::new(),
        }
    }

    /// The field `key` of this mapping (`None` inside if absent).
    pub fn get(&self, key: &str) -> At<'a> {
        At {
            value: self.value.and_then(|v| v.get(key)).filter(|v| !v.is_null()),
            path: if self.path.is_empty() {
                key.to_string()
            } else {
                format!("{}.{key}", self.path)
            },
        }
    }

    /// The items of an optional list, each with its indexed path.
    pub fn each(&self) -> Result<Vec<At<'a>>, Reason> {
        Ok(self
            .items()?
            .iter()
            .enumerate()
            .map(|(i, v)| At {
                value: Some(v).filter(|v| !v.is_null()),
                path: format!("{}[{i}]", self.path),
            })
            .collect())
    }

    /// Whether the field is there (and not `null`).
    pub fn is_present(&self) -> bool {
        self.value.is_some()
    }

    /// The path, for messages.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// An optional string.
    pub fn str(&self) -> Result<Option<&'a str>, Reason> {
        match self.value {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(self.wrong("a string", other)),
        }
    }

    /// An optional integer.
    pub fn int(&self) -> Result<Option<i64>, Reason> {
        match self.value {
            None => Ok(None),
            Some(Value::Number(n)) if n.is_i64() => Ok(n.as_i64()),
            Some(other) => Err(self.wrong("an integer", other)),
        }
    }

    /// An optional port: 1..=65535, with 0 taken as absent (Go's zero value,
    /// which Harvester's types write for "not set").
    pub fn port(&self) -> Result<Option<u16>, Reason> {
        match self.int()? {
            None | Some(0) => Ok(None),
            Some(n) => u16::try_from(n)
                .map(Some)
                .map_err(|_| format!("{}: {n} is not a port (1-65535)", self.path)),
        }
    }

    /// An optional positive count or number of seconds, 0 taken as absent
    /// (Harvester's "zero or absent takes the default").
    pub fn positive(&self) -> Result<Option<u32>, Reason> {
        match self.int()? {
            None | Some(0) => Ok(None),
            Some(n) => u32::try_from(n)
                .map(Some)
                .map_err(|_| format!("{}: {n} must be a positive integer", self.path)),
        }
    }

    /// The items of an optional list (empty when absent).
    pub fn items(&self) -> Result<&'a [Value], Reason> {
        match self.value {
            None => Ok(&[]),
            Some(Value::Array(items)) => Ok(items),
            Some(other) => Err(self.wrong("a list", other)),
        }
    }

    /// An optional list of strings.
    pub fn strings(&self) -> Result<Vec<&'a str>, Reason> {
        self.items()?
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str().ok_or_else(|| {
                    format!("{}[{i}]: expected a string, found {}", self.path, show(v))
                })
            })
            .collect()
    }

    /// An entry of a string map (`metadata.annotations`, `metadata.labels`);
    /// `None` when the map or the key is absent.
    pub fn map_entry(&self, key: &str) -> Result<Option<&'a str>, Reason> {
        match self.value {
            None => Ok(None),
            Some(Value::Object(map)) => match map.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s)),
                Some(other) => Err(format!(
                    "{}[{key:?}]: expected a string, found {}",
                    self.path,
                    show(other)
                )),
            },
            Some(other) => Err(self.wrong("a mapping", other)),
        }
    }

    fn wrong(&self, expected: &str, found: &Value) -> Reason {
        format!("{}: expected {expected}, found {}", self.path, show(found))
    }
}

/// A value as the operator wrote it, shortened.
pub fn show(v: &Value) -> String {
    let text = v.to_string();
    if text.chars().count() > 60 {
        let cut: String = text.chars().take(57).collect();
        format!("{cut}...")
    } else {
        text
    }
}

/// An IP address as Kubernetes writes it; IPv4-mapped IPv6 becomes IPv4
/// (the config takes them as one node).
pub fn ip(text: &str, path: &str) -> Result<IpAddr, Reason> {
    text.trim()
        .parse::<IpAddr>()
        .map(|ip| ip.to_canonical())
        .map_err(|_| format!("{path}: {text:?} is not an IPv4 or IPv6 address"))
}
