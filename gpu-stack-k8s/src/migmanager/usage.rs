//! The MIG usage this node's manager publishes for demand-driven MIG: each
//! GPU's layout and which instances are in use, in the node annotation
//! [`MIG_USAGE_ANNOTATION`] (format and bounds in
//! [`gpu_stack_core::operator::migusage`]).
//!
//! In use means: a process runs on the instance (what the driver reports),
//! or, per profile, as many instances as the live pods bound to this node
//! request (`spec.nodeName=<node>`, the manager's own field-selected watch).
use gpu_stack_core::catalog;
use gpu_stack_core::mig::Demand;
use gpu_stack_core::operator::migdemand::demand_from_requests;
use gpu_stack_core::operator::migusage::{GpuUsage, NodeUsage, mark_in_use};
use gpu_stack_nvml::migapply::GpuSnapshot;
use k8s_openapi::api::core::v1::Pod;

pub use gpu_stack_core::operator::migusage::MIG_USAGE_ANNOTATION;

use super::kube_node::pod_is_live;
use crate::operator::migconfig::demand::pod_mig_requests;

/// MIG instances the live pods of the node request, per profile.
pub fn requested_on_node<'a>(pods: impl IntoIterator<Item = &'a Pod>) -> Demand {
    let requests: Vec<(String, u32)> = pods
        .into_iter()
        .filter(|p| pod_is_live(p))
        .flat_map(pod_mig_requests)
        .collect();
    demand_from_requests(requests.iter().map(|(r, n)| (r.as_str(), *n)))
}

/// The usage of the node's MIG-capable GPUs of catalog models: layouts as
/// read, instances with processes in use, then as many more per profile as
/// `requested` asks ([`mark_in_use`]).
pub fn usage_of(snapshots: &[GpuSnapshot], requested: &Demand) -> NodeUsage {
    let gpus = snapshots
        .iter()
        .filter(|s| s.mig.is_some())
        .filter_map(|s| {
            let model = catalog::by_pci_device_id(s.info.pci_device_id)?;
            let busy_starts: Vec<u32> = s
                .observed
                .gis
                .iter()
                .filter(|gi| gi.cis.iter().any(|ci| !ci.processes.is_empty()))
                .map(|gi| gi.start)
                .collect();
            Some(GpuUsage {
                index: s.info.index,
                model: model.name.clone(),
                mig_enabled: s.observed.mode.current,
                layout: s.layout.clone(),
                in_use: s
                    .layout
                    .iter()
                    .filter(|i| busy_starts.contains(&i.start))
                    .cloned()
                    .collect(),
            })
        })
        .collect();
    let mut usage = NodeUsage { gpus };
    mark_in_use(&mut usage, requested);
    usage
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_pods_count_and_finished_ones_do_not() {
        let pod = |phase: &str, n: &str| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p"},
                "spec": {"containers": [{"name": "a", "resources": {"limits": {"nvidia.com/mig-1g.10gb": n}}}]},
                "status": {"phase": phase},
            }))
            .unwrap()
        };
        let pods = [
            pod("Running", "2"),
            pod("Pending", "1"),
            pod("Succeeded", "4"),
        ];
        assert_eq!(
            requested_on_node(&pods),
            vec![("1g.10gb".parse().unwrap(), 3)]
        );
    }
}
