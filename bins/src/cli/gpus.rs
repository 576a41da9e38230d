//! `gpu-stack gpus`: inventory, MIG state and running processes of a node's GPUs
//! from a GPU backend, and (`--watch`) its health events as they arrive. On
//! simulated GPUs it also changes the shared state: faults, processes starting
//! and stopping, and a node reboot.
use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gpu_stack_core::backend::{
    BackendError, Fault, FaultSpec, GpuBackend, HealthEventKind, NodeSnapshot, node_snapshot,
};

use crate::backend_flags::BackendArgs;

/// Output format.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// One line per GPU and GPU instance.
    Table,
    /// The node snapshot as JSON (the same shape for every backend).
    Json,
}

/// Flags of `gpu-stack gpus`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    backend: BackendArgs,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Table)]
    output: Output,
    /// Print health events (Xid, GPU lost) as they arrive instead of the inventory.
    #[arg(long)]
    watch: bool,
    /// Stop watching after this many seconds (default: until interrupted).
    #[arg(long, value_name = "SECONDS", requires = "watch")]
    watch_for: Option<u64>,
    /// Simulated GPUs only: raise Xid `XID` on GPU `GPU` now (`GPU:XID`).
    #[arg(long, value_name = "GPU:XID")]
    inject_xid: Vec<String>,
    /// Simulated GPUs only: make GPU `GPU` fall off the bus now.
    #[arg(long, value_name = "GPU")]
    inject_lost: Vec<u32>,
    /// Simulated GPUs only: start a compute process on GPU `GPU` (MIG off) or
    /// on MIG device `GPU:GI[:CI]` (MIG on); prints its pid.
    #[arg(long, value_name = "GPU[:GI[:CI]]")]
    start_process: Vec<String>,
    /// Pid of the process `--start-process` starts (default: the lowest free
    /// one from 4000); only with a single `--start-process`.
    #[arg(long, value_name = "PID", requires = "start_process")]
    pid: Option<u32>,
    /// GPU memory the started process uses, in MiB.
    #[arg(long, value_name = "MIB", requires = "start_process")]
    used_memory_mib: Option<u64>,
    /// Simulated GPUs only: stop process `PID` on every GPU of the node.
    #[arg(long, value_name = "PID")]
    stop_process: Vec<u32>,
    /// Simulated GPUs only: reboot the node (pending MIG modes take effect,
    /// MIG instances and processes are gone, lost GPUs answer again).
    #[arg(long)]
    reboot: bool,
}

/// A `--start-process` target: GPU, and GPU / compute instance when MIG is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ProcessTarget {
    gpu: u32,
    gi: Option<u32>,
    ci: Option<u32>,
}

fn parse_target(s: &str) -> Result<ProcessTarget> {
    let parts: Vec<&str> = s.split(':').map(str::trim).collect();
    if parts.is_empty() || parts.len() > 3 {
        bail!("--start-process {s:?}: expected GPU, GPU:GI or GPU:GI:CI, e.g. 0:3");
    }
    let num = |what: &str, v: &str| -> Result<u32> {
        v.parse().with_context(|| {
            format!("--start-process {s:?}: {what} {v:?} is not a number (expected GPU[:GI[:CI]])")
        })
    };
    Ok(ProcessTarget {
        gpu: num("GPU index", parts[0])?,
        gi: parts
            .get(1)
            .map(|v| num("GPU-instance id", v))
            .transpose()?,
        ci: parts
            .get(2)
            .map(|v| num("compute-instance id", v))
            .transpose()?,
    })
}

fn parse_xid(s: &str) -> Result<(u32, u64)> {
    let (g, x) = s
        .split_once(':')
        .with_context(|| format!("--inject-xid {s:?}: expected GPU:XID, e.g. 0:48"))?;
    Ok((
        g.trim()
            .parse()
            .with_context(|| format!("--inject-xid {s:?}: GPU index {g:?} is not a number"))?,
        x.trim()
            .parse()
            .with_context(|| format!("--inject-xid {s:?}: Xid {x:?} is not a number"))?,
    ))
}

