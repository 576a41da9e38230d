//! Prometheus metrics of the operator.
//!
//! The names and meanings follow the NVIDIA GPU Operator (`gpu_operator_*`) so
//! existing dashboards and alerts keep working; a few gpu-stack additions
//! (`gpu_stack_operator_*`) count API requests and applied objects, which is how
//! a "no writes on resync" claim is checked from outside the process.
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::clock::unix_seconds_f64;

/// Value of `gpu_operator_reconciliation_status`, with NVIDIA's encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReconciliationStatus {
    /// The last reconcile succeeded and every operand is ready (`1`).
    Success,
    /// The last reconcile succeeded but operands are not ready yet (`0`).
    NotReady,
    /// No ClusterPolicy exists, or it was ignored by the singleton rule (`-1`).
    ClusterPolicyUnavailable,
    /// The operator hit an error while reconciling (`-2`).
    OperatorError,
}

impl ReconciliationStatus {
    /// The gauge value NVIDIA's operator uses for this status.
    pub fn value(self) -> i64 {
        match self {
            Self::Success => 1,
            Self::NotReady => 0,
            Self::ClusterPolicyUnavailable => -1,
            Self::OperatorError => -2,
        }
    }

    /// The `status` label of the per-policy reconcile count.
    pub fn label(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::NotReady => "not-ready",
            Self::ClusterPolicyUnavailable => "unavailable",
            Self::OperatorError => "error",
        }
    }
}

/// Labels of `gpu_stack_operator_policy_in_charge`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabels {
    /// The ClusterPolicy's name.
    pub policy: String,
}

/// Labels of `gpu_stack_operator_policy_reconciliations_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyOutcomeLabels {
    /// The ClusterPolicy's name.
    pub policy: String,
    /// [`ReconciliationStatus::label`] of the outcome.
    pub status: String,
}

/// The verb of an API request, as Kubernetes audit logs name it.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Verb {
    /// GET of a single object.
    get,
    /// GET of a collection.
    list,
    /// GET with `watch=true`.
    watch,
    /// POST.
    create,
    /// PATCH (server-side apply included).
    patch,
    /// PUT.
    update,
    /// DELETE.
    delete,
    /// Anything else (HEAD, OPTIONS, ...).
    other,
}

impl Verb {
    /// Whether this verb changes state on the API server.
    pub fn is_write(self) -> bool {
        matches!(
            self,
            Self::create | Self::patch | Self::update | Self::delete
        )
    }
}

/// Labels of `gpu_stack_operator_api_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// What the request did.
    pub verb: Verb,
    /// The plural resource name (`nodes`, `daemonsets`, `leases`, ...), with a
    /// `/status` suffix for the status subresource.
    pub resource: String,
}

