//! `gpu-node-agent`: the device plugin, GFD, the metrics exporter, the MIG
//! manager and the validator in one process, each with its own binary's flags:
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
//!
//! With the validator hosted, each component first passes the gates its own
//! pod's init containers would have run (the validator's checks with its
//! flags, or a wait for their status files), and the agent keeps a file
//! that exists while every component that should run is up: its readiness
//! probe is `gpu-node-agent --check-ready`.
//! What runs where is decided in `gpu_stack_core::nodeagent`.
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use futures::StreamExt;
use gpu_stack_core::nodeagent::{
    READY_FILE, Segment, gates_in_process, parse_segments, ready, wanted,
};
use gpu_stack_core::operator::components::Component;
use gpu_stack_core::operator::validation::{ValidationComponent, parse_components};
use gpu_stack_k8s::deviceplugin::run::{Signal, SignalSource};
use gpu_stack_k8s::validator::{hold, wait_for_ready};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::agent::{
    Failure, LogFormat, exit_code, init_logging, kube_client, run_main, shutdown_signal,
};
use crate::agents::{device_plugin, exporter, feature_discovery, mig_manager};
use crate::cli::validator;

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
    #[arg(long, env = "NODE_NAME", required_unless_present = "check_ready")]
    node_name: Option<String>,
    /// File that exists while every component that should run is up.
    #[arg(long, value_name = "FILE", default_value = READY_FILE)]
    ready_file: PathBuf,
    /// Run nothing: exit 0 if the ready file exists, 1 if not (the readiness probe).
    #[arg(long)]
    check_ready: bool,
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
    Validator(Box<validator::HostedArgs>),
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
        Component::OperatorValidator => {
            let v: validator::HostedArgs = parse_as(&s.args).with_context(what)?;
            if !v.args.checks_something() {
                anyhow::bail!(
                    "{}: the hosted validator runs checks (--component ... --wait); the agent holds and waits itself, so drop --hold and --wait-only",
                    what()
                );
            }
            Parsed::Validator(Box::new(v))
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

/// The process: logging, then [`supervise`] on the agents' runtime; with
/// `--check-ready`, only the readiness check.
pub fn main(args: Args) -> ExitCode {
    if args.check_ready {
        if args.ready_file.exists() {
            return ExitCode::SUCCESS;
        }
        eprintln!(
            "not ready: a component that should run is not up yet ({} is missing)",
            args.ready_file.display()
        );
        return ExitCode::from(1);
    }
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

/// A running component: its stop flag and task, and whether it is up
/// (past its gates; the validator, once its checks have passed).
struct Running {
    stop: watch::Sender<bool>,
    task: JoinHandle<Result<(), String>>,
    started: tokio::time::Instant,
    up: Arc<AtomicBool>,
}

/// How long a component may take to stop before the supervisor leaves it
/// behind on its thread. The supervisor never waits for a stop: it goes on
/// with the other components and checks on it each tick.
const STOP_DEADLINE: Duration = Duration::from_secs(30);

/// Poll interval of a gate that waits for status files (NVIDIA's `sleep 5`).
const GATE_POLL: Duration = Duration::from_secs(5);

/// Starts one component from its flags (parsed again: each run gets fresh
/// state, as a restarted container does). With `gates` (the hosted
/// validator's flags), it first passes its gates.
fn start(
    component: Component,
    args: &[String],
    gates: Option<&validator::Args>,
    local_clients: &watch::Receiver<BTreeSet<&'static str>>,
) -> Result<Running> {
    let (stop, rx) = watch::channel(false);
    let parsed = flags(&Segment {
        component,
        args: args.to_vec(),
    })?;
    let local = local_clients.clone();
    let up = Arc::new(AtomicBool::new(false));
    let is_up = up.clone();
    let gates = gates
        .filter(|_| component != Component::OperatorValidator)
        .cloned();
    // Each component runs on a thread and runtime of its own: one stuck in
    // a call that never returns (a hung GPU under a synchronous NVML call)
    // stalls neither the other components nor the supervisor.
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let run = move || async move {
        let result = async {
            if let Some(v) = gates {
                tokio::select! {
                    passed = pass_gates(component, &v) => passed?,
                    () = stopped(rx.clone()) => return Ok(()),
                }
            }
            if !matches!(parsed, Parsed::Validator(_)) {
                is_up.store(true, Ordering::Release);
            }
            match parsed {
                Parsed::DevicePlugin(a) => device_plugin::serve_until(*a, StopSignals(rx)).await,
                Parsed::Gfd(a) => feature_discovery::label_until(*a, stopped(rx)).await,
                Parsed::Exporter(a) => {
                    exporter::run_until(*a, std::time::Instant::now(), stopped(rx))
                        .await
                        .map_err(|f| anyhow::anyhow!("{:#} (exit code {})", f.error(), f.code()))
                }
                Parsed::MigManager(a) => {
                    mig_manager::manage_until(*a, stopped(rx), Some(local)).await
                }
                Parsed::Validator(a) => validate_and_hold(a.args, &is_up, rx).await,
            }
        }
        .await;
        result.map_err(|e| format!("{e:#}"))
    };
    std::thread::Builder::new()
        .name(format!("agent-{}", component.deploy_label_suffix()))
        .spawn(move || {
            let outcome = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime.block_on(run()),
                Err(e) => Err(format!("cannot build the component's runtime: {e}")),
            };
            let _ = done_tx.send(outcome);
        })
        .context("starting the component's thread")?;
    let task = tokio::spawn(async move {
        done_rx
            .await
            .unwrap_or_else(|_| Err("the component's thread ended without an outcome".into()))
    });
    Ok(Running {
        stop,
        task,
        started: tokio::time::Instant::now(),
        up,
    })
}

/// Passes `component`'s gates as its own pod's init containers would: the
/// validator's checks (with its flags) for a check gate, a wait for the
/// status files for a wait gate.
async fn pass_gates(component: Component, validator_args: &validator::Args) -> Result<()> {
    for gate in component.gates() {
        match gate.validator_component() {
            Some(checks) => {
                validator::checks(validator_args.checking(checks))
                    .await?
                    .run(log_passed)
                    .await?
            }
            None => {
                let files = parse_components(gate.status_component())?;
                wait_for_ready(
                    validator_args.validations_dir(),
                    &files,
                    Duration::MAX,
                    GATE_POLL,
                )
                .await?
            }
        }
        tracing::info!(component = %component, gate = gate.container_name(), "gate passed");
    }
    Ok(())
}

fn log_passed(c: ValidationComponent, path: &Path) {
    tracing::info!(component = %c, "ready: wrote {}", path.display());
}

/// The hosted validator: its checks in order (each writing its status file),
/// then up until stopped, when it removes the status files as its pod does.
async fn validate_and_hold(
    args: validator::Args,
    up: &AtomicBool,
    stop: watch::Receiver<bool>,
) -> Result<()> {
    let checks = validator::checks(args).await?;
    tokio::select! {
        passed = checks.run(log_passed) => passed?,
        () = stopped(stop.clone()) => return Ok(()),
    }
    up.store(true, Ordering::Release);
    hold(&checks.options.dir, stopped(stop)).await?;
    Ok(())
}

/// Keeps the ready file in step with `is_ready` (created empty, removed);
/// a failure is logged, and the probe then reports what the file says.
fn set_ready_file(path: &Path, is_ready: bool) {
    let result = if is_ready {
        std::fs::write(path, b"")
    } else {
        match std::fs::remove_file(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            other => other,
        }
    };
    match result {
        Ok(()) => tracing::info!(ready = is_ready, file = %path.display(), "readiness changed"),
        Err(err) => tracing::warn!(file = %path.display(), %err, "cannot update the ready file"),
    }
}

/// A component told to stop that has not finished yet.
struct Stopping {
    task: JoinHandle<Result<(), String>>,
    since: tokio::time::Instant,
    why: &'static str,
}

/// One hosted component's state in the supervisor.
struct Slot {
    component: Component,
    args: Vec<String>,
    running: Option<Running>,
    /// The previous run, still stopping: no new one starts before it is
    /// gone (it may still hold the socket or port) or left behind.
    stopping: Option<Stopping>,
    backoff: Duration,
    retry_at: Option<tokio::time::Instant>,
}

/// Runs the components as the node's labels say until SIGTERM, then stops
/// them all.
pub async fn supervise(args: Args) -> Result<(), Failure> {
    let node_name = args.node_name.clone().context("--node-name is required")?;
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
            stopping: None,
            backoff: FIRST_BACKOFF,
            retry_at: None,
        })
        .collect();
    let hosted: Vec<Component> = slots.iter().map(|s| s.component).collect();
    // With the validator hosted, the gates run here, with its flags.
    let gates: Option<validator::Args> = if gates_in_process(&hosted) {
        slots
            .iter()
            .find(|s| s.component == Component::OperatorValidator)
            .and_then(|s| {
                match flags(&Segment {
                    component: s.component,
                    args: s.args.clone(),
                }) {
                    Ok(Parsed::Validator(v)) => Some(v.args),
                    _ => None,
                }
            })
    } else {
        None
    };
    tracing::info!(node = %node_name, components = ?hosted, gates_in_process = gates.is_some(), "node agent started");
    set_ready_file(&args.ready_file, false);
    let mut was_ready = false;

    let nodes: Api<PartialObjectMeta<Node>> = Api::all(client);
    let cfg = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
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
            reconcile(
                slot,
                run,
                "deploy label is not true",
                gates.as_ref(),
                &clients_rx,
            )
            .await;
        }
        let up: BTreeSet<Component> = slots
            .iter()
            .filter(|s| {
                s.running
                    .as_ref()
                    .is_some_and(|r| r.up.load(Ordering::Acquire))
            })
            .map(|s| s.component)
            .collect();
        let now_ready = ready(labels, &hosted, &up);
        if now_ready != was_ready {
            set_ready_file(&args.ready_file, now_ready);
            was_ready = now_ready;
        }
        // A component still stopping still holds its GPUs.
        let running: BTreeSet<&'static str> = slots
            .iter()
            .filter(|s| s.running.is_some() || s.stopping.is_some())
            .map(|s| s.component.app_label())
            .collect();
        clients_tx.send_if_modified(|current| {
            let changed = *current != running;
            *current = running;
            changed
        });
    }
    set_ready_file(&args.ready_file, false);
    // Every component winds down at once; the supervisor waits until each
    // has stopped or been left behind (at most STOP_DEADLINE).
    for slot in &mut slots {
        reconcile(slot, false, "shutting down", gates.as_ref(), &clients_rx).await;
    }
    while slots.iter().any(|s| s.stopping.is_some()) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        for slot in &mut slots {
            reconcile(slot, false, "shutting down", gates.as_ref(), &clients_rx).await;
        }
    }
    tracing::info!("node agent stopped");
    Ok(())
}