/// Runs `gpu-stack gpus`.
pub fn run(args: Args) -> Result<ExitCode> {
    if !args.start_process.is_empty() || !args.stop_process.is_empty() || args.reboot {
        return change_processes(&args);
    }
    if !args.inject_xid.is_empty() || !args.inject_lost.is_empty() {
        let faults: Vec<FaultSpec> = args
            .inject_xid
            .iter()
            .map(|s| {
                parse_xid(s).map(|(gpu, xid)| FaultSpec {
                    gpu: Some(gpu),
                    at_ms: 0,
                    fault: Fault::Xid {
                        xid,
                        gpu_instance: None,
                    },
                })
            })
            .chain(args.inject_lost.iter().map(|&gpu| {
                Ok(FaultSpec {
                    gpu: Some(gpu),
                    at_ms: 0,
                    fault: Fault::FallOffBus,
                })
            }))
            .collect::<Result<_>>()?;
        let sim = args
            .backend
            .build_simulated()
            .context("--inject-xid/--inject-lost work on simulated GPUs")?;
        if args.backend.sim_state.is_none() {
            bail!(
                "--inject-xid/--inject-lost need --sim-state FILE so other processes simulating the node see the fault"
            );
        }
        for f in faults {
            sim.inject(f)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let backend = args.backend.build()?;
    if args.watch {
        let mut events = backend.health_events()?;
        let deadline = args
            .watch_for
            .map(|s| Instant::now() + Duration::from_secs(s));
        let mut out = std::io::stdout().lock();
        loop {
            let slice = match deadline {
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(ExitCode::SUCCESS);
                    }
                    left.min(Duration::from_secs(1))
                }
                None => Duration::from_secs(1),
            };
            let Some(e) = events.wait(slice)? else {
                continue;
            };
            match args.output {
                Output::Json => writeln!(out, "{}", serde_json::to_string(&e)?)?,
                Output::Table => {
                    let what = match e.kind {
                        HealthEventKind::Xid { xid } => format!("Xid {xid}"),
                        HealthEventKind::GpuLost => "GPU lost".to_string(),
                    };
                    let mig = match (e.gpu_instance_id, e.compute_instance_id) {
                        (Some(gi), Some(ci)) => {
                            format!(" (GPU instance {gi}, compute instance {ci})")
                        }
                        (Some(gi), None) => format!(" (GPU instance {gi})"),
                        _ => String::new(),
                    };
                    writeln!(out, "GPU {} {}: {what}{mig}", e.gpu, e.uuid)?;
                }
            }
            out.flush()?;
        }
    }
    let snap = node_snapshot(backend.as_ref())?;
    let mut out = std::io::stdout().lock();
    match args.output {
        Output::Json => writeln!(out, "{}", serde_json::to_string_pretty(&snap)?)?,
        Output::Table => write_table(&mut out, &snap, backend.as_ref())?,
    }
    Ok(if snap.errors.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `--start-process`, `--stop-process`, `--reboot`: checks every flag first,
/// then changes the shared simulated state.
fn change_processes(args: &Args) -> Result<ExitCode> {
    let targets = args
        .start_process
        .iter()
        .map(|s| parse_target(s))
        .collect::<Result<Vec<_>>>()?;
    if args.pid.is_some() && targets.len() > 1 {
        bail!(
            "--pid names one process but {} --start-process flags were given; start them one at a time",
            targets.len()
        );
    }
    let sim = args
        .backend
        .build_simulated()
        .context("--start-process/--stop-process/--reboot work on simulated GPUs")?;
    if args.backend.sim_state.is_none() {
        bail!(
            "--start-process/--stop-process/--reboot need --sim-state FILE so other processes simulating the node see the change"
        );
    }
    if args.reboot {
        sim.reboot()?;
        println!("node rebooted");
    }
    for pid in &args.stop_process {
        sim.stop_process(None, *pid)?;
        println!("stopped process {pid}");
    }
    for t in targets {
        let p = sim.start_process(t.gpu, t.gi, t.ci, args.pid, args.used_memory_mib)?;
        match (p.gpu_instance_id, p.compute_instance_id) {
            (Some(gi), Some(ci)) => println!(
                "started process {} on GPU {} GPU instance {gi} compute instance {ci}",
                p.pid, t.gpu
            ),
            _ => println!("started process {} on GPU {}", p.pid, t.gpu),
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn write_table(out: &mut impl Write, s: &NodeSnapshot, backend: &dyn GpuBackend) -> Result<()> {
    writeln!(
        out,
        "driver {}  CUDA {}  NVML {}",
        s.system.driver_version, s.system.cuda_driver_version, s.system.nvml_version
    )?;
    for g in &s.gpus {
        let i = &g.info;
        let mig = match &g.mig {
            None => "MIG n/a".to_string(),
            Some(m) if m.mode.reset_pending() => format!(
                "MIG {} (pending {}, needs reset)",
                on(m.mode.current),
                on(m.mode.pending)
            ),
            Some(m) => format!("MIG {}", on(m.mode.current)),
        };
        writeln!(
            out,
            "GPU {}  {}  {}  {}  {} MiB  {}",
            i.index,
            i.name,
            i.uuid,
            i.pci_bus_id,
            i.memory_total_bytes >> 20,
            mig
        )?;
        let processes = match backend.running_processes(i.index) {
            Ok(list) => list,
            Err(BackendError::NotSupported { .. }) | Err(BackendError::MissingFunction { .. }) => {
                Vec::new()
            }
            Err(e) => {
                writeln!(out, "  processes: ERROR {e}")?;
                Vec::new()
            }
        };
        let proc_line = |p: &gpu_stack_core::backend::GpuProcess| {
            let mem = p
                .used_memory_bytes
                .map(|b| format!("  {} MiB", b >> 20))
                .unwrap_or_default();
            format!("pid {}{mem}", p.pid)
        };
        for p in processes.iter().filter(|p| p.gpu_instance_id.is_none()) {
            writeln!(out, "  {}", proc_line(p))?;
        }
        for gi in g.mig.iter().flat_map(|m| &m.gpu_instances) {
            writeln!(
                out,
                "  GI {:>2}  {:<12} @{}",
                gi.id, gi.profile_name, gi.placement
            )?;
            for ci in &gi.compute_instances {
                writeln!(out, "    CI {:>2}  {}c  {}", ci.id, ci.slice_count, ci.uuid)?;
                for p in processes.iter().filter(|p| {
                    p.gpu_instance_id == Some(gi.id) && p.compute_instance_id == Some(ci.id)
                }) {
                    writeln!(out, "      {}", proc_line(p))?;
                }
            }
        }
    }
    for e in &s.errors {
        writeln!(out, "GPU {}  ERROR  {}", e.index, e.error)?;
    }
    Ok(())
}

fn on(b: bool) -> &'static str {
    if b { "on" } else { "off" }
}
