//! Helpers of the driver upgrade end-to-end tests and benchmark: the
//! operator as a process, the ClusterPolicy with an upgrade policy, the
//! driver pods and revisions as the upgrade controller sees them, a GPU
//! workload under a PodDisruptionBudget, and watches that record every node
//! and driver pod change so a test can assert on the whole rollout, not only
//! its end.
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use gpu_stack_k8s::operator::clusterpolicy::ClusterPolicy;
use k8s_openapi::api::apps::v1::{ControllerRevision, DaemonSet};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::task::JoinHandle;

use crate::wait_for;

/// Node label holding the upgrade state.
pub const STATE_LABEL: &str = "nvidia.com/gpu-driver-upgrade-state";
/// Selects the driver DaemonSets, their pods and their ControllerRevisions.
pub const DRIVER_SELECTOR: &str = "nvidia.com/gpu-stack.component=driver";
/// The ClusterPolicy the tests apply (a cluster-wide singleton).
pub const POLICY_NAME: &str = "cluster-policy";
/// How long setup steps may take on a busy 2-core machine.
pub const LONG: Duration = Duration::from_secs(120);

pub use crate::chart::apply_operator_crds;

/// The `gpu-operator` binary running as a process; killed (SIGKILL) on drop.
pub struct OperatorProcess {
    child: Child,
    listen: String,
}

impl OperatorProcess {
    /// Starts the operator with the chart's ServiceAccount `kubeconfig`,
    /// operands in `namespace`, a 6 s lease (so a restart takes over fast)
    /// and `extra` flags; its log goes to stderr, without the per-node lines
    /// unless `RUST_LOG` says otherwise.
    pub fn start(
        bin: &Path,
        kubeconfig: &Path,
        namespace: &str,
        identity: &str,
        extra: &[String],
    ) -> Result<Self> {
        let listen = format!("127.0.0.1:{}", free_port()?);
        let log = std::env::var("GPU_STACK_E2E_OPERATOR_LOG")
            .unwrap_or_else(|_| "info,kube=warn".to_string());
        let child = Command::new(bin)
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--namespace={namespace}"))
            .arg(format!("--identity={identity}"))
            .arg(format!("--listen={listen}"))
            .arg(format!("--lease-name=gpu-stack-upg-{namespace}"))
            .args(["--lease-duration-seconds=6", "--renew-grace-seconds=2"])
            .args(extra)
            .env("RUST_LOG", log)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        Ok(Self { child, listen })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (`STOP`, `CONT`, ...) to the process.
    pub fn signal(&self, signal: &str) -> Result<()> {
        send_signal(self.pid(), signal)
    }

    /// Waits (at most `within`) for the process to exit by itself.
    pub async fn exited(&mut self, within: Duration) -> Result<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "the operator (pid {}) did not exit within {within:?}",
                self.pid()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// SIGKILL, and reap the process.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The `/metrics` page (empty if it cannot be read): plain HTTP on loopback.
    pub async fn metrics_page(&self) -> String {
        self.page("/metrics").await
    }

    /// The whole HTTP answer to `GET path` (empty if there is none).
    pub async fn page(&self, path: &str) -> String {
        crate::http_get(&self.listen, path).await
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// One gauge or counter without labels.
    pub async fn metric(&self, name: &str) -> Option<f64> {
        self.metrics_page()
            .await
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    /// `gpu_stack_operator_api_requests_total` by `(verb, resource)`.
    pub async fn api_requests(&self) -> BTreeMap<(String, String), f64> {
        parse_api_requests(&self.metrics_page().await)
    }

    /// Waits until this process leads (its leader gauge is 1).
    pub async fn wait_leading(&self) -> Result<()> {
        wait_for("the operator leads", LONG, || async {
            Ok((self.metric("gpu_stack_operator_leader").await == Some(1.0)).then_some(()))
        })
        .await?;
        Ok(())
    }
}

impl Drop for OperatorProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sends `signal` (`STOP`, `CONT`, ...) to process `pid`.
pub fn send_signal(pid: u32, signal: &str) -> Result<()> {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .context("running kill")?;
    anyhow::ensure!(status.success(), "kill -{signal} {pid} failed");
    Ok(())
}

/// The test cluster's kube-apiserver, stopped (SIGSTOP) until this is
/// dropped: it is resumed even when the test fails midway.
pub struct StoppedApiServer {
    pid: u32,
}

impl StoppedApiServer {
    /// Stops the kube-apiserver of the test cluster whose kubeconfig is
    /// `kubeconfig` (`cargo xtask cluster up` keeps its pid beside it).
    pub fn stop(kubeconfig: &Path) -> Result<Self> {
        let file = kubeconfig
            .parent()
            .map(|d| d.join("pids/kube-apiserver.pid"))
            .context("the kubeconfig has no folder")?;
        let pid: u32 = std::fs::read_to_string(&file)
            .with_context(|| {
                format!(
                    "reading {} (this step needs the test cluster of `cargo xtask cluster up`)",
                    file.display()
                )
            })?
            .trim()
            .parse()
            .with_context(|| format!("{} holds no pid", file.display()))?;
        send_signal(pid, "STOP")?;
        Ok(Self { pid })
    }
}

impl Drop for StoppedApiServer {
    fn drop(&mut self) {
        let _ = send_signal(self.pid, "CONT");
    }
}

/// `gpu_stack_operator_api_requests_total{verb,resource}` samples of a
/// metrics page, by `(verb, resource)`.
pub fn parse_api_requests(page: &str) -> BTreeMap<(String, String), f64> {
    let mut out = BTreeMap::new();
    for line in page.lines() {
        let Some(rest) = line.strip_prefix("gpu_stack_operator_api_requests_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |key: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{key}=\"")))
                .and_then(|v| v.split('"').next())
                .unwrap_or("")
                .to_string()
        };
        if let Ok(v) = value.trim().parse::<f64>() {
            *out.entry((label("verb"), label("resource"))).or_default() += v;
        }
    }
    out
}

