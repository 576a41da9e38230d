//! Dynamic Resource Allocation with dynamic MIG on the real test control
//! plane: the scheduler itself allocates MIG devices from the ResourceSlices
//! gpu-stack publishes, and the KEP-4815 shared counters keep every GPU's
//! set of allocated devices a layout `mig::validate` accepts.
//!
//! 100 kwok nodes of eight simulated H100s each publish their slices (one per
//! GPU, 26 devices and a counter set each) as the DRA plugin would; kwok runs
//! no plugin and marks the pods Running without preparing anything. 500
//! ResourceClaims of the chart's `mig.nvidia.com` class, each used by one pod,
//! ask for 1g.10gb, 1g.20gb, 2g.20gb or 3g.40gb (one device) or for half a
//! node's worth of 7g.80gb (four devices). Single-device claims alone cannot
//! outgrow 800 GPUs, so the four-device claims do: 210 of them want 840
//! whole GPUs, and every GPU a smaller instance lands on leaves less for
//! them. The test checks each allocation against the
//! published devices (right profile, right node, no device twice, each
//! GPU's layout valid) and that every claim left pending fits on no node and
//! has a pod the scheduler marked Unschedulable for its claims.
//!
//! A second test publishes one GPU of every MIG-capable catalog model and
//! reads the slices back: the API server accepts them and keeps their
//! counters. Both need the `DRAPartitionableDevices` feature gate, which
//! `cargo xtask cluster up` sets; without it the API server drops the
//! counters and the read-back fails.
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use futures::{StreamExt, TryStreamExt};
use gpu_stack_core::catalog;
use gpu_stack_core::dra::devices::GpuDevices;
use gpu_stack_core::mig::{MigGeometry, PlacedInstance, format_layout, validate};
use gpu_stack_e2e::dra::{
    DRIVER, MIG_CLASS, allocated_devices, apply_chart_class, claim_pod, delete_claims,
    delete_node_slices, delete_run_class, devices_of, mig_claim, placement_of, publish_node,
    quantity_u64, simulated_gpu,
};
use gpu_stack_e2e::{E2eError, GpuFleet, TestCluster, unique_suffix, wait_for};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{Counter, ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};

const MODEL: &str = "H100-SXM5-80GB";
const NODES: usize = 100;
const GPUS_PER_NODE: u32 = 8;
const RUN_LABEL: &str = "e2e.gpu-stack.dev/run";
/// What the scheduler's DRA plugin says when no node has the devices.
const NO_DEVICES: &str = "cannot allocate all claims";
/// Bounds on the waits, so a broken cluster fails the run instead of hanging
/// it; they are not speed assertions.
const NODES_READY: Duration = Duration::from_secs(300);
const SETTLED: Duration = Duration::from_secs(900);
/// Requests in flight while creating objects: enough to keep the API server
/// busy, few enough to leave the scheduler a core.
const IN_FLIGHT: usize = 16;

/// One block of 50 claims, repeated ten times: (profile, devices per claim,
/// claims per block). 210 claims of four 7g.80gb ask for 840 GPUs; the nodes
/// have 800. Four, not eight: the 1.34 allocator tries a multi-device
/// request's devices in every order, so asking a node with seven free GPUs
/// for eight costs it thousands of tries, on every such node for every such
/// pod, and the scheduler needs tens of minutes for what four do in a few.
const WHOLE_GPUS: u32 = 4;
const MIX: [(&str, u32, usize); 5] = [
    ("7g.80gb", WHOLE_GPUS, 21),
    ("1g.10gb", 1, 13),
    ("2g.20gb", 1, 6),
    ("3g.40gb", 1, 6),
    ("1g.20gb", 1, 4),
];
const BLOCKS: usize = 10;

/// One claim and its pod.
#[derive(Debug, Clone)]
struct Ask {
    claim: String,
    pod: String,
    profile: &'static str,
    count: u32,
}

