//! The real test node: a kubelet built from the control plane's Go module and
//! containerd 1.7 with runc, in a network namespace and a mount namespace of
//! their own, so the host keeps its own `/run`, `/var/lib` and `/var/log` and
//! no address of the node exists outside the namespace.
//!
//! How it is wired (everything under `<state>/node`):
//! - network: namespace `gpu-stack-<port base>` with a bridge holding the node
//!   address ([`NODE_IP`]); pods get addresses on it from the CNI bridge
//!   plugin. The namespace has no route out. The service address of the API
//!   server ([`SERVICE_IP`]:443) and `127.0.0.1:<apiserver port>` inside it
//!   are served by a forwarder that reaches the host's API server through a
//!   unix socket; the API server reaches the kubelet and pods through an HTTP
//!   CONNECT proxy on a unix socket inside the namespace (its egress selector),
//!   which accepts only the node's subnet. So no packet leaves the machine.
//! - mounts: a persistent mount namespace where `root/run`, `root/var/lib`,
//!   `root/var/log` and `root/etc/containerd` are bound over `/run`,
//!   `/var/lib`, `/var/log` and `/etc/containerd` (the kubelet always uses
//!   `/var/lib/kubelet/device-plugins`; the toolkit agent edits containerd's
//!   config at its default path).
//! - containerd: a plain user's config (no CDI, no `nvidia` runtime), started
//!   again whenever it exits, as its systemd unit would.
//! - cgroups: the kubelet's cgroup root is `/gpu-stack-<port base>` in every
//!   hierarchy, removed on teardown.
//! - a simulated GPU host: under `/run/gpu-stack-sim` the GPUs' device nodes
//!   (`dev/nvidia*`) for CDI injection and the PCI entries of a sysfs tree
//!   (`sys/bus/pci/devices`) for node discovery; the fleet file with this
//!   node's GPUs in `/run/nvidia/validations/gpu-stack-sim`.
use std::fs;
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::images;
use crate::layout::Layout;
use crate::procs;

/// Name of the real node.
pub const NODE_NAME: &str = "gpu-node-real";
/// The node's address, on the bridge inside its network namespace.
pub const NODE_IP: &str = "10.250.0.1";
/// Pod addresses, from the node's bridge.
const POD_SUBNET: &str = "10.250.0.0/24";
/// First address of the API server's service range (`kubernetes.default`).
pub const SERVICE_IP: &str = "10.0.0.1";
const BRIDGE: &str = "gsnode0";
/// GPUs of the simulated host: one HGX-like H100 node (PCI id 10de:2330).
const SIM_GPUS: u32 = 2;
const SIM_MODEL: &str = "H100-SXM5-80GB";
const SIM_PCI_DEVICE: &str = "0x2330";
/// Inside the node: the simulated GPU host's device nodes and sysfs tree.
pub const SIM_DIR: &str = "/run/gpu-stack-sim";
/// Inside the node: the fleet file (and the operands' shared state file)
/// live in the validations directory, the one host directory every operand
/// container mounts writable.
pub const SIM_SHARED_DIR: &str = "/run/nvidia/validations/gpu-stack-sim";

const NODE_TIMEOUT: Duration = Duration::from_secs(120);
const STOP_GRACE: Duration = Duration::from_secs(10);
/// Debian packages the node needs: runc, the CNI plugins, and busybox for the
/// workload image.
const DEBIAN_PACKAGES: [(&str, &str); 3] = [
    ("/usr/sbin/runc", "runc"),
    ("/usr/lib/cni/bridge", "containernetworking-plugins"),
    ("/bin/busybox", "busybox-static"),
];

/// Paths and names of the node of one cluster.
#[derive(Clone, Debug)]
pub struct NodeLayout {
    /// `<state>/node`.
    pub dir: PathBuf,
    /// Network namespace name.
    pub netns: String,
    /// cgroup root of the kubelet (`/gpu-stack-<port base>`).
    pub cgroup_root: String,
    apiserver_port: u16,
    bin: PathBuf,
    pki: PathBuf,
    kubeconfig: PathBuf,
    pids: PathBuf,
    logs: PathBuf,
    feature_gates: &'static str,
    containerd_config_version: u32,
}

