//! Compiles the kubelet protocol definitions (device plugin v1beta1, pod-resources v1,
//! the CRI runtime service's Status, DRA kubelet plugin v1 and plugin
//! registration v1)
//! with a protoc shipped inside a crate, so a fresh build needs nothing installed.
use std::path::Path;

const PROTOS: &[&str] = &[
    "proto/deviceplugin/v1beta1/api.proto",
    "proto/podresources/v1/api.proto",
    "proto/cri/v1/api.proto",
    "proto/dra/v1/api.proto",
    "proto/pluginregistration/v1/api.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let present: Vec<&str> = PROTOS
        .iter()
        .copied()
        .filter(|p| Path::new(p).exists())
        .collect();
    if present.is_empty() {
        return Ok(());
    }
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; prost-build reads PROTOC.
    unsafe { std::env::set_var("PROTOC", protoc) };
    tonic_prost_build::configure().compile_protos(&present, &["proto"])?;
    Ok(())
}
