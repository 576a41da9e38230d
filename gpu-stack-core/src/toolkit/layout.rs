//! Which containerd files and socket the agent uses on a node, decided from
//! which host paths exist, and the layouts it must not edit.
//!
//! k3s and RKE2 regenerate their containerd config at every start and
//! MicroK8s renders its own from a snap template, so an edit there is lost or
//! fights the distribution; these are refused with the fix named. k0s is
//! handled: it imports a drop-in directory of its own.

use crate::echo;

/// containerd's default main config.
pub const DEFAULT_CONFIG: &str = "/etc/containerd/config.toml";
/// containerd's default socket.
pub const DEFAULT_SOCKET: &str = "/run/containerd/containerd.sock";
/// Our drop-in's file name.
pub const DROP_IN_NAME: &str = "99-gpu-stack.toml";

/// The config k3s generates from `config.toml.tmpl` at every start.
pub const K3S_CONFIG: &str = "/var/lib/rancher/k3s/agent/etc/containerd/config.toml";
/// The config RKE2 generates from `config.toml.tmpl` at every start.
pub const RKE2_CONFIG: &str = "/var/lib/rancher/rke2/agent/etc/containerd/config.toml";
/// k0s' containerd config; it imports [`K0S_DROP_IN_DIR`] itself.
pub const K0S_CONFIG: &str = "/etc/k0s/containerd.toml";
/// k0s' drop-in directory.
pub const K0S_DROP_IN_DIR: &str = "/etc/k0s/containerd.d";
/// k0s' containerd socket.
pub const K0S_SOCKET: &str = "/run/k0s/containerd.sock";
/// The snap template MicroK8s renders its containerd config from.
pub const MICROK8S_TEMPLATE: &str = "/var/snap/microk8s/current/args/containerd-template.toml";

/// containerd sockets seen on nodes; only the first is the plain kubelet's
/// (Docker's own containerd is not).
pub const KNOWN_SOCKETS: [&str; 5] = [
    DEFAULT_SOCKET,
    "/run/k3s/containerd/containerd.sock",
    "/run/docker/containerd/containerd.sock",
    "/var/snap/microk8s/common/run/containerd.sock",
    K0S_SOCKET,
];

/// Which Kubernetes distribution's containerd layout a node has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Distribution {
    /// containerd as packaged (or a config path given explicitly).
    Plain,
    /// k3s: refused (generated config).
    K3s,
    /// RKE2: refused (generated config).
    Rke2,
    /// k0s: its own drop-in directory.
    K0s,
    /// MicroK8s: refused (snap template).
    MicroK8s,
}

/// The files and socket the agent uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The layout found.
    pub distribution: Distribution,
    /// The main config (host path); the drop-in copies its CRI table.
    pub main_config: String,
    /// Our drop-in file (host path).
    pub drop_in: String,
    /// Whether the main config needs our `imports` entry (false where the
    /// distribution imports the drop-in directory itself).
    pub edit_main: bool,
    /// containerd's socket (host path).
    pub socket: String,
}

/// A layout the agent must not edit, or cannot decide alone.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// k3s or RKE2 generates the config the agent would edit.
    #[error(
        "{name} manages containerd on this node: it regenerates {} from config.toml.tmpl in the same directory at every start, so an edit there is lost. Recent {name} releases find NVIDIA runtimes and can enable CDI in the config they generate; otherwise put `enable_cdi = true` (and the runtime) into that config.toml.tmpl, or set toolkit.enabled=false in the ClusterPolicy. To configure a different containerd on this node, set CONTAINERD_CONFIG (and CONTAINERD_SOCKET) to its paths",
        echo::quoted(.path)
    )]
    Generated {
        /// `k3s` or `RKE2`.
        name: &'static str,
        /// The generated config.
        path: String,
    },
    /// MicroK8s renders its containerd config from a snap template.
    #[error(
        "MicroK8s runs its own containerd, configured from the snap-managed template {}, which the agent does not edit (pointing CONTAINERD_CONFIG at the template is not supported either). Use MicroK8s' own nvidia addon (`microk8s enable nvidia`) and set toolkit.enabled=false in the ClusterPolicy, or, for a different containerd on this node, set CONTAINERD_CONFIG and CONTAINERD_SOCKET to its paths",
        echo::quoted(.path)
    )]
    MicroK8s {
        /// The template.
        path: String,
    },
    /// No socket at the default path but others exist: which one the
    /// kubelet uses is not known.
    #[error(
        "no containerd socket at {DEFAULT_SOCKET}, but other containerd sockets exist: {}; set CONTAINERD_SOCKET to the one the kubelet uses, and CONTAINERD_CONFIG to that containerd's config",
        echo::join_capped(.found)
    )]
    AmbiguousSocket {
        /// The sockets found.
        found: Vec<String>,
    },
    /// A requested path that is not absolute.
    #[error(
        "{what} {} is not an absolute path; give the host path, e.g. {example}",
        echo::quoted(.path)
    )]
    RelativePath {
        /// `CONTAINERD_CONFIG` or `CONTAINERD_SOCKET`.
        what: &'static str,
        /// The path given.
        path: String,
        /// A path of the right form.
        example: &'static str,
    },
}

