//! `gpu-node-agent`: the device plugin, GFD, the metrics exporter and the MIG
//! manager in one process, each with its own binary's flags:
//!
//! ```text
//! gpu-node-agent --node-name NODE -- gpu-device-plugin [FLAGS] -- gpu-exporter [FLAGS] ...
//! ```
//!
//! Each component runs while its `nvidia.com/gpu.deploy.<component>` label
//! is `true` (the node selector of its own DaemonSet) and is stopped in the
//! process when the label changes, as the MIG manager pausing it for a
//! change does; the hosted MIG manager waits for those stops as it waits for
//! client pods to leave. A component that fails is started again after a
//! back-off (1 s doubling to 60 s), as the kubelet restarts a container.
//! What runs where is decided in `gpu_stack_core::nodeagent`.
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use futures::StreamExt;
use gpu_stack_core::nodeagent::{Segment, parse_segments, wanted};
use gpu_stack_core::operator::components::Component;
use gpu_stack_k8s::deviceplugin::run::{Signal, SignalSource};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::agent::{
    Failure, LogFormat, exit_code, init_logging, kube_client, run_main, shutdown_signal,
};
use crate::agents::{device_plugin, exporter, feature_discovery, mig_manager};

/// First wait before a failed component is started again; doubled each
/// time up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// gpu-node-agent: GPU node agents in one process, each run while its deploy label is `true`.
#[derive(Parser, Debug)]
#[command(
    name = "gpu-node-agent",
    version,
    about,
    after_help = "Exit codes: 2 bad flags (of the agent or of a component)."
)]
pub struct Args {
    /// This node's name (whose deploy labels are followed).
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// Kubeconfig for the node watch (default: in-cluster, then $KUBECONFIG).
    #[arg(long, value_name = "FILE")]
    kubeconfig: Option<PathBuf>,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// The components, separated by `--`, each its binary's name and flags.
    #[arg(last = true, allow_hyphen_values = true, value_name = "COMPONENT")]
    components: Vec<String>,
}

/// One component's parsed flags.
enum Parsed {
    DevicePlugin(Box<device_plugin::Args>),
    Gfd(Box<feature_discovery::Args>),
    Exporter(Box<exporter::Args>),
    MigManager(Box<mig_manager::Args>),
}

/// Parses every component's flags with its own binary's parser; the first
/// error stops the agent before anything starts.
fn parse(segments: &[Segment]) -> Result<Vec<(Component, Vec<String>)>, Failure> {
    for s in segments {
        flags(s).map_err(exit_code(2))?;
    }
    Ok(segments
        .iter()
        .map(|s| (s.component, s.args.clone()))
        .collect())
}

fn flags(s: &Segment) -> Result<Parsed> {
    let what = || format!("flags of {}", s.args[0]);
    fn parse_as<T: Parser>(args: &[String]) -> clap::error::Result<T> {
        T::try_parse_from(env_as_flags(&T::command(), args))
    }
    Ok(match s.component {
        Component::DevicePlugin => {
            Parsed::DevicePlugin(Box::new(parse_as(&s.args).with_context(what)?))
        }
        Component::GpuFeatureDiscovery => {
            Parsed::Gfd(Box::new(parse_as(&s.args).with_context(what)?))
        }
        Component::DcgmExporter => {
            Parsed::Exporter(Box::new(parse_as(&s.args).with_context(what)?))
        }
        _ => Parsed::MigManager(Box::new(parse_as(&s.args).with_context(what)?)),
    })
}

