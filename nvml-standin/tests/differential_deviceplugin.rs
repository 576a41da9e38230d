//! NVIDIA's nvidia-device-plugin against our gpu-device-plugin on the same
//! simulated nodes, each registering with a kubelet stand-in over real gRPC on
//! unix sockets. NVIDIA's reads the stand-in libnvidia-ml, ours the simulated
//! backend of the same fleet and state file; both run under
//! `tools/nvidia-oracles/fake-host.sh` (`unshare -m`, root), which lays out
//! what NVIDIA's plugin reads besides NVML: the GPUs' NUMA nodes in sysfs, the
//! MIG capability minors (`/proc/driver/nvidia-caps/mig-minors`) and, bind
//! mounted from a temporary directory, `/var/lib/kubelet/device-plugins`,
//! where it serves its sockets.
//!
//! For every node and MIG strategy (none, single, mixed), compared: the
//! resources registered and their options, every resource's devices (ids,
//! health, NUMA topology), and the `Allocate` answer for one device and for
//! two in reverse order (the `envvar` list strategy with uuid ids on every
//! case; index ids, volume mounts and device specs on the MIG nodes). Then a
//! critical Xid injected into the shared state file on a full GPU turns that
//! one device Unhealthy on both sides. The differences known today are
//! asserted one by one (so a change on either side shows up).

mod oracles;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use gpu_stack_core::backend::{Fault, FaultSpec, GpuBackend};
use gpu_stack_k8s::kubelet::deviceplugin::api;
use gpu_stack_k8s::kubelet::deviceplugin::standin::{KubeletStandin, KubeletView};
use oracles::{Node, fleet, oracle, ours, unshare_works};

const FAKE_HOST: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tools/nvidia-oracles/fake-host.sh"
);

/// Bound on every wait; only keeps a broken build from hanging the run.
const WAIT: Duration = Duration::from_secs(60);

/// Environment variables either plugin reads; cleared so the caller's shell
/// cannot change what the test runs.
const PLUGIN_ENV: &[&str] = &[
    "MIG_STRATEGY",
    "DEVICE_LIST_STRATEGY",
    "DEVICE_ID_STRATEGY",
    "PASS_DEVICE_SPECS",
    "CONFIG_FILE",
    "KUBELET_DIR",
    "KUBELET_SOCKET",
    "CDI_SPEC_DIR",
    "NVIDIA_DRIVER_ROOT",
    "NVIDIA_DEV_ROOT",
    "CONTAINER_DRIVER_ROOT",
    "DP_DISABLE_HEALTHCHECKS",
    "DP_ENABLE_HEALTHCHECKS",
    "FAIL_ON_INIT_ERROR",
];

const STRATEGIES: &[&str] = &["none", "single", "mixed"];

/// A simulated node as both plugins see it, after `prepare` (MIG changes).
struct NodeCase {
    name: &'static str,
    fleet: &'static str,
    /// `gpu-stack mig apply` arguments run before the plugins start.
    prepare: Option<&'static [&'static str]>,
    /// Whether to compare the other Allocate settings too.
    variants: bool,
    /// Whether to inject a GPU-wide Xid on a MIG-enabled GPU too (mixed).
    mig_xid: bool,
}

/// HGX H100 after MIG changes: GPUs 0-3 whole, 4-5 split 3g + 2g + 2x 1g,
/// 6 into seven 1g, 7 into 4g + 3g.
const H100_CHANGES: &str = "\
version: v1
mig-configs:
  changed:
    - devices: [0, 1, 2, 3]
      mig-enabled: false
    - devices: [4, 5]
      mig-enabled: true
      mig-devices:
        3g.40gb: 1
        2g.20gb: 1
        1g.10gb: 2
    - devices: [6]
      mig-enabled: true
      mig-devices:
        1g.10gb: 7
    - devices: [7]
      mig-enabled: true
      mig-devices:
        4g.40gb: 1
        3g.40gb: 1
";

