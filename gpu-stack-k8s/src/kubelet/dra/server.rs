//! The DRA v1 `DRAPlugin` gRPC service: checks and bounds the kubelet's
//! requests, hands the claims to a [`DraDriver`], and puts its per-claim
//! results on the wire.
//!
//! A claim that succeeded with nothing to report (no devices, no error) is
//! an empty map entry on the wire, which Go decodes as a nil entry; the
//! kubelet reads entries through nil-safe getters, and the protocol allows
//! nil entries.

use std::collections::BTreeMap;
use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::api;
use super::driver::{ClaimRef, DraDriver, PreparedDevice};

/// The most claims one request may carry. The kubelet sends the claims of
/// one pod for one driver (a pod has at most a handful); a request beyond
/// this is refused with `INVALID_ARGUMENT` rather than handed to the driver.
pub const MAX_CLAIMS_PER_REQUEST: usize = 256;

/// The claims of a request after checking: those to hand to the driver, in
/// request order, and those already failed, by uid.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct CheckedClaims {
    /// Claims for the driver, each uid once.
    pub valid: Vec<ClaimRef>,
    /// Claims refused before reaching the driver, with the reason.
    pub refused: BTreeMap<String, String>,
}

impl CheckedClaims {
    /// Every uid of the request, each once.
    pub fn uids(&self) -> impl Iterator<Item = &String> {
        self.valid.iter().map(|c| &c.uid).chain(self.refused.keys())
    }
}

/// Checks the claims of a `call` (the RPC name, for messages): at most
/// [`MAX_CLAIMS_PER_REQUEST`], each with a uid (else the whole request is
/// refused: a result is keyed by uid, so there would be nowhere to put that
/// claim's error). A claim without namespace or name, or a uid listed twice
/// with different contents, fails alone; an exact repeat counts once.
pub fn check_claims(call: &str, claims: Vec<api::Claim>) -> Result<CheckedClaims, Status> {
    if claims.len() > MAX_CLAIMS_PER_REQUEST {
        return Err(Status::invalid_argument(format!(
            "{call}: {} claims in one request, at most {MAX_CLAIMS_PER_REQUEST} are accepted; \
             send them in several requests",
            claims.len()
        )));
    }
    let mut checked = CheckedClaims::default();
    for (i, c) in claims.into_iter().enumerate() {
        if c.uid.is_empty() {
            return Err(Status::invalid_argument(format!(
                "{call}: claim #{i} ({}/{}) has no uid; every claim needs its ResourceClaim uid",
                c.namespace, c.name
            )));
        }
        let claim = ClaimRef::from(c);
        if checked.refused.contains_key(&claim.uid) {
            continue;
        }
        if let Some(pos) = checked.valid.iter().position(|v| v.uid == claim.uid) {
            if checked.valid[pos] != claim {
                let first = checked.valid.remove(pos);
                checked.refused.insert(
                    claim.uid.clone(),
                    format!(
                        "claim uid {} is listed twice, as {}/{} and {}/{}",
                        claim.uid, first.namespace, first.name, claim.namespace, claim.name
                    ),
                );
            }
            continue;
        }
        if claim.namespace.is_empty() || claim.name.is_empty() {
            checked.refused.insert(
                claim.uid.clone(),
                format!(
                    "claim {} has no {}; the kubelet sends the ResourceClaim's namespace and name",
                    claim.uid,
                    if claim.namespace.is_empty() {
                        "namespace"
                    } else {
                        "name"
                    }
                ),
            );
            continue;
        }
        checked.valid.push(claim);
    }
    Ok(checked)
}

/// An error message for the wire: the kubelet reads an empty `error` as
/// success, so a failure without a reason still gets one.
fn wire_error(call: &str, message: String) -> String {
    if message.trim().is_empty() {
        format!("{call} failed for this claim (the driver gave no reason)")
    } else {
        message
    }
}

/// Puts the driver's results for `checked` in the response map: one entry per
/// requested uid (a uid the driver left out fails), none for uids the
/// kubelet did not send (it fails the whole call on those).
fn merge_results<T>(
    call: &str,
    checked: CheckedClaims,
    mut results: BTreeMap<String, Result<T, String>>,
) -> BTreeMap<String, Result<T, String>> {
    let mut out = BTreeMap::new();
    for c in &checked.valid {
        let r = results.remove(&c.uid).unwrap_or_else(|| {
            Err(format!(
                "{call}: the driver returned no result for claim {}/{} ({})",
                c.namespace, c.name, c.uid
            ))
        });
        out.insert(c.uid.clone(), r);
    }
    if !results.is_empty() {
        tracing::warn!(
            call,
            uids = ?results.keys().collect::<Vec<_>>(),
            "the DRA driver returned results for claims not in the request; dropped"
        );
    }
    for (uid, reason) in checked.refused {
        out.insert(uid, Err(reason));
    }
    for (uid, r) in &out {
        if let Err(e) = r {
            tracing::warn!(call, claim = %uid, error = %e, "claim failed");
        }
    }
    out
}

