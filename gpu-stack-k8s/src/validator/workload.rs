//! The plugin check's workload pod: a pod on this node that asks for one GPU
//! through the real allocation path (scheduler, kubelet, device plugin,
//! runtime) with no RuntimeClass, and checks its own `/dev`
//! (`gpu-stack validator --workload-devices`). Allocatable above zero says
//! the plugin registered; only this says a pod gets its device.
//!
//! The pod is bound to the node by `nodeName`, so the scheduler does not
//! gate it; it is deleted before a new one is made and after it finished.
//! Its verdict travels in its termination message, so the validator needs
//! no access to pod logs.
use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    Capabilities, Container, LocalObjectReference, Pod, PodSecurityContext, PodSpec,
    ResourceRequirements, SeccompProfile, SecurityContext, Toleration,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};

/// Where and with what the workload pod runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginWorkload {
    /// The validator's own image (its entrypoint is `gpu-stack`).
    pub image: String,
    /// Namespace of the pod (the validator's).
    pub namespace: String,
    /// Pull secrets of the validator's image.
    pub pull_secrets: Vec<String>,
    /// How long the pod may take from creation to its verdict.
    pub timeout: Duration,
}

/// Why the workload pod gave no verdict.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// An API call failed.
    #[error(
        "plugin not ready: {what} for the workload pod {pod}: {source}; check the validator's RBAC (create, get and delete pods in its namespace)"
    )]
    Api {
        /// The call.
        what: &'static str,
        /// The pod.
        pod: String,
        /// The cause.
        source: kube::Error,
    },
    /// The pod failed: its own message, or the kubelet's reason.
    #[error("{0}")]
    Failed(String),
    /// The pod gave no verdict in time.
    #[error(
        "plugin not ready: the workload pod {pod} asking for one {resource} gave no verdict within {secs}s (last seen: {last}); check that the node has a free {resource} and that the device plugin answers the kubelet's Allocate"
    )]
    Timeout {
        /// The pod.
        pod: String,
        /// What it asked for.
        resource: String,
        /// The bound.
        secs: u64,
        /// The pod's last state, as its status says it.
        last: String,
    },
}

/// At most this many bytes of a pod's message are echoed.
const MAX_ECHO: usize = 1024;

/// The workload pod's name on `node` (a pod name is a DNS subdomain, as a
/// node name is, up to 253 characters).
pub fn pod_name(node: &str) -> String {
    let mut name = format!("gpu-plugin-validation-{node}");
    name.truncate(253);
    name.trim_end_matches(['-', '.']).to_string()
}

