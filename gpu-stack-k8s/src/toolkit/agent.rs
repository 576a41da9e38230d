//! What the toolkit agent does to a node: plan the runtime's drop-in and the
//! main config's `imports` line (decided in `gpu_stack_core::toolkit`), write
//! them atomically with a record of the user's original file, restart the
//! runtime only when its effective configuration changes, and undo it all.
//!
//! Order of writes, so a kill at any instant leaves a node that works and a
//! record that undoes everything: the drop-in first (unread until imported),
//! then the record (the user's original main config), then the main config.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use gpu_stack_core::toolkit::containerd::{self, Gap};
use gpu_stack_core::toolkit::layout::{self, Distribution, Target};
use gpu_stack_core::toolkit::{ConfigError, RuntimeOptions, crio, runtime_to_signal};
use gpu_stack_nvml::fsutil::write_atomic;
use serde::{Deserialize, Serialize};

use super::cri::{self, CriError};

/// Name of the record kept beside the drop-in (not matched by `*.toml`).
pub const RECORD_FILE: &str = ".gpu-stack-toolkit.json";
/// Largest config file read (containerd configs are a few KiB).
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Which runtime the agent configures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuntimeKind {
    /// containerd 1.7 (config version 2) or 2.x (version 3).
    Containerd,
    /// CRI-O, through `/etc/crio/crio.conf.d`.
    Crio,
}

/// How a changed configuration reaches the runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestartMode {
    /// SIGTERM to the process behind the socket; its service manager starts
    /// it again (containerd has no configuration reload). Needs hostPID.
    Signal,
    /// Write the files only; somebody else restarts the runtime.
    None,
}

impl std::str::FromStr for RestartMode {
    type Err = String;

    /// NVIDIA's `CONTAINERD_RESTART_MODE` values: `signal` and `none`;
    /// `systemd` is refused with what to use instead.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "signal" => Ok(RestartMode::Signal),
            "none" => Ok(RestartMode::None),
            "systemd" => Err(
                "`systemd` is not supported: use `signal` (the runtime's systemd \
                 unit, Restart=always, starts it again) or `none`"
                    .into(),
            ),
            other => Err(format!(
                "unknown restart mode {:?}: use `signal` or `none`",
                gpu_stack_core::echo::clipped(other).to_string()
            )),
        }
    }
}

/// The agent's settings.
#[derive(Debug, Clone)]
pub struct ToolkitConfig {
    /// Where the host's root is seen (`/host` in the pod, `/` on the host).
    pub host_root: PathBuf,
    /// The runtime to configure.
    pub runtime: RuntimeKind,
    /// The runtime's main config file (host path), when not the default.
    pub config: Option<String>,
    /// The runtime's socket (host path), when not the default.
    pub socket: Option<String>,
    /// The drop-in file (host path), when not the layout's default.
    pub drop_in: Option<String>,
    /// What the runtime must provide.
    pub options: RuntimeOptions,
    /// How changes reach the runtime.
    pub restart: RestartMode,
    /// How long a restarted runtime may take to serve again.
    pub restart_timeout: Duration,
}

/// Errors of the agent.
#[derive(Debug, thiserror::Error)]
pub enum ToolkitError {
    /// The config could not be understood or edited.
    #[error("{path}: {source}")]
    Config {
        /// Host path of the file.
        path: String,
        /// Cause.
        source: ConfigError,
    },
    /// The node's layout is one the agent must not edit.
    #[error(transparent)]
    Layout(#[from] layout::LayoutError),
    /// A file could not be read or written.
    #[error("{action} {path}: {reason}; nothing further was changed")]
    Io {
        /// What was being done.
        action: &'static str,
        /// Host path.
        path: String,
        /// Cause.
        reason: String,
    },
    /// Talking to the runtime failed.
    #[error(transparent)]
    Cri(#[from] CriError),
    /// The runtime did not take the configuration; the files were restored.
    #[error("{0}")]
    NotTaken(String),
}

/// One file's change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileChange {
    /// Host path.
    pub path: String,
    /// Content now (None: absent).
    pub before: Option<String>,
    /// Content wanted (None: remove).
    pub after: Option<String>,
}

/// What the agent would do now.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The layout found.
    pub target: Target,
    /// Files to change, in write order.
    pub files: Vec<FileChange>,
    /// What the running runtime lacks (containerd only).
    pub gaps: Vec<Gap>,
    /// The record to keep beside the drop-in, when the main config is edited.
    pub record: Option<Record>,
}

