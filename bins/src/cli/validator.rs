//! `gpu-stack validator`: the per-node checks behind the operator's
//! `*-validation` init containers. Each check writes its status file
//! (`driver-ready`, `toolkit-ready`, `cuda-ready`, `plugin-ready`) under the
//! validations directory when it passes; a failed check writes nothing,
//! removes a stale file and exits 1. Takes `COMPONENT`, `WITH_WAIT` and
//! `NODE_NAME` from the environment as the rendered DaemonSets set them.
//!
//! Two modes check nothing, so they need no GPU, no Kubernetes client and no
//! privileges (a read-only mount of the directory is enough for the first):
//! `--wait-only` waits for status files (the operands' wait gates, and the
//! validator pod's readiness probe with `--timeout 0`), and `--hold` is the
//! validator pod's main container: it logs that all validations passed,
//! sleeps until SIGTERM or SIGINT, then removes the `*-ready` files and exits 0.
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use gpu_stack_core::operator::components::VALIDATIONS_DIR;
use gpu_stack_core::operator::validation::{
    CudaVersion, DEFAULT_REQUIRED_CUDA, DriverRoot, ValidationComponent, check_workload_devices,
    parse_components,
};
use gpu_stack_k8s::validator::devchar::DevCharPaths;
use gpu_stack_k8s::validator::workload::PluginWorkload;
use gpu_stack_k8s::validator::{
    DEFAULT_TOOLKIT_EVIDENCE, RuntimeCheck, Sources, ValidatorError, ValidatorOptions, hold,
    validate, wait_for_ready,
};

use crate::agent::{kube_client, shutdown_signal};
use crate::backend_flags::BackendArgs;

/// Flags of `gpu-stack validator`.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    #[command(flatten)]
    backend: BackendArgs,
    /// What to check: driver, toolkit, cuda, plugin, or all (in that order).
    #[arg(
        long,
        env = "COMPONENT",
        value_name = "NAME",
        required_unless_present_any = ["hold", "workload_devices"]
    )]
    component: Option<String>,
    /// Check nothing else: this process is the plugin check's workload pod;
    /// it passes when its /dev holds exactly one GPU device node and
    /// nvidiactl, and writes its verdict to the termination message.
    #[arg(long, conflicts_with_all = ["hold", "wait", "wait_only", "component"])]
    workload_devices: bool,
    /// The plugin check also runs a workload pod of this image (the
    /// validator's own) asking for one GPU on this node, without a
    /// RuntimeClass, and passes only if the pod sees exactly that GPU.
    #[arg(long, value_name = "IMAGE", requires = "plugin_workload_namespace")]
    plugin_workload_image: Option<String>,
    /// Namespace of the workload pod (the validator's).
    #[arg(long, value_name = "NS", requires = "plugin_workload_image")]
    plugin_workload_namespace: Option<String>,
    /// Pull secret of the workload pod's image (repeat for more).
    #[arg(long, value_name = "NAME")]
    plugin_workload_pull_secret: Vec<String>,
    /// Seconds the workload pod may take to give its verdict.
    #[arg(long, value_name = "SECS", default_value_t = 120)]
    plugin_workload_timeout: u64,
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
    /// Check nothing: log that all validations are successful, sleep until
    /// SIGTERM or SIGINT, then remove every `*-ready` file and exit 0 (the
    /// validator pod's main container).
    #[arg(long, conflicts_with_all = ["wait", "wait_only"])]
    hold: bool,
    /// Give up waiting after this many seconds; `0` checks once, `never`
    /// waits as long as it takes.
    #[arg(long, value_name = "SECS|never", default_value = "600")]
    timeout: Timeout,
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
    /// With gpu-stack's toolkit agent: the runtime's CRI socket (host path).
    /// The toolkit check then asks the running runtime whether it reads the
    /// CDI spec's directory, instead of looking for paths.
    #[arg(long, value_name = "FILE", requires = "toolkit_cdi_spec")]
    toolkit_cri_socket: Option<String>,
    /// With gpu-stack's toolkit agent: the host CDI spec it writes (host path).
    #[arg(long, value_name = "FILE", requires = "toolkit_cri_socket")]
    toolkit_cdi_spec: Option<String>,
    /// The runtime handler the toolkit check requires (the operands' RuntimeClass).
    #[arg(long, value_name = "NAME")]
    toolkit_runtime_class: Option<String>,
    /// Where the host's root is seen, for the toolkit agent's host paths.
    #[arg(long, value_name = "DIR", default_value = "/")]
    host_root: PathBuf,
    /// CUDA driver API version the cuda check requires (`major.minor`).
    #[arg(long, value_name = "VERSION", default_value_t = DEFAULT_REQUIRED_CUDA)]
    cuda_version: CudaVersion,
    /// The host's /dev/char as mounted: the driver check links NVIDIA's
    /// device nodes there (`<major>:<minor>` -> `../nvidia0`), as runc with
    /// the systemd cgroup driver needs. Left alone when the directory does
    /// not exist.
    #[arg(long, value_name = "DIR")]
    dev_char_dir: Option<PathBuf>,
    /// Kubeconfig for the plugin check (default: in-cluster or $KUBECONFIG).
    #[arg(long, value_name = "FILE")]
    kubeconfig: Option<PathBuf>,
}

