//! `gpu-stack node-discovery` against the real test control plane.
//!
//! Each test creates kwok nodes without NFD's labels and runs the agent as a
//! process against a fake host: a sysfs tree in a temp directory (an H100 and
//! a host bridge, linked from `bus/pci/devices/` as the kernel does), an
//! os-release file and `--kernel-release`.
//!
//! - `--once` on a node without NFD writes the labels the operator reads, and
//!   a second `--once` writes nothing; a label someone else wrote under the NFD
//!   prefix is left alone.
//! - `--once` on a node nfd-master annotated changes nothing.
//! - The long-running agent, started before its Node exists, labels it once
//!   it appears, rewrites a label someone deleted, follows changes
//!   of the host files (OS upgrade, GPU gone) at its rescan, and stops cleanly
//!   on SIGTERM. Its peak RSS (`VmHWM`) is printed.
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use gpu_stack_e2e::binaries::{AgentProcess, workspace_binary};
use gpu_stack_e2e::{TestCluster, fake_gpu_node, unique_suffix, wait_for};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};

const LONG: Duration = Duration::from_secs(60);
const NFD: &str = "feature.node.kubernetes.io/";
const PCI_10DE: &str = "feature.node.kubernetes.io/pci-10de.present";
const PCI_0302: &str = "feature.node.kubernetes.io/pci-0302_10de.present";
const PCI_H100: &str = "feature.node.kubernetes.io/pci-0302_10de_2330.present";
const OS_ID: &str = "feature.node.kubernetes.io/system-os_release.ID";
const OS_VERSION: &str = "feature.node.kubernetes.io/system-os_release.VERSION_ID";
const OS_MAJOR: &str = "feature.node.kubernetes.io/system-os_release.VERSION_ID.major";
const KERNEL: &str = "feature.node.kubernetes.io/kernel-version.full";
const OWNED: &str = "gpu-stack/node-discovery.labels";
const NFD_ANNOTATION: &str = "nfd.node.kubernetes.io/feature-labels";
/// A label under the NFD prefix that someone else wrote: must stay.
const FOREIGN: (&str, &str) = ("feature.node.kubernetes.io/custom-rdma.available", "true");
const KERNEL_RELEASE: &str = "5.15.0-127-generic";
const H100: &str = "0000:c1:00.0";

/// A fake host: sysfs tree and os-release file.
struct Host {
    dir: PathBuf,
}

impl Host {
    fn new() -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("gpu-stack-nd-e2e-{}", unique_suffix()));
        std::fs::create_dir_all(dir.join("sys/bus/pci/devices"))?;
        let host = Host { dir };
        host.add_pci(H100, "0x10de", "0x030200", "0x2330")?;
        host.add_pci("0000:00:00.0", "0x8086", "0x060000", "0x09a2")?;
        host.write_os_release("22.04")?;
        Ok(host)
    }

    fn sysfs(&self) -> PathBuf {
        self.dir.join("sys")
    }

    fn os_release(&self) -> PathBuf {
        self.dir.join("os-release")
    }

    fn add_pci(&self, addr: &str, vendor: &str, class: &str, device: &str) -> Result<()> {
        let real = self.sysfs().join("devices/pci0000:00").join(addr);
        std::fs::create_dir_all(&real)?;
        for (file, value) in [("vendor", vendor), ("class", class), ("device", device)] {
            std::fs::write(real.join(file), format!("{value}\n"))?;
        }
        std::os::unix::fs::symlink(
            format!("../../../devices/pci0000:00/{addr}"),
            self.sysfs().join("bus/pci/devices").join(addr),
        )?;
        Ok(())
    }

    fn remove_pci(&self, addr: &str) -> Result<()> {
        std::fs::remove_file(self.sysfs().join("bus/pci/devices").join(addr))?;
        Ok(())
    }

    fn write_os_release(&self, version: &str) -> Result<()> {
        // Written whole at once (rename), as a package upgrade would.
        let tmp = self.dir.join("os-release.tmp");
        std::fs::write(
            &tmp,
            format!(
                "PRETTY_NAME=\"Ubuntu {version} LTS\"\nNAME=\"Ubuntu\"\nVERSION_ID=\"{version}\"\n\
                 ID=ubuntu\nID_LIKE=debian\n"
            ),
        )?;
        std::fs::rename(&tmp, self.os_release())?;
        Ok(())
    }
}

/// The agent's command for `node` on `host`.
fn agent(cluster: &TestCluster, host: &Host, node: &str) -> Result<Command> {
    let mut c = Command::new(workspace_binary("gpu-stack")?);
    c.arg("node-discovery")
        .args(["--node-name", node])
        .arg("--sysfs-root")
        .arg(host.sysfs())
        .arg("--os-release")
        .arg(host.os_release())
        .args(["--kernel-release", KERNEL_RELEASE])
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig())
        .env_remove("NODE_NAME")
        .env_remove("KUBECONFIG")
        .env("RUST_LOG", "info")
        .env("RUST_BACKTRACE", "0");
    Ok(c)
}