impl Plan {
    /// True when the runtime must be restarted to take the plan.
    pub fn needs_restart(&self) -> bool {
        !self.files.is_empty() || !self.gaps.is_empty()
    }

    /// A unified diff of every file change, for `--dry-run`.
    pub fn diff(&self) -> String {
        let mut out = String::new();
        for f in &self.files {
            let before = f.before.as_deref().unwrap_or("");
            let after = f.after.as_deref().unwrap_or("");
            let from = if f.before.is_some() {
                f.path.as_str()
            } else {
                "/dev/null"
            };
            let to = if f.after.is_some() {
                f.path.as_str()
            } else {
                "/dev/null"
            };
            out.push_str(
                &similar::TextDiff::from_lines(before, after)
                    .unified_diff()
                    .header(from, to)
                    .to_string(),
            );
        }
        out
    }
}

/// What the agent did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Host paths written or removed.
    pub changed: Vec<String>,
    /// Runtime restarts made.
    pub restarts: u32,
}

/// The user's main config before the agent edited it, so removal restores it
/// byte for byte.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Host path of the main config.
    pub main_config: String,
    /// Its content before the first edit (None: the file did not exist).
    pub original: Option<String>,
    /// What the agent wrote there.
    pub written: String,
    /// The `imports` entry the agent added.
    pub import: String,
    /// Whether the agent added the `imports` key itself.
    pub added_key: bool,
}

impl ToolkitConfig {
    fn host(&self, path: &str) -> PathBuf {
        super::host_path(&self.host_root, path)
    }

