//! GPU feature discovery: the `nvidia.com/*` node labels NVIDIA's GFD publishes,
//! as a pure function of the node's GPUs and the device-plugin settings.
//!
//! Label values are strings. Memory labels are in MiB. With the `mixed` MIG
//! strategy `gpu.count` keeps counting physical GPUs (NVIDIA's behaviour).

use std::collections::BTreeMap;

use crate::deviceplugin::config::{MigStrategy, Settings, SharingStrategy};
use crate::deviceplugin::inventory::{Gpu, MigDevice, NodeGpus};

/// Label key prefix.
pub const PREFIX: &str = "nvidia.com/";

/// A node's label set, sorted by key.
pub type Labels = BTreeMap<String, String>;

/// Inputs GFD reads besides the GPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GfdContext {
    /// Machine type (DMI product name or cloud instance type).
    pub machine_type: Option<String>,
    /// Unix time of this labelling; `None` leaves out `gfd.timestamp`.
    pub timestamp: Option<u64>,
}

/// Model name as a label value: characters outside `[A-Za-z0-9-_. ]` are
/// dropped and spaces become `-`.
pub fn sanitize_product(name: &str) -> String {
    name.chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Architecture family from the compute capability.
pub fn family(major: u32, minor: u32) -> &'static str {
    match (major, minor) {
        (1, _) => "tesla",
        (2, _) => "fermi",
        (3, _) => "kepler",
        (5, _) => "maxwell",
        (6, _) => "pascal",
        (7, 0..=4) => "volta",
        (7, 5) => "turing",
        (8, 0..=8) => "ampere",
        (8, 9) => "ada-lovelace",
        (9, _) => "hopper",
        (10, _) | (12, _) => "blackwell",
        (13, _) => "rubin",
        _ => "undefined",
    }
}

fn put(labels: &mut Labels, key: &str, value: impl ToString) {
    labels.insert(format!("{PREFIX}{key}"), value.to_string());
}

fn sharing(settings: &Settings, resource: &str) -> (u32, &'static str, bool) {
    match settings.shared_for(resource) {
        Some(s) => (
            s.replicas,
            settings.sharing_strategy.as_str(),
            s.advertised_name == s.name,
        ),
        None => (1, SharingStrategy::None.as_str(), false),
    }
}

fn common_labels(labels: &mut Labels, node: &NodeGpus, settings: &Settings, ctx: &GfdContext) {
    let mut parts = node.driver_version.split('.');
    if let (Some(major), Some(minor)) = (parts.next(), parts.next()) {
        let rev = parts.next().unwrap_or("");
        put(labels, "cuda.driver-version.major", major);
        put(labels, "cuda.driver-version.minor", minor);
        put(labels, "cuda.driver-version.revision", rev);
        put(labels, "cuda.driver-version.full", &node.driver_version);
        put(labels, "cuda.driver.major", major);
        put(labels, "cuda.driver.minor", minor);
        put(labels, "cuda.driver.rev", rev);
    }
    let mut cuda = node.cuda_version.split('.');
    if let (Some(major), Some(minor)) = (cuda.next(), cuda.next()) {
        put(labels, "cuda.runtime-version.major", major);
        put(labels, "cuda.runtime-version.minor", minor);
        put(
            labels,
            "cuda.runtime-version.full",
            format!("{major}.{minor}"),
        );
        put(labels, "cuda.runtime.major", major);
        put(labels, "cuda.runtime.minor", minor);
    }
    put(
        labels,
        "mig.capable",
        node.gpus.iter().any(|g| g.mig_capable),
    );
    put(
        labels,
        "mps.capable",
        settings.sharing_strategy == SharingStrategy::Mps,
    );
    if settings.mig_strategy != MigStrategy::None {
        put(labels, "mig.strategy", settings.mig_strategy);
    }
    if let Some(m) = ctx
        .machine_type
        .as_deref()
        .map(sanitize_product)
        .filter(|m| !m.is_empty())
    {
        put(labels, "gpu.machine", m);
    }
    if let Some(t) = ctx.timestamp {
        put(labels, "gfd.timestamp", t);
    }
}

