//! Exporter tests against simulated GPUs: golden output for a DGX A100 with and
//! without MIG, `promtool check metrics`, a real Prometheus server scraping the
//! exporter on loopback, and pod attribution through a stand-in kubelet
//! (kubelet down, up, restarted).

use std::io::Read as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use gpu_stack_core::backend::GpuBackend;
use gpu_stack_core::metrics::{RenderOptions, ResourceMatcher};
use gpu_stack_k8s::exporter::{self, Exporter, ExporterConfig, PodResourcesConfig};
use gpu_stack_k8s::podresources::StandinKubelet;
use gpu_stack_k8s::podresources::standin::answer;
use gpu_stack_nvml::{SimClock, SimNodeSpec, SimulatedBackend};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const NODE: &str = "dgx-a100-0";

fn fleet() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/fleets/dgx-a100.yaml")
}

/// A DGX A100 at simulated time 0: with MIG as the fleet file describes it
/// (GPUs 6 and 7 partitioned), or eight whole GPUs.
fn backend(mig: bool) -> Arc<SimulatedBackend> {
    let spec = if mig {
        SimNodeSpec::from_fleet_file(&fleet(), Some(NODE)).unwrap()
    } else {
        let mut spec = SimNodeSpec::from_fleet_file(&fleet(), Some(NODE)).unwrap();
        let whole = SimNodeSpec::uniform(NODE, "A100-SXM4-40GB", 8);
        spec.gpus = whole.gpus;
        spec
    };
    let (clock, _handle) = SimClock::manual();
    Arc::new(SimulatedBackend::with_clock(&spec, clock).unwrap())
}

fn config(interval: Duration) -> ExporterConfig {
    ExporterConfig {
        interval,
        render: RenderOptions {
            hostname: Some(NODE.to_string()),
            ..RenderOptions::default()
        },
        ..ExporterConfig::default()
    }
}

