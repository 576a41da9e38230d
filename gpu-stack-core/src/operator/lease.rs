//! When a replica may trust that it still leads: a replica whose lease
//! renewals hang learns it lost the lease only late, and must stop writing
//! before another replica can take the lease.
use std::time::{Duration, Instant};

/// What a replica knows of its lead (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTrust {
    /// How long a lease write keeps the replica sure of its lead: the lease
    /// duration less half the renew grace. The renewal goes out a whole
    /// grace before expiry, so a healthy renewal lands within the first
    /// half; the second half covers clock skew between replicas.
    sure_for: Duration,
    leading: bool,
    sure_until: Option<Instant>,
}

impl LeaseTrust {
    /// For a lease of `duration`, renewed `grace` before it expires.
    pub fn new(duration: Duration, grace: Duration) -> Self {
        Self {
            sure_for: duration.saturating_sub(grace / 2),
            leading: false,
            sure_until: None,
        }
    }

    /// Records whether the election says this replica leads.
    pub fn set_leading(&mut self, leading: bool) {
        self.leading = leading;
    }

    /// A lease write sent at `sent_at` succeeded (a late answer to an older
    /// write moves nothing back).
    pub fn renewed(&mut self, sent_at: Instant) {
        let until = sent_at + self.sure_for;
        if self.sure_until.is_none_or(|u| u < until) {
            self.sure_until = Some(until);
        }
    }

    /// Whether a write other than the lease's own may go out at `now`: the
    /// election says this replica leads and its last lease write is recent
    /// enough that no other replica can hold the lease.
    pub fn admits_write(&self, now: Instant) -> bool {
        self.leading && self.sure_until.is_some_and(|t| now < t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_need_the_lead_and_a_recent_lease_write() {
        let mut t = LeaseTrust::new(Duration::from_secs(15), Duration::from_secs(5));
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_millis(s);
        assert!(!t.admits_write(t0), "no lease write yet");
        t.renewed(t0);
        assert!(
            !t.admits_write(t0),
            "renewed, but the election has not said so"
        );
        t.set_leading(true);
        // The renewal is due 10 s in (duration less grace): writes go on
        // while it is in flight.
        assert!(t.admits_write(at(12_000)));
        // Near the lease's expiry another replica may take it: writes stop
        // even if the election has not noticed (a renewal hung or failed).
        assert!(!t.admits_write(at(12_500)));
        t.renewed(at(10_000));
        assert!(t.admits_write(at(22_000)));
        // An older renewal's answer arriving late moves nothing back.
        t.renewed(t0);
        assert!(t.admits_write(at(22_000)));
        t.set_leading(false);
        assert!(!t.admits_write(at(9_000)));
    }

    proptest::proptest! {
        /// Whatever the renewals: no write is admitted once the lease
        /// duration less half the grace has passed since the latest one.
        #[test]
        fn no_write_after_the_trust_runs_out(
            renewals in proptest::collection::vec(0u64..60_000, 1..8),
            probe in 0u64..80_000,
        ) {
            let mut t = LeaseTrust::new(Duration::from_secs(15), Duration::from_secs(5));
            t.set_leading(true);
            let t0 = Instant::now();
            for r in &renewals {
                t.renewed(t0 + Duration::from_millis(*r));
            }
            let latest = renewals.iter().max().copied().unwrap_or(0);
            let admitted = t.admits_write(t0 + Duration::from_millis(probe));
            proptest::prop_assert_eq!(admitted, probe < latest + 12_500);
        }
    }
}
