//! The driver check's `/dev/char` links: reads NVIDIA's device nodes and
//! links each one into the host's `/dev/char` (which links, and why:
//! [`gpu_stack_core::operator::devchar`]).
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use gpu_stack_core::operator::devchar::{
    DevCharLink, DeviceNode, MAX_DEVICE_NODES, dev_char_links, is_nvidia_device,
};

/// Where the driver check reads device nodes and writes links.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevCharPaths {
    /// The device nodes: `/dev` (the check runs privileged, so it sees the host's).
    pub dev: PathBuf,
    /// The host's `/dev/char`, as the pod mounts it.
    pub dir: PathBuf,
}

/// Why a link could not be made.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot {action} {path}: {source}; the driver check links NVIDIA's device nodes into the host's /dev/char (runc with the systemd cgroup driver needs them): check the validator's host-dev-char mount (hostPath /dev/char), or set DISABLE_DEV_CHAR_SYMLINK_CREATION=true in the policy's validator.driver.env"
)]
pub struct DevCharError {
    /// What was being done.
    pub action: &'static str,
    /// The path.
    pub path: PathBuf,
    /// The cause.
    #[source]
    pub source: std::io::Error,
}

/// NVIDIA's character device nodes under `dev` and `dev/nvidia-caps`, at
/// most [`MAX_DEVICE_NODES`] entries read from each. Links are not followed.
pub fn device_nodes(dev: &Path) -> Result<Vec<DeviceNode>, DevCharError> {
    char_devices(dev, is_nvidia_device)
}

/// The character device nodes under `dev` and `dev/nvidia-caps` whose path
/// (relative to `dev`) `keep` accepts.
fn char_devices(dev: &Path, keep: fn(&str) -> bool) -> Result<Vec<DeviceNode>, DevCharError> {
    let mut out = Vec::new();
    for sub in ["", "nvidia-caps"] {
        let dir = dev.join(sub);
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if !sub.is_empty() && e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => {
                return Err(DevCharError {
                    action: "read",
                    path: dir,
                    source,
                });
            }
        };
        for entry in entries.take(MAX_DEVICE_NODES).flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let path = if sub.is_empty() {
                name.to_string()
            } else {
                format!("{sub}/{name}")
            };
            if !keep(&path) {
                continue;
            }
            let Ok(meta) = std::fs::symlink_metadata(entry.path()) else {
                continue;
            };
            if !meta.file_type().is_char_device() {
                continue;
            }
            let rdev = meta.rdev();
            out.push(DeviceNode {
                path,
                major: u32::try_from(nix::sys::stat::major(rdev)).unwrap_or(u32::MAX),
                minor: u32::try_from(nix::sys::stat::minor(rdev)).unwrap_or(u32::MAX),
            });
        }
    }
    Ok(out)
}

/// Makes each link in `dir` unless it already points at its target; a
/// link is replaced atomically (a temporary link renamed over it). Returns
/// how many were written.
pub fn write_links(dir: &Path, links: &[DevCharLink]) -> Result<usize, DevCharError> {
    let mut written = 0;
    for link in links {
        let path = dir.join(&link.name);
        if std::fs::read_link(&path).is_ok_and(|t| t == Path::new(&link.target)) {
            continue;
        }
        let tmp = dir.join(format!(".{}.gpu-stack-tmp", link.name));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&link.target, &tmp).map_err(|source| DevCharError {
            action: "create",
            path: tmp.clone(),
            source,
        })?;
        std::fs::rename(&tmp, &path).map_err(|source| {
            let _ = std::fs::remove_file(&tmp);
            DevCharError {
                action: "replace",
                path: path.clone(),
                source,
            }
        })?;
        written += 1;
    }
    Ok(written)
}

/// Links every NVIDIA device node under `paths.dev` into `paths.dir`.
/// A missing `paths.dir` (no such mount) is left alone: returns `Ok(None)`.
pub fn link_device_nodes(paths: &DevCharPaths) -> Result<Option<usize>, DevCharError> {
    if !paths.dir.is_dir() {
        return Ok(None);
    }
    let links = dev_char_links(&device_nodes(&paths.dev)?);
    write_links(&paths.dir, &links).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_nodes_are_read_with_their_numbers() {
        // Every Linux /dev has null (1:3).
        let all = char_devices(Path::new("/dev"), |_| true).unwrap();
        assert!(
            all.contains(&DeviceNode {
                path: "null".into(),
                major: 1,
                minor: 3
            }),
            "{all:?}"
        );
        // Neither a plain file nor a symlink by an NVIDIA name is a device.
        let dev = tempfile::tempdir().unwrap();
        std::fs::write(dev.path().join("nvidia0"), "").unwrap();
        std::os::unix::fs::symlink("/dev/null", dev.path().join("nvidiactl")).unwrap();
        std::fs::create_dir(dev.path().join("nvidia-caps")).unwrap();
        assert_eq!(device_nodes(dev.path()).unwrap(), []);
    }

    #[test]
    fn links_are_written_once_and_replaced_when_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let links = dev_char_links(&[
            DeviceNode {
                path: "nvidia0".into(),
                major: 195,
                minor: 0,
            },
            DeviceNode {
                path: "nvidia-caps/nvidia-cap1".into(),
                major: 511,
                minor: 1,
            },
        ]);
        std::os::unix::fs::symlink("../wrong", dir.path().join("195:0")).unwrap();
        assert_eq!(write_links(dir.path(), &links).unwrap(), 2);
        assert_eq!(
            std::fs::read_link(dir.path().join("195:0")).unwrap(),
            Path::new("../nvidia0")
        );
        assert_eq!(
            std::fs::read_link(dir.path().join("511:1")).unwrap(),
            Path::new("../nvidia-caps/nvidia-cap1")
        );
        // Already right: nothing written, no temporary left.
        assert_eq!(write_links(dir.path(), &links).unwrap(), 0);
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[test]
    fn without_the_mount_nothing_is_linked_and_an_unwritable_dir_is_named() {
        let root = tempfile::tempdir().unwrap();
        let paths = DevCharPaths {
            dev: root.path().join("dev"),
            dir: root.path().join("no-such-dir"),
        };
        assert_eq!(link_device_nodes(&paths).unwrap(), None);
        let links = [DevCharLink {
            name: "195:0".into(),
            target: "../nvidia0".into(),
        }];
        let err = write_links(&root.path().join("missing"), &links).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("missing") && text.contains("DISABLE_DEV_CHAR_SYMLINK_CREATION"));
    }
}
