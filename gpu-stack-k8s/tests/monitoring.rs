//! The shipped alerts and dashboard (deploy/monitoring/, and the chart's copies
//! in deploy/helm/gpu-stack/files/): the copies are byte-identical, promtool
//! checks the rules and runs their unit tests, and a real Prometheus on
//! loopback, scraping the exporter on simulated GPUs (whole and MIG) with the
//! shipped rules loaded, answers every panel query of the dashboard and fires
//! the alerts when faults are injected.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::Duration;

use gpu_stack_core::backend::{Fault, FaultSpec, GpuBackend};
use gpu_stack_core::metrics::RenderOptions;
use gpu_stack_k8s::exporter::{self, Exporter, ExporterConfig};
use gpu_stack_nvml::{SimNodeSpec, SimulatedBackend};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const RULES: &str = "deploy/monitoring/gpu-stack-alerts.rules.yaml";
const RULE_TESTS: &str = "deploy/monitoring/gpu-stack-alerts.test.yaml";
const DASHBOARD: &str = "deploy/monitoring/gpu-stack-dashboard.json";
const CHART_FILES: &str = "deploy/helm/gpu-stack/files";

/// The job name the test Prometheus scrapes the exporters under; the shipped
/// rules' default job matcher must match it.
const JOB: &str = "gpu-exporter";

/// Application-caused Xids, which the alerts leave out.
const APPLICATION_XIDS: [&str; 6] = ["13", "31", "43", "45", "68", "109"];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(rel: &str) -> String {
    let path = repo_root().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

fn promtool(args: &[&str]) -> Output {
    Command::new("promtool")
        .args(args)
        .current_dir(repo_root())
        .output()
        .expect("promtool is needed for this test: install Debian's `prometheus` package (`cargo xtask test` does)")
}

fn yaml(rel: &str) -> Value {
    serde_saphyr::from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel} is not YAML: {e}"))
}

fn dashboard() -> Value {
    serde_json::from_str(&read(DASHBOARD))
        .unwrap_or_else(|e| panic!("{DASHBOARD} is not JSON: {e}"))
}

/// Every alerting rule of the shipped file, as (group name, rule).
fn alert_rules() -> Vec<(String, Value)> {
    let rules = yaml(RULES);
    let mut out = Vec::new();
    for group in rules["groups"].as_array().expect("groups") {
        let name = group["name"].as_str().expect("group name").to_string();
        for rule in group["rules"].as_array().expect("rules") {
            assert!(
                rule["alert"].is_string(),
                "{RULES}: a rule of {name} is not an alert"
            );
            out.push((name.clone(), rule.clone()));
        }
    }
    out
}

#[test]
fn the_chart_ships_the_plain_files_byte_for_byte() {
    for name in ["gpu-stack-alerts.rules.yaml", "gpu-stack-dashboard.json"] {
        let plain = repo_root().join("deploy/monitoring").join(name);
        let chart = repo_root().join(CHART_FILES).join(name);
        let a = std::fs::read(&plain).unwrap_or_else(|e| panic!("{}: {e}", plain.display()));
        let b = std::fs::read(&chart).unwrap_or_else(|e| panic!("{}: {e}", chart.display()));
        assert!(
            a == b,
            "{} differs from the chart's {}; the chart's copy is the source: cp {} {}",
            plain.display(),
            chart.display(),
            chart.display(),
            plain.display()
        );
    }
}

