//! GPU feature discovery's loop: compute NVIDIA's GFD node labels from the
//! node's GPUs and publish them — printed on stdout, written as an NFD feature
//! file, and/or patched onto the Node with the kube client — once
//! (`oneshot`) or every `sleepInterval` until stopped.
//!
//! ```ignore
//! let stop = gfd::termination()?;
//! gfd::run(&options, || backend_args.build(), kube_client(None), stop).await?;
//! ```

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpu_stack_core::backend::{BackendError, GpuBackend};
use gpu_stack_core::deviceplugin::{Overrides, Settings};
use gpu_stack_core::gfd::{GfdContext, Labels, feature_file, labels};
use gpu_stack_nvml::fsutil::AtomicWriteError;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use tokio::signal::unix::{SignalKind, signal};

use super::labels::{label_changes, merge_patch};
use super::node::read_node_gpus;
use super::run::{SettingsError, resolve_settings};

/// Log target of the loop's own lines (the binary's name, as before the loop
/// moved into this crate).
const TARGET: &str = "gpu_feature_discovery";

/// How labels are printed on stdout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Print {
    /// A JSON object of label → value.
    Json,
    /// NFD feature-file lines (`key=value`).
    Nfd,
}

/// What GFD was started with (its flags, after clap).
#[derive(Debug, Clone, Default)]
pub struct GfdOptions {
    /// NVIDIA device-plugin/GFD config file (version: v1).
    pub config_file: Option<PathBuf>,
    /// Flag and environment values, which win over the config file
    /// (`oneshot`, `output_file`, `sleep_interval`, ...).
    pub overrides: Overrides,
    /// Print the labels on stdout in this format.
    pub print: Option<Print>,
    /// Patch the labels onto the Node `node_name`.
    pub publish: bool,
    /// The Node to label (needed with `publish`).
    pub node_name: Option<String>,
}

impl GfdOptions {
    /// Whether each run writes the NFD feature file: when an output file was
    /// asked for, or when nothing else would publish the labels.
    pub fn writes_feature_file(&self) -> bool {
        self.overrides.output_file.is_some() || (self.print.is_none() && !self.publish)
    }

    /// The Node to label: `node_name`, required when publishing.
    pub fn publish_target(&self) -> Result<Option<&str>, GfdError> {
        match (&self.node_name, self.publish) {
            (Some(n), _) => Ok(Some(n)),
            (None, true) => Err(GfdError::NoNodeName),
            (None, false) => Ok(None),
        }
    }
}

