//! What a DRA driver's node logic implements ([`DraDriver`]), in plain Rust
//! types, so that logic does not depend on the generated gRPC code.

use std::collections::BTreeMap;
use std::future::Future;

use super::api;

/// A ResourceClaim the kubelet asks to prepare or unprepare.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClaimRef {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's uid: the key of its result.
    pub uid: String,
    /// The claim's name.
    pub name: String,
}

/// A device prepared for a claim, which the kubelet hands to the container
/// runtime through its CDI device ids.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PreparedDevice {
    /// The claim's requests this device serves; empty means all of them.
    pub request_names: Vec<String>,
    /// The resource pool holding the device (as published in the driver's
    /// ResourceSlices).
    pub pool_name: String,
    /// The device's name in that pool.
    pub device_name: String,
    /// Fully qualified CDI device ids (`vendor/class=name`); none is valid.
    pub cdi_device_ids: Vec<String>,
}

/// Per-claim results of a prepare, keyed by claim uid; an error is a
/// message for the claim's events.
pub type PrepareResults = BTreeMap<String, Result<Vec<PreparedDevice>, String>>;

/// Per-claim results of an unprepare, keyed by claim uid.
pub type UnprepareResults = BTreeMap<String, Result<(), String>>;

/// The node side of a DRA driver.
///
/// Calls never overlap: the service runs one prepare or unprepare at a time,
/// as the upstream helper does by default, so an implementation need not
/// guard against a claim being prepared and unprepared at once. The kubelet
/// retries after a failure or a timeout, so both calls must be idempotent:
/// preparing a prepared claim returns its devices again, unpreparing an
/// unknown claim succeeds.
///
/// Implementations may write `async fn prepare(...)` in their `impl`; the
/// future must be `Send`.
pub trait DraDriver: Send + Sync + 'static {
    /// Prepares `claims` (all with a uid, namespace and name); returns one
    /// result per claim uid. A claim left out of the result is reported to
    /// the kubelet as failed.
    fn prepare(&self, claims: Vec<ClaimRef>) -> impl Future<Output = PrepareResults> + Send;

    /// Undoes the preparation of `claims`; returns one result per claim uid.
    fn unprepare(&self, claims: Vec<ClaimRef>) -> impl Future<Output = UnprepareResults> + Send;
}

impl From<api::Claim> for ClaimRef {
    fn from(c: api::Claim) -> ClaimRef {
        ClaimRef {
            namespace: c.namespace,
            uid: c.uid,
            name: c.name,
        }
    }
}

impl From<ClaimRef> for api::Claim {
    fn from(c: ClaimRef) -> api::Claim {
        api::Claim {
            namespace: c.namespace,
            uid: c.uid,
            name: c.name,
        }
    }
}

impl From<api::Device> for PreparedDevice {
    fn from(d: api::Device) -> PreparedDevice {
        PreparedDevice {
            request_names: d.request_names,
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
        }
    }
}

impl From<PreparedDevice> for api::Device {
    fn from(d: PreparedDevice) -> api::Device {
        api::Device {
            request_names: d.request_names,
            pool_name: d.pool_name,
            device_name: d.device_name,
            cdi_device_ids: d.cdi_device_ids,
        }
    }
}
