//! The container-runtime edits of the CDI-native container toolkit agent.
//!
//! gpu-stack does not install NVIDIA's runtime shim. Its toolkit agent only
//! makes the node's runtime read CDI specs and, when asked, adds a runtime
//! handler (e.g. `nvidia`) that is plain runc, for RuntimeClasses that name
//! it. This module decides the file contents; the agent does the file I/O.
//!
//! - [`containerd`]: the drop-in file, the main config's `imports` entry (and
//!   its removal), and what a running containerd still lacks.
//! - [`crio`]: the CRI-O drop-in.
//! - [`layout`]: which files and socket to use on a node, and the layouts
//!   (k3s, RKE2, MicroK8s) the agent must not edit.
//!
//! ```
//! use gpu_stack_core::toolkit::{RuntimeOptions, containerd};
//!
//! let main = "version = 2\n\n\
//!     [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\n\
//!     \x20 SystemdCgroup = true\n";
//! let opts = RuntimeOptions {
//!     cdi_spec_dirs: vec!["/var/run/cdi".into()],
//!     runtime_handler: Some("nvidia".into()),
//! };
//!
//! // The drop-in carries the user's CRI settings plus CDI and the handler.
//! let drop_in = containerd::render_drop_in(Some(main), &opts)?;
//! assert!(drop_in.contains("enable_cdi = true"));
//! assert!(drop_in.contains("SystemdCgroup = true"));
//! assert!(drop_in.contains("[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.nvidia]"));
//!
//! // The main config only gains an `imports` line.
//! let path = "/etc/containerd/conf.d/99-gpu-stack.toml";
//! let edited = containerd::add_import(Some(main), path)?.ok_or("already imported")?;
//! assert_eq!(
//!     edited,
//!     format!("version = 2\nimports = [\"{path}\"]\n{}", &main["version = 2\n".len()..])
//! );
//! assert_eq!(containerd::add_import(Some(&edited), path)?, None);
//! assert_eq!(containerd::remove_import(&edited, path, true)?, main);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod containerd;
pub mod crio;
pub mod layout;

use crate::echo;

/// Most characters of a runtime handler name: a Kubernetes RuntimeClass
/// handler is an RFC 1123 label.
pub const MAX_HANDLER_LEN: usize = 63;

/// What the container runtime must provide.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RuntimeOptions {
    /// Directories the runtime must read CDI specs from (absolute paths).
    /// The runtime's own directories are kept; these are added.
    pub cdi_spec_dirs: Vec<String>,
    /// A runtime handler to add, plain runc, e.g. `nvidia` for a RuntimeClass
    /// of that handler. `None` (or an empty name) adds none.
    pub runtime_handler: Option<String>,
}

impl RuntimeOptions {
    /// The handler to add, if any: an empty name counts as none.
    pub fn handler(&self) -> Option<&str> {
        self.runtime_handler.as_deref().filter(|h| !h.is_empty())
    }

    /// Checks the options: spec directories are absolute paths, the handler
    /// is a lowercase RFC 1123 label (what a RuntimeClass handler must be).
    pub fn validate(&self) -> Result<(), ConfigError> {
        for dir in &self.cdi_spec_dirs {
            if !dir.starts_with('/') || dir.chars().any(char::is_control) {
                return Err(ConfigError::InvalidSpecDir { dir: dir.clone() });
            }
        }
        if let Some(h) = self.handler()
            && !is_rfc1123_label(h)
        {
            return Err(ConfigError::InvalidHandler {
                name: h.to_string(),
            });
        }
        Ok(())
    }
}

fn is_rfc1123_label(s: &str) -> bool {
    let b = s.as_bytes();
    let inner = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-';
    let edge = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !b.is_empty()
        && b.len() <= MAX_HANDLER_LEN
        && b.iter().all(inner)
        && b.first().is_some_and(edge)
        && b.last().is_some_and(edge)
}

