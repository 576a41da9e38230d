//! Starts and stops the test control plane: etcd, kube-apiserver,
//! kube-controller-manager, kube-scheduler and kwok, each in its own process
//! group on 127.0.0.1, with pid files so a later run can find and stop them.
use std::fs::{self, File};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::gobuild::{self, KWOK_STAGES_FILE};
use crate::layout::{KWOK_NODE_SELECTOR, Layout};
use crate::{node, pki, procs};

/// Components in start order; teardown goes the other way.
const COMPONENTS: [&str; 5] = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
];

/// How long each phase may take on a busy 2-core machine.
const ETCD_TIMEOUT: Duration = Duration::from_secs(60);
const APISERVER_TIMEOUT: Duration = Duration::from_secs(180);
const AGENTS_TIMEOUT: Duration = Duration::from_secs(120);
const STOP_GRACE: Duration = Duration::from_secs(10);

/// API client rate limits for the controllers, scheduler and kwok: a test
/// cluster should be limited by its own work, not by client-side throttling.
const CLIENT_QPS: &str = "200";
const CLIENT_BURST: &str = "400";

/// How long a node may miss heartbeats before it is marked Unknown: longer
/// than the longest gap between kwok's status heartbeats (the
/// `node-heartbeat-with-lease` stage: 600 s plus up to 610 s of jitter).
const NODE_MONITOR_GRACE: &str = "30m";

struct Component {
    name: &'static str,
    child: Child,
}

/// A cluster started by this process. Dropping it without [`Cluster::detach`]
/// stops it.
pub struct Cluster {
    layout: Layout,
    components: Vec<Component>,
    done: bool,
}

impl Cluster {
    /// Checks ports and leftovers, writes certificates and kubeconfig, starts
    /// every component and waits until the cluster serves requests.
    /// With `real_node` (the directory of the project's built binaries), a
    /// real node joins once the control plane serves ([`node::start`]).
    pub fn start(layout: &Layout, real_node: Option<&Path>) -> Result<Self> {
        preflight(layout)?;
        let mut cluster = Cluster {
            layout: layout.clone(),
            components: Vec::new(),
            done: false,
        };
        let booted = cluster.boot().and_then(|()| match real_node {
            Some(bins) => node::start(layout, bins).map(|_| ()),
            None => Ok(()),
        });
        match booted {
            Ok(()) => Ok(cluster),
            Err(err) => {
                if !procs::interrupted() {
                    cluster.print_log_tails(30);
                }
                if let Err(stop_err) = cluster.stop_inner() {
                    eprintln!("xtask: while cleaning up: {stop_err:#}");
                }
                Err(err)
            }
        }
    }

