//! The MIG apply path against simulated GPUs: NVIDIA's shipped configs, minimal
//! switches, impossible configs, busy instances, mode changes that need a
//! reset, and failures or kills after every single backend call.

use std::sync::atomic::{AtomicUsize, Ordering};

use gpu_stack_core::backend::{
    BackendError, ComputeInstance, GpuBackend, GpuInfo, GpuInstance, GpuInstanceProfile,
    GpuProcess, GpuTelemetry, HealthEvents, MigMode, MigModeChange, MigTelemetry, SlicePlacement,
    SystemInfo,
};
use gpu_stack_core::migparted::MigPartedConfig;
use gpu_stack_nvml::migapply::{
    ApplyError, ApplyOptions, ApplyOutcome, ApplyReport, NoProcesses, ProcessProbe, apply, export,
    plan_node,
};
use gpu_stack_nvml::{SimNodeSpec, SimulatedBackend};

const H100: &str = "0x233010DE";
const A100_40: &str = "0x20B010DE";

fn node(model: &str, gpus: u32) -> SimulatedBackend {
    SimulatedBackend::new(&SimNodeSpec::uniform("n0", model, gpus)).unwrap()
}

fn shipped() -> MigPartedConfig {
    MigPartedConfig::default_config().unwrap()
}

fn run(b: &dyn GpuBackend, cfg: &MigPartedConfig, name: &str) -> Result<ApplyReport, ApplyError> {
    apply(
        b,
        cfg,
        name,
        ApplyOptions::default(),
        &NoProcesses,
        &mut |_| {},
    )
}

/// Layout of every GPU as `profile@start` lists, plus MIG mode.
/// (profile id, start, compute-instance slice counts) of one GPU instance.
type Gi = (u32, u32, Vec<u32>);

fn layout(b: &dyn GpuBackend) -> Vec<(bool, Vec<Gi>)> {
    (0..b.device_count().unwrap())
        .map(|g| {
            let s = b.mig_state(g).unwrap();
            let mut gis: Vec<_> = s
                .gpu_instances
                .iter()
                .map(|gi| {
                    (
                        gi.profile_id,
                        gi.placement.start,
                        gi.compute_instances.iter().map(|c| c.slice_count).collect(),
                    )
                })
                .collect();
            gis.sort();
            (s.mode.current, gis)
        })
        .collect()
}

/// Names of shipped configs that apply to a model (the others fail cleanly).
fn applicable(model: &str) -> Vec<String> {
    let cfg = shipped();
    let b = node(model, 1);
    cfg.names()
        .into_iter()
        .filter(|n| plan_node(&b, &cfg, n, &NoProcesses).is_ok())
        .map(str::to_string)
        .collect()
}

#[test]
fn every_shipped_config_applies_and_reapplies_with_no_change() {
    let cfg = shipped();
    for model in [H100, A100_40] {
        let names = applicable(model);
        assert!(names.len() >= 9, "{model}: {names:?}");
        for name in &names {
            let b = node(model, 2);
            let first = run(&b, &cfg, name).unwrap_or_else(|e| panic!("{model} {name}: {e}"));
            assert_eq!(first.outcome, ApplyOutcome::Converged, "{model} {name}");
            let second = run(&b, &cfg, name).unwrap();
            assert_eq!(
                second.change_calls, 0,
                "{model} {name}: second apply changed things"
            );
            assert_eq!(second.outcome, ApplyOutcome::Converged);
            assert!(
                plan_node(&b, &cfg, name, &NoProcesses)
                    .unwrap()
                    .is_converged()
            );
        }
    }
}

#[test]
fn switching_configs_changes_only_the_difference() {
    let cfg = shipped();
    let names = applicable(H100);
    for from in &names {
        for to in &names {
            let b = node(H100, 1);
            run(&b, &cfg, from).unwrap();
            let before = layout(&b);
            let r = run(&b, &cfg, to).unwrap();
            let after = layout(&b);
            // Instances present before and after were never touched: the
            // destroyed + created counts are exactly the symmetric difference.
            let (old, new) = (&before[0].1, &after[0].1);
            if before[0].0 && after[0].0 {
                let gone = old.iter().filter(|g| !new.contains(g)).count();
                let came = new.iter().filter(|g| !old.contains(g)).count();
                let destroyed: usize = old
                    .iter()
                    .filter(|g| !new.contains(g))
                    .map(|g| g.2.len() + 1)
                    .sum();
                let created: usize = new
                    .iter()
                    .filter(|g| !old.contains(g))
                    .map(|g| g.2.len() + 1)
                    .sum();
                assert_eq!(r.destroyed, destroyed, "{from} -> {to}");
                assert_eq!(r.created, created, "{from} -> {to}");
                assert_eq!(r.kept, old.len() - gone, "{from} -> {to}");
                assert_eq!(new.len(), r.kept + came);
                // No mode change between two MIG layouts, so every changing
                // call is a destroy or a create, and the minimal change never
                // costs more than clearing the GPU and recreating everything.
                assert_eq!(r.change_calls, destroyed + created, "{from} -> {to}");
                assert!(
                    r.change_calls <= r.from_scratch_calls,
                    "{from} -> {to}: {} incremental calls, {} from scratch",
                    r.change_calls,
                    r.from_scratch_calls
                );
            }
        }
    }
}

