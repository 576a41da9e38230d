//! The `gpu-operator` binary against the real test control plane.
//!
//! The operator runs as separate processes (two replicas), authenticated with a
//! token of the ServiceAccount that the Helm chart creates and bound by the
//! chart's own RBAC, so a missing rule fails this test. One test function walks
//! the scenarios in order because a ClusterPolicy is a cluster-wide singleton.
//! Assertions look only at this test's nodes (unique name prefix): other
//! tests may add nodes to the same cluster at the same time.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail, ensure};
use gpu_stack_core::nodeagent::{HOSTED, parse_segments};
use gpu_stack_core::operator::components::Component;
use gpu_stack_core::operator::labels::apply_patch;
use gpu_stack_e2e::binaries::workspace_binary;
use gpu_stack_e2e::chart::{
    OperatorTestEnv, apply_operator_crds, chart_kubeconfig, delete_applied, install_chart_rbac,
};
use gpu_stack_e2e::upgrade::{force_delete_policy, parse_api_requests};
use gpu_stack_e2e::{
    E2eError, GpuFleet, NFD_NVIDIA_PCI_LABEL, TestCluster, fake_gpu_node, http_get, unique_suffix,
    wait_for,
};
use gpu_stack_k8s::operator::cluster::object::{MANAGED_BY, MANAGED_BY_LABEL};
use gpu_stack_k8s::operator::cluster::selector::pod_selects_node;
use gpu_stack_k8s::operator::clusterpolicy::ClusterPolicy;
use gpu_stack_k8s::operator::controller::operator_pass::FINALIZER;
use gpu_stack_k8s::operator::desired::render::NODE_AGENT_NAME;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod, ServiceAccount};
use k8s_openapi::api::node::v1::RuntimeClass;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};

const GPU_NODES: usize = 20;
const CPU_NODES: usize = 5;
const LONG: Duration = Duration::from_secs(120);
const DEPLOY_DEVICE_PLUGIN: &str = "nvidia.com/gpu.deploy.device-plugin";

struct Replica {
    child: Child,
    metrics: String,
}

impl Replica {
    fn start(
        bin: &Path,
        kubeconfig: &Path,
        namespace: &str,
        identity: &str,
        port: u16,
    ) -> Result<Self> {
        let listen = format!("127.0.0.1:{port}");
        let child = Command::new(bin)
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--namespace={namespace}"))
            .arg(format!("--identity={identity}"))
            .arg(format!("--listen={listen}"))
            .arg(format!("--lease-name=gpu-stack-e2e-{namespace}"))
            .args(["--lease-duration-seconds=6", "--renew-grace-seconds=2"])
            .env("RUST_LOG", "info,kube=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        Ok(Self {
            child,
            metrics: format!("http://{listen}/metrics"),
        })
    }

    fn sigterm(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
    }

    fn sigkill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.sigkill();
    }
}

/// The replica's `/metrics` page (empty if it cannot be read).
async fn metrics_page(replica: &Replica) -> String {
    let url = replica.metrics.trim_start_matches("http://");
    let Some((addr, path)) = url.split_once('/') else {
        return String::new();
    };
    http_get(addr, &format!("/{path}")).await
}

/// One metric value of a replica.
async fn metric(replica: &Replica, name: &str) -> Option<f64> {
    metrics_page(replica)
        .await
        .lines()
        .find(|l| l.starts_with(&format!("{name} ")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

async fn policy_state(client: &Client, name: &str) -> Result<Option<ClusterPolicy>, kube::Error> {
    Api::<ClusterPolicy>::all(client.clone())
        .get_opt(name)
        .await
}

async fn wait_policy(
    client: &Client,
    name: &str,
    what: &str,
    pred: impl Fn(&ClusterPolicy) -> bool,
) -> Result<ClusterPolicy> {
    Ok(wait_for(what, LONG, || async {
        Ok(policy_state(client, name)
            .await
            .ok()
            .flatten()
            .filter(|p| pred(p)))
    })
    .await?)
}

fn node_label(n: &Node, key: &str) -> Option<String> {
    n.labels().get(key).cloned()
}

async fn my_nodes(client: &Client, prefix: &str) -> Result<Vec<Node>, kube::Error> {
    Ok(Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|n| n.name_any().starts_with(prefix))
        .collect())
}

/// Names of this test's nodes running a Running pod of DaemonSet `ds`.
async fn nodes_running(
    client: &Client,
    namespace: &str,
    ds: &str,
    prefix: &str,
) -> Result<Vec<String>, kube::Error> {
    let pods = Api::<Pod>::namespaced(client.clone(), namespace)
        .list(&ListParams::default())
        .await?;
    let mut out: Vec<String> = pods
        .items
        .iter()
        .filter(|p| {
            p.metadata
                .owner_references
                .as_ref()
                .is_some_and(|o| o.iter().any(|o| o.kind == "DaemonSet" && o.name == ds))
        })
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| p.spec.as_ref().and_then(|s| s.node_name.clone()))
        .filter(|n| n.starts_with(prefix))
        .collect();
    out.sort();
    Ok(out)
}

async fn daemonsets(client: &Client, namespace: &str) -> Result<Vec<DaemonSet>, kube::Error> {
    Ok(Api::<DaemonSet>::namespaced(client.clone(), namespace)
        .list(&ListParams::default())
        .await?
        .items)
}

/// Each DaemonSet's name and generation (which only a spec change moves).
async fn generations(
    client: &Client,
    namespace: &str,
) -> Result<Vec<(String, Option<i64>)>, kube::Error> {
    Ok(daemonsets(client, namespace)
        .await?
        .iter()
        .map(|d| (d.name_any(), d.metadata.generation))
        .collect())
}

/// Each DaemonSet's name, uid and generation: a recreated or changed
/// DaemonSet shows in them.
async fn daemonset_identities(
    client: &Client,
    namespace: &str,
) -> Result<Vec<(String, Option<String>, Option<i64>)>, kube::Error> {
    let mut all: Vec<_> = daemonsets(client, namespace)
        .await?
        .iter()
        .map(|d| (d.name_any(), d.uid(), d.metadata.generation))
        .collect();
    all.sort();
    Ok(all)
}

/// [`daemonset_identities`] once two reads 2 s apart agree (the operator
/// has finished what it was applying).
async fn settled_daemonsets(
    client: &Client,
    namespace: &str,
) -> Result<Vec<(String, Option<String>, Option<i64>)>> {
    Ok(wait_for("DaemonSets settled", LONG, || async {
        let first = daemonset_identities(client, namespace).await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let second = daemonset_identities(client, namespace).await?;
        Ok((first == second).then_some(second))
    })
    .await?)
}

/// The DaemonSet that runs the device plugin: its own, or the node agent's.
fn device_plugin_ds(all: &[DaemonSet]) -> Option<String> {
    all.iter()
        .map(ResourceExt::name_any)
        .find(|n| n == Component::DevicePlugin.daemonset_name() || n == NODE_AGENT_NAME)
}

async fn apply_policy(client: &Client, name: &str, spec: serde_json::Value) -> Result<()> {
    let body = serde_json::json!({
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "metadata": { "name": name },
        "spec": spec,
    });
    Api::<ClusterPolicy>::all(client.clone())
        .patch(
            name,
            &PatchParams::apply("gpu-stack-e2e").force(),
            &Patch::Apply(&body),
        )
        .await?;
    Ok(())
}

fn has_condition(p: &ClusterPolicy, type_: &str, needle: &str) -> bool {
    p.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == type_ && c.status == "True" && c.message.contains(needle))
    })
}

