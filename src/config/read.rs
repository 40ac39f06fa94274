//! Reading a file at a path someone else may have put anything at.
//!
//! The config path, an `import` input and `--base` are read with
//! [`read_regular_file`] alone: a FIFO there would block the `open(2)` (and
//! with it the reload loop, SIGTERM and `check`) until a writer came, and
//! `/dev/zero` would be read until memory ran out. So the path is opened
//! with `O_NONBLOCK` (a FIFO cannot block the open), anything but a regular
//! file is refused by what it is, and at most a bound is read. The only I/O
//! the config layer does.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// What a path names when it is not a regular file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    /// A directory.
    Directory,
    /// A FIFO (named pipe): a read waits for a writer.
    Fifo,
    /// A character device (`/dev/zero`, a terminal): a read may never end.
    CharDevice,
    /// A block device (a disk).
    BlockDevice,
    /// A Unix socket.
    Socket,
    /// Something else that is not a regular file.
    Other,
}

impl FileKind {
    fn of(file_type: std::fs::FileType) -> Option<FileKind> {
        Some(if file_type.is_file() {
            return None;
        } else if file_type.is_dir() {
            FileKind::Directory
        } else if file_type.is_fifo() {
            FileKind::Fifo
        } else if file_type.is_char_device() {
            FileKind::CharDevice
        } else if file_type.is_block_device() {
            FileKind::BlockDevice
        } else if file_type.is_socket() {
            FileKind::Socket
        } else {
            FileKind::Other
        })
    }
}

impl fmt::Display for FileKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FileKind::Directory => "a directory",
            FileKind::Fifo => "a FIFO (named pipe)",
            FileKind::CharDevice => "a character device",
            FileKind::BlockDevice => "a block device",
            FileKind::Socket => "a Unix socket",
            FileKind::Other => "not a regular file",
        })
    }
}

/// Why [`read_regular_file`] read nothing. The messages leave out the path:
/// each caller names the file in its own words.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// `stat`, `open` or `read` failed (missing, no permission…).
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The path names something other than a regular file.
    #[error("is {0}, not a regular file")]
    NotRegular(FileKind),
    /// The file holds more than the bound.
    #[error("is {size} bytes; the limit is {limit} bytes")]
    TooLarge {
        /// Its size (as far as it was read, when it grew while being read).
        size: u64,
        /// The bound.
        limit: u64,
    },
}

/// The bytes of the regular file at `path` (symlinks followed), at most
/// `limit` of them; anything else is refused without waiting on it.
pub fn read_regular_file(path: &Path, limit: u64) -> Result<Vec<u8>, ReadError> {
    // stat first: a device or FIFO is refused without being opened at all
    // (opening some devices does something).
    let meta = std::fs::metadata(path)?;
    regular(&meta, limit)?;
    // The path may have been swapped since: O_NONBLOCK keeps the open of a
    // FIFO from waiting for a writer, O_NOCTTY a terminal from becoming ours,
    // and fstat of what was opened decides.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    regular(&file.metadata()?, limit)?;
    read_bounded(file, limit)
}

/// Refuses what is not a regular file of at most `limit` bytes.
fn regular(meta: &std::fs::Metadata, limit: u64) -> Result<(), ReadError> {
    if let Some(kind) = FileKind::of(meta.file_type()) {
        return Err(ReadError::NotRegular(kind));
    }
    if meta.len() > limit {
        return Err(ReadError::TooLarge {
            size: meta.len(),
            limit,
        });
    }
    Ok(())
}

/// Reads at most `limit` bytes; one more means the file grew past it.
fn read_bounded(file: File, limit: u64) -> Result<Vec<u8>, ReadError> {
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(ReadError::TooLarge {
            size: bytes.len() as u64,
            limit,
        });
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_are_read_and_only_up_to_the_bound() {
        let dir = std::env::temp_dir().join(format!("hlb-read-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("f");
        std::fs::write(&file, b"0123456789").unwrap();
        assert_eq!(read_regular_file(&file, 10).unwrap(), b"0123456789");
        assert!(matches!(
            read_regular_file(&file, 9),
            Err(ReadError::TooLarge { size: 10, limit: 9 })
        ));
        assert!(matches!(
            read_regular_file(&dir, 10),
            Err(ReadError::NotRegular(FileKind::Directory))
        ));
        assert!(matches!(
            read_regular_file(Path::new("/dev/zero"), 10),
            Err(ReadError::NotRegular(FileKind::CharDevice))
        ));
        let e = read_regular_file(&dir.join("missing"), 10).unwrap_err();
        assert!(matches!(&e, ReadError::Io(e) if e.kind() == io::ErrorKind::NotFound));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
