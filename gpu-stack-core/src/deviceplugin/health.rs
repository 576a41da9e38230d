//! Device health: which Xids count, and when a device is Unhealthy or Healthy
//! again.
//!
//! Marking follows NVIDIA's plugin: a critical Xid (one not in the ignored
//! list) marks the device Unhealthy; an event on a full GPU also covers its MIG
//! devices; an event that cannot be attributed marks every device.
//!
//! Recovery differs on purpose: a device becomes Healthy again once **both**
//! (a) the GPU backend reports that its fault condition cleared (the device
//! answers queries again, e.g. after a GPU reset), and (b) no critical Xid was
//! seen on it for the quiet period (default 60 s) since the last one. A new
//! critical Xid restarts the quiet period and cancels a pending recovery. Time is
//! passed in as milliseconds from any monotonic origin, so the rule is pure.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// Xids that signal application errors, not GPU faults; ignored by default
/// (13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped
/// processing, 45 preemptive cleanup, 68 video processor exception,
/// 109 context switch timeout).
pub const DEFAULT_IGNORED_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// Default quiet period before a cleared device counts as Healthy again.
pub const DEFAULT_RECOVERY_QUIET_MS: u64 = 60_000;

/// Errors in the health-check settings.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HealthError {
    /// An entry of `DP_DISABLE_HEALTHCHECKS` / `DP_ENABLE_HEALTHCHECKS` is not an Xid.
    #[error(
        "{var}: {value:?} is not an Xid number; use a comma-separated list of Xids, or 'all' / 'xids'"
    )]
    BadXid {
        /// Variable name.
        var: &'static str,
        /// Offending entry.
        value: String,
    },
}

/// Which Xids are acted on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HealthPolicy {
    /// All health checks off (`DP_DISABLE_HEALTHCHECKS=all`).
    pub all_disabled: bool,
    /// Xids that never mark a device.
    pub ignored: BTreeSet<u64>,
    /// Xids that always mark a device, even if disabled or ignored.
    pub enabled: BTreeSet<u64>,
    /// Quiet period before recovery, in ms.
    pub recovery_quiet_ms: u64,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        HealthPolicy {
            all_disabled: false,
            ignored: DEFAULT_IGNORED_XIDS.into_iter().collect(),
            enabled: BTreeSet::new(),
            recovery_quiet_ms: DEFAULT_RECOVERY_QUIET_MS,
        }
    }
}

fn parse_list(var: &'static str, v: &str) -> Result<(bool, BTreeSet<u64>), HealthError> {
    let mut all = false;
    let mut set = BTreeSet::new();
    for part in v.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.to_ascii_lowercase().as_str() {
            "all" | "xids" => all = true,
            n => {
                let x = n.parse().map_err(|_| HealthError::BadXid {
                    var,
                    value: part.to_string(),
                })?;
                set.insert(x);
            }
        }
    }
    Ok((all, set))
}

impl HealthPolicy {
    /// Builds the policy from NVIDIA's variables: `DP_DISABLE_HEALTHCHECKS`
    /// (`all`/`xids` or extra Xids to ignore) and `DP_ENABLE_HEALTHCHECKS`
    /// (Xids to act on regardless; `all` acts on every Xid).
    pub fn from_env(
        disable: Option<&str>,
        enable: Option<&str>,
    ) -> Result<HealthPolicy, HealthError> {
        let mut p = HealthPolicy::default();
        if let Some(d) = disable {
            let (all, extra) = parse_list("DP_DISABLE_HEALTHCHECKS", d)?;
            p.all_disabled = all;
            p.ignored.extend(extra);
        }
        if let Some(e) = enable {
            let (all, xids) = parse_list("DP_ENABLE_HEALTHCHECKS", e)?;
            if all {
                p.all_disabled = false;
                p.ignored.clear();
            }
            p.enabled = xids;
        }
        Ok(p)
    }

    /// Whether an Xid marks a device Unhealthy.
    pub fn is_critical(&self, xid: u64) -> bool {
        if self.enabled.contains(&xid) {
            return true;
        }
        !self.all_disabled && !self.ignored.contains(&xid)
    }
}

/// A health signal from the GPU backend.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "kind")]
pub enum HealthEvent {
    /// An Xid on a GPU (`GPU-…`, also covers its MIG devices) or a MIG device (`MIG-…`).
    Xid {
        /// Device UUID.
        uuid: String,
        /// Xid number.
        xid: u64,
    },
    /// The device stopped answering (lost from the bus, handle invalid).
    Lost {
        /// Device UUID.
        uuid: String,
    },
    /// The backend failed in a way that cannot be attributed to one device.
    AllDevices {
        /// What happened.
        reason: String,
    },
    /// The backend reports the device's fault condition cleared.
    Cleared {
        /// Device UUID.
        uuid: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Fault {
    last_critical_ms: u64,
    cleared: bool,
    reason: String,
}

/// Tracks which devices are Unhealthy. Keys are UUIDs of GPUs or MIG devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthTracker {
    policy: HealthPolicy,
    faults: BTreeMap<String, Fault>,
    all: Option<Fault>,
}

impl HealthTracker {
    /// A tracker with everything Healthy.
    pub fn new(policy: HealthPolicy) -> HealthTracker {
        HealthTracker {
            policy,
            faults: BTreeMap::new(),
            all: None,
        }
    }