/// Decides the target. `exists` answers whether a host path exists.
/// `config`/`socket` are the user's requested paths (None = the defaults
/// [`DEFAULT_CONFIG`] and [`DEFAULT_SOCKET`]). Rules:
/// - k3s ([`K3S_CONFIG`] exists) or RKE2 ([`RKE2_CONFIG`]): the config is
///   regenerated at every start, so edits are lost: an error naming the path
///   and the fix, unless `config` explicitly points elsewhere.
/// - k0s ([`K0S_CONFIG`] exists, or is the `config` given): drop-in in
///   [`K0S_DROP_IN_DIR`], `edit_main = false`, socket [`K0S_SOCKET`].
/// - MicroK8s ([`MICROK8S_TEMPLATE`] exists): an error naming the path,
///   unless `config` explicitly points elsewhere (not at the template).
/// - Several known sockets ([`KNOWN_SOCKETS`]) and no `socket`: the default
///   one when it exists; when it does not and others do, an error listing
///   them. With none present the default is used (containerd may be starting).
/// - Plain: drop-in `<dir of main config>/conf.d/99-gpu-stack.toml`,
///   `edit_main = true`.
pub fn classify(
    exists: &dyn Fn(&str) -> bool,
    config: Option<&str>,
    socket: Option<&str>,
) -> Result<Target, LayoutError> {
    if let Some(c) = config
        && !c.starts_with('/')
    {
        return Err(LayoutError::RelativePath {
            what: "CONTAINERD_CONFIG",
            path: c.to_string(),
            example: DEFAULT_CONFIG,
        });
    }
    if let Some(s) = socket
        && !s.starts_with('/')
    {
        return Err(LayoutError::RelativePath {
            what: "CONTAINERD_SOCKET",
            path: s.to_string(),
            example: DEFAULT_SOCKET,
        });
    }
    // An explicit path is checked by what it is; without one, by what the
    // host has.
    let is = |managed: &str| match config {
        Some(c) => c == managed,
        None => exists(managed),
    };
    for (name, path) in [("k3s", K3S_CONFIG), ("RKE2", RKE2_CONFIG)] {
        if is(path) {
            return Err(LayoutError::Generated {
                name,
                path: path.to_string(),
            });
        }
    }
    if is(MICROK8S_TEMPLATE) {
        return Err(LayoutError::MicroK8s {
            path: MICROK8S_TEMPLATE.to_string(),
        });
    }
    if is(K0S_CONFIG) {
        return Ok(Target {
            distribution: Distribution::K0s,
            main_config: K0S_CONFIG.to_string(),
            drop_in: format!("{K0S_DROP_IN_DIR}/{DROP_IN_NAME}"),
            edit_main: false,
            socket: socket.unwrap_or(K0S_SOCKET).to_string(),
        });
    }
    let main_config = config.unwrap_or(DEFAULT_CONFIG).to_string();
    let dir = match main_config.rsplit_once('/') {
        Some(("", _)) | None => "",
        Some((dir, _)) => dir,
    };
    let drop_in = format!("{dir}/conf.d/{DROP_IN_NAME}");
    let socket = match socket {
        Some(s) => s.to_string(),
        None => plain_socket(exists)?,
    };
    Ok(Target {
        distribution: Distribution::Plain,
        main_config,
        drop_in,
        edit_main: true,
        socket,
    })
}