/// The 500 claims in a fixed shuffled order, so every profile arrives
/// throughout the run rather than one after another.
fn asks() -> Vec<Ask> {
    let mut kinds: Vec<(&'static str, u32)> = Vec::new();
    for _ in 0..BLOCKS {
        for (profile, count, n) in MIX {
            kinds.extend(std::iter::repeat_n((profile, count), n));
        }
    }
    // Fisher-Yates with a fixed linear congruential generator: the same
    // order on every run.
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    for i in (1..kinds.len()).rev() {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let j = ((state >> 33) % (i as u64 + 1)) as usize;
        kinds.swap(i, j);
    }
    kinds
        .into_iter()
        .enumerate()
        .map(|(i, (profile, count))| Ask {
            claim: format!("claim-{i:03}"),
            pod: format!("pod-{i:03}"),
            profile,
            count,
        })
        .collect()
}

fn h100_geometry() -> Result<&'static MigGeometry> {
    catalog::lookup(MODEL)?
        .mig
        .as_ref()
        .ok_or_else(|| anyhow!("{MODEL} has no MIG geometry in the catalog"))
}

/// Runs `f` over `items` with [`IN_FLIGHT`] requests in flight.
async fn for_each<T, F, Fut>(items: Vec<T>, f: F) -> Result<()>
where
    F: Fn(T) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    futures::stream::iter(items.into_iter().map(f))
        .buffer_unordered(IN_FLIGHT)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Creates the fleet and waits until the scheduler may use every node:
/// Ready, and free of the not-ready taint the node lifecycle controller puts
/// on new nodes. Returns (name, uid) per node.
async fn ready_nodes(
    cluster: &TestCluster,
    prefix: &str,
    run: &str,
    count: usize,
) -> Result<Vec<(String, String)>> {
    let fleet = GpuFleet::new(prefix, count)
        .with_gpus(GPUS_PER_NODE)
        .with_label(RUN_LABEL, run);
    cluster.create_gpu_nodes(&fleet).await?;
    let api: Api<Node> = Api::all(cluster.client());
    let selector = format!("{RUN_LABEL}={run}");
    let nodes = wait_for(&format!("{count} nodes Ready"), NODES_READY, || {
        let api = api.clone();
        let selector = selector.clone();
        async move {
            let list = api.list(&ListParams::default().labels(&selector)).await?;
            let usable = |n: &Node| {
                let ready = n
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
                let tainted = n
                    .spec
                    .as_ref()
                    .and_then(|s| s.taints.as_ref())
                    .is_some_and(|t| !t.is_empty());
                ready && !tainted
            };
            let ok = list.items.len() == count && list.items.iter().all(usable);
            Ok::<_, E2eError>(ok.then_some(list.items))
        }
    })
    .await?;
    Ok(nodes
        .iter()
        .map(|n| (n.name_any(), n.uid().unwrap_or_default()))
        .collect())
}

/// Deletes the nodes `<prefix>-...` and their slices, whatever state the
/// test left.
async fn delete_fleet(cluster: &TestCluster, prefix: &str) {
    let client = cluster.client();
    let nodes = gpu_stack_e2e::nodes_with_prefix(&client, prefix).await;
    if let Err(err) = delete_node_slices(&client, &nodes).await {
        eprintln!("cleanup: deleting the ResourceSlices of {prefix}-*: {err:#}");
    }
    if let Err(err) = cluster.delete_nodes(&nodes).await {
        eprintln!("cleanup: deleting the nodes {prefix}-*: {err:#}");
    }
}

