//! The per-node validator's side effects: gathering evidence (GPU backend,
//! files on the node, the Node object through the API server), writing and
//! removing status files under the validations directory, and waiting.
//!
//! The decisions are in [`gpu_stack_core::operator::validation`]. A status
//! file is written atomically (through [`gpu_stack_nvml::fsutil::write_atomic`]:
//! temporary file in the same directory, fsync, rename, fsync of the
//! directory), so an init container polling for it never reads half a file; a
//! failed check writes nothing and removes a stale file of the same name.
//!
//! - [`workload`] (workload.rs): the plugin check's workload pod.
pub mod devchar;
pub mod workload;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpu_stack_core::backend::GpuBackend;
use gpu_stack_core::operator::validation::{
    CudaVersion, DriverEvidence, DriverRoot, PluginEvidence, ReadyFile, ToolkitEvidence,
    ValidationComponent, ValidationError, check_cuda, check_driver, check_plugin, check_toolkit,
    missing_ready_files, workload_resource,
};
use gpu_stack_nvml::fsutil::{AtomicWriteError, write_atomic};
use k8s_openapi::api::core::v1::Node;
use kube::Api;

/// Paths the container toolkit leaves on a node, looked at by the `toolkit`
/// check when none are given: CDI specs, the containerd drop-in and the
/// toolkit's install directory.
pub const DEFAULT_TOOLKIT_EVIDENCE: &[&str] = &[
    "/var/run/cdi/nvidia.yaml",
    "/etc/cdi/nvidia.yaml",
    "/etc/containerd/conf.d/99-nvidia.toml",
    "/usr/local/nvidia/toolkit",
];

/// Errors of the validator's adapter.
#[derive(Debug, thiserror::Error)]
pub enum ValidatorError {
    /// The component is not valid (what is missing and how to fix it).
    #[error(transparent)]
    Check(#[from] ValidationError),
    /// A status file could not be written or removed.
    #[error(
        "cannot {action} {path}: {source}; check that the validations directory is mounted read-write (hostPath /run/nvidia/validations)"
    )]
    Io {
        /// What was being done.
        action: &'static str,
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The plugin check's workload pod gave no verdict, or a failing one.
    #[error(transparent)]
    Workload(#[from] workload::WorkloadError),
    /// The driver check could not link the device nodes into `/dev/char`.
    #[error(transparent)]
    DevChar(#[from] devchar::DevCharError),
    /// The plugin check has no node name.
    #[error(
        "the plugin check needs the node name: pass --node or set NODE_NAME (the DaemonSet sets it from spec.nodeName)"
    )]
    NoNodeName,
    /// The plugin check has no Kubernetes client.
    #[error(
        "the plugin check needs the Kubernetes API: run in-cluster, set $KUBECONFIG or pass --kubeconfig ({0})"
    )]
    NoKube(String),
    /// Reading the Node failed.
    #[error(
        "plugin not ready: cannot read node {node} from the API server: {source}; check the validator's RBAC (get nodes) and that the node name is right"
    )]
    Kube {
        /// Node name.
        node: String,
        /// The cause.
        source: kube::Error,
    },
    /// The CDI-native toolkit check found problems.
    #[error(
        "toolkit not ready: {}; the toolkit DaemonSet's `gpu-stack toolkit` sets this up (see its log)",
        problems.join("; ")
    )]
    ToolkitRuntime {
        /// What is wrong, one entry each.
        problems: Vec<String>,
    },
    /// `--wait` gave up.
    #[error("{component} not ready after {secs} s of waiting; last failure: {last}")]
    CheckTimedOut {
        /// Component checked.
        component: ValidationComponent,
        /// Seconds waited.
        secs: u64,
        /// The last check's failure.
        last: Box<ValidatorError>,
    },
    /// Waiting for status files gave up.
    #[error(
        "timed out after {secs} s waiting for {} in {}; the validator pod on this node writes them once its checks pass: see its init containers' logs",
        missing.join(", "),
        dir.display()
    )]
    WaitTimedOut {
        /// Files still missing.
        missing: Vec<String>,
        /// Directory watched.
        dir: PathBuf,
        /// Seconds waited.
        secs: u64,
    },
}

/// Where the validator gets its evidence from.
pub struct Sources {
    /// Opens the GPU backend (retried by `--wait`: the driver may not be loaded yet).
    pub gpus: Box<dyn Fn() -> Result<Arc<dyn GpuBackend>, String> + Send + Sync>,
    /// Kubernetes client for the plugin check, or why there is none.
    pub kube: Result<kube::Client, String>,
}

