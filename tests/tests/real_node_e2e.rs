//! The whole stack on a real node: `helm install` of the chart with Helm 4
//! (tools/helm) on the test cluster's real kubelet + containerd (`cargo
//! xtask cluster up --real-node`, always part of `cargo xtask test`), the
//! operator as the chart's Deployment, the node found without NFD, every
//! operand as a real container of the project's images on simulated GPUs,
//! workload pods that get exactly their GPUs, MIG, faults, a driver upgrade,
//! MIG instances created for DRA claims, and `helm uninstall`.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use gpu_stack_e2e::binaries::workspace_binary;
use gpu_stack_e2e::chart::{
    CLUSTER_POLICY_CRD, has_unsupported_fields, leave_foreign_cluster_policy_crd,
};
use gpu_stack_e2e::{TestCluster, wait_for};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};

/// Directory of the real node (`<state>/node`), set by `cargo xtask test`.
const NODE_DIR_ENV: &str = "GPU_STACK_E2E_NODE_DIR";
/// Must match xtask/src/node.rs.
const NODE_NAME: &str = "gpu-node-real";
const NAMESPACE: &str = "gpu-operator";
const RELEASE: &str = "gpu-stack";
const POLICY: &str = "cluster-policy";
const BUSYBOX: &str = "localhost/gpu-stack/busybox:0.1.0";
/// Inside the node, and as seen by the operands (validations directory).
const SIM_FLEET: &str = "/run/nvidia/validations/gpu-stack-sim/fleet.yaml";
const SIM_STATE: &str = "/run/nvidia/validations/gpu-stack-sim/state.json";
/// Bounds that keep a broken node from hanging the run (not speed assertions).
const ROLLOUT: Duration = Duration::from_secs(300);
const STEP: Duration = Duration::from_secs(120);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".."))
}

/// The real node's directory, or an error saying how to get one.
fn node_dir() -> Result<PathBuf> {
    let dir = match std::env::var_os(NODE_DIR_ENV).filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => repo_root().join(".cache/cluster/node"),
    };
    ensure!(
        dir.join("kubelet.sh").is_file(),
        "no real test node at {} ({NODE_DIR_ENV} unset or stale): run `cargo xtask test`, or \
         `cargo xtask cluster up --real-node` and export the {NODE_DIR_ENV} it prints",
        dir.display()
    );
    Ok(dir)
}

/// A path inside the node, as the host sees it.
fn on_node(dir: &Path, inside: &str) -> PathBuf {
    dir.join("root").join(inside.trim_start_matches('/'))
}

fn helm() -> Result<PathBuf> {
    let out = Command::new(repo_root().join("tools/helm/build.sh"))
        .output()
        .context("running tools/helm/build.sh")?;
    ensure!(
        out.status.success(),
        "tools/helm/build.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// Runs helm against the test cluster. Helm 4 applies server-side (its
/// default, kept here as users get it) and `--wait=watcher` waits for kstatus
/// readiness: workloads rolled out, and the ClusterPolicy's
/// `status.observedGeneration` caught up with its spec.
fn run_helm(cluster: &TestCluster, args: &[&str]) -> Result<String> {
    let out = Command::new(helm()?)
        .args(args)
        .arg(format!("--kubeconfig={}", cluster.kubeconfig().display()))
        .output()
        .context("running helm")?;
    ensure!(
        out.status.success(),
        "helm {} failed: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn uninstall(cluster: &TestCluster) -> Result<String> {
    run_helm(
        cluster,
        &[
            "uninstall",
            RELEASE,
            "--namespace",
            NAMESPACE,
            "--wait=watcher",
            "--timeout",
            "5m",
        ],
    )
}

/// `helm upgrade --reuse-values` of the release with `extra` (`--set`,
/// `--values`), waiting for it as install does.
fn helm_upgrade(cluster: &TestCluster, extra: &[&str]) -> Result<()> {
    helm_upgrade_waiting(cluster, "--wait=watcher", extra)
}

/// `helm upgrade` that returns once the release is written (Helm 4's
/// `hookOnly`, its default): Helm 4's watcher waits until the ClusterPolicy
/// reports ready again, which during a driver upgrade is after the whole
/// rollout, and the test follows that rollout state by state.
fn helm_upgrade_no_wait(cluster: &TestCluster, extra: &[&str]) -> Result<()> {
    helm_upgrade_waiting(cluster, "--wait=hookOnly", extra)
}

fn helm_upgrade_waiting(cluster: &TestCluster, wait: &str, extra: &[&str]) -> Result<()> {
    let chart = repo_root().join("deploy/helm/gpu-stack");
    let chart = chart.display().to_string();
    let mut args = vec![
        "upgrade",
        RELEASE,
        chart.as_str(),
        "--namespace",
        NAMESPACE,
        "--reuse-values",
        wait,
        "--timeout",
        "5m",
    ];
    args.extend_from_slice(extra);
    run_helm(cluster, &args).map(drop)
}

/// Waits until the ClusterPolicy's state is `ready`.
async fn wait_policy_ready(client: &Client, what: &str) -> Result<()> {
    wait_for(what, ROLLOUT, || async {
        Ok((policy_state(client).await.as_deref() == Some("ready")).then_some(()))
    })
    .await?;
    Ok(())
}

/// Runs a busybox pod `name` asking for one `resource`, checks that its
/// `NVIDIA_VISIBLE_DEVICES` names exactly one device starting `prefix`
/// (`GPU-`, `MIG-`) and returns its log; the caller deletes it.
async fn one_visible_device(
    client: &Client,
    name: &str,
    resource: &str,
    prefix: &str,
) -> Result<String> {
    let pod = busybox_pod(
        name,
        &[(resource, "1")],
        "echo VISIBLE=$NVIDIA_VISIBLE_DEVICES; echo DONE; sleep 3600",
    )?;
    let log = run_workload(client, pod, "DONE").await?;
    ensure!(
        only_visible(&log, prefix).is_some(),
        "{name}: NVIDIA_VISIBLE_DEVICES is not exactly one {prefix} device: {log}"
    );
    Ok(log)
}

/// The ClusterPolicy API (the test reads it untyped, as a user's tools do).
fn cluster_policies(client: &Client) -> Api<kube::api::DynamicObject> {
    Api::all_with(
        client.clone(),
        &kube::api::ApiResource::from_gvk(&kube::api::GroupVersionKind::gvk(
            "nvidia.com",
            "v1",
            "ClusterPolicy",
        )),
    )
}

fn node_label(node: &Node, key: &str) -> Option<String> {
    node.labels().get(key).cloned()
}

fn allocatable(node: &Node, resource: &str) -> i64 {
    node.status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .and_then(|a| a.get(resource))
        .and_then(|q| q.0.parse().ok())
        .unwrap_or(0)
}

async fn policy_state(client: &Client) -> Option<String> {
    let api = cluster_policies(client);
    let policy = api.get_opt(POLICY).await.ok()??;
    policy.data["status"]["state"].as_str().map(String::from)
}

fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn phase(pod: &Pod) -> String {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.clone())
        .unwrap_or_default()
}

/// One line per pod of the operator's namespace, for failure messages.
async fn describe_pods(client: &Client) -> String {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let Ok(list) = pods.list(&ListParams::default()).await else {
        return "(pods could not be listed)".into();
    };
    let mut out = String::new();
    for p in list {
        let statuses = p
            .status
            .as_ref()
            .map(|s| {
                s.init_container_statuses
                    .iter()
                    .flatten()
                    .chain(s.container_statuses.iter().flatten())
                    .map(|c| {
                        let state = c.state.as_ref();
                        let why = state
                            .and_then(|s| s.waiting.as_ref())
                            .map(|w| {
                                format!(
                                    "waiting {} {}",
                                    w.reason.clone().unwrap_or_default(),
                                    w.message.clone().unwrap_or_default()
                                )
                            })
                            .or_else(|| {
                                state.and_then(|s| s.terminated.as_ref()).map(|t| {
                                    format!(
                                        "terminated {} ({})",
                                        t.exit_code,
                                        t.reason.clone().unwrap_or_default()
                                    )
                                })
                            })
                            .unwrap_or_else(|| "running".into());
                        format!("{}: {why} ready={}", c.name, c.ready)
                    })
                    .collect::<Vec<_>>()
                    .join("; ")
            })
            .unwrap_or_default();
        out.push_str(&format!("{} {} [{statuses}]\n", p.name_any(), phase(&p)));
    }
    out
}

/// Last lines of every container log of the operator's namespace on the node.
fn pod_log_tails(dir: &Path, lines: usize) -> String {
    let mut out = String::new();
    let root = on_node(dir, "/var/log/pods");
    let Ok(pods) = std::fs::read_dir(&root) else {
        return out;
    };
    for pod in pods.flatten() {
        if !pod.file_name().to_string_lossy().starts_with(NAMESPACE) {
            continue;
        }
        for container in std::fs::read_dir(pod.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            for log in std::fs::read_dir(container.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                let text = std::fs::read_to_string(log.path()).unwrap_or_default();
                let all: Vec<&str> = text.lines().collect();
                out.push_str(&format!("--- {} ---\n", log.path().display()));
                for line in &all[all.len().saturating_sub(lines)..] {
                    out.push_str(line);
                    out.push('\n');
                }
            }
        }
    }
    out
}

fn busybox_pod(name: &str, resources: &[(&str, &str)], script: &str) -> Result<Pod> {
    let limits: BTreeMap<&str, &str> = resources.iter().copied().collect();
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "restartPolicy": "Never",
            "containers": [{
                "name": "work",
                "image": BUSYBOX,
                "imagePullPolicy": "IfNotPresent",
                "command": ["sh", "-c", script],
                "resources": {"limits": limits},
            }],
        },
    }))?)
}

