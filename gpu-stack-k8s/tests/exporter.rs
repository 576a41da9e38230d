//! Exporter tests against simulated GPUs: golden output for a DGX A100 with and
//! without MIG, `promtool check metrics`, a real Prometheus server scraping the
//! exporter on loopback, and pod attribution through a stand-in kubelet
//! (kubelet down, up, restarted).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use gpu_stack_core::backend::GpuBackend;
use gpu_stack_core::metrics::{RenderOptions, ResourceMatcher};
use gpu_stack_k8s::exporter::{self, Exporter, ExporterConfig, PodResourcesConfig};
use gpu_stack_k8s::kubelet::podresources::StandinKubelet;
use gpu_stack_k8s::kubelet::podresources::standin::answer;
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
    // Feed stdin from another thread: promtool reports while it reads, and a
    // full stderr pipe would otherwise block both sides.
    let mut stdin = child.stdin.take().unwrap();
    let input = text.to_string();
    let writer = std::thread::spawn(move || {
        use std::io::Write as _;
        let _ = stdin.write_all(input.as_bytes());
    });
    let output = child.wait_with_output().unwrap();
    writer.join().unwrap();
    let mut out = String::from_utf8_lossy(&output.stdout).into_owned();
    out.push_str(&String::from_utf8_lossy(&output.stderr));
    (output.status.code().unwrap_or(-1), out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_accepts_the_output() {
    let b: Arc<dyn GpuBackend> = backend(true);
    let exporter = Arc::new(
        exporter::start(
            b,
            ExporterConfig {
                openmetrics: true,
                ..config(Duration::from_secs(3600))
            },
        )
        .unwrap(),
    );
    wait_all_gpus(&exporter, 8).await;
    let (addr, stop, server) = serve_in_background(&exporter).await;
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
    drop(exporter);
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
    exporter: &Arc<Exporter>,
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
    let exporter = exporter.clone();
    let server = tokio::spawn(async move {
        exporter::serve(listener, &exporter, async {
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
    let exporter = Arc::new(exporter::start(b, config(Duration::from_secs(3600))).unwrap());
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_that_hangs_later_has_its_series_go_stale_not_freeze() {
    use gpu_stack_core::backend::{CallClass, Fault, FaultSpec};
    let sim = backend(false);
    let b: Arc<dyn GpuBackend> = sim.clone();
    let exporter = exporter::start(b, config(Duration::from_millis(100))).unwrap();
    wait_all_gpus(&exporter, 8).await;
    // GPU 3 hangs in its next telemetry read: its last values must not stay
    // on show as if current; the other GPUs go on.
    sim.inject(FaultSpec {
        gpu: Some(3),
        at_ms: 0,
        fault: Fault::SlowCalls {
            calls: CallClass::Telemetry,
            delay_ms: 60_000,
        },
    })
    .unwrap();
    let text = wait_snapshot(&exporter, "GPU 3's series stale", |t| {
        t.matches("DCGM_FI_DEV_GPU_TEMP{").count() == 7
    })
    .await;
    assert!(
        !text
            .lines()
            .any(|l| l.starts_with("DCGM_FI_DEV_GPU_TEMP{") && l.contains("gpu=\"3\"")),
        "{text}"
    );
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
        .find(|l| l.starts_with("DCGM_EXP_XID_ERRORS_COUNT{") && l.contains("xid="))
        .unwrap();
    assert!(count_line.contains("gpu=\"2\""), "{count_line}");
    // One series with the code; every other GPU has its 0 series.
    let counts: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("DCGM_EXP_XID_ERRORS_COUNT{"))
        .collect();
    assert_eq!(counts.len(), 8);
    assert_eq!(counts.iter().filter(|l| l.contains("xid=")).count(), 1);
    assert!(
        counts
            .iter()
            .filter(|l| !l.contains("xid="))
            .all(|l| l.ends_with(",window_size_in_ms=\"300000\"} 0"))
    );
    exporter.shutdown();
}

/// An HGX H100 with every GPU split into seven 1g.10gb instances.
fn h100_mig_backend() -> Arc<SimulatedBackend> {
    let fleet = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/fleets/hgx-h100-mig.yaml");
    let spec = SimNodeSpec::from_fleet_file(&fleet, None).unwrap();
    let (clock, _handle) = SimClock::manual();
    Arc::new(SimulatedBackend::with_clock(&spec, clock).unwrap())
}

fn all_fields() -> gpu_stack_core::metrics::CounterSet {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../gpu-stack-core/tests/data/metrics/dcgm-exporter-all-fields.csv"),
    )
    .unwrap();
    gpu_stack_core::metrics::parse_counters(&text).unwrap().set
}

/// Two H100s: one whole, one split into three instances.
fn h100_pair_backend() -> Arc<SimulatedBackend> {
    let fleet = gpu_stack_core::fleet::Fleet::from_yaml(
        "nodes:\n  - name: hgx-h100-0\n    telemetry: {seed: 300, utilization-pct: 65, jitter-pct: 15, memory-used-pct: 50, tick-ms: 1000}\n    gpus:\n      - model: H100-SXM5-80GB\n      - model: H100-SXM5-80GB\n        mig: {enabled: true, instances: [\"3g.40gb@4\", \"2g.20gb@0\", \"1g.10gb@2\"]}\n",
    )
    .unwrap();
    let spec = SimNodeSpec::from_fleet(&fleet, None).unwrap();
    let (clock, _handle) = SimClock::manual();
    Arc::new(SimulatedBackend::with_clock(&spec, clock).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn golden_h100_with_every_field_turned_on() {
    let b: Arc<dyn GpuBackend> = h100_pair_backend();
    let exporter = exporter::start(
        b,
        ExporterConfig {
            counters: all_fields(),
            ..config(Duration::from_secs(3600))
        },
    )
    .unwrap();
    wait_all_gpus(&exporter, 2).await;
    let text = String::from_utf8(exporter.snapshot().prometheus.to_vec()).unwrap();
    check_golden("exporter-h100-all-fields.prom", &text);
    // Whole GPU and instances both carry the GPM ratios.
    assert_eq!(text.matches("DCGM_FI_PROF_SM_OCCUPANCY{").count(), 4);
    exporter.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_field_on_8_h100_with_7_instances_each() {
    let b: Arc<dyn GpuBackend> = h100_mig_backend();
    let exporter = exporter::start(
        b,
        ExporterConfig {
            counters: all_fields(),
            ..config(Duration::from_secs(3600))
        },
    )
    .unwrap();
    wait_all_gpus(&exporter, 8).await;
    let text = String::from_utf8(exporter.snapshot().prometheus.to_vec()).unwrap();
    // 56 instances; GPM ratios per instance, bounded, occupancy under activity.
    assert_eq!(text.matches("DCGM_FI_PROF_SM_ACTIVE{").count(), 56);
    for line in text.lines().filter(|l| l.starts_with("DCGM_FI_PROF_")) {
        let (name, v) = line.rsplit_once("} ").unwrap();
        let v: f64 = v.parse().unwrap();
        if !name.contains("BYTES") {
            assert!((0.0..=1.0).contains(&v), "{line}");
        }
    }
    // Label fields in dcgm-exporter's sorted order on every series.
    let temp = text
        .lines()
        .find(|l| l.starts_with("DCGM_FI_DEV_GPU_TEMP{"))
        .unwrap();
    let order = [
        "DCGM_FI_DEV_BRAND=",
        "DCGM_FI_DEV_ECC_INFOROM_VER=",
        "DCGM_FI_DEV_SERIAL=",
        "DCGM_FI_DEV_VBIOS_VERSION=",
        "DCGM_FI_DRIVER_VERSION=",
        "DCGM_FI_NVML_VERSION=",
    ];
    let pos: Vec<usize> = order.iter().map(|k| temp.find(k).unwrap()).collect();
    assert!(pos.windows(2).all(|w| w[0] < w[1]), "{temp}");
    // Health: ten watches per instance, all passing on a healthy node.
    assert_eq!(text.matches("DCGM_EXP_GPU_HEALTH_STATUS{").count(), 560);
    assert!(
        !text
            .lines()
            .any(|l| l.starts_with("DCGM_EXP_GPU_HEALTH_STATUS{") && !l.ends_with("} 0"))
    );
    // P2P: seven peers per GPU, over NVLink.
    assert!(text.contains("link_status=\"OK\",peer_gpu=\"7\"} 0\n"));
    // Before the first Xid: one 0 series per entity with only the window label.
    let zero = text
        .lines()
        .filter(|l| {
            l.starts_with("DCGM_EXP_XID_ERRORS_COUNT{")
                && l.ends_with(",window_size_in_ms=\"300000\"} 0")
        })
        .count();
    assert_eq!(zero, 56);
    let (code, out) = promtool_check(&text);
    assert!(code == 0 || code == 3, "promtool exit {code}: {out}");
    exporter.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_that_falls_off_the_bus_keeps_reporting_xid_79() {
    use gpu_stack_core::backend::{Fault, FaultSpec};
    let sim = backend(false);
    let b: Arc<dyn GpuBackend> = sim.clone();
    let exporter = exporter::start(b, config(Duration::from_millis(100))).unwrap();
    wait_all_gpus(&exporter, 8).await;
    sim.inject(FaultSpec {
        gpu: Some(5),
        at_ms: 0,
        fault: Fault::FallOffBus,
    })
    .unwrap();
    let text = wait_snapshot(&exporter, "Xid 79 on the lost GPU", |t| {
        t.lines().any(|l| {
            l.starts_with("DCGM_EXP_XID_ERRORS_COUNT{gpu=\"5\"") && l.contains("xid=\"79\"")
        }) && !t.contains("DCGM_FI_DEV_GPU_TEMP{gpu=\"5\"")
    })
    .await;
    assert!(
        text.lines()
            .any(|l| l.starts_with("DCGM_FI_DEV_XID_ERRORS{gpu=\"5\"")
                && l.contains("err_code=\"79\",err_msg=\"GPU has fallen off the bus\"} 79")),
        "{text}"
    );
    assert_eq!(text.matches("DCGM_FI_DEV_GPU_TEMP{").count(), 7);
    exporter.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overheating_gpu_shows_thermal_events_and_a_thermal_warning() {
    use gpu_stack_core::backend::{Fault, FaultSpec};
    let sim = backend(false);
    let b: Arc<dyn GpuBackend> = sim.clone();
    let exporter = exporter::start(
        b,
        ExporterConfig {
            counters: all_fields(),
            ..config(Duration::from_millis(100))
        },
    )
    .unwrap();
    wait_all_gpus(&exporter, 8).await;
    sim.inject(FaultSpec {
        gpu: Some(1),
        at_ms: 0,
        fault: Fault::Overheat { temp_c: 92 },
    })
    .unwrap();
    let text = wait_snapshot(&exporter, "thermal warning on GPU 1", |t| {
        t.lines().any(|l| {
            l.starts_with("DCGM_EXP_GPU_HEALTH_STATUS{gpu=\"1\"")
                && l.contains("health_error_code=\"DCGM_FR_CLOCK_THROTTLE_THERMAL\",health_watch=\"THERMAL\"} 10")
        })
    })
    .await;
    assert!(
        text.lines()
            .any(|l| l.starts_with("DCGM_FI_DEV_GPU_TEMP{gpu=\"1\"") && l.ends_with("} 92"))
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("DCGM_EXP_CLOCK_EVENTS_COUNT{gpu=\"1\"")
                && l.contains("clock_event=\"sw_thermal\""))
    );
    exporter.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_text_format_is_served_unless_openmetrics_is_on_and_idle_connections_are_closed() {
    let b: Arc<dyn GpuBackend> = backend(false);
    let exporter = Arc::new(
        exporter::start(
            b,
            ExporterConfig {
                header_read_timeout: Duration::from_millis(300),
                ..config(Duration::from_secs(3600))
            },
        )
        .unwrap(),
    );
    wait_all_gpus(&exporter, 8).await;
    let (addr, stop, server) = serve_in_background(&exporter).await;
    let prometheus_accept =
        "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2";
    let (status, headers, body) = http_get(addr, "/metrics", Some(prometheus_accept)).await;
    assert_eq!(status, 200);
    assert!(headers.contains("text/plain; version=0.0.4"), "{headers}");
    assert!(body.contains("# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n"));
    assert!(!body.contains("# EOF"));
    // A client that connects and sends nothing is disconnected.
    let mut idle = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), idle.read_to_end(&mut buf)).await;
    assert!(
        closed.is_ok(),
        "an idle connection must be closed by the server"
    );
    // Half a request line, then silence: closed too.
    let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(10), slow.read_to_end(&mut buf)).await;
    assert!(closed.is_ok(), "a slow request must be cut off");
    let (status, _, _) = http_get(addr, "/health", None).await;
    assert_eq!(status, 200, "the server still answers");
    let _ = stop.send(());
    server.await.unwrap().unwrap();
}
