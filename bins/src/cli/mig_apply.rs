//! `gpu-stack mig apply | assert | export`: mig-parted's command line for people
//! without a cluster, on the same apply path as `gpu-mig-manager`
//! (`gpu_stack_nvml::migapply`).
//!
//! `apply` lists the compute processes of every MIG-capable GPU through the
//! backend and refuses to destroy an instance a process runs on (naming the
//! GPU, the instance and the pids, changing nothing) unless `--force`.
//!
//! Exit codes: 0 = done / GPUs match, 1 = `assert` found a difference (or
//! `apply` needs a reboot), 2 = bad input, busy instances or a failure to act.
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::ValueEnum;
use gpu_stack_core::migparted::MigPartedConfig;
use gpu_stack_nvml::migapply::{self, ApplyEvent, ApplyOptions, ApplyOutcome, NoProcesses};

/// Output format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Readable text.
    #[default]
    Table,
    /// JSON (YAML for `export`).
    Json,
}

/// The shared GPU backend flags (`--backend simulated|nvml`, `--fleet`,
/// `--node`, `--nvml-lib`, `--sim-state`), re-exported for `gpu-stack mig`.
pub use crate::backend_flags::BackendArgs;

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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ConfigArgs,
    }

    fn fleet() -> String {
        format!(
            "{}/../examples/fleets/hgx-h100.yaml",
            env!("CARGO_MANIFEST_DIR")
        )
    }

    fn args(extra: &[&str], state: &std::path::Path) -> ConfigArgs {
        let mut argv = vec!["x", "-f", "default", "--backend", "simulated", "--fleet"];
        let fleet = fleet();
        argv.push(&fleet);
        let state = state.to_str().unwrap();
        argv.extend(["--sim-state", state, "-o", "json"]);
        argv.extend(extra);
        Cli::try_parse_from(argv).unwrap().args
    }

    #[test]
    fn apply_then_assert_through_a_shared_state_file() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("gpus.json");
        let before = assert(args(&["-c", "all-1g.10gb"], &state)).unwrap();
        assert_eq!(before, ExitCode::from(1), "a clean GPU does not match");
        let done = apply(args(&["-c", "all-1g.10gb"], &state), false, false).unwrap();
        assert_eq!(done, ExitCode::SUCCESS);
        let after = assert(args(&["-c", "all-1g.10gb"], &state)).unwrap();
        assert_eq!(after, ExitCode::SUCCESS, "a later process sees the layout");
        let other = assert(args(&["-c", "all-3g.40gb"], &state)).unwrap();
        assert_eq!(other, ExitCode::from(1));
    }

    #[test]
    fn unknown_config_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("gpus.json");
        let err = apply(args(&["-c", "no-such-config"], &state), false, false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no-such-config"), "{err}");
    }

    #[test]
    fn nvml_backend_is_accepted_and_names_a_missing_library() {
        let cli = Cli::try_parse_from([
            "x",
            "-f",
            "default",
            "-c",
            "all-1g.10gb",
            "--backend",
            "nvml",
            "--nvml-lib",
            "/nonexistent/libnvidia-ml.so.1",
        ])
        .unwrap();
        let err = format!("{:#}", assert(cli.args).unwrap_err());
        assert!(err.contains("/nonexistent/libnvidia-ml.so.1"), "{err}");
    }
}