const NODES: &[NodeCase] = &[
    // 8x A100-SXM4-40GB with MIG turned off on every GPU.
    NodeCase {
        name: "dgx-a100, MIG off",
        fleet: "dgx-a100",
        prepare: Some(&["apply", "-f", "default", "-c", "all-disabled"]),
        variants: false,
        mig_xid: false,
    },
    // MIG on GPUs 6-7 (3g + 2g + 2x 1g), off on 0-5.
    NodeCase {
        name: "dgx-a100, partly MIG",
        fleet: "dgx-a100",
        prepare: None,
        variants: true,
        mig_xid: true,
    },
    NodeCase {
        name: "hgx-h100 after MIG changes",
        fleet: "hgx-h100",
        prepare: Some(&["apply", "-f", "@H100_CHANGES", "-c", "changed"]),
        variants: true,
        mig_xid: true,
    },
    // Every GPU split into seven 1g.10gb: `single` is valid here.
    NodeCase {
        name: "hgx-h100-mig",
        fleet: "hgx-h100-mig",
        prepare: None,
        variants: false,
        mig_xid: false,
    },
    // MIG off on 0-3, on on 4-7 (6-7 with no instances).
    NodeCase {
        name: "h200",
        fleet: "h200",
        prepare: None,
        variants: true,
        mig_xid: true,
    },
];

/// Allocate settings: flags for NVIDIA's plugin and ours.
struct Variant {
    name: &'static str,
    nvidia: &'static [&'static str],
    ours: &'static [&'static str],
}

const ENVVAR_UUID: Variant = Variant {
    name: "envvar, uuid",
    nvidia: &[],
    ours: &[],
};

const OTHER_VARIANTS: &[Variant] = &[
    Variant {
        name: "envvar, index",
        nvidia: &["--device-id-strategy", "index"],
        ours: &["--device-id-strategy", "index"],
    },
    Variant {
        name: "volume-mounts, uuid, device specs",
        nvidia: &[
            "--device-list-strategy",
            "volume-mounts",
            "--pass-device-specs",
        ],
        ours: &[
            "--device-list-strategy",
            "volume-mounts",
            "--pass-device-specs",
        ],
    },
];

/// A plugin process (either side) and its log; killed if still running at
/// the end.
struct Plugin {
    side: &'static str,
    child: Child,
    log: PathBuf,
}

impl Plugin {
    fn spawn(side: &'static str, mut cmd: Command, log: PathBuf) -> Plugin {
        for k in PLUGIN_ENV {
            cmd.env_remove(k);
        }
        cmd.stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(log.with_extension("err")).unwrap());
        let shown = format!("{cmd:?}");
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {shown}: {e}"));
        Plugin { side, child, log }
    }

    fn log(&self) -> String {
        format!(
            "{}{}",
            std::fs::read_to_string(&self.log).unwrap_or_default(),
            std::fs::read_to_string(self.log.with_extension("err")).unwrap_or_default()
        )
    }

    /// Waits (bounded) for the process to exit.
    async fn exit(&mut self) -> ExitStatus {
        for _ in 0..(WAIT.as_millis() / 50) {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{} did not exit; log:\n{}", self.side, self.log());
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// What one side advertised: resource → (device id → (health, NUMA nodes)).
type Advertised = BTreeMap<String, BTreeMap<String, (String, Vec<i64>)>>;

fn advertised(v: &KubeletView) -> Advertised {
    v.devices
        .iter()
        .map(|(r, ds)| {
            let devices = ds
                .iter()
                .map(|d| {
                    let numa = d
                        .topology
                        .as_ref()
                        .map(|t| t.nodes.iter().map(|n| n.id).collect())
                        .unwrap_or_default();
                    (d.id.clone(), (d.health.clone(), numa))
                })
                .collect();
            (r.clone(), devices)
        })
        .collect()
}

/// Resource → device count each plugin should advertise, from the node's
/// MIG layout by NVIDIA's documented strategies; `None` where the strategy
/// is invalid on the node (`single` with mixed MIG modes or profiles).
fn expected(node: &Node, strategy: &str) -> Option<BTreeMap<String, usize>> {
    let sim = node.sim();
    let n = sim.device_count().unwrap();
    let mut full = 0;
    let mut mig_gpus = 0;
    let mut mig: BTreeMap<String, usize> = BTreeMap::new();
    for g in 0..n {
        let state = sim.mig_state(g).unwrap();
        if !state.mode.current {
            full += 1;
            continue;
        }
        mig_gpus += 1;
        for gi in &state.gpu_instances {
            *mig.entry(format!("nvidia.com/mig-{}", gi.profile_name))
                .or_default() += gi.compute_instances.len();
        }
    }
    let mut out = BTreeMap::new();
    match strategy {
        "none" => {
            out.insert("nvidia.com/gpu".to_string(), n as usize);
        }
        "single" if mig_gpus == 0 => {
            out.insert("nvidia.com/gpu".to_string(), n as usize);
        }
        "single" => {
            if full > 0 || mig.len() != 1 {
                return None;
            }
            out.insert("nvidia.com/gpu".to_string(), mig.values().sum());
        }
        _ => {
            if full > 0 {
                out.insert("nvidia.com/gpu".to_string(), full);
            }
            out.extend(mig);
        }
    }
    Some(out)
}

/// One side running: its kubelet stand-in and plugin process.
struct Side {
    kubelet: KubeletStandin,
    plugin: Plugin,
}

impl Side {
    /// Waits until every expected resource is registered with its devices.
    async fn registered(&self, want: &BTreeMap<String, usize>, case: &str) -> KubeletView {
        let what = format!("{case}: {} registers {want:?}", self.plugin.side);
        self.kubelet
            .wait_for(&what, WAIT, |v| {
                want.iter().all(|(r, n)| {
                    v.registrations.iter().any(|g| &g.resource == r)
                        && v.devices.get(r).is_some_and(|d| d.len() == *n)
                })
            })
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "{e}; view: {:?}\nlog:\n{}",
                    advertised(&self.kubelet.view()),
                    self.plugin.log()
                )
            })
    }
}

