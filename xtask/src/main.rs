//! Project automation for gpu-stack.
//!
//! `cargo xtask test` is the one command that runs every test of the project,
//! including the end-to-end tests against a real Kubernetes control plane (etcd,
//! kube-apiserver, kube-controller-manager, kube-scheduler and kwok built from
//! their Go modules). `cargo xtask cluster up|down|status|build|bin-dir`
//! manages that control plane by hand, at the Kubernetes and containerd
//! releases `versions.rs` lists (`--kube-version`, `--containerd-version`);
//! `cargo xtask matrix` runs the end-to-end suite on each of them.
mod cluster;
mod gobuild;
mod images;
mod layout;
mod matrix;
mod node;
mod pki;
mod procs;
mod proxy;
mod versions;

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
    Test(TestArgs),
    /// Run the end-to-end suite on each supported Kubernetes and containerd
    /// release, one throwaway cluster after another, and print a table of
    /// version × test binary (also written to `<state>/../matrix/matrix.md`).
    Matrix(MatrixArgs),
    /// Manage the local test control plane.
    #[command(subcommand)]
    Cluster(ClusterCmd),
    /// Build the OCI images of the project's binaries into one archive
    /// (`ctr images import` loads it; see docs/operator.md, Images).
    Images(ImagesArgs),
    /// A forwarder of the real test node (started by `cluster up`).
    #[command(hide = true)]
    NodeProxy(proxy::ProxyArgs),
}

#[derive(Args, Clone)]
struct TestArgs {
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Run without the real node (kwok nodes only); its tests then fail
    /// saying so.
    #[arg(long)]
    no_real_node: bool,
}

#[derive(Args, Clone)]
struct MatrixArgs {
    #[command(flatten)]
    cluster: ClusterArgs,
    /// A release combination as KUBE/CONTAINERD (`1.37/2.3`); repeat for
    /// more. Default: 1.35, 1.36 and 1.37 on containerd 2.3, then 1.37 on
    /// containerd 2.4 and 1.7.
    #[arg(long = "entry")]
    entries: Vec<String>,
    /// Only this end-to-end test binary (`dra_scale_e2e`); repeat for more.
    /// Default: every one.
    #[arg(long = "test")]
    tests: Vec<String>,
    /// Run without the real node (kwok nodes only).
    #[arg(long)]
    no_real_node: bool,
}

#[derive(Args, Clone)]
struct UpArgs {
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Also start a real node: a kubelet and containerd in namespaces of
    /// their own, with the project's images imported (needs root).
    #[arg(long)]
    real_node: bool,
}

#[derive(Args, Clone)]
struct ImagesArgs {
    /// Build (and package) the release profile instead of the debug one.
    #[arg(long)]
    release: bool,
    /// Where to write the OCI archive.
    #[arg(long, default_value = "target/gpu-stack-images.tar")]
    output: PathBuf,
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Build what is missing, start the cluster on loopback and print the
    /// `export KUBECONFIG=...` line. It keeps running until `cluster down`.
    Up(UpArgs),
    /// Stop every process of the cluster and remove its state directory.
    Down(ClusterArgs),
    /// Say whether a cluster is running and where its kubeconfig is.
    Status(ClusterArgs),
    /// Only build (or check the cache of) the control plane binaries.
    Build(ClusterArgs),
    /// Print the directory of the chosen releases' binaries (kubectl, ...).
    BinDir(ClusterArgs),
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
    /// Kubernetes minor of the control plane and the real node's kubelet
    /// (1.35, 1.36 or 1.37).
    #[arg(long, env = "GPU_STACK_KUBE_VERSION", default_value = versions::DEFAULT_KUBE)]
    kube_version: String,
    /// containerd series of the real node (2.3, 2.4 or 1.7).
    #[arg(long, env = "GPU_STACK_CONTAINERD_VERSION", default_value = versions::DEFAULT_CONTAINERD)]
    containerd_version: String,
}

