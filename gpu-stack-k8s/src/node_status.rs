//! The node status exporter: the validation status of one node as
//! Prometheus gauges on `/metrics`, like NVIDIA's node-status-exporter
//! (`nvidia-validator --component metrics`), read from the status files
//! under the validations directory at each scrape.
//!
//! - `gpu_operator_node_metrics_ready_ts_seconds{node}`: when the exporter started;
//! - `gpu_operator_node_{driver,toolkit,cuda,plugin}_ready{node}`: 1 while the
//!   status file of that check exists, 0 otherwise (NVIDIA's names, so its
//!   dashboards and alerts keep working);
//! - one more `gpu_operator_node_<name>_ready{node}` gauge, at 1, for every
//!   other `<name>-ready` file found (`mofed-ready`, `vfio-pci-ready`, ...).
//!
//! The exporter only reads the directory: it needs no GPU, no Kubernetes
//! access and no privileges.
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use gpu_stack_core::metrics::format::write_label_value;
use gpu_stack_core::operator::validation::ValidationComponent;

use crate::validator::{is_status_file, present_files};

/// Content type of the Prometheus text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// What the exporter reports about.
#[derive(Debug, Clone)]
pub struct NodeStatusConfig {
    /// Directory of the status files (`/run/nvidia/validations`).
    pub dir: PathBuf,
    /// The node's name (the `node` label).
    pub node: String,
    /// When the exporter started, in seconds since the Unix epoch.
    pub started_unix_secs: u64,
}

/// The metric name of a status file: `driver-ready` → `gpu_operator_node_driver_ready`;
/// characters a metric name may not hold become `_`.
pub fn metric_name(status_file: &str) -> String {
    let stem = status_file.strip_suffix("-ready").unwrap_or(status_file);
    let mut name = String::from("gpu_operator_node_");
    name.extend(
        stem.chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }),
    );
    name.push_str("_ready");
    name
}

fn gauge(out: &mut String, name: &str, help: &str, node: &str, value: u64) {
    // Writing to a String cannot fail.
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} gauge");
    let _ = write!(out, "{name}{{node=\"");
    write_label_value(out, node);
    let _ = writeln!(out, "\"}} {value}");
}

/// The exposition of a node whose validations directory holds `present`
/// (file names). Pure, for tests; [`render_dir`] reads the directory.
pub fn render(config: &NodeStatusConfig, present: &BTreeSet<String>) -> String {
    let mut out = String::with_capacity(1024);
    gauge(
        &mut out,
        "gpu_operator_node_metrics_ready_ts_seconds",
        "timestamp (in seconds) of the launch time of the GPU Operator node metrics Pod",
        &config.node,
        config.started_unix_secs,
    );
    let known: Vec<&str> = ValidationComponent::ALL
        .iter()
        .map(|c| c.ready_file())
        .collect();
    for c in ValidationComponent::ALL {
        let file = c.ready_file();
        gauge(
            &mut out,
            &metric_name(file),
            &format!(
                "1 if the {} status file {file} exists on the local node, 0 otherwise",
                c.name()
            ),
            &config.node,
            u64::from(present.contains(file)),
        );
    }
    let mut seen: BTreeSet<String> = known.iter().map(|f| metric_name(f)).collect();
    for file in present
        .iter()
        .filter(|f| is_status_file(f) && !known.contains(&f.as_str()))
    {
        let name = metric_name(file);
        // Two files that map to one metric name are reported once.
        if seen.insert(name.clone()) {
            gauge(
                &mut out,
                &name,
                &format!("1 while the status file {file} exists on the local node"),
                &config.node,
                1,
            );
        }
    }
    out
}

/// The exposition for the directory as it is now (a missing directory
/// reports every check at 0).
pub fn render_dir(config: &NodeStatusConfig) -> String {
    render(config, &present_files(&config.dir))
}

async fn metrics(State(config): State<Arc<NodeStatusConfig>>) -> Response {
    let dir_config = config.clone();
    // Reading a directory blocks; keep it off the runtime's thread.
    let body = tokio::task::spawn_blocking(move || render_dir(&dir_config))
        .await
        .unwrap_or_else(|_| render(&config, &BTreeSet::new()));
    (
        [(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE))],
        body,
    )
        .into_response()
}

async fn health() -> &'static str {
    "OK"
}

