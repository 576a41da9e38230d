//! `gpu-stack mig`: catalog, profile tables, layout validation, fitting,
//! layout enumeration, fleet planning and mig-parted config checks.
//!
//! Exit codes: 0 = yes / done, 1 = checked and the answer is no, 2 = bad input
//! (returned as an error to the dispatcher).
use std::process::ExitCode;

use anyhow::{Context, Result, anyhow};
use clap::{Subcommand, ValueEnum};
use gpu_stack_core::catalog::{self, GpuModel};
use gpu_stack_core::fleet::Fleet;
use gpu_stack_core::mig::{self, MigGeometry, MigProfileName, PlacedInstance};
use gpu_stack_core::migparted::{self, CheckStatus, EntryVerdict, MigPartedConfig};

/// Writes a line to stdout; a closed pipe (`| head`) is not an error.
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($t)*);
    }};
}

/// Flags of `gpu-stack mig`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    command: MigCommand,
}

/// Output format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// A readable table.
    #[default]
    Table,
    /// Machine-readable JSON.
    Json,
}

/// Subcommands of `gpu-stack mig`.
#[derive(Subcommand, Debug)]
pub enum MigCommand {
    /// List the GPU catalog.
    Models {
        /// Output format.
        #[arg(short, long, value_enum, default_value_t)]
        output: Output,
    },
    /// Show the MIG profile table of a model.
    Profiles {
        /// Catalog name or PCI device id (0x20B010DE).
        #[arg(long)]
        model: String,
        /// Output format.
        #[arg(short, long, value_enum, default_value_t)]
        output: Output,
    },
    /// Validate a placed layout: exit 0 valid, 1 invalid.
    Validate {
        /// Catalog name or PCI device id.
        #[arg(long)]
        model: String,
        /// Layout, e.g. "3g.40gb@4,1g.10gb@0".
        layout: String,
        /// Apply the pre-R510 restriction on 4g + 3g.
        #[arg(long)]
        pre_r510: bool,
        /// Output format.
        #[arg(short, long, value_enum, default_value_t)]
        output: Output,
    },
    /// Place a multiset of profiles: exit 0 with a layout, 1 if none exists.
    Fit {
        /// Catalog name or PCI device id.
        #[arg(long)]
        model: String,
        /// Profiles and counts, e.g. "1g.10gb=2,3g.40gb=1".
        demand: String,
        /// Output format.
        #[arg(short, long, value_enum, default_value_t)]
        output: Output,
    },
    /// Enumerate valid (or maximal) layouts.
    Layouts {
        /// Catalog name or PCI device id.
        #[arg(long)]
        model: String,
        /// Only these profiles (comma separated); default all.
        #[arg(long, value_delimiter = ',')]
        profiles: Option<Vec<String>>,
        /// Only layouts that admit no further instance.
        #[arg(long)]
        maximal: bool,
        /// Output format.
        #[arg(short, long, value_enum, default_value_t)]
        output: Output,
    },
    /// Plan MIG layouts for a fleet file to meet a demand.
    Plan {
        /// Fleet description file (YAML).
        #[arg(long)]
        fleet: std::path::PathBuf,
        /// Instances wanted across the fleet, e.g. "1g.10gb=20,3g.40gb=4".
        #[arg(long)]
        demand: String,
        /// Output format.
        #[arg(short, long, value_enum, default_value_t)]
        output: Output,
    },
    /// Apply a named mig-parted config to the GPUs of a node (minimal change).
    Apply {
        /// Config file, config name, backend and output.
        #[command(flatten)]
        args: super::mig_apply::ConfigArgs,
        /// Destroy instances even when processes run on them.
        #[arg(long)]
        force: bool,
        /// Only switch MIG modes.
        #[arg(long)]
        mode_only: bool,
    },
    /// Exit 0 when the GPUs already match a named mig-parted config, 1 when not.
    Assert {
        /// Config file, config name, backend and output.
        #[command(flatten)]
        args: super::mig_apply::ConfigArgs,
    },
    /// Print the GPUs' current MIG layout as a mig-parted config.
    Export {
        /// GPU backend.
        #[command(flatten)]
        backend: super::mig_apply::BackendArgs,
        /// Name of the config written.
        #[arg(long, default_value = "current")]
        name: String,
        /// Output format (table = YAML).
        #[arg(short, long, value_enum, default_value_t)]
        output: super::mig_apply::Output,
    },
    /// Parse a mig-parted config file and check every config against GPUs:
    /// exit 0 when the file parses.
    CheckConfig {
        /// mig-parted config file; `-` or `default` for NVIDIA's shipped file.
        file: String,
        /// Check only this model (default: every MIG-capable model).
        #[arg(long)]
        model: Option<String>,
        /// Output format.
        #[arg(short, long, value_enum, default_value_t)]
        output: Output,
    },
}