/// Creates the pod and waits until it runs; returns its log once `marker` shows.
async fn run_workload(client: &Client, pod: Pod, marker: &str) -> Result<String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let name = pod.name_any();
    pods.create(&PostParams::default(), &pod).await?;
    let log = wait_for(
        &format!("workload pod {name} to log {marker:?}"),
        STEP,
        || {
            let pods = pods.clone();
            let name = name.clone();
            async move {
                let Ok(pod) = pods.get(&name).await else {
                    return Ok(None);
                };
                if phase(&pod) != "Running" && phase(&pod) != "Succeeded" {
                    return Ok(None);
                }
                // Through the API server, its egress proxy and the real kubelet.
                let log = pods
                    .logs(&name, &LogParams::default())
                    .await
                    .unwrap_or_default();
                Ok(log.contains(marker).then_some(log))
            }
        },
    )
    .await;
    match log {
        Ok(log) => Ok(log),
        Err(e) => {
            let pod = pods.get(&name).await.ok();
            bail!("{e}; pod status: {:?}", pod.and_then(|p| p.status));
        }
    }
}

/// The one device a workload's `VISIBLE=$NVIDIA_VISIBLE_DEVICES` line names,
/// if it names exactly one and it starts with `prefix` (`GPU-`, `MIG-`).
fn only_visible<'a>(log: &'a str, prefix: &str) -> Option<&'a str> {
    let visible: Vec<&str> = log
        .lines()
        .filter_map(|l| l.strip_prefix("VISIBLE="))
        .collect();
    match visible.as_slice() {
        [one] if one.starts_with(prefix) && !one.contains(',') => Some(one),
        _ => None,
    }
}

async fn delete_pod(client: &Client, name: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let _ = pods
        .delete(name, &DeleteParams::default().grace_period(0))
        .await;
    let _ = wait_for(&format!("pod {name} to go"), STEP, || {
        let pods = pods.clone();
        let name = name.to_string();
        async move {
            Ok(pods
                .get_opt(&name)
                .await
                .ok()
                .flatten()
                .is_none()
                .then_some(()))
        }
    })
    .await;
}

async fn the_node(client: &Client) -> Result<Node> {
    Ok(Api::<Node>::all(client.clone()).get(NODE_NAME).await?)
}

async fn wait_allocatable(
    client: &Client,
    resource: &str,
    what: &str,
    ok: impl Fn(i64) -> bool,
) -> Result<i64> {
    let nodes: Api<Node> = Api::all(client.clone());
    Ok(wait_for(what, STEP, || {
        let nodes = nodes.clone();
        let ok = &ok;
        async move {
            let node = nodes.get(NODE_NAME).await?;
            let n = allocatable(&node, resource);
            Ok(ok(n).then_some(n))
        }
    })
    .await?)
}