/// Why a runtime configuration could not be read or edited. Every message
/// says what is wrong, where, and how to fix it; echoes of file contents are
/// capped (see [`crate::echo`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The file is not valid TOML.
    #[error(
        "the {what} is not valid TOML: line {line}, column {column}: {message}; the line reads {excerpt}; fix the syntax there and run again"
    )]
    Parse {
        /// Which file, in words.
        what: &'static str,
        /// 1-based line of the error.
        line: usize,
        /// 1-based column (characters) of the error.
        column: usize,
        /// The parser's message, capped.
        message: String,
        /// The offending line, quoted and capped.
        excerpt: String,
    },
    /// A containerd config without `version` and with settings: the version 1
    /// schema, which cannot load drop-in files.
    #[error(
        "the containerd config has no `version` key but has settings (it starts with `{first_key}`), so containerd reads it with the version 1 schema (containerd 1.5 and older, `plugins.cri`), which cannot load drop-in files; migrate it with `containerd config migrate`, add `version = 2` at its top, and run again"
    )]
    Version1 {
        /// The first top-level key or table of the file, capped.
        first_key: String,
    },
    /// A `version` this module does not know.
    #[error(
        "the containerd config says `version = {found}`; only version 2 (containerd 1.x) and version 3 (containerd 2.x) are supported: fix the `version` line"
    )]
    UnsupportedVersion {
        /// The value found, capped.
        found: String,
    },
    /// A containerd release the agent does not configure.
    #[error(
        "the node runs containerd {}: {reason}; nothing was changed",
        echo::quoted(.version)
    )]
    UnsupportedRuntime {
        /// The version CRI `Version` reported, capped.
        version: String,
        /// Why, and what to do.
        reason: &'static str,
    },
    /// A key holds a value of the wrong kind.
    #[error(
        "`{key}` in the {what} is {found}, but containerd expects {expected} there; fix that key and run again"
    )]
    WrongType {
        /// Which file, in words.
        what: &'static str,
        /// The dotted key path, capped.
        key: String,
        /// What containerd expects there.
        expected: &'static str,
        /// What the file has.
        found: &'static str,
    },
    /// The drop-in path to import is not usable as an `imports` entry.
    #[error(
        "cannot import {}: {reason}; pass the drop-in's absolute path",
        echo::quoted(.import)
    )]
    InvalidImport {
        /// The path given.
        import: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The runtime handler name is not a RuntimeClass handler.
    #[error(
        "runtime handler {} is not a lowercase RFC 1123 label (a-z, 0-9 and '-', at most 63 characters, starting and ending with a letter or digit), which a RuntimeClass handler must be; choose such a name",
        echo::quoted(.name)
    )]
    InvalidHandler {
        /// The name given.
        name: String,
    },
    /// A CDI spec directory that is not an absolute path.
    #[error(
        "CDI spec directory {} is not an absolute path; give it as the runtime sees it, e.g. /var/run/cdi",
        echo::quoted(.dir)
    )]
    InvalidSpecDir {
        /// The directory given.
        dir: String,
    },
    /// The parser gave no location for a key that must be edited in place.
    #[error("cannot locate `{key}` in the text of the {what}; edit that key by hand and run again")]
    Unlocatable {
        /// Which file, in words.
        what: &'static str,
        /// The key.
        key: &'static str,
    },
    /// The running containerd's CRI config (CRI `Status`, verbose) is not
    /// what containerd 1.7 or 2.x reports.
    #[error(
        "cannot read the running containerd's CRI config (CRI Status, verbose, info[\"config\"]): {reason}; check that the socket belongs to containerd 1.7 or later"
    )]
    EffectiveConfig {
        /// What was wrong, capped.
        reason: String,
    },
}

/// A [`ConfigError::Parse`] from toml_edit's error, with line and column
/// counted here so the message stays short whatever the line's length.
pub(crate) fn parse_error(
    what: &'static str,
    text: &str,
    err: &toml_edit::TomlError,
) -> ConfigError {
    let mut at = err.span().map_or(0, |s| s.start).min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    let before = &text[..at];
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let line_end = text[at..].find('\n').map_or(text.len(), |i| at + i);
    ConfigError::Parse {
        what,
        line: before.matches('\n').count() + 1,
        column: text[line_start..at].chars().count() + 1,
        message: echo::clipped(err.message().trim()).to_string(),
        excerpt: echo::quoted(text[line_start..line_end].trim_end_matches('\r')).to_string(),
    }
}