/// The pod asking for one `resource` on `node`, running the device check.
pub fn workload_pod(node: &str, resource: &str, workload: &PluginWorkload) -> Pod {
    let limits = BTreeMap::from([(resource.to_string(), Quantity("1".into()))]);
    Pod {
        metadata: ObjectMeta {
            name: Some(pod_name(node)),
            namespace: Some(workload.namespace.clone()),
            labels: Some(BTreeMap::from([
                (
                    "app.kubernetes.io/component".to_string(),
                    "plugin-validation".to_string(),
                ),
                (
                    "app.kubernetes.io/managed-by".to_string(),
                    "gpu-stack".to_string(),
                ),
            ])),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.to_string()),
            restart_policy: Some("Never".into()),
            termination_grace_period_seconds: Some(0),
            automount_service_account_token: Some(false),
            // The node's GPU taints, whatever they are: the pod is bound
            // to this node on purpose.
            tolerations: Some(vec![Toleration {
                operator: Some("Exists".into()),
                ..Toleration::default()
            }]),
            image_pull_secrets: (!workload.pull_secrets.is_empty()).then(|| {
                workload
                    .pull_secrets
                    .iter()
                    .map(|name| LocalObjectReference { name: name.clone() })
                    .collect()
            }),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(65532),
                run_as_group: Some(65532),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".into(),
                    ..SeccompProfile::default()
                }),
                ..PodSecurityContext::default()
            }),
            containers: vec![Container {
                name: "plugin-validation".into(),
                image: Some(workload.image.clone()),
                args: Some(vec!["validator".into(), "--workload-devices".into()]),
                resources: Some(ResourceRequirements {
                    limits: Some(limits),
                    ..ResourceRequirements::default()
                }),
                termination_message_policy: Some("FallbackToLogsOnError".into()),
                security_context: Some(SecurityContext {
                    allow_privilege_escalation: Some(false),
                    read_only_root_filesystem: Some(true),
                    capabilities: Some(Capabilities {
                        drop: Some(vec!["ALL".into()]),
                        ..Capabilities::default()
                    }),
                    ..SecurityContext::default()
                }),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

/// What a pod's status says so far: `Some(Ok(message))` once it succeeded,
/// `Some(Err(why))` once it failed, `None` while it runs or waits.
pub fn verdict(pod: &Pod) -> Option<Result<String, String>> {
    let status = pod.status.as_ref()?;
    let terminated_message = || {
        status
            .container_statuses
            .iter()
            .flatten()
            .find_map(|c| c.state.as_ref()?.terminated.as_ref()?.message.clone())
            .unwrap_or_default()
    };
    match status.phase.as_deref() {
        Some("Succeeded") => Some(Ok(capped(terminated_message().trim()))),
        Some("Failed") => {
            let own = terminated_message();
            // Refused by the kubelet (no free device): the reason is on the pod.
            let why = if own.trim().is_empty() {
                format!(
                    "plugin not ready: the kubelet refused the workload pod: {} {}",
                    status.reason.as_deref().unwrap_or("Failed"),
                    status.message.as_deref().unwrap_or_default()
                )
            } else {
                own
            };
            Some(Err(capped(why.trim())))
        }
        _ => None,
    }
}

/// A pod's state while it has no verdict: a container's waiting reason, or
/// the phase.
fn last_seen(pod: &Pod) -> String {
    let Some(status) = pod.status.as_ref() else {
        return "no status yet".into();
    };
    let waiting = status.container_statuses.iter().flatten().find_map(|c| {
        let w = c.state.as_ref()?.waiting.as_ref()?;
        Some(format!(
            "{}: {}",
            w.reason.as_deref().unwrap_or("waiting"),
            w.message.as_deref().unwrap_or_default()
        ))
    });
    capped(&waiting.unwrap_or_else(|| status.phase.clone().unwrap_or_else(|| "Pending".into())))
}

fn capped(text: &str) -> String {
    if text.len() <= MAX_ECHO {
        return text.to_string();
    }
    let mut end = MAX_ECHO;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// Deletes the pod `name` if it exists and waits until it is gone, for at
/// most `within`.
async fn delete_and_wait(
    pods: &Api<Pod>,
    name: &str,
    within: Duration,
) -> Result<(), WorkloadError> {
    let api = |what| {
        let pod = name.to_string();
        move |source| WorkloadError::Api { what, pod, source }
    };
    let params = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::background()
    };
    match pods.delete(name, &params).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(()),
        Err(e) => return Err(api("deleting")(e)),
    }
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        if pods.get_opt(name).await.map_err(api("reading"))?.is_none() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(WorkloadError::Timeout {
        pod: name.to_string(),
        resource: "device".into(),
        secs: within.as_secs(),
        last: "an earlier workload pod of this node is still being deleted".into(),
    })
}

/// Runs the workload pod on `node` asking for one `resource`; returns what
/// it reported (the device it saw). The pod is gone when this returns,
/// whatever the outcome (but for a failed deletion, which the next run
/// retries).
pub async fn run(
    client: &kube::Client,
    node: &str,
    resource: &str,
    workload: &PluginWorkload,
) -> Result<String, WorkloadError> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &workload.namespace);
    let name = pod_name(node);
    delete_and_wait(&pods, &name, workload.timeout).await?;
    let pod = workload_pod(node, resource, workload);
    pods.create(&PostParams::default(), &pod)
        .await
        .map_err(|source| WorkloadError::Api {
            what: "creating",
            pod: name.clone(),
            source,
        })?;
    let deadline = tokio::time::Instant::now() + workload.timeout;
    let mut last = "created".to_string();
    let outcome = loop {
        if tokio::time::Instant::now() >= deadline {
            break Err(WorkloadError::Timeout {
                pod: name.clone(),
                resource: resource.to_string(),
                secs: workload.timeout.as_secs(),
                last,
            });
        }
        match pods.get_opt(&name).await {
            Ok(Some(pod)) => match verdict(&pod) {
                Some(Ok(message)) => break Ok(message),
                Some(Err(why)) => break Err(WorkloadError::Failed(why)),
                None => last = last_seen(&pod),
            },
            // Deleted under us (an operator's cleanup): no verdict.
            Ok(None) => last = "deleted before it finished".into(),
            // A passing API error: the deadline decides.
            Err(e) => last = capped(&format!("reading it failed: {e}")),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    if let Err(e) = delete_and_wait(&pods, &name, workload.timeout).await {
        tracing::warn!(pod = %name, "the workload pod stays: {e}");
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        ContainerState, ContainerStateTerminated, ContainerStateWaiting, ContainerStatus, PodStatus,
    };

    fn workload() -> PluginWorkload {
        PluginWorkload {
            image: "localhost/gpu-stack:0.1.0".into(),
            namespace: "gpu-operator".into(),
            pull_secrets: vec!["regcred".into()],
            timeout: Duration::from_secs(120),
        }
    }

    #[test]
    fn the_pod_asks_for_one_device_on_its_node_without_a_runtime_class() {
        let pod = workload_pod("gpu-node-1", "nvidia.com/mig-1g.10gb", &workload());
        let spec = pod.spec.unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("gpu-node-1"));
        assert_eq!(spec.runtime_class_name, None);
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        let c = &spec.containers[0];
        assert_eq!(
            c.args.as_deref(),
            Some(&["validator".to_string(), "--workload-devices".to_string()][..])
        );
        let limits = c.resources.as_ref().unwrap().limits.as_ref().unwrap();
        assert_eq!(
            limits.get("nvidia.com/mig-1g.10gb"),
            Some(&Quantity("1".into()))
        );
        assert_eq!(limits.len(), 1);
        assert_eq!(spec.image_pull_secrets.unwrap()[0].name, "regcred");
        assert_eq!(pod.metadata.namespace.as_deref(), Some("gpu-operator"));
    }

    #[test]
    fn pod_names_stay_valid_for_any_node_name() {
        assert_eq!(pod_name("n1"), "gpu-plugin-validation-n1");
        let long = format!("{}.b", "a".repeat(240));
        let name = pod_name(&long);
        assert!(name.len() <= 253);
        assert!(!name.ends_with('-') && !name.ends_with('.'));
    }

    fn pod_with(phase: &str, terminated: Option<&str>, waiting: Option<&str>) -> Pod {
        Pod {
            status: Some(PodStatus {
                phase: Some(phase.into()),
                reason: Some("UnexpectedAdmissionError".into()),
                message: Some("Allocate failed due to no healthy devices present".into()),
                container_statuses: Some(vec![ContainerStatus {
                    state: Some(ContainerState {
                        terminated: terminated.map(|m| ContainerStateTerminated {
                            message: Some(m.into()),
                            ..ContainerStateTerminated::default()
                        }),
                        waiting: waiting.map(|r| ContainerStateWaiting {
                            reason: Some(r.into()),
                            ..ContainerStateWaiting::default()
                        }),
                        ..ContainerState::default()
                    }),
                    ..ContainerStatus::default()
                }]),
                ..PodStatus::default()
            }),
            ..Pod::default()
        }
    }

    #[test]
    fn the_verdict_is_the_pods_own_message_or_the_kubelets_reason() {
        assert_eq!(
            verdict(&pod_with("Succeeded", Some("devices: nvidia1\n"), None)),
            Some(Ok("devices: nvidia1".into()))
        );
        assert_eq!(
            verdict(&pod_with("Failed", Some("plugin not ready: 0 GPU"), None)),
            Some(Err("plugin not ready: 0 GPU".into()))
        );
        let refused = verdict(&pod_with("Failed", None, None))
            .unwrap()
            .unwrap_err();
        assert!(refused.contains("UnexpectedAdmissionError"), "{refused}");
        assert_eq!(
            verdict(&pod_with("Pending", None, Some("ErrImagePull"))),
            None
        );
        assert!(
            last_seen(&pod_with("Pending", None, Some("ErrImagePull"))).starts_with("ErrImagePull")
        );
        // A huge message is capped.
        let big = "x".repeat(10 * MAX_ECHO);
        let v = verdict(&pod_with("Failed", Some(&big), None))
            .unwrap()
            .unwrap_err();
        assert!(v.len() <= MAX_ECHO + 4);
    }
}