/// How long to wait: `--timeout SECS` or `--timeout never`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeout(Option<Duration>);

impl Timeout {
    /// The limit; `never` is a limit no wait reaches.
    fn limit(self) -> Duration {
        self.0.unwrap_or(Duration::MAX)
    }
}

impl std::str::FromStr for Timeout {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "never" {
            return Ok(Timeout(None));
        }
        s.parse::<u64>()
            .map(|secs| Timeout(Some(Duration::from_secs(secs))))
            .map_err(|_| format!("{s:?} is neither a number of seconds nor `never`"))
    }
}

/// The validator as the node agent hosts it: `validator [FLAGS]`, the flags
/// of `gpu-stack validator` (checks only: the agent holds and waits itself).
#[derive(clap::Parser, Debug)]
#[command(name = "validator")]
pub struct HostedArgs {
    #[command(flatten)]
    pub args: Args,
}

/// What a check run needs: the checks in order, their options and sources.
pub struct Checks {
    /// The components to check, in order.
    pub components: Vec<ValidationComponent>,
    /// Directory, driver root, toolkit evidence, wait and poll.
    pub options: ValidatorOptions,
    /// The GPUs and, for the plugin check, the API.
    pub sources: Sources,
}

impl Checks {
    /// Runs every check in order, writing each status file as it passes
    /// and telling `passed` its path; stops at the first that fails.
    pub async fn run(
        &self,
        mut passed: impl FnMut(ValidationComponent, &std::path::Path),
    ) -> Result<(), ValidatorError> {
        for c in &self.components {
            let path = validate(*c, &self.options, &self.sources).await?;
            passed(*c, &path);
        }
        Ok(())
    }
}

/// The checks `args` asks for (`--component`, with `--wait`'s timeout).
pub async fn checks(args: Args) -> Result<Checks> {
    // clap requires --component unless --hold.
    let components = parse_components(args.component.as_deref().unwrap_or_default())?;
    let poll = Duration::from_millis(args.poll_interval_ms.max(1));
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
        toolkit_runtime: match (args.toolkit_cri_socket, args.toolkit_cdi_spec) {
            (Some(cri_socket), Some(cdi_spec)) => Some(RuntimeCheck {
                host_root: args.host_root,
                cri_socket,
                cdi_spec,
                runtime_handler: args.toolkit_runtime_class,
            }),
            _ => None,
        },
        cuda_required: args.cuda_version,
        dev_char: args.dev_char_dir.map(|dir| DevCharPaths {
            dev: PathBuf::from("/dev"),
            dir,
        }),
        node: args.backend.node.clone(),
        plugin_workload: match (args.plugin_workload_image, args.plugin_workload_namespace) {
            (Some(image), Some(namespace)) => Some(PluginWorkload {
                image,
                namespace,
                pull_secrets: args.plugin_workload_pull_secret,
                timeout: Duration::from_secs(args.plugin_workload_timeout.max(1)),
            }),
            _ => None,
        },
        wait: args.wait.then_some(args.timeout.limit()),
        poll,
    };
    Ok(Checks {
        components,
        options,
        sources,
    })
}

impl Args {
    /// Whether these flags ask for checks (not `--hold` or `--wait-only`).
    pub fn checks_something(&self) -> bool {
        !self.hold && !self.wait_only
    }

