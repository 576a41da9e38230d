//! `gpu-stack toolkit`: the container toolkit agent without a runtime shim.
//! Writes the host's CDI spec for the installed driver, makes containerd (or
//! CRI-O) read CDI specs through a drop-in, restarts the runtime only when its
//! effective configuration changes, and undoes it all when the component is
//! removed from the node (or with `--remove`). `--dry-run` prints the diff and
//! changes nothing. The operator runs it as the toolkit DaemonSet when the
//! ClusterPolicy's toolkit image is the gpu-stack image.
//!
//! Flags take NVIDIA's toolkit variables (`RUNTIME`, `CONTAINERD_CONFIG`,
//! `CONTAINERD_SOCKET`, `RUNTIME_DROP_IN_CONFIG`, `CONTAINERD_RUNTIME_CLASS`,
//! `CONTAINERD_RESTART_MODE`, `NVIDIA_DRIVER_ROOT`), so a policy's
//! `toolkit.env` works unchanged.
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use gpu_stack_core::cdi::node_spec;
use gpu_stack_core::toolkit::RuntimeOptions;
use gpu_stack_k8s::deviceplugin::cdi::{DEFAULT_CDI_DIR, discover_host_files, write_spec};
use gpu_stack_k8s::deviceplugin::node::{MIG_MINORS_PATH, read_node_gpus};
use gpu_stack_k8s::toolkit::{
    PodIdentity, RemovalWatch, RestartMode, RuntimeKind, ToolkitConfig, component_removed,
    host_path, run as run_agent,
};

use crate::agent::{LogFormat, init_logging, kube_client, run_main, shutdown_signal};
use crate::backend_flags::BackendArgs;

/// The runtime to configure.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum Runtime {
    /// containerd 1.7 (config version 2) or 2.x (version 3).
    Containerd,
    /// CRI-O (drop-in under /etc/crio/crio.conf.d).
    Crio,
}

/// Flags of `gpu-stack toolkit`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The container runtime to configure.
    #[arg(long, value_enum, env = "RUNTIME", default_value_t = Runtime::Containerd)]
    runtime: Runtime,
    /// Where the host's root file system is seen (the DaemonSet mounts it at /host).
    #[arg(long, value_name = "DIR", default_value = "/")]
    host_root: PathBuf,
    /// The runtime's main config file, as a host path (default: found from the node's layout).
    #[arg(long, value_name = "FILE", env = "CONTAINERD_CONFIG")]
    config: Option<String>,
    /// The runtime's CRI socket, as a host path.
    #[arg(long, value_name = "FILE", env = "CONTAINERD_SOCKET")]
    socket: Option<String>,
    /// The drop-in file written, as a host path (default `<config dir>/conf.d/99-gpu-stack.toml`).
    #[arg(long, value_name = "FILE", env = "RUNTIME_DROP_IN_CONFIG")]
    drop_in: Option<String>,
    /// Directories the runtime reads CDI specs from (comma-separated host paths).
    #[arg(
        long,
        value_name = "DIRS",
        value_delimiter = ',',
        default_value = "/etc/cdi,/var/run/cdi"
    )]
    cdi_spec_dirs: Vec<String>,
    /// The runtime handler added for the operator's RuntimeClass (plain runc: devices come through CDI).
    #[arg(
        long,
        value_name = "NAME",
        env = "CONTAINERD_RUNTIME_CLASS",
        default_value = "nvidia"
    )]
    runtime_class: String,
    /// Add no runtime handler (pods then use the default runtime).
    #[arg(long)]
    no_runtime_handler: bool,
    /// How a changed configuration reaches the runtime: `signal` (SIGTERM; its
    /// service manager starts it again; needs hostPID) or `none`.
    #[arg(
        long,
        value_name = "MODE",
        env = "CONTAINERD_RESTART_MODE",
        default_value = "signal"
    )]
    restart_mode: RestartMode,
    /// Seconds a restarted runtime may take to serve again before the change is rolled back.
    #[arg(long, default_value_t = 60)]
    restart_timeout_seconds: u64,
    /// Print what would change (a unified diff) and change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Undo the agent's changes now and exit.
    #[arg(long)]
    remove: bool,
    /// Configure once and exit instead of holding until SIGTERM.
    #[arg(long)]
    once: bool,
    /// Seconds between re-checks while holding.
    #[arg(long, default_value_t = 300)]
    recheck_interval_seconds: u64,
    /// The driver's root on the host (where its libraries and device nodes are).
    #[arg(
        long,
        value_name = "DIR",
        env = "NVIDIA_DRIVER_ROOT",
        default_value = "/"
    )]
    driver_root: String,
    /// Directory the host's CDI spec is written to (host path).
    #[arg(long, value_name = "DIR", default_value = DEFAULT_CDI_DIR)]
    cdi_output_dir: String,
    /// Path of NVIDIA's CDI hook recorded in the spec.
    #[arg(
        long,
        value_name = "PATH",
        env = "NVIDIA_CDI_HOOK_PATH",
        default_value = "/usr/bin/nvidia-cdi-hook"
    )]
    nvidia_cdi_hook_path: String,
    /// Write no CDI spec (another component writes it).
    #[arg(long)]
    no_cdi_spec: bool,
    /// Kubeconfig for the removal check at SIGTERM (default: in-cluster).
    #[arg(long, value_name = "FILE")]
    kubeconfig: Option<PathBuf>,
    /// This pod's namespace (downward API), for the removal check.
    #[arg(long, env = "POD_NAMESPACE", default_value = "")]
    pod_namespace: String,
    /// This pod's name (downward API), for the removal check.
    #[arg(long, env = "POD_NAME", default_value = "")]
    pod_name: String,
    #[command(flatten)]
    backend: BackendArgs,
    /// Log line format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