fn is_ready(p: &ClusterPolicy) -> bool {
    p.status.as_ref().is_some_and(|s| s.state == "ready")
}

async fn leader_count(replicas: &[&Replica]) -> usize {
    let mut n = 0;
    for r in replicas {
        if metric(r, "gpu_stack_operator_leader").await == Some(1.0) {
            n += 1;
        }
    }
    n
}

/// How the policy runs the node agents: one DaemonSet each, or all in one
/// `gpu-node-agent` DaemonSet (`spec.nodeAgent.enabled`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Separate,
    NodeAgent,
}

impl Mode {
    /// `spec` with this mode's `nodeAgent` section.
    fn spec(self, mut spec: serde_json::Value) -> serde_json::Value {
        spec["nodeAgent"] = serde_json::json!({ "enabled": self == Mode::NodeAgent });
        spec
    }
}

/// Where the components the node agent can host run: in their own
/// DaemonSets, or on the node agent's command line (read with the agent's
/// own parser).
#[derive(Debug)]
struct Hosted {
    own: Vec<Component>,
    in_agent: Vec<Component>,
}

impl Hosted {
    fn of(all: &[DaemonSet]) -> Result<Self, E2eError> {
        let own = HOSTED
            .iter()
            .map(|(c, _)| *c)
            .filter(|c| all.iter().any(|d| d.name_any() == c.daemonset_name()))
            .collect();
        let mut in_agent = Vec::new();
        let agent_containers = all
            .iter()
            .filter(|d| d.name_any() == NODE_AGENT_NAME)
            .flat_map(|d| d.spec.template.spec.iter())
            .flat_map(|p| p.containers.iter());
        for c in agent_containers {
            let args = c.args.clone().unwrap_or_default();
            let segments = parse_segments(&args)
                .map_err(|e| E2eError::Check(format!("{NODE_AGENT_NAME} command line: {e}")))?;
            in_agent.extend(segments.into_iter().map(|s| s.component));
        }
        Ok(Self { own, in_agent })
    }

    fn runs(&self, c: Component) -> bool {
        self.own.contains(&c) || self.in_agent.contains(&c)
    }
}

/// Whether the operands in `namespace` include the exporter.
async fn runs_exporter(client: &Client, namespace: &str) -> Result<bool, E2eError> {
    Ok(Hosted::of(&daemonsets(client, namespace).await?)?.runs(Component::DcgmExporter))
}

/// The node contract in both modes, one after the other (a ClusterPolicy is
/// a cluster-wide singleton).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_binary_on_a_real_cluster() -> Result<()> {
    let cluster = TestCluster::attach().await?;
    let bin = workspace_binary("gpu-operator")?;
    for (mode, tag) in [(Mode::Separate, "op"), (Mode::NodeAgent, "opna")] {
        // The generated CRDs, and the chart's ServiceAccount and RBAC.
        let env = OperatorTestEnv::setup(&cluster, tag).await?;
        let result = scenarios(
            &cluster,
            &env.admin,
            &bin,
            &env.kubeconfig,
            &env.namespace,
            &env.prefix,
            mode,
        )
        .await
        .with_context(|| format!("in mode {mode:?}"));
        env.teardown(&cluster, result).await?;
    }
    Ok(())
}