/// Kills a node process by its pid file and starts it again with the start
/// script `cargo xtask` wrote, as a process of its own.
fn restart_node_process(dir: &Path, name: &str) -> Result<()> {
    let pids = dir
        .parent()
        .context("node directory without a parent")?
        .join("pids");
    // A supervised process (containerd) is started again by its supervisor,
    // as systemd would: stop it and wait for the new one.
    let main_pid = pids.join(format!("{name}.main.pid"));
    if main_pid.exists() {
        let old = std::fs::read_to_string(&main_pid)?.trim().to_string();
        let status = Command::new("kill").arg(&old).status()?;
        ensure!(status.success(), "kill {old} ({name}) failed");
        for _ in 0..200 {
            let now = std::fs::read_to_string(&main_pid)?.trim().to_string();
            if now != old && Path::new(&format!("/proc/{now}")).exists() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        bail!("{name} was not started again after kill {old}");
    }
    let pid_file = pids.join(format!("{name}.pid"));
    let pid: i32 = std::fs::read_to_string(&pid_file)?.trim().parse()?;
    let status = Command::new("kill").arg(pid.to_string()).status()?;
    ensure!(status.success(), "kill {pid} ({name}) failed");
    for _ in 0..100 {
        if !Path::new(&format!("/proc/{pid}")).exists() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let child = Command::new("setsid")
        .arg("/bin/sh")
        .arg(dir.join(format!("{name}.sh")))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .with_context(|| format!("restarting {name}"))?;
    std::fs::write(&pid_file, format!("{}\n", child.id()))?;
    Ok(())
}

/// containerd's config inside the node (the toolkit agent edits it).
const CONTAINERD_CONFIG: &str = "/etc/containerd/config.toml";
/// The drop-in gpu-stack's toolkit agent writes there.
const CONTAINERD_DROP_IN: &str = "/etc/containerd/conf.d/99-gpu-stack.toml";

/// How many times the node's containerd has started (its log says so at
/// each boot): restarts are counted, not timed.
fn containerd_boots(dir: &Path) -> Result<usize> {
    let log = dir
        .parent()
        .context("node directory without a parent")?
        .join("logs/containerd.log");
    let text =
        std::fs::read_to_string(&log).with_context(|| format!("reading {}", log.display()))?;
    Ok(text.matches("containerd successfully booted").count())
}

/// `containerd config dump` of the node's containerd (what it reads:
/// the main config merged with its imports).
fn containerd_config_dump(dir: &Path) -> Result<String> {
    let ns = dir.join("ns/mnt");
    let pid_file = dir
        .parent()
        .context("node directory without a parent")?
        .join("pids/containerd.main.pid");
    let pid = std::fs::read_to_string(&pid_file)?;
    let binary = std::fs::read_link(format!("/proc/{}/exe", pid.trim()))
        .context("locating the node's containerd binary")?;
    let out = Command::new("nsenter")
        .arg(format!("--mount={}", ns.display()))
        .arg("--")
        .arg(binary)
        .args(["--config", CONTAINERD_CONFIG, "config", "dump"])
        .output()
        .context("running containerd config dump in the node")?;
    ensure!(
        out.status.success(),
        "containerd config dump failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The `took_ms` of the toolkit agent's last "container runtime configured"
/// line (colour codes stripped).
fn toolkit_took_ms(log: &str) -> Option<u64> {
    let line = log
        .lines()
        .rfind(|l| l.contains("container runtime configured"))?;
    let plain = gpu_stack_e2e::strip_ansi(line);
    let rest = &plain[plain.find("took_ms=")? + "took_ms=".len()..];
    rest.chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .ok()
}

/// The toolkit agent's pod log (the current container's), from the node.
fn toolkit_log(dir: &Path) -> String {
    pod_log_tails(dir, 400)
        .lines()
        .filter(|l| l.contains("container runtime") || l.contains("toolkit"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Changes the device plugin's DEVICE_LIST_STRATEGY in the ClusterPolicy,
/// keeping its other env, and waits until the rolled pod is Ready. The
/// change goes through the release: helm applies server-side, so an edit of
/// the policy's `devicePlugin.env` by another field manager would make every
/// later `helm upgrade` fail with a conflict on that field.
async fn set_device_list_strategy(
    cluster: &TestCluster,
    client: &Client,
    strategy: &str,
) -> Result<()> {
    let policy = cluster_policies(client).get(POLICY).await?;
    let mut env: Vec<serde_json::Value> = policy.data["spec"]["devicePlugin"]["env"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    env.retain(|e| e["name"] != "DEVICE_LIST_STRATEGY");
    env.push(serde_json::json!({"name": "DEVICE_LIST_STRATEGY", "value": strategy}));
    let env = format!("devicePlugin.env={}", serde_json::Value::from(env));
    helm_upgrade(cluster, &["--set-json", &env])?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let wanted = strategy.to_string();
    wait_for(
        "the device plugin to roll to the new strategy",
        ROLLOUT,
        || {
            let pods = pods.clone();
            let wanted = wanted.clone();
            async move {
                let list = pods
                    .list(&ListParams::default().labels("app=nvidia-device-plugin-daemonset"))
                    .await?;
                let rolled = list.items.len() == 1
                    && list.items.iter().all(|p| {
                        pod_ready(p)
                            && p.metadata.deletion_timestamp.is_none()
                            && p.spec.as_ref().is_some_and(|s| {
                                s.containers[0].env.iter().flatten().any(|e| {
                                    e.name == "DEVICE_LIST_STRATEGY"
                                        && e.value.as_deref() == Some(wanted.as_str())
                                })
                            })
                    });
                Ok(rolled.then_some(()))
            }
        },
    )
    .await?;
    Ok(())
}

fn inject_xid(dir: &Path, gpu: u32) -> Result<()> {
    let out = Command::new(workspace_binary("gpu-stack")?)
        .args(["gpus", "--backend", "simulated"])
        .arg("--fleet")
        .arg(on_node(dir, SIM_FLEET))
        .arg("--node")
        .arg(NODE_NAME)
        .arg("--sim-state")
        .arg(on_node(dir, SIM_STATE))
        .arg("--inject-xid")
        .arg(format!("{gpu}:48"))
        .output()?;
    ensure!(
        out.status.success(),
        "injecting an Xid failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stack_on_a_real_node() -> Result<()> {
    let dir = node_dir()?;
    let cluster = TestCluster::attach().await?;
    let client = cluster.client();
    let mut outcome = scenarios(&cluster, &client, &dir).await;
    if outcome.is_ok() {
        outcome = bad_input(&cluster, &client).await;
    }
    if let Err(e) = outcome {
        let pods = describe_pods(&client).await;
        let logs = pod_log_tails(&dir, 15);
        // Leave nothing behind for the next run.
        let _ = uninstall(&cluster);
        bail!("{e:#}\n--- pods ---\n{pods}--- container logs ---\n{logs}");
    }
    Ok(())
}

async fn scenarios(cluster: &TestCluster, client: &Client, dir: &Path) -> Result<()> {
    // GPUs as the node came: an earlier run leaves its MIG layout (as on a
    // real node, uninstall keeps it), which the MIG manager would apply again.
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .patch(
            NODE_NAME,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"labels": {
                "nvidia.com/mig.config": null, "nvidia.com/mig.config.state": null,
            }}})),
        )
        .await?;
    match std::fs::remove_file(on_node(dir, SIM_STATE)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
        _ => {}
    }

    // The user's containerd config, which uninstall must give back byte for byte.
    let original_config = std::fs::read_to_string(on_node(dir, CONTAINERD_CONFIG))?;
    ensure!(
        !original_config.contains("enable_cdi") && !original_config.contains("imports"),
        "the node's containerd config must start without CDI: {original_config}"
    );
    // What containerd reads before the toolkit: containerd 2.x has CDI on by
    // default (with /var/run/cdi), 1.7 off; uninstall must give this back.
    let original_dump = containerd_config_dump(dir)?;
    ensure!(
        !original_dump.contains("runtimes.nvidia]"),
        "the node's containerd must start without the nvidia handler:\n{original_dump}"
    );
    let boots_before = containerd_boots(dir)?;

    // 0. NVIDIA's chart, installed with Helm 3, left its ClusterPolicy CRD
    // behind: a schema without gpu-stack's fields (here
    // `status.unsupportedFields`), which Helm 3 skips and Helm 4's
    // server-side apply of `crds/` stops at (a conflict with the fields Helm
    // 3 wrote): the install skips `crds/`, and the chart's upgradeCRD hook
    // applies gpu-stack's.
    leave_foreign_cluster_policy_crd(client).await?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());

    // 1. helm install: the operator runs as the chart's Deployment.
    let values = repo_root().join("tests/real-node/values.yaml");
    let chart = repo_root().join("deploy/helm/gpu-stack");
    let installed = Instant::now();
    run_helm(
        cluster,
        &[
            "install",
            RELEASE,
            &chart.display().to_string(),
            "--namespace",
            NAMESPACE,
            "--create-namespace",
            "--skip-crds",
            "--values",
            &values.display().to_string(),
            "--wait=watcher",
            "--timeout",
            "5m",
        ],
    )?;
    // The chart's pre-install hook served gpu-stack's schema again, applied
    // as Helm's field manager.
    let crd = crds.get(CLUSTER_POLICY_CRD).await?;
    ensure!(
        has_unsupported_fields(&crd)?
            && crd.managed_fields().iter().any(|m| {
                m.manager.as_deref() == Some("helm") && m.operation.as_deref() == Some("Apply")
            }),
        "the upgradeCRD hook did not apply gpu-stack's ClusterPolicy CRD over the one left behind"
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let operator = pods
        .list(&ListParams::default().labels("app.kubernetes.io/component=operator"))
        .await?;
    ensure!(
        operator.items.len() == 1 && pod_ready(&operator.items[0]),
        "the operator Deployment's pod is not ready: {}",
        describe_pods(client).await
    );

    // 2. Found as a GPU node without NFD, labelled by the operator.
    wait_for(
        "node discovery and the operator to label the node",
        ROLLOUT,
        || {
            let nodes = nodes.clone();
            async move {
                let node = nodes.get(NODE_NAME).await?;
                Ok(
                    (node_label(&node, "feature.node.kubernetes.io/pci-10de.present").as_deref()
                        == Some("true")
                        && node_label(&node, "nvidia.com/gpu.present").as_deref() == Some("true"))
                    .then_some(()),
                )
            }
        },
    )
    .await?;

    // 3. The policy is ready with every operand Running and Ready.
    wait_policy_ready(client, "the ClusterPolicy to be ready").await?;
    eprintln!(
        "figure: helm install -> ClusterPolicy ready in {:.1}s",
        installed.elapsed().as_secs_f64()
    );
    // The plugin check passed on a pod of its own, without a RuntimeClass,
    // that saw exactly the GPU it was allocated (not on allocatable alone).
    let plugin_ready =
        std::fs::read_to_string(on_node(dir, "/run/nvidia/validations/plugin-ready"))?;
    ensure!(
        plugin_ready.contains("WORKLOAD_RESOURCE=nvidia.com/gpu\n")
            && plugin_ready.contains("WORKLOAD_DEVICE=/dev/nvidia"),
        "the plugin check ran no workload pod that saw its GPU:\n{plugin_ready}"
    );
    // Every pod of the stack Running and Ready (probes run every few seconds,
    // so a pod may still turn Ready just after the policy did).
    wait_for(
        "every pod of the stack to be Running and Ready",
        STEP,
        || {
            let pods = pods.clone();
            async move {
                let all = pods.list(&ListParams::default()).await?.items;
                Ok(all
                    .iter()
                    .all(|p| phase(p) == "Running" && pod_ready(p))
                    .then_some(()))
            }
        },
    )
    .await?;
    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), NAMESPACE);
    let names: Vec<String> = daemonsets
        .list(&ListParams::default())
        .await?
        .into_iter()
        .map(|d| d.name_any())
        .collect();
    ensure!(
        !names.iter().any(|n| n.contains("driver")),
        "a pre-installed driver gets no driver DaemonSet: {names:?}"
    );
    for expected in [
        "nvidia-container-toolkit-daemonset",
        "nvidia-device-plugin-daemonset",
        "gpu-feature-discovery",
        "nvidia-dcgm-exporter",
        "nvidia-mig-manager",
        "nvidia-operator-validator",
    ] {
        ensure!(
            names.iter().any(|n| n == expected),
            "no {expected} DaemonSet: {names:?}"
        );
    }
    let gpus = wait_allocatable(client, "nvidia.com/gpu", "2 GPUs allocatable", |n| n == 2).await?;
    ensure!(gpus == 2);
    let node = the_node(client).await?;
    ensure!(
        node_label(&node, "nvidia.com/gpu.product").is_some_and(|p| p.contains("H100")),
        "GFD did not label the product: {:?}",
        node.labels()
    );

    // 3b. gpu-stack's toolkit agent configured the node's real containerd:
    // CDI on with the spec directory, the `nvidia` handler as plain runc, one
    // restart; no nvidia-container-runtime anywhere.
    let dump = containerd_config_dump(dir)?;
    // containerd 2.4 has no `enable_cdi` any more: CDI is always on there.
    ensure!(
        (dump.contains("enable_cdi = true") || !dump.contains("enable_cdi"))
            && dump.contains("/var/run/cdi"),
        "containerd does not read CDI specs after the toolkit agent ran:\n{dump}"
    );
    ensure!(
        dump.contains("runtimes.nvidia]") && !dump.contains("nvidia-container-runtime"),
        "the nvidia handler is missing or is a runtime shim:\n{dump}"
    );
    let edited = std::fs::read_to_string(on_node(dir, CONTAINERD_CONFIG))?;
    ensure!(
        edited.contains(CONTAINERD_DROP_IN) && on_node(dir, CONTAINERD_DROP_IN).is_file(),
        "the main config does not import the agent's drop-in:\n{edited}"
    );
    let boots_configured = containerd_boots(dir)?;
    ensure!(
        boots_configured == boots_before + 1,
        "configuring restarted containerd {} times (expected once)\n{}",
        boots_configured - boots_before,
        toolkit_log(dir)
    );
    eprintln!(
        "figure: containerd restarts to configure CDI: {}",
        boots_configured - boots_before
    );
    if let Some(ms) = toolkit_took_ms(&toolkit_log(dir)) {
        eprintln!(
            "figure: toolkit agent start -> containerd {} configured for CDI: {ms} ms",
            std::env::var("GPU_STACK_E2E_CONTAINERD").unwrap_or_default()
        );
    }
    // A second run (the agent's pod replaced) changes nothing, restarts nothing.
    let toolkit_pods = ListParams::default().labels("app=nvidia-container-toolkit-daemonset");
    let first = pods.list(&toolkit_pods).await?;
    let first_uid = first.items.first().and_then(|p| p.metadata.uid.clone());
    for p in &first.items {
        pods.delete(&p.name_any(), &Default::default()).await?;
    }
    wait_for("the toolkit agent's new pod to run", STEP, || {
        let (pods, toolkit_pods, first_uid) =
            (pods.clone(), toolkit_pods.clone(), first_uid.clone());
        async move {
            let now = pods.list(&toolkit_pods).await?.items;
            Ok(now
                .iter()
                .any(|p| p.metadata.uid != first_uid && phase(p) == "Running")
                .then_some(()))
        }
    })
    .await?;
    wait_for("the new agent to check the runtime", STEP, || async {
        Ok(toolkit_log(dir)
            .contains("already configured")
            .then_some(()))
    })
    .await?;
    ensure!(
        containerd_boots(dir)? == boots_configured,
        "a second run of the toolkit agent restarted containerd\n{}",
        toolkit_log(dir)
    );
    ensure!(
        std::fs::read_to_string(on_node(dir, CONTAINERD_CONFIG))? == edited,
        "a second run of the toolkit agent changed the config"
    );

    // 4. A workload without a RuntimeClass gets exactly one GPU: with the
    // chart's defaults (`cdi.enabled`) the plugin names its devices through
    // CDI (`cdi-annotations,cdi-cri`, NVIDIA's rule) and containerd injects
    // the device node of the allocated GPU.
    let plugin = pods
        .list(&ListParams::default().labels("app=nvidia-device-plugin-daemonset"))
        .await?
        .items
        .into_iter()
        .next()
        .context("no device plugin pod")?;
    let strategy = plugin
        .spec
        .iter()
        .flat_map(|s| s.containers[0].env.iter().flatten())
        .find(|e| e.name == "DEVICE_LIST_STRATEGY")
        .and_then(|e| e.value.clone());
    ensure!(
        strategy.as_deref() == Some("cdi-annotations,cdi-cri"),
        "the default device list strategy with CDI on is {strategy:?}"
    );
    let one = busybox_pod(
        "gpu-workload",
        &[("nvidia.com/gpu", "1")],
        "ls /dev | grep nvidia | sed 's/^/DEV=/'; echo DONE; sleep 3600",
    )?;
    let created = Instant::now();
    let log = run_workload(client, one, "DONE").await?;
    eprintln!(
        "figure: default values: a GPU pod without RuntimeClass created -> running with its device in {:.1}s",
        created.elapsed().as_secs_f64()
    );
    let devs: Vec<&str> = log.lines().filter_map(|l| l.strip_prefix("DEV=")).collect();
    let gpu_nodes: Vec<&&str> = devs
        .iter()
        .filter(|d| {
            d.strip_prefix("nvidia")
                .is_some_and(|n| n.parse::<u32>().is_ok())
        })
        .collect();
    ensure!(
        gpu_nodes.len() == 1 && devs.contains(&"nvidiactl"),
        "the container does not see exactly one GPU device node and nvidiactl (CDI through \
         containerd): {devs:?}"
    );

    // More GPUs than the node has: Pending, with the scheduler's reason.
    let greedy = busybox_pod("gpu-greedy", &[("nvidia.com/gpu", "3")], "sleep 3600")?;
    let default_pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    default_pods.create(&PostParams::default(), &greedy).await?;
    let reason = wait_for("the greedy pod to be unschedulable", STEP, || {
        let default_pods = default_pods.clone();
        async move {
            let pod = default_pods.get("gpu-greedy").await?;
            Ok(pod
                .status
                .and_then(|s| s.conditions)
                .into_iter()
                .flatten()
                .find(|c| c.type_ == "PodScheduled" && c.status == "False")
                .and_then(|c| c.message))
        }
    })
    .await?;
    ensure!(
        reason.contains("Insufficient nvidia.com/gpu"),
        "unexpected scheduling message: {reason}"
    );
    delete_pod(client, "gpu-greedy").await;

    // 5. The exporter attributes the GPU to the pod (kubelet pod-resources).
    let exporter = pods
        .list(&ListParams::default().labels("app=nvidia-dcgm-exporter"))
        .await?
        .items
        .into_iter()
        .next()
        .context("no exporter pod")?;
    let exporter_name = exporter.name_any();
    wait_for(
        "the exporter to attribute a GPU to gpu-workload",
        STEP,
        || {
            let client = client.clone();
            let exporter_name = exporter_name.clone();
            async move {
                let req = http::Request::get(format!(
                    "/api/v1/namespaces/{NAMESPACE}/pods/{exporter_name}:9400/proxy/metrics"
                ))
                .body(Vec::new())
                .map_err(|e| gpu_stack_e2e::E2eError::Check(e.to_string()))?;
                let text = client.request_text(req).await.unwrap_or_default();
                Ok(text
                    .lines()
                    .any(|l| {
                        l.starts_with("DCGM_FI_DEV_GPU_UTIL") && l.contains("pod=\"gpu-workload\"")
                    })
                    .then_some(()))
            }
        },
    )
    .await?;
    // The same metrics through NVIDIA's Service (what scrape configs and
    // ServiceMonitors written for NVIDIA's stack select): its endpoints are
    // the exporter's pods.
    wait_for("the exporter's Service to serve its metrics", STEP, || {
        let client = client.clone();
        async move {
            let req = http::Request::get(format!(
                "/api/v1/namespaces/{NAMESPACE}/services/nvidia-dcgm-exporter:gpu-metrics/proxy/metrics"
            ))
            .body(Vec::new())
            .map_err(|e| gpu_stack_e2e::E2eError::Check(e.to_string()))?;
            let text = client.request_text(req).await.unwrap_or_default();
            Ok(text
                .lines()
                .any(|l| l.starts_with("DCGM_FI_DEV_GPU_UTIL"))
                .then_some(()))
        }
    })
    .await?;

    // 7a. An Xid: allocatable drops, then recovers after the quiet period.
    let gpu_index = log
        .lines()
        .filter_map(|l| l.strip_prefix("DEV=nvidia"))
        .find_map(|n| n.parse::<u32>().ok())
        .context("no GPU index")?;
    inject_xid(dir, gpu_index)?;
    wait_allocatable(
        client,
        "nvidia.com/gpu",
        "allocatable to drop after an Xid",
        |n| n == 1,
    )
    .await?;
    wait_allocatable(
        client,
        "nvidia.com/gpu",
        "allocatable to recover after the Xid",
        |n| n == 2,
    )
    .await?;

    // 7b. containerd restarts: running pods keep their GPUs.
    let before = default_pods.get("gpu-workload").await?;
    let container_id = |p: &Pod| {
        p.status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|c| c.first())
            .and_then(|c| c.container_id.clone())
    };
    restart_node_process(dir, "containerd")?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let after = default_pods.get("gpu-workload").await?;
    ensure!(
        phase(&after) == "Running" && container_id(&after) == container_id(&before),
        "the workload did not survive a containerd restart: {:?}",
        after.status
    );

    // 4b. The `envvar` strategy (NVIDIA's default): the policy changes, the
    // device plugin rolls, and a pod gets NVIDIA_VISIBLE_DEVICES with
    // exactly one GPU.
    set_device_list_strategy(cluster, client, "envvar").await?;
    wait_allocatable(
        client,
        "nvidia.com/gpu",
        "the rolled device plugin to register",
        |n| n == 2,
    )
    .await?;

    // 7c. The kubelet restarts: the plugin registers again, new pods get GPUs.
    restart_node_process(dir, "kubelet")?;
    let restarted = Instant::now();
    one_visible_device(client, "gpu-after-restart", "nvidia.com/gpu", "GPU-").await?;
    eprintln!(
        "figure: kubelet restart -> a GPU pod admitted and running in {:.1}s",
        restarted.elapsed().as_secs_f64()
    );
    delete_pod(client, "gpu-after-restart").await;
    delete_pod(client, "gpu-workload").await;

    // 6. MIG: the manager pauses the clients, applies, restores; the plugin
    // advertises the profile; a pod gets one MIG device.
    let clients = |list: Vec<Pod>| -> BTreeMap<String, String> {
        list.into_iter()
            .filter_map(|p| {
                let app = p.labels().get("app")?.clone();
                let uid = p.metadata.uid.clone()?;
                [
                    "nvidia-device-plugin-daemonset",
                    "gpu-feature-discovery",
                    "nvidia-dcgm-exporter",
                ]
                .contains(&app.as_str())
                .then_some((app, uid))
            })
            .collect()
    };
    let before_mig = clients(pods.list(&ListParams::default()).await?.items);
    ensure!(
        before_mig.len() == 3,
        "MIG clients before the change: {before_mig:?}"
    );
    nodes
        .patch(
            NODE_NAME,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
                "metadata": {"labels": {"nvidia.com/mig.config": "all-1g.10gb"}}
            })),
        )
        .await?;
    // Applied: the state says success again *and* the plugin advertises the
    // new profile (the state alone still says success from the old config).
    wait_for("the MIG config to be applied", ROLLOUT, || {
        let nodes = nodes.clone();
        async move {
            let node = nodes.get(NODE_NAME).await?;
            match node_label(&node, "nvidia.com/mig.config.state").as_deref() {
                Some("failed") => Err(gpu_stack_e2e::E2eError::Check(format!(
                    "mig.config.state=failed: {:?}",
                    node.annotations()
                ))),
                Some("success") if allocatable(&node, "nvidia.com/mig-1g.10gb") > 0 => Ok(Some(())),
                _ => Ok(None),
            }
        }
    })
    .await?;
    // The clients' pods really left while the GPUs changed: each is a new pod.
    let after_mig = wait_for("the MIG clients to run again", ROLLOUT, || {
        let pods = pods.clone();
        let clients = &clients;
        async move {
            let list = pods.list(&ListParams::default()).await?.items;
            let ready = list.iter().filter(|p| pod_ready(p)).cloned().collect();
            let now = clients(ready);
            Ok((now.len() == 3).then_some(now))
        }
    })
    .await?;
    for (app, uid) in &before_mig {
        ensure!(
            after_mig.get(app) != Some(uid),
            "{app} was not paused for the MIG change (same pod {uid})"
        );
    }
    let node = the_node(client).await?;
    ensure!(
        !node
            .labels()
            .values()
            .any(|v| v.contains("paused-for-mig-change")),
        "deploy labels were not restored after the MIG change: {:?}",
        node.labels()
    );
    let migs = wait_allocatable(
        client,
        "nvidia.com/mig-1g.10gb",
        "MIG devices allocatable",
        |n| n == 14,
    )
    .await?;
    ensure!(migs == 14, "2 H100 x 7 1g.10gb instances");
    one_visible_device(client, "mig-workload", "nvidia.com/mig-1g.10gb", "MIG-").await?;
    delete_pod(client, "mig-workload").await;

    // 8. Driver upgrade: the driver DaemonSet's version bumped, the node
    // cordoned, the GPU workload evicted and rescheduled on the new driver.
    driver_upgrade(cluster, client, dir).await?;

    // 9. Dynamic Resource Allocation: the DRA plugin instead of the device
    // plugin and the MIG manager; a claim's MIG instance is created at the
    // placement the scheduler chose and destroyed with its pod.
    dra_on_the_node(cluster, client, dir).await?;

    // 9b. The combined node agent: `nodeAgent.enabled` runs the device
    // plugin, GFD, the exporter, the MIG manager and the validator in one
    // pod, Ready once the hosted validator's checks have passed on this node.
    node_agent_on_the_node(cluster, client).await?;

    // 10. helm uninstall (from the combined mode): everything the stack made
    // is gone, and the labels the operator, GFD and node discovery wrote
    // (the MIG layout's stay).
    let boots_before_uninstall = containerd_boots(dir)?;
    // The toolkit's pod log goes with the pod: kept to say why, should the
    // runtime not be restored.
    let toolkit_log = follow_log(
        client,
        "app=nvidia-container-toolkit-daemonset",
        "nvidia-container-toolkit",
    )
    .await?;
    // The operator's and the hook's logs say why, should the node keep
    // labels or operands.
    let operator_log = follow_log(
        client,
        "app.kubernetes.io/component=operator",
        "gpu-operator",
    )
    .await?;
    let hook_log =
        follow_log_of_coming_pod(client, "app.kubernetes.io/component=uninstall", "uninstall");
    uninstall(cluster)?;
    let gone = wait_for(
        "the operands and the node labels to go",
        ROLLOUT,
        || async {
            let left = leftovers(client)
                .await
                .map_err(|e| gpu_stack_e2e::E2eError::Check(format!("{e:#}")))?;
            Ok(left.is_empty().then_some(()))
        },
    )
    .await;
    if let Err(err) = gone {
        let left = leftovers(client).await.unwrap_or_default();
        bail!(
            "{err}; still there: {left:?}\n--- the operator's log ---\n{}\n--- the uninstall hook's log ---\n{}",
            operator_log.tail(150),
            hook_log.tail(150)
        );
    }
    // The toolkit left with the policy: containerd restarted once onto the
    // user's config, back byte for byte, and the drop-in is gone.
    let restarted = wait_for(
        "containerd to restart onto the restored config",
        STEP,
        || async {
            Ok((containerd_boots(dir).unwrap_or(0) > boots_before_uninstall).then_some(()))
        },
    )
    .await;
    if let Err(err) = restarted {
        bail!("{err}; the toolkit's log:\n{}", toolkit_log.text());
    }
    let restored = std::fs::read_to_string(on_node(dir, CONTAINERD_CONFIG))?;
    ensure!(
        restored == original_config,
        "uninstall did not restore the containerd config:\n--- before install ---\n{original_config}\n--- now ---\n{restored}"
    );
    ensure!(
        !on_node(dir, CONTAINERD_DROP_IN).exists(),
        "uninstall left the toolkit's drop-in"
    );
    let dump = containerd_config_dump(dir)?;
    ensure!(
        dump == original_dump,
        "containerd does not read what it read before install:\n--- before install ---\n{original_dump}\n--- now ---\n{dump}"
    );
    ensure!(
        containerd_boots(dir)? == boots_before_uninstall + 1,
        "removing the toolkit restarted containerd more than once"
    );
    Ok(())
}

