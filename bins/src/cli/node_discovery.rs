//! `gpu-stack node-discovery`: writes the NFD labels the operator reads
//! (PCI, OS release, kernel) on this node where node feature discovery is not
//! installed, and stays out of the way on nodes NFD manages. Thin: flags, then
//! `gpu_stack_k8s::nodediscovery::{run, run_once}` on a one-thread runtime.
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use gpu_stack_core::deviceplugin::config::parse_interval_secs;
use gpu_stack_k8s::nodediscovery::{self as discovery, DiscoveryOptions, HostPaths, KernelRelease};

use crate::agent::{LogFormat, init_logging, kube_client, shutdown_signal};

/// Flags of `gpu-stack node-discovery`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// This node's name (the only Node read and labelled).
    #[arg(long, value_name = "NAME", env = "NODE_NAME")]
    node_name: String,
    /// sysfs root; PCI devices are read from `<root>/bus/pci/devices/*/{vendor,class,device}`.
    #[arg(long, value_name = "DIR", default_value = "/sys")]
    sysfs_root: PathBuf,
    /// The host's os-release file (in the chart: the host's file mounted at /host-etc/os-release).
    #[arg(long, value_name = "FILE", default_value = "/etc/os-release")]
    os_release: PathBuf,
    /// Kernel release to label; default: read /proc/sys/kernel/osrelease.
    #[arg(long, value_name = "RELEASE")]
    kernel_release: Option<String>,
    /// How often the host files are read again (`30s`, `5m`, `1h`).
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = parse_interval)]
    rescan_interval: Duration,
    /// Compute and patch once, print the outcome as JSON, and exit.
    #[arg(long)]
    once: bool,
    /// Kubeconfig; default: in-cluster, then $KUBECONFIG, then ~/.kube/config.
    #[arg(long, value_name = "FILE")]
    kubeconfig: Option<PathBuf>,
    /// Log line format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

fn parse_interval(v: &str) -> Result<Duration, String> {
    parse_interval_secs(v)
        .map(Duration::from_secs)
        .map_err(|_| format!("{v:?} is not a duration such as 30s, 5m or 1h"))
}

/// Runs until SIGTERM or SIGINT (or one pass with `--once`).
pub fn run(args: Args) -> Result<ExitCode> {
    init_logging(args.log_format);
    let kernel = match args.kernel_release {
        Some(release) => KernelRelease::Fixed(release),
        None => KernelRelease::File(PathBuf::from("/proc/sys/kernel/osrelease")),
    };
    let options = DiscoveryOptions {
        paths: HostPaths {
            sysfs_root: args.sysfs_root,
            os_release: args.os_release,
            kernel,
        },
        rescan_interval: args.rescan_interval,
        ..DiscoveryOptions::new(args.node_name)
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    // Fail early, before touching the cluster, on a path that cannot be read.
    discovery::scan(&options.paths)?;
    rt.block_on(async move {
        let client = kube_client(args.kubeconfig.as_deref()).await?;
        if args.once {
            let outcome = discovery::run_once(client, &options).await?;
            println!("{}", serde_json::to_string(&outcome)?);
        } else {
            discovery::run(client, options, shutdown_signal()).await?;
        }
        Ok(ExitCode::SUCCESS)
    })
}