#[test]
fn promtool_checks_both_rules_files() {
    let chart = format!("{CHART_FILES}/gpu-stack-alerts.rules.yaml");
    let out = promtool(&["check", "rules", RULES, &chart]);
    assert!(
        out.status.success(),
        "promtool check rules failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn promtool_unit_tests_of_the_rules_pass() {
    let out = promtool(&["test", "rules", RULE_TESTS]);
    assert!(
        out.status.success(),
        "promtool test rules {RULE_TESTS} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn every_alert_is_labelled_annotated_and_unit_tested_both_ways() {
    let rules = alert_rules();
    assert!(rules.len() >= 8, "{RULES} has only {} alerts", rules.len());
    for (group, rule) in &rules {
        let name = rule["alert"].as_str().unwrap();
        let severity = rule["labels"]["severity"].as_str();
        assert!(
            matches!(severity, Some("critical" | "warning")),
            "{name}: severity is {severity:?}"
        );
        let ann = &rule["annotations"];
        for key in ["summary", "description", "runbook"] {
            assert!(
                ann[key].as_str().is_some_and(|s| !s.trim().is_empty()),
                "{name} has no {key} annotation"
            );
        }
        let description = ann["description"].as_str().unwrap();
        let needs: &[&str] = if group == "gpu-stack-gpu-health" {
            &["$labels.gpu", "$labels.UUID", "$labels.Hostname"]
        } else {
            &["gpu", "UUID", "Hostname"]
        };
        for n in needs {
            assert!(
                description.contains(n),
                "{name}'s description does not name {n}"
            );
        }
        let expr = rule["expr"].as_str().unwrap();
        if expr.contains("DCGM_EXP_XID_ERRORS_COUNT{xid!~") {
            for xid in APPLICATION_XIDS {
                assert!(
                    expr.contains(&format!("|{xid}|"))
                        || expr.contains(&format!("\"{xid}|"))
                        || expr.contains(&format!("|{xid}\"")),
                    "{name} does not leave out the application Xid {xid}"
                );
            }
        }
    }

    // Each alert has a unit test where it fires and one where it does not.
    let tests = yaml(RULE_TESTS);
    let mut firing = BTreeSet::new();
    let mut quiet = BTreeSet::new();
    for t in tests["tests"].as_array().expect("tests") {
        for case in t["alert_rule_test"].as_array().into_iter().flatten() {
            let name = case["alertname"].as_str().unwrap().to_string();
            let n = case["exp_alerts"].as_array().map_or(0, Vec::len);
            if n > 0 {
                firing.insert(name);
            } else {
                quiet.insert(name);
            }
        }
    }
    for (_, rule) in &rules {
        let name = rule["alert"].as_str().unwrap();
        assert!(
            firing.contains(name),
            "{RULE_TESTS} never expects {name} to fire"
        );
        assert!(
            quiet.contains(name),
            "{RULE_TESTS} never expects {name} to stay quiet"
        );
    }
}

/// Every panel of the dashboard, rows' nested panels included.
fn panels(dash: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    for p in dash["panels"].as_array().expect("panels") {
        if p["type"] == "row" {
            out.extend(p["panels"].as_array().into_iter().flatten().cloned());
        } else {
            out.push(p.clone());
        }
    }
    out
}

/// (panel title, refId, expr) of every query of the dashboard.
fn panel_queries(dash: &Value) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for p in panels(dash) {
        let title = p["title"].as_str().expect("panel title").to_string();
        for t in p["targets"].as_array().expect("targets") {
            out.push((
                title.clone(),
                t["refId"].as_str().expect("refId").to_string(),
                t["expr"].as_str().expect("expr").to_string(),
            ));
        }
    }
    out
}

/// Metric names a query selects.
fn metrics_of(expr: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("DCGM_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.push(&tail[..end]);
        rest = &tail[end..];
    }
    out
}

/// Fields read once per GPU and repeated on each of its GPU instances.
const GPU_LEVEL: [&str; 7] = [
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_MEMORY_TEMP",
    "DCGM_FI_DEV_SM_CLOCK",
    "DCGM_FI_DEV_MEM_CLOCK",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
];

#[test]
fn the_dashboard_is_well_formed() {
    let dash = dashboard();
    assert_eq!(dash["uid"], "gpu-stack-gpus");
    let vars: BTreeMap<&str, &Value> = dash["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| (v["name"].as_str().unwrap(), v))
        .collect();
    for name in ["datasource", "Hostname", "gpu"] {
        assert!(vars.contains_key(name), "no template variable {name}");
    }
    for name in ["Hostname", "gpu"] {
        // Queries substitute `.*` for All; the tests below rely on it.
        assert_eq!(vars[name]["allValue"], ".*", "{name}'s All value");
        assert_eq!(vars[name]["includeAll"], true);
    }
    let mut ids = BTreeSet::new();
    for p in dash["panels"].as_array().unwrap() {
        assert!(
            ids.insert(p["id"].as_i64().unwrap()),
            "panel id {} twice",
            p["id"]
        );
        let g = &p["gridPos"];
        let (x, w) = (g["x"].as_i64().unwrap(), g["w"].as_i64().unwrap());
        assert!(x + w <= 24, "panel {} is wider than the grid", p["title"]);
    }
    for p in panels(&dash) {
        assert_eq!(
            p["datasource"]["uid"], "${datasource}",
            "panel {}",
            p["title"]
        );
    }
    let queries = panel_queries(&dash);
    assert!(queries.len() >= 20);
    for (title, ref_id, expr) in &queries {
        let names = metrics_of(expr);
        assert!(!names.is_empty(), "{title}/{ref_id} selects no DCGM metric");
        // Every selector is narrowed to the chosen nodes and GPUs.
        let selectors = expr.matches("DCGM_").count();
        let filtered = expr
            .matches("{Hostname=~\"$Hostname\", gpu=~\"$gpu\"")
            .count();
        assert_eq!(
            selectors, filtered,
            "{title}/{ref_id}: a selector lacks the Hostname and gpu filters: {expr}"
        );
        // GPU-level fields are reduced once per GPU before any sum.
        if names.iter().any(|n| GPU_LEVEL.contains(n)) && expr.contains("sum") {
            assert!(
                expr.contains("max by (Hostname, gpu, UUID)"),
                "{title}/{ref_id} sums a GPU-level field over GPU instances: {expr}"
            );
        }
    }
    let titles: BTreeSet<&str> = queries.iter().map(|(t, _, _)| t.as_str()).collect();
    for t in [
        "GPU utilisation",
        "Graphics engine active",
        "Tensor pipe active",
        "Framebuffer used",
        "Framebuffer free",
        "Power draw per GPU",
        "GPU temperature",
        "SM clock",
        "Energy in the time range",
        "Xid errors",
        "ECC errors",
        "Remapped rows",
        "NVLink bandwidth",
        "PCIe throughput",
    ] {
        assert!(titles.contains(t), "the dashboard has no panel {t:?}");
    }
}

// ---- a real Prometheus against exporters on simulated GPUs ----

fn fleet(name: &str) -> PathBuf {
    repo_root().join("examples/fleets").join(name)
}

/// One simulated node and its exporter, served on loopback.
struct Node {
    hostname: String,
    sim: Arc<SimulatedBackend>,
    exporter: Option<Exporter>,
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

#[derive(Clone, Copy)]
enum Sim {
    /// The DGX A100 with every GPU whole.
    A100Whole,
    /// The DGX A100 of the fleet file: GPUs 6 and 7 in MIG mode, 4 instances each.
    A100Mig,
    /// The H200 node: GPUs 0-3 whole, 4-5 with 4 instances, 6-7 in MIG mode
    /// without instances; Hopper, so with profiling metrics.
    H200,
}

impl Sim {
    fn hostname(self) -> &'static str {
        match self {
            Sim::A100Whole => "a100-whole-0",
            Sim::A100Mig => "dgx-a100-0",
            Sim::H200 => "h200-0",
        }
    }

    fn spec(self) -> SimNodeSpec {
        match self {
            Sim::A100Whole => {
                let mut spec =
                    SimNodeSpec::from_fleet_file(&fleet("dgx-a100.yaml"), Some("dgx-a100-0"))
                        .unwrap();
                spec.gpus = SimNodeSpec::uniform("dgx-a100-0", "A100-SXM4-40GB", 8).gpus;
                spec
            }
            Sim::A100Mig => {
                SimNodeSpec::from_fleet_file(&fleet("dgx-a100.yaml"), Some("dgx-a100-0")).unwrap()
            }
            Sim::H200 => SimNodeSpec::from_fleet_file(&fleet("h200.yaml"), Some("h200-0")).unwrap(),
        }
    }
}

impl Node {
    /// Simulated GPUs on the wall clock (counters move, NVLink has a rate),
    /// sampled every 500 ms.
    async fn start(sim: Sim) -> Node {
        let backend = Arc::new(SimulatedBackend::new(&sim.spec()).unwrap());
        // dcgm-exporter's defaults plus the ECC rows users uncomment for
        // the double-bit ECC alert.
        let counters = gpu_stack_core::metrics::parse_counters(&format!(
            "{}\nDCGM_FI_DEV_ECC_SBE_VOL_TOTAL, counter, Total number of single-bit volatile ECC errors.\nDCGM_FI_DEV_ECC_DBE_VOL_TOTAL, counter, Total number of double-bit volatile ECC errors.\n",
            gpu_stack_core::metrics::DEFAULT_COUNTERS_CSV
        ))
        .unwrap()
        .set;
        let config = ExporterConfig {
            counters,
            interval: Duration::from_millis(500),
            render: RenderOptions {
                hostname: Some(sim.hostname().to_string()),
                ..RenderOptions::default()
            },
            ..ExporterConfig::default()
        };
        let b: Arc<dyn GpuBackend> = backend.clone();
        let exporter = exporter::start(b, config).unwrap();
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
        Node {
            hostname: sim.hostname().to_string(),
            sim: backend,
            exporter: Some(exporter),
            addr,
            stop: Some(stop),
            server: Some(server),
        }
    }

    /// Stops serving /metrics (the exporter's scrapes fail from now on).
    async fn stop_serving(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            server.await.unwrap().unwrap();
        }
    }

    async fn shutdown(mut self) {
        self.stop_serving().await;
        if let Some(e) = self.exporter.take() {
            e.shutdown();
        }
    }
}

/// Kills and reaps the Prometheus server when the test ends, however it ends.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Prometheus {
    addr: SocketAddr,
    _child: KillOnDrop,
    _dir: tempfile::TempDir,
}