/// A pod's log, read as it is written until the pod is gone.
struct FollowedLog(std::sync::Arc<std::sync::Mutex<String>>);

impl FollowedLog {
    fn text(&self) -> String {
        self.0.lock().map(|t| t.clone()).unwrap_or_default()
    }

    /// The last `n` lines (an operator's log is long).
    fn tail(&self, n: usize) -> String {
        let text = self.text();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

/// Follows the log of `container` in the one pod `selector` matches in the
/// stack's namespace.
async fn follow_log(client: &Client, selector: &str, container: &str) -> Result<FollowedLog> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let list = pods.list(&ListParams::default().labels(selector)).await?;
    let name = list
        .items
        .first()
        .map(|p| p.name_any())
        .with_context(|| format!("no pod matches {selector}"))?;
    let text = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    tokio::spawn(copy_log(pods, name, container.to_string(), text.clone()));
    Ok(FollowedLog(text))
}

/// The log of the first pod matching `selector` that appears within `STEP`
/// (a hook's pod, created by the command the test runs next).
fn follow_log_of_coming_pod(client: &Client, selector: &str, container: &str) -> FollowedLog {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let (selector, container) = (selector.to_string(), container.to_string());
    let text = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let sink = text.clone();
    tokio::spawn(async move {
        let deadline = tokio::time::Instant::now() + STEP;
        while tokio::time::Instant::now() < deadline {
            let listed = pods.list(&ListParams::default().labels(&selector)).await;
            let running = listed.ok().and_then(|l| {
                l.items.into_iter().find(|p| {
                    p.status
                        .as_ref()
                        .and_then(|s| s.start_time.as_ref())
                        .is_some()
                })
            });
            if let Some(pod) = running {
                copy_log(pods, pod.name_any(), container, sink).await;
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    FollowedLog(text)
}

/// Appends a pod's log to `sink`, following it until the pod is gone.
async fn copy_log(
    pods: Api<Pod>,
    name: String,
    container: String,
    sink: std::sync::Arc<std::sync::Mutex<String>>,
) {
    use futures::{AsyncBufReadExt, StreamExt};
    let params = LogParams {
        follow: true,
        container: Some(container),
        ..LogParams::default()
    };
    let Ok(stream) = pods.log_stream(&name, &params).await else {
        return;
    };
    let mut lines = std::pin::pin!(stream.lines());
    while let Some(Ok(line)) = lines.next().await {
        if let Ok(mut t) = sink.lock() {
            t.push_str(&line);
            t.push('\n');
        }
    }
}

/// `nodeAgent.enabled` by `helm upgrade`: the hosted components' own
/// DaemonSets go and `gpu-stack-node-agent` runs them in one pod, which turns
/// Ready on its probe (`gpu-node-agent --check-ready`) only once the hosted
/// validator's checks have passed against the node's real containerd and
/// kubelet; the hosted device plugin registers with the kubelet again, and
/// a workload gets exactly one GPU (by the policy's `envvar` strategy).
async fn node_agent_on_the_node(cluster: &TestCluster, client: &Client) -> Result<()> {
    // The stack is back from the DRA step first: the policy ready and the
    // device plugin advertising whole GPUs.
    wait_policy_ready(client, "the ClusterPolicy to be ready again").await?;
    wait_allocatable(
        client,
        "nvidia.com/gpu",
        "whole GPUs advertised before the switch",
        |n| n >= 1,
    )
    .await?;
    let started = Instant::now();
    helm_upgrade(cluster, &["--set", "nodeAgent.enabled=true"])?;
    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), NAMESPACE);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let hosted = [
        "nvidia-device-plugin-daemonset",
        "gpu-feature-discovery",
        "nvidia-dcgm-exporter",
        "nvidia-mig-manager",
        "nvidia-operator-validator",
    ];
    let switched = wait_for(
        "the hosted DaemonSets to go and the node agent's pod to be Ready",
        ROLLOUT,
        || async {
            let names: Vec<String> = daemonsets
                .list(&ListParams::default())
                .await?
                .into_iter()
                .map(|d| d.name_any())
                .collect();
            let agent = pods
                .list(&ListParams::default().labels("app=gpu-stack-node-agent"))
                .await?
                .items;
            let ready = agent.len() == 1 && phase(&agent[0]) == "Running" && pod_ready(&agent[0]);
            Ok((ready && hosted.iter().all(|h| !names.iter().any(|n| n == h))).then_some(()))
        },
    )
    .await;
    if let Err(err) = switched {
        bail!("{err}\n{}", describe_pods(client).await);
    }
    wait_policy_ready(client, "the ClusterPolicy to be ready").await?;
    eprintln!(
        "figure: real node nodeAgent.enabled: helm upgrade -> ClusterPolicy ready in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    wait_allocatable(
        client,
        "nvidia.com/gpu",
        "whole GPUs advertised by the hosted device plugin",
        |n| n >= 1,
    )
    .await?;
    // The policy's device-plugin env (`envvar` since step 4b) reached the
    // hosted device plugin.
    one_visible_device(client, "agent-workload", "nvidia.com/gpu", "GPU-").await?;
    delete_pod(client, "agent-workload").await;
    Ok(())
}

/// Driver versions of the stand-in driver image (must match
/// DRIVER_STANDIN_VERSIONS in xtask/src/images.rs and driver-values.yaml).
const DRIVER_FROM: &str = "570.195.03";
const DRIVER_TO: &str = "580.95.05";
const UPGRADE_STATE: &str = "nvidia.com/gpu-driver-upgrade-state";
const WORKLOAD: &str = "gpu-workload";

/// The driver pods (of every OS pool).
fn driver_pod_label() -> ListParams {
    ListParams::default().labels("nvidia.com/gpu-stack.component=driver")
}

/// The node's driver pod when it is Running and Ready: its image and uid.
async fn ready_driver_pod(client: &Client) -> Result<Option<(String, String)>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let list = pods.list(&driver_pod_label()).await?.items;
    Ok(list
        .iter()
        .find(|p| phase(p) == "Running" && pod_ready(p) && p.metadata.deletion_timestamp.is_none())
        .map(|p| {
            let image = p
                .spec
                .as_ref()
                .and_then(|s| s.containers.first())
                .and_then(|c| c.image.clone())
                .unwrap_or_default();
            (image, p.uid().unwrap_or_default())
        }))
}

/// The workload Deployment's pods: `(uid, phase, node)`.
async fn workload_pods(client: &Client) -> Result<Vec<(String, String, String)>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let list = pods
        .list(&ListParams::default().labels(&format!("app={WORKLOAD}")))
        .await?;
    Ok(list
        .items
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .map(|p| {
            (
                p.uid().unwrap_or_default(),
                phase(p),
                p.spec
                    .as_ref()
                    .and_then(|s| s.node_name.clone())
                    .unwrap_or_default(),
            )
        })
        .collect())
}

/// Installs the driver DaemonSet with the stand-in driver at
/// [`DRIVER_FROM`], runs a GPU workload (a Deployment with a PDB), bumps the
/// version with `helm upgrade`, and follows NVIDIA's upgrade flow on the real
/// node: cordoned, the workload evicted, the driver pod replaced by one at
/// [`DRIVER_TO`], validated, uncordoned, the workload back on its GPU.
async fn driver_upgrade(cluster: &TestCluster, client: &Client, dir: &Path) -> Result<()> {
    let values = repo_root().join("tests/real-node/driver-values.yaml");
    let values = values.display().to_string();
    helm_upgrade(cluster, &["--values", &values])?;
    let nodes: Api<Node> = Api::all(client.clone());
    let os = {
        let node = the_node(client).await?;
        format!(
            "{}{}",
            node_label(&node, "feature.node.kubernetes.io/system-os_release.ID")
                .unwrap_or_default(),
            node_label(
                &node,
                "feature.node.kubernetes.io/system-os_release.VERSION_ID"
            )
            .unwrap_or_default()
        )
    };
    let image = |v: &str| format!("localhost/gpu-stack/driver:{v}-{os}");
    let (first_image, first_uid) = wait_for(
        "the driver pod to be Running and Ready",
        ROLLOUT,
        || async {
            ready_driver_pod(client)
                .await
                .map_err(|e| gpu_stack_e2e::E2eError::Check(format!("{e:#}")))
        },
    )
    .await?;
    ensure!(
        first_image == image(DRIVER_FROM),
        "the driver pod runs {first_image}, not {}",
        image(DRIVER_FROM)
    );
    wait_for(
        "the node on the first driver, with no upgrade state (it needed none)",
        STEP,
        || {
            let nodes = nodes.clone();
            async move {
                let node = nodes.get(NODE_NAME).await?;
                Ok(node_label(&node, UPGRADE_STATE).is_none().then_some(()))
            }
        },
    )
    .await?;
    wait_for(
        "the ClusterPolicy to be ready with the driver",
        ROLLOUT,
        || async { Ok((policy_state(client).await.as_deref() == Some("ready")).then_some(())) },
    )
    .await?;

    // A GPU workload that may be evicted (its PDB allows one pod down).
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(client.clone(), "default");
    let pod_template = busybox_pod(
        WORKLOAD,
        &[("nvidia.com/mig-1g.10gb", "1")],
        "echo VISIBLE=$NVIDIA_VISIBLE_DEVICES; sleep 3600",
    )?;
    let deployment: k8s_openapi::api::apps::v1::Deployment =
        serde_json::from_value(serde_json::json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": WORKLOAD, "namespace": "default"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app": WORKLOAD}},
                "template": {
                    "metadata": {"labels": {"app": WORKLOAD}},
                    "spec": {
                        "terminationGracePeriodSeconds": 1,
                        "containers": pod_template.spec.map(|s| s.containers).unwrap_or_default(),
                    },
                },
            },
        }))?;
    deployments
        .create(&PostParams::default(), &deployment)
        .await?;
    let pdbs: Api<k8s_openapi::api::policy::v1::PodDisruptionBudget> =
        Api::namespaced(client.clone(), "default");
    let pdb = serde_json::from_value(serde_json::json!({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": WORKLOAD, "namespace": "default"},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": WORKLOAD}}},
    }))?;
    pdbs.create(&PostParams::default(), &pdb).await?;
    let running_on_node = |pods: &[(String, String, String)]| {
        pods.iter()
            .find(|(_, phase, node)| phase == "Running" && node == NODE_NAME)
            .map(|(uid, _, _)| uid.clone())
    };
    let workload_uid = wait_for("the GPU workload to run", STEP, || async {
        let pods = workload_pods(client)
            .await
            .map_err(|e| gpu_stack_e2e::E2eError::Check(format!("{e:#}")))?;
        Ok(running_on_node(&pods))
    })
    .await?;

    // The bump: the driver DaemonSet (OnDelete) gets a new template, and
    // the upgrade controller takes the node through NVIDIA's states.
    let bumped = Instant::now();
    helm_upgrade_no_wait(cluster, &["--set", &format!("driver.version={DRIVER_TO}")])?;
    let mut states: Vec<String> = Vec::new();
    let mut timeline: Vec<String> = Vec::new();
    let mut cordoned = false;
    let mut evicted_at = None;
    let mut back_at = None;
    let deadline = Instant::now() + ROLLOUT;
    let (new_image, new_uid) = loop {
        ensure!(
            Instant::now() < deadline,
            "the driver upgrade did not finish within {ROLLOUT:?}; states seen: {states:?}; workload: {:?}",
            workload_pods(client).await.ok()
        );
        let node = nodes.get(NODE_NAME).await?;
        let state = node_label(&node, UPGRADE_STATE).unwrap_or_default();
        if states.last() != Some(&state) {
            timeline.push(format!("{state} {:.1}s", bumped.elapsed().as_secs_f64()));
            states.push(state.clone());
        }
        cordoned |= node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true);
        let pods = workload_pods(client).await?;
        if evicted_at.is_none() && !pods.iter().any(|(uid, _, _)| *uid == workload_uid) {
            evicted_at = Some(Instant::now());
        }
        if evicted_at.is_some() && back_at.is_none() && running_on_node(&pods).is_some() {
            back_at = Some(Instant::now());
        }
        if state == "upgrade-done"
            && states.len() > 1
            && back_at.is_some()
            && let Some(driver) = ready_driver_pod(client).await?
        {
            break driver;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let took = bumped.elapsed();
    ensure!(
        new_image == image(DRIVER_TO) && new_uid != first_uid,
        "the node's driver pod was not replaced by one at {}: {new_image}",
        image(DRIVER_TO)
    );
    for want in [
        "upgrade-required",
        "cordon-required",
        "pod-deletion-required",
        "pod-restart-required",
        "validation-required",
        "uncordon-required",
        "upgrade-done",
    ] {
        ensure!(
            states.iter().any(|s| s == want),
            "the node never showed {UPGRADE_STATE}={want}: {states:?}"
        );
    }
    ensure!(
        cordoned,
        "the node was never cordoned during its upgrade: {states:?}"
    );
    let node = the_node(client).await?;
    ensure!(
        node.spec.as_ref().and_then(|s| s.unschedulable) != Some(true),
        "the node is still cordoned after upgrade-done"
    );
    let pods = workload_pods(client).await?;
    let new_workload = running_on_node(&pods).context("the workload is not running again")?;
    ensure!(
        new_workload != workload_uid,
        "the GPU workload was never evicted: {pods:?}"
    );
    // The new driver container is the one that started, by its own log.
    let logs = pod_log_tails(dir, 40);
    ensure!(
        logs.contains(&format!("driver container stand-in {DRIVER_TO}")),
        "no log of the new driver container:\n{logs}"
    );
    let policy = cluster_policies(client).get(POLICY).await?;
    let progress = policy.data["status"]["driverUpgrade"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    ensure!(
        progress.starts_with("1 of 1"),
        "the ClusterPolicy does not report the finished rollout: {progress:?}"
    );
    if let (Some(evicted), Some(back)) = (evicted_at, back_at) {
        eprintln!(
            "figure: real node driver upgrade {DRIVER_FROM} -> {DRIVER_TO}: helm upgrade -> upgrade-done in {:.1}s, workload evicted -> running again in {:.1}s",
            took.as_secs_f64(),
            back.duration_since(evicted).as_secs_f64()
        );
        eprintln!(
            "figure: real node driver upgrade states: {}",
            timeline.join(", ")
        );
    }
    let _ = pdbs.delete(WORKLOAD, &DeleteParams::default()).await;
    let _ = deployments
        .delete(WORKLOAD, &DeleteParams::default().grace_period(0))
        .await;
    wait_for("the workload pods to go", STEP, || async {
        let pods = workload_pods(client)
            .await
            .map_err(|e| gpu_stack_e2e::E2eError::Check(format!("{e:#}")))?;
        Ok(pods.is_empty().then_some(()))
    })
    .await?;
    Ok(())
}

/// `kind/name` of every object `api` lists with `params`.
async fn names<K>(kind: &str, api: &Api<K>, params: &ListParams) -> Result<Vec<String>>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    Ok(api
        .list_metadata(params)
        .await?
        .items
        .iter()
        .map(|o| format!("{kind}/{}", o.name_any()))
        .collect())
}

