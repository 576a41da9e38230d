//! Why an operand is not ready, when its pods say so: an image that cannot be
//! pulled leaves a DaemonSet unready with nothing in its status, so while the
//! policy is not ready the pass reads the operand pods still Pending and
//! names such images in an Event (what, on which node, what the kubelet said).
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

/// Kubelet reasons of a container waiting for an image it cannot get.
const IMAGE_REASONS: [&str; 4] = [
    "ErrImagePull",
    "ImagePullBackOff",
    "ErrImageNeverPull",
    "InvalidImageName",
];
/// Longest kubelet message repeated in an Event.
const MESSAGE_CAP: usize = 300;
/// At most this many problems are reported per pass.
pub const MAX_PROBLEMS: usize = 10;
/// Selects the operand pods (`desired::render` labels every one).
pub const OPERAND_SELECTOR: &str = "app.kubernetes.io/part-of=gpu-stack";

/// An operand container that cannot get its image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageProblem {
    /// The pod.
    pub pod: String,
    /// Its node, if scheduled.
    pub node: Option<String>,
    /// The container (init or main).
    pub container: String,
    /// The image it asks for.
    pub image: String,
    /// The kubelet's reason.
    pub reason: String,
    /// The kubelet's message, capped.
    pub message: String,
}

impl ImageProblem {
    /// The Event text: what, where, how to fix.
    pub fn note(&self) -> String {
        format!(
            "image {} of {}/{} cannot be pulled{} ({}: {}); push the image there or set the \
             ClusterPolicy's repository/image/version (chart: imageRepository) to one the node can pull",
            self.image,
            self.pod,
            self.container,
            self.node
                .as_deref()
                .map(|n| format!(" on node {n}"))
                .unwrap_or_default(),
            self.reason,
            self.message
        )
    }
}

fn cap(text: &str) -> String {
    match text.char_indices().nth(MESSAGE_CAP) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_string(),
    }
}

/// The image problems of `pods`, at most [`MAX_PROBLEMS`], one per image.
pub fn image_problems(pods: &[Pod]) -> Vec<ImageProblem> {
    let mut out: Vec<ImageProblem> = Vec::new();
    for pod in pods {
        let Some(status) = &pod.status else { continue };
        let statuses = status
            .init_container_statuses
            .iter()
            .flatten()
            .chain(status.container_statuses.iter().flatten());
        for c in statuses {
            let Some(waiting) = c.state.as_ref().and_then(|s| s.waiting.as_ref()) else {
                continue;
            };
            let reason = waiting.reason.clone().unwrap_or_default();
            if !IMAGE_REASONS.contains(&reason.as_str()) || out.iter().any(|p| p.image == c.image) {
                continue;
            }
            out.push(ImageProblem {
                pod: pod.name_any(),
                node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
                container: c.name.clone(),
                image: c.image.clone(),
                reason,
                message: cap(waiting.message.as_deref().unwrap_or("")),
            });
            if out.len() == MAX_PROBLEMS {
                return out;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, image: &str, reason: &str, message: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "spec": {"nodeName": "gpu-1", "containers": [{"name": "main", "image": image}]},
            "status": {"containerStatuses": [{
                "name": "main", "image": image, "imageID": "", "ready": false,
                "restartCount": 0,
                "state": {"waiting": {"reason": reason, "message": message}},
            }]},
        }))
        .unwrap()
    }

    #[test]
    fn pull_failures_are_named_once_per_image() {
        let pods = [
            pod("dp-a", "r/x:1", "ErrImagePull", "not found"),
            pod("dp-b", "r/x:1", "ImagePullBackOff", "back-off"),
            pod("gfd-a", "r/y:1", "ContainerCreating", ""),
        ];
        let problems = image_problems(&pods);
        assert_eq!(problems.len(), 1);
        let note = problems[0].note();
        assert!(
            note.contains("image r/x:1 of dp-a/main cannot be pulled on node gpu-1"),
            "{note}"
        );
        assert!(note.contains("ErrImagePull: not found"), "{note}");
    }

    #[test]
    fn long_messages_are_capped_and_the_list_bounded() {
        let long = "x".repeat(10_000);
        let pods: Vec<Pod> = (0..50)
            .map(|i| pod(&format!("p{i}"), &format!("r/{i}:1"), "ErrImagePull", &long))
            .collect();
        let problems = image_problems(&pods);
        assert_eq!(problems.len(), MAX_PROBLEMS);
        assert!(
            problems
                .iter()
                .all(|p| p.message.chars().count() <= MESSAGE_CAP + 1)
        );
    }
}
