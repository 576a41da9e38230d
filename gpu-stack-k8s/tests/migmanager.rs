//! The MIG manager's node pass against an in-memory node and simulated GPUs:
//! state label transitions, deploy labels paused and restored exactly, clean
//! failures that never leave `pending`.

use std::collections::BTreeMap;
use std::time::Duration;

use gpu_stack_core::migmanager::{
    FAILURE_REASON_ANNOTATION, MIG_CONFIG_STATE_LABEL, MigConfigState, PAUSE_RECORD_ANNOTATION,
};
use gpu_stack_core::migparted::MigPartedConfig;
use gpu_stack_core::operator::labels::{MIG_CONFIG, PAUSED_FOR_MIG_CHANGE};
use gpu_stack_k8s::migmanager::{ManagerOptions, MemoryNode, PassResult, reconcile};
use gpu_stack_nvml::migapply::NoProcesses;
use gpu_stack_nvml::{SimNodeSpec, SimulatedBackend};

fn start_labels(config: &str) -> BTreeMap<String, String> {
    [
        (MIG_CONFIG, config),
        ("nvidia.com/gpu.deploy.device-plugin", "true"),
        ("nvidia.com/gpu.deploy.gpu-feature-discovery", "true"),
        ("nvidia.com/gpu.deploy.dcgm-exporter", "false"),
        ("nvidia.com/gpu.deploy.dcgm", "true"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

fn opts(signal: Option<std::path::PathBuf>) -> ManagerOptions {
    ManagerOptions {
        node: "n0".into(),
        force: false,
        client_timeout: Duration::from_millis(50),
        poll: Duration::from_millis(5),
        reset_gpus: true,
        signal_file: signal,
    }
}

fn deploy(labels: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    labels
        .iter()
        .filter(|(k, _)| k.starts_with("nvidia.com/gpu.deploy."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

#[tokio::test]
async fn pending_then_success_with_labels_paused_and_restored() {
    let dir = tempfile::tempdir().unwrap();
    let signal = dir.path().join("mig-changed");
    let gpus = SimulatedBackend::new(&SimNodeSpec::uniform("n0", "0x233010DE", 2)).unwrap();
    let node = MemoryNode::new(start_labels("all-balanced"));
    let before = deploy(&node.view().labels);
    let cfg = MigPartedConfig::default_config().unwrap();
    let r = reconcile(
        &node,
        &gpus,
        &cfg,
        &opts(Some(signal.clone())),
        &NoProcesses,
    )
    .await
    .unwrap();
    assert_eq!(r, PassResult::State(MigConfigState::Success, None));
    let history = node.history();
    let first = &history[0];
    assert_eq!(first[MIG_CONFIG_STATE_LABEL], "pending");
    assert_eq!(
        first["nvidia.com/gpu.deploy.device-plugin"],
        PAUSED_FOR_MIG_CHANGE
    );
    assert_eq!(first["nvidia.com/gpu.deploy.dcgm-exporter"], "false");
    assert_eq!(first["nvidia.com/gpu.deploy.nvsm"], PAUSED_FOR_MIG_CHANGE);
    let end = node.view();
    assert_eq!(end.labels[MIG_CONFIG_STATE_LABEL], "success");
    assert_eq!(
        deploy(&end.labels),
        before,
        "deploy labels restored exactly"
    );
    assert!(!end.annotations.contains_key(PAUSE_RECORD_ANNOTATION));
    assert!(signal.exists(), "device plugin signal file touched");
    // A second pass: nothing to pause, nothing to change.
    let n = node.history().len();
    reconcile(&node, &gpus, &cfg, &opts(None), &NoProcesses)
        .await
        .unwrap();
    assert_eq!(node.history().len(), n);
}

#[tokio::test]
async fn impossible_config_fails_without_pausing() {
    let gpus = SimulatedBackend::new(&SimNodeSpec::uniform("n0", "0x233010DE", 1)).unwrap();
    let node = MemoryNode::new(start_labels("all-1g.6gb"));
    let cfg = MigPartedConfig::default_config().unwrap();
    let r = reconcile(&node, &gpus, &cfg, &opts(None), &NoProcesses)
        .await
        .unwrap();
    assert!(
        matches!(r, PassResult::State(MigConfigState::Failed, Some(_))),
        "{r:?}"
    );
    for labels in node.history() {
        assert_ne!(labels[MIG_CONFIG_STATE_LABEL], "pending");
        assert_eq!(labels["nvidia.com/gpu.deploy.device-plugin"], "true");
    }
    assert!(node.view().annotations[FAILURE_REASON_ANNOTATION].contains("1g.6gb"));
}

#[tokio::test]
async fn clients_that_never_leave_end_failed_with_labels_restored() {
    let gpus = SimulatedBackend::new(&SimNodeSpec::uniform("n0", "0x233010DE", 1)).unwrap();
    let node = MemoryNode::new(start_labels("all-balanced"));
    node.set_lingering(true);
    let before = deploy(&node.view().labels);
    let cfg = MigPartedConfig::default_config().unwrap();
    let r = reconcile(&node, &gpus, &cfg, &opts(None), &NoProcesses)
        .await
        .unwrap();
    let PassResult::State(MigConfigState::Failed, Some(reason)) = r else {
        panic!("{r:?}")
    };
    assert!(reason.contains("did not leave"), "{reason}");
    let end = node.view();
    assert_eq!(end.labels[MIG_CONFIG_STATE_LABEL], "failed");
    assert_eq!(deploy(&end.labels), before);
    // Nothing was applied to the GPU.
    assert!(
        !gpu_stack_core::backend::GpuBackend::mig_mode(&gpus, 0)
            .unwrap()
            .current
    );
    // Once the clients behave, the next pass succeeds.
    node.set_lingering(false);
    let r = reconcile(&node, &gpus, &cfg, &opts(None), &NoProcesses)
        .await
        .unwrap();
    assert_eq!(r, PassResult::State(MigConfigState::Success, None));
    assert!(
        !node
            .view()
            .annotations
            .contains_key(FAILURE_REASON_ANNOTATION)
    );
}

#[tokio::test]
async fn reset_needed_reports_rebooting_then_resumes() {
    let mut spec = SimNodeSpec::uniform("n0", "0x233010DE", 1);
    spec.mig_change_needs_reset = true;
    let gpus = SimulatedBackend::new(&spec).unwrap();
    let node = MemoryNode::new(start_labels("all-balanced"));
    let before = deploy(&node.view().labels);
    let cfg = MigPartedConfig::default_config().unwrap();
    let mut o = opts(None);
    o.reset_gpus = false;
    let r = reconcile(&node, &gpus, &cfg, &o, &NoProcesses)
        .await
        .unwrap();
    assert_eq!(r, PassResult::State(MigConfigState::Rebooting, None));
    assert!(
        node.view()
            .annotations
            .contains_key(PAUSE_RECORD_ANNOTATION)
    );
    // "Reboot": the GPU reset happens, the manager starts again.
    gpu_stack_core::backend::GpuBackend::reset_gpu(&gpus, 0).unwrap();
    let r = reconcile(&node, &gpus, &cfg, &opts(None), &NoProcesses)
        .await
        .unwrap();
    assert_eq!(r, PassResult::State(MigConfigState::Success, None));
    assert_eq!(deploy(&node.view().labels), before);
}

#[tokio::test]
async fn busy_instance_fails_naming_it_and_pauses_nothing_unless_forced() {
    let gpus = SimulatedBackend::new(&SimNodeSpec::uniform("n0", "0x233010DE", 2)).unwrap();
    let cfg = MigPartedConfig::default_config().unwrap();
    let node = MemoryNode::new(start_labels("all-3g.40gb"));
    let r = reconcile(&node, &gpus, &cfg, &opts(None), &NoProcesses)
        .await
        .unwrap();
    assert_eq!(r, PassResult::State(MigConfigState::Success, None));
    let gi = gpu_stack_core::backend::GpuBackend::gpu_instances(&gpus, 1).unwrap()[0].id;
    gpus.start_process(1, Some(gi), None, Some(4242), Some(1024))
        .unwrap();
    let layout = |b: &SimulatedBackend| b.snapshot().unwrap().gpus;
    let before_gpus = layout(&gpus);
    let before_labels = node.view().labels;
    let writes = node.history().len();

    node.set_label(MIG_CONFIG, "all-1g.10gb");
    let r = reconcile(&node, &gpus, &cfg, &opts(None), &NoProcesses)
        .await
        .unwrap();
    let PassResult::State(MigConfigState::Failed, Some(reason)) = r else {
        panic!("expected failed, got {r:?}");
    };
    assert!(
        reason.contains(&format!("GPU 1 GPU instance {gi} compute instance 0"))
            && reason.contains("4242")
            && reason.contains("--force"),
        "{reason}"
    );
    assert_eq!(layout(&gpus), before_gpus, "no GPU was touched");
    let view = node.view();
    assert_eq!(view.annotations[FAILURE_REASON_ANNOTATION], reason);
    assert_eq!(
        deploy(&view.labels),
        deploy(&before_labels),
        "clients were never paused"
    );
    assert!(
        node.history()[writes..]
            .iter()
            .all(|l| l.get(MIG_CONFIG_STATE_LABEL).map(String::as_str) != Some("pending")),
        "the refusal comes before pending"
    );

    let mut forced = opts(None);
    forced.force = true;
    let r = reconcile(&node, &gpus, &cfg, &forced, &NoProcesses)
        .await
        .unwrap();
    assert_eq!(r, PassResult::State(MigConfigState::Success, None));
    assert!(
        gpu_stack_core::backend::GpuBackend::running_processes(&gpus, 1)
            .unwrap()
            .is_empty(),
        "the process ended with its instance"
    );
    assert!(
        !node
            .view()
            .annotations
            .contains_key(FAILURE_REASON_ANNOTATION)
    );
    assert_eq!(deploy(&node.view().labels), deploy(&before_labels));
}

#[tokio::test]
async fn reboot_through_the_shared_state_file_resumes_to_success() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("gpus.json");
    let mut spec = SimNodeSpec::uniform("n0", "0x233010DE", 2);
    spec.mig_change_needs_reset = true;
    // The manager's view of the GPUs and, separately, the node's (as
    // `gpu-stack gpus --reboot` would open it).
    let gpus = SimulatedBackend::with_state_file(&spec, &state).unwrap();
    let machine = SimulatedBackend::with_state_file(&spec, &state).unwrap();
    let node = MemoryNode::new(start_labels("all-1g.10gb"));
    let before = deploy(&node.view().labels);
    let cfg = MigPartedConfig::default_config().unwrap();
    let mut no_reset = opts(None);
    no_reset.reset_gpus = false;

    let r = reconcile(&node, &gpus, &cfg, &no_reset, &NoProcesses)
        .await
        .unwrap();
    assert_eq!(r, PassResult::State(MigConfigState::Rebooting, None));
    let view = node.view();
    assert_eq!(view.labels[MIG_CONFIG_STATE_LABEL], "rebooting");
    assert_eq!(
        view.labels["nvidia.com/gpu.deploy.device-plugin"], PAUSED_FOR_MIG_CHANGE,
        "clients stay paused across the reboot"
    );
    assert!(view.annotations.contains_key(PAUSE_RECORD_ANNOTATION));
    let mode = gpu_stack_core::backend::GpuBackend::mig_mode(&gpus, 0).unwrap();
    assert!(mode.pending && !mode.current, "{mode:?}");

    // The node reboots (pending MIG modes take effect, instances are gone);
    // the manager starts again and finishes the change.
    machine.reboot().unwrap();
    let r = reconcile(&node, &gpus, &cfg, &no_reset, &NoProcesses)
        .await
        .unwrap();
    assert_eq!(r, PassResult::State(MigConfigState::Success, None));
    let view = node.view();
    assert_eq!(deploy(&view.labels), before, "deploy labels restored");
    assert!(!view.annotations.contains_key(PAUSE_RECORD_ANNOTATION));
    let assert_plan =
        gpu_stack_nvml::migapply::plan_node(&machine, &cfg, "all-1g.10gb", &NoProcesses).unwrap();
    assert!(assert_plan.is_converged());
}

#[tokio::test]
async fn a_layout_short_of_the_instances_pods_use_is_refused_and_nothing_changes() {
    let gpus = SimulatedBackend::new(&SimNodeSpec::uniform("n0", "0x233010DE", 1)).unwrap();
    let cfg = MigPartedConfig::default_config().unwrap();
    let node = MemoryNode::new(start_labels("all-1g.10gb"));
    let r = reconcile(&node, &gpus, &cfg, &opts(None), &NoProcesses)
        .await
        .unwrap();
    assert_eq!(r, PassResult::State(MigConfigState::Success, None));
    // Two pods hold 1g.10gb instances; all-3g.40gb would keep none.
    node.set_mig_in_use(vec![("1g.10gb".parse().unwrap(), 2)]);
    node.set_label(MIG_CONFIG, "all-3g.40gb");
    let r = reconcile(&node, &gpus, &cfg, &opts(None), &NoProcesses)
        .await
        .unwrap();
    let PassResult::State(MigConfigState::Failed, Some(reason)) = r else {
        panic!("{r:?}");
    };
    assert!(
        reason.contains("would leave 0 1g.10gb instance(s) while pods bound to this node use 2"),
        "{reason}"
    );
    let view = node.view();
    assert!(view.annotations[FAILURE_REASON_ANNOTATION].contains("1g.10gb"));
    let layout = gpu_stack_nvml::migapply::observe(&gpus, &NoProcesses).unwrap();
    assert_eq!(layout[0].layout.len(), 7, "the GPU keeps its seven 1g.10gb");
    // A layout keeping enough goes ahead.
    node.set_label(MIG_CONFIG, "all-balanced");
    let r = reconcile(&node, &gpus, &cfg, &opts(None), &NoProcesses)
        .await
        .unwrap();
    assert_eq!(r, PassResult::State(MigConfigState::Success, None));
}