/// Runs `--once` and returns its JSON report.
fn once(cluster: &TestCluster, host: &Host, node: &str) -> Result<serde_json::Value> {
    let out = agent(cluster, host, node)?
        .arg("--once")
        .output()
        .context("running gpu-stack node-discovery --once")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "node-discovery --once failed ({}): {stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last).with_context(|| format!("--once report {stdout:?}"))
}

/// A kwok node as `fake_gpu_node` makes it, without NFD's labels, plus `labels`
/// and `annotations`.
async fn create_node(
    client: &Client,
    name: &str,
    labels: &[(&str, &str)],
    annotations: &[(&str, &str)],
) -> Result<Node> {
    let mut node = fake_gpu_node(name, 8, &BTreeMap::new());
    let meta = &mut node.metadata;
    let l = meta.labels.get_or_insert_with(BTreeMap::new);
    l.retain(|k, _| !k.starts_with(NFD));
    l.extend(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let a = meta.annotations.get_or_insert_with(BTreeMap::new);
    a.extend(
        annotations
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    Ok(Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &node)
        .await?)
}

/// The node's labels under NFD's prefix.
fn nfd_labels(node: &Node) -> BTreeMap<&str, &str> {
    node.labels()
        .iter()
        .filter(|(k, _)| k.starts_with(NFD))
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

fn label<'a>(node: &'a Node, key: &str) -> Option<&'a str> {
    node.labels().get(key).map(String::as_str)
}

/// Waits until `check` holds for the node.
async fn wait_node(
    client: &Client,
    name: &str,
    what: &str,
    check: impl Fn(&Node) -> bool,
) -> Result<Node> {
    let api = Api::<Node>::all(client.clone());
    let check = &check;
    Ok(wait_for(&format!("{what} on {name}"), LONG, || {
        let api = api.clone();
        async move {
            let n = api.get(name).await?;
            Ok(check(&n).then_some(n))
        }
    })
    .await?)
}

/// Runs `body`, deletes the nodes, and removes the host on success.
async fn with_cleanup(
    cluster: &TestCluster,
    nodes: &[String],
    host: &Host,
    body: impl std::future::Future<Output = Result<()>>,
) -> Result<()> {
    let outcome = body.await;
    cluster.delete_nodes(nodes).await?;
    if outcome.is_ok() {
        let _ = std::fs::remove_dir_all(&host.dir);
    }
    outcome
}