async fn scenarios(
    cluster: &TestCluster,
    admin: &Client,
    bin: &Path,
    kubeconfig: &Path,
    namespace: &str,
    prefix: &str,
    mode: Mode,
) -> Result<()> {
    // 20 GPU nodes and 5 CPU-only nodes.
    let gpu_names = cluster
        .create_gpu_nodes(&GpuFleet::new(format!("{prefix}-gpu"), GPU_NODES))
        .await?;
    let nodes_api: Api<Node> = Api::all(admin.clone());
    for i in 0..CPU_NODES {
        let mut n = fake_gpu_node(&format!("{prefix}-cpu-{i}"), 0, &BTreeMap::new());
        if let Some(l) = n.metadata.labels.as_mut() {
            l.remove(NFD_NVIDIA_PCI_LABEL);
        }
        if let Some(s) = n.status.as_mut() {
            s.capacity = None;
            s.allocatable = None;
        }
        nodes_api.create(&PostParams::default(), &n).await?;
    }

    // Two replicas: exactly one leads.
    let mut a = Replica::start(bin, kubeconfig, namespace, "replica-a", free_port()?)?;
    let mut b = Replica::start(bin, kubeconfig, namespace, "replica-b", free_port()?)?;
    wait_for("exactly one leader", LONG, || async {
        Ok((leader_count(&[&a, &b]).await == 1).then_some(()))
    })
    .await?;
    let lease = Api::<Lease>::namespaced(admin.clone(), namespace)
        .get(&format!("gpu-stack-e2e-{namespace}"))
        .await?;
    let holder = lease
        .spec
        .and_then(|s| s.holder_identity)
        .unwrap_or_default();
    ensure!(
        holder == "replica-a" || holder == "replica-b",
        "lease holder is {holder:?}"
    );

    // ClusterPolicy → labels, DaemonSets, pods on exactly the GPU nodes, ready.
    apply_policy(
        admin,
        "cluster-policy",
        mode.spec(serde_json::json!({
            "operator": { "defaultRuntime": "containerd" },
            "driver": { "enabled": true },
            "dcgmExporter": { "enabled": true },
            "migManager": { "enabled": true },
            "sandboxWorkloads": { "enabled": false },
        })),
    )
    .await?;
    wait_policy(admin, "cluster-policy", "ClusterPolicy ready", is_ready).await?;
    let nodes = my_nodes(admin, prefix).await?;
    for n in &nodes {
        let gpu = n.name_any().contains("-gpu-");
        ensure!(
            (node_label(n, "nvidia.com/gpu.present").as_deref() == Some("true")) == gpu,
            "node {} gpu.present label is {:?}",
            n.name_any(),
            node_label(n, "nvidia.com/gpu.present")
        );
    }
    let ds_all = daemonsets(admin, namespace).await?;
    ensure!(!ds_all.is_empty(), "no DaemonSets in {namespace}");
    // The hosted components have no DaemonSet of their own in the combined
    // mode, and the node agent hosts none in the other.
    let hosted = Hosted::of(&ds_all)?;
    let (own, in_agent) = match mode {
        Mode::Separate => (HOSTED.len(), 0),
        Mode::NodeAgent => (0, HOSTED.len()),
    };
    ensure!(
        hosted.own.len() == own && hosted.in_agent.len() == in_agent,
        "{mode:?}: hosted components {hosted:?}"
    );
    let plugin = device_plugin_ds(&ds_all).ok_or_else(|| anyhow!("no device-plugin DaemonSet"))?;
    let mut expected = gpu_names.clone();
    expected.sort();
    let running = wait_for("device plugin pods on the GPU nodes", LONG, || async {
        let r = nodes_running(admin, namespace, &plugin, prefix).await?;
        Ok((r == expected).then_some(r))
    })
    .await?;
    ensure!(running.iter().all(|n| n.contains("-gpu-")));
    // Owner references: everything namespaced we created points at the policy.
    for ds in &ds_all {
        ensure!(
            ds.owner_references()
                .iter()
                .any(|o| o.kind == "ClusterPolicy"),
            "DaemonSet {} has no owner reference to the ClusterPolicy",
            ds.name_any()
        );
    }

    // An owned object deleted by someone else → recreated (the operator
    // watches every kind it owns, not only DaemonSets).
    let accounts: Api<ServiceAccount> = Api::namespaced(admin.clone(), namespace);
    let owned_sa = accounts
        .list(&ListParams::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGED_BY}")))
        .await?
        .items
        .into_iter()
        .next()
        .ok_or_else(|| anyhow!("the operator created no ServiceAccount"))?;
    let (sa_name, sa_uid) = (owned_sa.name_any(), owned_sa.uid());
    accounts.delete(&sa_name, &DeleteParams::default()).await?;
    wait_for("deleted ServiceAccount recreated", LONG, || async {
        let again = accounts.get_opt(&sa_name).await?;
        Ok(again.filter(|sa| sa.uid() != sa_uid).map(|_| ()))
    })
    .await?;

    // A DaemonSet edited by hand → put back by the next pass (the edit is
    // a trigger; the resync would catch a missed one).
    let ds_api: Api<DaemonSet> = Api::namespaced(admin.clone(), namespace);
    let original = ds_api.get(&plugin).await?;
    let container = |d: &DaemonSet| {
        d.spec
            .template
            .spec
            .as_ref()
            .and_then(|p| p.containers.first())
            .map(|c| (c.name.clone(), c.image.clone()))
    };
    let (first, image) =
        container(&original).ok_or_else(|| anyhow!("{plugin} has no container"))?;
    ds_api
        .patch(
            &plugin,
            &PatchParams::default(),
            &Patch::Strategic(
                serde_json::json!({"spec": {"template": {"spec": {"containers": [
                    {"name": first, "image": "example.invalid/edited-by-hand:1"}
                ]}}}}),
            ),
        )
        .await?;
    wait_for("the hand edit put back", LONG, || async {
        let now = ds_api.get(&plugin).await?;
        Ok((container(&now).and_then(|(_, i)| i) == image).then_some(()))
    })
    .await?;

    // A node joins → labelled and served.
    let joined = cluster
        .create_gpu_nodes(&GpuFleet::new(format!("{prefix}-gpu-late"), 1))
        .await?;
    wait_for("joined node served", LONG, || async {
        Ok(nodes_running(admin, namespace, &plugin, prefix)
            .await?
            .contains(&joined[0])
            .then_some(()))
    })
    .await?;

    // paused-for-mig-change → left alone; its pod goes away, or in the
    // combined mode the node agent's pod stays (its other components still
    // run there; it stops the device plugin in-process: node_agent_e2e).
    let paused = gpu_names[0].clone();
    nodes_api
        .patch(
            &paused,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"labels": {DEPLOY_DEVICE_PLUGIN: "paused-for-mig-change"}}})),
        )
        .await?;
    if mode == Mode::Separate {
        wait_for("paused node's plugin pod gone", LONG, || async {
            Ok((!nodes_running(admin, namespace, &plugin, prefix)
                .await?
                .contains(&paused))
            .then_some(()))
        })
        .await?;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    if mode == Mode::NodeAgent {
        ensure!(
            nodes_running(admin, namespace, &plugin, prefix)
                .await?
                .contains(&paused),
            "the node agent's pod left a node where GFD and the MIG manager still run"
        );
    }
    let label = node_label(&nodes_api.get(&paused).await?, DEPLOY_DEVICE_PLUGIN);
    ensure!(
        label.as_deref() == Some("paused-for-mig-change"),
        "the operator overwrote the paused label: {label:?}"
    );

    // A component disabled → its DaemonSet deleted, or its segment gone from
    // the node agent's command line.
    apply_policy(
        admin,
        "cluster-policy",
        mode.spec(serde_json::json!({
            "driver": { "enabled": true },
            "dcgmExporter": { "enabled": false },
            "migManager": { "enabled": true },
        })),
    )
    .await?;
    wait_for("the exporter removed", LONG, || async {
        Ok((!runs_exporter(admin, namespace).await?).then_some(()))
    })
    .await?;

    // An invalid field → status Error naming the field, nothing else changed
    // (no DaemonSet spec: its generation; status moves on with the rollout).
    let before = generations(admin, namespace).await?;
    apply_policy(
        admin,
        "cluster-policy",
        mode.spec(serde_json::json!({
            "driver": { "enabled": true },
            "dcgmExporter": { "enabled": false },
            "migManager": { "enabled": true },
            "mig": { "strategy": "sideways" },
        })),
    )
    .await?;
    wait_policy(
        admin,
        "cluster-policy",
        "Error naming spec.mig.strategy",
        |p| has_condition(p, "Error", "mig.strategy"),
    )
    .await?;
    let after = generations(admin, namespace).await?;
    ensure!(
        before == after,
        "DaemonSets changed under an invalid policy"
    );

    // An impossible driver for a pool → refused for that pool only.
    let old_pool = cluster
        .create_gpu_nodes(
            &GpuFleet::new(format!("{prefix}-b200"), 2)
                .with_label("nvidia.com/gpu.product", "NVIDIA-B200")
                .with_label("feature.node.kubernetes.io/system-os_release.ID", "rhel")
                .with_label(
                    "feature.node.kubernetes.io/system-os_release.VERSION_ID",
                    "9.4",
                )
                .with_label(
                    "feature.node.kubernetes.io/system-os_release.VERSION_ID.major",
                    "9",
                ),
        )
        .await?;
    apply_policy(
        admin,
        "cluster-policy",
        mode.spec(serde_json::json!({
            "driver": { "enabled": true, "version": "550.127.05" },
            "dcgmExporter": { "enabled": false },
            "migManager": { "enabled": true },
        })),
    )
    .await?;
    let refused = wait_policy(
        admin,
        "cluster-policy",
        "driver refused for the B200 pool",
        |p| {
            p.status
                .as_ref()
                .is_some_and(|s| !s.refused_nodes.is_empty())
        },
    )
    .await?;
    let refused: Vec<String> = refused
        .status
        .map(|s| s.refused_nodes.into_iter().map(|r| r.node).collect())
        .unwrap_or_default();
    let mut want = old_pool.clone();
    want.sort();
    let mut got: Vec<String> = refused
        .into_iter()
        .filter(|n| n.starts_with(prefix))
        .collect();
    got.sort();
    ensure!(
        got == want,
        "refused nodes {got:?}, expected only the B200 pool {want:?}"
    );

    // SIGKILL the leader mid-reconcile: change the policy and kill at once.
    let (leader, standby) = if metric(&a, "gpu_stack_operator_leader").await == Some(1.0) {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    apply_policy(
        admin,
        "cluster-policy",
        mode.spec(serde_json::json!({
            "driver": { "enabled": true, "version": "550.127.05" },
            "dcgmExporter": { "enabled": true },
            "migManager": { "enabled": true },
        })),
    )
    .await?;
    leader.sigkill();
    wait_for("standby takes over", LONG, || async {
        Ok((metric(standby, "gpu_stack_operator_leader").await == Some(1.0)).then_some(()))
    })
    .await?;
    wait_for("the exporter back after failover", LONG, || async {
        Ok(runs_exporter(admin, namespace).await?.then_some(()))
    })
    .await?;
    // No duplicates or orphans: every DaemonSet is owned and names are unique.
    let ds_now = daemonsets(admin, namespace).await?;
    let mut names: Vec<String> = ds_now.iter().map(ResourceExt::name_any).collect();
    let count = names.len();
    names.sort();
    names.dedup();
    ensure!(names.len() == count, "duplicate DaemonSets: {names:?}");
    for ds in &ds_now {
        ensure!(
            ds.owner_references()
                .iter()
                .any(|o| o.kind == "ClusterPolicy"),
            "orphaned DaemonSet {}",
            ds.name_any()
        );
    }
    // Restart the killed replica: it becomes a standby; still one leader.
    let restarted = Replica::start(bin, kubeconfig, namespace, "replica-c", free_port()?)?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    ensure!(
        leader_count(&[standby, &restarted]).await == 1,
        "not exactly one leader after restart"
    );

    // A second policy is ignored and reported on both; deleting it changes
    // nothing. Deleting the one in charge while another lives hands the
    // running stack over: no DaemonSet is recreated or changed.
    let spec = mode.spec(serde_json::json!({
        "driver": { "enabled": true, "version": "550.127.05" },
        "dcgmExporter": { "enabled": true },
        "migManager": { "enabled": true },
    }));
    let policies = Api::<ClusterPolicy>::all(admin.clone());
    let before = settled_daemonsets(admin, namespace).await?;
    apply_policy(admin, "cluster-policy-copy", spec.clone()).await?;
    let copy = wait_policy(admin, "cluster-policy-copy", "the copy ignored", |p| {
        p.status.as_ref().is_some_and(|s| s.state == "ignored")
    })
    .await?;
    ensure!(
        !copy.finalizers().iter().any(|f| f == FINALIZER),
        "an ignored policy got the finalizer: {:?}",
        copy.finalizers()
    );
    // The leader's metrics say which policy is in charge.
    wait_for(
        "the policies in charge and ignored in the metrics",
        LONG,
        || async {
            let page = metrics_page(standby).await;
            Ok(
                (page.contains("gpu_stack_operator_policy_in_charge{policy=\"cluster-policy\"} 1")
                    && page.contains(
                        "gpu_stack_operator_policy_in_charge{policy=\"cluster-policy-copy\"} 0",
                    ))
                .then_some(()),
            )
        },
    )
    .await?;
    policies
        .delete("cluster-policy-copy", &DeleteParams::default())
        .await?;
    wait_for("the ignored copy gone", LONG, || async {
        Ok(policy_state(admin, "cluster-policy-copy")
            .await?
            .is_none()
            .then_some(()))
    })
    .await?;
    // The operator has seen the deletion once the policy is gone; give the
    // garbage collector a moment to act on any dependent, then compare.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = daemonset_identities(admin, namespace).await?;
    ensure!(
        before == after,
        "deleting an ignored policy changed DaemonSets: {before:?} → {after:?}"
    );

    apply_policy(admin, "cluster-policy-next", spec).await?;
    wait_policy(admin, "cluster-policy-next", "the successor ignored", |p| {
        p.status.as_ref().is_some_and(|s| s.state == "ignored")
    })
    .await?;
    policies
        .delete("cluster-policy", &DeleteParams::default())
        .await?;
    wait_for("the policy in charge gone", LONG, || async {
        Ok(policy_state(admin, "cluster-policy")
            .await?
            .is_none()
            .then_some(()))
    })
    .await?;
    let next = wait_policy(
        admin,
        "cluster-policy-next",
        "the successor in charge",
        |p| {
            p.status
                .as_ref()
                .is_some_and(|s| !s.state.is_empty() && s.state != "ignored")
        },
    )
    .await?;
    ensure!(
        next.finalizers().iter().any(|f| f == FINALIZER),
        "the successor holds no finalizer"
    );
    let next_uid = next.uid().unwrap_or_default();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let handed = daemonsets(admin, namespace).await?;
    for ds in &handed {
        ensure!(
            ds.owner_references().iter().all(|o| o.uid == next_uid),
            "DaemonSet {} not owned by the successor: {:?}",
            ds.name_any(),
            ds.owner_references()
        );
    }
    let after = daemonset_identities(admin, namespace).await?;
    ensure!(
        before == after,
        "the hand-over changed DaemonSets: {before:?} → {after:?}"
    );

    // The last ClusterPolicy deleted → everything we created is gone.
    policies
        .delete("cluster-policy-next", &DeleteParams::default())
        .await?;
    wait_for("ClusterPolicy gone", LONG, || async {
        Ok(policy_state(admin, "cluster-policy-next")
            .await?
            .is_none()
            .then_some(()))
    })
    .await?;
    wait_for("owned DaemonSets gone", LONG, || async {
        Ok(daemonsets(admin, namespace).await?.is_empty().then_some(()))
    })
    .await?;
    for n in my_nodes(admin, prefix).await? {
        let ours: Vec<&String> = n
            .labels()
            .keys()
            .filter(|k| {
                k.as_str() == "nvidia.com/gpu.present"
                    || (k.starts_with("nvidia.com/gpu.deploy.")
                        && n.labels().get(*k).map(String::as_str) != Some("false"))
            })
            .collect();
        if n.name_any() == paused {
            // Another agent's value stays.
            ensure!(
                node_label(&n, DEPLOY_DEVICE_PLUGIN).as_deref() == Some("paused-for-mig-change"),
                "cleanup removed the paused value on {paused}"
            );
            continue;
        }
        if !ours.is_empty() {
            bail!("node {} still has operator labels {ours:?}", n.name_any());
        }
    }

    // SIGTERM: a clean exit.
    let mut standby_owned = std::mem::replace(
        standby,
        Replica {
            child: Command::new("true").spawn()?,
            metrics: String::new(),
        },
    );
    standby_owned.sigterm();
    let status = wait_for("operator exits on SIGTERM", Duration::from_secs(30), || {
        let s = standby_owned.child.try_wait().ok().flatten();
        async move { Ok(s) }
    })
    .await?;
    ensure!(status.success(), "operator exited with {status} on SIGTERM");
    drop(restarted);
    Ok(())
}

/// Peak resident memory of a process, in KiB (VmHWM).
fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// Bytes of the pods in `namespace` as the API server returns them (each
/// object's compact JSON), in total and by `app` label, and split into
/// metadata.managedFields, the rest of metadata, spec and status.
#[derive(Debug, Default)]
struct PodBytes {
    pods: usize,
    total: usize,
    by_app: BTreeMap<String, (usize, usize)>,
    managed_fields: usize,
    metadata: usize,
    spec: usize,
    status: usize,
}

/// `dump`: a directory to write one pod of each app into, as served.
async fn pod_bytes(client: &Client, namespace: &str, dump: Option<&Path>) -> Result<PodBytes> {
    let mut out = PodBytes::default();
    let mut next: Option<String> = None;
    loop {
        let mut url = format!("/api/v1/namespaces/{namespace}/pods?limit=500");
        if let Some(token) = &next {
            url.push_str(&format!("&continue={token}"));
        }
        let request = http::Request::get(url).body(Vec::new())?;
        let page: serde_json::Value = client.request(request).await?;
        for mut pod in page["items"].as_array().cloned().unwrap_or_default() {
            let size = serde_json::to_vec(&pod)?.len();
            let app = pod["metadata"]["labels"]["app"]
                .as_str()
                .unwrap_or("-")
                .to_string();
            if let Some(dir) = dump
                && !out.by_app.contains_key(&app)
            {
                std::fs::write(
                    dir.join(format!("{app}.json")),
                    serde_json::to_vec_pretty(&pod)?,
                )?;
            }
            let entry = out.by_app.entry(app).or_default();
            entry.0 += 1;
            entry.1 += size;
            out.pods += 1;
            out.total += size;
            let part = |v: &serde_json::Value| serde_json::to_vec(v).map(|b| b.len());
            out.managed_fields += part(&pod["metadata"]["managedFields"])?;
            if let Some(meta) = pod["metadata"].as_object_mut() {
                meta.remove("managedFields");
            }
            out.metadata += part(&pod["metadata"])?;
            out.spec += part(&pod["spec"])?;
            out.status += part(&pod["status"])?;
        }
        next = page["metadata"]["continue"]
            .as_str()
            .filter(|t| !t.is_empty())
            .map(str::to_string);
        if next.is_none() {
            return Ok(out);
        }
    }
}

/// The test cluster's processes whose CPU time the bench reports: the
/// control plane, then kwok (the nodes' stand-in, reported apart).
const CLUSTER_PROCESSES: [&str; 5] = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
];

