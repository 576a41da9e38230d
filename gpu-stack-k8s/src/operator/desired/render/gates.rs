//! The init containers that gate a component's start (NVIDIA's
//! `*-validation` init containers): the validator's checks, and waits for
//! the status files other components' checks write.
use gpu_stack_core::operator::components::{Component, Gate, VALIDATIONS_DIR};
use k8s_openapi::api::core::v1::Container;

use super::{
    DRIVER_ROOT_VOLUME, HOST_DEV_CHAR_DIR, HOST_DEV_CHAR_VOLUME, HOST_ROOT_VOLUME,
    PREINSTALLED_TOOLKIT_TRACES, RenderContext, VALIDATIONS_VOLUME, component_env, mount,
    node_name_env, privileged, toolkit_socket, with_user_env,
};

/// The init containers of a component's gates, in order. Consecutive
/// checks run as one container (`gpu-stack validator --component
/// driver,toolkit,...` runs them in that order, writing each status file as
/// its check passes), so the validator pod has one init container where
/// NVIDIA's has four: the node contract (status files and their order) is the
/// same, and each container costs the control plane about 1.5 KB per pod.
pub(super) fn gate_containers(ctx: &RenderContext, gates: &[Gate]) -> Vec<Container> {
    let mut out = Vec::new();
    let mut checks: Vec<Gate> = Vec::new();
    for gate in gates {
        if gate.validator_component().is_some() {
            checks.push(*gate);
            continue;
        }
        if !checks.is_empty() {
            out.push(check_container(ctx, &std::mem::take(&mut checks)));
        }
        out.push(wait_container(ctx, *gate));
    }
    if !checks.is_empty() {
        out.push(check_container(ctx, &checks));
    }
    out
}

/// One init container running the validator's checks of `gates` in order:
/// named `<gate>-validation` for one check, `<a>-<b>-...-validation` for several.
fn check_container(ctx: &RenderContext, gates: &[Gate]) -> Container {
    let validator = ctx.spec().image_settings(Component::OperatorValidator);
    let components: Vec<&str> = gates
        .iter()
        .filter_map(|g| g.validator_component())
        .collect();
    let has = |gate: Gate| gates.contains(&gate);
    let mut mounts = vec![mount(
        VALIDATIONS_VOLUME,
        VALIDATIONS_DIR,
        false,
        Some("Bidirectional"),
    )];
    if has(Gate::DriverValidation) {
        mounts.push(mount(
            DRIVER_ROOT_VOLUME,
            "/run/nvidia/driver",
            false,
            Some("HostToContainer"),
        ));
    }
    // NVIDIA's driver validation links the device nodes into the host's
    // /dev/char, unless `validator.driver.env` switches it off.
    let dev_char = has(Gate::DriverValidation) && ctx.spec().dev_char_links_wanted();
    if dev_char {
        mounts.push(mount(HOST_DEV_CHAR_VOLUME, HOST_DEV_CHAR_DIR, false, None));
    }
    // The image's entrypoint is `gpu-stack`; the checks are its `validator`
    // subcommand, told what to check by flags rather than NVIDIA's COMPONENT
    // and WITH_WAIT variables (a flag is a few bytes of one `args` field).
    let mut args: Vec<String> = vec![
        "validator".into(),
        "--component".into(),
        components.join(","),
        "--wait".into(),
    ];
    if dev_char {
        args.extend(["--dev-char-dir".into(), HOST_DEV_CHAR_DIR.into()]);
    }
    let toolkit = has(Gate::ToolkitValidation);
    if toolkit && ctx.spec().enablement().toolkit && ctx.spec().toolkit_is_gpu_stack() {
        // gpu-stack's agent: check the CDI spec it wrote and the runtime's
        // effective configuration, through the host root.
        args.extend([
            "--host-root".into(),
            "/host".into(),
            "--toolkit-cri-socket".into(),
            toolkit_socket(ctx.spec()),
            "--toolkit-cdi-spec".into(),
            format!("/var/run/cdi/{}", crate::deviceplugin::cdi::SPEC_FILE),
            "--toolkit-runtime-class".into(),
            ctx.spec().runtime_class(),
        ]);
    }
    if toolkit && !ctx.spec().enablement().toolkit {
        // No toolkit DaemonSet: the toolkit is pre-installed, or the runtime
        // injects devices through CDI by itself (containerd 1.7+, CRI-O).
        // Either leaves a trace on the host, seen through the host root.
        for trace in PREINSTALLED_TOOLKIT_TRACES {
            args.push("--toolkit-evidence".into());
            args.push(format!("/host{trace}"));
        }
    }
    if has(Gate::PluginValidation) && plugin_workload_runs(ctx) {
        args.extend([
            "--plugin-workload-image".into(),
            validator.image.clone(),
            "--plugin-workload-namespace".into(),
            ctx.namespace.to_string(),
        ]);
        for secret in &validator.pull_secrets {
            args.extend(["--plugin-workload-pull-secret".into(), secret.clone()]);
        }
    }
    let toolkit_on_host =
        toolkit && (!ctx.spec().enablement().toolkit || ctx.spec().toolkit_is_gpu_stack());
    if has(Gate::DriverValidation) || toolkit_on_host {
        mounts.push(mount(
            HOST_ROOT_VOLUME,
            "/host",
            true,
            Some("HostToContainer"),
        ));
    }
    let mut vars = vec![node_name_env()];
    // `validator.env` reaches every check, as NVIDIA's does (the checks read
    // the GPUs, so the backend settings live there).
    with_user_env(&mut vars, ctx.spec(), Component::OperatorValidator);
    Container {
        name: format!("{}-validation", components.join("-")),
        image: Some(validator.image),
        image_pull_policy: Some(validator.pull_policy),
        args: Some(args),
        env: Some(vars),
        volume_mounts: Some(mounts),
        security_context: privileged(),
        ..Default::default()
    }
}