/// A free loopback port.
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Server-side applies the ClusterPolicy [`POLICY_NAME`] with `spec`.
pub async fn apply_policy(client: &Client, spec: serde_json::Value) -> Result<()> {
    let body = serde_json::json!({
        "apiVersion": "nvidia.com/v1",
        "kind": "ClusterPolicy",
        "metadata": { "name": POLICY_NAME },
        "spec": spec,
    });
    Api::<ClusterPolicy>::all(client.clone())
        .patch(
            POLICY_NAME,
            &PatchParams::apply("gpu-stack-e2e").force(),
            &Patch::Apply(&body),
        )
        .await?;
    Ok(())
}

/// A ClusterPolicy spec with only the driver (at `version`) and its
/// `upgradePolicy` (autoUpgrade on, no limit on parallel upgrades, the
/// given `maxUnavailable`, `extra` merged into the policy).
pub fn policy_spec(
    version: &str,
    max_unavailable: &str,
    extra: serde_json::Value,
) -> serde_json::Value {
    let mut upgrade = serde_json::json!({
        "autoUpgrade": true,
        "maxUnavailable": max_unavailable,
        "maxParallelUpgrades": 0,
    });
    if let (Some(u), serde_json::Value::Object(extra)) = (upgrade.as_object_mut(), extra) {
        u.extend(extra);
    }
    serde_json::json!({
        "driver": {
            "enabled": true,
            "version": version,
            "upgradePolicy": upgrade,
        },
        "dcgmExporter": { "enabled": false },
        "migManager": { "enabled": false },
    })
}

/// The ClusterPolicy, if there is one.
pub async fn policy(client: &Client) -> Result<Option<ClusterPolicy>, kube::Error> {
    Api::<ClusterPolicy>::all(client.clone())
        .get_opt(POLICY_NAME)
        .await
}