/// CPU time (user + system, seconds) used so far by each of
/// [`CLUSTER_PROCESSES`], read from the pid files the cluster keeps beside
/// its kubeconfig (0 for a process it does not run).
fn cluster_cpu_seconds(kubeconfig: &Path) -> [f64; 5] {
    let pids = kubeconfig.parent().map(|d| d.join("pids"));
    let seconds = |name: &str| -> f64 {
        let Some(dir) = &pids else { return 0.0 };
        std::fs::read_to_string(dir.join(format!("{name}.pid")))
            .ok()
            .and_then(|pid| pid.trim().parse().ok())
            .map_or(0.0, process_cpu_seconds)
    };
    CLUSTER_PROCESSES.map(seconds)
}

/// CPU time (user + system, seconds) a process has used so far; 0 when it
/// is gone.
fn process_cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command name (which may hold spaces): utime is the
    // 14th field of the line, stime the 15th. Clock ticks per second: 100 on
    // every Linux this runs on (USER_HZ).
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = after.split_whitespace().collect();
    let field = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (field(11) + field(12)) / 100.0
}

/// Index of kwok in [`CLUSTER_PROCESSES`]: the processes before it are the
/// control plane.
const KWOK: usize = 4;

/// CPU-seconds each of [`CLUSTER_PROCESSES`] used between two readings.
struct CpuUsed([f64; 5]);