/// Names of what the chart's release left in the cluster (by its instance
/// label), ClusterPolicies, and the node's GPU labels.
async fn leftovers(client: &Client) -> Result<Vec<String>> {
    let instance = ListParams::default().labels(&format!("app.kubernetes.io/instance={RELEASE}"));
    let made_by_operator = ListParams::default().labels("app.kubernetes.io/managed-by=gpu-stack");
    let all = ListParams::default();
    let cluster_roles = Api::<k8s_openapi::api::rbac::v1::ClusterRole>::all(client.clone());
    let mut left = Vec::new();
    left.extend(
        names(
            "Deployment",
            &Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(client.clone(), NAMESPACE),
            &instance,
        )
        .await?,
    );
    left.extend(
        names(
            "DaemonSet",
            &Api::<DaemonSet>::namespaced(client.clone(), NAMESPACE),
            &all,
        )
        .await?,
    );
    left.extend(
        names(
            "Service",
            &Api::<k8s_openapi::api::core::v1::Service>::namespaced(client.clone(), NAMESPACE),
            &made_by_operator,
        )
        .await?,
    );
    left.extend(names("ClusterRole", &cluster_roles, &made_by_operator).await?);
    left.extend(names("ClusterRole", &cluster_roles, &instance).await?);
    if cluster_policies(client).get_opt(POLICY).await?.is_some() {
        left.push(format!("ClusterPolicy/{POLICY}"));
    }
    let node = the_node(client).await?;
    left.extend(
        node.labels()
            .keys()
            .filter(|k| {
                k.starts_with("nvidia.com/gpu.")
                    || k.starts_with("nvidia.com/cuda.")
                    || k.starts_with("feature.node.kubernetes.io/")
            })
            .map(|k| format!("label {k}")),
    );
    Ok(left)
}

