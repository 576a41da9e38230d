//! The stack's CRDs, applied from the operator's own types by the chart's
//! pre-install and pre-upgrade hook (NVIDIA's `operator.upgradeCRD`), and
//! removed by its post-delete hook (`operator.cleanupCRD`).
//!
//! Helm creates a chart's `crds/` only where they do not exist and never
//! upgrades them, so a ClusterPolicy CRD that NVIDIA's chart (or an older
//! gpu-stack) left keeps its schema, and the API server prunes every field
//! that schema lacks (`status.unsupportedFields`, `spec.nodeAgent`, ...).
//! Server-side apply with force takes the fields over from whoever wrote
//! them; nothing else of the CRD changes hands. It applies as Helm's field
//! manager: Helm 4 applies `crds/` server-side as `helm` too, so a later
//! install of the chart over these CRDs meets no conflict with the hook.
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::{Client, CustomResourceExt, ResourceExt};

use crate::operator::clusterpolicy::ClusterPolicy;
use crate::operator::migconfig::MigConfig;
use crate::operator::nvidiadriver::NvidiaDriver;

/// The field manager of the hook's applies: Helm's own.
pub const FIELD_MANAGER: &str = "helm";

/// Pause between two reads of a wait.
const POLL: Duration = Duration::from_millis(500);

/// Every CRD of the stack, as generated from its types (what `deploy/crds/`
/// holds).
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![ClusterPolicy::crd(), NvidiaDriver::crd(), MigConfig::crd()]
}

/// Why applying or removing the CRDs failed.
#[derive(Debug, thiserror::Error)]
pub enum CrdError {
    /// An API call failed.
    #[error(
        "{what} CRD {name}: {source}; check that the hook's ClusterRole allows get, create, patch and delete of customresourcedefinitions"
    )]
    Api {
        /// The call.
        what: &'static str,
        /// The CRD.
        name: String,
        /// The cause.
        source: kube::Error,
    },
    /// A CRD was not served in time.
    #[error(
        "CRD {name} was not Established within {secs}s (last conditions: {conditions}); see `kubectl describe crd {name}`"
    )]
    NotEstablished {
        /// The CRD.
        name: String,
        /// The bound.
        secs: u64,
        /// Its conditions as last read.
        conditions: String,
    },
    /// A CRD was still there after its deletion.
    #[error(
        "CRD {name} is still there {secs}s after its deletion: objects of it hold finalizers (`kubectl get {name} -A`); delete them, or remove their finalizers, and run the uninstall again"
    )]
    NotGone {
        /// The CRD.
        name: String,
        /// The bound.
        secs: u64,
    },
}

fn api(what: &'static str, name: &str) -> impl FnOnce(kube::Error) -> CrdError {
    let name = name.to_string();
    move |source| CrdError::Api { what, name, source }
}

/// Whether a CRD is served: its `Established` condition is true.
fn established(crd: &CustomResourceDefinition) -> bool {
    crd.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == "Established" && c.status == "True")
}

fn conditions(crd: &CustomResourceDefinition) -> String {
    let listed: Vec<String> = crd
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .map(|c| {
            let mut line = format!("{}={}", c.type_, c.status);
            if let Some(m) = c.message.as_deref().filter(|m| !m.is_empty()) {
                line.push_str(&format!(" ({})", m.chars().take(200).collect::<String>()));
            }
            line
        })
        .collect();
    if listed.is_empty() {
        "none".into()
    } else {
        listed.join(", ")
    }
}

/// Applies every CRD (server-side, forced) and waits until each is served,
/// for at most `timeout` in all; returns their names.
pub async fn apply(client: &Client, timeout: Duration) -> Result<Vec<String>, CrdError> {
    let api_crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let mut names = Vec::new();
    for crd in crds() {
        let name = crd.name_any();
        api_crds
            .patch(&name, &params, &Patch::Apply(&crd))
            .await
            .map_err(api("applying", &name))?;
        tracing::info!(crd = %name, "applied");
        names.push(name);
    }
    let deadline = tokio::time::Instant::now() + timeout;
    for name in &names {
        loop {
            let crd = api_crds.get(name).await.map_err(api("reading", name))?;
            if established(&crd) {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(CrdError::NotEstablished {
                    name: name.clone(),
                    secs: timeout.as_secs(),
                    conditions: conditions(&crd),
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }
    Ok(names)
}

/// Deletes every CRD of the stack (and with it every object of it) and
/// waits until they are gone, for at most `timeout` in all; returns the
/// names of those that existed.
pub async fn delete(client: &Client, timeout: Duration) -> Result<Vec<String>, CrdError> {
    let api_crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut deleted = Vec::new();
    for crd in crds() {
        let name = crd.name_any();
        match api_crds.delete(&name, &DeleteParams::background()).await {
            Ok(_) => deleted.push(name),
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(api("deleting", &name)(e)),
        }
    }
    let deadline = tokio::time::Instant::now() + timeout;
    for name in &deleted {
        while api_crds
            .get_opt(name)
            .await
            .map_err(api("reading", name))?
            .is_some()
        {
            if tokio::time::Instant::now() >= deadline {
                return Err(CrdError::NotGone {
                    name: name.clone(),
                    secs: timeout.as_secs(),
                });
            }
            tokio::time::sleep(POLL).await;
        }
        tracing::info!(crd = %name, "deleted");
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
        CustomResourceDefinitionCondition, CustomResourceDefinitionStatus,
    };

    #[test]
    fn the_hook_applies_the_crds_the_chart_ships() {
        let names: Vec<String> = crds().iter().map(|c| c.name_any()).collect();
        assert_eq!(
            names,
            [
                "clusterpolicies.nvidia.com",
                "nvidiadrivers.nvidia.com",
                "migconfigs.gpustack.io"
            ]
        );
        // The same documents as deploy/crds/ (which check.sh keeps equal to
        // the chart's crds/).
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/crds");
        for crd in crds() {
            let file = root.join(format!("{}_{}.yaml", crd.spec.group, crd.spec.names.plural));
            let text = std::fs::read_to_string(&file).unwrap();
            let shipped: CustomResourceDefinition = serde_saphyr::from_str(&text).unwrap();
            assert_eq!(shipped, crd, "{} differs from the types", file.display());
        }
    }

    #[test]
    fn served_means_established_true() {
        let with = |status: &str| CustomResourceDefinition {
            status: Some(CustomResourceDefinitionStatus {
                conditions: Some(vec![CustomResourceDefinitionCondition {
                    type_: "Established".into(),
                    status: status.into(),
                    message: Some("waiting".into()),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..ClusterPolicy::crd()
        };
        assert!(established(&with("True")));
        assert!(!established(&with("False")));
        assert!(!established(&ClusterPolicy::crd()));
        assert_eq!(conditions(&with("False")), "Established=False (waiting)");
        assert_eq!(conditions(&ClusterPolicy::crd()), "none");
    }
}
