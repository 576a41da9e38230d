//! Crash safety of the simulated GPU state file: a process changing the state
//! in a loop is killed with SIGKILL at many random points, and every time the
//! file still loads and holds the state after the child's last completed
//! change, or after the one it was making.
//!
//! The child is this test binary run again with `KILL_TEST_STATE` set (the
//! `child_writer` test), so the state goes through a real process that dies
//! without any chance to clean up.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use gpu_stack_core::backend::{GpuBackend, SlicePlacement};
use gpu_stack_nvml::{SimNodeSpec, SimulatedBackend};

const RUNS: u32 = 100;
/// Upper bound of the random delay before the kill, in microseconds.
const MAX_DELAY_US: u64 = 30_000;
/// 1g.5gb on an A100-SXM4-40GB: seven fit, at slices 0..7.
const PROFILE_1G: u32 = 19;
/// What the child prints once its state file exists.
const READY: &str = "kill-test-child-ready";
/// The child stops by itself after this many changes, should the parent
/// never kill it (it also stops when the parent goes away: its writes to
/// the closed pipe fail).
const CHILD_MAX_CHANGES: u64 = 1_000_000;

fn spec() -> SimNodeSpec {
    SimNodeSpec::uniform("n0", "A100-SXM4-40GB", 8)
}

/// GPU 0's instance count after the child's change number `k` (from 0): it
/// creates seven 1g instances one by one, destroys them one by one, repeats.
fn count_after(k: u64) -> usize {
    let j = (k % 14) as usize;
    if j < 7 { j + 1 } else { 13 - j }
}

/// The child: changes the state until killed, printing `done K` after change K.
#[test]
fn child_writer() {
    let Some(state) = std::env::var_os("KILL_TEST_STATE") else {
        return; // Only meaningful as the child of the kill test.
    };
    let b = SimulatedBackend::with_state_file(&spec(), Path::new(&state)).unwrap();
    b.set_mig_mode(0, true).unwrap();
    let mut out = std::io::stdout().lock();
    // libtest prints "test child_writer ... " on the same line first.
    writeln!(out, "{READY}").unwrap();
    out.flush().unwrap();
    let mut ids = Vec::new();
    for k in 0..CHILD_MAX_CHANGES {
        let j = k % 14;
        if j < 7 {
            let gi = b
                .create_gpu_instance(
                    0,
                    PROFILE_1G,
                    SlicePlacement {
                        start: j as u32,
                        size: 1,
                    },
                )
                .unwrap();
            ids.push(gi.id);
        } else {
            let id = ids.remove(0);
            b.destroy_gpu_instance(0, id).unwrap();
        }
        writeln!(out, "done {k}").unwrap();
        out.flush().unwrap();
    }
}

/// A small deterministic generator, so a failing run can be replayed.
struct XorShift(u64);
impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn sigkill_at_random_points_never_corrupts_the_state_file() {
    let exe = std::env::current_exe().unwrap();
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    let mut killed_mid_write = 0;
    let mut changes_seen = 0u64;
    for run in 0..RUNS {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("node.json");
        let mut child = Command::new(&exe)
            .args(["--exact", "child_writer", "--nocapture", "--test-threads=1"])
            .env("KILL_TEST_STATE", &state)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        // Wait (on the pipe, not on a clock) until the child has its state.
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                stdout.read_line(&mut line).unwrap() > 0,
                "run {run}: the child exited before it was ready"
            );
            if line.trim_end().ends_with(READY) {
                break;
            }
        }
        let delay = rng.next() % (MAX_DELAY_US + 1);
        std::thread::sleep(Duration::from_micros(delay));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let mut rest = String::new();
        stdout.read_to_string(&mut rest).unwrap();
        let last_done = rest
            .lines()
            .filter_map(|l| l.strip_prefix("done "))
            .filter_map(|k| k.parse::<u64>().ok())
            .next_back();
        let allowed = match last_done {
            None => vec![0, count_after(0)],
            Some(k) => vec![count_after(k), count_after(k + 1)],
        };
        changes_seen += last_done.map_or(0, |k| k + 1);

        // A kill between creating the temporary file and renaming it leaves
        // that file behind; the state file itself is always whole.
        killed_mid_write += std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                name.to_string_lossy().ends_with(".tmp")
            })
            .count()
            .min(1);
        let b = SimulatedBackend::with_state_file(&spec(), &state)
            .unwrap_or_else(|e| panic!("run {run} (delay {delay} µs): {e}"));
        let tmp_left = std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                name.to_string_lossy().ends_with(".tmp")
            })
            .count();
        assert_eq!(
            tmp_left, 0,
            "run {run}: the next start removes stale temporary files"
        );
        assert_eq!(b.device_count().unwrap(), 8, "run {run}");
        assert!(b.mig_mode(0).unwrap().current, "run {run}");
        let gis = b.gpu_instances(0).unwrap();
        assert!(
            allowed.contains(&gis.len()),
            "run {run} (delay {delay} µs): {} instances after change {last_done:?}, expected one of {allowed:?}",
            gis.len()
        );
        // The lock died with the child: the state is still writable.
        for gi in &gis {
            b.destroy_gpu_instance(0, gi.id).unwrap();
        }
        assert!(b.gpu_instances(0).unwrap().is_empty());
    }
    eprintln!(
        "{RUNS} SIGKILLs after 0–{MAX_DELAY_US} µs: every state file loaded with the expected instances; {changes_seen} changes completed in all, {killed_mid_write} kills left a half-written temporary file"
    );
}