/// Deletes every leftover ClusterPolicy, removing finalizers so they go
/// even without an operator running.
pub async fn force_delete_policy(client: &Client) -> Result<()> {
    let api = Api::<ClusterPolicy>::all(client.clone());
    let names: Vec<String> = api
        .list_metadata(&ListParams::default())
        .await?
        .items
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    for name in &names {
        let _ = api.delete(name, &DeleteParams::default()).await;
        let _ = api
            .patch_metadata(
                name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"metadata": {"finalizers": null}})),
            )
            .await;
    }
    wait_for("leftover ClusterPolicies gone", LONG, || async {
        Ok(api
            .list_metadata(&ListParams::default())
            .await?
            .items
            .is_empty()
            .then_some(()))
    })
    .await?;
    Ok(())
}

/// The newest revision hash of each driver DaemonSet, by DaemonSet uid.
pub async fn driver_revisions(
    client: &Client,
    ns: &str,
) -> Result<BTreeMap<String, String>, kube::Error> {
    let sets = Api::<DaemonSet>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(DRIVER_SELECTOR))
        .await?
        .items;
    let revs = Api::<ControllerRevision>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(DRIVER_SELECTOR))
        .await?
        .items;
    let mut out = BTreeMap::new();
    for ds in sets {
        let uid = ds.uid().unwrap_or_default();
        if let Some(hash) = revs
            .iter()
            .filter(|r| r.owner_references().iter().any(|o| o.uid == uid))
            .max_by_key(|r| r.revision)
            .and_then(|r| r.labels().get("controller-revision-hash").cloned())
        {
            out.insert(uid, hash);
        }
    }
    Ok(out)
}

/// Driver pods (not terminating) on the nodes whose name starts with
/// `prefix`: node -> Running at its DaemonSet's newest revision.
pub async fn driver_pods(
    client: &Client,
    ns: &str,
    prefix: &str,
) -> Result<BTreeMap<String, bool>, kube::Error> {
    let revs = driver_revisions(client, ns).await?;
    let pods = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(DRIVER_SELECTOR))
        .await?
        .items;
    let mut out = BTreeMap::new();
    for p in pods {
        if p.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let Some(node) = p.spec.as_ref().and_then(|s| s.node_name.clone()) else {
            continue;
        };
        if !node.starts_with(prefix) {
            continue;
        }
        let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        let owner = p
            .owner_references()
            .iter()
            .find(|o| o.kind == "DaemonSet")
            .map(|o| o.uid.clone())
            .unwrap_or_default();
        let in_sync = revs.get(&owner) == p.labels().get("controller-revision-hash");
        out.insert(node, running && in_sync);
    }
    Ok(out)
}

/// Nodes matching a label selector.
pub async fn fleet_nodes(client: &Client, selector: &str) -> Result<Vec<Node>, kube::Error> {
    Ok(Api::<Node>::all(client.clone())
        .list(&ListParams::default().labels(selector))
        .await?
        .items)
}

/// The node's upgrade state label ("" without one).
pub fn state_of(n: &Node) -> &str {
    n.labels().get(STATE_LABEL).map_or("", String::as_str)
}

/// `spec.unschedulable`.
pub fn unschedulable(n: &Node) -> bool {
    n.spec
        .as_ref()
        .and_then(|s| s.unschedulable)
        .unwrap_or(false)
}

/// The node's Ready condition is True (a node without one counts as Ready,
/// as the upgrade controller counts it).
pub fn node_ready(n: &Node) -> bool {
    n.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
        .is_none_or(|c| c.status == "True")
}

/// Node states by count, for failure messages.
pub fn state_counts(nodes: &[Node]) -> BTreeMap<String, usize> {
    let mut states = BTreeMap::new();
    for n in nodes {
        *states.entry(state_of(n).to_string()).or_default() += 1;
    }
    states
}