fn free_loopback_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Prometheus {
    /// A Prometheus on loopback scraping `targets` every second under job
    /// [`JOB`] and evaluating `rules` (the text of a rules file) every second.
    fn start(targets: &[SocketAddr], rules: &str) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let rules_path = dir.path().join("rules.yaml");
        std::fs::write(&rules_path, rules).unwrap();
        let list: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        let cfg = dir.path().join("prometheus.yml");
        std::fs::write(
            &cfg,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 rule_files:\n  - {}\n\
                 scrape_configs:\n  - job_name: {JOB}\n    honor_labels: true\n    static_configs:\n      - targets: [{}]\n",
                rules_path.display(),
                list.join(", ")
            ),
        )
        .unwrap();
        let addr: SocketAddr = format!("127.0.0.1:{}", free_loopback_port())
            .parse()
            .unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the prometheus server is needed for this test: install Debian's `prometheus` package (`cargo xtask test` does)");
        Prometheus {
            addr,
            _child: KillOnDrop(child),
            _dir: dir,
        }
    }

    /// GET `path` of the HTTP API; the parsed JSON when it answers.
    async fn api(&self, path: &str) -> Option<Value> {
        let (status, body) = http_get(self.addr, path).await?;
        let v: Value = serde_json::from_str(&body).ok()?;
        (status == 200 || v["status"].is_string()).then_some(v)
    }

    /// An instant query at `time` (seconds); the result vector, or the
    /// error Prometheus gave.
    async fn query_at(&self, query: &str, time: f64) -> Result<Vec<Value>, String> {
        let path = format!("/api/v1/query?query={}&time={time:.3}", urlencode(query));
        let v = self
            .api(&path)
            .await
            .ok_or_else(|| format!("no answer from Prometheus to {query}"))?;
        if v["status"] != "success" {
            return Err(format!("{}: {}", v["errorType"], v["error"]));
        }
        match v["data"]["resultType"].as_str() {
            Some("vector") => Ok(v["data"]["result"].as_array().cloned().unwrap_or_default()),
            other => Err(format!("result type {other:?}, not a vector")),
        }
    }

    /// Prometheus's clock now (the evaluation time of `time()`), once it
    /// answers.
    async fn now(&self) -> f64 {
        self.wait_for(
            "Prometheus to answer queries",
            Duration::from_secs(60),
            || async {
                let v = self.api("/api/v1/query?query=time()").await?;
                v["data"]["result"][0].as_f64()
            },
        )
        .await
    }

    async fn query(&self, query: &str) -> Vec<Value> {
        let t = self.now().await;
        self.query_at(query, t)
            .await
            .unwrap_or_else(|e| panic!("{query}: {e}"))
    }

    /// Polls `what` every 500 ms for at most `limit`; panics saying what was
    /// awaited when it never holds.
    async fn wait_for<T, F, Fut>(&self, what: &str, limit: Duration, mut f: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let tries = limit.as_millis() / 500;
        for _ in 0..tries {
            if let Some(v) = f().await {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        panic!("waited {}s in vain for {what}", limit.as_secs());
    }

    /// The alerts Prometheus holds now.
    async fn alerts(&self) -> Vec<Value> {
        self.api("/api/v1/alerts")
            .await
            .and_then(|v| v["data"]["alerts"].as_array().cloned())
            .unwrap_or_default()
    }

    /// The rule groups as /api/v1/rules reports them.
    async fn rule_groups(&self) -> Vec<Value> {
        self.api("/api/v1/rules")
            .await
            .and_then(|v| v["data"]["groups"].as_array().cloned())
            .unwrap_or_default()
    }

    /// Waits until every rule group has been evaluated `n` more times.
    async fn wait_evaluations(&self, n: usize) {
        let stamps = |groups: &[Value]| -> Vec<String> {
            groups
                .iter()
                .map(|g| g["lastEvaluation"].as_str().unwrap_or("").to_string())
                .collect()
        };
        let mut seen = stamps(&self.rule_groups().await);
        for _ in 0..n {
            let before = seen.clone();
            seen = self
                .wait_for(
                    "the next rule evaluation",
                    Duration::from_secs(30),
                    || async {
                        let now = stamps(&self.rule_groups().await);
                        (now.len() == before.len() && now.iter().zip(&before).all(|(a, b)| a != b))
                            .then_some(now)
                    },
                )
                .await;
        }
    }
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'_' | b'.' | b'-' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

async fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    // Prometheus's API answers are small enough to come unchunked, but
    // decode chunks should a version send them.
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)?
    } else {
        body.to_string()
    };
    Some((status, body))
}

