//! The driver upgrade flow at scale on the real test control plane: 200 kwok
//! GPU nodes running a GPU workload under a PodDisruptionBudget, a driver
//! version bump with `maxUnavailable: 20%`, and everything that goes wrong
//! in a real rollout at once:
//!
//! - one node goes NotReady before the bump and stays so: it counts against
//!   the budget, never gets a slot, never blocks the others, and ends in
//!   `upgrade-required`, the one node `DriverUpgradeStuck` names at the end;
//! - one GPU pod is guarded by a PodDisruptionBudget that never allows a
//!   disruption: its node waits in `pod-deletion-required`, the ClusterPolicy
//!   gets the `DriverUpgradeStuck` condition naming the node, its state and
//!   the pod, and the node a Warning Event; once the budget goes, the node
//!   finishes and leaves the condition;
//! - the API server is stopped (SIGSTOP) for 60 s mid-rollout: the operator
//!   neither exits nor wedges, its `/healthz` answers 200 and says the API
//!   server is silent, and it writes again once the server is back;
//! - a second replica starts; the leader is cut off from the API server (a
//!   relay that stops forwarding: [`Partition`]) while nodes are
//!   mid-upgrade (old driver pods deleted, new ones not yet validated) until
//!   the standby takes over; the old leader keeps running, its writes are
//!   refused, and it exits for the lost lease once the partition heals; then
//!   the new leader is SIGKILLed and a replica started again: the rollout
//!   continues from the node labels, the budget holds across both
//!   handovers, and no driver pod is restarted twice.
//!
//! A watch on the nodes counts the unschedulable and NotReady nodes after
//! every change, so the budget is checked at every step of the rollout, not
//! at samples; a watch on the driver pods records every pod each node ran.
//!
//! `bench_driver_upgrade_1000_nodes` (ignored; `scripts/bench-upgrade.sh`)
//! rolls a version over 1,000 nodes and prints the time, the most nodes
//! unavailable at once and the operator's API requests per upgraded node.
//!
//! The ClusterPolicy is a cluster-wide singleton: no other test binary that
//! applies one may run against the same cluster at the same time (cargo runs
//! test binaries one after another).
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail, ensure};
use gpu_stack_e2e::binaries::workspace_binary;
use gpu_stack_e2e::chart::OperatorTestEnv;
use gpu_stack_e2e::partition::Partition;
use gpu_stack_e2e::upgrade::{
    DriverPodWatch, LONG, NodeWatch, OperatorProcess, StoppedApiServer, apply_objects,
    apply_policy, delete_object, driver_pods, driver_revisions, fleet_nodes, gpu_deployment,
    pod_disruption_budget, policy, policy_spec, running_pods, state_counts, state_of,
    unschedulable,
};
use gpu_stack_e2e::{GpuFleet, KWOK_ANNOTATION, TestCluster, wait_for};
use gpu_stack_k8s::operator::clusterpolicy::ClusterPolicy;
use gpu_stack_k8s::operator::clusterpolicy::status::DriverUpgradeStatus;
use k8s_openapi::api::core::v1::{Event, Node};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};

/// GPU nodes in the fleet.
const NODES: usize = 200;
/// `maxUnavailable` of the test's rollout: 40 nodes at once, so that on
/// two cores the rollout takes about five waves (the benchmark rolls 1,000
/// nodes at 10%).
const MAX_UNAVAILABLE: &str = "20%";
/// [`MAX_UNAVAILABLE`] of [`NODES`], rounded up.
const BUDGET: usize = NODES.div_ceil(5);
/// `maxUnavailable` of the benchmark.
const BENCH_MAX_UNAVAILABLE: &str = "10%";
/// `--upgrade-stuck-after-seconds` of the operator under test.
const STUCK_AFTER_SECONDS: u64 = 10;
/// Upgraded nodes before the API server is stopped.
const STALL_AFTER_DONE: usize = 10;
/// How long the API server is stopped.
const STALL: Duration = Duration::from_secs(60);
/// Upgraded nodes before the leader is cut off.
const CUT_AFTER_DONE: usize = 60;
const ROLLOUT: Duration = Duration::from_secs(600);
const OLD_VERSION: &str = "550.54.15";
const NEW_VERSION: &str = "570.124.06";
const DONE: &str = "upgrade-done";