/// The exporter's routes: `/metrics` and `/health`.
pub fn router(config: NodeStatusConfig) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(health))
        .with_state(Arc::new(config))
}

/// Serves the exporter on `listener` until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    config: NodeStatusConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    tracing::info!(
        dir = %config.dir.display(),
        node = %config.node,
        "serving validation status on /metrics"
    );
    axum::serve(listener, router(config))
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::path::Path;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn config(dir: &Path) -> NodeStatusConfig {
        NodeStatusConfig {
            dir: dir.to_path_buf(),
            node: "gpu-1".into(),
            started_unix_secs: 1_700_000_000,
        }
    }

    fn files(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn one_gauge_per_check_and_per_other_status_file() {
        let text = render(
            &config(Path::new("/nowhere")),
            &files(&[
                "driver-ready",
                "toolkit-ready",
                "mofed-ready",
                ".driver-ctr-ready",
                "workload-type",
            ]),
        );
        for line in [
            "gpu_operator_node_metrics_ready_ts_seconds{node=\"gpu-1\"} 1700000000",
            "gpu_operator_node_driver_ready{node=\"gpu-1\"} 1",
            "gpu_operator_node_toolkit_ready{node=\"gpu-1\"} 1",
            "gpu_operator_node_cuda_ready{node=\"gpu-1\"} 0",
            "gpu_operator_node_plugin_ready{node=\"gpu-1\"} 0",
            "gpu_operator_node_mofed_ready{node=\"gpu-1\"} 1",
            "# TYPE gpu_operator_node_plugin_ready gauge",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(
            !text.contains("driver_ctr"),
            "hidden files are not status files:\n{text}"
        );
        assert!(!text.contains("workload"), "{text}");
    }

    #[test]
    fn metric_names_are_valid_prometheus_names() {
        assert_eq!(
            metric_name("vfio-pci-ready"),
            "gpu_operator_node_vfio_pci_ready"
        );
        assert_eq!(
            metric_name("host-vgpu-manager-ready"),
            "gpu_operator_node_host_vgpu_manager_ready"
        );
    }

    proptest! {
        #[test]
        fn every_series_line_is_well_formed(
            names in proptest::collection::btree_set("[a-z0-9.é\"-]{1,12}-ready", 0..6),
            node in "[a-z0-9\"\\\\-]{1,10}",
        ) {
            let mut c = config(Path::new("/nowhere"));
            c.node = node;
            let text = render(&c, &names);
            let mut series = 0;
            for line in text.lines().filter(|l| !l.starts_with('#')) {
                let (name, rest) = line.split_once('{').expect("a label set");
                prop_assert!(name.chars().all(|ch| ch.is_ascii_alphanumeric() || ch == '_'), "{}", line);
                prop_assert!(rest.ends_with("} 0") || rest.ends_with("} 1") || rest.ends_with("} 1700000000"), "{}", line);
                series += 1;
            }
            // Never fewer series than the start time and the four checks.
            prop_assert!(series >= 5);
            // Each metric name appears in one series only.
            let mut seen = BTreeSet::new();
            for line in text.lines().filter(|l| !l.starts_with('#')) {
                let name = line.split('{').next().unwrap_or_default().to_string();
                prop_assert!(seen.insert(name.clone()), "{} twice", name);
            }
        }
    }

    async fn get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn serves_the_directory_as_it_is_at_each_scrape() {
        let dir = tempfile::tempdir().unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, config(dir.path()), async {
            let _ = rx.await;
        }));
        let before = get(addr, "/metrics").await;
        assert!(before.starts_with("HTTP/1.1 200"), "{before}");
        assert!(
            before.contains("gpu_operator_node_driver_ready{node=\"gpu-1\"} 0"),
            "{before}"
        );
        std::fs::write(dir.path().join("driver-ready"), "IS_HOST_DRIVER=true\n").unwrap();
        let after = get(addr, "/metrics").await;
        assert!(
            after.contains("gpu_operator_node_driver_ready{node=\"gpu-1\"} 1"),
            "{after}"
        );
        assert!(after.contains("text/plain; version=0.0.4"), "{after}");
        assert!(get(addr, "/health").await.starts_with("HTTP/1.1 200"));
        tx.send(()).unwrap();
        server.await.unwrap().unwrap();
    }
}