    /// The same flags checking `components` (a `--component` value) instead.
    pub fn checking(&self, components: &str) -> Args {
        Args {
            component: Some(components.to_string()),
            ..self.clone()
        }
    }

    /// The directory of the status files.
    pub fn validations_dir(&self) -> &std::path::Path {
        &self.validations_dir
    }
}

/// Runs the checks; exit 0 when all pass, 1 when one fails (nothing written for it).
pub fn run(args: Args) -> Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    if args.workload_devices {
        return Ok(workload_devices(
            std::path::Path::new("/dev"),
            std::path::Path::new(TERMINATION_LOG),
        ));
    }
    if args.hold {
        return rt.block_on(async move {
            println!("all validations are successful");
            let removed = hold(&args.validations_dir, shutdown_signal()).await?;
            println!("stopped; removed {}", list_or_none(&removed));
            Ok(ExitCode::SUCCESS)
        });
    }
    rt.block_on(async move {
        if args.wait_only {
            let components = parse_components(args.component.as_deref().unwrap_or_default())?;
            let poll = Duration::from_millis(args.poll_interval_ms.max(1));
            return Ok(
                match wait_for_ready(
                    &args.validations_dir,
                    &components,
                    args.timeout.limit(),
                    poll,
                )
                .await
                {
                    Ok(()) => {
                        println!("ready: {}", names(&components));
                        ExitCode::SUCCESS
                    }
                    Err(err) => fail(&err),
                },
            );
        }
        let checks = checks(args).await?;
        let outcome = checks
            .run(|c, path| println!("{c} ready: wrote {}", path.display()))
            .await;
        Ok(match outcome {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => fail(&err),
        })
    })
}

/// Where the kubelet reads a container's termination message.
const TERMINATION_LOG: &str = "/dev/termination-log";

/// The workload pod's check of its own `dev` directory: the verdict goes to
/// stdout or stderr and to `termination_log` (where the validator reads it).
fn workload_devices(dev: &std::path::Path, termination_log: &std::path::Path) -> ExitCode {
    // A device directory holds a few hundred entries; bounded regardless.
    let entries: Vec<String> = match std::fs::read_dir(dev) {
        Ok(dir) => dir
            .flatten()
            .take(4096)
            .filter_map(|e| e.file_name().into_string().ok())
            .collect(),
        Err(e) => {
            let why = format!(
                "plugin not ready: the workload pod cannot list {}: {e}",
                dev.display()
            );
            eprintln!("error: {why}");
            let _ = std::fs::write(termination_log, &why);
            return ExitCode::from(1);
        }
    };
    let (message, code) = match check_workload_devices(&entries) {
        Ok(gpu) => {
            println!("sees exactly /dev/{gpu} and /dev/nvidiactl");
            (gpu, ExitCode::SUCCESS)
        }
        Err(err) => {
            eprintln!("error: {err}");
            (err.to_string(), ExitCode::from(1))
        }
    };
    // Best effort: without the file the kubelet falls back to the log on failure.
    let _ = std::fs::write(termination_log, message);
    code
}

fn list_or_none(names: &[String]) -> String {
    if names.is_empty() {
        "no status file".into()
    } else {
        names.join(", ")
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn dev_with(names: &[&str]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for n in names {
            std::fs::write(dir.path().join(n), b"").unwrap();
        }
        dir
    }

    #[test]
    fn the_workload_pod_reports_its_verdict_in_the_termination_message() {
        let out = tempfile::tempdir().unwrap();
        let log = out.path().join("termination-log");
        let dev = dev_with(&["null", "nvidia1", "nvidiactl", "nvidia-uvm"]);
        assert_eq!(workload_devices(dev.path(), &log), ExitCode::SUCCESS);
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "nvidia1");

        let dev = dev_with(&["null", "zero"]);
        assert_eq!(workload_devices(dev.path(), &log), ExitCode::from(1));
        let why = std::fs::read_to_string(&log).unwrap();
        assert!(why.contains("0 GPU device node(s)"), "{why}");

        let missing = out.path().join("no-such-dev");
        assert_eq!(workload_devices(&missing, &log), ExitCode::from(1));
        assert!(
            std::fs::read_to_string(&log)
                .unwrap()
                .contains("cannot list")
        );
    }
}