/// Why the agent will not signal the process behind the runtime's socket.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignalRefusal {
    /// The socket is served by the init process (socket activation, or a
    /// runtime that is pid 1 of its namespace): a SIGTERM would stop the
    /// node's service manager, not restart the runtime.
    #[error(
        "the runtime's socket is served by pid {pid} (the init process: socket activation?); \
         restart the runtime with its service manager, or set the toolkit's restart mode to \
         `none`"
    )]
    InitProcess {
        /// The peer pid read.
        pid: i32,
    },
    /// Two reads of the socket's peer disagree: the runtime is restarting
    /// or another process took the socket.
    #[error(
        "the runtime's socket changed hands while it was checked (pid {first}, then {second}); \
         nothing was signalled, the next pass tries again"
    )]
    PeerChanged {
        /// The first read.
        first: i32,
        /// The second read.
        second: i32,
    },
}

/// The pid to send SIGTERM to for a runtime restart, from two reads of the
/// socket's peer: both must name the same process, and never the init
/// process (pid 1, or no pid at all).
pub fn runtime_to_signal(first: i32, second: i32) -> Result<i32, SignalRefusal> {
    if first != second {
        return Err(SignalRefusal::PeerChanged { first, second });
    }
    if first <= 1 {
        return Err(SignalRefusal::InitProcess { pid: first });
    }
    Ok(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_validated() {
        let ok = RuntimeOptions {
            cdi_spec_dirs: vec!["/var/run/cdi".into()],
            runtime_handler: Some("nvidia-cdi".into()),
        };
        assert_eq!(ok.validate(), Ok(()));
        let empty = RuntimeOptions {
            runtime_handler: Some(String::new()),
            ..RuntimeOptions::default()
        };
        assert_eq!(empty.handler(), None);
        assert_eq!(empty.validate(), Ok(()));
        for bad in ["Nvidia", "-x", "x-", "a.b", &"a".repeat(64)] {
            let o = RuntimeOptions {
                runtime_handler: Some(bad.into()),
                ..RuntimeOptions::default()
            };
            assert!(
                matches!(o.validate(), Err(ConfigError::InvalidHandler { .. })),
                "{bad}"
            );
        }
        let rel = RuntimeOptions {
            cdi_spec_dirs: vec!["var/run/cdi".into()],
            ..RuntimeOptions::default()
        };
        let err = rel.validate().unwrap_err().to_string();
        assert!(
            err.contains("\"var/run/cdi\" is not an absolute path"),
            "{err}"
        );
    }

    #[test]
    fn parse_errors_name_line_and_column_and_are_capped() {
        let text = format!("version = 2\nx = [1,\n{} = 3\n", "k".repeat(5000));
        let err = match text.parse::<toml_edit::DocumentMut>() {
            Ok(_) => panic!("must not parse"),
            Err(e) => parse_error("containerd config", &text, &e),
        };
        let ConfigError::Parse { line, column, .. } = &err else {
            panic!("{err:?}")
        };
        assert_eq!((*line, *column), (3, 5002), "{err}");
        let msg = err.to_string();
        assert!(
            msg.starts_with("the containerd config is not valid TOML: line 3"),
            "{msg}"
        );
        assert!(msg.contains("more bytes left out"), "{msg}");
        assert!(msg.len() < 600, "{}", msg.len());
    }

    proptest::proptest! {
        /// Only one process, read twice alike, and never init, is signalled.
        #[test]
        fn only_a_steady_peer_other_than_init_is_signalled(a in -3i32..5, b in -3i32..5) {
            match runtime_to_signal(a, b) {
                Ok(pid) => proptest::prop_assert!(pid == a && a == b && pid > 1),
                Err(SignalRefusal::PeerChanged { .. }) => proptest::prop_assert!(a != b),
                Err(SignalRefusal::InitProcess { pid }) => {
                    proptest::prop_assert!(a == b && pid <= 1)
                }
            }
        }
    }
}