impl CpuUsed {
    fn between(before: [f64; 5], after: [f64; 5]) -> Self {
        CpuUsed(std::array::from_fn(|i| after[i] - before[i]))
    }
}

impl std::fmt::Display for CpuUsed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (control_plane, kwok) = self.0.split_at(KWOK);
        let each: Vec<String> = CLUSTER_PROCESSES
            .iter()
            .zip(control_plane)
            .map(|(n, s)| format!("{n} {s:.1}"))
            .collect();
        write!(
            f,
            "control plane {:.1} CPU-s ({}); kwok {:.1} CPU-s",
            control_plane.iter().sum::<f64>(),
            each.join(", "),
            kwok.iter().sum::<f64>()
        )
    }
}

/// Sum of every sample of `name` (all label sets) from a replica's /metrics.
async fn metric_sum(replica: &Replica, name: &str) -> f64 {
    metrics_page(replica)
        .await
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Requests the replica issued, by `verb resource`, largest first.
async fn requests_by_kind(replica: &Replica) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64)> = parse_api_requests(&metrics_page(replica).await)
        .into_iter()
        .filter(|(_, v)| *v > 0.0)
        .map(|((verb, resource), v)| (format!("{verb} {resource}"), v))
        .collect();
    out.sort_by(|a, b| b.1.total_cmp(&a.1));
    out
}

