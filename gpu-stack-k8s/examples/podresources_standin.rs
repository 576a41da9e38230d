//! A stand-in kubelet pod-resources socket for a simulated node, used by
//! `scripts/bench-exporter.sh`: every GPU (or, on MIG GPUs, every MIG device)
//! of the node is assigned to its own pod.
//!
//! `cargo run -p gpu-stack-k8s --example podresources_standin -- SOCKET FLEET [NODE]`
//! serves until it is killed.
use std::path::PathBuf;

use gpu_stack_core::backend::GpuBackend;
use gpu_stack_k8s::kubelet::podresources::StandinKubelet;
use gpu_stack_k8s::kubelet::podresources::api::{
    ContainerDevices, ContainerResources, ListPodResourcesResponse, PodResources,
};
use gpu_stack_nvml::{SimNodeSpec, SimulatedBackend};

fn pod(name: String, resource: &str, id: String) -> PodResources {
    PodResources {
        name,
        namespace: "bench".into(),
        containers: vec![ContainerResources {
            name: "main".into(),
            devices: vec![ContainerDevices {
                resource_name: resource.into(),
                device_ids: vec![id],
                topology: None,
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(socket), Some(fleet)) = (args.next(), args.next()) else {
        return Err("usage: podresources_standin SOCKET FLEET [NODE]".into());
    };
    let node = args.next();
    let spec = SimNodeSpec::from_fleet_file(&PathBuf::from(fleet), node.as_deref())?;
    let sim = SimulatedBackend::new(&spec)?;
    let mut answer = ListPodResourcesResponse::default();
    for gpu in sim.inventory()?.gpus {
        let gis = if gpu.mig_mode.map(|m| m.current).unwrap_or(false) {
            sim.gpu_instances(gpu.index)?
        } else {
            Vec::new()
        };
        if gis.is_empty() {
            answer.pod_resources.push(pod(
                format!("gpu-{}", gpu.index),
                "nvidia.com/gpu",
                gpu.uuid.clone(),
            ));
        }
        for gi in gis {
            for ci in gi.compute_instances {
                answer.pod_resources.push(pod(
                    format!("mig-{}-{}", gpu.index, gi.id),
                    &format!("nvidia.com/mig-{}", gi.profile_name),
                    ci.uuid,
                ));
            }
        }
    }
    let kubelet = StandinKubelet::start(&PathBuf::from(&socket))?;
    kubelet.set(answer);
    eprintln!("pod-resources stand-in serving on {socket}");
    tokio::signal::ctrl_c().await?;
    kubelet.stop().await;
    Ok(())
}