#[tokio::test]
async fn mig_claims_on_100_h100_nodes_get_valid_layouts_or_wait_with_the_schedulers_reason() {
    let cluster = TestCluster::attach().await.unwrap();
    let run = unique_suffix();
    let prefix = format!("dra-{run}");
    let admin = cluster.client();
    let namespace = cluster.create_namespace("dra-scale").await.unwrap();

    let result = scale(&cluster, &prefix, &run, &namespace).await;

    // Pods first (at once: kwok does not confirm deletions of pods it
    // runs), then the claims they pin, then the rest.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &namespace);
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    if let Err(err) = pods.delete_collection(&now, &ListParams::default()).await {
        eprintln!("cleanup: deleting the pods in {namespace}: {err}");
    }
    if let Err(err) = delete_claims(&admin, &namespace).await {
        eprintln!("cleanup: deleting the claims in {namespace}: {err:#}");
    }
    let _ = cluster.delete_namespace(&namespace).await;
    delete_fleet(&cluster, &prefix).await;
    delete_run_class(&admin, &format!("{run}.{MIG_CLASS}")).await;
    result.unwrap();
}

async fn scale(cluster: &TestCluster, prefix: &str, run: &str, namespace: &str) -> Result<()> {
    let admin = cluster.client();
    let model = catalog::lookup(MODEL)?;
    let geometry = h100_geometry()?;

    let nodes = ready_nodes(cluster, prefix, run, NODES).await?;

    // Every node's slices, as its DRA plugin would publish them.
    let started = Instant::now();
    let published: BTreeMap<String, Vec<GpuDevices>> = nodes
        .iter()
        .map(|(node, _)| {
            let gpus: Vec<_> = (0..GPUS_PER_NODE)
                .map(|minor| (simulated_gpu(model, node, minor), Some(geometry)))
                .collect();
            (node.clone(), devices_of(&gpus))
        })
        .collect();
    let uids: BTreeMap<&String, &String> = nodes.iter().map(|(n, u)| (n, u)).collect();
    for_each(published.iter().collect(), |(node, gpus)| {
        let admin = admin.clone();
        let uid = uids.get(node).map(|u| u.to_string());
        async move {
            publish_node(&admin, node, uid, gpus).await?;
            Ok(())
        }
    })
    .await?;
    let slice_count = published.values().map(Vec::len).sum::<usize>();
    println!(
        "figure: {slice_count} ResourceSlices ({} nodes of {GPUS_PER_NODE} {MODEL}) published in {:.1} s",
        published.len(),
        started.elapsed().as_secs_f64()
    );
    print_slice_size(&admin, &nodes[0].0).await?;

    // The chart's class (under this run's name), so the test proves its CEL
    // selects these devices.
    let class = apply_chart_class(&admin, MIG_CLASS, run).await?;

    let asks = asks();
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), namespace);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), namespace);
    for_each(asks.clone(), |ask| {
        let claims = claims.clone();
        let class = class.clone();
        async move {
            let claim = mig_claim(&ask.claim, &class, ask.profile, ask.count)?;
            claims.create(&PostParams::default(), &claim).await?;
            Ok(())
        }
    })
    .await?;
    let selector = BTreeMap::from([(RUN_LABEL.to_string(), run.to_string())]);
    let started = Instant::now();
    for_each(asks.clone(), |ask| {
        let pods = pods.clone();
        let selector = selector.clone();
        async move {
            let pod = claim_pod(&ask.pod, &ask.claim, &selector)?;
            pods.create(&PostParams::default(), &pod).await?;
            Ok(())
        }
    })
    .await?;

    // Settled: every pod is bound with its claim allocated, or the scheduler
    // found no devices for it. Consumption only grows, so neither changes.
    let (pod_list, claim_list) = wait_for(
        "every claim allocated or its pod Unschedulable",
        SETTLED,
        || {
            let pods = pods.clone();
            let claims = claims.clone();
            async move {
                let pod_list = pods.list(&ListParams::default()).await?.items;
                let claim_list = claims.list(&ListParams::default()).await?.items;
                let allocated: BTreeSet<String> = claim_list
                    .iter()
                    .filter(|c| !allocated_devices(c).is_empty())
                    .map(ResourceExt::name_any)
                    .collect();
                let settled = pod_list.len() == asks_len()
                    && pod_list.iter().all(|p| {
                        let bound = p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some();
                        let claim = pod_claim(p).unwrap_or_default();
                        (bound && allocated.contains(&claim)) || no_devices_reason(p).is_some()
                    });
                if !settled {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
                Ok::<_, E2eError>(settled.then_some((pod_list, claim_list)))
            }
        },
    )
    .await?;
    let settled_after = started.elapsed().as_secs_f64();

    check(
        geometry,
        &published,
        &asks,
        &pod_list,
        &claim_list,
        settled_after,
    )
}