/// Whether an argument is a `NAME=VALUE` environment assignment.
fn env_assignment(arg: &str) -> Option<(&str, &str)> {
    let (name, value) = arg.split_once('=')?;
    let mut chars = name.chars();
    let first = chars.next()?;
    ((first.is_ascii_uppercase() || first == '_')
        && chars.all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
    .then_some((name, value))
}

/// A component's command line with its leading `NAME=VALUE` arguments
/// (right after the binary's name) turned into the flags that read those
/// variables in `cmd`: the environment its own container would have had,
/// given to it alone (components read some variables of the same name,
/// `CONFIG_FILE` for one). As with a real environment, a flag given on the
/// command line wins, and a variable no flag reads changes nothing.
fn env_as_flags(cmd: &clap::Command, args: &[String]) -> Vec<String> {
    let Some((binary, rest)) = args.split_first() else {
        return Vec::new();
    };
    let assignments = rest
        .iter()
        .take_while(|a| env_assignment(a).is_some())
        .count();
    let (vars, explicit) = rest.split_at(assignments);
    let mut out = vec![binary.clone()];
    for (name, value) in vars.iter().filter_map(|a| env_assignment(a)) {
        let Some(arg) = cmd
            .get_arguments()
            .find(|a| a.get_env().is_some_and(|e| e == name))
        else {
            tracing::debug!(binary = %binary, variable = name, "no flag reads it; ignored");
            continue;
        };
        let Some(long) = arg.get_long() else { continue };
        let flag = format!("--{long}");
        if explicit
            .iter()
            .any(|a| *a == flag || a.starts_with(&format!("{flag}=")))
        {
            continue;
        }
        match arg.get_action() {
            // A switch is on for any value but clap's false ones.
            clap::ArgAction::SetTrue => {
                let off = ["", "0", "n", "no", "f", "false", "off"];
                if !off.contains(&value.to_ascii_lowercase().as_str()) {
                    out.push(flag);
                }
            }
            _ => out.push(format!("{flag}={value}")),
        }
    }
    out.extend(explicit.iter().cloned());
    out
}

/// The process: logging, then [`supervise`] on the agents' runtime.
pub fn main(args: Args) -> ExitCode {
    init_logging(args.log_format);
    run_main(supervise(args))
}

/// The device plugin's signals from a stop flag.
struct StopSignals(watch::Receiver<bool>);

impl SignalSource for StopSignals {
    async fn recv(&mut self) -> Signal {
        let _ = self.0.wait_for(|stop| *stop).await;
        Signal::Terminate
    }
}

async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

/// A running component: its stop flag and task.
struct Running {
    stop: watch::Sender<bool>,
    task: JoinHandle<Result<(), String>>,
    started: tokio::time::Instant,
}

/// Starts one component from its flags (parsed again: each run gets fresh
/// state, as a restarted container does).
fn start(
    component: Component,
    args: &[String],
    local_clients: &watch::Receiver<BTreeSet<&'static str>>,
) -> Result<Running> {
    let (stop, rx) = watch::channel(false);
    let parsed = flags(&Segment {
        component,
        args: args.to_vec(),
    })?;
    let local = local_clients.clone();
    let task = tokio::spawn(async move {
        let result = match parsed {
            Parsed::DevicePlugin(a) => device_plugin::serve_until(*a, StopSignals(rx)).await,
            Parsed::Gfd(a) => feature_discovery::label_until(*a, stopped(rx)).await,
            Parsed::Exporter(a) => exporter::run_until(*a, std::time::Instant::now(), stopped(rx))
                .await
                .map_err(|f| anyhow::anyhow!("{:#} (exit code {})", f.error(), f.code())),
            Parsed::MigManager(a) => mig_manager::manage_until(*a, stopped(rx), Some(local)).await,
        };
        result.map_err(|e| format!("{e:#}"))
    });
    Ok(Running {
        stop,
        task,
        started: tokio::time::Instant::now(),
    })
}

/// One hosted component's state in the supervisor.
struct Slot {
    component: Component,
    args: Vec<String>,
    running: Option<Running>,
    backoff: Duration,
    retry_at: Option<tokio::time::Instant>,
}

/// Runs the components as the node's labels say until SIGTERM, then stops
/// them all.
pub async fn supervise(args: Args) -> Result<(), Failure> {
    let segments = parse_segments(&args.components).map_err(exit_code(2))?;
    let parsed = parse(&segments)?;
    let client = kube_client(args.kubeconfig.as_deref()).await?;
    let (clients_tx, clients_rx) = watch::channel(BTreeSet::<&'static str>::new());
    let mut slots: Vec<Slot> = parsed
        .into_iter()
        .map(|(component, args)| Slot {
            component,
            args,
            running: None,
            backoff: FIRST_BACKOFF,
            retry_at: None,
        })
        .collect();
    let hosted: Vec<Component> = slots.iter().map(|s| s.component).collect();
    tracing::info!(node = %args.node_name, components = ?hosted, "node agent started");

    let nodes: Api<PartialObjectMeta<Node>> = Api::all(client);
    let cfg = watcher::Config::default().fields(&format!("metadata.name={}", args.node_name));
    let mut changes = watcher(nodes, cfg)
        .default_backoff()
        .applied_objects()
        .boxed();
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    let mut labels: Option<BTreeMap<String, String>> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            change = changes.next() => match change {
                Some(Ok(node)) => labels = Some(node.metadata.labels.unwrap_or_default()),
                Some(Err(err)) => tracing::warn!(%err, "watching the node; retrying"),
                None => break,
            },
            _ = tick.tick() => {}
        }
        // Nothing runs before the node's labels are known.
        let Some(labels) = &labels else { continue };
        let want = wanted(labels, &hosted);
        for slot in &mut slots {
            let run = want.contains(&slot.component);
            reconcile(slot, run, "deploy label is not true", &clients_rx).await;
        }
        let running: BTreeSet<&'static str> = slots
            .iter()
            .filter(|s| s.running.is_some())
            .map(|s| s.component.app_label())
            .collect();
        clients_tx.send_if_modified(|current| {
            let changed = *current != running;
            *current = running;
            changed
        });
    }
    for slot in &mut slots {
        reconcile(slot, false, "shutting down", &clients_rx).await;
    }
    tracing::info!("node agent stopped");
    Ok(())
}