/// Errors that end [`run`].
#[derive(Debug, thiserror::Error)]
pub enum GfdError {
    /// Settings could not be resolved.
    #[error(transparent)]
    Settings(#[from] SettingsError),
    /// The GPU backend could not be built.
    #[error(transparent)]
    Backend(Box<dyn std::error::Error + Send + Sync + 'static>),
    /// `publish` without a Node name.
    #[error("--publish needs the Node name: pass --node NAME or set NODE_NAME")]
    NoNodeName,
    /// The Kubernetes client could not be built.
    #[error(transparent)]
    Connect(Box<dyn std::error::Error + Send + Sync + 'static>),
    /// The node's GPUs could not be read.
    #[error(transparent)]
    ReadNode(#[from] BackendError),
    /// The task reading the node's GPUs failed.
    #[error(transparent)]
    Join(#[from] tokio::task::JoinError),
    /// The labels could not be rendered as JSON.
    #[error(transparent)]
    Render(#[from] serde_json::Error),
    /// The feature file's directory could not be created.
    #[error("cannot create {}", dir.display())]
    CreateDir {
        /// The directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The feature file could not be written.
    #[error(transparent)]
    Write(#[from] AtomicWriteError),
    /// The Node's labels could not be read.
    #[error("cannot read Node {node}")]
    ReadLabels {
        /// The Node.
        node: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// The Node's labels could not be patched.
    #[error("cannot patch labels of Node {node}")]
    PatchLabels {
        /// The Node.
        node: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

/// Resolves when SIGTERM or SIGINT arrives; the handlers are installed now
/// (needs a Tokio runtime), so a signal during the first run is not lost.
pub fn termination() -> std::io::Result<impl Future<Output = ()> + Send> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

/// Writes `text` to `path` crash-safely, creating the directory.
fn write_file(path: &Path, text: &str) -> Result<(), GfdError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|source| GfdError::CreateDir {
        dir: dir.to_path_buf(),
        source,
    })?;
    gpu_stack_nvml::fsutil::write_atomic(path, text.as_bytes())?;
    Ok(())
}

/// The node's labels now (machine type from the settings' file, timestamp
/// unless `noTimestamp`).
pub async fn compute(
    backend: &Arc<dyn GpuBackend>,
    settings: &Settings,
) -> Result<Labels, GfdError> {
    let b = backend.clone();
    let node = tokio::task::spawn_blocking(move || read_node_gpus(b.as_ref(), None)).await??;
    let machine_type = std::fs::read_to_string(&settings.gfd_machine_type_file)
        .ok()
        .map(|s| s.trim().to_string());
    let timestamp = (!settings.gfd_no_timestamp)
        .then(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .ok()
                .map(|d| d.as_secs())
        })
        .flatten();
    Ok(labels(
        &node,
        settings,
        &GfdContext {
            machine_type,
            timestamp,
        },
    ))
}

/// Brings the Node's GFD-owned labels to `desired` with one metadata merge
/// patch (none when nothing changed); labels GFD does not own are untouched.
/// Reads and writes only the Node's metadata, not its (large) status.
/// Returns how many labels changed.
pub async fn publish_labels(
    client: &kube::Client,
    node_name: &str,
    desired: &Labels,
) -> Result<usize, GfdError> {
    let nodes: Api<Node> = Api::all(client.clone());
    let node = nodes
        .get_metadata(node_name)
        .await
        .map_err(|source| GfdError::ReadLabels {
            node: node_name.to_string(),
            source,
        })?;
    let current: BTreeMap<String, String> = node.metadata.labels.unwrap_or_default();
    let changes = label_changes(&current, desired);
    if !changes.is_empty() {
        nodes
            .patch_metadata(
                node_name,
                &PatchParams::default(),
                &Patch::Merge(merge_patch(&changes)),
            )
            .await
            .map_err(|source| GfdError::PatchLabels {
                node: node_name.to_string(),
                source,
            })?;
    }
    Ok(changes.len())
}

/// Runs GFD: resolves the settings, builds the backend with
/// `backend_factory`, awaits `connect` for the client when publishing (it is
/// not polled otherwise), then labels once with `oneshot` or every
/// `sleepInterval` until `stop` resolves. Labels printed with `print` go to
/// stdout.
pub async fn run<F, E, C, CE>(
    options: &GfdOptions,
    backend_factory: F,
    connect: C,
    stop: impl Future<Output = ()>,
) -> Result<(), GfdError>
where
    F: FnOnce() -> Result<Arc<dyn GpuBackend>, E>,
    E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    C: Future<Output = Result<kube::Client, CE>>,
    CE: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
{
    let settings = resolve_settings(options.config_file.as_deref(), &options.overrides)?;
    for n in &settings.notices {
        tracing::warn!(target: TARGET, "{n}");
    }
    let backend = backend_factory().map_err(|e| GfdError::Backend(e.into()))?;
    let node_name = options.publish_target()?;
    let client = match node_name {
        Some(_) if options.publish => Some(connect.await.map_err(|e| GfdError::Connect(e.into()))?),
        _ => None,
    };
    tokio::pin!(stop);
    loop {
        let labels = compute(&backend, &settings).await?;
        match options.print {
            Some(Print::Json) => println!("{}", serde_json::to_string_pretty(&labels)?),
            Some(Print::Nfd) => print!("{}", feature_file(&labels)),
            None => {}
        }
        if options.writes_feature_file() {
            let path = PathBuf::from(&settings.gfd_output_file);
            write_file(&path, &feature_file(&labels))?;
            tracing::info!(target: TARGET, path = %path.display(), labels = labels.len(), "feature file written");
        }
        if let (Some(c), Some(n)) = (&client, node_name) {
            let changed = publish_labels(c, n, &labels).await?;
            tracing::info!(target: TARGET, node = %n, changed, "node labels published");
        }
        if settings.gfd_oneshot {
            return Ok(());
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(settings.gfd_sleep_interval_secs)) => {}
            _ = &mut stop => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_stack_nvml::{SimNodeSpec, SimulatedBackend};

    fn backend() -> Result<Arc<dyn GpuBackend>, Box<dyn std::error::Error + Send + Sync>> {
        Ok(Arc::new(SimulatedBackend::new(&SimNodeSpec::uniform(
            "n0",
            "0x233010DE",
            2,
        ))?))
    }

    /// A connect future that must not be awaited.
    async fn no_client() -> Result<kube::Client, &'static str> {
        Err("no cluster in unit tests")
    }

    #[test]
    fn the_feature_file_is_written_when_asked_or_nothing_else_publishes() {
        let mut o = GfdOptions::default();
        assert!(o.writes_feature_file());
        o.print = Some(Print::Json);
        assert!(!o.writes_feature_file());
        o.overrides.output_file = Some("/tmp/x".into());
        assert!(o.writes_feature_file());
        let o = GfdOptions {
            publish: true,
            node_name: Some("n0".into()),
            ..GfdOptions::default()
        };
        assert!(!o.writes_feature_file());
    }

    #[test]
    fn publishing_needs_a_node_name() {
        let mut o = GfdOptions::default();
        assert_eq!(o.publish_target().unwrap(), None);
        o.publish = true;
        let err = o.publish_target().unwrap_err();
        assert!(err.to_string().contains("--node"), "{err}");
        o.node_name = Some("n0".into());
        assert_eq!(o.publish_target().unwrap(), Some("n0"));
    }

    #[tokio::test]
    async fn oneshot_writes_the_feature_file_of_the_computed_labels() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("features.d").join("gfd");
        let options = GfdOptions {
            overrides: Overrides {
                oneshot: Some(true),
                no_timestamp: Some(true),
                output_file: Some(file.display().to_string()),
                ..Overrides::default()
            },
            ..GfdOptions::default()
        };
        run(&options, backend, no_client(), std::future::pending())
            .await
            .unwrap();
        let settings = resolve_settings(None, &options.overrides).unwrap();
        let expected = compute(&backend().unwrap(), &settings).await.unwrap();
        assert_eq!(
            std::fs::read_to_string(&file).unwrap(),
            feature_file(&expected)
        );
        assert!(
            expected.contains_key("nvidia.com/gpu.count"),
            "{expected:?}"
        );
    }

    #[tokio::test]
    async fn publish_without_a_node_fails_before_connecting() {
        let options = GfdOptions {
            publish: true,
            ..GfdOptions::default()
        };
        let err = run(&options, backend, no_client(), std::future::pending())
            .await
            .unwrap_err();
        assert!(matches!(err, GfdError::NoNodeName), "{err:?}");
    }

    #[tokio::test]
    async fn a_backend_error_keeps_its_message() {
        let err = run(
            &GfdOptions::default(),
            || Err::<Arc<dyn GpuBackend>, _>("no driver"),
            no_client(),
            std::future::pending(),
        )
        .await
        .unwrap_err();
        assert_eq!(err.to_string(), "no driver");
    }
}