fn full_gpu_labels(labels: &mut Labels, gpus: &[&Gpu], settings: &Settings, count: usize) {
    let Some(first) = gpus.first() else { return };
    let (replicas, strategy, suffix) = sharing(settings, "nvidia.com/gpu");
    let mut product = sanitize_product(&first.product);
    if suffix {
        product.push_str("-SHARED");
    }
    put(labels, "gpu.product", product);
    put(labels, "gpu.count", count);
    put(labels, "gpu.replicas", replicas);
    put(labels, "gpu.sharing-strategy", strategy);
    put(labels, "gpu.memory", first.memory_mib);
    arch_labels(labels, "gpu", first);
}

fn arch_labels(labels: &mut Labels, res: &str, gpu: &Gpu) {
    let (major, minor) = gpu.compute_capability;
    put(labels, &format!("{res}.family"), family(major, minor));
    put(labels, &format!("{res}.compute.major"), major);
    put(labels, &format!("{res}.compute.minor"), minor);
}

fn mig_labels(
    labels: &mut Labels,
    res: &str,
    resource_name: &str,
    parent: &Gpu,
    m: &MigDevice,
    count: usize,
    settings: &Settings,
) {
    let (replicas, strategy, suffix) = sharing(settings, resource_name);
    let mut product = format!("{}-MIG-{}", sanitize_product(&parent.product), m.profile);
    if suffix {
        product.push_str("-SHARED");
    }
    let a = &m.attributes;
    put(labels, &format!("{res}.product"), product);
    put(labels, &format!("{res}.count"), count);
    put(labels, &format!("{res}.replicas"), replicas);
    put(labels, &format!("{res}.sharing-strategy"), strategy);
    put(labels, &format!("{res}.memory"), m.memory_mib);
    put(labels, &format!("{res}.multiprocessors"), a.multiprocessors);
    put(labels, &format!("{res}.slices.gi"), a.gi_slices);
    put(labels, &format!("{res}.slices.ci"), a.ci_slices);
    put(labels, &format!("{res}.engines.copy"), a.copy_engines);
    put(labels, &format!("{res}.engines.decoder"), a.decoders);
    put(labels, &format!("{res}.engines.encoder"), a.encoders);
    put(labels, &format!("{res}.engines.jpeg"), a.jpeg_engines);
    put(labels, &format!("{res}.engines.ofa"), a.ofa_engines);
}

/// Computes the label set. A node without GPUs gets no labels; an invalid
/// `single` layout gets `gpu.product=<model>-MIG-INVALID` like NVIDIA's GFD.
pub fn labels(node: &NodeGpus, settings: &Settings, ctx: &GfdContext) -> Labels {
    let mut out = Labels::new();
    if node.gpus.is_empty() {
        return out;
    }
    common_labels(&mut out, node, settings, ctx);
    let all: Vec<&Gpu> = node.gpus.iter().collect();
    match settings.mig_strategy {
        MigStrategy::None => full_gpu_labels(&mut out, &all, settings, all.len()),
        MigStrategy::Single => {
            let enabled = all.iter().filter(|g| g.mig_enabled).count();
            if enabled == 0 {
                full_gpu_labels(&mut out, &all, settings, all.len());
                return out;
            }
            let devices: Vec<(&Gpu, &MigDevice)> = all
                .iter()
                .flat_map(|g| g.mig_devices.iter().map(move |m| (*g, m)))
                .collect();
            let uniform = devices.windows(2).all(|w| w[0].1.profile == w[1].1.profile);
            match devices.first() {
                Some((parent, m))
                    if enabled == all.len()
                        && uniform
                        && all.iter().all(|g| !g.mig_devices.is_empty()) =>
                {
                    mig_labels(
                        &mut out,
                        "gpu",
                        "nvidia.com/gpu",
                        parent,
                        m,
                        devices.len(),
                        settings,
                    );
                    arch_labels(&mut out, "gpu", parent);
                }
                _ => {
                    put(
                        &mut out,
                        "gpu.product",
                        format!("{}-MIG-INVALID", sanitize_product(&all[0].product)),
                    );
                    put(&mut out, "gpu.count", 0);
                    put(&mut out, "gpu.replicas", 0);
                }
            }
        }
        MigStrategy::Mixed => {
            // Full-GPU labels describe the node's GPUs (count = physical GPUs).
            full_gpu_labels(&mut out, &all, settings, all.len());
            let mut by_profile: BTreeMap<String, Vec<(&Gpu, &MigDevice)>> = BTreeMap::new();
            for g in all.iter().filter(|g| g.mig_enabled) {
                for m in g.mig_devices.iter().filter(|m| !m.is_compute_sliced()) {
                    by_profile
                        .entry(m.resource_profile())
                        .or_default()
                        .push((g, m));
                }
            }
            for (profile, devs) in by_profile {
                if let Some((parent, m)) = devs.first() {
                    let res = format!("mig-{profile}");
                    mig_labels(
                        &mut out,
                        &res,
                        &format!("nvidia.com/{res}"),
                        parent,
                        m,
                        devs.len(),
                        settings,
                    );
                }
            }
        }
    }
    out
}

