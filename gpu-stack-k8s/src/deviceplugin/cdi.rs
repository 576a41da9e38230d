//! Writing the node's CDI spec where container runtimes read it, atomically
//! (through [`gpu_stack_nvml::fsutil::write_atomic`]: temporary file in the
//! same directory, fsync, rename, fsync of the directory), and finding the
//! host files the spec mounts.

use std::path::{Path, PathBuf};

use gpu_stack_core::cdi::{HostFiles, Spec, to_json};
use gpu_stack_nvml::fsutil::{AtomicWriteError, write_atomic};

/// Directory container runtimes read dynamic CDI specs from.
pub const DEFAULT_CDI_DIR: &str = "/var/run/cdi";
/// File name of the spec this project writes.
pub const SPEC_FILE: &str = "nvidia-gpu-stack.json";

/// Errors writing the spec.
#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    /// Creating, writing or renaming failed.
    #[error(
        "cannot write CDI spec {path}: {source}; check that the directory is writable (--cdi-spec-dir)"
    )]
    Io {
        /// Target path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// Serialising failed.
    #[error("cannot render CDI spec: {0}")]
    Render(String),
}

/// Writes `spec` to `<dir>/nvidia-gpu-stack.json` atomically (creating `dir`
/// if needed); returns the path. An unchanged spec is not rewritten. A failed
/// write leaves the old spec (and no temporary file) in place; when only the
/// final fsync of the directory fails, the new spec is in place and readable,
/// so that is logged, not returned.
pub fn write_spec(dir: &Path, spec: &Spec) -> Result<PathBuf, CdiError> {
    let path = dir.join(SPEC_FILE);
    let text = to_json(spec).map_err(|e| CdiError::Render(e.to_string()))?;
    if std::fs::read_to_string(&path).is_ok_and(|cur| cur == text) {
        return Ok(path);
    }
    std::fs::create_dir_all(dir).map_err(|source| CdiError::Io {
        path: path.clone(),
        source,
    })?;
    match write_atomic(&path, text.as_bytes()) {
        Ok(()) => {}
        Err(AtomicWriteError::NotWritten { source, .. }) => {
            return Err(CdiError::Io { path, source });
        }
        Err(e @ AtomicWriteError::NotDurable { .. }) => {
            tracing::warn!(error = %e, "CDI spec written, but not yet durable");
        }
    }
    Ok(path)
}

const LIB_DIRS: [&str; 4] = [
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/lib/x86_64-linux-gnu",
];
const LIB_PREFIXES: [&str; 7] = [
    "libcuda.so.",
    "libnvidia-ml.so.",
    "libnvidia-ptxjitcompiler.so.",
    "libnvidia-nvvm.so.",
    "libcudadebugger.so.",
    "libnvidia-opencl.so.",
    "libnvidia-gpucomp.so.",
];
const BINARIES: [&str; 5] = [
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
];
const CONTROL_NODES: [&str; 4] = [
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
];

fn under(root: &str, p: &str) -> PathBuf {
    PathBuf::from(format!("{}{p}", root.trim_end_matches('/')))
}