fn dechunk(mut body: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n")?;
        let n = usize::from_str_radix(size.trim(), 16).ok()?;
        if n == 0 {
            return Some(out);
        }
        out.push_str(rest.get(..n)?);
        body = rest.get(n + 2..)?;
    }
}

/// Waits until Prometheus has at least `samples` scrapes of every node's
/// GPU temperature, so range queries (increase over the dashboard's
/// intervals) have data.
async fn wait_scraped(prom: &Prometheus, nodes: &[&Node], samples: usize) {
    for node in nodes {
        let q = format!(
            "min(count_over_time(DCGM_FI_DEV_GPU_TEMP{{Hostname=\"{}\"}}[1m]))",
            node.hostname
        );
        prom.wait_for(
            &format!("{samples} scrapes of {}", node.hostname),
            Duration::from_secs(120),
            || async {
                let t = prom.now().await;
                let r = prom.query_at(&q, t).await.ok()?;
                let n: f64 = r.first()?["value"][1].as_str()?.parse().ok()?;
                (n >= samples as f64).then_some(())
            },
        )
        .await;
    }
}

/// The dashboard's variables and Grafana's interval macros replaced as
/// Grafana would for `hostname` (a regex; `.*` is All) and all GPUs.
fn substitute(expr: &str, hostname: &str) -> String {
    expr.replace("$Hostname", hostname)
        .replace("$gpu", ".*")
        .replace("$__rate_interval", "30s")
        .replace("$__range", "1m")
}