/// Both plugins on `node` with `strategy` and `variant`, each under
/// fake-host.sh with its own kubelet stand-in.
async fn start(
    node: &Node,
    nvidia: &Path,
    dir: &Path,
    strategy: &str,
    variant: &Variant,
) -> (Side, Side) {
    let gpus = node.fake_host_gpus();
    let mut sides = Vec::new();
    for side in ["nvidia", "ours"] {
        let kubelet_dir = dir.join(side).join("device-plugins");
        std::fs::create_dir_all(&kubelet_dir).unwrap();
        let kubelet = KubeletStandin::start(&kubelet_dir).await.unwrap();
        let mut cmd = Command::new("unshare");
        cmd.args(["-m", FAKE_HOST]);
        if side == "nvidia" {
            cmd.arg("--kubelet-dir")
                .arg(&kubelet_dir)
                .arg(&gpus)
                .arg(nvidia)
                .args(["--mig-strategy", strategy])
                .args(variant.nvidia);
            node.nvidia_env(&mut cmd);
        } else {
            cmd.arg(&gpus)
                .arg(ours("gpu-device-plugin"))
                .arg("--kubelet-dir")
                .arg(&kubelet_dir)
                .args(["--mig-strategy", strategy])
                // No recovery while the test looks at an Unhealthy device.
                .args(["--health-recovery-seconds", "3600"])
                .args(variant.ours);
            node.ours_env(&mut cmd);
        }
        let log = dir.join(side).join("plugin.log");
        let side = if side == "nvidia" { "NVIDIA's" } else { "ours" };
        sides.push(Side {
            kubelet,
            plugin: Plugin::spawn(side, cmd, log),
        });
    }
    let ours = sides.pop().unwrap();
    let nvidia = sides.pop().unwrap();
    (nvidia, ours)
}

/// A comparable Allocate answer: envs, mounts, device specs, annotations
/// and CDI devices, in the order given.
fn allocation(r: &api::ContainerAllocateResponse) -> String {
    let envs: BTreeMap<&String, &String> = r.envs.iter().collect();
    let annotations: BTreeMap<&String, &String> = r.annotations.iter().collect();
    let mounts: Vec<String> = r
        .mounts
        .iter()
        .map(|m| format!("{}<-{} ro={}", m.container_path, m.host_path, m.read_only))
        .collect();
    let devices: Vec<String> = r
        .devices
        .iter()
        .map(|d| format!("{}<-{} {}", d.container_path, d.host_path, d.permissions))
        .collect();
    let cdi: Vec<&String> = r.cdi_devices.iter().map(|d| &d.name).collect();
    format!(
        "envs={envs:?} mounts={mounts:?} devices={devices:?} annotations={annotations:?} cdi={cdi:?}"
    )
}