fn config(args: &Args) -> ToolkitConfig {
    ToolkitConfig {
        host_root: args.host_root.clone(),
        runtime: match args.runtime {
            Runtime::Containerd => RuntimeKind::Containerd,
            Runtime::Crio => RuntimeKind::Crio,
        },
        config: args.config.clone(),
        socket: args.socket.clone(),
        drop_in: args.drop_in.clone(),
        options: RuntimeOptions {
            cdi_spec_dirs: args.cdi_spec_dirs.clone(),
            runtime_handler: (!args.no_runtime_handler).then(|| args.runtime_class.clone()),
        },
        restart: args.restart_mode,
        restart_timeout: Duration::from_secs(args.restart_timeout_seconds.max(1)),
    }
}

async fn write_host_cdi_spec(args: &Args) -> Result<()> {
    let backend = args.backend.build()?;
    let node = tokio::task::spawn_blocking(move || {
        read_node_gpus(backend.as_ref(), Some(MIG_MINORS_PATH.as_ref()))
    })
    .await??;
    let seen = host_path(&args.host_root, &args.driver_root);
    let host = discover_host_files(
        &args.driver_root,
        &args.driver_root,
        &seen.display().to_string(),
        &args.nvidia_cdi_hook_path,
        &node.driver_version,
    );
    let dir = host_path(&args.host_root, &args.cdi_output_dir);
    let path = write_spec(&dir, &node_spec(&node, &host))?;
    tracing::info!(path = %path.display(), gpus = node.gpus.len(), "host CDI spec written");
    Ok(())
}

fn identity(args: &Args) -> Option<PodIdentity> {
    (!args.pod_name.is_empty() && !args.pod_namespace.is_empty())
        .then(|| args.backend.node.clone())
        .flatten()
        .map(|node| PodIdentity {
            namespace: args.pod_namespace.clone(),
            name: args.pod_name.clone(),
            node,
        })
}

/// Starts watching the agent's DaemonSet and Node, when it runs as the
/// DaemonSet's pod.
async fn watch_removal(args: &Args) -> Option<(kube::Client, PodIdentity, RemovalWatch)> {
    let Some(who) = identity(args) else {
        tracing::info!(
            "not running as the toolkit DaemonSet's pod: the configuration stays at exit"
        );
        return None;
    };
    let client = match kube_client(args.kubeconfig.as_deref()).await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "cannot reach the API server: the configuration stays at exit");
            return None;
        }
    };
    match RemovalWatch::start(&client, &who).await {
        Ok(watch) => Some((client, who, watch)),
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch the toolkit DaemonSet: the configuration stays at exit");
            None
        }
    }
}

/// At SIGTERM: asks the API server; if it refuses or does not answer (the
/// operator deletes the agent's role with the DaemonSet), goes by what the
/// watches last saw, never by the refusal alone.
async fn removal_wanted(watched: Option<(kube::Client, PodIdentity, RemovalWatch)>) -> bool {
    let Some((client, who, watch)) = watched else {
        return false;
    };
    match component_removed(&client, &who).await {
        Ok(removed) => removed || watch.removed(),
        // Refused (the operator deletes the agent's role with the
        // DaemonSet, but a refusal alone proves nothing) or unanswered:
        // the watches decide.
        Err(e) => {
            // The watch events of a deletion usually arrive before the pod's
            // SIGTERM (the garbage collector deletes the pods after their
            // owner); a watch that was re-listing gets a moment to catch up.
            let mut removed = watch.removed();
            for _ in 0..20 {
                if removed {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                removed = watch.removed();
            }
            tracing::info!(error = %e, removed, "cannot ask the API server: deciding by the last watch events");
            removed
        }
    }
}

/// Runs the agent.
pub fn run(args: Args) -> Result<ExitCode> {
    init_logging(args.log_format);
    Ok(run_main(async move {
        let cfg = config(&args);
        if args.dry_run {
            let plan = cfg.plan().await?;
            let diff = plan.diff();
            if diff.is_empty() && !plan.needs_restart() {
                println!(
                    "nothing to change: the runtime already reads CDI specs from {}",
                    args.cdi_spec_dirs.join(", ")
                );
            } else {
                print!("{diff}");
                for gap in &plan.gaps {
                    println!("# the running runtime lacks: {gap}");
                }
                println!("# applying this would restart the runtime once");
            }
            return Ok(());
        }
        if args.remove {
            let out = cfg.remove().await?;
            println!(
                "removed: {} file(s) restored, {} runtime restart(s)",
                out.changed.len(),
                out.restarts
            );
            return Ok(());
        }
        if !args.no_cdi_spec {
            write_host_cdi_spec(&args)
                .await
                .context("writing the host's CDI spec")?;
        }
        if args.once {
            let out = cfg.configure().await?;
            println!(
                "configured: {} file(s) written, {} runtime restart(s)",
                out.changed.len(),
                out.restarts
            );
            return Ok(());
        }
        let watched = watch_removal(&args).await;
        let recheck = Duration::from_secs(args.recheck_interval_seconds.max(1));
        run_agent(&cfg, recheck, shutdown_signal()).await?;
        if removal_wanted(watched).await {
            let out = cfg.remove().await?;
            tracing::info!(files = ?out.changed, restarts = out.restarts, "toolkit removed from this node: runtime configuration restored");
        } else {
            tracing::info!("pod stopping, toolkit stays on this node: configuration kept");
        }
        anyhow::Ok(())
    }))
}