/// Renders labels as an NFD feature file (`key=value` lines, sorted).
pub fn feature_file(labels: &Labels) -> String {
    labels.iter().map(|(k, v)| format!("{k}={v}\n")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deviceplugin::config::{ConfigFile, Overrides};
    use crate::deviceplugin::inventory::MigAttributes;

    fn a100(index: u32, mig: bool) -> Gpu {
        Gpu {
            index,
            uuid: format!("GPU-{index}"),
            product: "NVIDIA A100-SXM4-40GB".into(),
            minor: index,
            pci_bus_id: String::new(),
            numa_node: Some(0),
            memory_mib: 40960,
            compute_capability: (8, 0),
            mig_capable: true,
            mig_enabled: mig,
            mig_devices: if mig {
                (0..7)
                    .map(|i| MigDevice {
                        index: i,
                        uuid: format!("MIG-{index}-{i}"),
                        profile: "1g.5gb".into(),
                        gi: 7 + i,
                        ci: 0,
                        memory_mib: 4864,
                        gi_cap_minor: None,
                        ci_cap_minor: None,
                        attributes: MigAttributes {
                            multiprocessors: 14,
                            gi_slices: 1,
                            ci_slices: 1,
                            copy_engines: 1,
                            decoders: 0,
                            encoders: 0,
                            jpeg_engines: 0,
                            ofa_engines: 0,
                        },
                    })
                    .collect()
            } else {
                vec![]
            },
            nvlink_peers: vec![],
        }
    }

    fn dgx(mig: bool) -> NodeGpus {
        NodeGpus {
            driver_version: "550.107.02".into(),
            cuda_version: "12.4".into(),
            gpus: (0..8).map(|i| a100(i, mig)).collect(),
        }
    }

    fn settings(yaml: &str) -> Settings {
        Settings::resolve(
            Some(&ConfigFile::parse("g", yaml).unwrap()),
            &Overrides::default(),
        )
        .unwrap()
    }

    fn golden(expected: &str, got: &Labels) {
        let expected: Labels = serde_json::from_str(expected).unwrap();
        assert_eq!(
            &expected,
            got,
            "got:\n{}",
            serde_json::to_string_pretty(got).unwrap()
        );
    }

    const DRIVER: &str = r#""nvidia.com/cuda.driver-version.full": "550.107.02",
        "nvidia.com/cuda.driver-version.major": "550",
        "nvidia.com/cuda.driver-version.minor": "107",
        "nvidia.com/cuda.driver-version.revision": "02",
        "nvidia.com/cuda.driver.major": "550",
        "nvidia.com/cuda.driver.minor": "107",
        "nvidia.com/cuda.driver.rev": "02",
        "nvidia.com/cuda.runtime-version.full": "12.4",
        "nvidia.com/cuda.runtime-version.major": "12",
        "nvidia.com/cuda.runtime-version.minor": "4",
        "nvidia.com/cuda.runtime.major": "12",
        "nvidia.com/cuda.runtime.minor": "4","#;

    #[test]
    fn golden_dgx_a100_mig_off() {
        let ctx = GfdContext {
            machine_type: Some("DGX A100".into()),
            timestamp: Some(1_724_632_719),
        };
        let got = labels(&dgx(false), &settings("{}"), &ctx);
        golden(
            &format!(
                r#"{{ {DRIVER}
                "nvidia.com/gfd.timestamp": "1724632719",
                "nvidia.com/gpu.compute.major": "8",
                "nvidia.com/gpu.compute.minor": "0",
                "nvidia.com/gpu.count": "8",
                "nvidia.com/gpu.family": "ampere",
                "nvidia.com/gpu.machine": "DGX-A100",
                "nvidia.com/gpu.memory": "40960",
                "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB",
                "nvidia.com/gpu.replicas": "1",
                "nvidia.com/gpu.sharing-strategy": "none",
                "nvidia.com/mig.capable": "true",
                "nvidia.com/mps.capable": "false" }}"#
            ),
            &got,
        );
    }

    #[test]
    fn golden_dgx_a100_all_1g_single() {
        let got = labels(
            &dgx(true),
            &settings("flags: {migStrategy: single}"),
            &GfdContext::default(),
        );
        golden(
            &format!(
                r#"{{ {DRIVER}
                "nvidia.com/gpu.compute.major": "8",
                "nvidia.com/gpu.compute.minor": "0",
                "nvidia.com/gpu.count": "56",
                "nvidia.com/gpu.engines.copy": "1",
                "nvidia.com/gpu.engines.decoder": "0",
                "nvidia.com/gpu.engines.encoder": "0",
                "nvidia.com/gpu.engines.jpeg": "0",
                "nvidia.com/gpu.engines.ofa": "0",
                "nvidia.com/gpu.family": "ampere",
                "nvidia.com/gpu.memory": "4864",
                "nvidia.com/gpu.multiprocessors": "14",
                "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb",
                "nvidia.com/gpu.replicas": "1",
                "nvidia.com/gpu.sharing-strategy": "none",
                "nvidia.com/gpu.slices.ci": "1",
                "nvidia.com/gpu.slices.gi": "1",
                "nvidia.com/mig.capable": "true",
                "nvidia.com/mig.strategy": "single",
                "nvidia.com/mps.capable": "false" }}"#
            ),
            &got,
        );
    }

    #[test]
    fn golden_dgx_a100_all_1g_mixed() {
        let got = labels(
            &dgx(true),
            &settings("flags: {migStrategy: mixed}"),
            &GfdContext::default(),
        );
        golden(
            &format!(
                r#"{{ {DRIVER}
                "nvidia.com/gpu.compute.major": "8",
                "nvidia.com/gpu.compute.minor": "0",
                "nvidia.com/gpu.count": "8",
                "nvidia.com/gpu.family": "ampere",
                "nvidia.com/gpu.memory": "40960",
                "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB",
                "nvidia.com/gpu.replicas": "1",
                "nvidia.com/gpu.sharing-strategy": "none",
                "nvidia.com/mig-1g.5gb.count": "56",
                "nvidia.com/mig-1g.5gb.engines.copy": "1",
                "nvidia.com/mig-1g.5gb.engines.decoder": "0",
                "nvidia.com/mig-1g.5gb.engines.encoder": "0",
                "nvidia.com/mig-1g.5gb.engines.jpeg": "0",
                "nvidia.com/mig-1g.5gb.engines.ofa": "0",
                "nvidia.com/mig-1g.5gb.memory": "4864",
                "nvidia.com/mig-1g.5gb.multiprocessors": "14",
                "nvidia.com/mig-1g.5gb.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb",
                "nvidia.com/mig-1g.5gb.replicas": "1",
                "nvidia.com/mig-1g.5gb.sharing-strategy": "none",
                "nvidia.com/mig-1g.5gb.slices.ci": "1",
                "nvidia.com/mig-1g.5gb.slices.gi": "1",
                "nvidia.com/mig.capable": "true",
                "nvidia.com/mig.strategy": "mixed",
                "nvidia.com/mps.capable": "false" }}"#
            ),
            &got,
        );
    }

    #[test]
    fn golden_hgx_h100() {
        let node = NodeGpus {
            driver_version: "560.35.03".into(),
            cuda_version: "12.6".into(),
            gpus: (0..8)
                .map(|i| Gpu {
                    product: "NVIDIA H100 80GB HBM3".into(),
                    memory_mib: 81559,
                    compute_capability: (9, 0),
                    ..a100(i, false)
                })
                .collect(),
        };
        let got = labels(&node, &settings("{}"), &GfdContext::default());
        golden(
            r#"{ "nvidia.com/cuda.driver-version.full": "560.35.03",
                "nvidia.com/cuda.driver-version.major": "560",
                "nvidia.com/cuda.driver-version.minor": "35",
                "nvidia.com/cuda.driver-version.revision": "03",
                "nvidia.com/cuda.driver.major": "560",
                "nvidia.com/cuda.driver.minor": "35",
                "nvidia.com/cuda.driver.rev": "03",
                "nvidia.com/cuda.runtime-version.full": "12.6",
                "nvidia.com/cuda.runtime-version.major": "12",
                "nvidia.com/cuda.runtime-version.minor": "6",
                "nvidia.com/cuda.runtime.major": "12",
                "nvidia.com/cuda.runtime.minor": "6",
                "nvidia.com/gpu.compute.major": "9",
                "nvidia.com/gpu.compute.minor": "0",
                "nvidia.com/gpu.count": "8",
                "nvidia.com/gpu.family": "hopper",
                "nvidia.com/gpu.memory": "81559",
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                "nvidia.com/gpu.replicas": "1",
                "nvidia.com/gpu.sharing-strategy": "none",
                "nvidia.com/mig.capable": "true",
                "nvidia.com/mps.capable": "false" }"#,
            &got,
        );
    }

    #[test]
    fn golden_time_slicing_t4() {
        let node = NodeGpus {
            driver_version: "550.107.02".into(),
            cuda_version: "12.4".into(),
            gpus: (0..2)
                .map(|i| Gpu {
                    product: "Tesla T4".into(),
                    memory_mib: 15360,
                    compute_capability: (7, 5),
                    mig_capable: false,
                    ..a100(i, false)
                })
                .collect(),
        };
        let got = labels(
            &node,
            &settings("sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 4}]}}"),
            &GfdContext::default(),
        );
        golden(
            &format!(
                r#"{{ {DRIVER}
                "nvidia.com/gpu.compute.major": "7",
                "nvidia.com/gpu.compute.minor": "5",
                "nvidia.com/gpu.count": "2",
                "nvidia.com/gpu.family": "turing",
                "nvidia.com/gpu.memory": "15360",
                "nvidia.com/gpu.product": "Tesla-T4-SHARED",
                "nvidia.com/gpu.replicas": "4",
                "nvidia.com/gpu.sharing-strategy": "time-slicing",
                "nvidia.com/mig.capable": "false",
                "nvidia.com/mps.capable": "false" }}"#
            ),
            &got,
        );
        // renameByDefault: the resource is renamed, so the product has no suffix.
        let got = labels(
            &node,
            &settings(
                "sharing: {timeSlicing: {renameByDefault: true, resources: [{name: nvidia.com/gpu, replicas: 4}]}}",
            ),
            &GfdContext::default(),
        );
        assert_eq!(got["nvidia.com/gpu.product"], "Tesla-T4");
    }

    #[test]
    fn invalid_single_layout_and_empty_node() {
        let mut n = dgx(true);
        n.gpus[0].mig_enabled = false;
        n.gpus[0].mig_devices.clear();
        let got = labels(
            &n,
            &settings("flags: {migStrategy: single}"),
            &GfdContext::default(),
        );
        assert_eq!(
            got["nvidia.com/gpu.product"],
            "NVIDIA-A100-SXM4-40GB-MIG-INVALID"
        );
        assert!(
            labels(
                &NodeGpus::default(),
                &Settings::defaults(),
                &GfdContext::default()
            )
            .is_empty()
        );
    }

    #[test]
    fn families_and_sanitising() {
        assert_eq!(family(7, 0), "volta");
        assert_eq!(family(8, 9), "ada-lovelace");
        assert_eq!(family(10, 0), "blackwell");
        assert_eq!(family(4, 0), "undefined");
        assert_eq!(
            sanitize_product("NVIDIA GeForce RTX 4090 (x)"),
            "NVIDIA-GeForce-RTX-4090-x"
        );
        let mut l = Labels::new();
        l.insert("nvidia.com/a".into(), "1".into());
        assert_eq!(feature_file(&l), "nvidia.com/a=1\n");
    }
}