/// [`allocation`] with the order of the ids in `NVIDIA_VISIBLE_DEVICES` and
/// of the device specs left out (and repeated device specs merged).
fn allocation_unordered(r: &api::ContainerAllocateResponse) -> String {
    let mut r = r.clone();
    if let Some(v) = r.envs.get_mut("NVIDIA_VISIBLE_DEVICES") {
        let mut ids: Vec<&str> = v.split(',').collect();
        ids.sort();
        *v = ids.join(",");
    }
    r.devices
        .sort_by(|a, b| (&a.container_path, &a.host_path).cmp(&(&b.container_path, &b.host_path)));
    r.devices.dedup();
    allocation(&r)
}

/// Whether `r` lists the devices of `request` in the request's order (in
/// `NVIDIA_VISIBLE_DEVICES` with `index` ids, `name` giving each id's index).
fn in_request_order(
    r: &api::ContainerAllocateResponse,
    request: &[String],
    index_of: &BTreeMap<String, String>,
) -> bool {
    let want: Vec<&str> = request
        .iter()
        .map(|id| index_of.get(id).map_or(id.as_str(), String::as_str))
        .collect();
    match r.envs.get("NVIDIA_VISIBLE_DEVICES") {
        Some(v) if v.starts_with('/') => true,
        Some(v) => v.split(',').collect::<Vec<_>>() == want,
        None => true,
    }
}

/// Compares what both sides advertise and answer on one running case;
/// returns the differences found.
async fn compare(
    case: &str,
    nvidia: &Side,
    ours: &Side,
    want: &BTreeMap<String, usize>,
    index_of: &BTreeMap<String, String>,
    order_only: &mut usize,
) -> Vec<String> {
    let mut diffs = Vec::new();
    let nv_view = nvidia.registered(want, case).await;
    let our_view = ours.registered(want, case).await;
    let resources = |v: &KubeletView| {
        let mut r: Vec<(String, String, bool)> = v
            .registrations
            .iter()
            .map(|g| {
                (
                    g.resource.clone(),
                    g.endpoint.clone(),
                    g.options.get_preferred_allocation_available,
                )
            })
            .collect();
        r.sort();
        r
    };
    if resources(&nv_view) != resources(&our_view) {
        diffs.push(format!(
            "{case}: registrations (resource, endpoint, GetPreferredAllocation):\n  NVIDIA: {:?}\n  ours:   {:?}",
            resources(&nv_view),
            resources(&our_view)
        ));
    }
    let (nv_adv, our_adv) = (advertised(&nv_view), advertised(&our_view));
    for r in want.keys() {
        if nv_adv.get(r) != our_adv.get(r) {
            diffs.push(format!(
                "{case}: {r} devices (id → health, NUMA):\n  NVIDIA: {:?}\n  ours:   {:?}",
                nv_adv.get(r),
                our_adv.get(r)
            ));
        }
    }
    for r in want.keys() {
        let ids: Vec<String> = nv_adv[r].keys().cloned().collect();
        let mut requests = vec![vec![ids[0].clone()]];
        if ids.len() > 1 {
            requests.push(vec![ids[ids.len() - 1].clone(), ids[0].clone()]);
        }
        for req in requests {
            let a = nvidia.kubelet.allocate(r, &req).await;
            let b = ours.kubelet.allocate(r, &req).await;
            match (a, b) {
                (Ok(a), Ok(b)) => {
                    // Known difference: NVIDIA's plugin lists index ids and
                    // device specs in Go map order (random from one call to
                    // the next); ours in the request's order, the same answer
                    // for the same request. Same sets on both sides.
                    if allocation(&a) != allocation(&b)
                        && allocation_unordered(&a) == allocation_unordered(&b)
                        && in_request_order(&b, &req, index_of)
                    {
                        *order_only += 1;
                        continue;
                    }
                    if allocation(&a) != allocation(&b) {
                        diffs.push(format!(
                            "{case}: Allocate {r} {req:?}:\n  NVIDIA: {}\n  ours:   {}",
                            allocation(&a),
                            allocation(&b)
                        ));
                    }
                }
                (a, b) => diffs.push(format!(
                    "{case}: Allocate {r} {req:?}:\n  NVIDIA: {:?}\n  ours:   {:?}",
                    a.map(|a| allocation(&a)),
                    b.map(|b| allocation(&b))
                )),
            }
        }
        // Known difference: an id the resource does not have. NVIDIA's
        // plugin returns a plain error (gRPC UNKNOWN), ours INVALID_ARGUMENT
        // naming the id; both refuse.
        let bad = vec!["GPU-not-on-this-node".to_string()];
        let a = nvidia.kubelet.allocate(r, &bad).await.unwrap_err();
        let b = ours.kubelet.allocate(r, &bad).await.unwrap_err();
        assert_eq!(a.code(), tonic::Code::Unknown, "{case}: NVIDIA: {a}");
        assert_eq!(b.code(), tonic::Code::InvalidArgument, "{case}: ours: {b}");
        assert!(b.message().contains(&bad[0]), "{case}: ours: {b}");
    }
    diffs
}

