//! The gpu-stack binaries the end-to-end tests run as processes. They are the
//! ones cargo built next to the test executable (`target/<profile>/`):
//! `cargo xtask test` and `cargo test --workspace` build every binary of the
//! workspace; a plain `cargo test -p gpu-stack-e2e` does not, and then the
//! error says which `cargo build` to run.
use std::path::{Path, PathBuf};

/// A binary of the workspace could not be found.
#[derive(Debug, thiserror::Error)]
pub enum BinaryError {
    /// The running test is not where cargo puts test executables.
    #[error(
        "cannot locate the target directory from the test executable {0}; run the test \
         through cargo (`cargo xtask test` or `cargo test -p gpu-stack-e2e`)"
    )]
    UnexpectedLocation(PathBuf),
    /// The binary has not been built.
    #[error(
        "{path} is missing: build it with `cargo build -p gpu-stack-bins --bin {name}` \
         (`cargo xtask test` builds it)"
    )]
    Missing {
        /// Where it was looked for.
        path: PathBuf,
        /// The binary's name.
        name: String,
    },
}

/// Path of the workspace binary `name` (e.g. `gpu-feature-discovery`) built
/// in the same target directory and profile as the running test.
pub fn workspace_binary(name: &str) -> Result<PathBuf, BinaryError> {
    let exe = std::env::current_exe()
        .map_err(|_| BinaryError::UnexpectedLocation(PathBuf::from("<unknown>")))?;
    // target/<profile>/deps/<test>-<hash> -> target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .ok_or_else(|| BinaryError::UnexpectedLocation(exe.clone()))?;
    let path = dir.join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(BinaryError::Missing {
            path,
            name: name.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_binary_names_the_build_command() {
        let err = workspace_binary("no-such-gpu-stack-binary").unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("cargo build -p gpu-stack-bins --bin no-such-gpu-stack-binary"),
            "{msg}"
        );
    }
}
