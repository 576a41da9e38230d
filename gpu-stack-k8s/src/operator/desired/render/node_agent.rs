//! The combined node agent's objects (`nodeAgent.enabled`): one DaemonSet
//! whose one container runs `gpu-node-agent` with each hosted component's
//! command line, in place of one DaemonSet per component.
//!
//! The DaemonSet is built from the components' own DaemonSets, so each
//! component keeps what its pod would have had: its flags, its environment,
//! its mounts, its init gates and its API access. The node contract keeps
//! its meaning through the node affinity: the pod runs where any hosted
//! component's deploy label is `true`, and the agent runs each component
//! exactly while its own label is.
//!
//! With the validator hosted, its check chain is the validator's part of
//! the command line and the agent runs every gate itself, so the pod has no
//! init containers; its readiness probe asks the agent whether every
//! component that should run is up, which includes the validator's checks
//! having passed (what the validator pod's readiness said).
use std::collections::{BTreeMap, BTreeSet};

use gpu_stack_core::nodeagent::{CHECK_READY_FLAG, SEPARATOR, binary_name, gates_in_process};
use gpu_stack_core::operator::components::{Component, Gate};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{
    Affinity, Container, EnvVar, ExecAction, NodeAffinity, NodeSelector, NodeSelectorRequirement,
    NodeSelectorTerm, Probe, ServiceAccount, Volume, VolumeMount,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject};

use super::gates::gate_containers;
use super::rbac::rbac_rules;
use super::{COMPONENT_LABEL, RenderContext, daemonset, merge_env, privileged, section_resources};
use crate::operator::cluster::object::Object;

/// Name of the node agent's DaemonSet, ServiceAccount and ClusterRole (and
/// the `app` label of its pods).
pub const NODE_AGENT_NAME: &str = gpu_stack_core::nodeagent::NODE_AGENT_APP;

/// The agent's binary in its image (the readiness probe runs it).
pub const NODE_AGENT_BIN: &str = "/usr/bin/gpu-node-agent";

/// The value of the component label on the node agent's objects.
pub const NODE_AGENT_COMPONENT: &str = "node-agent";

/// The ServiceAccount, RBAC and DaemonSet of the node agent running
/// `hosted` (components it can host, in its order); nothing when empty.
pub fn node_agent_objects(ctx: &RenderContext, hosted: &[Component]) -> Vec<Object> {
    let parts: Vec<(Component, DaemonSet)> = hosted
        .iter()
        .filter(|c| binary_name(**c).is_some())
        .filter_map(|c| match daemonset(ctx, *c, None) {
            Object::DaemonSet(ds) => Some((*c, ds)),
            _ => None,
        })
        .collect();
    let Some(ds) = combined_daemonset(ctx, &parts) else {
        return Vec::new();
    };
    let meta = |namespaced: bool| {
        let mut m = ctx.meta(NODE_AGENT_NAME, namespaced, None);
        if let Some(l) = m.labels.as_mut() {
            l.insert(COMPONENT_LABEL.into(), NODE_AGENT_COMPONENT.into());
        }
        m
    };
    let rules = merged_rules(
        parts
            .iter()
            .flat_map(|(c, _)| rbac_rules(ctx.spec(), *c))
            .collect(),
    );
    vec![
        Object::ServiceAccount(ServiceAccount {
            metadata: meta(true),
            ..Default::default()
        }),
        Object::ClusterRole(ClusterRole {
            metadata: meta(false),
            rules: Some(rules),
            ..Default::default()
        }),
        Object::ClusterRoleBinding(ClusterRoleBinding {
            metadata: meta(false),
            role_ref: RoleRef {
                api_group: Some("rbac.authorization.k8s.io".into()),
                kind: "ClusterRole".into(),
                name: NODE_AGENT_NAME.into(),
            },
            subjects: Some(vec![Subject {
                kind: "ServiceAccount".into(),
                name: NODE_AGENT_NAME.into(),
                namespace: Some(ctx.namespace.to_string()),
                ..Default::default()
            }]),
        }),
        Object::DaemonSet(ds),
    ]
}