fn asks_len() -> usize {
    MIX.iter().map(|(_, _, n)| n).sum::<usize>() * BLOCKS
}

fn pod_claim(pod: &Pod) -> Option<String> {
    pod.spec
        .as_ref()?
        .resource_claims
        .as_ref()?
        .first()?
        .resource_claim_name
        .clone()
}

/// The scheduler's message when the pod is Unschedulable for want of devices.
fn no_devices_reason(pod: &Pod) -> Option<String> {
    if pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_ref())
        .is_some()
    {
        return None;
    }
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| {
            c.type_ == "PodScheduled"
                && c.status == "False"
                && c.reason.as_deref() == Some("Unschedulable")
                && c.message.as_deref().is_some_and(|m| m.contains(NO_DEVICES))
        })
        .and_then(|c| c.message.clone())
}

/// How many more instances of `profile` a GPU holding `layout` takes, adding
/// them at its allowed starts in order while the layout stays valid. A lower
/// bound on its room, exact for one instance and for profiles that fill the
/// GPU.
fn room(geometry: &MigGeometry, layout: &[PlacedInstance], profile: &str) -> u32 {
    let Some(p) = geometry
        .gi_profiles
        .iter()
        .find(|p| p.name.to_string() == profile)
    else {
        return 0;
    };
    let mut starts: Vec<u32> = p.placements.iter().map(|pl| pl.start).collect();
    starts.sort_unstable();
    let mut layout = layout.to_vec();
    let mut n = 0;
    for start in starts {
        layout.push(PlacedInstance::new(p.name.clone(), start));
        if validate(geometry, &layout).is_ok() {
            n += 1;
        } else {
            layout.pop();
        }
    }
    n
}

