//! The `gpu-mig-manager` process loop: watches its own Node (by field selector
//! `metadata.name=<node>`, metadata only) and the mig-parted config file, and
//! runs one [`reconcile`] pass whenever the `nvidia.com/mig.config` label
//! changes, the file's content changes, or at start (the watch's initial list
//! counts as a change). A pass that hit a cluster API error is retried after a
//! pause. A pass that ends `rebooting` runs the configured reboot hook.
//!
//! Stopping (the `shutdown` future resolving, e.g. on SIGTERM) drops a pass at
//! its next await point; the pause record on the node lets the next start
//! finish what this one began.
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gpu_stack_core::backend::GpuBackend;
use gpu_stack_core::migmanager::{MIG_CONFIG_LABEL, MigConfigState};
use gpu_stack_core::migparted::MigPartedConfig;
use gpu_stack_nvml::migapply::NoProcesses;
use k8s_openapi::api::core::v1::Node;
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};

use super::kube_node::KubeNode;
use super::{ManagerOptions, PassResult, reconcile};

/// Settings of the manager process.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// Settings of each pass (node name, timeouts, force, signal file).
    pub manager: ManagerOptions,
    /// mig-parted config file (`default` for NVIDIA's shipped file).
    pub config_file: PathBuf,
    /// How often the config file is re-read for changes.
    pub config_poll: Duration,
    /// Pause before retrying a pass that failed talking to the cluster.
    pub retry: Duration,
    /// Shell command run (`sh -c`) when a pass ends `rebooting`; `NODE_NAME`
    /// and `MIG_CONFIG` are set in its environment.
    pub reboot_hook: Option<String>,
    /// This replica's name in Events (the pod name).
    pub instance: Option<String>,
}

/// Why the manager process stopped.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The config file could not be read or parsed at start.
    #[error(
        "mig-parted config file {path}: {detail}; fix the file (or pass `default` for NVIDIA's shipped configs)"
    )]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// The node watch ended, which it only does when the client is gone.
    #[error("the watch of node {node} ended; restart the manager")]
    WatchEnded {
        /// The node.
        node: String,
    },
}

/// A loaded config and the text it came from (to notice changes).
#[derive(Debug, Clone)]
pub struct LoadedConfig {
    /// The file's text (empty for the built-in default).
    pub text: String,
    /// The parsed config.
    pub config: MigPartedConfig,
}

/// Reads and parses a mig-parted config file; `default` is NVIDIA's shipped file.
pub fn load_config(path: &Path) -> Result<LoadedConfig, AgentError> {
    let err = |detail: String| AgentError::Config {
        path: path.to_path_buf(),
        detail,
    };
    if path == Path::new("default") {
        let config = MigPartedConfig::default_config().map_err(|e| err(e.to_string()))?;
        return Ok(LoadedConfig {
            text: String::new(),
            config,
        });
    }
    let text = std::fs::read_to_string(path).map_err(|e| err(format!("cannot read it: {e}")))?;
    let config = MigPartedConfig::from_yaml(&text).map_err(|e| err(e.to_string()))?;
    Ok(LoadedConfig { text, config })
}

/// Watches the config file: yields a new config when the content changed and
/// parses; a bad edit is logged once and the previous config stays in use.
#[derive(Debug)]
pub struct ConfigWatch {
    path: PathBuf,
    current: LoadedConfig,
    last_bad: Option<String>,
}

impl ConfigWatch {
    /// Starts from an already loaded config.
    pub fn new(path: PathBuf, current: LoadedConfig) -> Self {
        Self {
            path,
            current,
            last_bad: None,
        }
    }

    /// The config in use.
    pub fn config(&self) -> &MigPartedConfig {
        &self.current.config
    }

    /// Re-reads the file; `true` when a new, valid config is now in use.
    pub fn poll(&mut self) -> bool {
        if self.path == Path::new("default") {
            return false;
        }
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) => {
                let note = format!("unreadable: {e}");
                if self.last_bad.as_deref() != Some(note.as_str()) {
                    tracing::warn!(path = %self.path.display(), error = %e,
                        "cannot re-read the mig-parted config file; keeping the previous config");
                    self.last_bad = Some(note);
                }
                return false;
            }
        };
        if text == self.current.text || self.last_bad.as_deref() == Some(text.as_str()) {
            return false;
        }
        match MigPartedConfig::from_yaml(&text) {
            Ok(config) => {
                tracing::info!(path = %self.path.display(), "mig-parted config file changed; reloaded");
                self.current = LoadedConfig { text, config };
                self.last_bad = None;
                true
            }
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e,
                    "the changed mig-parted config file does not parse; keeping the previous config");
                self.last_bad = Some(text);
                false
            }
        }
    }
}