/// How the validator runs.
#[derive(Debug, Clone)]
pub struct ValidatorOptions {
    /// Directory of the status files (`/run/nvidia/validations`).
    pub dir: PathBuf,
    /// Where the driver lives (`/` for a host driver).
    pub driver_root: DriverRoot,
    /// Paths whose existence shows the toolkit is installed.
    pub toolkit_evidence: Vec<PathBuf>,
    /// With gpu-stack's toolkit agent: check its CDI spec and the runtime's
    /// effective configuration instead of looking for paths.
    pub toolkit_runtime: Option<RuntimeCheck>,
    /// CUDA driver API version the `cuda` check requires.
    pub cuda_required: CudaVersion,
    /// Where the driver check links NVIDIA's device nodes into `/dev/char`
    /// (`None`: it does not).
    pub dev_char: Option<devchar::DevCharPaths>,
    /// Node name (for the plugin check).
    pub node: Option<String>,
    /// The plugin check's workload pod, where it runs one (nodes whose GPUs
    /// reach pods through the device plugin; not DRA nodes).
    pub plugin_workload: Option<workload::PluginWorkload>,
    /// Retry failed checks until this much time has passed (`None`: check once).
    pub wait: Option<Duration>,
    /// Pause between retries.
    pub poll: Duration,
}

/// Reads what the driver says through the GPU backend.
pub fn driver_evidence(gpus: &dyn GpuBackend) -> Result<DriverEvidence, ValidationError> {
    let unreachable = |e: gpu_stack_core::backend::BackendError| {
        ValidationError::DriverUnreachable(e.to_string())
    };
    let info = gpus.system_info().map_err(unreachable)?;
    let gpu_count = gpus.device_count().map_err(unreachable)?;
    Ok(DriverEvidence {
        gpu_count,
        driver_version: info.driver_version,
        cuda_driver_version: info.cuda_driver_version,
    })
}

/// Which of `paths` exist.
pub fn toolkit_evidence(paths: &[PathBuf]) -> ToolkitEvidence {
    let checked: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    let present = paths
        .iter()
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect();
    ToolkitEvidence { checked, present }
}

/// What the CDI-native toolkit check looks at (host paths, seen under
/// `host_root`).
#[derive(Debug, Clone)]
pub struct RuntimeCheck {
    /// Where the host's root is seen.
    pub host_root: PathBuf,
    /// The runtime's CRI socket.
    pub cri_socket: String,
    /// The host CDI spec the agent writes.
    pub cdi_spec: String,
    /// The runtime handler the operands' RuntimeClass names, if any.
    pub runtime_handler: Option<String>,
}

/// The toolkit is ready when the host CDI spec parses, names GPUs whose
/// device nodes exist, and the running runtime reads CDI specs from the
/// spec's directory (and has the runtime handler).
pub async fn check_runtime(check: &RuntimeCheck) -> Result<ReadyFile, ValidatorError> {
    use gpu_stack_core::toolkit::{RuntimeOptions, containerd::effective_gaps};
    let host = |p: &str| crate::toolkit::host_path(&check.host_root, p);
    let mut problems = Vec::new();
    match std::fs::read_to_string(host(&check.cdi_spec)) {
        Err(e) => problems.push(format!("cannot read the CDI spec {}: {e}", check.cdi_spec)),
        Ok(text) => match serde_json::from_str::<gpu_stack_core::cdi::Spec>(&text) {
            Err(e) => problems.push(format!(
                "the CDI spec {} does not parse: {e}",
                check.cdi_spec
            )),
            Ok(spec) => problems.extend(
                gpu_stack_core::cdi::host_spec_problems(&spec, &|p: &str| host(p).exists())
                    .into_iter()
                    .map(|p| format!("the CDI spec {}: {p}", check.cdi_spec)),
            ),
        },
    }
    let dir = match check.cdi_spec.rsplit_once('/') {
        Some((d, _)) if !d.is_empty() => d.to_string(),
        _ => "/".to_string(),
    };
    match crate::toolkit::cri::status(&host(&check.cri_socket)).await {
        Err(e) => problems.push(e.to_string()),
        Ok(state) => {
            if !state.ready {
                problems.push(format!("the runtime at {} is not ready", check.cri_socket));
            }
            if let Some(json) = state.config_json {
                let wanted = RuntimeOptions {
                    cdi_spec_dirs: vec![dir],
                    runtime_handler: check.runtime_handler.clone(),
                };
                match effective_gaps(&json, &wanted) {
                    Ok(gaps) => {
                        problems.extend(gaps.iter().map(|g| format!("the running runtime: {g}")))
                    }
                    Err(e) => {
                        problems.push(format!("cannot read the runtime's configuration: {e}"))
                    }
                }
            }
        }
    }
    if problems.is_empty() {
        Ok(ReadyFile {
            name: ValidationComponent::Toolkit.ready_file(),
            content: format!(
                "CDI_SPEC={}\nCRI_SOCKET={}\n",
                check.cdi_spec, check.cri_socket
            ),
        })
    } else {
        Err(ValidatorError::ToolkitRuntime { problems })
    }
}