/// Write requests the replica issued, by resource.
async fn writes_by_resource(replica: &Replica) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for ((verb, resource), v) in parse_api_requests(&metrics_page(replica).await) {
        if matches!(verb.as_str(), "create" | "patch" | "update" | "delete") {
            *out.entry(resource).or_default() += v;
        }
    }
    out
}

/// Writes a reconcile made: every write except the leader's lease renewals,
/// which are the election's heartbeat and go on whether or not anything changes.
fn reconcile_writes(by_resource: &BTreeMap<String, f64>) -> f64 {
    by_resource
        .iter()
        .filter(|(resource, _)| resource.as_str() != "leases")
        .map(|(_, n)| n)
        .sum()
}

/// The DaemonSets the operator deploys for `spec` on `fleet` that run on at
/// least one node (as rendered by the operator's own desired state).
fn operand_daemonsets(spec: &serde_json::Value, fleet: &GpuFleet) -> Result<Vec<DaemonSet>> {
    let policy: ClusterPolicy = serde_json::from_value(serde_json::json!({
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "metadata": {"name": "cluster-policy"},
        "spec": spec,
    }))?;
    let mut nodes = fleet.nodes()?;
    let want = gpu_stack_k8s::operator::desired::desired_state(
        &policy,
        &nodes,
        &[],
        &gpu_stack_k8s::operator::desired::Options::default(),
    );
    for n in &mut nodes {
        if let Some(patch) = want.node_labels.get(&n.name_any()) {
            apply_patch(n.labels_mut(), patch);
        }
    }
    Ok(want
        .objects
        .iter()
        .filter_map(|o| o.as_daemonset())
        .filter(|ds| {
            let pod = ds.spec.template.spec.as_ref();
            pod.is_some_and(|pod| {
                nodes
                    .iter()
                    .any(|n| pod_selects_node(pod, &n.name_any(), n.labels()))
            })
        })
        .cloned()
        .collect())
}

/// Whether a DaemonSet reports a ready pod on each of `count` nodes.
fn ready_on(ds: &DaemonSet, count: usize) -> bool {
    ds.status.as_ref().is_some_and(|s| {
        usize::try_from(s.number_ready).is_ok_and(|n| n >= count)
            && s.desired_number_scheduled == s.number_ready
    })
}

/// What a floor rolls out: as many DaemonSets as the operator runs on the
/// nodes, either plain (one tiny container: the control plane's floor) or
/// the operator's own DaemonSets (the same pods the operator creates, so the
/// same work for the control plane), all selecting the GPU nodes by their
/// NFD label, which they have from the start.
#[derive(Clone, Copy)]
enum FloorPods {
    Plain,
    Operands,
}

fn floor_objects(kind: FloorPods, operands: &[DaemonSet]) -> Result<Vec<serde_json::Value>> {
    let mut out = Vec::new();
    for (i, operand) in operands.iter().enumerate() {
        let mut template = match kind {
            FloorPods::Plain => {
                let app = format!("floor-{i}");
                serde_json::json!({
                    "metadata": {"labels": {"app": app}},
                    "spec": {"containers": [{"name": "c", "image": "floor:1"}]}
                })
            }
            FloorPods::Operands => serde_json::to_value(&operand.spec.template)?,
        };
        template["spec"]["nodeSelector"] = serde_json::json!({NFD_NVIDIA_PCI_LABEL: "true"});
        // The node agent selects by affinity on deploy labels, which the
        // floor's nodes lack: the NFD selector alone decides here.
        if let Some(pod) = template["spec"].as_object_mut() {
            pod.remove("affinity");
        }
        if let Some(account) = template["spec"]["serviceAccountName"].as_str() {
            out.push(serde_json::json!({
                "apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": {"name": account}
            }));
        }
        let selector = template["metadata"]["labels"].clone();
        out.push(serde_json::json!({
            "apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": format!("floor-{i}")},
            "spec": {"selector": {"matchLabels": selector}, "template": template}
        }));
    }
    Ok(out)
}

/// Control-plane floor for the operator benchmark: the DaemonSets of
/// [`floor_objects`] (and the ServiceAccounts their pods name), timed from
/// creation until every one reports a ready pod on each of `count` nodes;
/// the namespace is deleted and its pods gone before this returns. Returns
/// the seconds and a note of the CPU it cost and the bytes of its pods.
async fn floor(
    cluster: &TestCluster,
    kind: FloorPods,
    operands: &[DaemonSet],
    count: usize,
) -> Result<(f64, String)> {
    let floor_ns = cluster.create_namespace("gpu-floor").await?;
    let objects = floor_objects(kind, operands)?;
    let accounts = Api::<ServiceAccount>::namespaced(cluster.client(), &floor_ns);
    let floor_api = Api::<DaemonSet>::namespaced(cluster.client(), &floor_ns);
    // Cluster-wide prerequisites of the operator's pods (its RuntimeClass)
    // exist before the clock starts, as they do for the operator's DaemonSets.
    let classes = Api::<RuntimeClass>::all(cluster.client());
    for class in objects
        .iter()
        .filter_map(|o| o["spec"]["template"]["spec"]["runtimeClassName"].as_str())
    {
        if classes.get_opt(class).await?.is_none() {
            let rc: RuntimeClass = serde_json::from_value(serde_json::json!({
                "apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                "metadata": {"name": class}, "handler": class
            }))?;
            classes.create(&PostParams::default(), &rc).await?;
        }
    }
    let cpu_before = cluster_cpu_seconds(cluster.kubeconfig());
    let t = std::time::Instant::now();
    for obj in objects {
        if obj["kind"] == "ServiceAccount" {
            let sa: ServiceAccount = serde_json::from_value(obj)?;
            accounts.create(&PostParams::default(), &sa).await?;
        } else {
            let ds: DaemonSet = serde_json::from_value(obj)?;
            floor_api.create(&PostParams::default(), &ds).await?;
        }
    }
    wait_for(
        "floor DaemonSets ready on every node",
        Duration::from_secs(900),
        || async {
            let all = daemonsets(&cluster.client(), &floor_ns).await?;
            Ok(
                (all.len() == operands.len() && all.iter().all(|d| ready_on(d, count)))
                    .then_some(()),
            )
        },
    )
    .await?;
    let floor = t.elapsed().as_secs_f64();
    let cpu = CpuUsed::between(cpu_before, cluster_cpu_seconds(cluster.kubeconfig()));
    let bytes = pod_bytes(&cluster.client(), &floor_ns, None).await?;
    let note = format!(
        "{cpu}; {} bytes per pod (managedFields {})",
        bytes.total / bytes.pods.max(1),
        bytes.managed_fields / bytes.pods.max(1)
    );
    cluster.delete_namespace(&floor_ns).await?;
    // The floor's pods must be gone before the next measurement.
    wait_for(
        "floor namespace deleted",
        Duration::from_secs(900),
        || async {
            let gone = Api::<k8s_openapi::api::core::v1::Namespace>::all(cluster.client())
                .get_opt(&floor_ns)
                .await?
                .is_none();
            Ok(gone.then_some(()))
        },
    )
    .await?;
    Ok((floor, note))
}