impl NodeLayout {
    pub fn new(layout: &Layout) -> Self {
        let id = layout.ports.etcd_client;
        Self {
            dir: layout.state.join("node"),
            netns: format!("gpu-stack-{id}"),
            cgroup_root: format!("/gpu-stack-{id}"),
            apiserver_port: layout.ports.apiserver,
            bin: layout.bin(),
            pki: layout.pki(),
            kubeconfig: layout.kubeconfig(),
            pids: layout.pids(),
            logs: layout.logs(),
            feature_gates: layout.kube.feature_gates,
            containerd_config_version: layout.containerd.config_version,
        }
    }

    /// The host path of a path inside the node (`/run`, `/var/lib`, `/var/log`).
    pub fn host_path(&self, inside: &str) -> PathBuf {
        self.dir.join("root").join(inside.trim_start_matches('/'))
    }

    fn mount_ns(&self) -> PathBuf {
        self.dir.join("ns").join("mnt")
    }

    fn netns_path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.netns)
    }

    /// Socket of the host side of the API server forwarder.
    fn apiserver_socket(&self) -> PathBuf {
        self.dir.join("apiserver.sock")
    }

    /// Socket of the API server's egress proxy into the node.
    pub fn egress_socket(&self) -> PathBuf {
        self.dir.join("egress.sock")
    }

    fn containerd_socket(&self) -> PathBuf {
        self.host_path("/run/containerd/containerd.sock")
    }

    /// Script that starts a node process; kept so tests can restart it.
    pub fn start_script(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.sh"))
    }
}

/// The egress selector configuration the API server starts with: every
/// connection to nodes and pods goes through the node's CONNECT proxy.
pub fn egress_selector_config(node: &NodeLayout) -> String {
    format!(
        "apiVersion: apiserver.k8s.io/v1beta1\n\
         kind: EgressSelectorConfiguration\n\
         egressSelections:\n\
         - name: cluster\n  connection:\n    proxyProtocol: HTTPConnect\n    transport:\n      uds:\n        udsName: {}\n",
        node.egress_socket().display()
    )
}

/// Debian packages the exporter's tests need: a real Prometheus and promtool.
pub const PROMETHEUS_PACKAGES: [(&str, &str); 1] = [("/usr/bin/promtool", "prometheus")];

/// Installs the Debian packages the node needs when they are missing.
pub fn ensure_packages() -> Result<()> {
    ensure_debian_packages(&DEBIAN_PACKAGES)
}