#[test]
fn impossible_or_unknown_config_fails_and_changes_nothing() {
    let cfg = MigPartedConfig::from_yaml(
        "version: v1\nmig-configs:\n  too-big:\n    - devices: all\n      mig-enabled: true\n      mig-devices:\n        \"3g.40gb\": 3\n  a30-only:\n    - devices: all\n      mig-enabled: true\n      mig-devices:\n        \"1g.6gb\": 4\n",
    )
    .unwrap();
    let b = node(H100, 2);
    run(&b, &shipped(), "all-balanced").unwrap();
    let before = layout(&b);
    for name in ["too-big", "a30-only", "no-such-config"] {
        let e = run(&b, &cfg, name).unwrap_err();
        assert!(matches!(e, ApplyError::Select(_)), "{name}: {e}");
        assert!(e.to_string().contains("nothing was changed"), "{e}");
        assert_eq!(layout(&b), before, "{name} changed the GPUs");
    }
}

/// A backend that lets `ok` changing calls through, then fails: either before
/// the call (`kill_after = false`: the call errors) or after it took effect
/// (`kill_after = true`: the process dies right after the call).
struct Faulty<'a> {
    inner: &'a SimulatedBackend,
    ok: usize,
    kill_after: bool,
    seen: AtomicUsize,
}

impl Faulty<'_> {
    fn gate<T>(&self, f: impl FnOnce() -> Result<T, BackendError>) -> Result<T, BackendError> {
        let n = self.seen.fetch_add(1, Ordering::SeqCst);
        let dead = || BackendError::Other {
            message: format!("injected failure at change call {}", n + 1),
        };
        if n < self.ok {
            return f();
        }
        if self.kill_after {
            f()?;
        }
        Err(dead())
    }
}

impl GpuBackend for Faulty<'_> {
    fn name(&self) -> &str {
        "faulty"
    }
    fn system_info(&self) -> Result<SystemInfo, BackendError> {
        self.inner.system_info()
    }
    fn device_count(&self) -> Result<u32, BackendError> {
        self.inner.device_count()
    }
    fn gpu_info(&self, gpu: u32) -> Result<GpuInfo, BackendError> {
        self.inner.gpu_info(gpu)
    }
    fn mig_mode(&self, gpu: u32) -> Result<MigMode, BackendError> {
        self.inner.mig_mode(gpu)
    }
    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<MigModeChange, BackendError> {
        self.gate(|| self.inner.set_mig_mode(gpu, enabled))
    }
    fn gpu_instance_profiles(&self, gpu: u32) -> Result<Vec<GpuInstanceProfile>, BackendError> {
        self.inner.gpu_instance_profiles(gpu)
    }
    fn gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstance>, BackendError> {
        self.inner.gpu_instances(gpu)
    }
    fn create_gpu_instance(
        &self,
        gpu: u32,
        profile_id: u32,
        placement: SlicePlacement,
    ) -> Result<GpuInstance, BackendError> {
        self.gate(|| self.inner.create_gpu_instance(gpu, profile_id, placement))
    }
    fn create_compute_instance(
        &self,
        gpu: u32,
        gi: u32,
        slices: u32,
    ) -> Result<ComputeInstance, BackendError> {
        self.gate(|| self.inner.create_compute_instance(gpu, gi, slices))
    }
    fn destroy_compute_instance(&self, gpu: u32, gi: u32, ci: u32) -> Result<(), BackendError> {
        self.gate(|| self.inner.destroy_compute_instance(gpu, gi, ci))
    }
    fn destroy_gpu_instance(&self, gpu: u32, gi: u32) -> Result<(), BackendError> {
        self.gate(|| self.inner.destroy_gpu_instance(gpu, gi))
    }
    fn reset_gpu(&self, gpu: u32) -> Result<(), BackendError> {
        self.gate(|| self.inner.reset_gpu(gpu))
    }
    fn gpu_telemetry(&self, gpu: u32) -> Result<GpuTelemetry, BackendError> {
        self.inner.gpu_telemetry(gpu)
    }
    fn mig_telemetry(&self, gpu: u32) -> Result<Vec<MigTelemetry>, BackendError> {
        self.inner.mig_telemetry(gpu)
    }
    fn health_events(&self) -> Result<Box<dyn HealthEvents>, BackendError> {
        self.inner.health_events()
    }
    fn running_processes(&self, gpu: u32) -> Result<Vec<GpuProcess>, BackendError> {
        self.inner.running_processes(gpu)
    }
}

