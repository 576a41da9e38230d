//! `gpu-feature-discovery`: computes NVIDIA's GFD node labels from the node's
//! GPUs and publishes them: printed (`-o json`), as an NFD feature file
//! (`--output-file`), and/or patched onto the Node (`--publish`).
//!
//! Flags and logging; the process is `gpu_stack_k8s::deviceplugin::gfd::run`.
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::Parser;
use gpu_stack_core::deviceplugin::Overrides;
use gpu_stack_k8s::deviceplugin::gfd::{self, GfdOptions, Print};

use crate::agent::{LogFormat, init_logging, kube_client, run_main};
use crate::backend_flags::BackendArgs;

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
pub struct Args {
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

impl Args {
    /// What [`gfd::run`] is to do.
    pub fn options(&self) -> GfdOptions {
        GfdOptions {
            config_file: self.config_file.clone(),
            overrides: Overrides {
                mig_strategy: self.mig_strategy.clone(),
                oneshot: self.oneshot,
                no_timestamp: self.no_timestamp,
                sleep_interval: self.sleep_interval.clone(),
                output_file: self.output_file.as_ref().map(|p| p.display().to_string()),
                machine_type_file: self.machine_type_file.clone(),
                ..Overrides::default()
            },
            print: self.output.map(|f| match f {
                Format::Json => Print::Json,
                Format::Nfd => Print::Nfd,
            }),
            publish: self.publish,
            node_name: self.backend.node.clone(),
        }
    }
}

/// The process: logging, then [`label`] on the agents' runtime.
pub fn main(args: Args) -> ExitCode {
    init_logging(LogFormat::Text);
    run_main(label(args))
}

/// Labels once (`--oneshot`) or until SIGTERM.
pub async fn label(args: Args) -> Result<()> {
    label_until(args, gfd::termination()?).await
}

/// Labels once (`--oneshot`) or until `stop` resolves.
pub async fn label_until(args: Args, stop: impl Future<Output = ()>) -> Result<()> {
    let connect = kube_client(args.kubeconfig.as_deref());
    gfd::run(&args.options(), || args.backend.build(), connect, stop).await?;
    Ok(())
}