/// Whether the plugin check runs its workload pod: unless the policy says
/// `WITH_WORKLOAD=false` (NVIDIA's `validator.plugin.env`), and where the
/// device plugin names its devices through CDI, the path by which a pod
/// without a RuntimeClass gets them. With `envvar` or `volume-mounts` only
/// a runtime shim injects devices, for pods that ask for its RuntimeClass.
fn plugin_workload_runs(ctx: &RenderContext) -> bool {
    let plugin_env = component_env(ctx, Component::DevicePlugin, None);
    let cdi_strategy = plugin_env
        .iter()
        .find(|e| e.name == "DEVICE_LIST_STRATEGY")
        .and_then(|e| e.value.as_deref())
        .is_some_and(|v| v.split(',').any(|s| s.trim().starts_with("cdi-")));
    cdi_strategy && ctx.spec().plugin_workload_wanted()
}

/// A wait-only gate: it reads the status files the privileged validator
/// writes. An unprivileged container may not use Bidirectional propagation,
/// so it sees the host directory read-only with HostToContainer propagation
/// (as NVIDIA's toolkit-validation does). The image has no shell: the wait
/// is the validator's own `--wait-only` mode, which needs no GPU, API access
/// or privileges.
fn wait_container(ctx: &RenderContext, gate: Gate) -> Container {
    let validator = ctx.spec().image_settings(Component::OperatorValidator);
    Container {
        name: gate.container_name().into(),
        image: Some(validator.image),
        image_pull_policy: Some(validator.pull_policy),
        args: Some(wait_only_args(gate.status_component(), "never")),
        volume_mounts: Some(vec![mount(
            VALIDATIONS_VOLUME,
            VALIDATIONS_DIR,
            true,
            Some("HostToContainer"),
        )]),
        ..Default::default()
    }
}

/// Arguments of `gpu-stack validator --wait-only` for the status files of
/// `component` (a validator `--component` value), polling every 5 s like
/// NVIDIA's `until [ -f ... ]; do sleep 5; done`.
pub(super) fn wait_only_args(component: &str, timeout: &str) -> Vec<String> {
    [
        "validator",
        "--wait-only",
        "--component",
        component,
        "--timeout",
        timeout,
        "--poll-interval-ms",
        "5000",
    ]
    .map(String::from)
    .to_vec()
}