/// A Deployment of `replicas` pods asking for one `nvidia.com/gpu` each,
/// on the nodes matching `node_selector`, spread over hostnames.
pub fn gpu_deployment(
    name: &str,
    ns: &str,
    replicas: usize,
    node_selector: serde_json::Value,
) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "nodeSelector": node_selector,
                    "topologySpreadConstraints": [{
                        "maxSkew": 1,
                        "topologyKey": "kubernetes.io/hostname",
                        "whenUnsatisfiable": "ScheduleAnyway",
                        "labelSelector": {"matchLabels": {"app": name}},
                    }],
                    "containers": [{
                        "name": "train",
                        "image": "registry.example.com/trainer:1",
                        "resources": {"limits": {"nvidia.com/gpu": "1"}},
                    }],
                },
            },
        },
    })
}

/// A PodDisruptionBudget over the pods `app=<app>`; `budget` is its spec
/// besides the selector (e.g. `{"maxUnavailable": 5}`).
pub fn pod_disruption_budget(
    name: &str,
    ns: &str,
    app: &str,
    budget: serde_json::Value,
) -> serde_json::Value {
    let mut spec = serde_json::json!({"selector": {"matchLabels": {"app": app}}});
    if let (Some(s), serde_json::Value::Object(b)) = (spec.as_object_mut(), budget) {
        s.extend(b);
    }
    serde_json::json!({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    })
}

fn api_resource(obj: &DynamicObject) -> Result<ApiResource> {
    let types = obj
        .types
        .as_ref()
        .context("object without apiVersion and kind")?;
    let (group, version) = types
        .api_version
        .split_once('/')
        .unwrap_or(("", &types.api_version));
    Ok(ApiResource::from_gvk(&GroupVersionKind::gvk(
        group,
        version,
        &types.kind,
    )))
}

/// Server-side applies namespaced objects given as JSON.
pub async fn apply_objects(admin: &Client, ns: &str, objects: &[serde_json::Value]) -> Result<()> {
    for value in objects {
        let obj: DynamicObject = serde_json::from_value(value.clone())?;
        let ar = api_resource(&obj)?;
        Api::<DynamicObject>::namespaced_with(admin.clone(), ns, &ar)
            .patch(
                &obj.name_any(),
                &PatchParams::apply("gpu-stack-e2e").force(),
                &Patch::Apply(&obj),
            )
            .await
            .with_context(|| format!("applying {} {}", ar.kind, obj.name_any()))?;
    }
    Ok(())
}

/// Deletes a namespaced object given as JSON (a missing one is fine).
pub async fn delete_object(admin: &Client, ns: &str, object: &serde_json::Value) -> Result<()> {
    let obj: DynamicObject = serde_json::from_value(object.clone())?;
    let ar = api_resource(&obj)?;
    match Api::<DynamicObject>::namespaced_with(admin.clone(), ns, &ar)
        .delete(&obj.name_any(), &DeleteParams::default())
        .await
    {
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
        other => other
            .map(|_| ())
            .with_context(|| format!("deleting {} {}", ar.kind, obj.name_any())),
    }
}

/// Names of the Running, not terminating pods matching `selector` in `ns`.
pub async fn running_pods(
    admin: &Client,
    ns: &str,
    selector: &str,
) -> Result<BTreeSet<String>, kube::Error> {
    Ok(Api::<Pod>::namespaced(admin.clone(), ns)
        .list(&ListParams::default().labels(selector))
        .await?
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .map(|p| p.name_any())
        .collect())
}

/// What a [`NodeWatch`] keeps of a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeView {
    /// The upgrade state label ("" without one).
    pub state: String,
    /// `spec.unschedulable`.
    pub unschedulable: bool,
    /// The Ready condition is True.
    pub ready: bool,
}

/// What a [`NodeWatch`] has seen.
#[derive(Debug, Default)]
pub struct NodeRecord {
    /// The nodes now, by name.
    pub nodes: BTreeMap<String, NodeView>,
    /// Most nodes unschedulable at once.
    pub peak_cordoned: usize,
    /// Most nodes unschedulable or NotReady at once (what the upgrade
    /// budget counts).
    pub peak_unavailable: usize,
    /// Every state each node has been seen in, in order, repeats folded.
    pub states: BTreeMap<String, Vec<String>>,
    /// Whether each node was ever seen unschedulable.
    pub ever_cordoned: BTreeSet<String>,
}

