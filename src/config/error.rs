//! Errors of reading and validating the config, written for the operator:
//! each names the file, and each problem its line, key path and what is allowed.

use std::fmt;

/// One thing wrong (or, as a warning, suspicious) in a config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// 1-based line in the file, when the problem has a place.
    pub line: Option<usize>,
    /// Key path, e.g. `load_balancer[0].listener[1].port`.
    pub key: String,
    /// What is wrong and what is allowed.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(line) = self.line {
            write!(f, "line {line}: ")?;
        }
        if self.key.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.key, self.message)
        }
    }
}

/// Why a config file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be opened or read (missing, no permission…).
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The path names something other than a regular file (a directory, a
    /// FIFO, a device): refused without waiting on it or reading it.
    #[error("config path {path} is {kind}, not a regular file; give the path of the TOML file")]
    NotRegular {
        /// The path.
        path: String,
        /// What it is.
        kind: super::FileKind,
    },
    /// The file is larger than [`super::MAX_FILE_BYTES`].
    #[error(
        "config file {path} is {size} bytes; the limit is {} bytes",
        super::MAX_FILE_BYTES
    )]
    TooLarge {
        /// The file.
        path: String,
        /// Its size.
        size: u64,
    },
    /// The file is not UTF-8, which TOML requires.
    #[error("config file {path} is not valid UTF-8 (first bad byte at offset {offset})")]
    NotUtf8 {
        /// The file.
        path: String,
        /// Offset of the first invalid byte.
        offset: usize,
    },
    /// The file is TOML with problems; all of them are listed.
    #[error("config file {path} is invalid ({} problem{}):\n{}", problems.len(), if problems.len() == 1 { "" } else { "s" }, ProblemList(problems))]
    Invalid {
        /// The file.
        path: String,
        /// Every problem found.
        problems: Vec<Problem>,
    },
}

/// Formats problems one per line, indented under the headline.
struct ProblemList<'a>(&'a [Problem]);

impl fmt::Display for ProblemList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, problem) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "  {problem}")?;
        }
        Ok(())
    }
}