fn check(
    geometry: &MigGeometry,
    published: &BTreeMap<String, Vec<GpuDevices>>,
    asks: &[Ask],
    pods: &[Pod],
    claims: &[ResourceClaim],
    settled_after: f64,
) -> Result<()> {
    let pods: BTreeMap<String, &Pod> = pods.iter().map(|p| (p.name_any(), p)).collect();
    let claims: BTreeMap<String, &ResourceClaim> =
        claims.iter().map(|c| (c.name_any(), c)).collect();
    let mut seen: BTreeSet<(String, String)> = BTreeSet::new();
    let mut layouts: BTreeMap<(String, usize), Vec<PlacedInstance>> = BTreeMap::new();
    let mut allocated: BTreeMap<&str, usize> = BTreeMap::new();
    let mut pending: Vec<(&Ask, String)> = Vec::new();
    for ask in asks {
        let pod = pods
            .get(&ask.pod)
            .ok_or_else(|| anyhow!("pod {} is missing", ask.pod))?;
        let claim = claims
            .get(&ask.claim)
            .ok_or_else(|| anyhow!("claim {} is missing", ask.claim))?;
        let devices = allocated_devices(claim);
        if devices.is_empty() {
            let message = no_devices_reason(pod).ok_or_else(|| {
                anyhow!(
                    "claim {} is not allocated and pod {} has no PodScheduled=False condition \
                     mentioning its claims: {:?}",
                    ask.claim,
                    ask.pod,
                    pod.status.as_ref().and_then(|s| s.conditions.as_ref())
                )
            })?;
            pending.push((ask, message));
            continue;
        }
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .ok_or_else(|| {
                anyhow!(
                    "claim {} is allocated but pod {} is not bound",
                    ask.claim,
                    ask.pod
                )
            })?;
        let uid = pod.uid().unwrap_or_default();
        let reserved = claim
            .status
            .as_ref()
            .and_then(|s| s.reserved_for.as_ref())
            .is_some_and(|r| r.iter().any(|c| c.uid == uid && c.resource == "pods"));
        ensure!(
            reserved,
            "claim {} is not reserved for its pod {}",
            ask.claim,
            ask.pod
        );
        ensure!(
            devices.len() == ask.count as usize,
            "claim {} asked for {} × {} and got {} devices: {devices:?}",
            ask.claim,
            ask.count,
            ask.profile,
            devices.len()
        );
        let gpus = published
            .get(&node)
            .ok_or_else(|| anyhow!("pod {} is bound to {node}, a node of no slices", ask.pod))?;
        for (pool, device) in devices {
            ensure!(
                pool == node,
                "claim {} got {device} from pool {pool}, but its pod runs on {node}",
                ask.claim
            );
            let (gpu, placed) = placement_of(gpus, geometry, &device).ok_or_else(|| {
                anyhow!(
                    "claim {} got {device} on {node}, not a published MIG device",
                    ask.claim
                )
            })?;
            ensure!(
                placed.profile.to_string() == ask.profile,
                "claim {} asked for {} and got {device} ({placed})",
                ask.claim,
                ask.profile
            );
            ensure!(
                seen.insert((pool.clone(), device.clone())),
                "{pool}/{device} is allocated to more than one claim (again to {})",
                ask.claim
            );
            layouts.entry((pool, gpu)).or_default().push(placed);
        }
        *allocated.entry(ask.profile).or_default() += 1;
    }

    let mut shared = 0;
    for ((node, gpu), layout) in &layouts {
        if let Err(violations) = validate(geometry, layout) {
            bail!(
                "{node} GPU {gpu}: the scheduler allocated {}, which mig::validate refuses: {}",
                format_layout(layout),
                violations
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; ")
            );
        }
        if layout.len() > 1 {
            shared += 1;
        }
    }

    // A pending claim must fit on no node: the counters refuse only what the
    // validator refuses, so the scheduler may not leave a fitting claim.
    let empty = Vec::new();
    for (ask, _) in &pending {
        for (node, gpus) in published {
            let free: u32 = (0..gpus.len())
                .map(|gpu| {
                    let layout = layouts.get(&(node.clone(), gpu)).unwrap_or(&empty);
                    room(geometry, layout, ask.profile)
                })
                .sum();
            ensure!(
                free < ask.count,
                "claim {} ({} × {}) is pending, yet {node} has room for {free}",
                ask.claim,
                ask.count,
                ask.profile
            );
        }
    }

    let claims_allocated: usize = allocated.values().sum();
    let devices: usize = seen.len();
    println!(
        "figure: {claims_allocated} claims allocated in {settled_after:.1} s ({:.1} claims/s) on {} nodes: {devices} MIG devices on {} GPUs, {shared} GPUs holding instances of more than one claim",
        claims_allocated as f64 / settled_after,
        published.len(),
        layouts.len(),
    );
    let mut by_profile: BTreeMap<&str, usize> = BTreeMap::new();
    for (ask, _) in &pending {
        *by_profile.entry(ask.profile).or_default() += 1;
    }
    println!(
        "figure: {} claims pending, their pods Unschedulable (allocated {allocated:?}, pending {by_profile:?})",
        pending.len()
    );
    if let Some((ask, message)) = pending.first() {
        println!(
            "pod {} (claim {}): PodScheduled=False Unschedulable: {message}",
            ask.pod, ask.claim
        );
    }
    // The GPU the counters had the most to do on, to show what they allowed.
    if let Some(((node, gpu), layout)) = layouts.iter().max_by_key(|(_, l)| l.len()) {
        println!(
            "fullest GPU: {node} GPU {gpu} holds {} ({} instances)",
            format_layout(layout),
            layout.len()
        );
    }

    // 840 GPUs of 7g.80gb on 800: some claims must wait.
    ensure!(
        !pending.is_empty(),
        "every claim was allocated, beyond the nodes' capacity"
    );
    let gpus = published.values().map(Vec::len).sum::<usize>();
    let whole = allocated.get("7g.80gb").copied().unwrap_or(0) * WHOLE_GPUS as usize;
    ensure!(
        whole <= gpus,
        "{whole} GPUs of 7g.80gb allocated on {gpus} GPUs"
    );
    // The first claims meet empty nodes: every single-device profile gets some.
    for (profile, count, _) in MIX {
        ensure!(
            count > 1 || allocated.get(profile).copied().unwrap_or(0) > 0,
            "no {profile} claim was allocated"
        );
    }
    Ok(())
}