impl NodeRecord {
    fn apply(&mut self, n: &Node) {
        let name = n.name_any();
        let view = NodeView {
            state: state_of(n).to_string(),
            unschedulable: unschedulable(n),
            ready: node_ready(n),
        };
        let seen = self.states.entry(name.clone()).or_default();
        if seen.last() != Some(&view.state) {
            seen.push(view.state.clone());
        }
        if view.unschedulable {
            self.ever_cordoned.insert(name.clone());
        }
        self.nodes.insert(name, view);
    }

    fn count(&mut self) {
        let cordoned = self.nodes.values().filter(|v| v.unschedulable).count();
        let unavailable = self
            .nodes
            .values()
            .filter(|v| v.unschedulable || !v.ready)
            .count();
        self.peak_cordoned = self.peak_cordoned.max(cordoned);
        self.peak_unavailable = self.peak_unavailable.max(unavailable);
    }

    /// Nodes now in `state`.
    pub fn in_state(&self, state: &str) -> usize {
        self.nodes.values().filter(|v| v.state == state).count()
    }
}

/// A watch of the nodes matching a label selector that counts unschedulable
/// and NotReady nodes after every change: its peaks are exact maxima over
/// the rollout, not samples. Stopped on drop.
pub struct NodeWatch {
    record: Arc<Mutex<NodeRecord>>,
    task: JoinHandle<()>,
}

impl NodeWatch {
    /// Starts watching; returns once the initial list is in.
    pub async fn start(client: &Client, selector: &str) -> Result<Self> {
        let record = Arc::new(Mutex::new(NodeRecord::default()));
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let api: Api<Node> = Api::all(client.clone());
        let config = watcher::Config::default().labels(selector);
        let task = {
            let record = record.clone();
            tokio::spawn(async move {
                let mut ready_tx = Some(ready_tx);
                let mut stream = watcher(api, config).default_backoff().boxed();
                let mut relist: Option<NodeRecord> = None;
                while let Some(event) = stream.next().await {
                    let Ok(event) = event else { continue };
                    let mut r = record.lock().unwrap_or_else(|e| e.into_inner());
                    match event {
                        watcher::Event::Init => {
                            relist = Some(NodeRecord::default());
                        }
                        watcher::Event::InitApply(n) => {
                            if let Some(fresh) = relist.as_mut() {
                                fresh.apply(&n);
                            }
                        }
                        watcher::Event::InitDone => {
                            if let Some(fresh) = relist.take() {
                                r.nodes = fresh.nodes;
                                for (name, view) in r.nodes.clone() {
                                    let seen = r.states.entry(name.clone()).or_default();
                                    if seen.last() != Some(&view.state) {
                                        seen.push(view.state.clone());
                                    }
                                    if view.unschedulable {
                                        r.ever_cordoned.insert(name);
                                    }
                                }
                            }
                            r.count();
                            if let Some(tx) = ready_tx.take() {
                                let _ = tx.send(());
                            }
                        }
                        watcher::Event::Apply(n) => {
                            r.apply(&n);
                            r.count();
                        }
                        watcher::Event::Delete(n) => {
                            r.nodes.remove(&n.name_any());
                            r.count();
                        }
                    }
                }
            })
        };
        tokio::time::timeout(LONG, ready_rx)
            .await
            .context("the node watch did not list in time")?
            .context("the node watch stopped")?;
        Ok(Self { record, task })
    }