/// The policy of the scale runs: only the operands the upgrade flow looks
/// at (the driver, and the validator it waits for; the toolkit the
/// validator depends on), so the control plane's work is the rollout's.
fn spec(version: &str, max_unavailable: &str) -> serde_json::Value {
    let mut spec = policy_spec(
        version,
        max_unavailable,
        // No pod deletion timeout: the pod whose budget refuses eviction
        // keeps its node waiting (and reported stuck) instead of failing it.
        serde_json::json!({"podDeletion": {"timeoutSeconds": 0}}),
    );
    if let Some(s) = spec.as_object_mut() {
        s.insert("devicePlugin".into(), serde_json::json!({"enabled": false}));
        s.insert("gfd".into(), serde_json::json!({"enabled": false}));
    }
    spec
}

fn operator_bin() -> Result<PathBuf> {
    Ok(match std::env::var_os("GPU_STACK_OPERATOR_BIN") {
        Some(p) => PathBuf::from(p),
        None => workspace_binary("gpu-operator")?,
    })
}

/// What a test needs set up and torn down: the operator's share of the
/// cluster ([`OperatorTestEnv`], whose fields it derefs to) and a namespace
/// for the workload pods.
struct Setup {
    cluster: TestCluster,
    env: OperatorTestEnv,
    workload_ns: String,
}

impl std::ops::Deref for Setup {
    type Target = OperatorTestEnv;
    fn deref(&self) -> &OperatorTestEnv {
        &self.env
    }
}

impl Setup {
    async fn new(tag: &str) -> Result<Self> {
        let cluster = TestCluster::attach().await?;
        let env = OperatorTestEnv::setup(&cluster, tag).await?;
        let workload_ns = cluster.create_namespace("gpu-upg-work").await?;
        Ok(Self {
            cluster,
            env,
            workload_ns,
        })
    }

    fn selector(&self) -> String {
        format!("upg-fleet={}", self.prefix)
    }

    fn node(&self, i: usize) -> String {
        format!("{}-{i}", self.prefix)
    }

    async fn teardown<T>(self, result: Result<T>) -> Result<T> {
        let _ = self.cluster.delete_namespace(&self.workload_ns).await;
        self.env.teardown(&self.cluster, result).await
    }
}

/// Applies the first driver version and waits until every node runs it; no
/// node needed an upgrade, so none carries a state label.
async fn install(s: &Setup, count: usize, max_unavailable: &str) -> Result<()> {
    apply_policy(&s.admin, spec(OLD_VERSION, max_unavailable)).await?;
    wait_for(
        "a driver pod in sync on every node, no node labelled",
        ROLLOUT,
        || async {
            let nodes = fleet_nodes(&s.admin, &s.selector()).await?;
            if nodes.len() != count || nodes.iter().any(|n| !state_of(n).is_empty()) {
                return Ok(None);
            }
            let pods = driver_pods(&s.admin, &s.namespace, &s.prefix).await?;
            Ok((pods.len() == count && pods.values().all(|ok| *ok)).then_some(()))
        },
    )
    .await?;
    Ok(())
}

/// Bumps the driver version and waits for the DaemonSet's new revision.
async fn bump(s: &Setup, max_unavailable: &str) -> Result<()> {
    let old = driver_revisions(&s.admin, &s.namespace).await?;
    apply_policy(&s.admin, spec(NEW_VERSION, max_unavailable)).await?;
    wait_for("the driver DaemonSet at a new revision", LONG, || async {
        let now = driver_revisions(&s.admin, &s.namespace).await?;
        Ok((!now.is_empty() && now != old).then_some(()))
    })
    .await?;
    Ok(())
}

