//! The combined node agent (`gpu-node-agent`): one process on a GPU node that
//! runs the device plugin, GFD, the metrics exporter, the MIG manager and the
//! validator, in place of one pod each.
//!
//! NVIDIA's node contract is kept by running each hosted component exactly
//! while its `nvidia.com/gpu.deploy.<component>` label is `true`: the
//! condition under which its own DaemonSet would have a pod on the node. A
//! label paused by the MIG manager (`paused-for-mig-change`) or the driver
//! upgrade stops that component in the process; the MIG manager waits for the
//! stop to finish as it waits for a separate pod to leave.
//!
//! With the validator hosted, the init containers' gates run in the process
//! too: each component starts once its gates have passed (the validator's
//! checks write the status files, as its pod's init chain does), and the
//! agent is ready while every component that should run is up
//! ([`ready`]), which is what the validator pod's readiness said before.
//!
//! The command line names each component by its binary, followed by that
//! binary's own flags:
//!
//! ```
//! use gpu_stack_core::nodeagent::{parse_segments, should_run};
//! use gpu_stack_core::operator::components::Component;
//! use std::collections::BTreeMap;
//!
//! let args: Vec<String> = ["gpu-device-plugin", "--mig-strategy=mixed", "--", "gpu-exporter"]
//!     .iter().map(|s| s.to_string()).collect();
//! let segments = parse_segments(&args)?;
//! assert_eq!(segments[0].component, Component::DevicePlugin);
//! assert_eq!(segments[0].args, ["gpu-device-plugin", "--mig-strategy=mixed"]);
//!
//! let labels = BTreeMap::from([(
//!     "nvidia.com/gpu.deploy.device-plugin".to_string(),
//!     "paused-for-mig-change".to_string(),
//! )]);
//! assert!(!should_run(&labels, Component::DevicePlugin));
//! # Ok::<(), gpu_stack_core::nodeagent::NodeAgentError>(())
//! ```
use std::collections::{BTreeMap, BTreeSet};

use crate::echo;
use crate::operator::components::Component;

/// The components the node agent can host, with the binary each replaces.
/// The validator is `gpu-stack validator`, so its segment is named by the
/// subcommand.
pub const HOSTED: [(Component, &str); 5] = [
    (Component::DevicePlugin, "gpu-device-plugin"),
    (Component::GpuFeatureDiscovery, "gpu-feature-discovery"),
    (Component::DcgmExporter, "gpu-exporter"),
    (Component::MigManager, "gpu-mig-manager"),
    (Component::OperatorValidator, "validator"),
];

/// The `app` label of the agent's pods (and the name of its DaemonSet).
pub const NODE_AGENT_APP: &str = "gpu-stack-node-agent";

/// Where the agent keeps a file that exists while it is [`ready`] (inside
/// its container: the readiness probe, `gpu-node-agent --check-ready`,
/// looks for it).
pub const READY_FILE: &str = "/tmp/gpu-node-agent.ready";

/// The agent's flag that checks [`READY_FILE`] and exits (its readiness probe).
pub const CHECK_READY_FLAG: &str = "--check-ready";

/// Separator between components on the command line.
pub const SEPARATOR: &str = "--";

/// Most arguments the command line may carry (all components together).
pub const MAX_ARGS: usize = 1024;

/// The binary a hosted component replaces, `None` for components the agent
/// cannot host.
pub fn binary_name(c: Component) -> Option<&'static str> {
    HOSTED.iter().find(|(h, _)| *h == c).map(|(_, b)| *b)
}

/// One hosted component and its command line (the binary's name first, as
/// its own `argv` would be).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// The component.
    pub component: Component,
    /// Its arguments, starting with its binary's name.
    pub args: Vec<String>,
}

/// A command line the node agent cannot run; nothing is started.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeAgentError {
    /// No component was named.
    #[error(
        "no component to run: name at least one after `--`, e.g. `gpu-node-agent -- gpu-device-plugin -- gpu-exporter` (hosted: {})",
        hosted_list()
    )]
    Empty,
    /// A segment is empty (`-- --`).
    #[error(
        "component {index} is empty: every `--` must be followed by a component's binary name (hosted: {})",
        hosted_list()
    )]
    EmptySegment {
        /// 1-based position of the segment.
        index: usize,
    },
    /// A segment starts with a name that is not a hosted binary.
    #[error(
        "component {index}: {name} is not a component the node agent hosts; use one of: {}",
        hosted_list()
    )]
    Unknown {
        /// 1-based position of the segment.
        index: usize,
        /// What was given (capped).
        name: String,
    },
    /// A component is named twice.
    #[error(
        "component {index}: {binary} is named twice; give each component once, with all its flags"
    )]
    Duplicate {
        /// 1-based position of the second segment.
        index: usize,
        /// The repeated binary.
        binary: &'static str,
    },
    /// Too many arguments.
    #[error("{count} arguments is more than the {MAX_ARGS} the node agent accepts")]
    TooManyArgs {
        /// How many were given.
        count: usize,
    },
}