/// Reads the Node's allocatable resources and, on a node that runs the DRA
/// plugin, how many devices its ResourceSlices publish.
pub async fn plugin_evidence(
    client: &kube::Client,
    node: &str,
) -> Result<PluginEvidence, ValidatorError> {
    let api: Api<Node> = Api::all(client.clone());
    let n = api.get(node).await.map_err(|source| ValidatorError::Kube {
        node: node.to_string(),
        source,
    })?;
    let dra_label = gpu_stack_core::operator::components::Component::DraPlugin.deploy_label();
    let runs_dra = n
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(&dra_label))
        .is_some_and(|v| v == "true");
    let dra_devices = if runs_dra {
        let slices: Api<k8s_openapi::api::resource::v1::ResourceSlice> = Api::all(client.clone());
        let list = slices
            .list(&kube::api::ListParams::default().fields(&format!("spec.nodeName={node}")))
            .await
            .map_err(|source| ValidatorError::Kube {
                node: node.to_string(),
                source,
            })?;
        Some(
            list.items
                .iter()
                .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
                .sum(),
        )
    } else {
        None
    };
    let allocatable: BTreeMap<String, String> = n
        .status
        .and_then(|s| s.allocatable)
        .unwrap_or_default()
        .into_iter()
        .map(|(k, q)| (k, q.0))
        .collect();
    Ok(PluginEvidence {
        node: node.to_string(),
        allocatable,
        dra_devices,
    })
}

/// Writes a status file atomically (temporary file, fsync, rename, fsync of
/// the directory), creating `dir` if needed; returns its path. A failed write
/// leaves no temporary file and is [`ValidatorError::Io`]: `write` of the
/// temporary file, or `rename into` the status file. When only the final
/// fsync of the directory fails, the file is in place and visible, so that is
/// logged, not returned.
pub fn write_ready(dir: &Path, file: &ReadyFile) -> Result<PathBuf, ValidatorError> {
    std::fs::create_dir_all(dir).map_err(|source| ValidatorError::Io {
        action: "create",
        path: dir.to_path_buf(),
        source,
    })?;
    let target = dir.join(file.name);
    match write_atomic(&target, file.content.as_bytes()) {
        Ok(()) => {}
        Err(AtomicWriteError::NotWritten {
            step, path, source, ..
        }) => {
            let (action, path) = if step.starts_with("rename") {
                ("rename into", target)
            } else {
                ("write", PathBuf::from(path))
            };
            return Err(ValidatorError::Io {
                action,
                path,
                source,
            });
        }
        Err(e @ AtomicWriteError::NotDurable { .. }) => {
            tracing::warn!(error = %e, "status file written, but not yet durable");
        }
    }
    Ok(target)
}

/// Removes a status file; `true` when there was one.
pub fn remove_ready(dir: &Path, name: &str) -> Result<bool, ValidatorError> {
    let path = dir.join(name);
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(ValidatorError::Io {
            action: "remove",
            path,
            source,
        }),
    }
}

/// Names of the regular files in `dir` (empty when it does not exist).
pub fn present_files(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.file_type().map(|t| t.is_file()).unwrap_or(false))
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Whether a file name is a validation status file: `<name>-ready`, not
/// hidden (the `*-ready` glob of NVIDIA's preStop hook; the driver
/// container's own `.driver-ctr-ready` is not one).
pub fn is_status_file(name: &str) -> bool {
    !name.starts_with('.') && name.len() > "-ready".len() && name.ends_with("-ready")
}