/// Waits (bounded) until every GPU has been sampled into the snapshot.
async fn wait_all_gpus(exporter: &Exporter, gpus: usize) {
    for _ in 0..400 {
        if exporter.snapshot().gpus == gpus {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the exporter did not sample {gpus} GPUs in time");
}

/// Waits (bounded) until `pred` holds for the Prometheus-format snapshot.
async fn wait_snapshot(exporter: &Exporter, what: &str, pred: impl Fn(&str) -> bool) -> String {
    for _ in 0..400 {
        let snap = exporter.snapshot();
        let text = String::from_utf8_lossy(&snap.prometheus).into_owned();
        if pred(&text) {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("timed out waiting for: {what}");
}

fn check_golden(name: &str, actual: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, actual).unwrap();
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "cannot read {}: {e} (run with UPDATE_GOLDEN=1 to create it)",
            path.display()
        )
    });
    if expected != actual {
        let first = expected
            .lines()
            .zip(actual.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(expected.lines().count().min(actual.lines().count()));
        panic!(
            "{name} differs from the golden file at line {}:\n expected: {:?}\n   actual: {:?}",
            first + 1,
            expected.lines().nth(first),
            actual.lines().nth(first)
        );
    }
}

async fn golden_for(mig: bool, gpus: usize, name: &str) -> String {
    let b: Arc<dyn GpuBackend> = backend(mig);
    let exporter = exporter::start(b, config(Duration::from_secs(3600))).unwrap();
    wait_all_gpus(&exporter, gpus).await;
    let text = String::from_utf8(exporter.snapshot().prometheus.to_vec()).unwrap();
    check_golden(name, &text);
    exporter.shutdown();
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn golden_dgx_a100_without_mig() {
    let text = golden_for(false, 8, "exporter-dgx-a100.prom").await;
    assert!(!text.contains("GPU_I_PROFILE"));
    assert_eq!(text.matches("DCGM_FI_DEV_GPU_TEMP{").count(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn golden_dgx_a100_with_mig() {
    let text = golden_for(true, 8, "exporter-dgx-a100-mig.prom").await;
    // 6 whole GPUs plus 4 GPU instances on each of the 2 MIG GPUs.
    assert_eq!(text.matches("DCGM_FI_DEV_GPU_TEMP{").count(), 14);
    // Two 1g.5gb instances on each MIG GPU.
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("DCGM_FI_DEV_GPU_TEMP{")
                && l.contains("GPU_I_PROFILE=\"1g.5gb\""))
            .count(),
        4
    );
    // Framebuffer per GPU instance is reported.
    assert!(text.contains("DCGM_FI_DEV_FB_USED{gpu=\"6\""));
    // Utilizations are not per GPU instance, as in dcgm-exporter.
    assert!(
        !text
            .lines()
            .any(|l| l.starts_with("DCGM_FI_DEV_GPU_UTIL{") && l.contains("GPU_I_ID"))
    );
}

/// promtool's lint findings that the dcgm-exporter names and labels force on
/// us: counters without `_total`, `COUNTER` inside a counter's name, and the
/// camelCase `modelName` label.
fn only_compat_findings(out: &str) -> Result<(), String> {
    for line in out.lines().filter(|l| !l.trim().is_empty()) {
        let allowed = (line.starts_with("DCGM_")
            && line.ends_with("counter metrics should have \"_total\" suffix"))
            || (line.starts_with("DCGM_")
                && line.ends_with("metric name should not include type 'counter'"))
            || line.contains("label names should be written in 'snake_case' not 'camelCase'");
        if !allowed {
            return Err(line.to_string());
        }
    }
    Ok(())
}

fn promtool_check(text: &str) -> (i32, String) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool is needed for this test: install Debian's `prometheus` package (.ci/run does)");
    {
        use std::io::Write as _;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(text.as_bytes()).unwrap();
    }
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let status = child.wait().unwrap();
    (status.code().unwrap_or(-1), out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_accepts_the_output() {
    let b: Arc<dyn GpuBackend> = backend(true);
    let exporter = exporter::start(b, config(Duration::from_secs(3600))).unwrap();
    wait_all_gpus(&exporter, 8).await;
    let listener = exporter::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let router = exporter::router(&exporter);
    let server = tokio::spawn(async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await
    });
    let (status, headers, body) = http_get(addr, "/metrics", None).await;
    assert_eq!(status, 200);
    assert!(headers.contains("text/plain; version=0.0.4"), "{headers}");
    assert!(
        body.contains("gpu_exporter_nvml_errors_total") || body.contains("gpu_exporter_series")
    );
    let (code, out) = promtool_check(&body);
    // 0: clean; 3: lint findings only. 1 would be a parse error.
    assert!(code == 0 || code == 3, "promtool exit {code}: {out}");
    only_compat_findings(&out)
        .map_err(|l| format!("unexpected promtool finding: {l}"))
        .unwrap();

    let (status, headers, om) = http_get(
        addr,
        "/metrics",
        Some("application/openmetrics-text;version=1.0.0"),
    )
    .await;
    assert_eq!(status, 200);
    assert!(
        headers.contains("application/openmetrics-text"),
        "{headers}"
    );
    assert!(om.ends_with("# EOF\n"));
    assert!(om.contains("# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION unknown\n"));

    let (status, _, health) = http_get(addr, "/health", None).await;
    assert_eq!((status, health.as_str()), (200, "OK"));
    let _ = stop.send(());
    server.await.unwrap().unwrap();
    exporter.shutdown();
}

async fn http_get(addr: SocketAddr, path: &str, accept: Option<&str>) -> (u16, String, String) {
    try_http_get(addr, path, accept)
        .await
        .unwrap_or_else(|| panic!("GET http://{addr}{path} failed"))
}

async fn try_http_get(
    addr: SocketAddr,
    path: &str,
    accept: Option<&str>,
) -> Option<(u16, String, String)> {
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    let accept = accept
        .map(|a| format!("Accept: {a}\r\n"))
        .unwrap_or_default();
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{accept}Connection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Some((status, head.to_ascii_lowercase(), body.to_string()))
}

/// Kills and reaps the Prometheus server when the test ends, however it ends.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_loopback_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn prom_query(addr: SocketAddr, query: &str) -> Option<f64> {
    let encoded: String = query
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'_' | b'.' | b'-' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let (status, _, body) =
        try_http_get(addr, &format!("/api/v1/query?query={encoded}"), None).await?;
    if status != 200 {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    let result = v["data"]["result"].as_array()?;
    let first = result.first()?;
    first["value"][1].as_str()?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_and_queries_the_exporter() {
    let b: Arc<dyn GpuBackend> = backend(true);
    let exporter = exporter::start(b, config(Duration::from_secs(1))).unwrap();
    let listener = exporter::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let target = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let router = exporter::router(&exporter);
    let server = tokio::spawn(async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await
    });

    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("prometheus.yml");
    std::fs::write(
        &cfg,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: gpu\n    honor_labels: true\n    static_configs:\n      - targets: ['{target}']\n"
        ),
    )
    .unwrap();
    let port = free_loopback_port();
    let prom_addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", cfg.display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
        .arg(format!("--web.listen-address={prom_addr}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the prometheus server is needed for this test: install Debian's `prometheus` package (.ci/run does)");
    let _guard = KillOnDrop(child);

    // Bounded wait: up to 60 s for the first scrapes to land.
    let mut temps = None;
    for _ in 0..120 {
        temps = prom_query(prom_addr, "count(DCGM_FI_DEV_GPU_TEMP)").await;
        if temps == Some(14.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(temps, Some(14.0), "6 whole GPUs + 8 GPU instances");
    assert_eq!(prom_query(prom_addr, "up{job=\"gpu\"}").await, Some(1.0));
    assert_eq!(
        prom_query(
            prom_addr,
            "count(DCGM_FI_DEV_FB_USED{GPU_I_PROFILE=\"1g.5gb\"})"
        )
        .await,
        Some(4.0)
    );
    // Counters keep their dcgm-exporter names through OpenMetrics scraping.
    assert_eq!(
        prom_query(
            prom_addr,
            "count(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{Hostname=\"dgx-a100-0\"})"
        )
        .await,
        Some(14.0)
    );
    drop(_guard);
    let _ = stop.send(());
    server.await.unwrap().unwrap();
    exporter.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_are_attributed_through_the_kubelet_and_survive_its_restarts() {
    let sim = backend(true);
    let inv = sim.inventory().unwrap();
    let gpu0 = inv.gpus[0].uuid.clone();
    let gi = sim.gpu_instances(6).unwrap();
    let mig_uuid = gi[0].compute_instances[0].uuid.clone();
    let mig_profile = gi[0].profile_name.clone();

    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kubelet.sock");
    let mut cfg = config(Duration::from_millis(200));
    cfg.pod_resources = Some(PodResourcesConfig {
        socket: socket.clone(),
        refresh: Duration::from_millis(100),
        timeout: Duration::from_secs(2),
        matcher: ResourceMatcher::default(),
    });
    let b: Arc<dyn GpuBackend> = sim.clone();
    let exporter = exporter::start(b, cfg).unwrap();
    wait_all_gpus(&exporter, 8).await;

    // Kubelet not there yet: metrics serve without pod labels, health says so.
    let text = wait_snapshot(&exporter, "series", |t| t.contains("DCGM_FI_DEV_GPU_TEMP{")).await;
    assert!(!text.contains("pod=\""));
    let mut own = String::new();
    exporter.self_metrics().encode_prometheus(&mut own);
    assert!(own.contains("gpu_exporter_pod_resources_up 0"), "{own}");

    let resource = format!("nvidia.com/mig-{mig_profile}");
    let pods = answer(&[
        ("train-0", "ml", "cuda", "nvidia.com/gpu", &[gpu0.as_str()]),
        (
            "infer-1",
            "serving",
            "server",
            resource.as_str(),
            &[mig_uuid.as_str()],
        ),
        ("web", "default", "nginx", "example.com/fpga", &["fpga0"]),
    ]);
    let kubelet = StandinKubelet::start(&socket).unwrap();
    kubelet.set(pods.clone());
    let expect_gpu0 = format!("UUID=\"{gpu0}\"");
    let text = wait_snapshot(&exporter, "pod labels", |t| {
        t.contains("pod=\"infer-1\"") && t.contains("pod=\"train-0\"")
    })
    .await;
    let line = text
        .lines()
        .find(|l| l.starts_with("DCGM_FI_DEV_GPU_TEMP{") && l.contains(&expect_gpu0))
        .unwrap();
    assert!(
        line.contains(",container=\"cuda\",namespace=\"ml\",pod=\"train-0\"} "),
        "{line}"
    );
    let mig_line = text
        .lines()
        .find(|l| l.starts_with("DCGM_FI_DEV_FB_USED{") && l.contains("pod=\"infer-1\""))
        .unwrap();
    assert!(
        mig_line.contains(&format!("GPU_I_PROFILE=\"{mig_profile}\"")),
        "{mig_line}"
    );
    assert!(!text.contains("pod=\"web\""));
    let mut own = String::new();
    exporter.self_metrics().encode_prometheus(&mut own);
    assert!(own.contains("gpu_exporter_pod_resources_up 1"), "{own}");
    // Scrapes never reach the kubelet: List calls follow the refresh interval.
    let calls_before = kubelet.list_calls();
    for _ in 0..50 {
        let _ = exporter.snapshot();
    }
    assert!(kubelet.list_calls() <= calls_before + 2);

    // Kubelet goes down: labels go, series stay.
    kubelet.stop().await;
    let text = wait_snapshot(&exporter, "labels gone", |t| !t.contains("pod=\"")).await;
    assert!(text.contains("DCGM_FI_DEV_GPU_TEMP{"));
    let mut own = String::new();
    exporter.self_metrics().encode_prometheus(&mut own);
    assert!(own.contains("gpu_exporter_pod_resources_up 0"), "{own}");

    // Kubelet restarted on the same socket: labels come back.
    let kubelet = StandinKubelet::start(&socket).unwrap();
    kubelet.set(pods);
    wait_snapshot(&exporter, "labels back", |t| t.contains("pod=\"train-0\"")).await;
    kubelet.stop().await;
    exporter.shutdown();
}

async fn serve_in_background(
    exporter: &Exporter,
) -> (
    SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let listener = exporter::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let router = exporter::router(exporter);
    let server = tokio::spawn(async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await
    });
    (addr, stop, server)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_gpu_does_not_block_the_others_or_scrapes() {
    use gpu_stack_core::backend::{CallClass, Fault, FaultSpec};
    let sim = backend(false);
    sim.inject(FaultSpec {
        gpu: Some(3),
        at_ms: 0,
        fault: Fault::SlowCalls {
            calls: CallClass::Telemetry,
            delay_ms: 20_000,
        },
    })
    .unwrap();
    let b: Arc<dyn GpuBackend> = sim;
    let exporter = exporter::start(b, config(Duration::from_secs(3600))).unwrap();
    wait_all_gpus(&exporter, 7).await;
    let (addr, stop, server) = serve_in_background(&exporter).await;
    let (status, _, body) =
        tokio::time::timeout(Duration::from_secs(2), http_get(addr, "/metrics", None))
            .await
            .expect("a scrape must not wait for the hung GPU");
    assert_eq!(status, 200);
    assert_eq!(body.matches("DCGM_FI_DEV_GPU_TEMP{").count(), 7);
    assert!(!body.contains("gpu=\"3\""));
    let _ = stop.send(());
    server.await.unwrap().unwrap();
    exporter.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xid_events_show_as_last_xid_and_windowed_counts() {
    use gpu_stack_core::backend::{Fault, FaultSpec};
    let sim = backend(false);
    let b: Arc<dyn GpuBackend> = sim.clone();
    let exporter = exporter::start(b, config(Duration::from_millis(100))).unwrap();
    wait_all_gpus(&exporter, 8).await;
    for _ in 0..2 {
        sim.inject(FaultSpec {
            gpu: Some(2),
            at_ms: 0,
            fault: Fault::Xid {
                xid: 48,
                gpu_instance: None,
            },
        })
        .unwrap();
    }
    let text = wait_snapshot(&exporter, "Xid series", |t| {
        t.contains("window_size_in_ms=\"300000\",xid=\"48\"} 2\n")
            && t.contains("err_code=\"48\",err_msg=\"Double Bit ECC Error\"} 48\n")
    })
    .await;
    let count_line = text
        .lines()
        .find(|l| l.starts_with("DCGM_EXP_XID_ERRORS_COUNT{"))
        .unwrap();
    assert!(count_line.contains("gpu=\"2\""), "{count_line}");
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("DCGM_EXP_XID_ERRORS_COUNT{"))
            .count(),
        1
    );
    exporter.shutdown();
}
