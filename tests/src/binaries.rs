//! The gpu-stack binaries the end-to-end tests run as processes. They are the
//! ones cargo built next to the test executable (`target/<profile>/`):
//! `cargo xtask test` and `cargo test --workspace` build every binary of the
//! workspace; a plain `cargo test -p gpu-stack-e2e` does not, and then the
//! error says which `cargo build` to run.
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

/// A binary of the workspace could not be found.
#[derive(Debug, thiserror::Error)]
pub enum BinaryError {
    /// The running test is not where cargo puts test executables.
    #[error(
        "cannot locate the target directory from the test executable {0}; run the test \
         through cargo (`cargo xtask test` or `cargo test -p gpu-stack-e2e`)"
    )]
    UnexpectedLocation(PathBuf),
    /// The binary has not been built.
    #[error(
        "{path} is missing: build it with `cargo build -p gpu-stack-bins --bin {name}` \
         (`cargo xtask test` builds it)"
    )]
    Missing {
        /// Where it was looked for.
        path: PathBuf,
        /// The binary's name.
        name: String,
    },
}

/// Path of the workspace binary `name` (e.g. `gpu-feature-discovery`) built
/// in the same target directory and profile as the running test.
pub fn workspace_binary(name: &str) -> Result<PathBuf, BinaryError> {
    let exe = std::env::current_exe()
        .map_err(|_| BinaryError::UnexpectedLocation(PathBuf::from("<unknown>")))?;
    // target/<profile>/deps/<test>-<hash> -> target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .ok_or_else(|| BinaryError::UnexpectedLocation(exe.clone()))?;
    let path = dir.join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(BinaryError::Missing {
            path,
            name: name.to_string(),
        })
    }
}

/// Stopping an [`AgentProcess`] failed.
#[derive(Debug, thiserror::Error)]
pub enum StopError {
    /// `kill -TERM` could not be run or did not succeed.
    #[error("sending SIGTERM to {name} (pid {pid}): {message}")]
    Signal {
        /// The binary's name.
        name: String,
        /// Its process id.
        pid: u32,
        /// What went wrong.
        message: String,
    },
    /// The process was still running 10 s after SIGTERM.
    #[error("{0} did not stop within 10s of SIGTERM")]
    StillRunning(String),
}

/// A gpu-stack binary running for a test with its stderr in a log file;
/// killed if the test ends without stopping it.
pub struct AgentProcess {
    name: String,
    child: Child,
    log: PathBuf,
}

impl AgentProcess {
    /// Wraps the spawned `child` of binary `name` whose stderr goes to `log`.
    pub fn new(name: impl Into<String>, child: Child, log: PathBuf) -> Self {
        AgentProcess {
            name: name.into(),
            child,
            log,
        }
    }

    /// Starts the workspace's `binary` with `args`, as on a node: info
    /// logging, stderr appended to `log`, and no `NODE_NAME` from the test's
    /// environment (the node is always given by flag).
    pub fn spawn<S: AsRef<std::ffi::OsStr>>(
        binary: &str,
        args: &[S],
        log: PathBuf,
    ) -> anyhow::Result<Self> {
        use anyhow::Context;
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("opening {}", log.display()))?;
        let child = Command::new(workspace_binary(binary)?)
            .args(args)
            .env_remove("NODE_NAME")
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {binary}"))?;
        Ok(AgentProcess::new(binary, child, log))
    }

    /// Where its stderr goes.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last 30 lines of the log, for failure messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// SIGTERM, then wait (bounded) for a clean exit.
    pub fn terminate(&mut self) -> Result<ExitStatus, StopError> {
        self.terminate_within(Duration::from_secs(10))
    }

    /// SIGTERM, then waits at most `within` for the exit.
    pub fn terminate_within(&mut self, within: Duration) -> Result<ExitStatus, StopError> {
        let pid = self.child.id();
        let signal_error = |message: String| StopError::Signal {
            name: self.name.clone(),
            pid,
            message,
        };
        let status = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .map_err(|e| signal_error(format!("running kill -TERM: {e}")))?;
        if !status.success() {
            return Err(signal_error(format!("kill -TERM failed: {status}")));
        }
        let deadline = std::time::Instant::now() + within;
        while std::time::Instant::now() < deadline {
            match self.child.try_wait() {
                Ok(Some(status)) => return Ok(status),
                Ok(None) => {}
                Err(e) => return Err(signal_error(format!("waiting for the exit: {e}"))),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(StopError::StillRunning(self.name.clone()))
    }
}

impl AgentProcess {
    /// SIGKILL, as a crash or the OOM killer ends a process, and reap it.
    pub fn kill(&mut self) -> std::io::Result<ExitStatus> {
        self.child.kill()?;
        self.child.wait()
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_binary_names_the_build_command() {
        let err = workspace_binary("no-such-gpu-stack-binary").unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("cargo build -p gpu-stack-bins --bin no-such-gpu-stack-binary"),
            "{msg}"
        );
    }

    #[test]
    fn terminate_stops_the_process_and_keeps_its_log() {
        let dir =
            std::env::temp_dir().join(format!("gpu-stack-agent-process-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("agent.log");
        let child = Command::new("sh")
            .args(["-c", "echo started >&2; exec sleep 30"])
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut process = AgentProcess::new("sleeper", child, log);
        let mut tail = String::new();
        for _ in 0..100 {
            tail = process.log_tail();
            if !tail.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(tail, "started");
        let status = process.terminate().unwrap();
        assert!(
            !status.success(),
            "SIGTERM ends sleep without success: {status}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