/// Runs `gpu-stack mig`.
pub fn run(args: Args) -> Result<ExitCode> {
    match args.command {
        MigCommand::Models { output } => models(output),
        MigCommand::Profiles { model, output } => profiles(&model, output),
        MigCommand::Validate {
            model,
            layout,
            pre_r510,
            output,
        } => validate(&model, &layout, pre_r510, output),
        MigCommand::Fit {
            model,
            demand,
            output,
        } => fit(&model, &demand, output),
        MigCommand::Layouts {
            model,
            profiles,
            maximal,
            output,
        } => layouts(&model, profiles, maximal, output),
        MigCommand::Plan {
            fleet,
            demand,
            output,
        } => plan(&fleet, &demand, output),
        MigCommand::Apply {
            args,
            force,
            mode_only,
        } => super::mig_apply::apply(args, force, mode_only),
        MigCommand::Assert { args } => super::mig_apply::assert(args),
        MigCommand::Export {
            backend,
            name,
            output,
        } => super::mig_apply::export(backend, &name, output),
        MigCommand::CheckConfig {
            file,
            model,
            output,
        } => check_config(&file, model.as_deref(), output),
    }
}

fn model(name: &str) -> Result<&'static GpuModel> {
    Ok(catalog::lookup(name)?)
}

fn geometry(name: &str) -> Result<(&'static GpuModel, &'static MigGeometry)> {
    let m = model(name)?;
    let g = m
        .mig
        .as_ref()
        .ok_or_else(|| {
            anyhow!(
                "GPU model {} ({}) does not support MIG; pick a model with MIG (`gpu-stack mig models`)",
                m.name,
                gpu_stack_core::echo::quoted(name)
            )
        })?;
    Ok((m, g))
}

fn print_json(value: &impl serde::Serialize) -> Result<()> {
    out!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// Prints rows as aligned columns.
fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < widths.len() {
                widths[i] = widths[i].max(c.len());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let s: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<w$}", w = widths.get(i).copied().unwrap_or(0)))
            .collect();
        out!("{}", s.join("  ").trim_end());
    };
    line(header.to_vec());
    for r in rows {
        line(r.iter().map(String::as_str).collect());
    }
}