/// Classifies an API request by its method, path and query string.
///
/// A pure function so the counting layer stays trivial and this rule is tested.
pub fn classify_request(method: &str, path: &str, query: Option<&str>) -> RequestLabels {
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    // Strip the group/version prefix: /api/v1/... or /apis/<group>/<version>/...
    let rest: &[&str] = match segments.first() {
        Some(&"api") => segments.get(2..).unwrap_or(&[]),
        Some(&"apis") => segments.get(3..).unwrap_or(&[]),
        _ => &[],
    };
    // Strip namespaces/<ns>/ unless the resource *is* namespaces.
    let rest = match rest {
        ["namespaces", _ns, tail @ ..] if !tail.is_empty() => tail,
        other => other,
    };
    let (resource, named) = match rest {
        [] => (String::from("unknown"), false),
        [kind] => ((*kind).to_string(), false),
        [kind, _name] => ((*kind).to_string(), true),
        [kind, _name, sub, ..] => (format!("{kind}/{sub}"), true),
    };
    let watching = query
        .map(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"))
        .unwrap_or(false);
    let verb = match method {
        "GET" if watching => Verb::watch,
        "GET" if named => Verb::get,
        "GET" => Verb::list,
        "POST" => Verb::create,
        "PATCH" => Verb::patch,
        "PUT" => Verb::update,
        "DELETE" => Verb::delete,
        _ => Verb::other,
    };
    RequestLabels { verb, resource }
}

/// All operator metrics, cheap to clone and share between tasks.
#[derive(Clone, Debug)]
pub struct OperatorMetrics {
    registry: Arc<Registry>,
    /// `gpu_operator_gpu_nodes_total`: nodes the operator treats as GPU nodes.
    pub gpu_nodes_total: Gauge,
    /// `gpu_operator_reconciliation_status`, see [`ReconciliationStatus`].
    pub reconciliation_status: Gauge,
    /// `gpu_operator_reconciliation_total`: reconciles run.
    pub reconciliation_total: Counter,
    /// `gpu_operator_reconciliation_failed_total`: reconciles that errored.
    pub reconciliation_failed_total: Counter,
    /// `gpu_operator_reconciliation_last_success_ts_seconds`.
    pub reconciliation_last_success_ts_seconds: Gauge<f64, AtomicU64>,
    /// `gpu_operator_reconciliation_has_nfd_labels`: 1 when any node carries
    /// node-feature-discovery labels.
    pub reconciliation_has_nfd_labels: Gauge,
    /// `gpu_stack_operator_api_requests_total{verb,resource}`.
    pub api_requests: Family<RequestLabels, Counter>,
    /// `gpu_stack_operator_api_writes_total`: the write requests among them.
    pub api_writes: Counter,
    /// `gpu_stack_operator_objects_applied_total`: objects written because their
    /// desired-state hash changed.
    pub objects_applied: Counter,
    /// `gpu_stack_operator_objects_unchanged_total`: objects skipped because
    /// their hash was unchanged.
    pub objects_unchanged: Counter,
    /// `gpu_stack_operator_leader`: 1 while this replica holds the lease.
    pub leader: Gauge,
    /// `gpu_stack_operator_writes_dropped_total`: writes refused because
    /// this replica was not sure to lead
    /// ([`crate::operator::controller::client::WriteGate`]).
    pub writes_dropped: Counter,
    /// `gpu_stack_operator_policy_in_charge{policy}`: 1 for the ClusterPolicy
    /// the operator reconciles, 0 for each one it ignores (NVIDIA's
    /// `gpu_operator_*` metrics carry no policy and describe that one).
    pub policy_in_charge: Family<PolicyLabels, Gauge>,
    /// `gpu_stack_operator_policy_reconciliations_total{policy,status}`.
    pub policy_reconciliations: Family<PolicyOutcomeLabels, Counter>,
    /// `gpu_operator_nodes_upgrades_in_progress`.
    pub nodes_upgrades_in_progress: Gauge,
    /// `gpu_operator_nodes_upgrades_done`.
    pub nodes_upgrades_done: Gauge,
    /// `gpu_operator_nodes_upgrades_failed`.
    pub nodes_upgrades_failed: Gauge,
    /// `gpu_operator_nodes_upgrades_available`: upgrades that may start now.
    pub nodes_upgrades_available: Gauge,
    /// `gpu_operator_nodes_upgrades_pending`.
    pub nodes_upgrades_pending: Gauge,
    /// `gpu_operator_driver_auto_upgrade_enabled`.
    pub driver_auto_upgrade_enabled: Gauge,
}

impl Default for OperatorMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl OperatorMetrics {
    /// Creates the metrics and registers them under their public names.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let gpu_nodes_total = Gauge::default();
        let reconciliation_status = Gauge::default();
        let reconciliation_total = Counter::default();
        let reconciliation_failed_total = Counter::default();
        let reconciliation_last_success_ts_seconds = Gauge::<f64, AtomicU64>::default();
        let reconciliation_has_nfd_labels = Gauge::default();
        let api_requests = Family::<RequestLabels, Counter>::default();
        let api_writes = Counter::default();
        let objects_applied = Counter::default();
        let objects_unchanged = Counter::default();
        let leader = Gauge::default();
        let writes_dropped = Counter::default();
        let policy_in_charge = Family::<PolicyLabels, Gauge>::default();
        let policy_reconciliations = Family::<PolicyOutcomeLabels, Counter>::default();
        let upgrade_gauges: [(Gauge, &str, &str); 6] = [
            (
                Gauge::default(),
                "gpu_operator_nodes_upgrades_in_progress",
                "Total number of nodes on which the gpu operator pods are being upgraded",
            ),
            (
                Gauge::default(),
                "gpu_operator_nodes_upgrades_done",
                "Total number of nodes on which the gpu operator pods are successfully upgraded",
            ),
            (
                Gauge::default(),
                "gpu_operator_nodes_upgrades_failed",
                "Total number of nodes on which the gpu operator pod upgrades have failed",
            ),
            (
                Gauge::default(),
                "gpu_operator_nodes_upgrades_available",
                "Total number of nodes on which the gpu operator pod upgrades can be done",
            ),
            (
                Gauge::default(),
                "gpu_operator_nodes_upgrades_pending",
                "Total number of nodes on which the gpu operator pod upgrades are pending",
            ),
            (
                Gauge::default(),
                "gpu_operator_driver_auto_upgrade_enabled",
                "1 if driver auto upgrade is enabled 0 if not",
            ),
        ];
        for (g, name, help) in &upgrade_gauges {
            registry.register(*name, *help, g.clone());
        }
        let [
            (nodes_upgrades_in_progress, ..),
            (nodes_upgrades_done, ..),
            (nodes_upgrades_failed, ..),
            (nodes_upgrades_available, ..),
            (nodes_upgrades_pending, ..),
            (driver_auto_upgrade_enabled, ..),
        ] = upgrade_gauges;
        // ClusterPolicy is unavailable until the first reconcile says otherwise.
        reconciliation_status.set(ReconciliationStatus::ClusterPolicyUnavailable.value());

        registry.register(
            "gpu_operator_gpu_nodes_total",
            "Number of nodes with GPUs",
            gpu_nodes_total.clone(),
        );
        registry.register(
            "gpu_operator_reconciliation_status",
            "1 if the reconciliation is currently successful, 0 if the operands are not ready, \
             -1 if the cluster policy is unavailable, -2 if an error occurred within the operator.",
            reconciliation_status.clone(),
        );
        // Counters get their `_total` suffix from the encoder.
        registry.register(
            "gpu_operator_reconciliation",
            "Total number of reconciliation",
            reconciliation_total.clone(),
        );
        registry.register(
            "gpu_operator_reconciliation_failed",
            "Number of failed reconciliation",
            reconciliation_failed_total.clone(),
        );
        registry.register(
            "gpu_operator_reconciliation_last_success_ts_seconds",
            "Timestamp (in seconds) of the last reconciliation loop success",
            reconciliation_last_success_ts_seconds.clone(),
        );
        registry.register(
            "gpu_operator_reconciliation_has_nfd_labels",
            "1 if NFD mandatory kernel labels have been found, 0 otherwise",
            reconciliation_has_nfd_labels.clone(),
        );
        registry.register(
            "gpu_stack_operator_api_requests",
            "Kubernetes API requests issued by the operator, by verb and resource",
            api_requests.clone(),
        );
        registry.register(
            "gpu_stack_operator_api_writes",
            "Write requests (create, patch, update, delete) issued by the operator",
            api_writes.clone(),
        );
        registry.register(
            "gpu_stack_operator_objects_applied",
            "Objects written because their desired-state hash changed",
            objects_applied.clone(),
        );
        registry.register(
            "gpu_stack_operator_objects_unchanged",
            "Objects skipped because their desired-state hash was unchanged",
            objects_unchanged.clone(),
        );
        registry.register(
            "gpu_stack_operator_leader",
            "1 while this replica holds the leader lease",
            leader.clone(),
        );
        registry.register(
            "gpu_stack_operator_writes_dropped",
            "Writes refused because this replica was not sure to hold the leader lease",
            writes_dropped.clone(),
        );
        registry.register(
            "gpu_stack_operator_policy_in_charge",
            "1 for the ClusterPolicy the operator reconciles, 0 for each one it ignores",
            policy_in_charge.clone(),
        );
        registry.register(
            "gpu_stack_operator_policy_reconciliations",
            "Reconciles of each ClusterPolicy in charge, by outcome",
            policy_reconciliations.clone(),
        );
        Self {
            registry: Arc::new(registry),
            gpu_nodes_total,
            reconciliation_status,
            reconciliation_total,
            reconciliation_failed_total,
            reconciliation_last_success_ts_seconds,
            reconciliation_has_nfd_labels,
            api_requests,
            api_writes,
            objects_applied,
            objects_unchanged,
            leader,
            writes_dropped,
            policy_in_charge,
            policy_reconciliations,
            nodes_upgrades_in_progress,
            nodes_upgrades_done,
            nodes_upgrades_failed,
            nodes_upgrades_available,
            nodes_upgrades_pending,
            driver_auto_upgrade_enabled,
        }
    }

    /// Records the outcome of one reconcile.
    pub fn record_reconcile(&self, status: ReconciliationStatus) {
        self.reconciliation_total.inc();
        self.reconciliation_status.set(status.value());
        match status {
            ReconciliationStatus::OperatorError => {
                self.reconciliation_failed_total.inc();
            }
            ReconciliationStatus::Success | ReconciliationStatus::NotReady => {
                self.reconciliation_last_success_ts_seconds
                    .set(unix_seconds_f64());
            }
            ReconciliationStatus::ClusterPolicyUnavailable => {}
        }
    }

    /// Records a pass over `policy`: `Some(status)` when it is the policy in
    /// charge (it becomes the only one marked so), `None` when it is ignored.
    /// A failed pass is recorded as in charge: only that one does work.
    pub fn record_policy_pass(&self, policy: &str, outcome: Option<ReconciliationStatus>) {
        let labels = PolicyLabels {
            policy: policy.to_string(),
        };
        let Some(status) = outcome else {
            self.policy_in_charge.get_or_create(&labels).set(0);
            return;
        };
        // Drops the series of policies deleted since.
        self.policy_in_charge.clear();
        self.policy_in_charge.get_or_create(&labels).set(1);
        self.policy_reconciliations
            .get_or_create(&PolicyOutcomeLabels {
                policy: labels.policy,
                status: status.label().to_string(),
            })
            .inc();
    }

    /// Counts one API request.
    pub fn record_request(&self, method: &str, path: &str, query: Option<&str>) {
        let labels = classify_request(method, path, query);
        if labels.verb.is_write() {
            self.api_writes.inc();
        }
        self.api_requests.get_or_create(&labels).inc();
    }

    /// Write requests (create, patch, update, delete) issued so far.
    pub fn write_requests(&self) -> u64 {
        self.api_writes.get()
    }

    /// The OpenMetrics text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Encoding into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_core_and_group_requests() {
        let l = classify_request("GET", "/api/v1/nodes", None);
        assert_eq!((l.verb, l.resource.as_str()), (Verb::list, "nodes"));
        let l = classify_request("GET", "/api/v1/nodes", Some("watch=true&resourceVersion=5"));
        assert_eq!((l.verb, l.resource.as_str()), (Verb::watch, "nodes"));
        let l = classify_request("PATCH", "/api/v1/nodes/gpu-1", Some("fieldManager=x"));
        assert_eq!((l.verb, l.resource.as_str()), (Verb::patch, "nodes"));
        let l = classify_request(
            "PATCH",
            "/apis/apps/v1/namespaces/gpu-operator/daemonsets/nvidia-device-plugin",
            None,
        );
        assert_eq!((l.verb, l.resource.as_str()), (Verb::patch, "daemonsets"));
        let l = classify_request(
            "PATCH",
            "/apis/nvidia.com/v1/clusterpolicies/cluster-policy/status",
            None,
        );
        assert_eq!(
            (l.verb, l.resource.as_str()),
            (Verb::patch, "clusterpolicies/status")
        );
        let l = classify_request("GET", "/api/v1/namespaces/gpu-operator", None);
        assert_eq!((l.verb, l.resource.as_str()), (Verb::get, "namespaces"));
        let l = classify_request("GET", "/api/v1/namespaces", None);
        assert_eq!((l.verb, l.resource.as_str()), (Verb::list, "namespaces"));
        let l = classify_request("DELETE", "/apis/apps/v1/namespaces/ns/daemonsets/x", None);
        assert_eq!(l.verb, Verb::delete);
        assert!(l.verb.is_write());
        assert!(!Verb::watch.is_write());
        let l = classify_request("GET", "/version", None);
        assert_eq!(l.resource, "unknown");
    }

    #[test]
    fn exposes_nvidia_metric_names() {
        let m = OperatorMetrics::new();
        m.gpu_nodes_total.set(20);
        m.record_reconcile(ReconciliationStatus::Success);
        m.record_reconcile(ReconciliationStatus::OperatorError);
        let text = m.encode();
        for name in [
            "gpu_operator_gpu_nodes_total 20",
            "gpu_operator_reconciliation_status -2",
            "gpu_operator_reconciliation_total 2",
            "gpu_operator_reconciliation_failed_total 1",
            "gpu_operator_reconciliation_last_success_ts_seconds ",
            "gpu_operator_reconciliation_has_nfd_labels 0",
        ] {
            assert!(text.contains(name), "missing {name:?} in\n{text}");
        }
    }

    #[test]
    fn counts_writes_separately_from_reads() {
        let m = OperatorMetrics::new();
        m.record_request("GET", "/api/v1/nodes", Some("watch=true"));
        m.record_request("GET", "/api/v1/nodes", None);
        assert_eq!(m.write_requests(), 0);
        m.record_request("PATCH", "/api/v1/nodes/a", None);
        m.record_request("PATCH", "/api/v1/nodes/b", None);
        m.record_request("DELETE", "/apis/apps/v1/namespaces/n/daemonsets/d", None);
        assert_eq!(m.write_requests(), 3);
        assert!(m.encode().contains(
            "gpu_stack_operator_api_requests_total{verb=\"patch\",resource=\"nodes\"} 2"
        ));
    }

    #[test]
    fn one_policy_is_in_charge_and_its_outcomes_are_counted() {
        let m = OperatorMetrics::new();
        m.record_policy_pass("copy", None);
        m.record_policy_pass("old", Some(ReconciliationStatus::NotReady));
        m.record_policy_pass("old", Some(ReconciliationStatus::Success));
        m.record_policy_pass("copy", None);
        let text = m.encode();
        for line in [
            "gpu_stack_operator_policy_in_charge{policy=\"old\"} 1",
            "gpu_stack_operator_policy_in_charge{policy=\"copy\"} 0",
            "gpu_stack_operator_policy_reconciliations_total{policy=\"old\",status=\"success\"} 1",
            "gpu_stack_operator_policy_reconciliations_total{policy=\"old\",status=\"not-ready\"} 1",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        // The successor takes charge: the old policy's series goes.
        m.record_policy_pass("new", Some(ReconciliationStatus::Success));
        let text = m.encode();
        assert!(text.contains("gpu_stack_operator_policy_in_charge{policy=\"new\"} 1"));
        assert!(!text.contains("gpu_stack_operator_policy_in_charge{policy=\"old\""));
    }

    #[test]
    fn starts_with_policy_unavailable() {
        let m = OperatorMetrics::new();
        assert!(m.encode().contains("gpu_operator_reconciliation_status -1"));
    }
}