/// How many of NVIDIA's plugins have started their health check (and so
/// created their NVML event set, which sees only events after it).
fn nvidia_health_checks(log: &str) -> usize {
    log.matches("Ignoring the following XIDs for health checks")
        .count()
}

/// Injects critical Xid 48 on full GPU `gpu` (index) and checks that exactly
/// its device turns Unhealthy on both sides.
async fn xid_on_full_gpu(
    case: &str,
    node: &Node,
    nvidia: &Side,
    ours: &Side,
    gpu: u32,
    resources: usize,
) -> Vec<String> {
    let uuid = node.sim().gpu_info(gpu).unwrap().uuid;
    // NVIDIA's event sets subscribe when its health checks start (after
    // registration); wait for all of them before injecting.
    let mut started = false;
    for _ in 0..(WAIT.as_millis() / 50) {
        if nvidia_health_checks(&nvidia.plugin.log()) >= resources {
            started = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        started,
        "{case}: NVIDIA's health checks did not start; log:\n{}",
        nvidia.plugin.log()
    );
    let sim = node.sim();
    let unhealthy = |v: &KubeletView| {
        v.devices
            .get("nvidia.com/gpu")
            .is_some_and(|ds| ds.iter().any(|d| d.id == uuid && d.health == "Unhealthy"))
    };
    // Injected again (it stays critical) should a side's event set have
    // been created a moment after the previous one.
    let mut seen = (false, false);
    for _ in 0..3 {
        sim.inject(FaultSpec {
            gpu: Some(gpu),
            at_ms: 0,
            fault: Fault::Xid {
                xid: 48,
                gpu_instance: None,
            },
        })
        .unwrap();
        let what = format!("{case}: GPU {gpu} Unhealthy after Xid 48");
        seen = (
            seen.0
                || nvidia
                    .kubelet
                    .wait_for(&what, WAIT / 3, unhealthy)
                    .await
                    .is_ok(),
            seen.1
                || ours
                    .kubelet
                    .wait_for(&what, WAIT / 3, unhealthy)
                    .await
                    .is_ok(),
        );
        if seen == (true, true) {
            break;
        }
    }
    let mut diffs = Vec::new();
    for (side, s, ok) in [("NVIDIA", nvidia, seen.0), ("ours", ours, seen.1)] {
        if !ok {
            diffs.push(format!(
                "{case}: {side}: GPU {gpu} ({uuid}) not Unhealthy after Xid 48; log:\n{}",
                s.plugin.log()
            ));
            continue;
        }
        let v = s.kubelet.view();
        let bad: Vec<String> = v
            .devices
            .iter()
            .flat_map(|(r, ds)| {
                ds.iter()
                    .filter(|d| d.health != "Healthy")
                    .map(move |d| format!("{r} {}", d.id))
            })
            .collect();
        if bad != [format!("nvidia.com/gpu {uuid}")] {
            diffs.push(format!(
                "{case}: {side}: after Xid 48 on GPU {gpu} ({uuid}) not Healthy: {bad:?}"
            ));
        }
    }
    diffs
}

/// Applies `prepare` (our `gpu-stack mig apply`) to the node's state file.
fn prepare(node: &Node, dir: &Path, args: &[&str]) {
    let config = dir.join("mig-config.yaml");
    std::fs::write(&config, H100_CHANGES).unwrap();
    let args: Vec<String> = args
        .iter()
        .map(|a| match *a {
            "@H100_CHANGES" => config.display().to_string(),
            a => a.to_string(),
        })
        .collect();
    let mut cmd = Command::new(ours("gpu-stack"));
    cmd.arg("mig").args(&args);
    let out = node.ours(cmd);
    assert!(
        out.status.success(),
        "gpu-stack mig {args:?}: {}",
        oracles::shown(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_device_plugin_matches_nvidias_on_every_node_and_strategy() {
    let Some(nvidia) = oracle("nvidia-device-plugin") else {
        return;
    };
    if !unshare_works() {
        return;
    }
    let mut failures = Vec::new();
    for nc in NODES {
        let dir = tempfile::tempdir().unwrap();
        let node = Node::new(fleet(nc.fleet), Some(dir.path().join("gpus.json")));
        if let Some(args) = nc.prepare {
            prepare(&node, dir.path(), args);
        }
        let index_of = index_names(&node);
        for strategy in STRATEGIES {
            let mut variants = vec![&ENVVAR_UUID];
            if nc.variants && *strategy == "mixed" {
                variants.extend(OTHER_VARIANTS);
            }
            for variant in variants {
                let case = format!("{}, --mig-strategy={strategy}, {}", nc.name, variant.name);
                let run = tempfile::tempdir().unwrap();
                let (mut nv, mut ou) = start(&node, &nvidia, run.path(), strategy, variant).await;
                let Some(want) = expected(&node, strategy) else {
                    // An invalid strategy for the node: both refuse to start.
                    for s in [&mut nv, &mut ou] {
                        let status = s.plugin.exit().await;
                        assert!(
                            !status.success(),
                            "{case}: {} exited {status}; log:\n{}",
                            s.plugin.side,
                            s.plugin.log()
                        );
                        assert!(
                            s.kubelet.view().registrations.is_empty(),
                            "{case}: {} registered",
                            s.plugin.side
                        );
                    }
                    eprintln!("{case}: both refuse to start");
                    continue;
                };
                let started = std::time::Instant::now();
                let mut order_only = 0;
                let mut diffs = compare(&case, &nv, &ou, &want, &index_of, &mut order_only).await;
                if variant.name == ENVVAR_UUID.name
                    && let Some(gpu) = last_full_gpu(&node, strategy)
                {
                    diffs.extend(xid_on_full_gpu(&case, &node, &nv, &ou, gpu, want.len()).await);
                    if *strategy == "mixed" && nc.mig_xid {
                        diffs.extend(xid_on_mig_gpu(&case, &node, &nv, &ou, gpu).await);
                    }
                }
                eprintln!(
                    "{case}: {} differences, {order_only} Allocate answers in another order ({:?})",
                    diffs.len(),
                    started.elapsed()
                );
                failures.extend(diffs);
                nv.kubelet.stop().await;
                ou.kubelet.stop().await;
            }
        }
    }
    assert!(
        failures.is_empty(),
        "differences from NVIDIA's device plugin:\n{}",
        failures.join("\n")
    );
}

/// Every device id (GPU and MIG UUID) → its `index` id (`3`, `6:1`), and
/// each MIG UUID → its GPU's index under the key `gpu:<uuid>`.
fn index_names(node: &Node) -> BTreeMap<String, String> {
    let sim = node.sim();
    let mut out = BTreeMap::new();
    for g in 0..sim.device_count().unwrap() {
        out.insert(sim.gpu_info(g).unwrap().uuid, g.to_string());
        let state = sim.mig_state(g).unwrap();
        if !state.mode.current {
            continue;
        }
        let mut gis = state.gpu_instances.clone();
        gis.sort_by_key(|gi| gi.id);
        let mut i = 0;
        for gi in &gis {
            let mut cis = gi.compute_instances.clone();
            cis.sort_by_key(|ci| ci.id);
            for ci in &cis {
                out.insert(ci.uuid.clone(), format!("{g}:{i}"));
                out.insert(format!("gpu:{}", ci.uuid), g.to_string());
                i += 1;
            }
        }
    }
    out
}

/// Injects critical Xid 48 on the highest-index MIG-enabled GPU, for the
/// whole GPU (no GPU instance), after [`xid_on_full_gpu`] broke
/// `broken_full`. Known difference: ours marks every MIG device of that GPU
/// Unhealthy; NVIDIA's maps each GPU to one of its MIG devices per resource
/// (the last one it iterates, in Go map order) and marks only that one.
async fn xid_on_mig_gpu(
    case: &str,
    node: &Node,
    nvidia: &Side,
    ours: &Side,
    broken_full: u32,
) -> Vec<String> {
    let sim = node.sim();
    let gpu = (0..sim.device_count().unwrap())
        .rev()
        .find(|&g| {
            let s = sim.mig_state(g).unwrap();
            s.mode.current
                && s.gpu_instances
                    .iter()
                    .any(|gi| !gi.compute_instances.is_empty())
        })
        .expect("a MIG-enabled GPU with MIG devices");
    let broken_uuid = sim.gpu_info(broken_full).unwrap().uuid;
    // Resource → the MIG devices it has on `gpu`.
    let mut on_gpu: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for gi in &sim.mig_state(gpu).unwrap().gpu_instances {
        for ci in &gi.compute_instances {
            on_gpu
                .entry(format!("nvidia.com/mig-{}", gi.profile_name))
                .or_default()
                .insert(ci.uuid.clone());
        }
    }
    // Resource → its Unhealthy devices, the full GPU broken before left out.
    let unhealthy = |v: &KubeletView| -> BTreeMap<String, BTreeSet<String>> {
        let mut m: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (r, ds) in &v.devices {
            for d in ds {
                if d.health != "Healthy" && d.id != broken_uuid {
                    m.entry(r.clone()).or_default().insert(d.id.clone());
                }
            }
        }
        m
    };
    sim.inject(FaultSpec {
        gpu: Some(gpu),
        at_ms: 0,
        fault: Fault::Xid {
            xid: 48,
            gpu_instance: None,
        },
    })
    .unwrap();
    let what = format!("{case}: MIG devices of GPU {gpu} Unhealthy after Xid 48");
    let mut diffs = Vec::new();
    let nvidia_done = |v: &KubeletView| {
        let u = unhealthy(v);
        on_gpu.keys().all(|r| u.contains_key(r))
    };
    match nvidia.kubelet.wait_for(&what, WAIT, nvidia_done).await {
        Ok(v) => {
            let u = unhealthy(&v);
            let one_each = u.len() == on_gpu.len()
                && u.iter().all(|(r, ids)| {
                    ids.len() == 1 && on_gpu.get(r).is_some_and(|o| o.is_superset(ids))
                });
            if !one_each {
                diffs.push(format!(
                    "{case}: NVIDIA: after Xid 48 on MIG GPU {gpu}, Unhealthy {u:?}; \
                     expected one of each resource's devices there: {on_gpu:?}"
                ));
            }
        }
        Err(e) => diffs.push(format!(
            "{e}; NVIDIA's Unhealthy: {:?}",
            unhealthy(&nvidia.kubelet.view())
        )),
    }
    if let Err(e) = ours
        .kubelet
        .wait_for(&what, WAIT, |v| unhealthy(v) == on_gpu)
        .await
    {
        diffs.push(format!(
            "{e}; ours Unhealthy: {:?}, expected {on_gpu:?}",
            unhealthy(&ours.kubelet.view())
        ));
    }
    diffs
}

/// The highest-index GPU advertised whole under `strategy`, if any.
fn last_full_gpu(node: &Node, strategy: &str) -> Option<u32> {
    let sim = node.sim();
    (0..sim.device_count().unwrap())
        .rev()
        .find(|&g| strategy == "none" || !sim.mig_state(g).unwrap().mode.current)
}