#[test]
fn fails_or_is_killed_after_every_call_then_converges() {
    let cfg = shipped();
    // Start from one layout, switch to another: destroys, creates and (for the
    // last pair) a MIG mode change all get interrupted somewhere.
    for (from, to) in [
        ("all-balanced", "all-1g.10gb"),
        ("all-1g.10gb", "all-3g.40gb"),
        ("all-disabled", "all-balanced"),
        ("all-balanced", "all-disabled"),
    ] {
        let reference = node(H100, 2);
        run(&reference, &cfg, from).unwrap();
        let total = run(&reference, &cfg, to).unwrap().change_calls;
        let expected = layout(&reference);
        assert!(total > 0);
        for kill_after in [false, true] {
            for ok in 0..total {
                let b = node(H100, 2);
                run(&b, &cfg, from).unwrap();
                let faulty = Faulty {
                    inner: &b,
                    ok,
                    kill_after,
                    seen: AtomicUsize::new(0),
                };
                let e = run(&faulty, &cfg, to).unwrap_err();
                assert!(matches!(e, ApplyError::Step { .. }), "{e}");
                // The next run reads what is there and finishes the job.
                let r = run(&b, &cfg, to).unwrap();
                assert_eq!(r.outcome, ApplyOutcome::Converged);
                assert!(r.change_calls <= total, "{from}->{to} at {ok}: {r}");
                assert_eq!(
                    layout(&b),
                    expected,
                    "{from}->{to} cut at {ok} ({kill_after})"
                );
                assert_eq!(run(&b, &cfg, to).unwrap().change_calls, 0);
            }
        }
    }
}

/// Processes on the GPU instance at slice 0 of GPU 0.
struct BusyAtZero(u32);

impl ProcessProbe for BusyAtZero {
    fn processes(&self, gpu: u32, gi: Option<u32>, _ci: Option<u32>) -> Vec<u32> {
        if gpu == 0 && gi == Some(self.0) {
            vec![4242]
        } else {
            Vec::new()
        }
    }
}

#[test]
fn busy_instances_are_refused_unless_forced() {
    let cfg = shipped();
    let b = node(H100, 1);
    run(&b, &cfg, "all-1g.10gb").unwrap();
    let gi0 = b
        .gpu_instances(0)
        .unwrap()
        .into_iter()
        .find(|g| g.placement.start == 0)
        .unwrap()
        .id;
    let before = layout(&b);
    let probe = BusyAtZero(gi0);
    let e = apply(
        &b,
        &cfg,
        "all-7g.80gb",
        ApplyOptions::default(),
        &probe,
        &mut |_| {},
    )
    .unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, ApplyError::Busy(_)), "{text}");
    assert!(
        text.contains("4242") && text.contains(&format!("GPU instance {gi0}")),
        "{text}"
    );
    assert!(text.contains("--force"), "{text}");
    assert_eq!(layout(&b), before);
    // A change that keeps the busy instance is fine.
    apply(
        &b,
        &cfg,
        "all-1g.10gb",
        ApplyOptions::default(),
        &probe,
        &mut |_| {},
    )
    .unwrap();
    let forced = ApplyOptions {
        force: true,
        ..ApplyOptions::default()
    };
    let r = apply(&b, &cfg, "all-7g.80gb", forced, &probe, &mut |_| {}).unwrap();
    assert_eq!(r.outcome, ApplyOutcome::Converged);
}