/// The node stops: kwok no longer manages it (its annotation is removed)
/// and its Ready condition turns False, as the node lifecycle controller
/// would write once the kubelet's heartbeats stop (the test cluster's grace
/// period is 30 minutes, longer than any test). Its pods keep the status
/// they last had, as on a real node that lost its kubelet.
async fn stop_node(admin: &Client, name: &str) -> Result<()> {
    let nodes: Api<Node> = Api::all(admin.clone());
    nodes
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"metadata": {"annotations": {KWOK_ANNOTATION: null}}}),
            ),
        )
        .await?;
    nodes
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Strategic(serde_json::json!({"status": {"conditions": [{
                "type": "Ready",
                "status": "False",
                "reason": "KubeletNotReady",
                "message": "the kubelet stopped posting node status (e2e)",
            }]}})),
        )
        .await?;
    // The scheduler keeps new pods off it once the taint is there.
    wait_for("the NotReady node tainted", LONG, || async {
        let n = nodes.get(name).await?;
        let tainted = n
            .spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|ts| ts.iter().any(|t| t.key == "node.kubernetes.io/not-ready"));
        let still_false = n
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
            .is_some_and(|c| c.status == "False");
        check(still_false, "the stopped node turned Ready again")?;
        Ok(tainted.then_some(()))
    })
    .await?;
    Ok(())
}

/// A check inside a wait: a state that cannot turn good ends the wait.
fn check(ok: bool, what: &str) -> Result<(), gpu_stack_e2e::E2eError> {
    if ok {
        Ok(())
    } else {
        Err(gpu_stack_e2e::E2eError::Check(what.to_string()))
    }
}

fn upgrade_status(p: &ClusterPolicy) -> Option<&DriverUpgradeStatus> {
    p.status.as_ref().and_then(|s| s.driver_upgrade.as_ref())
}

fn stuck_condition(p: &ClusterPolicy) -> Option<(String, String)> {
    upgrade_status(p)?
        .conditions
        .iter()
        .find(|c| c.type_ == "DriverUpgradeStuck")
        .map(|c| (c.status.clone(), c.message.clone()))
}

/// Nodes (other than `except`) not yet done, schedulable and at the new
/// revision. The watch answers first, from memory; the API is asked (nodes
/// and driver pods listed) only once the watch sees every node done, so
/// waiting costs the control plane next to nothing while the rollout runs.
async fn unfinished(
    s: &Setup,
    watch: &NodeWatch,
    except: &[&str],
) -> Result<Vec<String>, gpu_stack_e2e::E2eError> {
    let pending: Vec<String> = watch.with(|r| {
        r.nodes
            .iter()
            .filter(|(n, _)| !except.contains(&n.as_str()))
            .filter(|(_, v)| v.state != DONE || v.unschedulable)
            .map(|(n, _)| n.clone())
            .collect()
    });
    if !pending.is_empty() {
        return Ok(pending);
    }
    let pods = driver_pods(&s.admin, &s.namespace, &s.prefix).await?;
    let nodes = fleet_nodes(&s.admin, &s.selector()).await?;
    Ok(nodes
        .iter()
        .filter(|n| !except.contains(&n.name_any().as_str()))
        .filter(|n| {
            state_of(n) != DONE || unschedulable(n) || pods.get(&n.name_any()) != Some(&true)
        })
        .map(ResourceExt::name_any)
        .collect())
}

/// Waits until nodes are mid-upgrade: at least `done` upgraded, and some
/// whose old driver pod is deleted but which are not validated yet.
/// Returns how many nodes are in each state.
async fn mid_upgrade(
    nodes: &NodeWatch,
    driver: &DriverPodWatch,
    done: usize,
) -> Result<BTreeMap<String, usize>> {
    Ok(wait_for("nodes mid-upgrade", ROLLOUT, || async {
        let uids = driver.uids();
        Ok(nodes.with(|r| {
            let restarted = |n: &str| uids.get(n).is_some_and(|u| u.len() >= 2);
            let upgraded = r
                .nodes
                .iter()
                .filter(|(n, v)| v.state == DONE && restarted(n))
                .count();
            let restarting = r
                .nodes
                .iter()
                .filter(|(n, v)| v.state == "pod-restart-required" && restarted(n))
                .count();
            (upgraded >= done && restarting > 0).then(|| {
                let mut states: BTreeMap<String, usize> = BTreeMap::new();
                for v in r.nodes.values() {
                    *states.entry(v.state.clone()).or_default() += 1;
                }
                states
            })
        }))
    })
    .await?)
}

