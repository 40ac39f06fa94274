//! `--write PATH`: the new config goes to a temporary file in PATH's own
//! directory, is validated there exactly as `harvester-lb check` validates
//! (the same [`crate::config::load`]), and is renamed over PATH only if it
//! is valid. The rename is atomic within one file system, so the daemon's
//! file watch sees the old file or the new one, never half of one; a file
//! whose bytes would not change is left alone, so a timer that imports
//! every minute does not make the daemon reload for nothing.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::config::{self, ConfigError};

/// What `--write` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    /// PATH now holds the new config.
    Written,
    /// PATH already held exactly these bytes; nothing was touched.
    Unchanged,
}

/// Why PATH was not written.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// PATH has no file name (`/`, `..`).
    #[error("--write {0}: not a file path")]
    NotAFile(PathBuf),
    /// The temporary file could not be created, written or renamed.
    #[error("cannot write {path}: {source}")]
    Io {
        /// The file being written (the temporary one, or PATH at rename).
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The config is larger than the daemon reads; PATH is untouched.
    #[error(
        "the imported config would be {size} bytes, more than the {} a config file may have; {target} was not changed",
        config::MAX_FILE_BYTES
    )]
    TooLarge {
        /// PATH.
        target: PathBuf,
        /// The config's size.
        size: usize,
    },
    /// The config, as written, does not pass `check`; PATH is untouched.
    #[error("the imported config is invalid; {target} was not changed:\n{source}")]
    Invalid {
        /// PATH.
        target: PathBuf,
        /// Every problem, as `check` prints them.
        source: ConfigError,
    },
}

/// Removes the temporary file unless it was renamed into place.
struct TempFile {
    path: PathBuf,
    keep: bool,
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.keep {
            // Best effort: the file is ours, and a leftover is harmless.
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Writes `text` to `target` through a validated temporary file.
pub fn write_validated(target: &Path, text: &str) -> Result<WriteOutcome, WriteError> {
    let file_name = target
        .file_name()
        .ok_or_else(|| WriteError::NotAFile(target.to_path_buf()))?;
    if text.len() as u64 > config::MAX_FILE_BYTES {
        return Err(WriteError::TooLarge {
            target: target.to_path_buf(),
            size: text.len(),
        });
    }
    let dir = target
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut temp = TempFile {
        path: dir.join(format!(
            ".{}.import-{}",
            file_name.to_string_lossy(),
            std::process::id()
        )),
        keep: false,
    };
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| WriteError::Io { path, source }
    };
    // A leftover of a run killed with this pid is ours to replace.
    let _ = fs::remove_file(&temp.path);
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        // The daemon reads the file as an unprivileged user: world-readable,
        // as the README's install step makes it.
        .mode(0o644)
        .open(&temp.path)
        .map_err(io(&temp.path))?;
    file.write_all(text.as_bytes()).map_err(io(&temp.path))?;
    file.sync_all().map_err(io(&temp.path))?;
    drop(file);

    if let Err(source) = config::load(&temp.path) {
        return Err(WriteError::Invalid {
            target: target.to_path_buf(),
            source,
        });
    }
    // Only a regular file can be unchanged; whatever else is at PATH (a
    // FIFO would block a plain read) is replaced by the rename.
    if existing(target).is_some_and(|old| old == text) {
        return Ok(WriteOutcome::Unchanged);
    }
    fs::rename(&temp.path, target).map_err(io(target))?;
    temp.keep = true;
    // The rename is durable once the directory is; a failure here leaves
    // the new file in place, so it is not an error of the import.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(WriteOutcome::Written)
}

/// The text of the config file at `path` if it is a regular file (not a
/// FIFO, which would block the read, nor a device) of at most the config's
/// size limit, in UTF-8; `None` otherwise.
pub(super) fn existing(path: &Path) -> Option<String> {
    let bytes = config::read_regular_file(path, config::MAX_FILE_BYTES).ok()?;
    String::from_utf8(bytes).ok()
}