impl ClusterArgs {
    fn layout(&self) -> Result<Layout> {
        Layout::new(
            self.state_dir.clone(),
            self.cache_dir.clone(),
            self.port_base,
            versions::kube(&self.kube_version)?,
            versions::containerd(&self.containerd_version)?,
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
        Cmd::Test(args) => test(&args.cluster.layout()?, !args.no_real_node),
        Cmd::Matrix(args) => run_matrix(&args),
        Cmd::NodeProxy(args) => proxy::run(&args).map(|()| ExitCode::SUCCESS),
        Cmd::Images(args) => {
            let profile = if args.release { "release" } else { "debug" };
            let mut build = vec!["build", "-p", "gpu-stack-bins", "--bins"];
            if args.release {
                build.push("--release");
            }
            cargo(&build)?;
            let names = images::build(&repo_dir(), &target_dir().join(profile), &args.output)?;
            eprintln!("wrote {} with:", args.output.display());
            for name in names {
                eprintln!("  {name}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Cluster(cmd) => {
            match cmd {
                ClusterCmd::Up(args) => {
                    let layout = args.cluster.layout()?;
                    procs::install_interrupt_handler()?;
                    if args.real_node {
                        cargo(&["build", "-p", "gpu-stack-bins", "--bins"])?;
                    }
                    gobuild::ensure_built(&layout)?;
                    let started = Instant::now();
                    let real_node = args.real_node.then(|| target_dir().join("debug"));
                    let cluster = Cluster::start(&layout, real_node.as_deref())?;
                    eprintln!(
                        "cluster ready in {:.1}s; stop it with `cargo xtask cluster down`",
                        started.elapsed().as_secs_f64()
                    );
                    cluster.detach();
                    println!("export KUBECONFIG={}", layout.kubeconfig().display());
                    if args.real_node {
                        println!(
                            "export {}={}",
                            layout::E2E_NODE_DIR_ENV,
                            node::NodeLayout::new(&layout).dir.display()
                        );
                    }
                }
                ClusterCmd::Down(args) => {
                    let stopped = cluster::down(&args.layout()?)?;
                    eprintln!("stopped {stopped} control-plane process(es)");
                }
                ClusterCmd::Status(args) => cluster::status(&args.layout()?)?,
                ClusterCmd::Build(args) => gobuild::ensure_built(&args.layout()?)?,
                ClusterCmd::BinDir(args) => println!("{}", args.layout()?.bin().display()),
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `cargo xtask test`: compile first (so the cluster does not idle while rustc
/// runs), then start the cluster, run the tests and always tear it down.
fn test(layout: &Layout, real_node: bool) -> Result<ExitCode> {
    procs::install_interrupt_handler()?;
    // The exporter's tests scrape it with a real Prometheus.
    node::ensure_debian_packages(&node::PROMETHEUS_PACKAGES)?;
    if real_node {
        node::ensure_packages()?;
    }
    // This also builds every binary (the binaries' tests run them), with the
    // features of the test build: the real node's images are made from them.
    cargo(&["test", "--workspace", "--all-targets", "--no-run"])?;
    gobuild::ensure_built(layout)?;
    // NVIDIA's own NVML clients, run against the stand-in libnvidia-ml.
    let oracles = repo_dir().join("tools/nvidia-oracles/build.sh");
    let status = Command::new("bash")
        .arg(&oracles)
        .status()
        .with_context(|| format!("could not run {}", oracles.display()))?;
    if !status.success() {
        bail!("{} failed ({status})", oracles.display());
    }

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
            let bins = real_node.then(|| target_dir().join("debug"));
            let cluster = Cluster::start(layout, bins.as_deref())?;
            eprintln!("cluster ready in {:.1}s", started.elapsed().as_secs_f64());
            (layout.kubeconfig(), Some(cluster))
        }
    };

    let outcome = procs::run_interruptible(
        Command::new(cargo_bin())
            // Run every test binary even after a failure, so one run reports all.
            .args(["test", "--workspace", "--all-targets", "--no-fail-fast"])
            .envs(suite_env(layout, &kubeconfig)),
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

/// What the tests read to find the cluster, the real node and the versions.
fn suite_env(
    layout: &Layout,
    kubeconfig: &std::path::Path,
) -> Vec<(&'static str, std::ffi::OsString)> {
    vec![
        ("KUBECONFIG", kubeconfig.into()),
        (layout::E2E_KUBECONFIG_ENV, kubeconfig.into()),
        ("GPU_STACK_NVIDIA_ORACLES_REQUIRED", "1".into()),
        (
            layout::E2E_NODE_DIR_ENV,
            node::NodeLayout::new(layout).dir.into(),
        ),
        (
            layout::E2E_KUBE_MINOR_ENV,
            layout.kube.minor.to_string().into(),
        ),
        (layout::E2E_CONTAINERD_ENV, layout.containerd.series.into()),
        // The toolkit's golden configs are read by the node's containerd.
        ("CONTAINERD_BIN", layout.binary("containerd").into()),
    ]
}

/// `cargo xtask matrix`: for each entry, build (or reuse) its releases,
/// start a cluster of its own, run the end-to-end suite, tear it down; then
/// the table. Fails unless every entry passed.
fn run_matrix(args: &MatrixArgs) -> Result<ExitCode> {
    procs::install_interrupt_handler()?;
    let entries = if args.entries.is_empty() {
        matrix::default_entries()
    } else {
        args.entries
            .iter()
            .map(|e| matrix::parse_entry(e))
            .collect::<Result<Vec<_>>>()?
    };
    let real_node = !args.no_real_node;
    node::ensure_debian_packages(&node::PROMETHEUS_PACKAGES)?;
    if real_node {
        node::ensure_packages()?;
    }
    cargo(&["test", "--workspace", "--all-targets", "--no-run"])?;
    let base = args.cluster.layout()?;
    let report_dir = base
        .state
        .parent()
        .map(|p| p.join("matrix"))
        .unwrap_or_else(|| base.state.join("matrix"));
    std::fs::create_dir_all(&report_dir)
        .with_context(|| format!("creating {}", report_dir.display()))?;
    let mut columns = Vec::new();
    for entry in entries {
        let layout = layout::Layout {
            kube: entry.kube,
            containerd: entry.containerd,
            ..base.clone()
        };
        if cluster::running(&layout)?.is_some() {
            bail!(
                "a test cluster is already running in {}: stop it with `cargo xtask cluster down` \
                 (the matrix starts one cluster per entry)",
                layout.state.display()
            );
        }
        eprintln!("==> matrix: {entry}");
        let log = report_dir.join(format!(
            "k8s-1.{}-containerd-{}.log",
            entry.kube.minor, entry.containerd.series
        ));
        let outcome =
            matrix_entry(&layout, real_node, &args.tests, &log).map_err(|e| format!("{e:#}"));
        if let Err(e) = &outcome {
            eprintln!("matrix: {entry}: {e}");
        }
        columns.push((entry, outcome));
        // The table so far, so a long matrix that is stopped keeps its results.
        std::fs::write(report_dir.join("matrix.md"), matrix::table(&columns))
            .with_context(|| format!("writing {}", report_dir.display()))?;
        if procs::interrupted() {
            break;
        }
    }
    matrix::report(&report_dir, &columns)?;
    let all_passed = columns.iter().all(|(_, r)| {
        r.as_ref()
            .is_ok_and(|o| !o.is_empty() && o.values().all(|&(_, failed)| failed == 0))
    });
    Ok(if all_passed && !procs::interrupted() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// One matrix column: the suite's output goes to `log`, which is then read.
fn matrix_entry(
    layout: &Layout,
    real_node: bool,
    tests: &[String],
    log: &std::path::Path,
) -> Result<matrix::Outcomes> {
    gobuild::ensure_built(layout)?;
    let started = Instant::now();
    let bins = real_node.then(|| target_dir().join("debug"));
    let cluster = Cluster::start(layout, bins.as_deref())?;
    eprintln!("cluster ready in {:.1}s", started.elapsed().as_secs_f64());
    let file = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let mut cmd = Command::new(cargo_bin());
    cmd.args(["test", "-p", "gpu-stack-e2e", "--no-fail-fast"]);
    if tests.is_empty() {
        cmd.arg("--tests");
    }
    for t in tests {
        cmd.args(["--test", t]);
    }
    // The tests' `figure:` lines go to the log too.
    cmd.args(["--", "--show-output"]);
    cmd.envs(suite_env(layout, &layout.kubeconfig()))
        .stdout(file.try_clone()?)
        .stderr(file);
    let passed = procs::run_interruptible(&mut cmd);
    if !matches!(passed, Ok(true)) && !procs::interrupted() {
        cluster.print_log_tails(20);
    }
    cluster.stop().context("tearing down the test cluster")?;
    passed.context("running the end-to-end suite")?;
    let text =
        std::fs::read_to_string(log).with_context(|| format!("reading {}", log.display()))?;
    Ok(matrix::parse_outcomes(&text))
}

/// The workspace root.
fn repo_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Cargo's target directory (`CARGO_TARGET_DIR`, or `target/` in the workspace).
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_dir().join("target"))
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
