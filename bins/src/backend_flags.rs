//! The GPU backend flags every gpu-stack binary takes, and the one function that
//! turns them into a backend: `--backend simulated|nvml`, `--fleet FILE`,
//! `--node NAME`, `--nvml-lib PATH`, `--sim-state FILE`.
//!
//! Agents flatten [`BackendArgs`] into their own flags:
//!
//! ```ignore
//! #[derive(clap::Parser)]
//! struct Cli {
//!     #[command(flatten)]
//!     backend: gpu_stack_bins::backend_flags::BackendArgs,
//! }
//! let gpus = cli.backend.build()?; // Arc<dyn GpuBackend>
//! ```
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use gpu_stack_core::backend::GpuBackend;
use gpu_stack_nvml::{NvmlBackend, SimNodeSpec, SimulatedBackend};

/// Which GPU backend to use.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// GPUs described by a fleet file (`--fleet`), for laptops and tests.
    Simulated,
    /// The NVIDIA driver through libnvidia-ml.
    Nvml,
}

/// GPU backend flags shared by every binary.
#[derive(clap::Args, Clone, Debug)]
pub struct BackendArgs {
    /// GPU backend: `nvml` (the driver) or `simulated` (a fleet file).
    #[arg(long, value_enum, default_value_t = BackendKind::Nvml, env = "GPU_STACK_BACKEND")]
    pub backend: BackendKind,
    /// Fleet file describing simulated GPUs (with `--backend simulated`).
    #[arg(long, value_name = "FILE", env = "GPU_STACK_FLEET")]
    pub fleet: Option<PathBuf>,
    /// Node of the fleet file to simulate; may be omitted when only one node has GPUs.
    #[arg(long, value_name = "NAME", env = "NODE_NAME")]
    pub node: Option<String>,
    /// Path of libnvidia-ml (with `--backend nvml`); default `libnvidia-ml.so.1`.
    #[arg(long, value_name = "PATH", env = "GPU_STACK_NVML_LIB")]
    pub nvml_lib: Option<PathBuf>,
    /// State file shared by every process simulating the same node, so a MIG
    /// change made by one is seen by the others (with `--backend simulated`).
    #[arg(long, value_name = "FILE", env = "GPU_STACK_SIM_STATE")]
    pub sim_state: Option<PathBuf>,
}

impl BackendArgs {
    /// Builds the backend the flags describe.
    pub fn build(&self) -> Result<Arc<dyn GpuBackend>> {
        match self.backend {
            BackendKind::Simulated => Ok(Arc::new(self.build_simulated()?)),
            BackendKind::Nvml => {
                let b = NvmlBackend::open(self.nvml_lib.as_deref())
                    .context("could not start the NVML GPU backend")?;
                Ok(Arc::new(b))
            }
        }
    }

    /// Builds the simulated backend (for callers that inject faults); fails
    /// unless `--backend simulated`.
    pub fn build_simulated(&self) -> Result<SimulatedBackend> {
        if self.backend != BackendKind::Simulated {
            bail!("this needs --backend simulated");
        }
        let Some(fleet) = &self.fleet else {
            bail!("--backend simulated needs --fleet FILE (see examples/fleets/)");
        };
        let spec = SimNodeSpec::from_fleet_file(fleet, self.node.as_deref())?;
        let backend = match &self.sim_state {
            Some(state) => SimulatedBackend::with_state_file(&spec, state)?,
            None => SimulatedBackend::new(&spec)?,
        };
        Ok(backend)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        backend: BackendArgs,
    }

    fn fleet() -> String {
        format!(
            "{}/../examples/fleets/hgx-h100.yaml",
            env!("CARGO_MANIFEST_DIR")
        )
    }

    #[test]
    fn simulated_backend_builds_from_flags() {
        let cli =
            Cli::try_parse_from(["x", "--backend", "simulated", "--fleet", &fleet()]).unwrap();
        let b = cli.backend.build().unwrap();
        assert_eq!(b.name(), "simulated");
        assert_eq!(b.device_count().unwrap(), 8);
    }

    #[test]
    fn simulated_without_fleet_is_a_clear_error() {
        let cli = Cli::try_parse_from(["x", "--backend", "simulated"]).unwrap();
        let err = cli.backend.build().err().unwrap().to_string();
        assert!(err.contains("--fleet"), "{err}");
    }

    #[test]
    fn nvml_with_missing_library_names_the_path() {
        let cli = Cli::try_parse_from([
            "x",
            "--backend",
            "nvml",
            "--nvml-lib",
            "/nonexistent/libnvidia-ml.so.1",
        ])
        .unwrap();
        let err = format!("{:#}", cli.backend.build().err().unwrap());
        assert!(err.contains("/nonexistent/libnvidia-ml.so.1"), "{err}");
    }
}
