//! `gpu-feature-discovery`: computes NVIDIA's GFD node labels from the node's
//! GPUs and publishes them: printed (`-o json`), as an NFD feature file
//! (`--output-file`), and/or patched onto the Node (`--publish`).
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use gpu_stack_bins::agent::kube_client;
use gpu_stack_bins::backend_flags::BackendArgs;
use gpu_stack_core::backend::GpuBackend;
use gpu_stack_core::deviceplugin::{ConfigFile, Overrides, Settings};
use gpu_stack_core::gfd::{GfdContext, Labels, feature_file, labels};
use gpu_stack_k8s::deviceplugin::labels::{label_changes, merge_patch};
use gpu_stack_k8s::deviceplugin::node::read_node_gpus;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use tokio::signal::unix::{SignalKind, signal};

/// How labels are printed on stdout.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    /// A JSON object of label → value.
    Json,
    /// NFD feature-file lines (`key=value`).
    Nfd,
}

#[derive(Parser, Debug)]
#[command(
    name = "gpu-feature-discovery",
    version,
    about = "Labels Kubernetes nodes with NVIDIA GPU features"
)]
struct Cli {
    #[command(flatten)]
    backend: BackendArgs,
    /// NVIDIA device-plugin/GFD config file (version: v1).
    #[arg(long, env = "CONFIG_FILE")]
    config_file: Option<PathBuf>,
    /// MIG strategy: none, single or mixed.
    #[arg(long, env = "MIG_STRATEGY")]
    mig_strategy: Option<String>,
    /// Label once and exit.
    #[arg(long, env = "GFD_ONESHOT", num_args = 0..=1, default_missing_value = "true")]
    oneshot: Option<bool>,
    /// Leave out nvidia.com/gfd.timestamp.
    #[arg(long, env = "GFD_NO_TIMESTAMP", num_args = 0..=1, default_missing_value = "true")]
    no_timestamp: Option<bool>,
    /// Time between labelling runs, e.g. 60s.
    #[arg(long, env = "GFD_SLEEP_INTERVAL")]
    sleep_interval: Option<String>,
    /// Print labels on stdout in this format.
    #[arg(short = 'o', long = "output", value_enum)]
    output: Option<Format>,
    /// Write an NFD feature file here (e.g. /etc/kubernetes/node-feature-discovery/features.d/gfd).
    #[arg(long, env = "GFD_OUTPUT_FILE")]
    output_file: Option<PathBuf>,
    /// File holding the machine type.
    #[arg(long, env = "GFD_MACHINE_TYPE_FILE")]
    machine_type_file: Option<String>,
    /// Patch the labels onto this Node (the --node name) with the in-cluster or kubeconfig client.
    #[arg(long)]
    publish: bool,
    /// Kubeconfig for --publish (default: in-cluster, then $KUBECONFIG, then ~/.kube/config).
    #[arg(long, value_name = "FILE", requires = "publish")]
    kubeconfig: Option<PathBuf>,
}

fn settings(cli: &Cli) -> Result<Settings> {
    let file = match &cli.config_file {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read config file {}", p.display()))?;
            Some(ConfigFile::parse(&p.display().to_string(), &text)?)
        }
        None => None,
    };
    let ov = Overrides {
        mig_strategy: cli.mig_strategy.clone(),
        oneshot: cli.oneshot,
        no_timestamp: cli.no_timestamp,
        sleep_interval: cli.sleep_interval.clone(),
        output_file: cli.output_file.as_ref().map(|p| p.display().to_string()),
        machine_type_file: cli.machine_type_file.clone(),
        ..Overrides::default()
    };
    let s = Settings::resolve(file.as_ref(), &ov)?;
    for n in &s.notices {
        tracing::warn!("{n}");
    }
    Ok(s)
}

fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    gpu_stack_nvml::fsutil::write_atomic(path, text.as_bytes())?;
    Ok(())
}

async fn compute(backend: &Arc<dyn GpuBackend>, settings: &Settings) -> Result<Labels> {
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
async fn publish(client: &kube::Client, node_name: &str, desired: &Labels) -> Result<usize> {
    let nodes: Api<Node> = Api::all(client.clone());
    let node = nodes
        .get_metadata(node_name)
        .await
        .with_context(|| format!("cannot read Node {node_name}"))?;
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
            .with_context(|| format!("cannot patch labels of Node {node_name}"))?;
    }
    Ok(changes.len())
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let cli = Cli::parse();
    let settings = settings(&cli)?;
    let backend = cli.backend.build()?;
    let node_name = match (&cli.backend.node, cli.publish) {
        (Some(n), _) => Some(n.clone()),
        (None, true) => {
            anyhow::bail!("--publish needs the Node name: pass --node NAME or set NODE_NAME")
        }
        (None, false) => None,
    };
    let client = match node_name {
        Some(_) if cli.publish => Some(kube_client(cli.kubeconfig.as_deref()).await?),
        _ => None,
    };
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    loop {
        let labels = compute(&backend, &settings).await?;
        match cli.output {
            Some(Format::Json) => println!("{}", serde_json::to_string_pretty(&labels)?),
            Some(Format::Nfd) => print!("{}", feature_file(&labels)),
            None => {}
        }
        if cli.output_file.is_some() || (cli.output.is_none() && !cli.publish) {
            let path = PathBuf::from(&settings.gfd_output_file);
            write_atomic(&path, &feature_file(&labels))?;
            tracing::info!(path = %path.display(), labels = labels.len(), "feature file written");
        }
        if let (Some(c), Some(n)) = (&client, &node_name) {
            let changed = publish(c, n, &labels).await?;
            tracing::info!(node = %n, changed, "node labels published");
        }
        if settings.gfd_oneshot {
            return Ok(());
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(settings.gfd_sleep_interval_secs)) => {}
            _ = term.recv() => return Ok(()),
            _ = int.recv() => return Ok(()),
        }
    }
}