/// Installs those of `packages` (file it provides, package) whose file is
/// missing, with apt-get when running as root; otherwise says what to install.
pub fn ensure_debian_packages(packages: &[(&str, &str)]) -> Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .filter(|(path, _)| !Path::new(path).exists())
        .map(|(_, package)| *package)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !nix::unistd::Uid::effective().is_root() {
        bail!(
            "the tests need the Debian packages {}: install them \
             (`sudo apt-get install {}`) or run as root, which installs them",
            missing.join(", "),
            missing.join(" ")
        );
    }
    eprintln!(
        "installing Debian packages for the real node: {}",
        missing.join(" ")
    );
    run(Command::new("apt-get").args(["update", "-qq"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

fn run(cmd: &mut Command) -> Result<()> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn ip(args: &[&str]) -> Result<()> {
    run(Command::new("ip").args(args))
}

/// Starts the node against the running control plane and waits until its
/// Node is Ready. `bin_dir` holds the project's built binaries (for images).
pub fn start(layout: &Layout, cargo_bin_dir: &Path) -> Result<NodeLayout> {
    if !nix::unistd::Uid::effective().is_root() {
        bail!(
            "the real test node needs root (network and mount namespaces, cgroups, \
             containerd): run as root, or leave the real node out (`cargo xtask test \
             --no-real-node`, or `cargo xtask cluster up` without --real-node)"
        );
    }
    ensure_packages()?;
    let node = NodeLayout::new(layout);
    cleanup(&node)?;
    let started = Instant::now();
    for inside in [
        "/run/containerd",
        "/run/netns",
        "/var/lib/kubelet",
        "/var/lib/containerd",
        "/var/lib/cni",
        "/var/log/pods",
        // The runtime's CDI directory (`/var/run` is `/run` on Debian).
        "/run/cdi",
    ] {
        let path = node.host_path(inside);
        fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
    }
    fs::create_dir_all(node.dir.join("ns"))?;
    fs::create_dir_all(node.dir.join("cni"))?;
    write_sim_host(&node)?;
    write_configs(&node)?;
    network_up(&node)?;
    mount_ns_up(&node)?;
    cgroups_up(&node)?;

    let xtask = std::env::current_exe().context("locating the xtask binary")?;
    let api = format!("127.0.0.1:{}", node.apiserver_port);
    // Host side: the node's forwarder connects here, we connect to the API server.
    spawn(
        &node,
        "node-apiserver-bridge",
        &[
            xtask.display().to_string(),
            "node-proxy".into(),
            format!("--listen-unix={}", node.apiserver_socket().display()),
            format!("--to-tcp={api}"),
        ],
        false,
    )?;
    wait_for(&node, "the API server bridge socket", || {
        node.apiserver_socket().exists()
    })?;
    spawn(
        &node,
        "node-apiserver-forward",
        &[
            xtask.display().to_string(),
            "node-proxy".into(),
            format!("--listen-tcp={api}"),
            format!("--listen-tcp={SERVICE_IP}:443"),
            format!("--to-unix={}", node.apiserver_socket().display()),
        ],
        true,
    )?;
    spawn(
        &node,
        "node-egress",
        &[
            xtask.display().to_string(),
            "node-proxy".into(),
            format!("--connect-unix={}", node.egress_socket().display()),
            format!("--allow={POD_SUBNET}"),
        ],
        true,
    )?;
    spawn_supervised(
        &node,
        "containerd",
        &[
            node.bin.join("containerd").display().to_string(),
            format!("--config={CONTAINERD_CONFIG}"),
        ],
    )?;
    wait_for(&node, "containerd's socket", || {
        ctr(&node, &["version"]).is_ok()
    })?;
    let archive = node.dir.join("images.tar");
    let names = images::build(&layout.repo, cargo_bin_dir, &archive)?;
    ctr(&node, &["images", "import", &archive.display().to_string()])
        .context("importing the project's images into containerd")?;
    fs::remove_file(&archive).ok();
    eprintln!("real node: imported {} images", names.len());

    spawn(
        &node,
        "kubelet",
        &[
            node.bin.join("kubelet").display().to_string(),
            format!("--config={}", node.dir.join("kubelet.yaml").display()),
            format!("--kubeconfig={}", node.kubeconfig.display()),
            format!("--hostname-override={NODE_NAME}"),
            format!("--node-ip={NODE_IP}"),
            "--v=1".into(),
        ],
        true,
    )?;
    let kubectl = node.bin.join("kubectl");
    wait_for(&node, "the real node to be Ready", || {
        Command::new(&kubectl)
            .arg(format!("--kubeconfig={}", node.kubeconfig.display()))
            .args([
                "get",
                "node",
                NODE_NAME,
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
            ])
            .stderr(Stdio::null())
            .output()
            .is_ok_and(|o| o.status.success() && o.stdout == b"True")
    })?;
    eprintln!(
        "real node {NODE_NAME} Ready in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    Ok(node)
}

fn ctr(node: &NodeLayout, args: &[&str]) -> Result<()> {
    run(Command::new(node.bin.join("ctr"))
        .arg(format!("--address={}", node.containerd_socket().display()))
        .args(["--namespace", "k8s.io"])
        .args(args))
}

fn wait_for(node: &NodeLayout, what: &str, mut ready: impl FnMut() -> bool) -> Result<()> {
    let started = Instant::now();
    loop {
        if procs::interrupted() {
            bail!("interrupted while waiting for {what}");
        }
        if ready() {
            return Ok(());
        }
        for name in [
            "containerd",
            "kubelet",
            "node-apiserver-forward",
            "node-egress",
        ] {
            if let Some(pid) = read_pid(node, name)
                && !procs::alive(pid)
            {
                bail!(
                    "{name} exited while waiting for {what}; its log is {}",
                    node.logs.join(format!("{name}.log")).display()
                );
            }
        }
        if started.elapsed() > NODE_TIMEOUT {
            bail!(
                "timed out after {}s waiting for {what}; see the logs in {}",
                NODE_TIMEOUT.as_secs(),
                node.logs.display()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Writes the start script of a node process and starts it in its own
/// process group (inside the node's namespaces when `inside`); the pid file
/// holds the process itself (the script `exec`s it).
fn spawn(node: &NodeLayout, name: &str, argv: &[String], inside: bool) -> Result<()> {
    spawn_with(node, name, argv, inside, false)
}

/// Like [`spawn`], started again one second after it exits, as systemd's
/// `Restart=always` does for containerd: the toolkit agent restarts the
/// runtime by signalling it. The running process's pid is in
/// `pids/<name>.main.pid`.
fn spawn_supervised(node: &NodeLayout, name: &str, argv: &[String]) -> Result<()> {
    spawn_with(node, name, argv, true, true)
}

fn spawn_with(
    node: &NodeLayout,
    name: &str,
    argv: &[String],
    inside: bool,
    supervised: bool,
) -> Result<()> {
    let mut line = String::from(if supervised { "" } else { "exec" });
    if inside {
        line.push_str(&format!(
            " nsenter --net={} --mount={} --",
            node.netns_path().display(),
            node.mount_ns().display()
        ));
    }
    for arg in argv {
        line.push(' ');
        line.push_str(&shell_quote(arg));
    }
    let log = shell_quote(&node.logs.join(format!("{name}.log")).display().to_string());
    let run = if supervised {
        let main_pid = node.pids.join(format!("{name}.main.pid"));
        format!(
            "while :; do\n  {line} >>{log} 2>&1 &\n  echo $! >{pid}\n  wait $!\n  sleep 1\ndone\n",
            line = line.trim_start(),
            pid = shell_quote(&main_pid.display().to_string()),
        )
    } else {
        format!("{line} >>{log} 2>&1\n")
    };
    let script = format!(
        "#!/bin/sh\n# Starts {name} of the real test node (written by cargo xtask).\n\
         cd {dir}\nexport PATH={bin}:/usr/sbin:/usr/bin:/sbin:/bin\n{run}",
        dir = shell_quote(&node.dir.display().to_string()),
        bin = shell_quote(&node.bin.display().to_string()),
    );
    let path = node.start_script(name);
    fs::write(&path, script).with_context(|| format!("writing {}", path.display()))?;
    fs::set_permissions(&path, fs::Permissions::from_mode(0o755))?;
    let child = std::os::unix::process::CommandExt::process_group(
        Command::new("/bin/sh")
            .arg(&path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
        0,
    )
    .spawn()
    .with_context(|| format!("starting {name}"))?;
    let pid_path = node.pids.join(format!("{name}.pid"));
    fs::write(&pid_path, format!("{}\n", child.id()))
        .with_context(|| format!("writing {}", pid_path.display()))?;
    // The child is reaped by whoever waits on the process group at teardown;
    // dropping the handle does not kill it.
    drop(child);
    Ok(())
}

fn shell_quote(s: &str) -> String {
    if s.chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@+".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

fn read_pid(node: &NodeLayout, name: &str) -> Option<i32> {
    fs::read_to_string(node.pids.join(format!("{name}.pid")))
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn network_up(node: &NodeLayout) -> Result<()> {
    let ns = node.netns.as_str();
    ip(&["netns", "add", ns]).context("creating the node's network namespace")?;
    ip(&["-n", ns, "link", "set", "lo", "up"])?;
    ip(&[
        "-n",
        ns,
        "addr",
        "add",
        &format!("{SERVICE_IP}/32"),
        "dev",
        "lo",
    ])?;
    ip(&["-n", ns, "link", "add", BRIDGE, "type", "bridge"])?;
    ip(&[
        "-n",
        ns,
        "addr",
        "add",
        &format!("{NODE_IP}/24"),
        "dev",
        BRIDGE,
    ])?;
    ip(&["-n", ns, "link", "set", BRIDGE, "up"])?;
    Ok(())
}

/// containerd's config file inside the node (its default path).
pub const CONTAINERD_CONFIG: &str = "/etc/containerd/config.toml";
/// The host directory the node's `/etc/containerd` is mounted on.
const HOST_CONTAINERD_ETC: &str = "/etc/containerd";
/// Marks that the node's start created [`HOST_CONTAINERD_ETC`].
const CREATED_ETC_MARKER: &str = "created-etc-containerd";
/// The syslog socket NVIDIA's driver pod mounts (a hostPath of no type):
/// where the host has none, containerd creates it as a directory in the
/// host's /dev, which the node shares.
const DEV_LOG: &str = "/dev/log";
/// Marks that the host had no [`DEV_LOG`] when the node started, so
/// `cleanup` removes the directory a driver pod left there.
const NO_DEV_LOG_MARKER: &str = "host-without-dev-log";

fn mount_ns_up(node: &NodeLayout) -> Result<()> {
    let ns_dir = node.dir.join("ns");
    let dir = ns_dir.display().to_string();
    // A namespace file may only be bound on a private mount.
    run(Command::new("mount").args(["--bind", &dir, &dir]))?;
    run(Command::new("mount").args(["--make-private", &dir]))?;
    fs::File::create(node.mount_ns())?;
    // The node's /etc/containerd is its own (the toolkit agent edits it); the
    // host only needs the mount point, removed again by `cleanup`.
    if !Path::new(HOST_CONTAINERD_ETC).exists() {
        fs::create_dir(HOST_CONTAINERD_ETC)
            .with_context(|| format!("creating the mount point {HOST_CONTAINERD_ETC}"))?;
        fs::write(node.dir.join(CREATED_ETC_MARKER), "")?;
    }
    if !Path::new(DEV_LOG).exists() {
        fs::write(node.dir.join(NO_DEV_LOG_MARKER), "")?;
    }
    run(Command::new("unshare")
        .arg(format!("--mount={}", node.mount_ns().display()))
        .args(["--propagation", "private", "true"]))
    .context("creating the node's mount namespace")?;
    let script = format!(
        "set -e\n\
         mount --bind {run} /run\n\
         mount --bind {lib} /var/lib\n\
         mount --bind {log} /var/log\n\
         mount --bind {etc} /etc/containerd\n\
         mount --make-rshared /\n",
        run = shell_quote(&node.host_path("/run").display().to_string()),
        lib = shell_quote(&node.host_path("/var/lib").display().to_string()),
        log = shell_quote(&node.host_path("/var/log").display().to_string()),
        etc = shell_quote(&node.host_path("/etc/containerd").display().to_string()),
    );
    // The namespace's mounts are its own copies (the host's stay private to
    // the host), so making them shared inside lets pods use HostToContainer
    // and Bidirectional propagation, as on a systemd host, without anything
    // reaching the host.
    run(Command::new("nsenter")
        .arg(format!("--mount={}", node.mount_ns().display()))
        .args(["--", "/bin/sh", "-c", &script]))
    .context("mounting the node's /run, /var/lib and /var/log")
}

/// Mount points of every cgroup hierarchy (v1 controllers and the unified one).
fn cgroup_mounts() -> Vec<PathBuf> {
    let Ok(text) = fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for line in text.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let fstype = right.split_whitespace().next().unwrap_or("");
        if (fstype == "cgroup" || fstype == "cgroup2")
            && let Some(point) = left.split_whitespace().nth(4)
        {
            out.push(PathBuf::from(point));
        }
    }
    out.sort();
    out.dedup();
    out
}

fn cgroups_up(node: &NodeLayout) -> Result<()> {
    let name = node.cgroup_root.trim_start_matches('/');
    for mount in cgroup_mounts() {
        let dir = mount.join(name);
        fs::create_dir_all(&dir).with_context(|| format!("creating cgroup {}", dir.display()))?;
        // A v1 cpuset cgroup takes tasks only once it has CPUs and memory nodes.
        for file in ["cpuset.cpus", "cpuset.mems"] {
            if let Ok(parent) = fs::read_to_string(mount.join(file)) {
                fs::write(dir.join(file), parent.trim())
                    .with_context(|| format!("initialising {}", dir.join(file).display()))?;
            }
        }
    }
    Ok(())
}

/// Every cgroup directory under the node's root, deepest first.
fn node_cgroups(node: &NodeLayout) -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        if let Ok(entries) = fs::read_dir(dir) {
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    walk(&entry.path(), out);
                }
            }
        }
        out.push(dir.to_path_buf());
    }
    let name = node.cgroup_root.trim_start_matches('/');
    let mut out = Vec::new();
    for mount in cgroup_mounts() {
        let root = mount.join(name);
        if root.is_dir() {
            walk(&root, &mut out);
        }
    }
    out
}

fn cgroup_pids(dirs: &[PathBuf]) -> Vec<i32> {
    let mut pids: Vec<i32> = dirs
        .iter()
        .filter_map(|d| fs::read_to_string(d.join("cgroup.procs")).ok())
        .flat_map(|text| {
            text.lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect();
    pids.sort();
    pids.dedup();
    pids
}

/// Processes whose network namespace is the node's (the kubelet, containerd,
/// its shims and the forwarders).
fn netns_pids(node: &NodeLayout) -> Vec<i32> {
    let Ok(target) = fs::metadata(node.netns_path()) else {
        return Vec::new();
    };
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            fs::metadata(format!("/proc/{pid}/ns/net"))
                .is_ok_and(|m| m.ino() == target.ino() && m.dev() == target.dev())
        })
        .collect()
}

fn kill_all(pids: &[i32], signal: nix::sys::signal::Signal) {
    for pid in pids {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), signal);
    }
}

/// Stops every process of the node and removes its namespaces, mounts and
/// cgroups. Safe to call when nothing of the node exists.
pub fn cleanup(node: &NodeLayout) -> Result<()> {
    use nix::sys::signal::Signal;
    // The kubelet first, so it restarts nothing; then the containers, then
    // containerd, its shims and the forwarders.
    if let Some(pid) = read_pid(node, "kubelet") {
        procs::terminate_groups(&[pid], STOP_GRACE, || {});
    }
    for _ in 0..50 {
        let pids = cgroup_pids(&node_cgroups(node));
        if pids.is_empty() {
            break;
        }
        kill_all(&pids, Signal::SIGKILL);
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut daemons: Vec<i32> = [
        "containerd",
        "node-egress",
        "node-apiserver-forward",
        "node-apiserver-bridge",
    ]
    .iter()
    .filter_map(|name| read_pid(node, name))
    .collect();
    daemons.retain(|p| procs::alive(*p));
    procs::terminate_groups(&daemons, STOP_GRACE, || {});
    for _ in 0..50 {
        let pids = netns_pids(node);
        if pids.is_empty() {
            break;
        }
        kill_all(&pids, Signal::SIGKILL);
        std::thread::sleep(Duration::from_millis(100));
    }
    let ns_file = node.mount_ns();
    let ns_dir = node.dir.join("ns");
    for path in [&ns_file, &ns_dir] {
        if is_mount_point(path) {
            run(Command::new("umount").arg("--lazy").arg(path))
                .with_context(|| format!("unmounting {}", path.display()))?;
        }
    }
    if node.netns_path().exists() {
        ip(&["netns", "del", &node.netns]).context("removing the node's network namespace")?;
    }
    if node.dir.join(CREATED_ETC_MARKER).exists() {
        // Only if still empty: another node may use it as its mount point.
        if fs::remove_dir(HOST_CONTAINERD_ETC).is_ok() || !Path::new(HOST_CONTAINERD_ETC).exists() {
            fs::remove_file(node.dir.join(CREATED_ETC_MARKER)).ok();
        }
    }
    if node.dir.join(NO_DEV_LOG_MARKER).exists() {
        // Only an empty directory: a socket or files are someone else's.
        if fs::remove_dir(DEV_LOG).is_ok() || !Path::new(DEV_LOG).exists() {
            fs::remove_file(node.dir.join(NO_DEV_LOG_MARKER)).ok();
        }
    }
    for dir in node_cgroups(node) {
        // A cgroup disappears once its last task is gone; retry briefly.
        for _ in 0..50 {
            if fs::remove_dir(&dir).is_ok() || !dir.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if dir.exists() {
            bail!(
                "could not remove cgroup {}: processes are still in it ({:?})",
                dir.display(),
                cgroup_pids(std::slice::from_ref(&dir))
            );
        }
    }
    Ok(())
}

fn is_mount_point(path: &Path) -> bool {
    let Ok(text) = fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let target = path.display().to_string();
    text.lines()
        .any(|l| l.split_whitespace().nth(4) == Some(target.as_str()))
}

/// True when anything of the node of `layout` is left (namespace, cgroup).
pub fn leftovers(layout: &Layout) -> bool {
    let node = NodeLayout::new(layout);
    node.netns_path().exists() || !node_cgroups(&node).is_empty()
}

fn write_configs(node: &NodeLayout) -> Result<()> {
    let containerd = containerd_config(
        node.containerd_config_version,
        &images::pause_image(),
        &node.dir.join("cni").display().to_string(),
    );
    let etc = node.host_path(CONTAINERD_CONFIG);
    if let Some(dir) = etc.parent() {
        fs::create_dir_all(dir)?;
    }
    fs::write(&etc, containerd)?;
    let cni = format!(
        r#"{{
  "cniVersion": "1.0.0",
  "name": "gpu-stack-node",
  "plugins": [
    {{
      "type": "bridge",
      "bridge": "{BRIDGE}",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {{
        "type": "host-local",
        "ranges": [[{{"subnet": "{POD_SUBNET}", "rangeStart": "10.250.0.10", "rangeEnd": "10.250.0.250", "gateway": "{NODE_IP}"}}]],
        "routes": [{{"dst": "0.0.0.0/0"}}]
      }}
    }}
  ]
}}
"#
    );
    fs::write(node.dir.join("cni").join("10-gpu-stack.conflist"), cni)?;
    // Pods get no name servers: nothing may be resolved off the machine.
    fs::write(node.dir.join("resolv.conf"), "")?;
    let kubelet = format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {NODE_IP}
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: false
  x509:
    clientCAFile: {ca}
authorization:
  mode: AlwaysAllow
cgroupDriver: cgroupfs
cgroupRoot: {cgroup_root}
cgroupsPerQOS: true
enforceNodeAllocatable: [pods]
# The machine's cgroups are v1 (hybrid).
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
resolvConf: {resolv}
# The images are imported, never pulled: never collect them.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
localStorageCapacityIsolation: false
serializeImagePulls: false
maxPods: 110
# One node: report allocatable changes (device health) within 2 s.
nodeStatusUpdateFrequency: 2s
{gates}"#,
        ca = node.pki.join("ca.crt").display(),
        cgroup_root = node.cgroup_root,
        resolv = node.dir.join("resolv.conf").display(),
        gates = kubelet_feature_gates(node.feature_gates),
    );
    fs::write(node.dir.join("kubelet.yaml"), kubelet)?;
    Ok(())
}

/// A plain containerd config as a user has it, in the config version the
/// release reads (its `containerd config default` shape): no CDI, no
/// `nvidia` runtime, no `imports`. The toolkit agent adds those.
fn containerd_config(version: u32, pause: &str, cni: &str) -> String {
    let header = format!(
        "# containerd of the real test node (written by cargo xtask).\n\
         version = {version}\n\
         root = \"/var/lib/containerd\"\n\
         state = \"/run/containerd\"\n\n\
         [grpc]\n  address = \"/run/containerd/containerd.sock\"\n\n"
    );
    // The machine lacks CAP_SYS_RESOURCE: runc may not raise oom_score_adj.
    let body = if version >= 3 {
        format!(
            r#"[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{pause}"

[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "{cni}"
"#
        )
    } else {
        format!(
            r#"[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni}"
"#
        )
    };
    header + &body
}

/// `A=true,B=false` as a KubeletConfiguration `featureGates` map (the
/// kubelet's --feature-gates flag is deprecated), or nothing without gates.
fn kubelet_feature_gates(gates: &str) -> String {
    let entries: String = gates
        .split(',')
        .filter_map(|g| g.split_once('='))
        .map(|(name, value)| format!("  {}: {}\n", name.trim(), value.trim()))
        .collect();
    if entries.is_empty() {
        return String::new();
    }
    format!("# The control plane's gates.\nfeatureGates:\n{entries}")
}

/// The simulated GPU host under [`SIM_DIR`]: fleet file, device nodes, sysfs
/// PCI entries.
fn write_sim_host(node: &NodeLayout) -> Result<()> {
    let sim = node.host_path(SIM_DIR);
    fs::create_dir_all(sim.join("dev"))?;
    let fleet = format!(
        "# The real test node's simulated GPUs (written by cargo xtask).\n\
         nodes:\n  - name: {NODE_NAME}\n    gpus:\n      - model: {SIM_MODEL}\n        count: {SIM_GPUS}\n"
    );
    let shared = node.host_path(SIM_SHARED_DIR);
    fs::create_dir_all(&shared)?;
    fs::write(shared.join("fleet.yaml"), fleet)?;
    let mut nodes: Vec<(String, u64)> = (0..SIM_GPUS)
        .map(|i| (format!("nvidia{i}"), u64::from(i)))
        .collect();
    nodes.push(("nvidiactl".into(), 255));
    for (name, minor) in nodes {
        let path = sim.join("dev").join(&name);
        if !fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_char_device()) {
            nix::sys::stat::mknod(
                &path,
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::from_bits_truncate(0o666),
                nix::sys::stat::makedev(195, minor),
            )
            .with_context(|| format!("creating device node {}", path.display()))?;
        }
    }
    for i in 0..SIM_GPUS {
        let dev = sim.join(format!("sys/bus/pci/devices/0000:{:02x}:00.0", 0x18 + i));
        fs::create_dir_all(&dev)?;
        for (file, value) in [
            ("vendor", "0x10de"),
            ("device", SIM_PCI_DEVICE),
            ("class", "0x030200"),
        ] {
            let mut f = fs::File::create(dev.join(file))?;
            writeln!(f, "{value}")?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_leaves_plain_words_and_quotes_the_rest() {
        assert_eq!(shell_quote("--config=/a/b.toml"), "--config=/a/b.toml");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
    }

    #[test]
    fn egress_config_names_the_proxy_socket() {
        let layout = Layout::new(
            Some("/tmp/x".into()),
            Some("/tmp/c".into()),
            26440,
            crate::versions::KUBE_RELEASES[0],
            crate::versions::CONTAINERD_RELEASES[0],
        )
        .unwrap();
        let node = NodeLayout::new(&layout);
        let text = egress_selector_config(&node);
        assert!(text.contains("proxyProtocol: HTTPConnect"));
        assert!(text.contains("udsName: /tmp/x/node/egress.sock"));
    }

    #[test]
    fn feature_gates_become_kubelet_config_map_entries() {
        assert!(
            kubelet_feature_gates("A=true, B=false")
                .ends_with("featureGates:\n  A: true\n  B: false\n")
        );
        assert_eq!(kubelet_feature_gates(""), "");
    }

    #[test]
    fn containerd_config_matches_the_release() {
        let v3 = containerd_config(3, "pause:1", "/cni");
        assert!(v3.contains("version = 3\n"));
        assert!(v3.contains("[plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.runc]"));
        assert!(v3.contains("sandbox = \"pause:1\""));
        assert!(!v3.contains("imports") && !v3.contains("enable_cdi"));
        let v2 = containerd_config(2, "pause:1", "/cni");
        assert!(v2.contains("version = 2\n") && v2.contains("sandbox_image = \"pause:1\""));
    }
}