/// The `DRAPlugin` service over a [`DraDriver`].
pub struct DraService<D> {
    driver: Arc<D>,
    // One call at a time (see DraDriver): the kubelet may call for several
    // pods at once.
    serial: Arc<tokio::sync::Mutex<()>>,
}

impl<D> Clone for DraService<D> {
    fn clone(&self) -> Self {
        DraService {
            driver: self.driver.clone(),
            serial: self.serial.clone(),
        }
    }
}

impl<D: DraDriver> DraService<D> {
    /// A service handing claims to `driver`.
    pub fn new(driver: D) -> DraService<D> {
        DraService::from_arc(Arc::new(driver))
    }

    /// A service handing claims to a shared `driver`.
    pub fn from_arc(driver: Arc<D>) -> DraService<D> {
        DraService {
            driver,
            serial: Arc::new(tokio::sync::Mutex::new(())),
        }
    }

    /// Runs `f` on the driver in a task of its own, one call at a time. The
    /// task finishes even if the kubelet gives up waiting (its deadline
    /// drops this future), so a preparation is never cut in half; and a
    /// panic in the driver fails this call instead of the connection.
    async fn run<T, F, Fut>(&self, call: &'static str, f: F) -> Result<T, Status>
    where
        T: Send + 'static,
        F: FnOnce(Arc<D>) -> Fut + Send + 'static,
        Fut: Future<Output = T> + Send + 'static,
    {
        let driver = self.driver.clone();
        let serial = self.serial.clone();
        let task = tokio::spawn(async move {
            let _one_at_a_time = serial.lock().await;
            f(driver).await
        });
        task.await.map_err(|e| {
            tracing::error!(call, error = %e, "the DRA driver failed");
            Status::internal(format!(
                "{call}: the driver failed ({e}); see the plugin's log"
            ))
        })
    }
}

#[tonic::async_trait]
impl<D: DraDriver> api::dra_plugin_server::DraPlugin for DraService<D> {
    async fn node_prepare_resources(
        &self,
        request: Request<api::NodePrepareResourcesRequest>,
    ) -> Result<Response<api::NodePrepareResourcesResponse>, Status> {
        const CALL: &str = "NodePrepareResources";
        let checked = check_claims(CALL, request.into_inner().claims)?;
        tracing::debug!(
            claims = checked.valid.len() + checked.refused.len(),
            "NodePrepareResources"
        );
        let valid = checked.valid.clone();
        let results = if valid.is_empty() {
            BTreeMap::new()
        } else {
            self.run(CALL, |d| async move { d.prepare(valid).await })
                .await?
        };
        let claims = merge_results(CALL, checked, results)
            .into_iter()
            .map(|(uid, r)| {
                let resp = match r {
                    Ok(devices) => api::NodePrepareResourceResponse {
                        devices: devices.into_iter().map(api::Device::from).collect(),
                        error: String::new(),
                    },
                    Err(e) => api::NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error: wire_error(CALL, e),
                    },
                };
                (uid, resp)
            })
            .collect();
        Ok(Response::new(api::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<api::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<api::NodeUnprepareResourcesResponse>, Status> {
        const CALL: &str = "NodeUnprepareResources";
        let checked = check_claims(CALL, request.into_inner().claims)?;
        tracing::debug!(
            claims = checked.valid.len() + checked.refused.len(),
            "NodeUnprepareResources"
        );
        let valid = checked.valid.clone();
        let results = if valid.is_empty() {
            BTreeMap::new()
        } else {
            self.run(CALL, |d| async move { d.unprepare(valid).await })
                .await?
        };
        let claims = merge_results(CALL, checked, results)
            .into_iter()
            .map(|(uid, r)| {
                let error = match r {
                    Ok(()) => String::new(),
                    Err(e) => wire_error(CALL, e),
                };
                (uid, api::NodeUnprepareResourceResponse { error })
            })
            .collect();
        Ok(Response::new(api::NodeUnprepareResourcesResponse {
            claims,
        }))
    }
}

/// Reads a prepare response as per-claim results (an entry with an error is
/// that claim's failure, its devices ignored, as the kubelet does).
pub fn prepare_results(resp: api::NodePrepareResourcesResponse) -> super::PrepareResults {
    resp.claims
        .into_iter()
        .map(|(uid, r)| {
            let result = if r.error.is_empty() {
                Ok(r.devices.into_iter().map(PreparedDevice::from).collect())
            } else {
                Err(r.error)
            };
            (uid, result)
        })
        .collect()
}

/// Reads an unprepare response as per-claim results.
pub fn unprepare_results(resp: api::NodeUnprepareResourcesResponse) -> super::UnprepareResults {
    resp.claims
        .into_iter()
        .map(|(uid, r)| {
            let result = if r.error.is_empty() {
                Ok(())
            } else {
                Err(r.error)
            };
            (uid, result)
        })
        .collect()
}
