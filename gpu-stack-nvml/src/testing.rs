//! Test support, behind the `testing` feature: building the stand-in
//! libnvidia-ml (`nvml-standin`) the NVML backend's tests load.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Builds `libnvml_standin.so` into the calling test's target directory (the
/// same profile) and returns its path. Panics when the build fails: only
/// tests and benchmarks call it.
pub fn standin_lib() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    // <target>/<profile>/deps/<test binary>
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let target_dir = profile_dir
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .args(["build", "-p", "nvml-standin", "--lib"])
        .env("CARGO_TARGET_DIR", &target_dir);
    if profile_dir.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    let built = cmd.status().is_ok_and(|s| s.success());
    assert!(built, "cargo build -p nvml-standin failed");
    let lib = profile_dir.join("libnvml_standin.so");
    assert!(lib.exists(), "{} was not built", lib.display());
    lib
}
