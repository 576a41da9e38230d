//! The API access of each component: its ServiceAccount, and the
//! ClusterRole and binding of the rules its process needs.
use gpu_stack_core::operator::components::Component;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject};

use super::RenderContext;
use crate::operator::cluster::object::Object;
use crate::operator::clusterpolicy::ClusterPolicySpec;

/// Service account name of a component.
pub fn service_account_name(c: Component) -> String {
    match c {
        Component::Driver => "nvidia-driver".into(),
        Component::ContainerToolkit => "nvidia-container-toolkit".into(),
        Component::OperatorValidator => "nvidia-operator-validator".into(),
        Component::DevicePlugin => "nvidia-device-plugin".into(),
        Component::GpuFeatureDiscovery => "nvidia-gpu-feature-discovery".into(),
        Component::DcgmExporter => "nvidia-dcgm-exporter".into(),
        Component::MigManager => "nvidia-mig-manager".into(),
        Component::NodeStatusExporter => "nvidia-node-status-exporter".into(),
        Component::DraPlugin => "nvidia-dra-driver-gpu-kubelet-plugin".into(),
    }
}

/// A service account.
pub fn service_account(ctx: &RenderContext, c: Component) -> Object {
    Object::ServiceAccount(ServiceAccount {
        metadata: ctx.meta(&service_account_name(c), true, Some(c)),
        ..Default::default()
    })
}

fn rule(groups: &[&str], resources: &[&str], verbs: &[&str]) -> PolicyRule {
    let v = |xs: &[&str]| xs.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    PolicyRule {
        api_groups: Some(v(groups)),
        resources: Some(v(resources)),
        verbs: v(verbs),
        ..Default::default()
    }
}

/// The API access a component needs (empty for components that need none).
pub fn rbac_rules(spec: &ClusterPolicySpec, c: Component) -> Vec<PolicyRule> {
    match c {
        Component::Driver => vec![
            rule(
                &[""],
                &["nodes"],
                &["get", "list", "watch", "patch", "update"],
            ),
            rule(&[""], &["pods"], &["get", "list", "watch", "delete"]),
            rule(&[""], &["pods/eviction"], &["create"]),
            rule(&["apps"], &["daemonsets"], &["get", "list", "watch"]),
        ],
        Component::OperatorValidator => vec![
            rule(&[""], &["nodes"], &["get", "list", "watch"]),
            // On a DRA node the plugin check counts the published devices.
            rule(&["resource.k8s.io"], &["resourceslices"], &["list"]),
            rule(
                &[""],
                &["pods"],
                &["get", "list", "watch", "create", "delete"],
            ),
        ],
        Component::DevicePlugin | Component::DcgmExporter => {
            vec![rule(&[""], &["nodes"], &["get", "list", "watch"])]
        }
        Component::GpuFeatureDiscovery => {
            vec![rule(
                &[""],
                &["nodes"],
                &["get", "list", "watch", "patch", "update"],
            )]
        }
        Component::MigManager => vec![
            rule(
                &[""],
                &["nodes"],
                &["get", "list", "watch", "patch", "update"],
            ),
            rule(&[""], &["pods"], &["get", "list", "watch", "delete"]),
            // Outcome Events regarding its Node (recorded in "default").
            rule(&["events.k8s.io"], &["events"], &["create", "patch"]),
        ],
        // The plugin reads its Node (the MIG manager's ownership labels),
        // publishes its ResourceSlices by server-side apply (listed by field
        // selector, stale ones deleted), and reads the claims it prepares.
        Component::DraPlugin => vec![
            rule(&[""], &["nodes"], &["get"]),
            rule(
                &["resource.k8s.io"],
                &["resourceslices"],
                &[
                    "get", "list", "watch", "create", "update", "patch", "delete",
                ],
            ),
            rule(
                &["resource.k8s.io"],
                &["resourceclaims"],
                &["get", "list", "watch"],
            ),
        ],
        // gpu-stack's agent watches its Node and its DaemonSet to tell a
        // removal from a restart at SIGTERM (NVIDIA's needs none).
        Component::ContainerToolkit if spec.toolkit_is_gpu_stack() => vec![
            rule(&[""], &["nodes"], &["get", "list", "watch"]),
            rule(&[""], &["pods"], &["get"]),
            rule(&["apps"], &["daemonsets"], &["get", "list", "watch"]),
        ],
        Component::ContainerToolkit | Component::NodeStatusExporter => Vec::new(),
    }
}

/// ClusterRole and binding of a component, if it needs API access.
pub fn rbac(ctx: &RenderContext, c: Component) -> Vec<Object> {
    let rules = rbac_rules(ctx.spec(), c);
    if rules.is_empty() {
        return Vec::new();
    }
    let name = service_account_name(c);
    vec![
        Object::ClusterRole(ClusterRole {
            metadata: ctx.meta(&name, false, Some(c)),
            rules: Some(rules),
            ..Default::default()
        }),
        Object::ClusterRoleBinding(ClusterRoleBinding {
            metadata: ctx.meta(&name, false, Some(c)),
            role_ref: RoleRef {
                api_group: Some("rbac.authorization.k8s.io".into()),
                kind: "ClusterRole".into(),
                name: name.clone(),
            },
            subjects: Some(vec![Subject {
                kind: "ServiceAccount".into(),
                name,
                namespace: Some(ctx.namespace.to_string()),
                ..Default::default()
            }]),
        }),
    ]
}