    /// Reads what the watch has seen.
    pub fn with<T>(&self, f: impl FnOnce(&NodeRecord) -> T) -> T {
        f(&self.record.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Drop for NodeWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A watch of the driver pods in a namespace that records the uid of every
/// driver pod each node has run: a node whose driver was restarted once has
/// two. Stopped on drop.
pub struct DriverPodWatch {
    uids: Arc<Mutex<BTreeMap<String, BTreeSet<String>>>>,
    task: JoinHandle<()>,
}

impl DriverPodWatch {
    /// Starts watching; returns once the initial list is in.
    pub async fn start(client: &Client, ns: &str) -> Result<Self> {
        let uids: Arc<Mutex<BTreeMap<String, BTreeSet<String>>>> = Arc::default();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let api: Api<Pod> = Api::namespaced(client.clone(), ns);
        let config = watcher::Config::default().labels(DRIVER_SELECTOR);
        let task = {
            let uids = uids.clone();
            tokio::spawn(async move {
                let mut ready_tx = Some(ready_tx);
                let mut stream = watcher(api, config).default_backoff().boxed();
                while let Some(event) = stream.next().await {
                    let pod = match event {
                        Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => p,
                        Ok(watcher::Event::InitDone) => {
                            if let Some(tx) = ready_tx.take() {
                                let _ = tx.send(());
                            }
                            continue;
                        }
                        _ => continue,
                    };
                    let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
                    if let (Some(node), Some(uid)) = (node, pod.uid()) {
                        uids.lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .entry(node)
                            .or_default()
                            .insert(uid);
                    }
                }
            })
        };
        tokio::time::timeout(LONG, ready_rx)
            .await
            .context("the driver pod watch did not list in time")?
            .context("the driver pod watch stopped")?;
        Ok(Self { uids, task })
    }

    /// The driver pod uids seen on each node.
    pub fn uids(&self) -> BTreeMap<String, BTreeSet<String>> {
        self.uids.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Drop for DriverPodWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_requests_are_summed_by_verb_and_resource() {
        let page = "\
# HELP gpu_stack_operator_api_requests_total x
gpu_stack_operator_api_requests_total{verb=\"patch\",resource=\"nodes\"} 2
gpu_stack_operator_api_requests_total{verb=\"list\",resource=\"pods\"} 7
gpu_operator_gpu_nodes_total 3
";
        let got = parse_api_requests(page);
        assert_eq!(got[&("patch".to_string(), "nodes".to_string())], 2.0);
        assert_eq!(got[&("list".to_string(), "pods".to_string())], 7.0);
        assert_eq!(got.len(), 2);
    }

    #[test]
    fn policy_spec_merges_extra_upgrade_fields() {
        let spec = policy_spec(
            "570.1",
            "10%",
            serde_json::json!({"podDeletion": {"timeoutSeconds": 0}}),
        );
        let u = &spec["driver"]["upgradePolicy"];
        assert_eq!(u["maxUnavailable"], "10%");
        assert_eq!(u["autoUpgrade"], true);
        assert_eq!(u["podDeletion"]["timeoutSeconds"], 0);
    }

    #[test]
    fn node_record_counts_cordoned_and_not_ready_nodes() {
        let mut r = NodeRecord::default();
        let node = |name: &str, cordoned: bool, ready: &str, state: &str| -> Node {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "labels": {STATE_LABEL: state}},
                "spec": {"unschedulable": cordoned},
                "status": {"conditions": [{"type": "Ready", "status": ready}]},
            }))
            .unwrap()
        };
        r.apply(&node("a", true, "True", "cordon-required"));
        r.apply(&node("b", false, "False", "upgrade-required"));
        r.apply(&node("c", false, "True", "upgrade-done"));
        r.count();
        r.apply(&node("a", false, "True", "upgrade-done"));
        r.count();
        assert_eq!(r.peak_cordoned, 1);
        assert_eq!(r.peak_unavailable, 2);
        assert_eq!(r.states["a"], ["cordon-required", "upgrade-done"]);
        assert!(r.ever_cordoned.contains("a") && !r.ever_cordoned.contains("b"));
        assert_eq!(r.in_state("upgrade-done"), 2);
    }
}
