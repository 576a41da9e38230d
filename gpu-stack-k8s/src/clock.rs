//! The wall clock as the agents record it: seconds since the Unix epoch
//! (a clock set before 1970 reads as 0).
use std::time::{SystemTime, UNIX_EPOCH};

/// Whole seconds since the Unix epoch.
pub fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Seconds since the Unix epoch, with the fraction (Prometheus timestamps).
pub fn unix_seconds_f64() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_readings_agree() {
        let whole = unix_seconds();
        let fractional = unix_seconds_f64();
        // Read one after the other: the second is at or after the first.
        assert!(fractional >= whole as f64);
        assert!(whole > 1_700_000_000, "{whole}");
    }
}
