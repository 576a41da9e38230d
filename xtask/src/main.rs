//! Project automation for gpu-stack.
//!
//! `cargo xtask test` is the one command that runs every test of the project,
//! including the end-to-end tests against a real Kubernetes control plane (etcd,
//! kube-apiserver, kube-controller-manager, kube-scheduler and kwok built from
//! their Go modules). `cargo xtask cluster up|down|status|build` manages that
//! control plane by hand.
mod cluster;
mod gobuild;
mod layout;
mod pki;
mod procs;

use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};

use crate::cluster::Cluster;
use crate::layout::Layout;

#[derive(Parser)]
#[command(name = "xtask", about = "gpu-stack project automation")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run every test of the workspace, end-to-end tests included: builds (or
    /// reuses) the control plane, starts a throwaway cluster, runs
    /// `cargo test --workspace --all-targets` against it and tears it down.
    Test(ClusterArgs),
    /// Manage the local test control plane.
    #[command(subcommand)]
    Cluster(ClusterCmd),
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Build what is missing, start the cluster on loopback and print the
    /// `export KUBECONFIG=...` line. It keeps running until `cluster down`.
    Up(ClusterArgs),
    /// Stop every process of the cluster and remove its state directory.
    Down(ClusterArgs),
    /// Say whether a cluster is running and where its kubeconfig is.
    Status(ClusterArgs),
    /// Only build (or check the cache of) the control plane binaries.
    Build(ClusterArgs),
}

#[derive(Args, Clone)]
struct ClusterArgs {
    /// First of six consecutive loopback ports (etcd client, etcd peer,
    /// kube-apiserver, controller-manager, scheduler, kwok).
    #[arg(long, env = "GPU_STACK_CLUSTER_PORT_BASE", default_value_t = layout::DEFAULT_PORT_BASE)]
    port_base: u16,
    /// Where the cluster keeps its certificates, kubeconfig, etcd data, logs
    /// and pid files (removed by `cluster down`).
    #[arg(long, env = "GPU_STACK_CLUSTER_DIR")]
    state_dir: Option<PathBuf>,
    /// Where the built binaries are cached between runs.
    #[arg(long, env = "GPU_STACK_CONTROL_PLANE_CACHE")]
    cache_dir: Option<PathBuf>,
}

impl ClusterArgs {
    fn layout(&self) -> Result<Layout> {
        Layout::new(
            self.state_dir.clone(),
            self.cache_dir.clone(),
            self.port_base,
        )
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("xtask: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Cmd::Test(args) => test(&args.layout()?),
        Cmd::Cluster(cmd) => {
            match cmd {
                ClusterCmd::Up(args) => {
                    let layout = args.layout()?;
                    procs::install_interrupt_handler()?;
                    gobuild::ensure_built(&layout)?;
                    let started = Instant::now();
                    let cluster = Cluster::start(&layout)?;
                    eprintln!(
                        "cluster ready in {:.1}s; stop it with `cargo xtask cluster down`",
                        started.elapsed().as_secs_f64()
                    );
                    cluster.detach();
                    println!("export KUBECONFIG={}", layout.kubeconfig().display());
                }
                ClusterCmd::Down(args) => {
                    let stopped = cluster::down(&args.layout()?)?;
                    eprintln!("stopped {stopped} control-plane process(es)");
                }
                ClusterCmd::Status(args) => cluster::status(&args.layout()?)?,
                ClusterCmd::Build(args) => gobuild::ensure_built(&args.layout()?)?,
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `cargo xtask test`: compile first (so the cluster does not idle while rustc
/// runs), then start the cluster, run the tests and always tear it down.
fn test(layout: &Layout) -> Result<ExitCode> {
    procs::install_interrupt_handler()?;
    cargo(&["test", "--workspace", "--all-targets", "--no-run"])?;
    gobuild::ensure_built(layout)?;

    let (kubeconfig, owned) = match cluster::running(layout)? {
        Some(kubeconfig) => {
            eprintln!(
                "using the running test cluster ({}); it stays up afterwards",
                kubeconfig.display()
            );
            (kubeconfig, None)
        }
        None => {
            let started = Instant::now();
            let cluster = Cluster::start(layout)?;
            eprintln!("cluster ready in {:.1}s", started.elapsed().as_secs_f64());
            (layout.kubeconfig(), Some(cluster))
        }
    };

    let outcome = procs::run_interruptible(
        Command::new(cargo_bin())
            // Run every test binary even after a failure, so one run reports all.
            .args(["test", "--workspace", "--all-targets", "--no-fail-fast"])
            .env("KUBECONFIG", &kubeconfig)
            .env(layout::E2E_KUBECONFIG_ENV, &kubeconfig),
    );

    let owned_cluster = owned.is_some();
    if let Some(cluster) = owned {
        if !matches!(outcome, Ok(true)) && !procs::interrupted() {
            cluster.print_log_tails(20);
        }
        cluster.stop().context("tearing down the test cluster")?;
    }
    if procs::interrupted() {
        if owned_cluster {
            eprintln!("interrupted; the test cluster was torn down");
        } else {
            eprintln!("interrupted");
        }
        return Ok(ExitCode::from(130));
    }
    let all_targets_passed = outcome.context("running `cargo test --workspace --all-targets`")?;
    // `--all-targets` leaves out doctests; the crate docs' examples must run too.
    let doc_outcome = cargo(&["test", "--workspace", "--doc"]);
    if !all_targets_passed {
        bail!("`cargo test --workspace --all-targets` failed");
    }
    doc_outcome.map(|()| ExitCode::SUCCESS)
}

fn cargo_bin() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string())
}

fn cargo(args: &[&str]) -> Result<()> {
    let cargo = cargo_bin();
    let status = Command::new(&cargo)
        .args(args)
        .status()
        .with_context(|| format!("could not run {cargo}"))?;
    if !status.success() {
        bail!("`cargo {}` failed ({status})", args.join(" "));
    }
    Ok(())
}