    /// The policy in use.
    pub fn policy(&self) -> &HealthPolicy {
        &self.policy
    }

    /// Applies an event at time `now_ms`; returns whether any device's health changed.
    pub fn apply(&mut self, event: &HealthEvent, now_ms: u64) -> bool {
        let before = self.snapshot();
        match event {
            HealthEvent::Xid { uuid, xid } => {
                if self.policy.is_critical(*xid) {
                    self.mark(uuid, now_ms, format!("Xid {xid}"));
                }
            }
            HealthEvent::Lost { uuid } => {
                if !self.policy.all_disabled {
                    self.mark(uuid, now_ms, "device lost".into());
                }
            }
            HealthEvent::AllDevices { reason } => {
                if !self.policy.all_disabled {
                    self.all = Some(Fault {
                        last_critical_ms: now_ms,
                        cleared: false,
                        reason: reason.clone(),
                    });
                }
            }
            HealthEvent::Cleared { uuid } => {
                if let Some(f) = self.faults.get_mut(uuid) {
                    f.cleared = true;
                }
                if let Some(f) = self.all.as_mut() {
                    f.cleared = true;
                }
            }
        }
        self.tick_inner(now_ms);
        before != self.snapshot()
    }

    /// Lets time pass: recovers cleared devices whose quiet period is over.
    /// Returns whether any device's health changed.
    pub fn tick(&mut self, now_ms: u64) -> bool {
        let before = self.snapshot();
        self.tick_inner(now_ms);
        before != self.snapshot()
    }

    fn tick_inner(&mut self, now_ms: u64) {
        let quiet = self.policy.recovery_quiet_ms;
        let over = |f: &Fault| f.cleared && now_ms.saturating_sub(f.last_critical_ms) >= quiet;
        self.faults.retain(|_, f| !over(f));
        if self.all.as_ref().is_some_and(over) {
            self.all = None;
        }
    }

    fn mark(&mut self, uuid: &str, now_ms: u64, reason: String) {
        let f = self.faults.entry(uuid.to_string()).or_insert(Fault {
            last_critical_ms: now_ms,
            cleared: false,
            reason: String::new(),
        });
        f.last_critical_ms = f.last_critical_ms.max(now_ms);
        f.cleared = false;
        f.reason = reason;
    }

    fn snapshot(&self) -> (Vec<String>, bool) {
        (self.faults.keys().cloned().collect(), self.all.is_some())
    }

    /// Why a device (by its own UUID and its parent GPU's UUID) is Unhealthy, or
    /// `None` when it is Healthy.
    pub fn unhealthy_reason(&self, uuid: &str, gpu_uuid: &str) -> Option<&str> {
        if let Some(f) = &self.all {
            return Some(&f.reason);
        }
        self.faults
            .get(uuid)
            .or_else(|| self.faults.get(gpu_uuid))
            .map(|f| f.reason.as_str())
    }

    /// Whether a device is Healthy.
    pub fn is_healthy(&self, uuid: &str, gpu_uuid: &str) -> bool {
        self.unhealthy_reason(uuid, gpu_uuid).is_none()
    }

    /// UUIDs with a fault whose condition has not been reported cleared yet,
    /// so callers know which devices to probe.
    pub fn uncleared(&self) -> Vec<String> {
        self.faults
            .iter()
            .filter(|(_, f)| !f.cleared)
            .map(|(u, _)| u.clone())
            .collect()
    }

    /// Whether a fault that covers every device is pending.
    pub fn all_devices_faulted(&self) -> bool {
        self.all.is_some()
    }