/// Runs the manager until `shutdown` resolves.
pub async fn run(
    client: Client,
    backend: Arc<dyn GpuBackend>,
    opts: AgentOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), AgentError> {
    let node_name = opts.manager.node.clone();
    let mut config = ConfigWatch::new(opts.config_file.clone(), load_config(&opts.config_file)?);
    let api = KubeNode::new(client.clone(), opts.instance.clone());
    let nodes: Api<PartialObjectMeta<Node>> = Api::all(client);
    let watch_cfg = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
    let mut changes = watcher(nodes, watch_cfg)
        .default_backoff()
        .applied_objects()
        .boxed();
    let mut ticker = tokio::time::interval(opts.config_poll.max(Duration::from_millis(10)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    tokio::pin!(shutdown);

    // `None` until the watch's first answer: that answer triggers the start pass.
    let mut seen: Option<Option<String>> = None;
    let mut dirty = false;
    let mut retry_at: Option<tokio::time::Instant> = None;
    tracing::info!(node = %node_name, config = %opts.config_file.display(), backend = backend.name(),
        "MIG manager started");
    loop {
        if dirty {
            dirty = false;
            retry_at = None;
            let selected = seen.clone().flatten();
            let pass = reconcile(
                &api,
                backend.as_ref(),
                config.config(),
                &opts.manager,
                &NoProcesses,
            );
            let result = tokio::select! {
                r = pass => r,
                () = &mut shutdown => {
                    tracing::info!("stopping during a pass; the next start finishes it");
                    return Ok(());
                }
            };
            match result {
                Ok(PassResult::NoConfig) => {
                    tracing::info!(node = %node_name, "no {MIG_CONFIG_LABEL} label; nothing to do");
                }
                Ok(PassResult::State(state, reason)) => {
                    report(
                        &api,
                        &node_name,
                        selected.as_deref(),
                        state,
                        reason.as_deref(),
                    )
                    .await;
                    if state == MigConfigState::Rebooting {
                        run_reboot_hook(&opts, selected.as_deref()).await;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?opts.retry, "MIG manager pass failed; retrying");
                    retry_at = Some(tokio::time::Instant::now() + opts.retry);
                }
            }
        }
        let retry_sleep =
            tokio::time::sleep_until(retry_at.unwrap_or_else(tokio::time::Instant::now));
        tokio::select! {
            () = &mut shutdown => return Ok(()),
            change = changes.next() => match change {
                Some(Ok(meta)) => {
                    let value = meta.labels().get(MIG_CONFIG_LABEL).cloned();
                    if seen.as_ref() != Some(&value) {
                        tracing::info!(node = %node_name, selected = ?value, "{MIG_CONFIG_LABEL} changed");
                        seen = Some(value);
                        dirty = true;
                    }
                }
                Some(Err(e)) => tracing::warn!(error = %e, "node watch error; the watch retries"),
                None => return Err(AgentError::WatchEnded { node: node_name }),
            },
            _ = ticker.tick() => {
                // The label is not known before the first watch answer; that
                // answer runs a pass with the new config anyway.
                if config.poll() && seen.is_some() {
                    dirty = true;
                }
            }
            () = retry_sleep, if retry_at.is_some() => dirty = true,
        }
    }
}

async fn report(
    api: &KubeNode,
    node: &str,
    selected: Option<&str>,
    state: MigConfigState,
    reason: Option<&str>,
) {
    match state {
        MigConfigState::Failed => tracing::error!(node, config = ?selected,
            reason = reason.unwrap_or(""), "MIG config failed"),
        _ => tracing::info!(node, config = ?selected, state = %state, "MIG manager pass done"),
    }
    if let Err(e) = api.record_outcome(node, selected, state, reason).await {
        tracing::warn!(error = %e, "could not publish the Event (the state label is set)");
    }
}

async fn run_reboot_hook(opts: &AgentOptions, selected: Option<&str>) {
    let Some(hook) = &opts.reboot_hook else {
        tracing::warn!(
            "a MIG mode change waits for a GPU reset the driver refused: reboot the node; \
             the manager resumes at start (or set --reboot-hook)"
        );
        return;
    };
    tracing::info!(hook = %hook, "running the reboot hook");
    let status = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(hook)
        .env("NODE_NAME", &opts.manager.node)
        .env("MIG_CONFIG", selected.unwrap_or(""))
        .status()
        .await;
    match status {
        Ok(s) if s.success() => tracing::info!("reboot hook finished"),
        Ok(s) => tracing::error!(status = %s, hook = %hook, "reboot hook failed"),
        Err(e) => tracing::error!(error = %e, hook = %hook, "could not run the reboot hook"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: &str = "version: v1\nmig-configs:\n  all-disabled:\n    - devices: all\n      mig-enabled: false\n";
    const TWO: &str = "version: v1\nmig-configs:\n  all-disabled:\n    - devices: all\n      mig-enabled: false\n  all-enabled:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {}\n";

    #[test]
    fn default_is_the_shipped_file() {
        let c = load_config(Path::new("default")).unwrap();
        assert!(c.config.get("all-1g.10gb").is_some());
    }

    #[test]
    fn missing_or_bad_file_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.yaml");
        let e = load_config(&missing).unwrap_err().to_string();
        assert!(e.contains("nope.yaml") && e.contains("cannot read"), "{e}");
        let bad = dir.path().join("bad.yaml");
        std::fs::write(&bad, "mig-configs: [").unwrap();
        let e = load_config(&bad).unwrap_err().to_string();
        assert!(e.contains("bad.yaml"), "{e}");
    }

    #[test]
    fn watch_reloads_changes_and_keeps_the_old_config_on_a_bad_edit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.yaml");
        std::fs::write(&path, ONE).unwrap();
        let mut w = ConfigWatch::new(path.clone(), load_config(&path).unwrap());
        assert!(!w.poll(), "unchanged content is not a change");
        std::fs::write(&path, TWO).unwrap();
        assert!(w.poll());
        assert!(w.config().get("all-enabled").is_some());
        std::fs::write(&path, "mig-configs: [").unwrap();
        assert!(!w.poll());
        assert!(!w.poll(), "a bad edit is reported once");
        assert!(w.config().get("all-enabled").is_some(), "old config kept");
        std::fs::remove_file(&path).unwrap();
        assert!(!w.poll());
        std::fs::write(&path, ONE).unwrap();
        assert!(w.poll());
        assert!(w.config().get("all-enabled").is_none());
    }
}
