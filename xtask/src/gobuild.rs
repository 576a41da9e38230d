//! Builds the control plane from the Go wrapper modules in `tools/control-plane`
//! and caches the binaries; a stamp of the inputs decides whether a rebuild is
//! needed, so a second run costs nothing.
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::layout::Layout;
use crate::versions::{ContainerdRelease, KubeRelease};

/// Binaries built from the Kubernetes wrapper module of the chosen release
/// (`tools/control-plane/k8s/1.<minor>`), with the package each comes from.
const K8S_PACKAGES: [(&str, &str); 6] = [
    ("etcd", "./cmd/etcd"),
    ("kube-apiserver", "k8s.io/kubernetes/cmd/kube-apiserver"),
    (
        "kube-controller-manager",
        "k8s.io/kubernetes/cmd/kube-controller-manager",
    ),
    ("kube-scheduler", "k8s.io/kubernetes/cmd/kube-scheduler"),
    ("kubectl", "k8s.io/kubernetes/cmd/kubectl"),
    // The real test node's kubelet, from the same module as the control plane.
    ("kubelet", "k8s.io/kubernetes/cmd/kubelet"),
];

/// The real test node's container runtime, built from the wrapper module of
/// the chosen containerd release (`tools/node/containerd/<series>`): its
/// commands under the release's module path.
const CONTAINERD_COMMANDS: [&str; 3] = ["containerd", "containerd-shim-runc-v2", "ctr"];

fn containerd_package(release: &ContainerdRelease, command: &str) -> String {
    format!("{}/cmd/{command}", release.module)
}

/// Build tags that leave out the snapshotters the node does not use (and
/// their C dependencies).
const CONTAINERD_TAGS: &str = "no_btrfs no_devmapper no_zfs no_aufs";

/// kwok's default stages for fast fake nodes and pods, copied from the kwok
/// module at build time (kwok does nothing without stages).
const KWOK_STAGES: [&str; 5] = [
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-complete.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
];

/// Name of the stages file next to the binaries.
pub const KWOK_STAGES_FILE: &str = "kwok-stages.yaml";

const STAMP_FILE: &str = ".build-stamp";

/// Every file the cluster needs from the cache.
pub fn required_files() -> Vec<&'static str> {
    let mut files: Vec<&str> = K8S_PACKAGES
        .iter()
        .map(|(name, _)| *name)
        .chain(CONTAINERD_COMMANDS)
        .collect();
    files.push("kwok");
    files.push(KWOK_STAGES_FILE);
    files
}

fn k8s_ldflags(kube: &KubeRelease) -> String {
    let (version, minor) = (kube.version, kube.minor);
    let mut flags = String::from("-s -w");
    for pkg in [
        "k8s.io/component-base/version",
        "k8s.io/client-go/pkg/version",
    ] {
        flags.push_str(&format!(
            " -X {pkg}.gitVersion={version} -X {pkg}.gitMajor=1 -X {pkg}.gitMinor={minor} \
             -X {pkg}.gitTreeState=clean -X {pkg}.buildDate=1970-01-01T00:00:00Z"
        ));
    }
    flags
}