    /// Earliest time at which a pending recovery could happen, so callers know
    /// when to call [`HealthTracker::tick`].
    pub fn next_recovery_ms(&self) -> Option<u64> {
        let quiet = self.policy.recovery_quiet_ms;
        self.faults
            .values()
            .chain(self.all.iter())
            .filter(|f| f.cleared)
            .map(|f| f.last_critical_ms.saturating_add(quiet))
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const G: &str = "GPU-0";
    const M: &str = "MIG-0-1";

    fn xid(uuid: &str, x: u64) -> HealthEvent {
        HealthEvent::Xid {
            uuid: uuid.into(),
            xid: x,
        }
    }

    #[test]
    fn ignored_xids_do_not_mark() {
        let mut t = HealthTracker::new(HealthPolicy::default());
        for x in DEFAULT_IGNORED_XIDS {
            assert!(!t.apply(&xid(G, x), 0));
        }
        assert!(t.is_healthy(G, G));
        assert!(t.apply(&xid(G, 79), 0));
        assert!(!t.is_healthy(G, G));
        assert_eq!(
            t.unhealthy_reason(M, G),
            Some("Xid 79"),
            "GPU fault covers its MIG devices"
        );
    }

    #[test]
    fn mig_fault_stays_on_the_mig_device() {
        let mut t = HealthTracker::new(HealthPolicy::default());
        t.apply(&xid(M, 94), 0);
        assert!(!t.is_healthy(M, G));
        assert!(t.is_healthy("MIG-0-2", G));
        assert!(t.is_healthy(G, G));
    }

    #[test]
    fn env_lists() {
        let p = HealthPolicy::from_env(Some("all"), None).unwrap();
        assert!(!p.is_critical(79));
        let p = HealthPolicy::from_env(Some("all"), Some("79")).unwrap();
        assert!(p.is_critical(79) && !p.is_critical(48));
        let p = HealthPolicy::from_env(Some("48, 63"), Some("13")).unwrap();
        assert!(!p.is_critical(48) && !p.is_critical(63) && p.is_critical(13) && p.is_critical(79));
        let p = HealthPolicy::from_env(None, Some("all")).unwrap();
        assert!(p.is_critical(13));
        assert!(matches!(
            HealthPolicy::from_env(Some("79,x"), None),
            Err(HealthError::BadXid { .. })
        ));
    }

    #[test]
    fn recovery_needs_clear_and_quiet_period() {
        let mut t = HealthTracker::new(HealthPolicy {
            recovery_quiet_ms: 1000,
            ..HealthPolicy::default()
        });
        t.apply(&xid(G, 79), 100);
        assert!(!t.tick(5000), "no clear, no recovery");
        t.apply(&xid(G, 79), 5000);
        assert!(
            !t.apply(&HealthEvent::Cleared { uuid: G.into() }, 5500),
            "quiet period not over"
        );
        assert_eq!(t.next_recovery_ms(), Some(6000));
        assert!(!t.tick(5999));
        assert!(t.tick(6000));
        assert!(t.is_healthy(G, G));
    }

    #[test]
    fn new_xid_cancels_pending_recovery() {
        let mut t = HealthTracker::new(HealthPolicy {
            recovery_quiet_ms: 1000,
            ..HealthPolicy::default()
        });
        t.apply(&xid(G, 79), 0);
        t.apply(&HealthEvent::Cleared { uuid: G.into() }, 10);
        t.apply(&xid(G, 48), 500);
        assert!(!t.tick(2000));
        assert!(!t.is_healthy(G, G));
    }

    #[test]
    fn all_devices_fault() {
        let mut t = HealthTracker::new(HealthPolicy {
            recovery_quiet_ms: 0,
            ..HealthPolicy::default()
        });
        assert!(t.apply(
            &HealthEvent::AllDevices {
                reason: "event wait failed".into()
            },
            0
        ));
        assert!(!t.is_healthy("GPU-9", "GPU-9"));
        assert!(t.apply(
            &HealthEvent::Cleared {
                uuid: "GPU-9".into()
            },
            1
        ));
        assert!(t.is_healthy("GPU-9", "GPU-9"));
    }

    proptest! {
        /// Whatever happened before, a device is Healthy at time t iff its last
        /// critical event is followed by a clear and t is past the quiet period.
        #[test]
        fn recovery_rule_holds(events in proptest::collection::vec((0u8..3, 0u64..200), 0..40), extra in 0u64..3000) {
            let quiet = 1000;
            let mut t = HealthTracker::new(HealthPolicy { recovery_quiet_ms: quiet, ..HealthPolicy::default() });
            let mut now = 0;
            let mut last_critical: Option<u64> = None;
            let mut cleared_after = false;
            for (kind, dt) in events {
                now += dt;
                match kind {
                    0 => { t.apply(&xid(G, 79), now); last_critical = Some(now); cleared_after = false; }
                    1 => { t.apply(&xid(G, 13), now); }
                    _ => { t.apply(&HealthEvent::Cleared { uuid: G.into() }, now); if last_critical.is_some() { cleared_after = true; } }
                }
                if let Some(lc) = last_critical
                    && cleared_after
                    && now - lc >= quiet
                {
                    last_critical = None;
                    cleared_after = false;
                }
            }
            now += extra;
            t.tick(now);
            let expect_healthy = match last_critical {
                None => true,
                Some(lc) => cleared_after && now - lc >= quiet,
            };
            prop_assert_eq!(t.is_healthy(G, G), expect_healthy);
        }
    }
}