/// Bad input: a value that cannot work fails a `--rollback-on-failure`
/// install (Helm 3's `--atomic`), which leaves nothing behind; an operand
/// image that cannot be pulled is named in an Event.
async fn bad_input(cluster: &TestCluster, client: &Client) -> Result<()> {
    let values = repo_root().join("tests/real-node/values.yaml");
    let chart = repo_root().join("deploy/helm/gpu-stack");
    let (chart, values) = (chart.display().to_string(), values.display().to_string());
    // The toolkit stays on: without its agent the node's containerd has no
    // `nvidia` handler, so no operand pod would get as far as pulling.
    let base = [
        "install",
        RELEASE,
        chart.as_str(),
        "--namespace",
        NAMESPACE,
        "--values",
        values.as_str(),
    ];

    // An operator whose leader election timing cannot work (a renew grace
    // longer than the lease) refuses to start and never gets ready: helm
    // gives up and rolls back, running the uninstall hook with no operator
    // to finish. (A port below 1024 is no such value: containerd 2.x lets
    // pods bind any port, `enable_unprivileged_ports`.)
    let mut atomic = base.to_vec();
    atomic.extend([
        "--rollback-on-failure",
        "--wait=watcher",
        "--timeout",
        "90s",
        "--set",
        "leaderElection.renewGraceSeconds=20",
    ]);
    let failed = run_helm(cluster, &atomic);
    ensure!(failed.is_err(), "an install that cannot work succeeded");
    let left = wait_for(
        "the rolled-back install to leave nothing",
        ROLLOUT,
        || async {
            let left = leftovers(client)
                .await
                .map_err(|e| gpu_stack_e2e::E2eError::Check(format!("{e:#}")))?;
            Ok(left.is_empty().then_some(left))
        },
    )
    .await;
    if left.is_err() {
        bail!(
            "a failed --rollback-on-failure install left {:?} ({})",
            leftovers(client).await?,
            failed.err().map(|e| format!("{e:#}")).unwrap_or_default()
        );
    }

    // An operand image that does not exist: the policy is not ready and an
    // Event names the image, the pod and the node.
    let missing = "localhost/gpu-stack/gpu-device-plugin:0.0.0-missing";
    let mut install = base.to_vec();
    install.extend(["--set", "devicePlugin.version=0.0.0-missing"]);
    run_helm(cluster, &install)?;
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), "default");
    let note = wait_for("an Event naming the missing image", ROLLOUT, || {
        let events = events.clone();
        async move {
            let list = events.list(&ListParams::default()).await?;
            Ok(list.items.into_iter().find_map(|e| {
                (e.reason.as_deref() == Some("OperandImagePullFailed"))
                    .then_some(e.note.unwrap_or_default())
                    .filter(|n| n.contains(missing))
            }))
        }
    })
    .await?;
    ensure!(
        note.contains(NODE_NAME),
        "the Event does not name the node: {note}"
    );
    ensure!(
        policy_state(client).await.as_deref() == Some("notReady"),
        "a policy whose device plugin cannot start is not notReady"
    );
    uninstall(cluster)?;
    let left = leftovers(client).await?;
    ensure!(left.is_empty(), "uninstall left {left:?}");
    Ok(())
}