/// Removes every status file in `dir` (what NVIDIA's validator pod does
/// with `rm -f <dir>/*-ready` when it stops); returns the names removed, in
/// order. A missing directory removes nothing.
pub fn remove_status_files(dir: &Path) -> Result<Vec<String>, ValidatorError> {
    let mut removed = Vec::new();
    for name in present_files(dir) {
        if is_status_file(&name) && remove_ready(dir, &name)? {
            removed.push(name);
        }
    }
    Ok(removed)
}

/// The validator pod's main container: once every check of the init chain
/// has passed, holds until `stop` completes (SIGTERM when the pod stops),
/// then removes the status files, so that no operand starts on this node
/// on the word of a validator that is gone. Returns the names removed.
pub async fn hold(
    dir: &Path,
    stop: impl std::future::Future<Output = ()>,
) -> Result<Vec<String>, ValidatorError> {
    tracing::info!(dir = %dir.display(), "all validations are successful; holding until stopped");
    stop.await;
    let removed = remove_status_files(dir)?;
    tracing::info!(removed = ?removed, "stopping: removed the status files");
    Ok(removed)
}

/// Gathers evidence for one component and decides, once.
pub async fn check_once(
    component: ValidationComponent,
    options: &ValidatorOptions,
    sources: &Sources,
) -> Result<ReadyFile, ValidatorError> {
    match component {
        ValidationComponent::Driver | ValidationComponent::Cuda => {
            let gpus = (sources.gpus)().map_err(ValidationError::DriverUnreachable)?;
            let evidence = driver_evidence(gpus.as_ref())?;
            if component == ValidationComponent::Cuda {
                return Ok(check_cuda(&evidence, options.cuda_required)?);
            }
            let file = check_driver(&evidence, &options.driver_root)?;
            if let Some(paths) = &options.dev_char
                && let Some(written) = devchar::link_device_nodes(paths)?
            {
                tracing::debug!(written, dir = %paths.dir.display(), "device nodes linked into /dev/char");
            }
            Ok(file)
        }
        ValidationComponent::Toolkit => match &options.toolkit_runtime {
            Some(check) => check_runtime(check).await,
            None => Ok(check_toolkit(&toolkit_evidence(&options.toolkit_evidence))?),
        },
        ValidationComponent::Plugin => {
            let node = options.node.as_deref().ok_or(ValidatorError::NoNodeName)?;
            let client = sources
                .kube
                .as_ref()
                .map_err(|e| ValidatorError::NoKube(e.clone()))?;
            let evidence = plugin_evidence(client, node).await?;
            let file = check_plugin(&evidence)?;
            let (Some(pod), None) = (&options.plugin_workload, evidence.dra_devices) else {
                return Ok(file);
            };
            let resource = workload_resource(&evidence.allocatable)
                .ok_or_else(|| ValidationError::NoGpuResources { node: node.into() })?;
            let reported = workload::run(client, node, &resource, pod).await?;
            // One line of an env file, whatever the pod wrote.
            let device: String = reported
                .lines()
                .next()
                .unwrap_or_default()
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
                .take(64)
                .collect();
            Ok(ReadyFile {
                content: format!(
                    "{}WORKLOAD_RESOURCE={resource}\nWORKLOAD_DEVICE=/dev/{device}\n",
                    file.content
                ),
                ..file
            })
        }
    }
}

/// Validates one component: on success writes its status file and returns
/// its path; on failure removes a stale status file and returns why. With
/// `options.wait`, a failed check is retried until it passes or time runs out.
pub async fn validate(
    component: ValidationComponent,
    options: &ValidatorOptions,
    sources: &Sources,
) -> Result<PathBuf, ValidatorError> {
    let started = tokio::time::Instant::now();
    loop {
        match check_once(component, options, sources).await {
            Ok(file) => return write_ready(&options.dir, &file),
            Err(err) => {
                remove_ready(&options.dir, component.ready_file())?;
                let Some(limit) = options.wait else {
                    return Err(err);
                };
                if started.elapsed() + options.poll > limit {
                    return Err(ValidatorError::CheckTimedOut {
                        component,
                        secs: limit.as_secs(),
                        last: Box::new(err),
                    });
                }
                tracing::info!(%component, "not ready yet: {err}");
                tokio::time::sleep(options.poll).await;
            }
        }
    }
}