#[test]
fn mode_change_that_needs_a_reset() {
    let cfg = shipped();
    let mut spec = SimNodeSpec::uniform("n0", H100, 2);
    spec.mig_change_needs_reset = true;
    let b = SimulatedBackend::new(&spec).unwrap();
    let no_reset = ApplyOptions {
        reset_gpus: false,
        ..ApplyOptions::default()
    };
    let r = apply(
        &b,
        &cfg,
        "all-balanced",
        no_reset,
        &NoProcesses,
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(r.outcome, ApplyOutcome::NeedsReboot { gpus: vec![0, 1] });
    assert!(b.mig_mode(0).unwrap().pending);
    // Again without reset: still waiting, nothing new done.
    let r = apply(
        &b,
        &cfg,
        "all-balanced",
        no_reset,
        &NoProcesses,
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(r.change_calls, 0);
    assert!(matches!(r.outcome, ApplyOutcome::NeedsReboot { .. }));
    // With resets allowed the run finishes.
    let r = run(&b, &cfg, "all-balanced").unwrap();
    assert_eq!(r.outcome, ApplyOutcome::Converged);
    assert_eq!(run(&b, &cfg, "all-balanced").unwrap().change_calls, 0);
}

#[test]
fn export_round_trips_through_apply() {
    let cfg = shipped();
    let b = node(A100_40, 2);
    run(&b, &cfg, "all-balanced").unwrap();
    let text = export(&b, "current").unwrap().to_yaml();
    let exported = MigPartedConfig::from_yaml(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(run(&b, &exported, "current").unwrap().change_calls, 0);
    // Applied to a clean node it builds the same layout.
    let c = node(A100_40, 2);
    run(&c, &exported, "current").unwrap();
    assert_eq!(layout(&c), layout(&b));
}

/// The figures docs/mig.md's MIG manager section quotes, on 8 simulated H100s.
#[test]
fn from_clean_h100_node_call_counts() {
    let cfg = shipped();
    let b = node(H100, 8);
    // From a clean GPU: 8 MIG mode changes, then 7 GPU + 7 compute instances
    // on each GPU.
    let first = run(&b, &cfg, "all-1g.10gb").unwrap();
    assert_eq!(first.outcome, ApplyOutcome::Converged);
    assert_eq!(first.change_calls, 120, "{first}");
    assert_eq!(first.created, 112, "{first}");
    assert_eq!(first.destroyed, 0, "{first}");
    // Re-applying changes nothing; clearing and recreating would make 224.
    let again = run(&b, &cfg, "all-1g.10gb").unwrap();
    assert_eq!(again.change_calls, 0, "{again}");
    assert_eq!(again.from_scratch_calls, 224, "{again}");
    // Switching keeps the instances that already fit.
    let switch = run(&b, &cfg, "all-balanced").unwrap();
    assert_eq!(switch.outcome, ApplyOutcome::Converged);
    assert_eq!(switch.kept, 16, "{switch}");
    assert_eq!(switch.change_calls, 112, "{switch}");
    assert_eq!(switch.from_scratch_calls, 176, "{switch}");
}

#[test]
fn two_applies_on_one_state_file_run_one_after_the_other() {
    use std::sync::{Arc, Barrier, Mutex};
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("node.json");
    let spec = SimNodeSpec::uniform("n0", "H100-SXM5-80GB", 2);
    SimulatedBackend::with_state_file(&spec, &state).unwrap();
    let lock = gpu_stack_nvml::sim::state::apply_lock_path(&state);
    let steps: Arc<Mutex<Vec<&'static str>>> = Arc::default();
    let start = Arc::new(Barrier::new(2));
    let handles: Vec<_> = ["all-1g.10gb", "all-7g.80gb"]
        .into_iter()
        .map(|name| {
            let (spec, state, lock) = (spec.clone(), state.clone(), lock.clone());
            let (steps, start) = (steps.clone(), start.clone());
            std::thread::spawn(move || {
                let b = SimulatedBackend::with_state_file(&spec, &state).unwrap();
                start.wait();
                apply(
                    &b,
                    &shipped(),
                    name,
                    ApplyOptions::default(),
                    &NoProcesses,
                    &mut |_| {
                        // Inside an apply nobody else can take the apply lock.
                        let other = std::fs::File::open(&lock).unwrap();
                        assert!(matches!(
                            other.try_lock(),
                            Err(std::fs::TryLockError::WouldBlock)
                        ));
                        steps.lock().unwrap().push(name);
                    },
                )
                .unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let steps = steps.lock().unwrap();
    // One apply's steps, then the other's: never interleaved.
    let switches = steps.windows(2).filter(|w| w[0] != w[1]).count();
    assert!(switches <= 1, "interleaved steps: {steps:?}");
    let last = *steps.last().unwrap();
    let b = SimulatedBackend::with_state_file(&spec, &state).unwrap();
    let report = run(&b, &shipped(), last).unwrap();
    assert_eq!(report.change_calls, 0, "the node holds {last}");
}