/// FNV-1a over the build inputs: module files, mains, flags, the packages
/// built (so adding a binary rebuilds) and the stage list.
fn stamp(layout: &Layout) -> Result<String> {
    let kwok = layout.tools().join("kwok");
    let inputs = [
        layout.kube_module().join("go.mod"),
        layout.kube_module().join("go.sum"),
        layout.kube_module().join("cmd/etcd/main.go"),
        kwok.join("go.mod"),
        kwok.join("go.sum"),
        layout.containerd_module().join("go.mod"),
        layout.containerd_module().join("go.sum"),
    ];
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for b in bytes {
            hash ^= u64::from(*b);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for path in inputs {
        let data = fs::read(&path).with_context(|| {
            format!(
                "reading {} (part of the control-plane wrapper modules; is the checkout complete?)",
                path.display()
            )
        })?;
        let relative = path.strip_prefix(&layout.repo).unwrap_or(&path);
        feed(relative.to_string_lossy().as_bytes());
        feed(&data);
    }
    feed(k8s_ldflags(&layout.kube).as_bytes());
    feed(CONTAINERD_TAGS.as_bytes());
    for (name, package) in K8S_PACKAGES {
        feed(name.as_bytes());
        feed(package.as_bytes());
    }
    for command in CONTAINERD_COMMANDS {
        feed(containerd_package(&layout.containerd, command).as_bytes());
    }
    for stage in KWOK_STAGES {
        feed(stage.as_bytes());
    }
    Ok(format!("{hash:016x}"))
}

/// True when every binary is present and was built from the current inputs.
fn up_to_date(layout: &Layout, stamp: &str) -> bool {
    let bin = layout.bin();
    let stamp_ok = fs::read_to_string(bin.join(STAMP_FILE))
        .map(|s| s.trim() == stamp)
        .unwrap_or(false);
    stamp_ok && required_files().iter().all(|f| bin.join(f).is_file())
}

/// Finds the Go toolchain: `$GO`, then `go` on PATH, then /usr/local/go/bin/go.
fn find_go() -> Result<PathBuf> {
    locate_go(
        std::env::var_os("GO").filter(|v| !v.is_empty()),
        std::env::var_os("PATH"),
        Path::new("/usr/local/go/bin/go"),
    )
}

fn locate_go(
    explicit: Option<std::ffi::OsString>,
    path: Option<std::ffi::OsString>,
    fallback: &Path,
) -> Result<PathBuf> {
    if let Some(go) = explicit {
        let go = PathBuf::from(go);
        if !go.is_file() {
            bail!(
                "GO={} does not exist: point GO at the `go` binary of a Go 1.26+ \
                 installation, or unset it to use `go` from PATH",
                go.display()
            );
        }
        return Ok(go);
    }
    if let Some(path) = path {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join("go");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    if fallback.is_file() {
        return Ok(fallback.to_path_buf());
    }
    bail!(
        "the Go toolchain was not found (looked at $GO, PATH and /usr/local/go/bin/go). \
         The test control plane (etcd, kube-apiserver, kube-controller-manager, \
         kube-scheduler, kubectl, kwok) is built from Go modules: install Go 1.26 or \
         newer and put it on PATH, or set GO=/path/to/go"
    )
}

/// Builds the control plane unless the cache already holds it.
pub fn ensure_built(layout: &Layout) -> Result<()> {
    let stamp = stamp(layout)?;
    if up_to_date(layout, &stamp) {
        eprintln!(
            "control-plane binaries are up to date in {}",
            layout.bin().display()
        );
        return Ok(());
    }
    let go = find_go()?;
    let version = Command::new(&go)
        .arg("version")
        .output()
        .with_context(|| format!("running `{} version`", go.display()))?;
    if !version.status.success() {
        bail!(
            "`{} version` failed: {}; fix the Go installation or set GO=/path/to/go",
            go.display(),
            String::from_utf8_lossy(&version.stderr).trim()
        );
    }
    eprintln!(
        "building Kubernetes {} and containerd {} with {} into {} (a cold build takes tens \
         of minutes on 2 cores; later runs reuse the Go build cache and this directory)",
        layout.kube.version,
        layout.containerd.version,
        String::from_utf8_lossy(&version.stdout).trim(),
        layout.bin().display()
    );
    let bin = layout.bin();
    fs::create_dir_all(&bin).with_context(|| format!("creating {}", bin.display()))?;
    // A failed or interrupted build must not look complete.
    let _ = fs::remove_file(bin.join(STAMP_FILE));

    let started = Instant::now();
    let mut out_dir = bin.clone().into_os_string();
    out_dir.push("/");
    let ldflags = k8s_ldflags(&layout.kube);
    let mut args: Vec<&std::ffi::OsStr> = vec![
        "build".as_ref(),
        "-trimpath".as_ref(),
        "-ldflags".as_ref(),
        ldflags.as_ref(),
        "-o".as_ref(),
        out_dir.as_ref(),
    ];
    args.extend(
        K8S_PACKAGES
            .iter()
            .map(|(_, pkg)| std::ffi::OsStr::new(*pkg)),
    );
    go_command(&go, &layout.kube_module(), &args)?;

    let kwok_args: Vec<&std::ffi::OsStr> = vec![
        "build".as_ref(),
        "-trimpath".as_ref(),
        "-ldflags".as_ref(),
        "-s -w".as_ref(),
        "-o".as_ref(),
        out_dir.as_ref(),
        "sigs.k8s.io/kwok/cmd/kwok".as_ref(),
    ];
    go_command(&go, &layout.tools().join("kwok"), &kwok_args)?;
    write_kwok_stages(&go, layout)?;

    let mut containerd_args: Vec<&std::ffi::OsStr> = vec![
        "build".as_ref(),
        "-trimpath".as_ref(),
        "-tags".as_ref(),
        CONTAINERD_TAGS.as_ref(),
        "-ldflags".as_ref(),
        "-s -w".as_ref(),
        "-o".as_ref(),
        out_dir.as_ref(),
    ];
    let containerd_packages: Vec<String> = CONTAINERD_COMMANDS
        .iter()
        .map(|c| containerd_package(&layout.containerd, c))
        .collect();
    containerd_args.extend(containerd_packages.iter().map(std::ffi::OsStr::new));
    go_command(&go, &layout.containerd_module(), &containerd_args)?;

    fs::write(bin.join(STAMP_FILE), format!("{stamp}\n"))
        .with_context(|| format!("writing the build stamp in {}", bin.display()))?;
    eprintln!(
        "built the control plane in {:.0}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Runs `go` at low priority (the machine is shared), statically linked.
fn go_command(go: &Path, dir: &Path, args: &[&std::ffi::OsStr]) -> Result<()> {
    let mut cmd = if Path::new("/usr/bin/nice").is_file() {
        let mut c = Command::new("/usr/bin/nice");
        c.args(["-n", "10"]).arg(go);
        c
    } else {
        Command::new(go)
    };
    cmd.args(args).current_dir(dir).env("CGO_ENABLED", "0");
    let status = cmd
        .status()
        .with_context(|| format!("running {} in {}", go.display(), dir.display()))?;
    if crate::procs::interrupted() {
        bail!("interrupted while building the control plane");
    }
    if !status.success() {
        bail!(
            "`go {}` in {} failed ({status}); see the Go output above. If modules cannot \
             be fetched, check that the Go module proxy is reachable (GOPROXY)",
            args.iter()
                .map(|a| a.to_string_lossy())
                .collect::<Vec<_>>()
                .join(" "),
            dir.display()
        );
    }
    Ok(())
}

/// Concatenates kwok's default stages from the module cache into one config file.
fn write_kwok_stages(go: &Path, layout: &Layout) -> Result<()> {
    let dir = layout.tools().join("kwok");
    let output = Command::new(go)
        .args(["list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/kwok"])
        .current_dir(&dir)
        .output()
        .with_context(|| format!("running `go list -m` in {}", dir.display()))?;
    if !output.status.success() {
        bail!(
            "could not locate the kwok module source: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let module = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    let mut config = String::new();
    for stage in KWOK_STAGES {
        let path = module.join(stage);
        let text = fs::read_to_string(&path)
            .with_context(|| format!("reading kwok stage {}", path.display()))?;
        config.push_str("---\n");
        config.push_str(text.trim_end());
        config.push('\n');
    }
    let target = layout.binary(KWOK_STAGES_FILE);
    fs::write(&target, config).with_context(|| format!("writing {}", target.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_go_toolchain_says_what_to_do() {
        let empty = std::env::temp_dir().join("gpu-stack-no-go-here");
        let err = locate_go(None, Some(empty.clone().into()), &empty.join("go"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("Go toolchain was not found"), "{err}");
        assert!(err.contains("GO=/path/to/go"), "{err}");
    }

    #[test]
    fn explicit_go_that_does_not_exist_is_rejected() {
        let missing = std::env::temp_dir().join("gpu-stack-no-go-here").join("go");
        let err = locate_go(Some(missing.into()), None, Path::new("/nonexistent"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not exist"), "{err}");
    }

    #[test]
    fn ldflags_stamp_the_kubernetes_version() {
        let flags = k8s_ldflags(&crate::versions::KUBE_RELEASES[2]);
        assert!(flags.starts_with("-s -w"));
        assert!(flags.contains("k8s.io/component-base/version.gitVersion=v1.37.2"));
        assert!(flags.contains("k8s.io/client-go/pkg/version.gitMinor=37"));
    }

    #[test]
    fn containerd_commands_come_from_the_release_module() {
        let [v2, _, v1] = crate::versions::CONTAINERD_RELEASES;
        assert_eq!(
            containerd_package(&v2, "ctr"),
            "github.com/containerd/containerd/v2/cmd/ctr"
        );
        assert_eq!(
            containerd_package(&v1, "containerd"),
            "github.com/containerd/containerd/cmd/containerd"
        );
    }
}