/// Looks for the driver's libraries (of `driver_version`), binaries and
/// control device nodes under the given roots. Missing files are left out; on
/// a machine without the driver the lists are empty.
///
/// `container_root` is where this process sees `driver_root` (NVIDIA's
/// `CONTAINER_DRIVER_ROOT`: the plugin's pod mounts the host's driver root at
/// `/driver-root`): files are looked for there and recorded under the host
/// paths. Device nodes are looked for there too when the dev root is the
/// driver root, otherwise under `dev_root` itself.
pub fn discover_host_files(
    driver_root: &str,
    dev_root: &str,
    container_root: &str,
    hook_path: &str,
    driver_version: &str,
) -> HostFiles {
    let dev_lookup = if dev_root == driver_root {
        container_root
    } else {
        dev_root
    };
    let mut driver_files = Vec::new();
    for dir in LIB_DIRS {
        let Ok(entries) = std::fs::read_dir(under(container_root, dir)) else {
            continue;
        };
        let mut found: Vec<String> = entries
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| {
                LIB_PREFIXES.iter().any(|p| n.starts_with(p)) && n.ends_with(driver_version)
            })
            .map(|n| format!("{dir}/{n}"))
            .collect();
        found.sort();
        driver_files.extend(found);
    }
    for b in BINARIES {
        let p = format!("/usr/bin/{b}");
        if under(container_root, &p).exists() {
            driver_files.push(p);
        }
    }
    HostFiles {
        driver_root: driver_root.to_string(),
        dev_root: dev_root.to_string(),
        hook_path: hook_path.to_string(),
        control_nodes: CONTROL_NODES
            .iter()
            .filter(|p| under(dev_lookup, p).exists())
            .map(|p| p.to_string())
            .collect(),
        driver_files,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_stack_core::cdi::node_spec;
    use gpu_stack_core::deviceplugin::{Gpu, NodeGpus};

    #[test]
    fn writes_atomically_and_discovers_files() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path().to_str().unwrap();
        std::fs::create_dir_all(root.path().join("usr/lib/x86_64-linux-gnu")).unwrap();
        std::fs::write(
            root.path()
                .join("usr/lib/x86_64-linux-gnu/libcuda.so.550.1"),
            "",
        )
        .unwrap();
        std::fs::write(
            root.path().join("usr/lib/x86_64-linux-gnu/libcuda.so.1"),
            "",
        )
        .unwrap();
        std::fs::create_dir_all(root.path().join("dev")).unwrap();
        std::fs::write(root.path().join("dev/nvidiactl"), "").unwrap();
        let host = discover_host_files(r, r, r, "/usr/bin/nvidia-cdi-hook", "550.1");
        assert_eq!(
            host.driver_files,
            vec!["/usr/lib/x86_64-linux-gnu/libcuda.so.550.1".to_string()]
        );
        assert_eq!(host.control_nodes, vec!["/dev/nvidiactl".to_string()]);

        let node = NodeGpus {
            gpus: vec![Gpu {
                uuid: "GPU-0".into(),
                ..Gpu::default()
            }],
            ..NodeGpus::default()
        };
        let out = root.path().join("cdi");
        let path = write_spec(&out, &node_spec(&node, &host)).unwrap();
        let back: Spec = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(back.devices.len(), 3);
        let names: Vec<_> = std::fs::read_dir(&out)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names.len(), 1, "no temporary file left behind");
    }

    fn names_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    fn one_gpu_spec(uuid: &str) -> Spec {
        let node = NodeGpus {
            gpus: vec![Gpu {
                uuid: uuid.into(),
                ..Gpu::default()
            }],
            ..NodeGpus::default()
        };
        node_spec(&node, &HostFiles::default())
    }

    #[test]
    fn an_unchanged_spec_is_not_rewritten_and_a_changed_one_is() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let path = write_spec(dir.path(), &one_gpu_spec("GPU-0")).unwrap();
        let ino = std::fs::metadata(&path).unwrap().ino();
        // The same spec again: the file is left alone (a rewrite renames a new
        // inode into place).
        assert_eq!(
            write_spec(dir.path(), &one_gpu_spec("GPU-0")).unwrap(),
            path
        );
        assert_eq!(std::fs::metadata(&path).unwrap().ino(), ino);
        // A different spec replaces it.
        write_spec(dir.path(), &one_gpu_spec("GPU-1")).unwrap();
        assert_ne!(std::fs::metadata(&path).unwrap().ino(), ino);
        assert!(std::fs::read_to_string(&path).unwrap().contains("GPU-1"));
        assert_eq!(names_in(dir.path()), vec![SPEC_FILE.to_string()]);
    }

    #[test]
    fn a_failed_write_is_an_io_error_naming_the_spec_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        // A non-empty directory where the spec goes: the rename over it fails.
        let path = dir.path().join(SPEC_FILE);
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("inside"), "old").unwrap();
        let err = write_spec(dir.path(), &one_gpu_spec("GPU-0")).unwrap_err();
        assert!(
            matches!(&err, CdiError::Io { path: p, .. } if *p == path),
            "{err}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains(&path.display().to_string()) && msg.contains("--cdi-spec-dir"),
            "{msg}"
        );
        assert_eq!(names_in(dir.path()), vec![SPEC_FILE.to_string()]);
        assert_eq!(std::fs::read_to_string(path.join("inside")).unwrap(), "old");
    }

    #[test]
    fn files_seen_at_the_container_root_are_recorded_at_the_host_root() {
        let mounted = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(mounted.path().join("dev")).unwrap();
        std::fs::write(mounted.path().join("dev/nvidiactl"), "").unwrap();
        let seen = mounted.path().to_str().unwrap();
        let host = discover_host_files("/run/nvidia/driver", "/run/nvidia/driver", seen, "/h", "1");
        assert_eq!(host.control_nodes, vec!["/dev/nvidiactl".to_string()]);
        assert_eq!(host.driver_root, "/run/nvidia/driver");
        // Nothing is found where the host path would be inside the container.
        let elsewhere = tempfile::tempdir().unwrap();
        let none = discover_host_files(seen, seen, elsewhere.path().to_str().unwrap(), "/h", "1");
        assert!(none.control_nodes.is_empty());
    }
}