/// Brings one component to `want`: starts it (unless backing off after a
/// failure), or stops it (saying `why`) and waits until it has.
async fn reconcile(
    slot: &mut Slot,
    want: bool,
    why: &str,
    local_clients: &watch::Receiver<BTreeSet<&'static str>>,
) {
    let name = slot.component.deploy_label_suffix();
    if let Some(r) = &slot.running
        && r.task.is_finished()
    {
        let Some(finished) = slot.running.take() else {
            return;
        };
        // A run that lasted past the longest back-off was healthy.
        if finished.started.elapsed() > MAX_BACKOFF {
            slot.backoff = FIRST_BACKOFF;
        }
        let outcome = finished.task.await.unwrap_or_else(|e| Err(e.to_string()));
        match outcome {
            Ok(()) => tracing::info!(component = name, "component exited"),
            Err(err) => tracing::error!(component = name, "component failed: {err}"),
        }
        slot.retry_at = Some(tokio::time::Instant::now() + slot.backoff);
        tracing::info!(
            component = name,
            backoff_s = slot.backoff.as_secs(),
            "restarting after a back-off"
        );
        slot.backoff = (slot.backoff * 2).min(MAX_BACKOFF);
    }
    match (&slot.running, want) {
        (None, true) => {
            if slot
                .retry_at
                .is_some_and(|at| tokio::time::Instant::now() < at)
            {
                return;
            }
            match start(slot.component, &slot.args, local_clients) {
                Ok(r) => {
                    tracing::info!(component = name, "deploy label is true: started");
                    slot.running = Some(r);
                }
                Err(err) => tracing::error!(component = name, "cannot start: {err:#}"),
            }
        }
        (Some(_), false) => {
            if let Some(r) = slot.running.take() {
                let _ = r.stop.send(true);
                match r.task.await {
                    Ok(Err(err)) => tracing::warn!(component = name, "stopped with: {err}"),
                    Err(err) => tracing::warn!(component = name, %err, "stopped abnormally"),
                    Ok(Ok(())) => {}
                }
                tracing::info!(component = name, "{why}: stopped");
            }
            // A component stopped on purpose starts again without delay.
            slot.retry_at = None;
            slot.backoff = FIRST_BACKOFF;
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn strings(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_components_variables_become_its_own_flags() {
        let cmd = mig_manager::Args::command();
        let args = strings(&[
            "gpu-mig-manager",
            "CONFIG_FILE=/mig-parted-config/config.yaml",
            "DEFAULT_MIG_CONFIG=all-disabled",
            "--node-name=n",
        ]);
        // DEFAULT_MIG_CONFIG is read by no flag of the MIG manager: it stays out.
        assert_eq!(
            env_as_flags(&cmd, &args),
            strings(&[
                "gpu-mig-manager",
                "--config-file=/mig-parted-config/config.yaml",
                "--node-name=n"
            ])
        );
        let parsed = mig_manager::Args::try_parse_from(env_as_flags(&cmd, &args));
        assert!(parsed.is_ok(), "{parsed:?}");
    }

    #[test]
    fn a_flag_on_the_command_line_wins_over_a_variable() {
        let cmd = device_plugin::Args::command();
        let args = strings(&[
            "gpu-device-plugin",
            "MIG_STRATEGY=single",
            "--mig-strategy=mixed",
        ]);
        assert_eq!(
            env_as_flags(&cmd, &args),
            strings(&["gpu-device-plugin", "--mig-strategy=mixed"])
        );
    }

    #[test]
    fn only_leading_assignments_are_variables() {
        let cmd = exporter::Args::command();
        // A value that looks like an assignment after a flag is the flag's.
        let args = strings(&["gpu-exporter", "--collectors", "A=B"]);
        assert_eq!(env_as_flags(&cmd, &args), args);
        assert_eq!(env_assignment("lower=x"), None);
        assert_eq!(env_assignment("--x=y"), None);
        assert_eq!(env_assignment("NODE_NAME=n=1"), Some(("NODE_NAME", "n=1")));
    }

    #[test]
    fn every_hosted_parser_takes_its_variables_as_flags() {
        // Each flag that reads a variable accepts `--flag=VALUE` (or is a switch).
        for cmd in [
            device_plugin::Args::command(),
            feature_discovery::Args::command(),
            exporter::Args::command(),
            mig_manager::Args::command(),
        ] {
            for arg in cmd.get_arguments().filter(|a| a.get_env().is_some()) {
                assert!(
                    arg.get_long().is_some(),
                    "{}: {:?} reads a variable but has no long flag",
                    cmd.get_name(),
                    arg.get_id()
                );
            }
        }
    }
}