/// The API server stalls (SIGSTOP) for [`STALL`]: the operator neither
/// exits nor wedges (its `/healthz` answers 200 throughout, every call it
/// had in flight fails at its deadline, and the page says the API server
/// is silent), and it writes again once the server is back.
async fn api_server_stall(cluster: &TestCluster, operator: &mut OperatorProcess) -> Result<()> {
    let stalled = StoppedApiServer::stop(cluster.kubeconfig())?;
    let until = Instant::now() + STALL;
    let (mut samples, mut healthy, mut silent) = (0, 0, 0);
    while Instant::now() < until {
        samples += 1;
        let page = operator.page("/healthz").await;
        if page.starts_with("HTTP/1.1 200") {
            healthy += 1;
        }
        if page.contains("the API server has not answered") {
            silent += 1;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let running = operator.is_running();
    let writes = || async {
        operator
            .metric("gpu_stack_operator_api_writes_total")
            .await
            .unwrap_or(0.0)
    };
    let before = writes().await;
    drop(stalled);
    let resumed = Instant::now();
    ensure!(
        running,
        "the operator exited while the API server was stopped"
    );
    ensure!(
        healthy == samples,
        "/healthz failed {} of {samples} times while the API server was stopped",
        samples - healthy
    );
    ensure!(
        silent > 0,
        "/healthz never said the API server was silent in {samples} samples"
    );
    wait_for("the operator writing again", LONG, || async {
        Ok((writes().await > before).then_some(()))
    })
    .await?;
    eprintln!(
        "API server stopped {} s mid-rollout: /healthz answered 200 in {healthy} of {samples} \
         samples ({silent} of them saying the API server was silent); the operator wrote again \
         {:.1} s after it resumed",
        STALL.as_secs(),
        resumed.elapsed().as_secs_f64()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_200_node_rollout_survives_a_dead_node_a_stuck_pod_a_stall_a_partition_and_a_kill()
-> Result<()> {
    let s = Setup::new("upgs").await?;
    let result = scale_rollout(&s).await;
    s.teardown(result).await
}

async fn scale_rollout(s: &Setup) -> Result<()> {
    let admin = &s.admin;
    let bin = operator_bin()?;
    s.cluster
        .create_gpu_nodes(&GpuFleet::new(&s.prefix, NODES).with_label("upg-fleet", &s.prefix))
        .await?;
    // Node 0 (first in name order, so it gets the first slot) runs the pod
    // that refuses eviction; node 1 goes NotReady.
    let stuck_node = s.node(0);
    let dead_node = s.node(1);
    let stuck_after = format!("--upgrade-stuck-after-seconds={STUCK_AFTER_SECONDS}");
    // The first leader reaches the API server through a relay the test can
    // cut (a network partition).
    let (relay, relayed_kubeconfig) = Partition::start(&s.kubeconfig, &s.tmp)?;
    let mut operator = OperatorProcess::start(
        &bin,
        &relayed_kubeconfig,
        &s.namespace,
        "upgrade-scale-e2e",
        std::slice::from_ref(&stuck_after),
    )?;
    operator.wait_leading().await?;
    install(s, NODES, MAX_UNAVAILABLE).await?;
    stop_node(admin, &dead_node).await?;

    let ns = &s.workload_ns;
    let trainers = NODES - 1;
    let stubborn_pdb = pod_disruption_budget(
        "stubborn",
        ns,
        "stubborn",
        serde_json::json!({"maxUnavailable": 0}),
    );
    apply_objects(
        admin,
        ns,
        &[
            gpu_deployment(
                "trainer",
                ns,
                trainers,
                serde_json::json!({"upg-fleet": s.prefix}),
            ),
            pod_disruption_budget(
                "trainer",
                ns,
                "trainer",
                serde_json::json!({"maxUnavailable": MAX_UNAVAILABLE}),
            ),
            gpu_deployment(
                "stubborn",
                ns,
                1,
                serde_json::json!({"kubernetes.io/hostname": stuck_node}),
            ),
            stubborn_pdb.clone(),
        ],
    )
    .await?;
    let before = wait_for("the GPU workload running", LONG, || async {
        let running = running_pods(admin, ns, "app=trainer").await?;
        let stubborn = running_pods(admin, ns, "app=stubborn").await?;
        Ok((running.len() == trainers && stubborn.len() == 1).then_some(running))
    })
    .await?;
    let stubborn_pod = running_pods(admin, ns, "app=stubborn")
        .await?
        .into_iter()
        .next()
        .ok_or_else(|| anyhow!("no stubborn pod"))?;

    let nodes = NodeWatch::start(admin, &s.selector()).await?;
    let driver = DriverPodWatch::start(admin, &s.namespace).await?;
    let started = Instant::now();
    bump(s, MAX_UNAVAILABLE).await?;

    // The API server stops in the middle of the rollout.
    let at_stall = mid_upgrade(&nodes, &driver, STALL_AFTER_DONE).await?;
    eprintln!("stopping the API server with nodes in {at_stall:?}");
    api_server_stall(&s.cluster, &mut operator).await?;

    // A second replica waits for the lease.
    let mut standby = OperatorProcess::start(
        &bin,
        &s.kubeconfig,
        &s.namespace,
        "upgrade-scale-e2e-standby",
        std::slice::from_ref(&stuck_after),
    )?;
    wait_for("the standby competing for the lease", LONG, || async {
        Ok(standby
            .page("/readyz")
            .await
            .starts_with("HTTP/1.1 200")
            .then_some(()))
    })
    .await?;
    // The leader is cut off from the API server while nodes are
    // mid-upgrade (some upgraded, some whose old driver pod is deleted and
    // the new one not validated yet) until the standby takes over. It keeps
    // running through the partition: once it cannot be sure it leads, its
    // writes are refused; when the partition heals it finds the lease taken
    // and exits. The budget holds across the handover.
    let at_cut = mid_upgrade(&nodes, &driver, CUT_AFTER_DONE).await?;
    relay.cut();
    let cut = Instant::now();
    standby.wait_leading().await?;
    let took_over = cut.elapsed();
    // Read while cut off (the endpoint is local); gone if it already exited.
    let dropped = operator
        .metric("gpu_stack_operator_writes_dropped_total")
        .await;
    relay.heal();
    let status = operator.exited(LONG).await?;
    ensure!(
        !status.success(),
        "the old leader should exit for the lost lease, not cleanly: {status}"
    );
    eprintln!(
        "leader partitioned with nodes in {at_cut:?}; the standby took over after {:.1} s; \
         the old leader refused {} writes while cut off and exited ({status}) after the heal",
        took_over.as_secs_f64(),
        dropped.map_or("(it had exited)".to_string(), |d| d.to_string()),
    );
    // Then the new leader is SIGKILLed and a replica started again.
    standby.kill();
    eprintln!("new leader SIGKILLed");
    drop(standby);
    drop(operator);
    let operator = OperatorProcess::start(
        &bin,
        &s.kubeconfig,
        &s.namespace,
        "upgrade-scale-e2e",
        std::slice::from_ref(&stuck_after),
    )?;

    // The pod that refuses eviction: the node is reported stuck.
    let stuck = wait_for(
        "DriverUpgradeStuck on the ClusterPolicy",
        ROLLOUT,
        || async {
            let Some(p) = policy(admin).await? else {
                return Ok(None);
            };
            let found = upgrade_status(&p).and_then(|u| {
                let node = u.stuck.iter().find(|n| n.node == stuck_node)?.clone();
                let (status, message) = stuck_condition(&p)?;
                (status == "True").then_some((node, message))
            });
            Ok(found)
        },
    )
    .await?;
    let (entry, message) = stuck;
    ensure!(
        entry.state == "pod-deletion-required" && entry.waiting_for.contains(&stubborn_pod),
        "stuck entry {entry:?} should name pod-deletion-required and {stubborn_pod}"
    );
    ensure!(
        message.contains(&stuck_node),
        "DriverUpgradeStuck message {message:?} does not name {stuck_node}"
    );
    let events: Api<Event> = Api::namespaced(admin.clone(), "default");
    let event = wait_for("a Warning Event about the stuck node", LONG, || async {
        let list = events
            .list(&ListParams::default().fields(&format!("involvedObject.name={stuck_node}")))
            .await?;
        Ok(list.items.into_iter().find(|e| {
            e.reason.as_deref() == Some("DriverUpgradeStuck")
                && e.type_.as_deref() == Some("Warning")
                && e.involved_object.kind.as_deref() == Some("Node")
        }))
    })
    .await?;
    eprintln!(
        "stuck: {} in {} waiting for {:?}; Event: {:?}",
        entry.node,
        entry.state,
        entry.waiting_for,
        event.message.unwrap_or_default()
    );

    // Every other node finishes; the stuck one waits, the dead one never starts.
    let rest = wait_for(
        "every node but the stuck and the NotReady one upgraded",
        ROLLOUT,
        || async {
            let left = unfinished(s, &nodes, &[&stuck_node, &dead_node]).await?;
            Ok(left.is_empty().then_some(()))
        },
    )
    .await;
    if let Err(e) = rest {
        let all = fleet_nodes(admin, &s.selector()).await.unwrap_or_default();
        bail!("{e}; node states: {:?}", state_counts(&all));
    }
    let rest_took = started.elapsed();
    let (stuck_now, dead_now) = nodes.with(|r| {
        (
            r.nodes.get(&stuck_node).cloned(),
            r.nodes.get(&dead_node).cloned(),
        )
    });
    let stuck_now = stuck_now.ok_or_else(|| anyhow!("{stuck_node} not watched"))?;
    ensure!(
        stuck_now.state == "pod-deletion-required" && stuck_now.unschedulable,
        "the stuck node should still wait cordoned in pod-deletion-required: {stuck_now:?}"
    );

    // The budget goes; the stuck node finishes and the condition clears.
    delete_object(admin, ns, &stubborn_pdb).await?;
    wait_for("the stuck node upgraded", ROLLOUT, || async {
        let left = unfinished(s, &nodes, &[&dead_node]).await?;
        Ok(left.is_empty().then_some(()))
    })
    .await?;
    // Only the NotReady node is left reported: it waits in upgrade-required
    // for the node to come back (nodes queued for a slot are never stuck).
    let cleared = wait_for(
        "the stuck node gone from DriverUpgradeStuck, the NotReady one left",
        LONG,
        || async {
            let Some(p) = policy(admin).await? else {
                return Ok(None);
            };
            let only_dead = upgrade_status(&p).is_some_and(|u| {
                u.stuck.len() == 1
                    && u.stuck[0].node == dead_node
                    && u.stuck[0].state == "upgrade-required"
                    && u.stuck[0].waiting_for.contains("NotReady")
            });
            let named = stuck_condition(&p).is_some_and(|(status, message)| {
                status == "True" && message.contains(&dead_node) && !message.contains(&stuck_node)
            });
            Ok((only_dead && named).then_some(p))
        },
    )
    .await?;
    let took = started.elapsed();

    let (peak_unavailable, peak_cordoned, dead_states, dead_cordoned) = nodes.with(|r| {
        (
            r.peak_unavailable,
            r.peak_cordoned,
            r.states.get(&dead_node).cloned().unwrap_or_default(),
            r.ever_cordoned.contains(&dead_node),
        )
    });
    eprintln!(
        "driver upgrade of {NODES} nodes (one NotReady, one held by a PodDisruptionBudget, the API server stopped {} s, \
         the leader partitioned past its lease once and killed once): \
         {} nodes done in {:.1} s, the held one {:.1} s; peak unavailable {peak_unavailable} \
         (cordoned {peak_cordoned}, budget {BUDGET}); the NotReady node went through {dead_states:?}",
        STALL.as_secs(),
        NODES - 2,
        rest_took.as_secs_f64(),
        took.as_secs_f64(),
    );
    ensure!(
        peak_unavailable <= BUDGET,
        "{peak_unavailable} nodes were unschedulable or NotReady at once; the budget is {BUDGET}"
    );
    ensure!(
        peak_cordoned > 1,
        "at most {peak_cordoned} node was ever seen cordoned: the watch missed the rollout"
    );
    let dead_now = dead_now.ok_or_else(|| anyhow!("{dead_node} not watched"))?;
    ensure!(
        dead_now.state == "upgrade-required" && !dead_now.ready && !dead_cordoned,
        "the NotReady node should wait in upgrade-required, never cordoned: {dead_now:?}, cordoned {dead_cordoned}"
    );
    ensure!(
        dead_states
            .iter()
            .all(|st| st.is_empty() || st == DONE || st == "upgrade-required"),
        "the NotReady node was given a slot: it went through {dead_states:?}"
    );

    // No node upgraded twice: each ready node ran its old driver pod and
    // exactly one new one, across the operator's restart; the NotReady node
    // kept its old one.
    let uids = driver.uids();
    for i in 0..NODES {
        let name = s.node(i);
        let ran = uids.get(&name).map_or(0, |u| u.len());
        let want = if name == dead_node { 1 } else { 2 };
        ensure!(
            ran == want,
            "node {name} ran {ran} driver pods during the rollout; expected {want} \
             (its driver was restarted {} times)",
            ran.saturating_sub(1)
        );
    }

    let after = wait_for("the GPU workload running again", LONG, || async {
        let running = running_pods(admin, ns, "app=trainer").await?;
        Ok((running.len() == trainers).then_some(running))
    })
    .await?;
    let evicted = before.difference(&after).count();
    ensure!(
        evicted == trainers,
        "only {evicted} of {trainers} workload pods were evicted (every node that was upgraded ran them)"
    );
    let progress = upgrade_status(&cleared).ok_or_else(|| anyhow!("no status.driverUpgrade"))?;
    ensure!(
        progress.total as usize == NODES
            && progress.upgraded as usize == NODES - 1
            && progress.pending == 1,
        "status.driverUpgrade says {}",
        progress.message
    );
    drop(operator);
    Ok(())
}

/// 1,000-node benchmark (run by `scripts/bench-upgrade.sh`, not by default):
/// a driver version bump with `maxUnavailable: 10%` over
/// `GPU_STACK_BENCH_NODES` (1,000) kwok nodes, each running one GPU pod
/// under a PodDisruptionBudget. Prints the time from the bump to every node
/// `upgrade-done` and schedulable at the new revision, the most nodes
/// unavailable at once (from a watch, every change counted), and the
/// operator's API requests during the rollout per upgraded node. Asserts
/// only correctness (the budget held, every node done), never time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run scripts/bench-upgrade.sh"]
async fn bench_driver_upgrade_1000_nodes() -> Result<()> {
    let count: usize = std::env::var("GPU_STACK_BENCH_NODES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let s = Setup::new("bupg").await?;
    let result = bench(&s, count).await;
    s.teardown(result).await
}

async fn bench(s: &Setup, count: usize) -> Result<()> {
    let admin = &s.admin;
    let bin = operator_bin()?;
    let budget = count.div_ceil(10);
    let t = Instant::now();
    s.cluster
        .create_gpu_nodes(&GpuFleet::new(&s.prefix, count).with_label("upg-fleet", &s.prefix))
        .await?;
    println!(
        "bench: created {count} nodes in {:.1}s",
        t.elapsed().as_secs_f64()
    );
    let operator = OperatorProcess::start(&bin, &s.kubeconfig, &s.namespace, "bench-upgrade", &[])?;
    operator.wait_leading().await?;
    let t = Instant::now();
    install(s, count, BENCH_MAX_UNAVAILABLE).await?;
    println!(
        "bench: first driver version on {count} nodes, every driver pod in sync: {:.1}s",
        t.elapsed().as_secs_f64()
    );
    let ns = &s.workload_ns;
    apply_objects(
        admin,
        ns,
        &[
            gpu_deployment(
                "trainer",
                ns,
                count,
                serde_json::json!({"upg-fleet": s.prefix}),
            ),
            pod_disruption_budget(
                "trainer",
                ns,
                "trainer",
                serde_json::json!({"maxUnavailable": BENCH_MAX_UNAVAILABLE}),
            ),
        ],
    )
    .await?;
    let before = wait_for("the GPU workload running", ROLLOUT, || async {
        let running = running_pods(admin, ns, "app=trainer").await?;
        Ok((running.len() == count).then_some(running))
    })
    .await?;
    // Let the operator settle, then count from here.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let nodes = NodeWatch::start(admin, &s.selector()).await?;
    let requests_before = operator.api_requests().await;
    let t = Instant::now();
    bump(s, BENCH_MAX_UNAVAILABLE).await?;
    let outcome = wait_for("every node upgraded", Duration::from_secs(1800), || async {
        let left = unfinished(s, &nodes, &[]).await?;
        Ok(left.is_empty().then_some(()))
    })
    .await;
    let took = t.elapsed().as_secs_f64();
    let requests_after = operator.api_requests().await;
    let (peak_unavailable, peak_cordoned) = nodes.with(|r| (r.peak_unavailable, r.peak_cordoned));
    if let Err(e) = outcome {
        let all = fleet_nodes(admin, &s.selector()).await.unwrap_or_default();
        bail!("{e}; node states: {:?}", state_counts(&all));
    }
    let mut delta: BTreeMap<(String, String), f64> = BTreeMap::new();
    for (k, v) in &requests_after {
        let d = v - requests_before.get(k).copied().unwrap_or(0.0);
        if d > 0.0 {
            delta.insert(k.clone(), d);
        }
    }
    let total: f64 = delta.values().sum();
    let writes: f64 = delta
        .iter()
        .filter(|((verb, _), _)| matches!(verb.as_str(), "create" | "patch" | "update" | "delete"))
        .map(|(_, v)| v)
        .sum();
    println!(
        "bench: driver version bump over {count} nodes, maxUnavailable {BENCH_MAX_UNAVAILABLE} ({budget} nodes): every node upgrade-done in {took:.1}s"
    );
    println!(
        "bench: most nodes unavailable at once: {peak_unavailable} (cordoned {peak_cordoned}; every node change counted)"
    );
    println!(
        "bench: operator API requests during the rollout: {total} ({:.1} per upgraded node), writes {writes} ({:.1} per node)",
        total / count as f64,
        writes / count as f64
    );
    let by: Vec<String> = delta
        .iter()
        .map(|((verb, res), v)| format!("{verb} {res}: {v}"))
        .collect();
    println!("bench: requests by verb and resource: {}", by.join(", "));
    let after = wait_for("the GPU workload running again", ROLLOUT, || async {
        let running = running_pods(admin, ns, "app=trainer").await?;
        Ok((running.len() == count).then_some(running))
    })
    .await?;
    println!(
        "bench: workload pods evicted and running again: {} of {count}",
        before.difference(&after).count()
    );
    ensure!(
        peak_unavailable <= budget,
        "{peak_unavailable} nodes were unavailable at once; the budget is {budget}"
    );
    Ok(())
}