/// Rules with the same API groups and resources merged into one, verbs
/// unioned, in a stable order.
fn merged_rules(rules: Vec<PolicyRule>) -> Vec<PolicyRule> {
    let mut by_target: BTreeMap<(Vec<String>, Vec<String>), BTreeSet<String>> = BTreeMap::new();
    for r in rules {
        let key = (
            r.api_groups.unwrap_or_default(),
            r.resources.unwrap_or_default(),
        );
        by_target.entry(key).or_default().extend(r.verbs);
    }
    by_target
        .into_iter()
        .map(|((groups, resources), verbs)| PolicyRule {
            api_groups: Some(groups),
            resources: Some(resources),
            verbs: verbs.into_iter().collect(),
            ..Default::default()
        })
        .collect()
}

/// The one DaemonSet: the first component's pod settings (tolerations,
/// priority, runtime class and update strategy are the same for all), the
/// union of the components' gates, volumes and mounts, and one container.
fn combined_daemonset(ctx: &RenderContext, parts: &[(Component, DaemonSet)]) -> Option<DaemonSet> {
    let (_, first) = parts.first()?;
    let mut ds = first.clone();
    ds.metadata = ctx.meta(NODE_AGENT_NAME, true, None);
    if let Some(l) = ds.metadata.labels.as_mut() {
        l.insert(COMPONENT_LABEL.into(), NODE_AGENT_COMPONENT.into());
    }
    let spec = &mut ds.spec;
    spec.selector.match_labels = Some([("app".to_string(), NODE_AGENT_NAME.to_string())].into());
    if let Some(labels) = spec
        .template
        .metadata
        .as_mut()
        .and_then(|m| m.labels.as_mut())
    {
        labels.insert("app".into(), NODE_AGENT_NAME.into());
        labels.insert(COMPONENT_LABEL.into(), NODE_AGENT_COMPONENT.into());
    }
    let pod = spec.template.spec.as_mut()?;
    let hosted: Vec<Component> = parts.iter().map(|(c, _)| *c).collect();
    let in_process = gates_in_process(&hosted);
    // Each component's container; the validator's is its check chain (its
    // pod's init container), which is what the agent runs for it before
    // holding, instead of the pod's holding container.
    let mains: Vec<(Component, &Container)> = parts
        .iter()
        .filter_map(|(c, d)| {
            let pod = d.spec.template.spec.as_ref()?;
            let main = if *c == Component::OperatorValidator {
                pod.init_containers.as_ref()?.first()?
            } else {
                pod.containers.first()?
            };
            Some((*c, main))
        })
        .collect();

    // Init gates: every component's, each once, in the contract's order
    // (a driver check before the toolkit wait); none when the agent runs
    // them itself.
    let gates: BTreeSet<Gate> = parts.iter().flat_map(|(c, _)| c.gates()).copied().collect();
    let init = if in_process {
        Vec::new()
    } else {
        gate_containers(ctx, &gates.into_iter().collect::<Vec<_>>())
    };

    // The environment every component has alike is the container's; the
    // rest goes on each component's command line as `NAME=VALUE`, which the
    // agent gives that component alone (so the MIG manager's CONFIG_FILE
    // does not reach the device plugin, which reads a CONFIG_FILE too).
    let envs: Vec<&[EnvVar]> = mains
        .iter()
        .map(|(_, m)| m.env.as_deref().unwrap_or(&[]))
        .collect();
    let shared: Vec<EnvVar> = envs
        .first()
        .map(|e| e.to_vec())
        .unwrap_or_default()
        .into_iter()
        .filter(|v| envs.iter().all(|e| e.contains(v)))
        .collect();
    let mut container_env = shared.clone();
    let mut args: Vec<String> = ctx
        .spec()
        .node_agent
        .as_ref()
        .map(|n| n.args.clone())
        .unwrap_or_default();
    for (c, main) in &mains {
        args.push(SEPARATOR.into());
        args.push(binary_name(*c).unwrap_or_default().into());
        for v in main.env.iter().flatten().filter(|v| !shared.contains(v)) {
            match &v.value {
                Some(value) if v.value_from.is_none() => args.push(format!("{}={value}", v.name)),
                // A variable from the downward API has no value to pass on.
                _ if !container_env.iter().any(|e| e.name == v.name) => {
                    container_env.push(v.clone())
                }
                _ => {}
            }
        }
        // The validator's check chain starts with its subcommand, the
        // segment's name.
        let own = main.args.iter().flatten();
        let skip = usize::from(*c == Component::OperatorValidator);
        args.extend(own.skip(skip).cloned());
        if *c == Component::OperatorValidator
            && let Some(user) = ctx.spec().component(*c)
        {
            args.extend(user.args.iter().cloned());
        }
    }
    if let Some(n) = &ctx.spec().node_agent {
        merge_env(&mut container_env, &n.env);
    }

    // Mounts: each path once, writable if any component writes there, with
    // the strongest propagation any asks for.
    let mut mounts: Vec<VolumeMount> = Vec::new();
    for m in mains
        .iter()
        .flat_map(|(_, c)| c.volume_mounts.iter().flatten())
    {
        match mounts.iter_mut().find(|x| x.mount_path == m.mount_path) {
            Some(x) => {
                if x.read_only == Some(true) && m.read_only != Some(true) {
                    x.read_only = None;
                }
                if propagation_rank(m) > propagation_rank(x) {
                    x.mount_propagation = m.mount_propagation.clone();
                }
            }
            None => mounts.push(m.clone()),
        }
    }
    let mut volumes: Vec<Volume> = Vec::new();
    for v in parts.iter().flat_map(|(_, d)| {
        d.spec
            .template
            .spec
            .as_ref()
            .and_then(|p| p.volumes.as_ref())
            .into_iter()
            .flatten()
    }) {
        if !volumes.iter().any(|x| x.name == v.name) {
            volumes.push(v.clone());
        }
    }
    volumes.retain(|v| {
        init.iter()
            .flat_map(|c| c.volume_mounts.iter().flatten())
            .chain(&mounts)
            .any(|m| m.name == v.name)
    });

    let settings = ctx.spec().node_agent_image_settings();
    let privileged_any = mains.iter().any(|(_, m)| {
        m.security_context
            .as_ref()
            .and_then(|s| s.privileged)
            .unwrap_or(false)
    });
    let host_pid = parts.iter().any(|(_, d)| {
        d.spec
            .template
            .spec
            .as_ref()
            .and_then(|p| p.host_pid)
            .unwrap_or(false)
    });
    pod.service_account_name = Some(NODE_AGENT_NAME.into());
    pod.node_selector = None;
    pod.affinity = Some(Affinity {
        node_affinity: Some(NodeAffinity {
            required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                node_selector_terms: mains
                    .iter()
                    .map(|(c, _)| NodeSelectorTerm {
                        match_expressions: Some(vec![NodeSelectorRequirement {
                            key: c.deploy_label(),
                            operator: "In".into(),
                            values: Some(vec!["true".into()]),
                        }]),
                        ..Default::default()
                    })
                    .collect(),
            }),
            ..Default::default()
        }),
        ..Default::default()
    });
    pod.host_pid = host_pid.then_some(true);
    pod.image_pull_secrets = (!settings.pull_secrets.is_empty()).then(|| {
        settings
            .pull_secrets
            .iter()
            .map(|s| k8s_openapi::api::core::v1::LocalObjectReference { name: s.clone() })
            .collect()
    });
    pod.init_containers = (!init.is_empty()).then_some(init);
    pod.volumes = Some(volumes);
    pod.containers = vec![Container {
        name: NODE_AGENT_COMPONENT.into(),
        image: Some(settings.image),
        image_pull_policy: Some(settings.pull_policy),
        args: Some(args),
        env: Some(container_env),
        resources: section_resources(ctx.spec().node_agent.as_ref()),
        volume_mounts: Some(mounts),
        security_context: if privileged_any { privileged() } else { None },
        readiness_probe: in_process.then(|| Probe {
            exec: Some(ExecAction {
                command: Some(vec![NODE_AGENT_BIN.into(), CHECK_READY_FLAG.into()]),
            }),
            period_seconds: Some(10),
            ..Default::default()
        }),
        ..Default::default()
    }];
    Some(ds)
}

/// Bidirectional above HostToContainer above none: a mount shared by
/// components propagates as the most demanding of them needs.
fn propagation_rank(m: &VolumeMount) -> u8 {
    match m.mount_propagation.as_deref() {
        Some("Bidirectional") => 2,
        Some("HostToContainer") => 1,
        _ => 0,
    }
}
