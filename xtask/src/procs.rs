//! Process plumbing: Ctrl-C/SIGTERM handling, process groups, liveness checks
//! and finding control-plane processes by their executable.
use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// Process group of the foreground child (the test run), 0 when none.
static CHILD_GROUP: AtomicI32 = AtomicI32::new(0);

/// On Ctrl-C, SIGTERM or SIGHUP: remember it and pass SIGINT to the running
/// child's process group, so the caller can tear the cluster down.
pub fn install_interrupt_handler() -> Result<()> {
    ctrlc::set_handler(|| {
        INTERRUPTED.store(true, Ordering::SeqCst);
        let group = CHILD_GROUP.load(Ordering::SeqCst);
        if group > 0 {
            let _ = killpg(Pid::from_raw(group), Signal::SIGINT);
        }
    })
    .context("installing the Ctrl-C handler")
}

/// Whether an interrupt was received.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// Runs `cmd` in its own process group (signals are forwarded by the handler)
/// and returns whether it succeeded.
pub fn run_interruptible(cmd: &mut Command) -> Result<bool> {
    let mut child = cmd.process_group(0).spawn().context("spawning")?;
    let pid = i32::try_from(child.id()).unwrap_or(0);
    CHILD_GROUP.store(pid, Ordering::SeqCst);
    if interrupted() && pid > 0 {
        let _ = killpg(Pid::from_raw(pid), Signal::SIGINT);
    }
    let status = child.wait();
    CHILD_GROUP.store(0, Ordering::SeqCst);
    Ok(status.context("waiting")?.success())
}

/// True when `pid` exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    if pid <= 0 || kill(Pid::from_raw(pid), None).is_err() {
        return false;
    }
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state letter follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
            .unwrap_or(true),
        Err(_) => false,
    }
}

/// The executable of `pid`, if readable.
pub fn exe(pid: i32) -> Option<PathBuf> {
    fs::read_link(format!("/proc/{pid}/exe")).ok()
}

/// Command line of `pid` joined with spaces, if readable.
fn cmdline(pid: i32) -> Option<String> {
    let raw = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(
        raw.split(|b| *b == 0)
            .map(|part| String::from_utf8_lossy(part).into_owned())
            .collect::<Vec<_>>()
            .join(" "),
    )
}

/// Live processes whose executable is in a directory of `bins_root` (one per
/// release combination) and whose command line
/// mentions `state_dir`: the processes of this cluster, pid files or not.
pub fn find_cluster_processes(bins_root: &Path, state_dir: &Path) -> Vec<(i32, PathBuf)> {
    let state = state_dir.to_string_lossy().into_owned();
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Some(exe) = exe(pid) else { continue };
        if exe.parent().and_then(Path::parent) != Some(bins_root) || !alive(pid) {
            continue;
        }
        if cmdline(pid).is_some_and(|c| mentions_dir(&c, &state)) {
            found.push((pid, exe));
        }
    }
    found.sort();
    found
}

/// True when `cmdline` names `dir` or a path below it (`.cache/cluster` is
/// not mentioned by `.cache/cluster-rn/...`); an empty `dir` matches all.
fn mentions_dir(cmdline: &str, dir: &str) -> bool {
    if dir.is_empty() {
        return true;
    }
    cmdline.match_indices(dir).any(|(at, _)| {
        matches!(
            cmdline[at + dir.len()..].chars().next(),
            None | Some('/') | Some(' ')
        )
    })
}

/// Sends SIGTERM to each process group, waits up to `grace`, then SIGKILLs
/// whatever is left. `reap` is called while waiting so the caller can collect
/// its own children (zombies count as gone).
pub fn terminate_groups(pids: &[i32], grace: Duration, mut reap: impl FnMut()) -> usize {
    for pid in pids {
        signal_group(*pid, Signal::SIGTERM);
    }
    let step = Duration::from_millis(100);
    let mut waited = Duration::ZERO;
    while waited < grace {
        reap();
        if pids.iter().all(|p| !alive(*p)) {
            return pids.len();
        }
        std::thread::sleep(step);
        waited += step;
    }
    for pid in pids {
        if alive(*pid) {
            signal_group(*pid, Signal::SIGKILL);
        }
    }
    for _ in 0..50 {
        reap();
        if pids.iter().all(|p| !alive(*p)) {
            break;
        }
        std::thread::sleep(step);
    }
    pids.len()
}

/// Signals the process group led by `pid`, or the process alone when it does
/// not lead a group.
fn signal_group(pid: i32, signal: Signal) {
    if killpg(Pid::from_raw(pid), signal).is_err() {
        let _ = kill(Pid::from_raw(pid), signal);
    }
}

#[cfg(test)]
mod tests {
    use super::mentions_dir;

    #[test]
    fn a_state_dir_is_not_a_prefix_of_another() {
        let dir = "/w/.cache/cluster";
        assert!(mentions_dir(
            "etcd --data-dir=/w/.cache/cluster/etcd-data",
            dir
        ));
        assert!(mentions_dir("x --state /w/.cache/cluster", dir));
        assert!(!mentions_dir(
            "etcd --data-dir=/w/.cache/cluster-rn/etcd-data",
            dir
        ));
        assert!(mentions_dir("anything", ""));
    }
}