#[tokio::test]
async fn once_labels_a_node_without_nfd_and_a_second_run_writes_nothing() -> Result<()> {
    let cluster = TestCluster::attach().await?;
    let client = cluster.client();
    let node = format!("nd-once-{}", unique_suffix());
    let host = Host::new()?;
    create_node(&client, &node, &[FOREIGN], &[]).await?;
    let nodes = [node.clone()];
    with_cleanup(&cluster, &nodes, &host, async {
        let first = once(&cluster, &host, &node)?;
        ensure!(first["outcome"] == "patched", "first run: {first}");

        let n = Api::<Node>::all(client.clone()).get(&node).await?;
        for (key, want) in [
            (PCI_10DE, "true"),
            (PCI_0302, "true"),
            (PCI_H100, "true"),
            (OS_ID, "ubuntu"),
            (OS_VERSION, "22.04"),
            (OS_MAJOR, "22"),
            (KERNEL, KERNEL_RELEASE),
        ] {
            ensure!(
                label(&n, key) == Some(want),
                "{key}={want}: {:?}",
                n.labels()
            );
        }
        ensure!(
            !n.labels().keys().any(|k| k.contains("8086")),
            "the host bridge is not a whitelisted class: {:?}",
            n.labels()
        );
        ensure!(
            label(&n, FOREIGN.0) == Some(FOREIGN.1),
            "foreign label kept"
        );
        let owned = n.annotations().get(OWNED).cloned().unwrap_or_default();
        ensure!(
            owned.contains("pci-10de.present") && !owned.contains("custom-rdma"),
            "ownership record lists ours only: {owned:?}"
        );

        let second = once(&cluster, &host, &node)?;
        ensure!(
            second == serde_json::json!({"outcome": "unchanged"}),
            "second run: {second}"
        );
        let again = Api::<Node>::all(client.clone()).get(&node).await?;
        ensure!(
            again.labels() == n.labels(),
            "labels unchanged by the second run"
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn once_leaves_a_node_nfd_manages_untouched() -> Result<()> {
    let cluster = TestCluster::attach().await?;
    let client = cluster.client();
    let node = format!("nd-nfd-{}", unique_suffix());
    let host = Host::new()?;
    let created = create_node(
        &client,
        &node,
        &[(OS_ID, "rhel")],
        &[(NFD_ANNOTATION, "system-os_release.ID")],
    )
    .await?;
    let nodes = [node.clone()];
    with_cleanup(&cluster, &nodes, &host, async {
        let report = once(&cluster, &host, &node)?;
        ensure!(
            report == serde_json::json!({"outcome": "nfd-managed"}),
            "report: {report}"
        );
        // Only NFD's labels are compared: other components of the shared
        // test cluster (kwok, the operator) may label the node meanwhile.
        let after = Api::<Node>::all(client.clone()).get(&node).await?;
        ensure!(
            nfd_labels(&after) == nfd_labels(&created),
            "NFD's labels untouched: {:?}",
            nfd_labels(&after)
        );
        ensure!(
            after.annotations().get(OWNED).is_none(),
            "no ownership record on an NFD node"
        );
        ensure!(
            label(&after, PCI_10DE).is_none() && label(&after, OS_ID) == Some("rhel"),
            "NFD's labels stay NFD's"
        );
        Ok(())
    })
    .await
}

/// Peak resident memory of a process, from `/proc/<pid>/status`.
fn vm_hwm(pid: u32) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .map(|v| v.trim().to_string())
}

fn start(cluster: &TestCluster, host: &Host, node: &str) -> Result<(AgentProcess, u32)> {
    let log = host.dir.join("agent.log");
    let child = agent(cluster, host, node)?
        .args(["--rescan-interval", "1s"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()
        .context("starting gpu-stack node-discovery")?;
    let pid = child.id();
    Ok((
        AgentProcess::new("gpu-stack node-discovery", child, log),
        pid,
    ))
}

#[tokio::test]
async fn the_agent_rewrites_deleted_labels_and_follows_the_host() -> Result<()> {
    let cluster = TestCluster::attach().await?;
    let client = cluster.client();
    let node = format!("nd-run-{}", unique_suffix());
    let host = Host::new()?;
    let nodes = [node.clone()];
    with_cleanup(&cluster, &nodes, &host, async {
        // Started before its Node exists: it waits for it.
        let (mut agent, pid) = start(&cluster, &host, &node)?;
        let result = async {
            create_node(&client, &node, &[FOREIGN], &[]).await?;
            scenario(&client, &node, &host).await
        }
        .await;
        let hwm = vm_hwm(pid);
        let stopped = agent.terminate();
        if let Err(e) = result {
            bail!("{e:#}\n--- node-discovery log ---\n{}", agent.log_tail());
        }
        let status = stopped?;
        ensure!(status.success(), "node-discovery exited with {status}");
        eprintln!(
            "node-discovery peak RSS (VmHWM): {}",
            hwm.as_deref().unwrap_or("unknown")
        );
        Ok(())
    })
    .await
}

async fn scenario(client: &Client, node: &str, host: &Host) -> Result<()> {
    let api = Api::<Node>::all(client.clone());
    wait_node(client, node, "the agent's labels", |n| {
        label(n, PCI_10DE) == Some("true") && label(n, OS_VERSION) == Some("22.04")
    })
    .await?;

    // Someone deletes one of its labels: it is written again.
    let delete = serde_json::json!({"metadata": {"labels": {OS_ID: null}}});
    api.patch(node, &PatchParams::default(), &Patch::Merge(&delete))
        .await?;
    wait_node(client, node, "a deleted label rewritten", |n| {
        label(n, OS_ID) == Some("ubuntu")
    })
    .await?;

    // The OS is upgraded: the next rescan relabels.
    host.write_os_release("24.04")?;
    wait_node(client, node, "the upgraded OS", |n| {
        label(n, OS_VERSION) == Some("24.04") && label(n, OS_MAJOR) == Some("24")
    })
    .await?;

    // The GPU is gone: its labels go, the foreign one stays.
    host.remove_pci(H100)?;
    let n = wait_node(client, node, "the GPU labels removed", |n| {
        label(n, PCI_10DE).is_none() && label(n, PCI_H100).is_none()
    })
    .await?;
    ensure!(
        label(&n, FOREIGN.0) == Some(FOREIGN.1),
        "foreign label kept"
    );
    ensure!(label(&n, OS_ID) == Some("ubuntu"), "OS labels kept");
    let owned = n.annotations().get(OWNED).cloned().unwrap_or_default();
    ensure!(
        !owned.contains("pci-"),
        "ownership record updated: {owned:?}"
    );
    Ok(())
}
