//! File writes that survive a crash: a reader sees the old content or the new
//! content, never a truncated or half-written file.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// A failed atomic write: which step failed on which path.
#[derive(Debug, thiserror::Error)]
pub enum AtomicWriteError {
    /// A step before the rename failed: the target holds its old content (or
    /// is still missing).
    #[error(
        "could not write {target}: {step} {path} failed: {source} (the old content of {target} is unchanged; check that its directory exists, is writable and has free space)"
    )]
    NotWritten {
        /// The file that was to be replaced.
        target: String,
        /// What was being done (`create`, `write`, `fsync`, `rename into place from`).
        step: &'static str,
        /// The path the step acted on.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The new content is in place, but syncing its directory failed, so a
    /// power loss could still bring back the old content.
    #[error(
        "{target} holds the new content, but syncing its directory {dir} failed: {source} (a power loss could bring back the old content; check the file system's health)"
    )]
    NotDurable {
        /// The file that was replaced.
        target: String,
        /// Its directory.
        dir: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

impl AtomicWriteError {
    /// The step that failed.
    pub fn step(&self) -> &'static str {
        match self {
            AtomicWriteError::NotWritten { step, .. } => step,
            AtomicWriteError::NotDurable { .. } => "fsync of directory",
        }
    }
}

/// Replaces `path` with `bytes` atomically: writes a temporary file in the same
/// directory, fsyncs it, renames it over `path` and fsyncs the directory, so
/// a crash at any moment leaves either the old or the new content. The
/// directory must exist. The temporary file is removed when a step fails.
/// On [`AtomicWriteError::NotWritten`] the target is unchanged; on
/// [`AtomicWriteError::NotDurable`] it holds the new content.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), AtomicWriteError> {
    let target = path.display().to_string();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "file".into());
    let fail =
        |step: &'static str, p: &Path, source: std::io::Error| AtomicWriteError::NotWritten {
            target: target.clone(),
            step,
            path: p.display().to_string(),
            source,
        };
    let (tmp, mut file) = create_temp(&dir, &name).map_err(|(p, e)| fail("create", &p, e))?;
    let written = file
        .write_all(bytes)
        .map_err(|e| fail("write", &tmp, e))
        .and_then(|()| file.sync_all().map_err(|e| fail("fsync", &tmp, e)));
    drop(file);
    if let Err(e) = written.and_then(|()| {
        std::fs::rename(&tmp, path).map_err(|e| fail("rename into place from", &tmp, e))
    }) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    sync_dir(&dir).map_err(|source| AtomicWriteError::NotDurable {
        target: target.clone(),
        dir: dir.display().to_string(),
        source,
    })
}

/// A new temporary file `.<name>.<pid>.<n>.tmp` in `dir`, created exclusively
/// (threads and processes writing the same target never share one).
fn create_temp(dir: &Path, name: &str) -> Result<(PathBuf, File), (PathBuf, std::io::Error)> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let mut last = None;
    for _ in 0..16 {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{name}.{}.{n}.tmp", std::process::id()));
        match OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some((tmp, e)),
            Err(e) => return Err((tmp, e)),
        }
    }
    Err(last.unwrap_or_else(|| {
        (
            dir.to_path_buf(),
            std::io::Error::other("no free temporary file name"),
        )
    }))
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_content_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        write_atomic(&path, b"one").unwrap();
        write_atomic(&path, b"two, longer").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two, longer");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("state.json")]);
    }

    #[test]
    fn a_missing_directory_names_the_target_and_keeps_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("no/such/dir/labels");
        let err = write_atomic(&path, b"x").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("labels"), "{msg}");
        assert_eq!(err.step(), "create");
        assert!(msg.contains("unchanged"), "{msg}");
    }

    #[test]
    fn a_failed_rename_keeps_the_old_content_and_removes_the_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        // A non-empty directory as the target: rename over it fails.
        let path = dir.path().join("target");
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("inside"), "old").unwrap();
        let err = write_atomic(&path, b"new").unwrap_err();
        assert_eq!(err.step(), "rename into place from");
        assert_eq!(std::fs::read(path.join("inside")).unwrap(), b"old");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("target")]);
    }
}