/// What a panel query returns on a node.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// Exactly this many series.
    Series(usize),
    /// None: the simulated GPUs do not provide the field.
    Empty,
}

use Expect::{Empty, Series};

type Shape = [Expect; 3];

/// The expected result of every panel query on the three simulated nodes
/// (A100 whole, A100 with MIG, H200 with MIG), keyed by panel title and refId.
/// Whole A100: 8 GPUs. MIG A100: 8 GPUs, 6 whole and 8 GPU instances. H200:
/// 8 GPUs, 6 whole (two of them in MIG mode without instances) and 8 GPU
/// instances, and profiling metrics (Hopper).
fn expected_shapes() -> BTreeMap<(&'static str, &'static str), Shape> {
    let gpus = [Series(8), Series(8), Series(8)];
    let one = [Series(1), Series(1), Series(1)];
    let whole = [Series(8), Series(6), Series(6)];
    let instances = [Empty, Series(8), Series(8)];
    // Profiling metrics (NVML GPM): Hopper has them, Ampere does not.
    let prof_whole = [Empty, Empty, Series(6)];
    let prof_instances = [Empty, Empty, Series(8)];
    // Every simulated GPU here has HBM with ECC on.
    let ecc = gpus;
    BTreeMap::from([
        (("GPUs", "A"), one),
        (("MIG GPU instances", "A"), one),
        (("Power draw", "A"), one),
        (("Hottest GPU", "A"), one),
        (("Critical Xids", "A"), one),
        (("Row remap failures", "A"), one),
        (("GPU utilisation", "A"), whole),
        (("GPU utilisation", "B"), prof_instances),
        (("Graphics engine active", "A"), prof_whole),
        (("Graphics engine active", "B"), prof_instances),
        (("Tensor pipe active", "A"), prof_whole),
        (("Tensor pipe active", "B"), prof_instances),
        (("Framebuffer used", "A"), whole),
        (("Framebuffer used", "B"), instances),
        (("Framebuffer free", "A"), whole),
        (("Framebuffer free", "B"), instances),
        (("Framebuffer used (%)", "A"), whole),
        (("Framebuffer used (%)", "B"), instances),
        (("Power draw per GPU", "A"), gpus),
        (("Power draw per node", "A"), one),
        (("Energy in the time range", "A"), gpus),
        (("GPU temperature", "A"), gpus),
        (("Memory temperature", "A"), gpus),
        (("SM clock", "A"), gpus),
        (("SM clock", "B"), gpus),
        // No Xid has happened: the exporter's 0 series, one per GPU.
        (("Xid errors", "A"), gpus),
        (("Last Xid per GPU", "A"), gpus),
        (("ECC errors", "A"), ecc),
        (("ECC errors", "B"), ecc),
        (("Remapped rows", "A"), gpus),
        (("Remapped rows", "B"), gpus),
        (("Remapped rows", "C"), gpus),
        (("PCIe replays", "A"), gpus),
        (("NVLink bandwidth", "A"), gpus),
        (("PCIe throughput", "A"), gpus),
        (("PCIe throughput", "B"), gpus),
    ])
}