/// Prints the size of one H100's slice as the API server serves it.
async fn print_slice_size(client: &Client, node: &str) -> Result<()> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let slices = api
        .list(&ListParams::default().fields(&format!("spec.nodeName={node},spec.driver={DRIVER}")))
        .await?
        .items;
    let slice = slices
        .iter()
        .find(|s| s.spec.devices.is_some())
        .cloned()
        .ok_or_else(|| anyhow!("{node} has no ResourceSlice with devices"))?;
    for counters_only in slices.iter().filter(|s| s.spec.devices.is_none()) {
        println!(
            "figure: the counter slice {} holds {} counter sets",
            counters_only.name_any(),
            counters_only
                .spec
                .shared_counters
                .as_ref()
                .map_or(0, Vec::len)
        );
    }
    let name = slice.name_any();
    let request = http::Request::get(format!("/apis/resource.k8s.io/v1/resourceslices/{name}"))
        .body(Vec::new())?;
    let text = client.request_text(request).await?;
    let mut value: serde_json::Value = serde_json::from_str(&text)?;
    if let Some(meta) = value.get_mut("metadata").and_then(|m| m.as_object_mut()) {
        meta.remove("managedFields");
    }
    let without = serde_json::to_vec(&value)?.len();
    let devices = slice.spec.devices.as_ref().map_or(0, Vec::len);
    let counters: usize = slice
        .spec
        .shared_counters
        .iter()
        .flatten()
        .map(|s| s.counters.len())
        .sum();
    println!(
        "figure: one {MODEL}'s ResourceSlice is {} bytes of JSON as served ({without} without managedFields): {devices} devices, {counters} shared counters",
        text.len()
    );
    Ok(())
}

#[tokio::test]
async fn slices_of_every_mig_capable_catalog_gpu_are_accepted_with_their_counters() {
    let cluster = TestCluster::attach().await.unwrap();
    let run = unique_suffix();
    let prefix = format!("dra-catalog-{run}");
    let result = catalog_slices(&cluster, &prefix, &run).await;
    delete_fleet(&cluster, &prefix).await;
    result.unwrap();
}