/// How long the bench watches an idle operator's requests.
const IDLE_WINDOW: Duration = Duration::from_secs(60);

/// 1,000-node benchmark (run by `scripts/bench-operator.sh`, not by default):
/// the control-plane floor (a plain DaemonSet to every node) against the
/// operator (ClusterPolicy creation to status ready with every device-plugin
/// pod Running), the operator's peak RSS, its API requests, and the writes it
/// makes on a resync with nothing to change. Prints figures; asserts only
/// correctness (zero writes on resync), never time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run scripts/bench-operator.sh"]
async fn bench_operator_1000_nodes() -> Result<()> {
    let count: usize = std::env::var("GPU_STACK_BENCH_NODES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let cluster = TestCluster::attach().await?;
    let admin = cluster.client();
    let bin = match std::env::var_os("GPU_STACK_OPERATOR_BIN") {
        Some(p) => PathBuf::from(p),
        None => workspace_binary("gpu-operator")?,
    };
    let suffix = unique_suffix();
    let prefix = format!("bench{suffix}");
    let namespace = cluster.create_namespace("gpu-bench").await?;
    apply_operator_crds(&admin).await?;
    force_delete_policy(&admin).await?;
    let tmp = std::env::temp_dir().join(format!("gpu-stack-op-bench-{suffix}"));
    std::fs::create_dir_all(&tmp)?;
    let release = format!("b{suffix}");
    let rbac = install_chart_rbac(&admin, &release, &namespace).await?;
    let kubeconfig = chart_kubeconfig(&cluster, &admin, &rbac, &namespace, &tmp).await?;

    let fleet = GpuFleet::new(format!("{prefix}-n"), count);
    let t = std::time::Instant::now();
    let names = cluster.create_gpu_nodes(&fleet).await?;
    println!(
        "bench: created {} nodes in {:.1}s",
        names.len(),
        t.elapsed().as_secs_f64()
    );

    // Floors, in the same run, before and after the operator: as many
    // DaemonSets as the policy runs on the nodes, selecting the same nodes,
    // timed to the same end (every DaemonSet reporting a ready pod on every
    // node); once with plain pods, once with the operator's own pods.
    // GPU_STACK_BENCH_POLICY: the ClusterPolicy spec to roll out, as JSON.
    // The default is what users get: both charts turn the driver and its
    // automatic upgrades on.
    let spec: serde_json::Value = match std::env::var("GPU_STACK_BENCH_POLICY") {
        Ok(json) => serde_json::from_str(&json).context("GPU_STACK_BENCH_POLICY is not JSON")?,
        Err(_) => {
            serde_json::json!({"driver": {"enabled": true, "upgradePolicy": {"autoUpgrade": true}}})
        }
    };
    // GPU_STACK_BENCH_FLOORS=0: the operator alone (at 5,000 nodes the
    // floors would take most of the run).
    let floors = std::env::var("GPU_STACK_BENCH_FLOORS").as_deref() != Ok("0");
    println!("bench: policy spec {spec}");
    let operands = operand_daemonsets(&spec, &fleet)?;
    let n = operands.len();
    let mut separate = spec.clone();
    if let Some(s) = separate.as_object_mut() {
        s.remove("nodeAgent");
    }
    let stack = operand_daemonsets(&separate, &fleet)?;
    let mut before = None;
    if floors {
        // The first rollout after the nodes join also pays for their start
        // (heartbeats, leases, controllers' first look at each node): a
        // warm-up round, reported and left out of the comparison.
        let (warm_up, note) = floor(&cluster, FloorPods::Plain, &operands, count).await?;
        println!("bench: warm-up floor (not counted): {warm_up:.1}s; {note}");
        let (plain_before, note) = floor(&cluster, FloorPods::Plain, &operands, count).await?;
        println!(
            "bench: control-plane floor ({n} plain DaemonSets ready on {count} nodes): {plain_before:.1}s; {note}"
        );
        // With the node agent, one more floor: plain DaemonSets as many as
        // the same policy runs without it (a DaemonSet per component,
        // NVIDIA's layout), the leanest the control plane deploys that
        // stack in.
        let stack_before = if stack.len() == n {
            None
        } else {
            let (secs, note) = floor(&cluster, FloorPods::Plain, &stack, count).await?;
            println!(
                "bench: stack floor ({} plain DaemonSets, one per component without the node agent): {secs:.1}s; {note}",
                stack.len()
            );
            Some(secs)
        };
        // Right before the operator, as in the runs before the stack floor
        // existed: its 6,000 deleted pods are not what the rollout follows.
        let (same_before, note) = floor(&cluster, FloorPods::Operands, &operands, count).await?;
        println!(
            "bench: same-pods floor (the operator's {n} DaemonSets, applied directly): {same_before:.1}s; {note}"
        );
        before = Some((plain_before, stack_before, same_before));
    }

    let op = Replica::start(&bin, &kubeconfig, &namespace, "bench", free_port()?)?;
    wait_for("operator leads", LONG, || async {
        Ok((metric(&op, "gpu_stack_operator_leader").await == Some(1.0)).then_some(()))
    })
    .await?;
    let cpu_before = cluster_cpu_seconds(cluster.kubeconfig());
    let op_cpu_before = process_cpu_seconds(op.child.id());
    let t = std::time::Instant::now();
    apply_policy(&admin, "cluster-policy", spec.clone()).await?;
    wait_for("ClusterPolicy ready", Duration::from_secs(900), || async {
        Ok(policy_state(&admin, "cluster-policy")
            .await?
            .filter(is_ready)
            .map(|_| ()))
    })
    .await?;
    let ready = t.elapsed().as_secs_f64();
    let plugin = device_plugin_ds(&daemonsets(&admin, &namespace).await?)
        .ok_or_else(|| anyhow!("no device-plugin DaemonSet"))?;
    wait_for(
        "device plugin on every node",
        Duration::from_secs(900),
        || async {
            let r = nodes_running(&admin, &namespace, &plugin, &prefix).await?;
            Ok((r.len() >= count).then_some(()))
        },
    )
    .await?;
    let pods = t.elapsed().as_secs_f64();
    let cpu_after = cluster_cpu_seconds(cluster.kubeconfig());
    let op_cpu = process_cpu_seconds(op.child.id()) - op_cpu_before;
    println!(
        "bench: operator ClusterPolicy -> status ready: {ready:.1}s; -> device-plugin Running on {count} nodes: {pods:.1}s"
    );
    println!(
        "bench: CPU during the rollout: {}; operator {op_cpu:.2} CPU-s",
        CpuUsed::between(cpu_before, cpu_after)
    );
    // GPU_STACK_BENCH_DUMP_DIR: one operand pod of each DaemonSet, to read.
    let dump = std::env::var_os("GPU_STACK_BENCH_DUMP_DIR").map(PathBuf::from);
    let bytes = pod_bytes(&admin, &namespace, dump.as_deref()).await?;
    println!(
        "bench: operand pods as stored: {} pods, {} bytes of JSON ({} per GPU node, {} per pod); managedFields {}, other metadata {}, spec {}, status {}",
        bytes.pods,
        bytes.total,
        bytes.total / count.max(1),
        bytes.total / bytes.pods.max(1),
        bytes.managed_fields,
        bytes.metadata,
        bytes.spec,
        bytes.status
    );
    for (app, (n, b)) in &bytes.by_app {
        println!("bench:   {app}: {n} pods, {} bytes each", b / n.max(&1));
    }
    let requests = metric_sum(&op, "gpu_stack_operator_api_requests_total").await;
    let writes = writes_by_resource(&op).await;
    let passes = metric_sum(&op, "gpu_operator_reconciliation_total").await;
    println!(
        "bench: operator API requests to converge: {requests} in {passes} passes; writes by resource: {writes:?}"
    );
    let kinds: Vec<String> = requests_by_kind(&op)
        .await
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    println!("bench: operator API requests by kind: {}", kinds.join(", "));

    // Resync with nothing to change: an unrelated label on one node triggers
    // a pass, which may not write anything.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let passes_before = metric_sum(&op, "gpu_operator_reconciliation_total").await;
    let writes_before = reconcile_writes(&writes_by_resource(&op).await);
    Api::<Node>::all(admin.clone())
        .patch(
            &names[0],
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"labels": {"bench/unrelated": "1"}}})),
        )
        .await?;
    wait_for("a resync pass", LONG, || async {
        Ok(
            (metric_sum(&op, "gpu_operator_reconciliation_total").await > passes_before)
                .then_some(()),
        )
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let resync_writes = reconcile_writes(&writes_by_resource(&op).await) - writes_before;
    println!("bench: writes on a resync with nothing to change: {resync_writes}");
    // Idle: a minute with nothing changing (lease renewals, the upgrade
    // controller's planned requeue, watch restarts).
    let idle_before = metric_sum(&op, "gpu_stack_operator_api_requests_total").await;
    let idle_kinds_before = requests_by_kind(&op).await;
    tokio::time::sleep(IDLE_WINDOW).await;
    let idle = metric_sum(&op, "gpu_stack_operator_api_requests_total").await - idle_before;
    let idle_kinds: Vec<String> = requests_by_kind(&op)
        .await
        .into_iter()
        .filter_map(|(k, v)| {
            let was = idle_kinds_before
                .iter()
                .find(|(b, _)| *b == k)
                .map_or(0.0, |(_, v)| *v);
            (v > was).then(|| format!("{k} {}", v - was))
        })
        .collect();
    println!(
        "bench: operator API requests per minute, idle: {:.1} ({})",
        idle * 60.0 / IDLE_WINDOW.as_secs_f64(),
        idle_kinds.join(", ")
    );
    let rss = peak_rss_kib(op.child.id()).unwrap_or(0);
    println!(
        "bench: operator peak RSS: {:.1} MiB ({:.2} KiB per node)",
        rss as f64 / 1024.0,
        rss as f64 / count.max(1) as f64
    );

    // The floor again, after the operator's pods are gone: run-to-run spread
    // of the control plane is seconds, so the operator is compared with both.
    force_delete_policy(&admin).await?;
    drop(op);
    wait_for("operand pods gone", Duration::from_secs(900), || async {
        let left = Api::<Pod>::namespaced(admin.clone(), &namespace)
            .list_metadata(&ListParams::default().limit(1))
            .await?;
        Ok(left.items.is_empty().then_some(()))
    })
    .await?;
    if let Some((plain_before, stack_before, same_before)) = before {
        let (same_after, note) = floor(&cluster, FloorPods::Operands, &operands, count).await?;
        println!("bench: same-pods floor again: {same_after:.1}s; {note}");
        let (plain_after, note) = floor(&cluster, FloorPods::Plain, &operands, count).await?;
        println!("bench: control-plane floor again: {plain_after:.1}s; {note}");
        let plain = (plain_before + plain_after) / 2.0;
        let same = (same_before + same_after) / 2.0;
        println!(
            "bench: operator ready {ready:.1}s vs mean same-pods floor {same:.1}s: {:+.1}s ({:.2}x); vs mean plain floor {plain:.1}s: {:+.1}s ({:.2}x)",
            ready - same,
            ready / same,
            ready - plain,
            ready / plain
        );
        if let Some(before) = stack_before {
            let (after, note) = floor(&cluster, FloorPods::Plain, &stack, count).await?;
            println!("bench: stack floor again: {after:.1}s; {note}");
            let stack_mean = (before + after) / 2.0;
            println!(
                "bench: operator ready {ready:.1}s vs mean stack floor {stack_mean:.1}s: {:+.1}s ({:.2}x)",
                ready - stack_mean,
                ready / stack_mean
            );
        }
    }

    cluster.delete_nodes(&names).await?;
    delete_applied(&admin, &rbac).await;
    let _ = cluster.delete_namespace(&namespace).await;
    let _ = std::fs::remove_dir_all(&tmp);
    ensure!(
        resync_writes == 0.0,
        "the operator wrote {resync_writes} times on a resync"
    );
    Ok(())
}
