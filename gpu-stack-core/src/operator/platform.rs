//! Which Kubernetes API servers the operator runs against: 1.34 and later,
//! the first release serving `resource.k8s.io/v1`, which the stack's DRA
//! plugin, validator and chart use. An older one is refused at start, before
//! anything is written.
use crate::dra::slices::{KubeVersion, OLDEST_MINOR};

/// Why the operator does not run against an API server.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlatformError {
    /// Older than the oldest release gpu-stack supports.
    #[error(
        "the API server is Kubernetes {found}, older than 1.{OLDEST_MINOR}, the oldest release gpu-stack runs on (its DRA plugin, validator and chart use resource.k8s.io/v1, served from 1.{OLDEST_MINOR}); upgrade the control plane to a supported release (1.35, 1.36 or 1.37)"
    )]
    TooOld {
        /// The version found.
        found: KubeVersion,
    },
}

/// Whether the operator runs against an API server of `version`.
pub fn check_api_server(version: KubeVersion) -> Result<(), PlatformError> {
    if version.at_least(OLDEST_MINOR) {
        Ok(())
    } else {
        Err(PlatformError::TooOld { found: version })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn supported_releases_pass_and_older_ones_are_named() {
        for minor in [34, 35, 36, 37, 40] {
            assert!(check_api_server(KubeVersion { major: 1, minor }).is_ok());
        }
        let err = check_api_server(KubeVersion {
            major: 1,
            minor: 33,
        })
        .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("the API server is Kubernetes 1.33, older than 1.34")
        );
    }

    proptest! {
        #[test]
        fn refused_iff_older_than_the_floor(major in 0u32..4, minor in 0u32..100) {
            let ok = check_api_server(KubeVersion { major, minor }).is_ok();
            prop_assert_eq!(ok, (major, minor) >= (1, OLDEST_MINOR));
        }
    }
}