    fn read(&self, path: &str) -> Result<Option<String>, ToolkitError> {
        let p = self.host(path);
        let io = |reason: String| ToolkitError::Io {
            action: "cannot read",
            path: path.to_string(),
            reason,
        };
        match std::fs::metadata(&p) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(e.to_string())),
            Ok(m) if m.len() > MAX_CONFIG_BYTES => {
                return Err(io(format!(
                    "{} bytes, over the {MAX_CONFIG_BYTES}-byte limit for a runtime config",
                    m.len()
                )));
            }
            Ok(_) => {}
        }
        std::fs::read_to_string(&p)
            .map(Some)
            .map_err(|e| io(e.to_string()))
    }

    fn write(&self, path: &str, content: Option<&str>) -> Result<(), ToolkitError> {
        let p = self.host(path);
        let io = |reason: String| ToolkitError::Io {
            action: "cannot write",
            path: path.to_string(),
            reason,
        };
        match content {
            Some(text) => {
                if let Some(dir) = p.parent() {
                    std::fs::create_dir_all(dir).map_err(|e| io(e.to_string()))?;
                }
                write_atomic(&p, text.as_bytes()).map_err(|e| io(e.to_string()))
            }
            None => match std::fs::remove_file(&p) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(e.to_string())),
                _ => Ok(()),
            },
        }
    }

    /// The layout of this node.
    pub fn target(&self) -> Result<Target, ToolkitError> {
        match self.runtime {
            RuntimeKind::Containerd => {
                let exists = |p: &str| self.host(p).exists();
                let mut t =
                    layout::classify(&exists, self.config.as_deref(), self.socket.as_deref())?;
                if let Some(d) = &self.drop_in {
                    t.drop_in = d.clone();
                }
                Ok(t)
            }
            RuntimeKind::Crio => Ok(Target {
                distribution: Distribution::Plain,
                main_config: self
                    .config
                    .clone()
                    .unwrap_or_else(|| "/etc/crio/crio.conf".into()),
                drop_in: self
                    .drop_in
                    .clone()
                    .unwrap_or_else(|| "/etc/crio/crio.conf.d/99-gpu-stack.toml".into()),
                edit_main: false,
                socket: self
                    .socket
                    .clone()
                    .unwrap_or_else(|| "/var/run/crio/crio.sock".into()),
            }),
        }
    }

    fn record_path(target: &Target) -> String {
        match target.drop_in.rsplit_once('/') {
            Some((dir, _)) => format!("{dir}/{RECORD_FILE}"),
            None => RECORD_FILE.to_string(),
        }
    }

    fn read_record(&self, target: &Target) -> Result<Option<Record>, ToolkitError> {
        let path = Self::record_path(target);
        let Some(text) = self.read(&path)? else {
            return Ok(None);
        };
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| ToolkitError::Io {
                action: "cannot parse the agent's record",
                path,
                reason: format!("{e}; restore the runtime config by hand and delete the record"),
            })
    }

    /// What must change now, reading the files and the running runtime.
    pub async fn plan(&self) -> Result<Plan, ToolkitError> {
        let target = self.target()?;
        let config_err = |path: &str| {
            let path = path.to_string();
            move |source| ToolkitError::Config { path, source }
        };
        let drop_in_now = self.read(&target.drop_in)?;
        let (wanted_drop_in, gaps, main_change, record) = match self.runtime {
            RuntimeKind::Crio => (
                crio::render_drop_in(&self.options, "/usr/bin/runc"),
                Vec::new(),
                None,
                None,
            ),
            RuntimeKind::Containerd => {
                // The user's file first: a config we cannot edit is reported
                // even while the runtime is down.
                let main = self.read(&target.main_config)?;
                let drop_in = containerd::render_drop_in(main.as_deref(), &self.options)
                    .map_err(config_err(&target.main_config))?;
                // A release that cannot take the drop-in is refused before
                // any file is written.
                let runtime = cri::version(&self.host(&target.socket)).await?;
                if runtime.name == "containerd" {
                    let config = containerd::detect_version(main.as_deref())
                        .map_err(config_err(&target.main_config))?;
                    containerd::check_containerd(&runtime.version, config)
                        .map_err(config_err(&target.socket))?;
                }
                let state = cri::status(&self.host(&target.socket)).await?;
                let gaps = match &state.config_json {
                    Some(json) => containerd::effective_gaps(json, &self.options)
                        .map_err(config_err(&target.socket))?,
                    None => Vec::new(),
                };
                // A runtime that already does all we need, without our files,
                // is left alone: nothing to write, nothing to restart.
                if gaps.is_empty() && drop_in_now.is_none() {
                    return Ok(Plan {
                        target,
                        files: Vec::new(),
                        gaps,
                        record: None,
                    });
                }
                let previous = self.read_record(&target)?;
                let mut main_change = None;
                let mut record = previous.clone();
                if target.edit_main
                    && let Some(edited) = containerd::add_import(main.as_deref(), &target.drop_in)
                        .map_err(config_err(&target.main_config))?
                {
                    // Keep the first original: a record from an earlier run
                    // already holds the user's file.
                    let original = match &previous {
                        Some(r) if r.main_config == target.main_config => r.original.clone(),
                        _ => main.clone(),
                    };
                    record = Some(Record {
                        main_config: target.main_config.clone(),
                        added_key: !containerd::has_imports(main.as_deref()),
                        original,
                        written: edited.clone(),
                        import: target.drop_in.clone(),
                    });
                    main_change = Some(FileChange {
                        path: target.main_config.clone(),
                        before: main,
                        after: Some(edited),
                    });
                }
                (drop_in, gaps, main_change, record)
            }
        };
        let mut files = Vec::new();
        if drop_in_now.as_deref() != Some(wanted_drop_in.as_str()) {
            files.push(FileChange {
                path: target.drop_in.clone(),
                before: drop_in_now,
                after: Some(wanted_drop_in),
            });
        }
        files.extend(main_change);
        Ok(Plan {
            target,
            files,
            gaps,
            record,
        })
    }

    /// Carries out `plan`: writes, restarts when needed, and checks that the
    /// runtime took it; if it did not, restores the files as they were.
    pub async fn apply(&self, plan: &Plan) -> Result<Outcome, ToolkitError> {
        let mut out = Outcome::default();
        if !plan.needs_restart() {
            return Ok(out);
        }
        // A record from an earlier run holds the user's original: a rollback
        // puts it back as it was, never drops it.
        let record_path = Self::record_path(&plan.target);
        let record_before = self.read(&record_path)?;
        for f in &plan.files {
            if f.path == plan.target.main_config
                && let Some(r) = &plan.record
            {
                let text = serde_json::to_string_pretty(r).map_err(|e| ToolkitError::Io {
                    action: "cannot render the agent's record for",
                    path: record_path.clone(),
                    reason: e.to_string(),
                })?;
                self.write(&record_path, Some(&text))?;
            }
            self.write(&f.path, f.after.as_deref())?;
            out.changed.push(f.path.clone());
        }
        if self.restart == RestartMode::None {
            tracing::warn!(
                "configuration written; restart the container runtime to apply it (restart mode none)"
            );
            return Ok(out);
        }
        let taken = self.restart_and_check(&plan.target).await;
        match taken {
            Ok(()) => {
                out.restarts = 1;
                Ok(out)
            }
            Err(why) => {
                // Put back what was there, so the runtime is never left on a
                // configuration it refuses.
                for f in plan.files.iter().rev() {
                    self.write(&f.path, f.before.as_deref())?;
                }
                self.write(&record_path, record_before.as_deref())?;
                let restored = self.restart_and_wait(&plan.target).await;
                Err(ToolkitError::NotTaken(format!(
                    "{why}; the previous files were restored{}",
                    match restored {
                        Ok(()) => " and the runtime restarted on them".to_string(),
                        Err(e) => format!(", but the runtime did not come back: {e}"),
                    }
                )))
            }
        }
    }

    async fn restart_and_check(&self, target: &Target) -> Result<(), String> {
        self.restart_and_wait(target)
            .await
            .map_err(|e| e.to_string())?;
        if self.runtime != RuntimeKind::Containerd {
            return Ok(());
        }
        let state = cri::status(&self.host(&target.socket))
            .await
            .map_err(|e| e.to_string())?;
        let Some(json) = state.config_json else {
            return Ok(());
        };
        let gaps = containerd::effective_gaps(&json, &self.options).map_err(|e| e.to_string())?;
        if gaps.is_empty() {
            return Ok(());
        }
        Err(format!(
            "containerd restarted but its effective configuration still lacks: {}; it does not \
             read {} (started with another --config? set CONTAINERD_CONFIG to the file it reads)",
            gaps.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; "),
            target.main_config
        ))
    }

    /// SIGTERM to the runtime, then waits until a new process serves the
    /// socket and reports ready.
    async fn restart_and_wait(&self, target: &Target) -> Result<(), ToolkitError> {
        let socket = self.host(&target.socket);
        // Read twice: a runtime restarting by itself, or a socket handed to
        // another process, must not get a stray signal.
        let first = cri::server_pid(&socket)?;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let second = cri::server_pid(&socket)?;
        let old = runtime_to_signal(first, second)
            .map_err(|refusal| ToolkitError::NotTaken(refusal.to_string()))?;
        tracing::info!(pid = old, socket = %target.socket, "restarting the container runtime");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(old),
            nix::sys::signal::Signal::SIGTERM,
        )
        .map_err(|e| ToolkitError::NotTaken(format!("cannot signal pid {old}: {e}")))?;
        let deadline = Instant::now() + self.restart_timeout;
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if let Ok(pid) = cri::server_pid(&socket)
                && pid != old
                && cri::status(&socket).await.is_ok_and(|s| s.ready)
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(ToolkitError::NotTaken(format!(
                    "the container runtime did not serve {} again within {} s of its restart \
                     (is it run by a service manager that restarts it?)",
                    target.socket,
                    self.restart_timeout.as_secs()
                )));
            }
        }
    }

    /// Plans and applies in one step.
    #[tracing::instrument(level = "debug", name = "toolkit_pass", skip_all)]
    pub async fn configure(&self) -> Result<Outcome, ToolkitError> {
        let plan = self.plan().await?;
        self.apply(&plan).await
    }

    /// What removal would change: the drop-in goes, the main config returns
    /// to the user's original (or, if edited since, loses only our entry).
    pub fn removal(&self) -> Result<Vec<FileChange>, ToolkitError> {
        let target = self.target()?;
        let mut files = Vec::new();
        if let Some(now) = self.read(&target.drop_in)? {
            files.push(FileChange {
                path: target.drop_in.clone(),
                before: Some(now),
                after: None,
            });
        }
        if let Some(r) = self.read_record(&target)? {
            let now = self.read(&r.main_config)?;
            let after = match &now {
                Some(text) if *text == r.written => r.original.clone(),
                Some(text) => Some(
                    containerd::remove_import(text, &r.import, r.added_key).map_err(|source| {
                        ToolkitError::Config {
                            path: r.main_config.clone(),
                            source,
                        }
                    })?,
                ),
                None => None,
            };
            if after != now {
                files.push(FileChange {
                    path: r.main_config.clone(),
                    before: now,
                    after,
                });
            }
        }
        Ok(files)
    }

    /// Undoes the agent's changes and restarts the runtime if any file
    /// changed. The record goes last, so a kill midway can be resumed.
    pub async fn remove(&self) -> Result<Outcome, ToolkitError> {
        let target = self.target()?;
        let files = self.removal()?;
        let mut out = Outcome::default();
        for f in files.iter().rev() {
            self.write(&f.path, f.after.as_deref())?;
            out.changed.push(f.path.clone());
        }
        self.write(&Self::record_path(&target), None)?;
        if !out.changed.is_empty() && self.restart == RestartMode::Signal {
            self.restart_and_wait(&target).await?;
            out.restarts = 1;
        }
        Ok(out)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::toolkit::fake_runtime::FakeRuntime;

    const PLAIN: &str = "# the user's containerd\nversion = 2\n\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"pause:3.10\"\n  [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\n    SystemdCgroup = true\n";
    pub(crate) const CDI_OFF: &str = r#"{"enableCDI": false, "cdiSpecDirs": ["/etc/cdi", "/var/run/cdi"], "containerd": {"runtimes": {"runc": {"runtimeType": "io.containerd.runc.v2"}}}}"#;
    pub(crate) const CDI_ON: &str = r#"{"enableCDI": true, "cdiSpecDirs": ["/etc/cdi", "/var/run/cdi"], "containerd": {"runtimes": {"runc": {"runtimeType": "io.containerd.runc.v2"}, "nvidia": {"runtimeType": "io.containerd.runc.v2"}}}}"#;

    struct Node {
        root: tempfile::TempDir,
        runtime: FakeRuntime,
        config: ToolkitConfig,
    }

    impl Node {
        fn file(&self, path: &str) -> Option<String> {
            std::fs::read_to_string(self.root.path().join(path.trim_start_matches('/'))).ok()
        }
        fn set_effective(&self, json: &str) {
            self.runtime.set(json);
        }
    }

    /// The agent's settings on a test host root: default paths, the
    /// `nvidia` handler, no restarts.
    fn settings(root: &std::path::Path, runtime: RuntimeKind) -> ToolkitConfig {
        ToolkitConfig {
            host_root: root.to_path_buf(),
            runtime,
            config: None,
            socket: None,
            drop_in: None,
            options: RuntimeOptions {
                cdi_spec_dirs: vec!["/etc/cdi".into(), "/var/run/cdi".into()],
                runtime_handler: Some("nvidia".into()),
            },
            restart: RestartMode::None,
            restart_timeout: Duration::from_secs(5),
        }
    }

    async fn node(main: Option<&str>, effective: &str) -> Node {
        let root = tempfile::tempdir().unwrap();
        let etc = root.path().join("etc/containerd");
        std::fs::create_dir_all(&etc).unwrap();
        if let Some(text) = main {
            std::fs::write(etc.join("config.toml"), text).unwrap();
        }
        let runtime = FakeRuntime::serve(
            &root.path().join("run/containerd/containerd.sock"),
            effective,
        );
        let config = settings(root.path(), RuntimeKind::Containerd);
        Node {
            root,
            runtime,
            config,
        }
    }

    const DROP_IN: &str = "/etc/containerd/conf.d/99-gpu-stack.toml";
    const MAIN: &str = "/etc/containerd/config.toml";

    #[tokio::test]
    async fn configures_once_then_changes_nothing_and_removal_restores_the_users_file() {
        let n = node(Some(PLAIN), CDI_OFF).await;
        let plan = n.config.plan().await.unwrap();
        assert!(plan.needs_restart());
        assert_eq!(plan.files.len(), 2, "drop-in and main config");
        let diff = plan.diff();
        assert!(diff.contains("+imports"), "{diff}");
        assert!(n.file(DROP_IN).is_none(), "planning writes nothing");

        let out = n.config.apply(&plan).await.unwrap();
        assert_eq!(out.changed, vec![DROP_IN.to_string(), MAIN.to_string()]);
        let drop_in = n.file(DROP_IN).unwrap();
        assert!(drop_in.contains("enable_cdi = true"), "{drop_in}");
        assert!(
            drop_in.contains("SystemdCgroup = true"),
            "the user's CRI table is carried: {drop_in}"
        );
        let edited = n.file(MAIN).unwrap();
        assert!(edited.contains(DROP_IN) && edited.contains("SystemdCgroup = true"));

        // The runtime restarted onto it: nothing more to do.
        n.set_effective(CDI_ON);
        let again = n.config.plan().await.unwrap();
        assert!(!again.needs_restart(), "{:?}", again.files);
        assert_eq!(n.config.apply(&again).await.unwrap(), Outcome::default());

        let removed = n.config.remove().await.unwrap();
        assert_eq!(removed.changed.len(), 2);
        assert_eq!(n.file(MAIN).as_deref(), Some(PLAIN), "byte for byte");
        assert!(n.file(DROP_IN).is_none());
        assert!(
            n.file(&format!("/etc/containerd/conf.d/{RECORD_FILE}"))
                .is_none()
        );
        assert!(
            n.config.removal().unwrap().is_empty(),
            "a second removal has nothing to do"
        );
    }

    #[tokio::test]
    async fn a_containerd_release_that_cannot_take_the_drop_in_is_refused_with_nothing_written() {
        let n = node(Some(PLAIN), CDI_OFF).await;
        for version in ["v1.6.20", "v3.0.0"] {
            n.runtime.set_version(version);
            let err = n.config.configure().await.unwrap_err().to_string();
            assert!(
                err.contains(version) && err.contains("nothing was changed"),
                "{err}"
            );
            assert_eq!(n.file(MAIN).as_deref(), Some(PLAIN));
            assert!(n.file(DROP_IN).is_none());
        }
        // containerd 1.7 does not read a version 3 config.
        let v3 = node(Some("version = 3\n"), CDI_OFF).await;
        v3.runtime.set_version("1.7.35");
        let err = v3.config.configure().await.unwrap_err().to_string();
        assert!(err.contains("reads config version 2"), "{err}");
        assert!(v3.file(DROP_IN).is_none());
        n.runtime.set_version("v2.4.2");
        n.config.configure().await.unwrap();
        assert!(n.file(DROP_IN).is_some());
    }

    #[tokio::test]
    async fn a_missing_main_config_is_created_and_removed_again() {
        let n = node(None, CDI_OFF).await;
        n.config.configure().await.unwrap();
        assert!(n.file(MAIN).unwrap().contains(DROP_IN));
        n.config.remove().await.unwrap();
        assert!(n.file(MAIN).is_none(), "the file the agent created goes");
    }

    #[tokio::test]
    async fn removal_after_the_user_edited_the_file_keeps_their_edit() {
        let n = node(Some(PLAIN), CDI_OFF).await;
        n.config.configure().await.unwrap();
        let edited = n.file(MAIN).unwrap();
        let theirs = format!("{edited}\n# added by the user later\n");
        std::fs::write(n.root.path().join("etc/containerd/config.toml"), &theirs).unwrap();
        n.config.remove().await.unwrap();
        let now = n.file(MAIN).unwrap();
        assert!(now.contains("# added by the user later"), "{now}");
        assert!(!now.contains(DROP_IN), "{now}");
    }

    #[tokio::test]
    async fn a_runtime_that_already_reads_cdi_is_left_alone() {
        let n = node(Some(PLAIN), CDI_ON).await;
        let plan = n.config.plan().await.unwrap();
        assert!(plan.files.is_empty() && !plan.needs_restart());
        assert_eq!(n.config.configure().await.unwrap(), Outcome::default());
        assert_eq!(n.file(MAIN).as_deref(), Some(PLAIN));
    }

    #[tokio::test]
    async fn a_kill_between_the_drop_in_and_the_main_config_is_undone_cleanly() {
        let n = node(Some(PLAIN), CDI_OFF).await;
        let plan = n.config.plan().await.unwrap();
        // As if killed after the drop-in and the record, before the main config.
        n.config
            .write(DROP_IN, plan.files[0].after.as_deref())
            .unwrap();
        let record = serde_json::to_string(plan.record.as_ref().unwrap()).unwrap();
        n.config
            .write(
                &format!("/etc/containerd/conf.d/{RECORD_FILE}"),
                Some(&record),
            )
            .unwrap();
        // A restarted agent finishes the job...
        n.config.configure().await.unwrap();
        assert!(n.file(MAIN).unwrap().contains(DROP_IN));
        // ...and removal still gives back the user's original.
        n.config.remove().await.unwrap();
        assert_eq!(n.file(MAIN).as_deref(), Some(PLAIN));
    }

    #[tokio::test]
    async fn bad_configs_are_refused_and_nothing_is_written() {
        let huge = "# x\n".repeat(300_000);
        for bad in [
            "version = 2\n[plugins\n",
            "[plugins.cri]\n  x = 1\n",
            huge.as_str(),
        ] {
            let n = node(Some(bad), CDI_OFF).await;
            let err = n.config.configure().await.unwrap_err().to_string();
            assert!(err.contains("/etc/containerd/config.toml"), "{err}");
            assert!(
                err.len() < 2_000,
                "the error is capped: {} bytes",
                err.len()
            );
            assert!(n.file(DROP_IN).is_none(), "{err}");
            assert_eq!(n.file(MAIN).as_deref(), Some(bad));
        }
    }

    #[tokio::test]
    async fn an_unreachable_runtime_names_its_socket() {
        let n = node(Some(PLAIN), CDI_OFF).await;
        let cfg = ToolkitConfig {
            socket: Some("/run/nowhere.sock".into()),
            ..n.config.clone()
        };
        let err = cfg.configure().await.unwrap_err().to_string();
        assert!(
            err.contains("nowhere.sock") && err.contains("CONTAINERD_SOCKET"),
            "{err}"
        );
        assert!(n.file(DROP_IN).is_none());
    }

    #[tokio::test]
    async fn a_k3s_node_is_refused_with_the_path_and_nothing_is_written() {
        let n = node(Some(PLAIN), CDI_OFF).await;
        let k3s = n
            .root
            .path()
            .join("var/lib/rancher/k3s/agent/etc/containerd");
        std::fs::create_dir_all(&k3s).unwrap();
        std::fs::write(k3s.join("config.toml"), "version = 2\n").unwrap();
        let err = n.config.configure().await.unwrap_err().to_string();
        assert!(
            err.contains("/var/lib/rancher/k3s/agent/etc/containerd/config.toml"),
            "{err}"
        );
        assert!(n.file(DROP_IN).is_none());
        assert_eq!(n.file(MAIN).as_deref(), Some(PLAIN));
    }

    #[tokio::test]
    async fn cri_o_gets_only_a_drop_in_with_the_handler() {
        let root = tempfile::tempdir().unwrap();
        let cfg = settings(root.path(), RuntimeKind::Crio);
        let out = cfg.configure().await.unwrap();
        assert_eq!(
            out.changed,
            vec!["/etc/crio/crio.conf.d/99-gpu-stack.toml".to_string()]
        );
        let text =
            std::fs::read_to_string(root.path().join("etc/crio/crio.conf.d/99-gpu-stack.toml"))
                .unwrap();
        assert!(text.contains("[crio.runtime.runtimes.nvidia]"), "{text}");
        assert!(
            cfg.plan().await.unwrap().files.is_empty(),
            "a second run writes nothing"
        );
        cfg.remove().await.unwrap();
        assert!(
            !root
                .path()
                .join("etc/crio/crio.conf.d/99-gpu-stack.toml")
                .exists()
        );
    }

    #[test]
    fn restart_modes_parse_and_refusals_say_what_to_use() {
        assert_eq!("signal".parse::<RestartMode>(), Ok(RestartMode::Signal));
        assert_eq!("none".parse::<RestartMode>(), Ok(RestartMode::None));
        for bad in ["systemd", "reboot"] {
            let err = bad.parse::<RestartMode>().unwrap_err();
            assert!(err.contains("signal") && err.contains("none"), "{err}");
        }
    }
}