async fn catalog_slices(cluster: &TestCluster, prefix: &str, run: &str) -> Result<()> {
    let admin = cluster.client();
    let nodes = ready_nodes(cluster, prefix, run, 1).await?;
    let (node, uid) = &nodes[0];
    let models: Vec<_> = catalog::models()
        .iter()
        .filter(|m| m.mig.is_some())
        .collect();
    ensure!(!models.is_empty(), "the catalog has no MIG-capable model");
    let gpus: Vec<_> = models
        .iter()
        .zip(0u32..)
        .map(|(m, minor)| (simulated_gpu(m, node, minor), m.mig.as_ref()))
        .collect();
    let devices = devices_of(&gpus);
    for (d, m) in devices.iter().zip(&models) {
        ensure!(
            d.counter_set.is_some(),
            "{}: no counter set published: {}",
            m.name,
            d.mig_left_out.as_deref().unwrap_or("no reason given")
        );
    }
    let sent = publish_node(&admin, node, Some(uid.clone()), &devices).await?;

    // Every slice read back as stored: on 1.35+ the counter sets sit in
    // slices of their own, so sets and consumption are compared over the
    // node's whole pool.
    let api: Api<ResourceSlice> = Api::all(admin.clone());
    let (mut want_sets, mut got_sets) = (BTreeMap::new(), BTreeMap::new());
    let (mut want_use, mut got_use) = (BTreeMap::new(), BTreeMap::new());
    for slice in &sent {
        let name = slice.name_any();
        let stored = api
            .get(&name)
            .await
            .with_context(|| format!("reading back slice {name}"))?;
        let what = format!("slice {name}");
        ensure!(
            !(split_slices()
                && stored.spec.devices.is_some()
                && stored.spec.shared_counters.is_some()),
            "{what} holds devices and counters, which 1.35 and later refuse"
        );
        want_sets.extend(shared_counters(slice, &what)?);
        got_sets.extend(shared_counters(&stored, &what)?);
        want_use.extend(consumption(slice, &what)?);
        got_use.extend(consumption(&stored, &what)?);
    }
    ensure!(
        got_sets == want_sets,
        "the API server kept shared counters {got_sets:?}, not the {want_sets:?} sent; \
         is the DRAPartitionableDevices feature gate on?"
    );
    ensure!(
        got_use == want_use,
        "the API server kept other devices or consumption than sent; is the \
         DRAPartitionableDevices feature gate on? sent {} devices, stored {}",
        want_use.len(),
        got_use.len()
    );
    for (d, m) in devices.iter().zip(&models) {
        let set = d
            .counter_set
            .as_ref()
            .map(|s| s.name.clone())
            .unwrap_or_default();
        ensure!(
            got_sets.contains_key(&set),
            "{}: counter set {set} not stored",
            m.name
        );
        for device in &d.devices {
            ensure!(
                got_use
                    .get(&device.name)
                    .is_some_and(|sets| sets.iter().any(|(s, _)| *s == set)),
                "{}: device {} does not consume from {set}",
                m.name,
                device.name
            );
        }
    }
    let total_devices = got_use.len();
    println!(
        "figure: {} MIG-capable catalog models' slices accepted with their counters: {total_devices} devices ({})",
        models.len(),
        models
            .iter()
            .map(|m| m.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// Counter values by name.
type Counters = BTreeMap<String, u64>;

/// True on Kubernetes 1.35 and later, where a slice holds devices or
/// counters, never both.
fn split_slices() -> bool {
    gpu_stack_e2e::kube_minor() >= 35
}

/// A slice's counter sets: set name -> counters.
fn shared_counters(s: &ResourceSlice, what: &str) -> Result<BTreeMap<String, Counters>> {
    s.spec
        .shared_counters
        .iter()
        .flatten()
        .map(|set| Ok((set.name.clone(), counter_values(&set.counters, what)?)))
        .collect()
}

/// What each device of a slice consumes: device -> [(counter set, counters)].
fn consumption(s: &ResourceSlice, what: &str) -> Result<BTreeMap<String, Vec<(String, Counters)>>> {
    s.spec
        .devices
        .iter()
        .flatten()
        .map(|d| {
            let sets = d
                .consumes_counters
                .iter()
                .flatten()
                .map(|c| Ok((c.counter_set.clone(), counter_values(&c.counters, what)?)))
                .collect::<Result<_>>()?;
            Ok((d.name.clone(), sets))
        })
        .collect()
}

fn counter_values(counters: &BTreeMap<String, Counter>, what: &str) -> Result<Counters> {
    counters
        .iter()
        .map(|(k, c)| {
            quantity_u64(&c.value)
                .map(|v| (k.clone(), v))
                .ok_or_else(|| anyhow!("{what}: counter {k} is {:?}", c.value.0))
        })
        .collect()
}