/// Waits until the status files of `wanted` all exist in `dir`, polling
/// every `poll`, for at most `timeout`.
pub async fn wait_for_ready(
    dir: &Path,
    wanted: &[ValidationComponent],
    timeout: Duration,
    poll: Duration,
) -> Result<(), ValidatorError> {
    let started = tokio::time::Instant::now();
    loop {
        let missing = missing_ready_files(wanted, &present_files(dir));
        if missing.is_empty() {
            return Ok(());
        }
        if started.elapsed() + poll > timeout {
            return Err(ValidatorError::WaitTimedOut {
                missing: missing.into_iter().map(String::from).collect(),
                dir: dir.to_path_buf(),
                secs: timeout.as_secs(),
            });
        }
        tracing::info!("waiting for {}", missing.join(", "));
        tokio::time::sleep(poll).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_stack_nvml::{SimNodeSpec, SimulatedBackend};

    fn options(dir: &Path) -> ValidatorOptions {
        ValidatorOptions {
            dir: dir.to_path_buf(),
            driver_root: DriverRoot {
                host_path: "/".into(),
            },
            toolkit_evidence: vec![dir.join("toolkit-installed")],
            toolkit_runtime: None,
            cuda_required: "12.0".parse().unwrap(),
            dev_char: None,
            node: None,
            plugin_workload: None,
            wait: None,
            poll: Duration::from_millis(10),
        }
    }

    fn sources(fleet: &'static str) -> Sources {
        Sources {
            gpus: Box::new(move || {
                let f =
                    gpu_stack_core::fleet::Fleet::from_yaml(fleet).map_err(|e| e.to_string())?;
                let spec = SimNodeSpec::from_fleet(&f, Some("n")).map_err(|e| e.to_string())?;
                let b = SimulatedBackend::new(&spec).map_err(|e| e.to_string())?;
                Ok(Arc::new(b) as Arc<dyn GpuBackend>)
            }),
            kube: Err("none in unit tests".into()),
        }
    }

    const TWO_GPUS: &str =
        "nodes:\n  - name: n\n    gpus:\n      - model: H100-SXM5-80GB\n        count: 2\n";
    const NO_GPUS: &str = "nodes:\n  - name: n\n    gpus: []\n";

    #[tokio::test]
    async fn driver_and_cuda_write_files() {
        let dir = tempfile::tempdir().unwrap();
        let o = options(dir.path());
        let s = sources(TWO_GPUS);
        let p = validate(ValidationComponent::Driver, &o, &s).await.unwrap();
        let text = std::fs::read_to_string(p).unwrap();
        assert!(text.contains("GPU_COUNT=2\n"), "{text}");
        validate(ValidationComponent::Cuda, &o, &s).await.unwrap();
        assert_eq!(
            present_files(dir.path()),
            BTreeSet::from(["cuda-ready".to_string(), "driver-ready".to_string()])
        );
    }

    #[tokio::test]
    async fn failure_removes_stale_file_and_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("driver-ready"), "stale").unwrap();
        let err = validate(
            ValidationComponent::Driver,
            &options(dir.path()),
            &sources(NO_GPUS),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(err, ValidatorError::Check(ValidationError::NoGpus)),
            "{err}"
        );
        assert!(present_files(dir.path()).is_empty());
    }

    #[tokio::test]
    async fn plugin_without_node_name_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let err = validate(
            ValidationComponent::Plugin,
            &options(dir.path()),
            &sources(TWO_GPUS),
        )
        .await
        .unwrap_err();
        assert!(err.to_string().contains("NODE_NAME"), "{err}");
    }

    #[tokio::test]
    async fn waiting_check_passes_once_evidence_appears() {
        let dir = tempfile::tempdir().unwrap();
        let mut o = options(dir.path());
        o.wait = Some(Duration::from_secs(30));
        let marker = dir.path().join("toolkit-installed");
        let writer = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            std::fs::create_dir(marker).unwrap();
        });
        validate(ValidationComponent::Toolkit, &o, &sources(TWO_GPUS))
            .await
            .unwrap();
        writer.await.unwrap();
        assert!(dir.path().join("toolkit-ready").exists());
    }

    #[tokio::test]
    async fn waiting_check_times_out_with_the_last_failure() {
        let dir = tempfile::tempdir().unwrap();
        let mut o = options(dir.path());
        o.wait = Some(Duration::from_millis(30));
        let err = validate(ValidationComponent::Toolkit, &o, &sources(TWO_GPUS))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("toolkit not ready") && err.contains("toolkit-installed"),
            "{err}"
        );
    }

    #[test]
    fn status_files_are_the_visible_ready_files() {
        for name in [
            "driver-ready",
            "toolkit-ready",
            "cuda-ready",
            "plugin-ready",
            "mofed-ready",
        ] {
            assert!(is_status_file(name), "{name}");
        }
        for name in [
            ".driver-ctr-ready",
            "-ready",
            "ready",
            ".driver-daemons-status",
            "driver-ready.tmp",
        ] {
            assert!(!is_status_file(name), "{name}");
        }
    }

    #[tokio::test]
    async fn hold_removes_the_status_files_when_stopped() {
        let dir = tempfile::tempdir().unwrap();
        for name in [
            "driver-ready",
            "toolkit-ready",
            "cuda-ready",
            "plugin-ready",
            ".driver-ctr-ready",
            "workload-type",
        ] {
            std::fs::write(dir.path().join(name), "x").unwrap();
        }
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let held = tokio::spawn({
            let dir = dir.path().to_path_buf();
            async move {
                hold(&dir, async {
                    let _ = rx.await;
                })
                .await
            }
        });
        tokio::task::yield_now().await;
        // Nothing is removed while the pod runs.
        assert_eq!(present_files(dir.path()).len(), 6);
        tx.send(()).unwrap();
        let removed = held.await.unwrap().unwrap();
        assert_eq!(
            removed,
            [
                "cuda-ready",
                "driver-ready",
                "plugin-ready",
                "toolkit-ready"
            ]
        );
        assert_eq!(
            present_files(dir.path()),
            BTreeSet::from([".driver-ctr-ready".to_string(), "workload-type".to_string()])
        );
        assert!(
            remove_status_files(&dir.path().join("missing"))
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn write_is_atomic_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("validations");
        let file = ReadyFile {
            name: "toolkit-ready",
            content: "X=1\n".into(),
        };
        write_ready(&sub, &file).unwrap();
        write_ready(&sub, &file).unwrap();
        assert_eq!(
            present_files(&sub),
            BTreeSet::from(["toolkit-ready".to_string()])
        );
        assert!(remove_ready(&sub, "toolkit-ready").unwrap());
        assert!(!remove_ready(&sub, "toolkit-ready").unwrap());
    }

    #[test]
    fn a_failed_write_names_the_status_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        // A non-empty directory where the status file goes: the rename fails.
        let target = dir.path().join("toolkit-ready");
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join("inside"), "x").unwrap();
        let file = ReadyFile {
            name: "toolkit-ready",
            content: "X=1\n".into(),
        };
        let err = write_ready(dir.path(), &file).unwrap_err();
        assert!(
            matches!(&err, ValidatorError::Io { action: "rename into", path, .. } if *path == target),
            "{err}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("cannot rename into") && msg.contains("read-write"),
            "{msg}"
        );
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("toolkit-ready")]);
    }

    #[tokio::test]
    async fn the_cdi_native_toolkit_check_asks_the_running_runtime() {
        use crate::toolkit::fake_runtime::FakeRuntime;
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        std::fs::create_dir_all(r.join("dev")).unwrap();
        std::fs::write(r.join("dev/nvidia0"), "").unwrap();
        std::fs::create_dir_all(r.join("run/cdi")).unwrap();
        std::fs::create_dir_all(r.join("var")).unwrap();
        std::os::unix::fs::symlink("/run", r.join("var/run")).unwrap();
        let spec = serde_json::json!({
            "cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
            "devices": [{"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/dev/nvidia0"}]}}],
        });
        std::fs::write(r.join("run/cdi/nvidia-gpu-stack.json"), spec.to_string()).unwrap();
        let runtime = FakeRuntime::serve(
            &r.join("run/containerd/containerd.sock"),
            crate::toolkit::agent::tests::CDI_OFF,
        );
        let check = RuntimeCheck {
            host_root: r.to_path_buf(),
            cri_socket: "/run/containerd/containerd.sock".into(),
            cdi_spec: "/var/run/cdi/nvidia-gpu-stack.json".into(),
            runtime_handler: Some("nvidia".into()),
        };
        let err = check_runtime(&check).await.unwrap_err().to_string();
        assert!(err.contains("CDI") && err.contains("nvidia"), "{err}");
        runtime.set(crate::toolkit::agent::tests::CDI_ON);
        let ok = check_runtime(&check).await.unwrap();
        assert_eq!(ok.name, "toolkit-ready");
        // A device node the spec names but the host lacks.
        std::fs::remove_file(r.join("dev/nvidia0")).unwrap();
        let err = check_runtime(&check).await.unwrap_err().to_string();
        assert!(err.contains("/dev/nvidia0"), "{err}");
    }
}
