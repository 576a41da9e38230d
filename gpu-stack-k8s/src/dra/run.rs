//! The `gpu-dra-plugin` process: refuses a node the MIG manager owns, starts
//! the node driver, publishes the node's ResourceSlices (again whenever the
//! GPUs change), releases claims the API server no longer has, and serves
//! the kubelet until shutdown.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gpu_stack_core::backend::GpuBackend;
use gpu_stack_core::cdi::HostFiles;
use gpu_stack_core::dra::devices::GpuDevices;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, ListParams};

use super::node::{KubeAllocations, NodeDriver, NodeDriverConfig, mig_manager_owns};
use super::slices::{SliceError, SliceOwner, node_slices, publish, server_slice_shape};
use crate::kubelet::dra::DraPlugin;

/// What the process does.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Driver name.
    pub driver: String,
    /// This node.
    pub node: String,
    /// Directory of the plugin's DRA socket (`<kubelet>/plugins/<driver>`).
    pub plugin_dir: PathBuf,
    /// The kubelet's plugin registry directory.
    pub registry_dir: PathBuf,
    /// Checkpoint file.
    pub checkpoint: PathBuf,
    /// CDI spec directory.
    pub cdi_dir: PathBuf,
    /// Host files the claim specs mount.
    pub host: HostFiles,
    /// MIG capability minors file.
    pub mig_minors: Option<PathBuf>,
    /// Reset GPUs for MIG mode changes.
    pub reset_gpus: bool,
    /// How often the GPUs are read again for the slices.
    pub rescan: Duration,
}

/// Why the process stopped.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The node's GPU layout belongs to the MIG manager.
    #[error("{0}")]
    Refused(String),
    /// The API server could not be used.
    #[error("node {node}: {message}")]
    Api {
        /// Node.
        node: String,
        /// What failed.
        message: String,
    },
    /// The node driver could not start.
    #[error(transparent)]
    Driver(#[from] super::node::NodeDriverError),
    /// Slices could not be published.
    #[error(transparent)]
    Slices(#[from] super::slices::SliceError),
    /// The kubelet side failed.
    #[error(transparent)]
    Serve(#[from] crate::kubelet::dra::DraServeError),
}

/// Runs until `shutdown` completes.
pub async fn run(
    options: RunOptions,
    client: kube::Client,
    backend: Arc<dyn GpuBackend>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let nodes: Api<Node> = Api::all(client.clone());
    let node = nodes.get(&options.node).await.map_err(|e| RunError::Api {
        node: options.node.clone(),
        message: format!("reading the Node: {e}"),
    })?;
    let labels = node.metadata.labels.clone().unwrap_or_default();
    if let Some(reason) = mig_manager_owns(&options.node, &labels) {
        return Err(RunError::Refused(reason));
    }
    let (_, shape) = server_slice_shape(&client, &options.node).await?;
    let owner = SliceOwner {
        node: options.node.clone(),
        node_uid: node.metadata.uid.clone(),
    };
    let driver = Arc::new(
        NodeDriver::start(
            NodeDriverConfig {
                driver: options.driver.clone(),
                node: options.node.clone(),
                checkpoint: options.checkpoint.clone(),
                cdi_dir: options.cdi_dir.clone(),
                host: options.host.clone(),
                mig_minors: options.mig_minors.clone(),
                reset_gpus: options.reset_gpus,
            },
            backend,
            KubeAllocations {
                client: client.clone(),
                driver: options.driver.clone(),
                pool: options.node.clone(),
            },
        )
        .await?,
    );
    // The pool generation goes up whenever the devices change, also across
    // restarts: start above what the API server holds.
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let existing = slices
        .list(&ListParams::default().fields(&format!(
            "spec.nodeName={},spec.driver={}",
            options.node, options.driver
        )))
        .await
        .map_err(|e| RunError::Api {
            node: options.node.clone(),
            message: format!("listing ResourceSlices: {e}"),
        })?;
    let mut generation = existing
        .items
        .iter()
        .map(|s| s.spec.pool.generation)
        .max()
        .unwrap_or(0)
        + 1;
    let mut published: Vec<GpuDevices> = driver.published().await;
    let writes = publish_checked(
        &client,
        &options.driver,
        &options.node,
        &node_slices(&options.driver, &owner, generation, shape, &published),
    )
    .await?;
    let devices: usize = published.iter().map(|g| g.devices.len()).sum();
    tracing::info!(node = %options.node, gpus = published.len(), devices, generation, writes, "published ResourceSlices");
    for g in published.iter().filter_map(|g| g.mig_left_out.as_ref()) {
        tracing::warn!("{g}");
    }

    let plugin = DraPlugin::new(&options.driver, &options.plugin_dir, &options.registry_dir)?;
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let serving = {
        let driver = SharedDriver(driver.clone());
        let mut rx = stop_tx.subscribe();
        tokio::spawn(async move {
            plugin
                .serve(driver, async move {
                    let _ = rx.wait_for(|s| *s).await;
                })
                .await
        })
    };
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    loop {
        // Claims deleted while the plugin or the kubelet was down give
        // their GPUs back (at start, then on every rescan).
        driver.release_orphans().await;
        tokio::select! {
            _ = stop_rx.wait_for(|s| *s) => break,
            _ = tokio::time::sleep(options.rescan) => {}
        }
        match driver.refresh().await {
            Ok(now) if now != published => {
                generation += 1;
                let slices = node_slices(&options.driver, &owner, generation, shape, &now);
                match publish_checked(&client, &options.driver, &options.node, &slices).await {
                    Ok(_) => {
                        tracing::info!(
                            generation,
                            "the GPUs changed; ResourceSlices published again"
                        );
                        published = now;
                    }
                    Err(e @ RunError::Slices(SliceError::CountersDropped { .. })) => return Err(e),
                    Err(e) => {
                        tracing::warn!(error = %e, "publishing ResourceSlices failed; retrying")
                    }
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "reading the GPUs failed; the slices stay as they are")
            }
        }
    }
    match serving.await {
        Ok(result) => result.map_err(RunError::from),
        Err(e) => Err(RunError::Api {
            node: options.node,
            message: format!("the kubelet service task failed: {e}"),
        }),
    }
}

/// Publishes, and where the API server dropped the counters, removes every
/// slice of the driver on the node again: devices without their counters
/// must not stay published.
async fn publish_checked(
    client: &kube::Client,
    driver: &str,
    node: &str,
    slices: &[ResourceSlice],
) -> Result<usize, RunError> {
    match publish(client, driver, node, slices).await {
        Err(dropped @ SliceError::CountersDropped { .. }) => {
            if let Err(e) = publish(client, driver, node, &[]).await {
                tracing::error!(error = %e, "removing the slices after the counters were dropped failed");
            }
            Err(dropped.into())
        }
        other => Ok(other?),
    }
}

/// The driver shared between the kubelet service and the publishing loop.
struct SharedDriver<A>(Arc<NodeDriver<A>>);

impl<A: super::node::AllocationSource> crate::kubelet::dra::DraDriver for SharedDriver<A> {
    async fn prepare(
        &self,
        claims: Vec<crate::kubelet::dra::ClaimRef>,
    ) -> crate::kubelet::dra::PrepareResults {
        self.0.prepare(claims).await
    }

    async fn unprepare(
        &self,
        claims: Vec<crate::kubelet::dra::ClaimRef>,
    ) -> crate::kubelet::dra::UnprepareResults {
        self.0.unprepare(claims).await
    }
}