    fn boot(&mut self) -> Result<()> {
        let l = self.layout.clone();
        for dir in [l.pki(), l.logs(), l.pids(), l.state.join("etcd-data")] {
            fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let data = l.state.join("etcd-data");
        fs::set_permissions(&data, fs::Permissions::from_mode(0o700))
            .with_context(|| format!("restricting {}", data.display()))?;
        pki::generate(&l.pki())?;
        write_kubeconfig(&l)?;
        // Every connection of the API server to a node or pod goes through the
        // real node's CONNECT proxy, which reaches only that node's network:
        // nothing is dialled off the machine (kwok nodes' addresses included).
        let egress = l.state.join("egress-selector.yaml");
        fs::write(
            &egress,
            node::egress_selector_config(&node::NodeLayout::new(&l)),
        )
        .with_context(|| format!("writing {}", egress.display()))?;
        let pki = l.pki();
        let p = l.ports;
        let kubeconfig = l.kubeconfig();

        let etcd_url = format!("http://127.0.0.1:{}", p.etcd_client);
        let peer_url = format!("http://127.0.0.1:{}", p.etcd_peer);
        self.spawn(
            "etcd",
            &[
                "--name=gpu-stack-test".into(),
                format!("--data-dir={}", l.state.join("etcd-data").display()),
                format!("--listen-client-urls={etcd_url}"),
                format!("--advertise-client-urls={etcd_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster=gpu-stack-test={peer_url}"),
                "--unsafe-no-fsync=true".into(),
                "--log-level=warn".into(),
            ],
        )?;
        let etcd_health = SocketAddr::from(([127, 0, 0, 1], p.etcd_client));
        self.wait_until("etcd /health", ETCD_TIMEOUT, || {
            http_get(etcd_health, "/health")
                .is_some_and(|(ok, body)| ok && body.contains("\"health\":\"true\""))
        })?;

        self.spawn(
            "kube-apiserver",
            &[
                format!("--etcd-servers={etcd_url}"),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={}", p.apiserver),
                format!("--tls-cert-file={}", pki.join("apiserver.crt").display()),
                format!(
                    "--tls-private-key-file={}",
                    pki.join("apiserver.key").display()
                ),
                format!("--client-ca-file={}", pki.join("ca.crt").display()),
                "--authorization-mode=RBAC".into(),
                "--allow-privileged=true".into(),
                "--service-cluster-ip-range=10.0.0.0/24".into(),
                format!("--service-account-issuer={}", l.apiserver_url()),
                format!(
                    "--service-account-key-file={}",
                    pki.join("sa.pub").display()
                ),
                format!(
                    "--service-account-signing-key-file={}",
                    pki.join("sa.key").display()
                ),
                "--profiling=false".into(),
                format!("--egress-selector-config-file={}", egress.display()),
                "--kubelet-preferred-address-types=InternalIP".into(),
                // The real node's kubelet accepts clients signed by the cluster CA.
                format!(
                    "--kubelet-client-certificate={}",
                    pki.join("admin.crt").display()
                ),
                format!("--kubelet-client-key={}", pki.join("admin.key").display()),
            ]
            .into_iter()
            .chain(feature_gates_flag(&l))
            .collect::<Vec<_>>(),
        )?;
        let kubectl = l.binary("kubectl");
        self.wait_until("kube-apiserver /readyz", APISERVER_TIMEOUT, || {
            kubectl_ok(&kubectl, &kubeconfig, &["get", "--raw", "/readyz"])
        })?;

        let common = |port: u16| -> Vec<String> {
            let mut args = vec![
                format!("--kubeconfig={}", kubeconfig.display()),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={port}"),
                "--leader-elect=false".into(),
                format!("--kube-api-qps={CLIENT_QPS}"),
                format!("--kube-api-burst={CLIENT_BURST}"),
                "--profiling=false".into(),
            ];
            args.extend(feature_gates_flag(&l));
            args
        };
        let mut kcm = common(p.controller_manager);
        kcm.extend([
            format!("--root-ca-file={}", pki.join("ca.crt").display()),
            format!(
                "--service-account-private-key-file={}",
                pki.join("sa.key").display()
            ),
            "--use-service-account-credentials=false".into(),
            // kwok runs without node leases (renewing a thousand every 10 s
            // would be a load of its own on 2 cores) and heartbeats through
            // node status every 10 to 20 minutes. With a shorter grace period
            // nodes go Unknown and their pods lose Ready for good (kwok sets
            // it once). Real kubelets heartbeat on their own machines.
            format!("--node-monitor-grace-period={NODE_MONITOR_GRACE}"),
        ]);
        self.spawn("kube-controller-manager", &kcm)?;
        self.spawn("kube-scheduler", &common(p.scheduler))?;
        self.spawn(
            "kwok",
            &[
                format!("--kubeconfig={}", kubeconfig.display()),
                format!("--config={}", l.binary(KWOK_STAGES_FILE).display()),
                "--manage-all-nodes=false".into(),
                format!("--manage-nodes-with-annotation-selector={KWOK_NODE_SELECTOR}"),
                format!("--server-address=127.0.0.1:{}", p.kwok),
                // Room for one pod IP per pod of a 1,000-node DaemonSet and more.
                "--cidr=10.64.0.0/12".into(),
                "--node-ip=10.63.0.1".into(),
            ],
        )?;
        let kcm_addr = SocketAddr::from(([127, 0, 0, 1], p.controller_manager));
        let scheduler_addr = SocketAddr::from(([127, 0, 0, 1], p.scheduler));
        let kwok_addr = SocketAddr::from(([127, 0, 0, 1], p.kwok));
        self.wait_until(
            "controller-manager, scheduler and kwok to listen",
            AGENTS_TIMEOUT,
            || {
                listening(kcm_addr)
                    && listening(scheduler_addr)
                    && http_get(kwok_addr, "/healthz").is_some_and(|(ok, _)| ok)
            },
        )?;
        // The default service account appears once the controller-manager works;
        // pods cannot be admitted before it exists.
        self.wait_until(
            "the controller-manager to create the default service account",
            AGENTS_TIMEOUT,
            || {
                kubectl_ok(
                    &kubectl,
                    &kubeconfig,
                    &["get", "serviceaccount", "default", "--namespace=default"],
                )
            },
        )?;
        Ok(())
    }

    fn spawn(&mut self, name: &'static str, args: &[String]) -> Result<()> {
        let bin = self.layout.binary(name);
        let log_path = self.layout.logs().join(format!("{name}.log"));
        let log =
            File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
        let log_err = log
            .try_clone()
            .with_context(|| format!("opening {}", log_path.display()))?;
        let child = std::os::unix::process::CommandExt::process_group(
            Command::new(&bin)
                .args(args)
                .current_dir(&self.layout.state)
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(log_err),
            0,
        )
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
        let pid_path = self.layout.pids().join(format!("{name}.pid"));
        let pid = child.id();
        self.components.push(Component { name, child });
        fs::write(&pid_path, format!("{pid}\n"))
            .with_context(|| format!("writing {}", pid_path.display()))?;
        Ok(())
    }

    /// Polls `ready` every 200 ms; fails early when a component exits or the
    /// run is interrupted.
    fn wait_until(
        &mut self,
        what: &str,
        timeout: Duration,
        mut ready: impl FnMut() -> bool,
    ) -> Result<()> {
        let started = Instant::now();
        loop {
            if procs::interrupted() {
                bail!("interrupted while waiting for {what}");
            }
            for component in &mut self.components {
                if let Ok(Some(status)) = component.child.try_wait() {
                    bail!(
                        "{} exited while waiting for {what} ({status}); its log is {}",
                        component.name,
                        self.layout
                            .logs()
                            .join(format!("{}.log", component.name))
                            .display()
                    );
                }
            }
            if ready() {
                return Ok(());
            }
            if started.elapsed() > timeout {
                bail!(
                    "timed out after {}s waiting for {what}; the logs below say why",
                    timeout.as_secs()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Prints the last `lines` lines of every component log to stderr.
    pub fn print_log_tails(&self, lines: usize) {
        for component in &self.components {
            let path = self.layout.logs().join(format!("{}.log", component.name));
            let Ok(text) = fs::read_to_string(&path) else {
                continue;
            };
            let all: Vec<&str> = text.lines().collect();
            let tail = &all[all.len().saturating_sub(lines)..];
            eprintln!("---- last lines of {} ----", path.display());
            for line in tail {
                eprintln!("{line}");
            }
        }
    }

    /// Leaves the processes running (for `cluster up`).
    pub fn detach(mut self) {
        self.done = true;
    }

    /// Stops every process and removes the state directory.
    pub fn stop(mut self) -> Result<()> {
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> Result<()> {
        self.done = true;
        node::cleanup(&node::NodeLayout::new(&self.layout))?;
        let pids: Vec<i32> = self
            .components
            .iter()
            .rev()
            .filter_map(|c| i32::try_from(c.child.id()).ok())
            .collect();
        let components = &mut self.components;
        procs::terminate_groups(&pids, STOP_GRACE, || {
            for c in components.iter_mut() {
                let _ = c.child.try_wait();
            }
        });
        for c in components.iter_mut() {
            let _ = c.child.try_wait();
        }
        down(&self.layout).map(|_| ())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if !self.done
            && let Err(err) = self.stop_inner()
        {
            eprintln!("xtask: stopping the test cluster: {err:#}");
        }
    }
}

/// Refuses to start over a running cluster or a busy port; clears leftovers of
/// a cluster whose processes are all gone.
fn preflight(layout: &Layout) -> Result<()> {
    for name in gobuild::required_files() {
        let path = layout.binary(name);
        if !path.is_file() {
            bail!(
                "{} is missing: run `cargo xtask cluster build`",
                path.display()
            );
        }
    }
    let live = live_processes(layout);
    let complete = COMPONENTS.iter().all(|c| {
        live.iter()
            .any(|(_, exe)| exe.file_name() == Some(c.as_ref()))
    });
    if !live.is_empty() && !complete {
        bail!(
            "processes of an earlier test cluster that did not shut down cleanly are still \
             running from {} ({}). Stop them with `cargo xtask cluster down`, then try again",
            layout.state.display(),
            describe(&live)
        );
    }
    if !live.is_empty() {
        bail!(
            "a test cluster is already running from {} ({}). Use it with `export \
             KUBECONFIG={}`, or stop it with `cargo xtask cluster down`",
            layout.state.display(),
            describe(&live),
            layout.kubeconfig().display()
        );
    }
    if node::leftovers(layout) {
        eprintln!("removing leftovers of an earlier real test node");
        node::cleanup(&node::NodeLayout::new(layout))?;
    }
    if layout.state.exists() {
        // An empty directory (e.g. one made by `mktemp -d` for us) is no leftover.
        let empty = fs::read_dir(&layout.state).is_ok_and(|mut d| d.next().is_none());
        if !empty {
            eprintln!(
                "removing leftovers of a test cluster that did not shut down cleanly: {}",
                layout.state.display()
            );
        }
        fs::remove_dir_all(&layout.state)
            .with_context(|| format!("removing {}", layout.state.display()))?;
    }
    for (component, port) in layout.ports.all() {
        if let Err(err) = TcpListener::bind(("127.0.0.1", port)) {
            let ours = any_control_plane_processes(layout);
            let hint = if ours.is_empty() {
                String::new()
            } else {
                format!(
                    " Control-plane processes from another state directory are running ({}); \
                     stop them with `cargo xtask cluster down --state-dir <their dir>`.",
                    describe(&ours)
                )
            };
            bail!(
                "port {port} on 127.0.0.1 (for {component}) is not free: {err}.{hint} \
                 Otherwise free the port or move the cluster with --port-base N \
                 (or GPU_STACK_CLUSTER_PORT_BASE=N; six ports from N are used)"
            );
        }
    }
    Ok(())
}

/// `--feature-gates=...` for every component, where the release needs any
/// (the same gates everywhere, the real node's kubelet included, so no
/// component sees a different API).
fn feature_gates_flag(layout: &Layout) -> Option<String> {
    let gates = layout.kube.feature_gates;
    (!gates.is_empty()).then(|| format!("--feature-gates={gates}"))
}

/// Processes of the cluster in `layout.state`, from pid files and /proc
/// (whichever release's binaries run it).
fn live_processes(layout: &Layout) -> Vec<(i32, PathBuf)> {
    let bins = layout.bins_root();
    let mut found = procs::find_cluster_processes(&bins, &layout.state);
    for name in COMPONENTS {
        let Ok(text) = fs::read_to_string(layout.pids().join(format!("{name}.pid"))) else {
            continue;
        };
        let Ok(pid) = text.trim().parse::<i32>() else {
            continue;
        };
        if procs::alive(pid)
            && let Some(exe) = procs::exe(pid)
            && exe.file_name() == Some(std::ffi::OsStr::new(name))
            && exe.parent().and_then(Path::parent) == Some(bins.as_path())
            && !found.iter().any(|(p, _)| *p == pid)
        {
            found.push((pid, exe));
        }
    }
    found.sort();
    found
}

fn any_control_plane_processes(layout: &Layout) -> Vec<(i32, PathBuf)> {
    procs::find_cluster_processes(&layout.bins_root(), Path::new(""))
}

fn describe(procs: &[(i32, PathBuf)]) -> String {
    procs
        .iter()
        .map(|(pid, exe)| {
            let name = exe
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            format!("{name} pid {pid}")
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Stops every process of the cluster in `layout.state` and removes the state
/// directory. Returns how many processes were stopped.
pub fn down(layout: &Layout) -> Result<usize> {
    // The real node first: its kubelet talks to the API server.
    node::cleanup(&node::NodeLayout::new(layout))?;
    let live = live_processes(layout);
    let pids: Vec<i32> = live.iter().map(|(pid, _)| *pid).collect();
    let stopped = procs::terminate_groups(&pids, STOP_GRACE, || {});
    let still: Vec<_> = pids.iter().filter(|p| procs::alive(**p)).collect();
    if !still.is_empty() {
        bail!(
            "could not stop control-plane processes {still:?}; kill them by pid and run \
             `cargo xtask cluster down` again"
        );
    }
    if layout.state.exists() {
        fs::remove_dir_all(&layout.state)
            .with_context(|| format!("removing {}", layout.state.display()))?;
    }
    Ok(stopped)
}

/// The kubeconfig of a fully running cluster started by `cluster up`, `None`
/// when no process of it is alive, an error when it is only partly running.
pub fn running(layout: &Layout) -> Result<Option<PathBuf>> {
    let live = live_processes(layout);
    if live.is_empty() {
        return Ok(None);
    }
    let names: Vec<String> = live
        .iter()
        .filter_map(|(_, exe)| exe.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    let complete = COMPONENTS.iter().all(|c| names.iter().any(|n| n == c));
    let kubeconfig = layout.kubeconfig();
    if !complete
        || !kubeconfig.is_file()
        || !kubectl_ok(
            &layout.binary("kubectl"),
            &kubeconfig,
            &["get", "--raw", "/readyz"],
        )
    {
        bail!(
            "the test cluster in {} is only partly running ({}); stop it with \
             `cargo xtask cluster down` and try again",
            layout.state.display(),
            describe(&live)
        );
    }
    Ok(Some(kubeconfig))
}

/// Prints whether a cluster runs and how to use it.
pub fn status(layout: &Layout) -> Result<()> {
    let live = live_processes(layout);
    if live.is_empty() {
        if layout.state.exists() {
            println!(
                "not running; leftovers of an earlier cluster are in {} (`cargo xtask \
                 cluster down` removes them, `cluster up` does too)",
                layout.state.display()
            );
        } else {
            println!("not running");
        }
        return Ok(());
    }
    match running(layout) {
        Ok(_) => {
            println!(
                "running at {} ({})",
                layout.apiserver_url(),
                describe(&live)
            );
            println!("export KUBECONFIG={}", layout.kubeconfig().display());
        }
        Err(err) => println!("{err:#}"),
    }
    Ok(())
}

fn write_kubeconfig(layout: &Layout) -> Result<()> {
    let pki = layout.pki();
    let text = format!(
        "apiVersion: v1\n\
         kind: Config\n\
         clusters:\n\
         - name: gpu-stack-test\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\n\
         users:\n\
         - name: gpu-stack-admin\n  user:\n    client-certificate: {crt}\n    client-key: {key}\n\
         contexts:\n\
         - name: gpu-stack-test\n  context:\n    cluster: gpu-stack-test\n    user: gpu-stack-admin\n\
         current-context: gpu-stack-test\n",
        server = layout.apiserver_url(),
        ca = pki.join("ca.crt").display(),
        crt = pki.join("admin.crt").display(),
        key = pki.join("admin.key").display(),
    );
    let path = layout.kubeconfig();
    fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
}

fn kubectl_ok(kubectl: &Path, kubeconfig: &Path, args: &[&str]) -> bool {
    Command::new(kubectl)
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg("--request-timeout=5s")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn listening(addr: SocketAddr) -> bool {
    TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
}

/// Minimal HTTP/1.0 GET over loopback: (2xx status, body).
fn http_get(addr: SocketAddr, path: &str) -> Option<(bool, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    stream
        .set_write_timeout(Some(Duration::from_secs(2)))
        .ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let ok = head
        .split_whitespace()
        .nth(1)
        .is_some_and(|code| code.starts_with('2'));
    Some((ok, body.to_string()))
}
