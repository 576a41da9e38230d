//! `gpu-stack mig apply | assert | export`: mig-parted's command line for people
//! without a cluster, on the same apply path as `gpu-mig-manager`
//! (`gpu_stack_nvml::migapply`).
//!
//! Exit codes: 0 = done / GPUs match, 1 = `assert` found a difference (or
//! `apply` needs a reboot), 2 = bad input or a failure to act.
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::ValueEnum;
use gpu_stack_core::backend::GpuBackend;
use gpu_stack_core::migparted::MigPartedConfig;
use gpu_stack_nvml::migapply::{self, ApplyEvent, ApplyOptions, ApplyOutcome, NoProcesses};
use gpu_stack_nvml::{SimNodeSpec, SimulatedBackend};

/// Output format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Readable text.
    #[default]
    Table,
    /// JSON (YAML for `export`).
    Json,
}

/// Which GPUs to act on.
#[derive(clap::Args, Debug, Clone)]
pub struct BackendArgs {
    /// GPU backend.
    #[arg(long, value_enum, default_value_t = BackendKind::Simulated)]
    pub backend: BackendKind,
    /// Fleet file describing the simulated node (simulated backend).
    #[arg(long)]
    pub fleet: Option<PathBuf>,
    /// Node of the fleet file (default: the only node with GPUs).
    #[arg(long)]
    pub node: Option<String>,
    /// State file shared by processes simulating the same node, so an `apply`
    /// is seen by a later `assert` (simulated backend).
    #[arg(long)]
    pub sim_state: Option<PathBuf>,
}

/// GPU backends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// Simulated GPUs from a fleet file.
    Simulated,
    /// The NVIDIA driver.
    Nvml,
}

impl BackendArgs {
    /// Builds the backend.
    pub fn build(&self) -> Result<Box<dyn GpuBackend>> {
        match self.backend {
            BackendKind::Simulated => {
                let fleet = self.fleet.as_deref().context(
                    "--backend simulated needs --fleet FILE (for example examples/fleets/hgx-h100.yaml)",
                )?;
                let spec = SimNodeSpec::from_fleet_file(fleet, self.node.as_deref())
                    .with_context(|| format!("reading fleet file {}", fleet.display()))?;
                let backend = match &self.sim_state {
                    Some(state) => SimulatedBackend::with_state_file(&spec, state)
                        .with_context(|| format!("opening state file {}", state.display()))?,
                    None => SimulatedBackend::new(&spec)?,
                };
                Ok(Box::new(backend))
            }
            BackendKind::Nvml => {
                bail!(
                    "--backend nvml is not wired into `gpu-stack mig apply` in this build; use --backend simulated"
                )
            }
        }
    }
}

/// Flags shared by `apply` and `assert`.
#[derive(clap::Args, Debug)]
pub struct ConfigArgs {
    /// mig-parted config file; `default` for NVIDIA's shipped file.
    #[arg(short = 'f', long = "config-file")]
    pub file: String,
    /// Named config to apply.
    #[arg(short = 'c', long = "selected-config")]
    pub config: String,
    /// GPU backend.
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t)]
    pub output: Output,
}

fn load(file: &str) -> Result<MigPartedConfig> {
    if file == "default" {
        return Ok(MigPartedConfig::default_config()?);
    }
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("cannot read mig-parted config file {file}"))?;
    MigPartedConfig::from_yaml(&text).with_context(|| format!("in {file}"))
}

/// `gpu-stack mig apply`.
pub fn apply(args: ConfigArgs, force: bool, mode_only: bool) -> Result<ExitCode> {
    let config = load(&args.file)?;
    let backend = args.backend.build()?;
    let options = ApplyOptions {
        force,
        mode_only,
        ..ApplyOptions::default()
    };
    let text = args.output == Output::Table;
    let report = migapply::apply(
        backend.as_ref(),
        &config,
        &args.config,
        options,
        &NoProcesses,
        &mut |e| {
            if text {
                match e {
                    ApplyEvent::Step { gpu, step } => println!("GPU {gpu}: {step}"),
                    ApplyEvent::Reset { gpu } => println!("GPU {gpu}: reset"),
                }
            }
        },
    )?;
    if text {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(match report.outcome {
        ApplyOutcome::Converged => ExitCode::SUCCESS,
        ApplyOutcome::NeedsReboot { .. } => ExitCode::from(1),
    })
}

/// `gpu-stack mig assert`: exit 0 when the GPUs match the config, 1 when not.
pub fn assert(args: ConfigArgs) -> Result<ExitCode> {
    let config = load(&args.file)?;
    let backend = args.backend.build()?;
    let plan = migapply::plan_node(backend.as_ref(), &config, &args.config, &NoProcesses)?;
    let ok = plan.is_converged();
    if args.output == Output::Json {
        let body = serde_json::json!({ "matches": ok, "gpus": plan.reports() });
        println!("{}", serde_json::to_string_pretty(&body)?);
    } else {
        for r in plan.reports() {
            if r.steps.is_empty() && !r.needs_reset {
                println!("GPU {}: matches ({})", r.gpu, r.target.join(","));
            } else {
                println!(
                    "GPU {}: differs: has [{}], wants [{}], {} step(s){}",
                    r.gpu,
                    r.current.join(","),
                    r.target.join(","),
                    r.steps.len(),
                    if r.needs_reset {
                        ", waits for a GPU reset"
                    } else {
                        ""
                    }
                );
            }
        }
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `gpu-stack mig export`: the current layout as a mig-parted config.
pub fn export(backend: BackendArgs, name: &str, output: Output) -> Result<ExitCode> {
    let backend = backend.build()?;
    let exported = migapply::export(backend.as_ref(), name)?;
    match output {
        Output::Table => print!("{}", exported.to_yaml()),
        Output::Json => println!("{}", serde_json::to_string_pretty(&exported)?),
    }
    Ok(ExitCode::SUCCESS)
}