fn plain_socket(exists: &dyn Fn(&str) -> bool) -> Result<String, LayoutError> {
    if exists(DEFAULT_SOCKET) {
        return Ok(DEFAULT_SOCKET.to_string());
    }
    let found: Vec<String> = KNOWN_SOCKETS
        .iter()
        .filter(|s| exists(s))
        .map(|s| s.to_string())
        .collect();
    if found.is_empty() {
        Ok(DEFAULT_SOCKET.to_string())
    } else {
        Err(LayoutError::AmbiguousSocket { found })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(paths: &'static [&'static str]) -> impl Fn(&str) -> bool {
        move |p: &str| paths.contains(&p)
    }

    #[test]
    fn plain_uses_the_defaults() {
        let t = classify(&host(&[DEFAULT_CONFIG, DEFAULT_SOCKET]), None, None).unwrap();
        assert_eq!(
            t,
            Target {
                distribution: Distribution::Plain,
                main_config: DEFAULT_CONFIG.into(),
                drop_in: "/etc/containerd/conf.d/99-gpu-stack.toml".into(),
                edit_main: true,
                socket: DEFAULT_SOCKET.into(),
            }
        );
        // Nothing there yet (containerd starting, no config file): defaults.
        assert_eq!(
            classify(&host(&[]), None, None).unwrap().socket,
            DEFAULT_SOCKET
        );
        // An explicit config puts the drop-in beside it.
        let t = classify(
            &host(&[DEFAULT_SOCKET]),
            Some("/opt/ctr/containerd.toml"),
            None,
        )
        .unwrap();
        assert_eq!(t.drop_in, "/opt/ctr/conf.d/99-gpu-stack.toml");
        assert_eq!(t.main_config, "/opt/ctr/containerd.toml");
    }

    #[test]
    fn k3s_and_rke2_are_refused_with_the_fix() {
        for (path, name) in [(K3S_CONFIG, "k3s"), (RKE2_CONFIG, "RKE2")] {
            let exists = move |p: &str| p == path || p == DEFAULT_SOCKET;
            let err = classify(&exists, None, None).unwrap_err();
            assert_eq!(
                err,
                LayoutError::Generated {
                    name,
                    path: path.into()
                }
            );
            let msg = err.to_string();
            assert!(msg.contains(path), "{msg}");
            assert!(msg.contains("config.toml.tmpl"), "{msg}");
            assert!(msg.contains("toolkit.enabled=false"), "{msg}");
            // Asking for the generated file itself is still refused ...
            assert!(classify(&exists, Some(path), None).is_err());
            // ... another config is the user's call.
            let t = classify(&exists, Some("/etc/containerd/config.toml"), None).unwrap();
            assert_eq!(t.distribution, Distribution::Plain);
        }
    }

    #[test]
    fn k0s_uses_its_drop_in_directory() {
        let t = classify(&host(&[K0S_CONFIG, K0S_SOCKET, DEFAULT_SOCKET]), None, None).unwrap();
        assert_eq!(
            t,
            Target {
                distribution: Distribution::K0s,
                main_config: K0S_CONFIG.into(),
                drop_in: "/etc/k0s/containerd.d/99-gpu-stack.toml".into(),
                edit_main: false,
                socket: K0S_SOCKET.into(),
            }
        );
        let t = classify(&host(&[]), Some(K0S_CONFIG), Some("/run/custom.sock")).unwrap();
        assert_eq!(
            (t.distribution, t.socket.as_str()),
            (Distribution::K0s, "/run/custom.sock")
        );
    }

    #[test]
    fn microk8s_is_refused_unless_a_config_is_given() {
        let exists = host(&[
            MICROK8S_TEMPLATE,
            "/var/snap/microk8s/common/run/containerd.sock",
        ]);
        let err = classify(&exists, None, None).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(MICROK8S_TEMPLATE), "{msg}");
        assert!(msg.contains("microk8s enable nvidia"), "{msg}");
        assert!(classify(&exists, Some(MICROK8S_TEMPLATE), None).is_err());
        let t = classify(
            &exists,
            Some("/etc/containerd/config.toml"),
            Some("/var/snap/microk8s/common/run/containerd.sock"),
        )
        .unwrap();
        assert_eq!(t.distribution, Distribution::Plain);
        assert_eq!(t.socket, "/var/snap/microk8s/common/run/containerd.sock");
    }

    #[test]
    fn sockets() {
        // Docker's containerd beside the kubelet's: the default one.
        let both = host(&[DEFAULT_SOCKET, "/run/docker/containerd/containerd.sock"]);
        assert_eq!(classify(&both, None, None).unwrap().socket, DEFAULT_SOCKET);
        // Only others: refuse, listing them and naming the settings.
        let others = host(&[
            "/run/docker/containerd/containerd.sock",
            "/run/k3s/containerd/containerd.sock",
        ]);
        let err = classify(&others, None, None).unwrap_err();
        assert_eq!(
            err,
            LayoutError::AmbiguousSocket {
                found: vec![
                    "/run/k3s/containerd/containerd.sock".into(),
                    "/run/docker/containerd/containerd.sock".into()
                ]
            }
        );
        let msg = err.to_string();
        assert!(
            msg.contains("CONTAINERD_SOCKET") && msg.contains("CONTAINERD_CONFIG"),
            "{msg}"
        );
        assert!(
            msg.contains("/run/docker/containerd/containerd.sock"),
            "{msg}"
        );
        // An explicit socket is taken as given.
        let t = classify(
            &others,
            None,
            Some("/run/docker/containerd/containerd.sock"),
        )
        .unwrap();
        assert_eq!(t.socket, "/run/docker/containerd/containerd.sock");
    }

    #[test]
    fn relative_paths_are_refused() {
        let err = classify(&host(&[]), Some("config.toml"), None).unwrap_err();
        assert!(
            err.to_string()
                .contains("CONTAINERD_CONFIG \"config.toml\" is not an absolute path"),
            "{err}"
        );
        assert!(classify(&host(&[]), None, Some("containerd.sock")).is_err());
    }
}
