//! Writing the node's CDI spec where container runtimes read it, atomically
//! (temporary file in the same directory, then rename), and finding the host
//! files the spec mounts.

use std::io::Write;
use std::path::{Path, PathBuf};

use gpu_stack_core::cdi::{HostFiles, Spec, to_json};

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

/// Writes `spec` to `<dir>/nvidia-gpu-stack.json` atomically; returns the path.
/// An unchanged spec is not rewritten.
pub fn write_spec(dir: &Path, spec: &Spec) -> Result<PathBuf, CdiError> {
    let path = dir.join(SPEC_FILE);
    let io = |source| CdiError::Io {
        path: path.clone(),
        source,
    };
    let text = to_json(spec).map_err(|e| CdiError::Render(e.to_string()))?;
    if std::fs::read_to_string(&path).is_ok_and(|cur| cur == text) {
        return Ok(path);
    }
    std::fs::create_dir_all(dir).map_err(io)?;
    let tmp = dir.join(format!(".{SPEC_FILE}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(io)?;
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