fn models(output: Output) -> Result<ExitCode> {
    let all = catalog::models();
    if output == Output::Json {
        print_json(&all)?;
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = all
        .iter()
        .map(|m| {
            vec![
                m.name.clone(),
                m.pci_device_ids
                    .iter()
                    .map(|id| catalog::format_pci_id(*id))
                    .collect::<Vec<_>>()
                    .join(","),
                m.architecture.to_string(),
                m.memory_mib.to_string(),
                format!("{}.{}", m.compute_capability.0, m.compute_capability.1),
                match &m.mig {
                    None => "-".into(),
                    Some(g) => format!(
                        "{} profiles{}",
                        g.gi_profiles.len(),
                        if g.gi_profiles.iter().any(|p| p.inferred) {
                            " (inferred)"
                        } else {
                            ""
                        }
                    ),
                },
                m.product_name.clone(),
            ]
        })
        .collect();
    print_table(
        &[
            "MODEL",
            "PCI IDS",
            "ARCH",
            "MEMORY MiB",
            "CC",
            "MIG",
            "PRODUCT",
        ],
        &rows,
    );
    Ok(ExitCode::SUCCESS)
}

fn profiles(name: &str, output: Output) -> Result<ExitCode> {
    let (m, g) = geometry(name)?;
    if output == Output::Json {
        print_json(g)?;
        return Ok(ExitCode::SUCCESS);
    }
    out!(
        "{}: {} memory slices, {} compute slices, at most {} instances",
        m.name,
        g.memory_slices,
        g.compute_slices,
        g.max_instances
    );
    let opt = |v: Option<u64>| v.map(|x| x.to_string()).unwrap_or_else(|| "?".into());
    let rows: Vec<Vec<String>> = g
        .gi_profiles
        .iter()
        .map(|p| {
            vec![
                p.name.to_string(),
                p.id.to_string(),
                format!("0x{:X}", p.nvml_profile_enum),
                p.compute_slices.to_string(),
                p.memory_slices.to_string(),
                opt(p.memory_mib),
                opt(p.multiprocessors.map(u64::from)),
                format!(
                    "{}/{}/{}/{}",
                    p.media.decoders, p.media.encoders, p.media.jpeg, p.media.ofa
                ),
                p.max_instances.to_string(),
                format!(
                    "{{{}}}:{}",
                    p.placements
                        .iter()
                        .map(|pl| pl.start.to_string())
                        .collect::<Vec<_>>()
                        .join(","),
                    p.memory_slices
                ),
                if p.inferred { "inferred" } else { "" }.into(),
            ]
        })
        .collect();
    print_table(
        &[
            "PROFILE",
            "ID",
            "ENUM",
            "G",
            "SLICES",
            "MiB",
            "SM",
            "DEC/ENC/JPG/OFA",
            "MAX",
            "PLACEMENTS",
            "",
        ],
        &rows,
    );
    Ok(ExitCode::SUCCESS)
}

fn validate(name: &str, layout: &str, pre_r510: bool, output: Output) -> Result<ExitCode> {
    let (_, g) = geometry(name)?;
    let layout = mig::parse_layout(layout)
        .with_context(|| format!("layout {}", gpu_stack_core::echo::quoted(layout)))?;
    let options = mig::ValidateOptions {
        pre_r510_driver: pre_r510,
    };
    let result = mig::validate_with(g, &layout, options);
    if output == Output::Json {
        let violations: Vec<serde_json::Value> = match &result {
            Ok(()) => Vec::new(),
            Err(v) => v
                .iter()
                .map(|x| {
                    let mut j = serde_json::to_value(x).unwrap_or_default();
                    if let Some(o) = j.as_object_mut() {
                        o.insert("message".into(), x.to_string().into());
                    }
                    j
                })
                .collect(),
        };
        print_json(&serde_json::json!({
            "valid": result.is_ok(),
            "layout": layout,
            "violations": violations,
        }))?;
    } else {
        match &result {
            Ok(()) => out!("valid: {}", mig::format_layout(&layout)),
            Err(v) => {
                let text = mig::format_layout(&layout);
                out!("invalid: {}", gpu_stack_core::echo::clipped(&text));
                for x in v {
                    out!("  - {x}");
                }
            }
        }
    }
    Ok(if result.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn fit(name: &str, demand: &str, output: Output) -> Result<ExitCode> {
    let (_, g) = geometry(name)?;
    let d = mig::parse_demand(demand)
        .with_context(|| format!("demand {}", gpu_stack_core::echo::quoted(demand)))?;
    for (p, _) in &d {
        if g.resolve(p).is_none() {
            return Err(anyhow!(
                "profile {} does not exist on {name} (profiles: {})",
                gpu_stack_core::echo::clipped(&p.to_string()),
                g.profile_list()
            ));
        }
    }
    // A count above what one GPU of this model holds is a demand that does
    // not fit (exit 1), like any other: `fit` refuses it before anything is
    // sized by the count. Only a count that does not parse (above
    // 4294967295) is bad input.
    let result = mig::fit(g, &d);
    match (&result, output) {
        (Ok(l), Output::Json) => print_json(&serde_json::json!({ "fits": true, "layout": l }))?,
        (Err(e), Output::Json) => {
            print_json(&serde_json::json!({ "fits": false, "reason": e.to_string(), "detail": e }))?
        }
        (Ok(l), Output::Table) => out!("{}", mig::format_layout(l)),
        (Err(e), Output::Table) => out!("does not fit: {e}"),
    }
    Ok(if result.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn layouts(
    name: &str,
    profiles: Option<Vec<String>>,
    maximal: bool,
    output: Output,
) -> Result<ExitCode> {
    let (_, g) = geometry(name)?;
    let profiles: Option<Vec<MigProfileName>> = profiles
        .map(|v| {
            v.iter()
                .map(|s| s.trim().parse::<MigProfileName>())
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?;
    let all = if maximal {
        mig::enumerate_maximal_layouts(g, profiles.as_deref())?
    } else {
        mig::enumerate_layouts(g, profiles.as_deref())?
    };
    if output == Output::Json {
        print_json(&all)?;
    } else {
        for l in &all {
            out!("{}", mig::format_layout(l));
        }
        eprintln!("{} layouts", all.len());
    }
    Ok(ExitCode::SUCCESS)
}

fn plan(path: &std::path::Path, demand: &str, output: Output) -> Result<ExitCode> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read fleet file {}", path.display()))?;
    let fleet =
        Fleet::from_yaml(&text).with_context(|| format!("fleet file {}", path.display()))?;
    let d = mig::parse_demand(demand)
        .with_context(|| format!("demand {}", gpu_stack_core::echo::quoted(demand)))?;
    let gpus = fleet.planner_gpus();
    let plan =
        mig::plan_fleet(&gpus, &d).with_context(|| format!("fleet file {}", path.display()))?;
    if output == Output::Json {
        print_json(&plan)?;
    } else {
        let rows: Vec<Vec<String>> = plan
            .gpus
            .iter()
            .filter(|p| p.changes() || p.note.is_some())
            .map(|p| {
                vec![
                    p.gpu.clone(),
                    mig::format_layout(&p.destroy),
                    mig::format_layout(&p.create),
                    p.note
                        .clone()
                        .unwrap_or_else(|| mig::format_layout(&p.target)),
                ]
            })
            .collect();
        print_table(&["GPU", "DESTROY", "CREATE", "TARGET"], &rows);
        out!(
            "{} GPUs, {} changed, {} instances destroyed, {} created",
            plan.gpus.len(),
            plan.gpus.iter().filter(|p| p.changes()).count(),
            plan.destroyed,
            plan.created
        );
        let rows: Vec<Vec<String>> = plan
            .profiles
            .iter()
            .map(|o| {
                vec![
                    o.profile.clone(),
                    o.wanted.to_string(),
                    o.in_use.to_string(),
                    o.planned.to_string(),
                    o.unmet.to_string(),
                    o.reason.clone().unwrap_or_default(),
                ]
            })
            .collect();
        print_table(
            &["PROFILE", "WANTED", "IN USE", "PLANNED", "UNMET", "WHY"],
            &rows,
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn check_config(file: &str, model_name: Option<&str>, output: Output) -> Result<ExitCode> {
    let text = if file == "-" || file == "default" {
        migparted::DEFAULT_CONFIG_YAML.to_string()
    } else {
        std::fs::read_to_string(file).with_context(|| format!("cannot read {file}"))?
    };
    let config = MigPartedConfig::from_yaml(&text).with_context(|| format!("file {file}"))?;
    let models: Vec<&GpuModel> = match model_name {
        Some(n) => vec![model(n)?],
        None => catalog::models()
            .iter()
            .filter(|m| m.mig.is_some())
            .collect(),
    };
    let report = migparted::check(&config, &models);
    if output == Output::Json {
        print_json(&report)?;
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = report
        .iter()
        .filter(|c| model_name.is_some() || c.status != CheckStatus::NotApplicable)
        .map(|c| {
            let detail = c
                .entries
                .iter()
                .map(|e| match &e.verdict {
                    EntryVerdict::Disabled => "MIG disabled".to_string(),
                    EntryVerdict::Valid { layout } => layout_or_empty(layout),
                    EntryVerdict::Invalid { reason } => reason.clone(),
                })
                .collect::<Vec<_>>()
                .join(" | ");
            vec![
                c.config.clone(),
                c.model.clone(),
                c.status.to_string(),
                detail,
            ]
        })
        .collect();
    print_table(&["CONFIG", "MODEL", "STATUS", "DETAIL"], &rows);
    let valid = report
        .iter()
        .filter(|c| c.status == CheckStatus::Valid)
        .count();
    let invalid = report
        .iter()
        .filter(|c| c.status == CheckStatus::Invalid)
        .count();
    out!(
        "{} configs × {} models: {valid} valid, {invalid} invalid, {} not applicable",
        config.mig_configs.len(),
        models.len(),
        report.len() - valid - invalid
    );
    Ok(ExitCode::SUCCESS)
}

fn layout_or_empty(layout: &[PlacedInstance]) -> String {
    if layout.is_empty() {
        "MIG enabled, no instances".into()
    } else {
        mig::format_layout(layout)
    }
}