/// Whether Prometheus has series of every metric `expr` selects for `host`.
fn value_of(sample: &Value) -> f64 {
    sample["value"][1]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

fn label<'a>(sample: &'a Value, name: &str) -> &'a str {
    sample["metric"][name].as_str().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_answers_on_whole_and_mig_gpus() {
    let sims = [Sim::A100Whole, Sim::A100Mig, Sim::H200];
    let mut nodes = Vec::new();
    for sim in sims {
        nodes.push(Node::start(sim).await);
    }
    let targets: Vec<SocketAddr> = nodes.iter().map(|n| n.addr).collect();
    // The shipped rules as they are: Prometheus loads and evaluates them.
    let prom = Prometheus::start(&targets, &read(RULES));
    let refs: Vec<&Node> = nodes.iter().collect();
    wait_scraped(&prom, &refs, 8).await;
    prom.wait_evaluations(1).await;

    // Every rule evaluates without error on the exporter's real series.
    let groups = prom.rule_groups().await;
    let loaded: usize = groups
        .iter()
        .map(|g| g["rules"].as_array().map_or(0, Vec::len))
        .sum();
    assert_eq!(loaded, alert_rules().len(), "rules loaded: {groups:?}");
    for g in &groups {
        for r in g["rules"].as_array().unwrap() {
            assert_eq!(
                r["health"], "ok",
                "rule {} failed: {}",
                r["name"], r["lastError"]
            );
        }
    }
    // Healthy simulated GPUs raise no alert.
    let alerts = prom.alerts().await;
    assert!(alerts.is_empty(), "alerts on healthy GPUs: {alerts:?}");

    // The template variables' queries.
    let hosts = prom
        .api("/api/v1/label/Hostname/values?match[]=DCGM_FI_DEV_GPU_TEMP")
        .await
        .unwrap();
    let mut want: Vec<&str> = sims.iter().map(|s| s.hostname()).collect();
    want.sort();
    assert_eq!(
        hosts["data"],
        serde_json::json!(want),
        "label_values(Hostname)"
    );
    let gpus = prom
        .api(&format!(
            "/api/v1/label/gpu/values?match[]={}",
            urlencode("DCGM_FI_DEV_GPU_TEMP{Hostname=~\"dgx-a100-0\"}")
        ))
        .await
        .unwrap();
    assert_eq!(
        gpus["data"],
        serde_json::json!(["0", "1", "2", "3", "4", "5", "6", "7"]),
        "label_values(gpu)"
    );

    // Every panel query, per node and for All, at one instant.
    let time = prom.now().await;
    let shapes = expected_shapes();
    let queries = panel_queries(&dashboard());
    let mut checked = BTreeSet::new();
    let mut failures = Vec::new();
    for (title, ref_id, expr) in &queries {
        let shape = shapes
            .get(&(title.as_str(), ref_id.as_str()))
            .unwrap_or_else(|| {
                panic!("no expected shape for panel {title:?} query {ref_id}; add it to expected_shapes")
            });
        checked.insert((title.as_str(), ref_id.as_str()));
        let mut any = false;
        for (i, sim) in sims.iter().enumerate() {
            let q = substitute(expr, sim.hostname());
            match prom.query_at(&q, time).await {
                Err(e) => failures.push(format!("{title}/{ref_id} on {}: {e}", sim.hostname())),
                Ok(r) => {
                    let got = (!r.is_empty()).then_some(r.len());
                    any |= got.is_some();
                    let want = match shape[i] {
                        Series(n) => Some(n),
                        Empty => None,
                    };
                    if got != want {
                        failures.push(format!(
                            "{title}/{ref_id} on {}: {got:?} series, expected {want:?}: {q}",
                            sim.hostname(),
                        ));
                    }
                    for s in &r {
                        if !value_of(s).is_finite() {
                            failures.push(format!("{title}/{ref_id}: value {s}"));
                        }
                        let host = label(s, "Hostname");
                        if !host.is_empty() && host != sim.hostname() {
                            failures.push(format!("{title}/{ref_id}: series of {host}"));
                        }
                    }
                }
            }
        }
        match prom.query_at(&substitute(expr, ".*"), time).await {
            Err(e) => failures.push(format!("{title}/{ref_id} for All: {e}")),
            Ok(r) if any && r.is_empty() => {
                failures.push(format!("{title}/{ref_id} for All: no series"))
            }
            Ok(_) => {}
        }
    }
    assert!(
        failures.is_empty(),
        "dashboard queries:\n{}",
        failures.join("\n")
    );
    let unused: Vec<_> = shapes.keys().filter(|k| !checked.contains(*k)).collect();
    assert!(
        unused.is_empty(),
        "expected shapes of queries the dashboard lacks: {unused:?}"
    );

    // Power is taken once per GPU: the per-GPU series are distinct GPUs, and
    // the node total is their sum, below the sum over every series (which
    // counts a MIG GPU once per GPU instance).
    let per_gpu = queries
        .iter()
        .find(|(t, r, _)| t == "Power draw per GPU" && r == "A")
        .unwrap();
    let total = queries
        .iter()
        .find(|(t, r, _)| t == "Power draw" && r == "A")
        .unwrap();
    let per_node = queries
        .iter()
        .find(|(t, r, _)| t == "Power draw per node" && r == "A")
        .unwrap();
    for sim in sims {
        let host = sim.hostname();
        let gpus = prom
            .query_at(&substitute(&per_gpu.2, host), time)
            .await
            .unwrap();
        let distinct: BTreeSet<(&str, &str)> = gpus
            .iter()
            .map(|s| (label(s, "gpu"), label(s, "UUID")))
            .collect();
        assert_eq!(distinct.len(), 8, "{host}: power per GPU: {gpus:?}");
        let sum: f64 = gpus.iter().map(value_of).sum();
        let total_v = value_of(
            &prom
                .query_at(&substitute(&total.2, host), time)
                .await
                .unwrap()[0],
        );
        let node_v = value_of(
            &prom
                .query_at(&substitute(&per_node.2, host), time)
                .await
                .unwrap()[0],
        );
        assert!(
            (total_v - sum).abs() < 1e-6,
            "{host}: total {total_v} != sum {sum}"
        );
        assert!(
            (node_v - sum).abs() < 1e-6,
            "{host}: per node {node_v} != sum {sum}"
        );
        let naive = value_of(
            &prom
                .query_at(
                    &format!("sum(DCGM_FI_DEV_POWER_USAGE{{Hostname=\"{host}\"}})"),
                    time,
                )
                .await
                .unwrap()[0],
        );
        match sim {
            Sim::A100Whole => assert!((naive - sum).abs() < 1e-6, "{host}: {naive} vs {sum}"),
            // Two MIG GPUs with 4 instances each: each counted 4 times.
            _ => assert!(
                naive > sum + 1.0,
                "{host}: summing instances gave {naive}, per GPU {sum}"
            ),
        }
    }

    drop(prom);
    for node in nodes {
        node.shutdown().await;
    }
}

