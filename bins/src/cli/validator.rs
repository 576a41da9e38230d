//! `gpu-stack validator`: the per-node checks behind the operator's
//! `*-validation` init containers. Each check writes its status file
//! (`driver-ready`, `toolkit-ready`, `cuda-ready`, `plugin-ready`) under the
//! validations directory when it passes; a failed check writes nothing,
//! removes a stale file and exits 1. Takes `COMPONENT`, `WITH_WAIT` and
//! `NODE_NAME` from the environment as the rendered DaemonSets set them.
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use gpu_stack_core::operator::components::VALIDATIONS_DIR;
use gpu_stack_core::operator::validation::{
    CudaVersion, DEFAULT_REQUIRED_CUDA, DriverRoot, ValidationComponent, parse_components,
};
use gpu_stack_k8s::validator::{
    DEFAULT_TOOLKIT_EVIDENCE, Sources, ValidatorError, ValidatorOptions, validate, wait_for_ready,
};

use crate::agent::kube_client;
use crate::backend_flags::BackendArgs;

/// Flags of `gpu-stack validator`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    backend: BackendArgs,
    /// What to check: driver, toolkit, cuda, plugin, or all (in that order).
    #[arg(long, env = "COMPONENT", value_name = "NAME")]
    component: String,
    /// Directory of the status files.
    #[arg(long, value_name = "DIR", default_value = VALIDATIONS_DIR)]
    validations_dir: PathBuf,
    /// Retry a failed check until it passes or --timeout runs out (what the
    /// `*-validation` init containers do).
    #[arg(long, env = "WITH_WAIT")]
    wait: bool,
    /// Check nothing: wait until the components' status files exist (for
    /// pods that only need another pod's checks to have passed).
    #[arg(long, conflicts_with = "wait")]
    wait_only: bool,
    /// Give up waiting after this many seconds.
    #[arg(long, value_name = "SECS", default_value_t = 600)]
    timeout: u64,
    /// Pause between retries, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 5000)]
    poll_interval_ms: u64,
    /// Driver root on the host: `/` for a host driver, `/run/nvidia/driver` for the driver container.
    #[arg(
        long,
        value_name = "PATH",
        env = "NVIDIA_DRIVER_ROOT",
        default_value = "/"
    )]
    driver_root: String,
    /// A path whose existence shows the container toolkit is installed
    /// (repeatable; default: CDI specs, the containerd drop-in, /usr/local/nvidia/toolkit).
    #[arg(long, value_name = "PATH")]
    toolkit_evidence: Vec<PathBuf>,
    /// CUDA driver API version the cuda check requires (`major.minor`).
    #[arg(long, value_name = "VERSION", default_value_t = DEFAULT_REQUIRED_CUDA)]
    cuda_version: CudaVersion,
    /// Kubeconfig for the plugin check (default: in-cluster or $KUBECONFIG).
    #[arg(long, value_name = "FILE")]
    kubeconfig: Option<PathBuf>,
}

/// Runs the checks; exit 0 when all pass, 1 when one fails (nothing written for it).
pub fn run(args: Args) -> Result<ExitCode> {
    let components = parse_components(&args.component)?;
    let poll = Duration::from_millis(args.poll_interval_ms.max(1));
    let timeout = Duration::from_secs(args.timeout);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        if args.wait_only {
            return Ok(
                match wait_for_ready(&args.validations_dir, &components, timeout, poll).await {
                    Ok(()) => {
                        println!("ready: {}", names(&components));
                        ExitCode::SUCCESS
                    }
                    Err(err) => fail(&err),
                },
            );
        }
        let sources = Sources {
            gpus: gpu_source(args.backend.clone()),
            kube: if components.contains(&ValidationComponent::Plugin) {
                kube_client(args.kubeconfig.as_deref())
                    .await
                    .map_err(|e| format!("{e:#}"))
            } else {
                Err("not needed".into())
            },
        };
        let toolkit_evidence = if args.toolkit_evidence.is_empty() {
            DEFAULT_TOOLKIT_EVIDENCE.iter().map(PathBuf::from).collect()
        } else {
            args.toolkit_evidence
        };
        let options = ValidatorOptions {
            dir: args.validations_dir,
            driver_root: DriverRoot {
                host_path: args.driver_root,
            },
            toolkit_evidence,
            cuda_required: args.cuda_version,
            node: args.backend.node.clone(),
            wait: args.wait.then_some(timeout),
            poll,
        };
        for c in components {
            match validate(c, &options, &sources).await {
                Ok(path) => println!("{c} ready: wrote {}", path.display()),
                Err(err) => return Ok(fail(&err)),
            }
        }
        Ok(ExitCode::SUCCESS)
    })
}

fn names(components: &[ValidationComponent]) -> String {
    components
        .iter()
        .map(|c| c.ready_file())
        .collect::<Vec<_>>()
        .join(", ")
}

fn fail(err: &ValidatorError) -> ExitCode {
    eprintln!("error: {err}");
    ExitCode::from(1)
}

fn gpu_source(
    backend: BackendArgs,
) -> Box<dyn Fn() -> Result<Arc<dyn gpu_stack_core::backend::GpuBackend>, String> + Send + Sync> {
    Box::new(move || backend.build().map_err(|e| format!("{e:#}")))
}