fn hosted_list() -> String {
    HOSTED
        .iter()
        .map(|(_, b)| *b)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Splits the node agent's trailing arguments into one [`Segment`] per
/// component, in the order given. Every segment is checked before any is
/// returned, so a bad command line starts nothing.
pub fn parse_segments(args: &[String]) -> Result<Vec<Segment>, NodeAgentError> {
    if args.len() > MAX_ARGS {
        return Err(NodeAgentError::TooManyArgs { count: args.len() });
    }
    // A leading separator is allowed (`-- gpu-device-plugin ...`).
    let args = args.strip_prefix(&[SEPARATOR.to_string()]).unwrap_or(args);
    if args.is_empty() {
        return Err(NodeAgentError::Empty);
    }
    let mut out: Vec<Segment> = Vec::new();
    for (i, part) in args.split(|a| a == SEPARATOR).enumerate() {
        let index = i + 1;
        let Some(name) = part.first() else {
            return Err(NodeAgentError::EmptySegment { index });
        };
        let Some(&(component, binary)) = HOSTED.iter().find(|(_, b)| b == name) else {
            return Err(NodeAgentError::Unknown {
                index,
                name: echo::quoted(name).to_string(),
            });
        };
        if out.iter().any(|s| s.component == component) {
            return Err(NodeAgentError::Duplicate { index, binary });
        }
        out.push(Segment {
            component,
            args: part.to_vec(),
        });
    }
    Ok(out)
}

/// Whether a hosted component runs on a node with these labels: exactly
/// when its deploy label is `true`, the selector of its own DaemonSet.
pub fn should_run(labels: &BTreeMap<String, String>, c: Component) -> bool {
    labels.get(&c.deploy_label()).map(String::as_str) == Some("true")
}

/// The hosted components that should run on a node with these labels.
pub fn wanted(labels: &BTreeMap<String, String>, hosted: &[Component]) -> BTreeSet<Component> {
    hosted
        .iter()
        .copied()
        .filter(|c| should_run(labels, *c))
        .collect()
}

/// Whether the agent runs its components' gates itself: exactly when it
/// hosts the validator, whose checks write the status files the gates wait
/// for. Otherwise the pod's init containers ran them before the agent started.
pub fn gates_in_process(hosted: &[Component]) -> bool {
    hosted.contains(&Component::OperatorValidator)
}

/// Whether the agent is ready: every component that should run on a node
/// with these labels is `up` (started, past its gates; the validator once
/// its checks have passed). A paused component is not waited for, as its
/// own DaemonSet would not count its pod.
pub fn ready(
    labels: &BTreeMap<String, String>,
    hosted: &[Component],
    up: &BTreeSet<Component>,
) -> bool {
    wanted(labels, hosted).is_subset(up)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn strings(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn every_hosted_binary_parses_with_its_flags() {
        let args = strings(&[
            "--",
            "gpu-device-plugin",
            "--mig-strategy",
            "mixed",
            "--",
            "gpu-feature-discovery",
            "--publish",
            "--",
            "gpu-exporter",
            "--",
            "gpu-mig-manager",
            "--config-file=/c.yaml",
            "--",
            "validator",
            "--host-root=/host",
        ]);
        let s = parse_segments(&args).unwrap();
        let components: Vec<Component> = s.iter().map(|s| s.component).collect();
        assert_eq!(
            components,
            HOSTED.iter().map(|(c, _)| *c).collect::<Vec<_>>()
        );
        assert_eq!(s[2].args, ["gpu-exporter"]);
        assert_eq!(s[3].args, ["gpu-mig-manager", "--config-file=/c.yaml"]);
    }

    #[test]
    fn bad_command_lines_are_refused_with_what_to_do() {
        assert_eq!(parse_segments(&[]), Err(NodeAgentError::Empty));
        assert_eq!(
            parse_segments(&strings(&["gpu-exporter", "--", "--", "gpu-mig-manager"])),
            Err(NodeAgentError::EmptySegment { index: 2 })
        );
        let err = parse_segments(&strings(&["gpu-operator"])).unwrap_err();
        assert!(
            err.to_string()
                .contains("gpu-device-plugin, gpu-feature-discovery")
        );
        assert_eq!(
            parse_segments(&strings(&[
                "gpu-exporter",
                "--",
                "gpu-exporter",
                "-a",
                ":1"
            ])),
            Err(NodeAgentError::Duplicate {
                index: 2,
                binary: "gpu-exporter"
            })
        );
        let long = vec!["x".repeat(100_000)];
        assert!(parse_segments(&long).unwrap_err().to_string().len() < 1_000);
        let many = vec!["gpu-exporter".to_string(); MAX_ARGS + 1];
        assert_eq!(
            parse_segments(&many),
            Err(NodeAgentError::TooManyArgs {
                count: MAX_ARGS + 1
            })
        );
    }

    #[test]
    fn only_hosted_components_have_a_binary() {
        assert_eq!(binary_name(Component::DcgmExporter), Some("gpu-exporter"));
        assert_eq!(binary_name(Component::Driver), None);
        assert_eq!(binary_name(Component::OperatorValidator), Some("validator"));
        assert_eq!(binary_name(Component::ContainerToolkit), None);
    }

    #[test]
    fn the_driver_upgrade_waits_for_the_agent_that_hosts_the_validator() {
        let selector = crate::operator::upgrade::state::VALIDATOR_POD_SELECTOR;
        assert!(selector.contains(NODE_AGENT_APP), "{selector}");
    }

    #[test]
    fn the_gates_run_in_the_process_with_the_validator_hosted() {
        assert!(gates_in_process(&[
            Component::DevicePlugin,
            Component::OperatorValidator
        ]));
        assert!(!gates_in_process(&[
            Component::DevicePlugin,
            Component::MigManager
        ]));
    }

    fn label_value() -> impl Strategy<Value = Option<String>> {
        prop_oneof![
            Just(None),
            Just(Some("true".to_string())),
            Just(Some("false".to_string())),
            Just(Some("paused-for-mig-change".to_string())),
            Just(Some("paused-for-driver-upgrade".to_string())),
            "[a-zA-Z-]{0,12}".prop_map(Some),
        ]
    }

    proptest! {
        /// A hosted component runs exactly when its own DaemonSet's node
        /// selector would match, whatever the other labels say.
        #[test]
        fn a_component_runs_exactly_when_its_deploy_label_is_true(
            values in proptest::collection::vec(label_value(), HOSTED.len()),
            other in "[a-z]{1,8}",
        ) {
            let mut labels = BTreeMap::new();
            labels.insert(format!("example.com/{other}"), "true".to_string());
            for ((c, _), v) in HOSTED.iter().zip(&values) {
                if let Some(v) = v {
                    labels.insert(c.deploy_label(), v.clone());
                }
            }
            let hosted: Vec<Component> = HOSTED.iter().map(|(c, _)| *c).collect();
            let run = wanted(&labels, &hosted);
            for ((c, _), v) in HOSTED.iter().zip(&values) {
                prop_assert_eq!(run.contains(c), v.as_deref() == Some("true"));
            }
        }

        /// Any order of distinct hosted components, each with arbitrary
        /// flags that are not the separator, comes back as given.
        #[test]
        fn segments_round_trip(
            order in Just((0..HOSTED.len()).collect::<Vec<_>>()).prop_shuffle(),
            take in 1..=HOSTED.len(),
            flags in proptest::collection::vec(
                proptest::collection::vec("-{0,2}[a-z=/0-9]{1,10}", 0..4), HOSTED.len()),
        ) {
            let mut args = Vec::new();
            let mut expected = Vec::new();
            for &i in order.iter().take(take) {
                if !args.is_empty() {
                    args.push(SEPARATOR.to_string());
                }
                let mut seg = vec![HOSTED[i].1.to_string()];
                seg.extend(flags[i].iter().cloned());
                args.extend(seg.iter().cloned());
                expected.push(Segment { component: HOSTED[i].0, args: seg });
            }
            prop_assert_eq!(parse_segments(&args).unwrap(), expected);
        }

        /// The agent is ready exactly when each component whose label is
        /// `true` is up; what is up beyond that changes nothing.
        #[test]
        fn ready_means_every_wanted_component_is_up(
            values in proptest::collection::vec(label_value(), HOSTED.len()),
            up_mask in proptest::collection::vec(any::<bool>(), HOSTED.len()),
        ) {
            let mut labels = BTreeMap::new();
            for ((c, _), v) in HOSTED.iter().zip(&values) {
                if let Some(v) = v {
                    labels.insert(c.deploy_label(), v.clone());
                }
            }
            let hosted: Vec<Component> = HOSTED.iter().map(|(c, _)| *c).collect();
            let up: BTreeSet<Component> = hosted
                .iter()
                .zip(&up_mask)
                .filter(|(_, u)| **u)
                .map(|(c, _)| *c)
                .collect();
            let expected = hosted
                .iter()
                .zip(&values)
                .zip(&up_mask)
                .all(|((_, v), u)| *u || v.as_deref() != Some("true"));
            prop_assert_eq!(ready(&labels, &hosted, &up), expected);
        }
    }
}