/// The shipped rules with every `for:` cut to 2s (a test-only copy): an
/// alert is pending for two evaluations before it fires.
fn rules_with_short_for() -> String {
    let text = read(RULES);
    let mut out = String::new();
    for line in text.lines() {
        if line.trim_start().starts_with("for: ") {
            let indent = &line[..line.len() - line.trim_start().len()];
            out.push_str(&format!("{indent}for: 2s\n"));
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    assert!(out.contains("for: 2s"), "{RULES} has no `for:` to cut");
    out
}

/// Firing alerts named `name` whose labels include every pair of `labels`.
fn firing<'a>(alerts: &'a [Value], name: &str, labels: &[(&str, &str)]) -> Vec<&'a Value> {
    alerts
        .iter()
        .filter(|a| {
            a["state"] == "firing"
                && a["labels"]["alertname"] == name
                && labels.iter().all(|(k, v)| a["labels"][*k] == *v)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injected_faults_fire_the_alerts_in_a_real_prometheus() {
    let whole = Node::start(Sim::A100Whole).await;
    let mut mig = Node::start(Sim::A100Mig).await;
    let prom = Prometheus::start(&[whole.addr, mig.addr], &rules_with_short_for());
    wait_scraped(&prom, &[&whole, &mig], 3).await;
    prom.wait_evaluations(2).await;
    let alerts = prom.alerts().await;
    assert!(alerts.is_empty(), "alerts on healthy GPUs: {alerts:?}");

    // The temperature alert: a whole GPU and a MIG GPU (whose temperature
    // repeats on its 4 instances) held at 95 °C.
    let overheat = |gpu| FaultSpec {
        gpu: Some(gpu),
        at_ms: 0,
        fault: Fault::Overheat { temp_c: 95 },
    };
    whole.sim.inject(overheat(1)).unwrap();
    mig.sim.inject(overheat(7)).unwrap();
    let host = whole.hostname.clone();
    let hot = prom
        .wait_for(
            "GPUTemperatureHigh for both GPUs",
            Duration::from_secs(60),
            || async {
                let a = prom.alerts().await;
                let got: BTreeSet<(String, String)> = firing(&a, "GPUTemperatureHigh", &[])
                    .iter()
                    .map(|a| {
                        (
                            a["labels"]["Hostname"].as_str().unwrap_or("").to_string(),
                            a["labels"]["gpu"].as_str().unwrap_or("").to_string(),
                        )
                    })
                    .collect();
                let want = BTreeSet::from([
                    (host.clone(), "1".to_string()),
                    ("dgx-a100-0".to_string(), "7".to_string()),
                ]);
                (got == want).then_some(a)
            },
        )
        .await;
    let temps = firing(&hot, "GPUTemperatureHigh", &[]);
    assert_eq!(
        temps.len(),
        2,
        "one alert per hot GPU, not per GPU instance: {temps:?}"
    );
    for a in temps {
        assert_eq!(a["labels"]["severity"], "warning");
        assert!(a["labels"]["GPU_I_ID"].is_null(), "{a}");
        let uuid = a["labels"]["UUID"].as_str().unwrap();
        let description = a["annotations"]["description"].as_str().unwrap();
        assert!(
            description.contains(uuid) && description.contains("it is at 95 °C"),
            "{description}"
        );
    }
    let rule = prom
        .rule_groups()
        .await
        .iter()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .find(|r| r["name"] == "GPUTemperatureHigh")
        .unwrap();
    assert_eq!(rule["duration"], 2.0, "the test copy's `for:`");

    // A critical Xid on a whole GPU, an application Xid on another, and a
    // GPU-level critical Xid on a MIG GPU (repeated on its 4 instances).
    let xid = |gpu, xid| FaultSpec {
        gpu: Some(gpu),
        at_ms: 0,
        fault: Fault::Xid {
            xid,
            gpu_instance: None,
        },
    };
    whole.sim.inject(xid(3, 13)).unwrap();
    whole.sim.inject(xid(2, 48)).unwrap();
    mig.sim.inject(xid(6, 94)).unwrap();
    prom.wait_for(
        "GPUXidCritical for Xid 48 and 94",
        Duration::from_secs(60),
        || async {
            let a = prom.alerts().await;
            (!firing(
                &a,
                "GPUXidCritical",
                &[("Hostname", &host), ("gpu", "2"), ("xid", "48")],
            )
            .is_empty()
                && !firing(
                    &a,
                    "GPUXidCritical",
                    &[("Hostname", "dgx-a100-0"), ("gpu", "6")],
                )
                .is_empty())
            .then_some(())
        },
    )
    .await;
    // Prometheus has Xid 13 too, and the rules have seen it.
    let q13 = format!("DCGM_EXP_XID_ERRORS_COUNT{{Hostname=\"{host}\",xid=\"13\"}}");
    prom.wait_for(
        "the Xid 13 count in Prometheus",
        Duration::from_secs(60),
        || async { (!prom.query(&q13).await.is_empty()).then_some(()) },
    )
    .await;
    prom.wait_evaluations(2).await;
    let alerts = prom.alerts().await;
    let xids = firing(&alerts, "GPUXidCritical", &[]);
    let got: BTreeSet<(&str, &str, &str)> = xids
        .iter()
        .map(|a| {
            (
                a["labels"]["Hostname"].as_str().unwrap(),
                a["labels"]["gpu"].as_str().unwrap(),
                a["labels"]["xid"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        got,
        BTreeSet::from([(host.as_str(), "2", "48"), ("dgx-a100-0", "6", "94")]),
        "one alert per critical Xid and GPU, none for the application's Xid 13: {xids:?}"
    );
    let a48 = firing(&alerts, "GPUXidCritical", &[("xid", "48")])[0];
    assert_eq!(a48["labels"]["severity"], "critical");
    let uuid = a48["labels"]["UUID"].as_str().unwrap();
    assert!(uuid.starts_with("GPU-"), "{a48}");
    let description = a48["annotations"]["description"].as_str().unwrap();
    assert!(
        description.contains(uuid) && description.contains(&host) && description.contains("GPU 2"),
        "{description}"
    );
    assert!(
        firing(&alerts, "GPULastXidCritical", &[]).is_empty(),
        "the last-Xid alert waits while the windowed count fires: {alerts:?}"
    );

    // A GPU falls off the bus: its series go while the node's others stay.
    whole
        .sim
        .inject(FaultSpec {
            gpu: Some(5),
            at_ms: 0,
            fault: Fault::FallOffBus,
        })
        .unwrap();
    prom.wait_for(
        "GPUMetricsMissing for GPU 5",
        Duration::from_secs(60),
        || async {
            let a = prom.alerts().await;
            let f = firing(
                &a,
                "GPUMetricsMissing",
                &[("Hostname", &host), ("gpu", "5")],
            );
            (f.len() == 1).then_some(())
        },
    )
    .await;
    let alerts = prom.alerts().await;
    let missing = firing(&alerts, "GPUMetricsMissing", &[]);
    assert_eq!(missing.len(), 1, "only GPU 5 is missing: {missing:?}");
    // The lost GPU keeps its Xid 79 series, so the bus alert fires too.
    prom.wait_for(
        "GPUFallenOffBus for GPU 5",
        Duration::from_secs(60),
        || async {
            let a = prom.alerts().await;
            (firing(&a, "GPUFallenOffBus", &[("Hostname", &host), ("gpu", "5")]).len() == 1)
                .then_some(())
        },
    )
    .await;

    // Double-bit ECC errors and a failed row remap on two more whole GPUs.
    whole
        .sim
        .inject(FaultSpec {
            gpu: Some(4),
            at_ms: 0,
            fault: Fault::EccErrors {
                single_bit: 0,
                double_bit: 2,
            },
        })
        .unwrap();
    whole
        .sim
        .inject(FaultSpec {
            gpu: Some(0),
            at_ms: 0,
            fault: Fault::RowRemapFailure,
        })
        .unwrap();
    prom.wait_for(
        "GPUDoubleBitECCErrors for GPU 4 and GPURowRemapFailure for GPU 0",
        Duration::from_secs(60),
        || async {
            let a = prom.alerts().await;
            let ecc = firing(
                &a,
                "GPUDoubleBitECCErrors",
                &[("Hostname", &host), ("gpu", "4")],
            );
            let remap = firing(
                &a,
                "GPURowRemapFailure",
                &[("Hostname", &host), ("gpu", "0")],
            );
            (ecc.len() == 1 && remap.len() == 1).then_some(())
        },
    )
    .await;
    let alerts = prom.alerts().await;
    assert_eq!(firing(&alerts, "GPUDoubleBitECCErrors", &[]).len(), 1);
    assert_eq!(firing(&alerts, "GPURowRemapFailure", &[]).len(), 1);

    // An exporter stops answering: GPUExporterDown, naming its Hostname.
    mig.stop_serving().await;
    let instance = mig.addr.to_string();
    prom.wait_for(
        "GPUExporterDown for the MIG node",
        Duration::from_secs(60),
        || async {
            let a = prom.alerts().await;
            (!firing(
                &a,
                "GPUExporterDown",
                &[
                    ("instance", &instance),
                    ("job", JOB),
                    ("Hostname", "dgx-a100-0"),
                ],
            )
            .is_empty())
            .then_some(())
        },
    )
    .await;
    let alerts = prom.alerts().await;
    let down = firing(&alerts, "GPUExporterDown", &[]);
    assert_eq!(
        down.len(),
        1,
        "only the MIG node's exporter is down: {down:?}"
    );
    assert!(
        firing(&alerts, "GPUExporterAbsent", &[]).is_empty(),
        "the whole-GPU node's exporter is still scraped"
    );

    drop(prom);
    whole.shutdown().await;
    mig.shutdown().await;
}