/// Brings one component to `want`: starts it (unless backing off after a
/// failure, or its previous run is still stopping), or tells it to stop
/// (saying `why`). Never waits for a component: a stop in progress is
/// checked on the next call, and left behind after [`STOP_DEADLINE`].
async fn reconcile(
    slot: &mut Slot,
    want: bool,
    why: &'static str,
    gates: Option<&validator::Args>,
    local_clients: &watch::Receiver<BTreeSet<&'static str>>,
) {
    let name = slot.component.deploy_label_suffix();
    if let Some(stopping) = slot.stopping.take() {
        if stopping.task.is_finished() {
            match stopping.task.await {
                Ok(Err(err)) => tracing::warn!(component = name, "stopped with: {err}"),
                Err(err) => tracing::warn!(component = name, %err, "stopped abnormally"),
                Ok(Ok(())) => {}
            }
            tracing::info!(component = name, "{}: stopped", stopping.why);
        } else if stopping.since.elapsed() > STOP_DEADLINE {
            // Left to finish on its own thread; the supervisor and the
            // other components go on.
            tracing::error!(
                component = name,
                secs = STOP_DEADLINE.as_secs(),
                "did not stop in time (stuck in a call?); left behind"
            );
        } else {
            slot.stopping = Some(stopping);
            return;
        }
    }
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
            match start(slot.component, &slot.args, gates, local_clients) {
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
                slot.stopping = Some(Stopping {
                    task: r.task,
                    since: tokio::time::Instant::now(),
                    why,
                });
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
    fn the_hosted_validator_runs_checks_and_nothing_else() {
        let segment = |args: &[&str]| Segment {
            component: Component::OperatorValidator,
            args: strings(args),
        };
        let checks = flags(&segment(&[
            "validator",
            "--component",
            "driver,toolkit,cuda,plugin",
            "--wait",
            "--host-root",
            "/host",
        ]));
        assert!(matches!(checks, Ok(Parsed::Validator(_))));
        for refused in ["--hold", "--wait-only"] {
            let err = flags(&segment(&["validator", "--component", "driver", refused]))
                .err()
                .map(|e| format!("{e:#}"))
                .unwrap_or_default();
            assert!(
                err.contains("drop --hold and --wait-only"),
                "{refused}: {err}"
            );
        }
    }

    #[test]
    fn the_ready_file_follows_readiness() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ready");
        set_ready_file(&file, true);
        assert!(file.exists());
        set_ready_file(&file, false);
        assert!(!file.exists());
        // Not there already: nothing to do, no error.
        set_ready_file(&file, false);
        assert!(!file.exists());
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
            validator::HostedArgs::command(),
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