const DRA_DRIVER: &str = "gpu.nvidia.com";
const DRA_CLAIM_TEMPLATE: &str = "one-1g";
const DRA_POD: &str = "dra-workload";

/// One simulated GPU instance: GPU index, profile, start, MIG device UUIDs.
type NodeInstance = (u64, String, u64, Vec<String>);

/// The node's simulated GPU instances.
fn node_instances(dir: &Path) -> Result<Vec<NodeInstance>> {
    let out = Command::new(workspace_binary("gpu-stack")?)
        .args(["gpus", "--backend", "simulated", "-o", "json", "--fleet"])
        .arg(on_node(dir, SIM_FLEET))
        .args(["--node", NODE_NAME, "--sim-state"])
        .arg(on_node(dir, SIM_STATE))
        .output()?;
    ensure!(
        out.status.success(),
        "gpu-stack gpus failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let body: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let mut found = Vec::new();
    for g in body["gpus"].as_array().into_iter().flatten() {
        for gi in g["mig"]["gpu_instances"].as_array().into_iter().flatten() {
            found.push((
                g["index"].as_u64().unwrap_or(u64::MAX),
                gi["profile_name"].as_str().unwrap_or_default().to_string(),
                gi["placement"]["start"].as_u64().unwrap_or(u64::MAX),
                gi["compute_instances"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|ci| ci["uuid"].as_str().map(String::from))
                    .collect(),
            ));
        }
    }
    Ok(found)
}

async fn dra_slices(client: &Client) -> Result<Vec<k8s_openapi::api::resource::v1::ResourceSlice>> {
    let api: Api<k8s_openapi::api::resource::v1::ResourceSlice> = Api::all(client.clone());
    Ok(api
        .list(&ListParams::default().fields(&format!(
            "spec.nodeName={NODE_NAME},spec.driver={DRA_DRIVER}"
        )))
        .await?
        .items)
}

async fn dra_on_the_node(cluster: &TestCluster, client: &Client, dir: &Path) -> Result<()> {
    // The GPUs are handed over empty, as a user would: the MIG manager turns
    // MIG off (all-1g.10gb from step 7 leaves no room), then the DRA plugin
    // owns the layout.
    // The MIG manager refuses to take instances that pods use: the driver
    // upgrade's workload leaves with its Deployment, in the background.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    wait_for("the driver upgrade's workload pods to go", STEP, || {
        let pods = pods.clone();
        async move {
            let left = pods
                .list(&ListParams::default().labels(&format!("app={WORKLOAD}")))
                .await?;
            Ok(left.items.is_empty().then_some(()))
        }
    })
    .await?;
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .patch(
            NODE_NAME,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
                "metadata": {"labels": {"nvidia.com/mig.config": "all-disabled"}}
            })),
        )
        .await?;
    wait_for("MIG to be off (all-disabled applied)", ROLLOUT, || {
        let nodes = nodes.clone();
        async move {
            let node = nodes.get(NODE_NAME).await?;
            match node_label(&node, "nvidia.com/mig.config.state").as_deref() {
                Some("failed") => Err(gpu_stack_e2e::E2eError::Check(format!(
                    "mig.config.state=failed: {:?}",
                    node.annotations()
                ))),
                Some("success") if allocatable(&node, "nvidia.com/mig-1g.10gb") == 0 => {
                    Ok(Some(()))
                }
                _ => Ok(None),
            }
        }
    })
    .await?;
    let left = node_instances(dir)?;
    ensure!(
        left.is_empty(),
        "MIG instances left after all-disabled: {left:?}"
    );

    let values = repo_root()
        .join("tests/real-node/dra-values.yaml")
        .display()
        .to_string();
    helm_upgrade(cluster, &["--values", &values])?;
    // The plugin runs as the operator's DaemonSet and publishes the node's
    // two GPUs as the API server stored them: from 1.35 one slice with both
    // counter sets and a device slice per GPU, never both in one slice.
    let slices = wait_for("the DRA plugin's ResourceSlices", ROLLOUT, || async {
        let s = dra_slices(client)
            .await
            .map_err(|e| gpu_stack_e2e::E2eError::Check(format!("{e:#}")))?;
        let complete = s
            .first()
            .is_some_and(|f| f.spec.pool.resource_slice_count == s.len() as i64);
        Ok(complete.then_some(s))
    })
    .await?;
    let sets: usize = slices
        .iter()
        .map(|s| s.spec.shared_counters.as_ref().map_or(0, Vec::len))
        .sum();
    let consuming = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .filter(|d| d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty()))
        .count();
    ensure!(
        slices.len() == 3 && sets == 2 && consuming == 52,
        "the node's slices are not one counter slice with 2 sets and 2 device slices of 26 \
         counter-consuming devices: {} slices, {sets} sets, {consuming} devices",
        slices.len()
    );
    for s in &slices {
        ensure!(
            s.spec.devices.is_none() || s.spec.shared_counters.is_none(),
            "slice {} holds devices and counters",
            s.name_any()
        );
    }
    let before = node_instances(dir)?;

    // A pod with a claim for one 1g.10gb, from a template as a user writes it.
    let templates: Api<k8s_openapi::api::resource::v1::ResourceClaimTemplate> =
        Api::namespaced(client.clone(), "default");
    let template = serde_json::from_value(serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": DRA_CLAIM_TEMPLATE, "namespace": "default"},
        "spec": {"spec": {"devices": {"requests": [{
            "name": "mig",
            "exactly": {
                "deviceClassName": "mig.nvidia.com",
                "selectors": [{"cel": {"expression":
                    "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"}}],
            },
        }]}}},
    }))?;
    // An earlier failed run may have left its pod and template.
    delete_pod(client, DRA_POD).await;
    let _ = templates
        .delete(DRA_CLAIM_TEMPLATE, &DeleteParams::default())
        .await;
    templates.create(&PostParams::default(), &template).await?;
    let mut pod = busybox_pod(
        DRA_POD,
        &[],
        "echo VISIBLE=$NVIDIA_VISIBLE_DEVICES; ls /dev | grep nvidia | sed 's/^/DEV=/'; echo DRA-DONE; sleep 3600",
    )?;
    if let Some(spec) = pod.spec.as_mut() {
        spec.resource_claims = Some(vec![k8s_openapi::api::core::v1::PodResourceClaim {
            name: "gpu".into(),
            resource_claim_template_name: Some(DRA_CLAIM_TEMPLATE.into()),
            ..Default::default()
        }]);
        spec.containers[0].resources = Some(k8s_openapi::api::core::v1::ResourceRequirements {
            claims: Some(vec![k8s_openapi::api::core::v1::ResourceClaim {
                name: "gpu".into(),
                ..Default::default()
            }]),
            ..Default::default()
        });
    }
    let started = Instant::now();
    let log = run_workload(client, pod, "DRA-DONE").await?;
    println!(
        "figure: DRA pod created -> running with its MIG instance: {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let visible = only_visible(&log, "MIG-")
        .with_context(|| format!("the DRA pod does not see exactly one MIG device: {log}"))?;

    // The scheduler's allocation names the placement; the instance is there.
    let claim_name = pods
        .get(DRA_POD)
        .await?
        .status
        .and_then(|s| s.resource_claim_statuses)
        .and_then(|c| c.into_iter().next())
        .and_then(|c| c.resource_claim_name)
        .context("the pod's claim has no name in its status")?;
    let claims: Api<k8s_openapi::api::resource::v1::ResourceClaim> =
        Api::namespaced(client.clone(), "default");
    let claim = claims.get(&claim_name).await?;
    let device = claim
        .status
        .and_then(|s| s.allocation)
        .and_then(|a| a.devices)
        .and_then(|d| d.results)
        .and_then(|r| r.into_iter().next())
        .context("the claim is not allocated")?;
    ensure!(
        device.driver == DRA_DRIVER && device.pool == NODE_NAME,
        "{device:?}"
    );
    // gpu-<minor>-mig-1g10gb-19-<start>
    let parts: Vec<&str> = device.device.split('-').collect();
    let (gpu, start) = match parts.as_slice() {
        ["gpu", gpu, "mig", "1g10gb", "19", start] => (gpu.parse::<u64>()?, start.parse::<u64>()?),
        _ => bail!(
            "allocated device {} is not a 1g.10gb placement",
            device.device
        ),
    };
    let after = node_instances(dir)?;
    let created: Vec<_> = after.iter().filter(|i| !before.contains(i)).collect();
    ensure!(
        created.len() == 1
            && created[0].0 == gpu
            && created[0].1 == "1g.10gb"
            && created[0].2 == start
            && created[0].3 == [visible.to_string()],
        "expected exactly one new 1g.10gb instance on GPU {gpu} at slice {start} with UUID {visible}, found {created:?}"
    );
    println!(
        "figure: DRA claim allocated {} and prepared as GPU {gpu} 1g.10gb@{start}",
        device.device
    );

    // The pod goes: the kubelet unprepares the claim and the instance goes too.
    delete_pod(client, DRA_POD).await;
    wait_for("the claim's MIG instance to be destroyed", STEP, || async {
        let now =
            node_instances(dir).map_err(|e| gpu_stack_e2e::E2eError::Check(format!("{e:#}")))?;
        Ok((now == before).then_some(()))
    })
    .await?;
    templates
        .delete(DRA_CLAIM_TEMPLATE, &DeleteParams::default())
        .await?;

    // Back to the device plugin and the MIG manager; the kubelet removes the
    // slices of the plugin that went away.
    helm_upgrade(
        cluster,
        &[
            "--set",
            "dra.enabled=false",
            "--set",
            "draDriver.enabled=false",
            "--set",
            "devicePlugin.enabled=true",
        ],
    )?;
    wait_for("the DRA plugin's slices to go", ROLLOUT, || async {
        let s = dra_slices(client)
            .await
            .map_err(|e| gpu_stack_e2e::E2eError::Check(format!("{e:#}")))?;
        Ok(s.is_empty().then_some(()))
    })
    .await?;
    Ok(())
}
