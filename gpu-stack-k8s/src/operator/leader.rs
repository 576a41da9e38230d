//! Leader election over a `coordination.k8s.io/v1` Lease.
//!
//! Two operator replicas must never act at once. We use kube-lease-manager
//! (same kube major as ours): it renews through server-side apply, so two
//! candidates racing for a free lease conflict on the API server instead of
//! both winning, and it tolerates clock skew up to the grace period. A replica
//! that loses the lease stops acting; the binary exits and is restarted rather
//! than trying to wind down half-finished work.
use std::time::Duration;

use kube::Client;
use kube_lease_manager::{LeaseManagerBuilder, LeaseManagerError};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Errors of leader election.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    /// The Lease could not be read or created.
    #[error(
        "cannot use Lease {namespace}/{name}: {source}; check that the operator's ServiceAccount \
         may get, create and patch coordination.k8s.io leases in {namespace}"
    )]
    Lease {
        /// Lease namespace.
        namespace: String,
        /// Lease name.
        name: String,
        /// Underlying error.
        #[source]
        source: LeaseManagerError,
    },
    /// The lease manager task stopped before this replica became leader.
    #[error("leader election for Lease {namespace}/{name} stopped unexpectedly")]
    Stopped {
        /// Lease namespace.
        namespace: String,
        /// Lease name.
        name: String,
    },
    /// Durations that cannot work together.
    #[error(
        "invalid leader election timing: lease duration {duration:?} must be longer than the \
         renew grace {grace:?} and both at least one second"
    )]
    Timing {
        /// Lease duration.
        duration: Duration,
        /// Renew grace.
        grace: Duration,
    },
}

/// Where the Lease lives and how long a claim lasts.
#[derive(Clone, Debug)]
pub struct LeaderConfig {
    /// Lease name, shared by every replica.
    pub lease_name: String,
    /// Lease namespace (the operator's namespace).
    pub namespace: String,
    /// This replica's identity (the pod name).
    pub identity: String,
    /// How long a claim is valid after its last renewal; failover takes at most this long.
    pub duration: Duration,
    /// How long before expiry the holder renews; also the clock skew tolerated.
    pub grace: Duration,
}

impl LeaderConfig {
    /// Checks the timing rules before anything talks to the API server.
    pub fn validate(&self) -> Result<(), LeaderError> {
        let (d, g) = (self.duration.as_secs(), self.grace.as_secs());
        if d == 0 || g == 0 || g >= d {
            return Err(LeaderError::Timing {
                duration: self.duration,
                grace: self.grace,
            });
        }
        Ok(())
    }
}

/// A running election: tells whether this replica leads, and releases the
/// lease on shutdown so a standby takes over at once.
pub struct Leadership {
    config: LeaderConfig,
    state: watch::Receiver<bool>,
    task: JoinHandle<Result<kube_lease_manager::LeaseManager, LeaseManagerError>>,
}

impl Leadership {
    /// Starts competing for the lease (creating it if missing).
    pub async fn start(client: Client, config: LeaderConfig) -> Result<Self, LeaderError> {
        config.validate()?;
        let manager = LeaseManagerBuilder::new(client, config.lease_name.clone())
            .with_namespace(config.namespace.clone())
            .with_identity(config.identity.clone())
            .with_duration(config.duration.as_secs())
            .with_grace(config.grace.as_secs())
            .with_field_manager(format!("gpu-stack-operator-lease/{}", config.identity))
            .build()
            .await
            .map_err(|source| LeaderError::Lease {
                namespace: config.namespace.clone(),
                name: config.lease_name.clone(),
                source,
            })?;
        let (state, task) = manager.watch().await;
        Ok(Self {
            config,
            state,
            task,
        })
    }

    /// Whether this replica holds the lease right now.
    pub fn is_leader(&self) -> bool {
        *self.state.borrow()
    }

    /// A receiver that sees every change of leadership.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.state.clone()
    }

    /// Waits until this replica holds the lease.
    pub async fn acquired(&mut self) -> Result<(), LeaderError> {
        self.state
            .wait_for(|leader| *leader)
            .await
            .map(|_| ())
            .map_err(|_| LeaderError::Stopped {
                namespace: self.config.namespace.clone(),
                name: self.config.lease_name.clone(),
            })
    }

    /// Resolves when this replica no longer holds the lease (lost it, or the
    /// election task stopped).
    pub async fn lost(&mut self) {
        let _ = self.state.wait_for(|leader| !*leader).await;
    }

    /// Gives the lease up so a standby replica takes over without waiting for
    /// it to expire.
    pub async fn release(self) -> Result<(), LeaderError> {
        let Self {
            config,
            state,
            task,
        } = self;
        drop(state);
        match task.await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(source)) => Err(LeaderError::Lease {
                namespace: config.namespace,
                name: config.lease_name,
                source,
            }),
            Err(_) => Err(LeaderError::Stopped {
                namespace: config.namespace,
                name: config.lease_name,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(duration: u64, grace: u64) -> LeaderConfig {
        LeaderConfig {
            lease_name: "l".into(),
            namespace: "n".into(),
            identity: "i".into(),
            duration: Duration::from_secs(duration),
            grace: Duration::from_secs(grace),
        }
    }

    #[test]
    fn timing_rules() {
        assert!(cfg(15, 5).validate().is_ok());
        assert!(cfg(5, 5).validate().is_err());
        assert!(cfg(0, 0).validate().is_err());
        let err = cfg(3, 10).validate().unwrap_err().to_string();
        assert!(err.contains("longer than the renew grace"), "{err}");
    }
}
