//! `cargo xtask matrix`: the end-to-end suite on each supported release
//! combination, one throwaway cluster (and real node) after another, and a
//! table of version × test binary.
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::path::Path;

use anyhow::{Context, Result, bail};

use crate::versions::{self, ContainerdRelease, KubeRelease};

/// One column of the matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub kube: KubeRelease,
    pub containerd: ContainerdRelease,
}

impl std::fmt::Display for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "k8s {} / containerd {}", self.kube, self.containerd)
    }
}

/// The default matrix: every Kubernetes minor on the default containerd,
/// then the newest Kubernetes on the other containerd series.
pub fn default_entries() -> Vec<Entry> {
    let default_containerd = versions::CONTAINERD_RELEASES[0];
    let newest = versions::KUBE_RELEASES[versions::KUBE_RELEASES.len() - 1];
    versions::KUBE_RELEASES
        .iter()
        .map(|&kube| Entry {
            kube,
            containerd: default_containerd,
        })
        .chain(
            versions::CONTAINERD_RELEASES[1..]
                .iter()
                .map(|&containerd| Entry {
                    kube: newest,
                    containerd,
                }),
        )
        .collect()
}

/// `1.37/2.3` (Kubernetes minor, containerd series).
pub fn parse_entry(text: &str) -> Result<Entry> {
    let Some((kube, containerd)) = text.split_once('/') else {
        bail!(
            "matrix entry {text:?} is not KUBE/CONTAINERD: write it as 1.37/2.3 \
             (Kubernetes minor, containerd series)"
        );
    };
    Ok(Entry {
        kube: versions::kube(kube)?,
        containerd: versions::containerd(containerd)?,
    })
}

/// Per test binary: (passed, failed) as the test output says.
pub type Outcomes = BTreeMap<String, (usize, usize)>;

/// Reads `cargo test` output: `Running tests/<name>.rs (...)` opens a
/// binary, `test <case> ... ok|FAILED` counts in it.
pub fn parse_outcomes(log: &str) -> Outcomes {
    let mut outcomes = Outcomes::new();
    let mut current: Option<String> = None;
    for line in log.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("Running ") {
            let file = rest.split_whitespace().next().unwrap_or_default();
            current = Path::new(file)
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned());
            continue;
        }
        let (Some(binary), Some(case)) = (&current, line.strip_prefix("test ")) else {
            continue;
        };
        let entry = outcomes.entry(binary.clone()).or_default();
        if case.ends_with(" ... ok") {
            entry.0 += 1;
        } else if case.ends_with(" ... FAILED") {
            entry.1 += 1;
        }
    }
    outcomes
}

/// The table: a row per test binary, a column per entry; a cell is
/// `pass (n)`, `FAIL (k of n)` or `not run`, and the last row says whether
/// the cluster came up.
pub fn table(columns: &[(Entry, Result<Outcomes, String>)]) -> String {
    let mut rows: Vec<String> = columns
        .iter()
        .filter_map(|(_, r)| r.as_ref().ok())
        .flat_map(|o| o.keys().cloned())
        .collect();
    rows.sort();
    rows.dedup();
    let mut out = String::from("| test |");
    for (entry, _) in columns {
        let _ = write!(out, " {entry} |");
    }
    out.push_str("\n|---|");
    out.push_str(&"---|".repeat(columns.len()));
    out.push('\n');
    for row in &rows {
        let _ = write!(out, "| {row} |");
        for (_, result) in columns {
            let cell = match result.as_ref().ok().and_then(|o| o.get(row)) {
                Some(&(passed, 0)) if passed > 0 => format!("pass ({passed})"),
                Some(&(passed, failed)) if failed > 0 => {
                    format!("FAIL ({failed} of {})", passed + failed)
                }
                _ => "not run".to_string(),
            };
            let _ = write!(out, " {cell} |");
        }
        out.push('\n');
    }
    out.push_str("| cluster |");
    for (_, result) in columns {
        let cell = match result {
            Ok(_) => "up".to_string(),
            Err(e) => format!("error: {}", e.chars().take(120).collect::<String>()),
        };
        let _ = write!(out, " {cell} |");
    }
    out.push('\n');
    out
}

/// Writes the table next to the logs and prints it.
pub fn report(dir: &Path, columns: &[(Entry, Result<Outcomes, String>)]) -> Result<()> {
    let text = table(columns);
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("matrix.md");
    fs::write(&path, &text).with_context(|| format!("writing {}", path.display()))?;
    println!("{text}");
    eprintln!("the table is also in {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_matrix_covers_every_minor_and_containerd_series() {
        let entries = default_entries();
        let names: Vec<String> = entries
            .iter()
            .map(|e| format!("{}/{}", e.kube, e.containerd))
            .collect();
        assert_eq!(
            names,
            ["1.35/2.3", "1.36/2.3", "1.37/2.3", "1.37/2.4", "1.37/1.7"]
        );
        assert_eq!(parse_entry("1.36/1.7").unwrap().kube.minor, 36);
        let err = parse_entry("1.37").unwrap_err().to_string();
        assert!(err.contains("1.37/2.3"), "{err}");
        assert!(parse_entry("1.33/2.3").is_err());
    }

    #[test]
    fn outcomes_are_counted_per_test_binary() {
        let log = "\
     Running tests/dra_scale_e2e.rs (target/debug/deps/dra_scale_e2e-1)
running 2 tests
test a ... ok
test b ... FAILED
     Running tests/smoke.rs (target/debug/deps/smoke-2)
test c ... ok
test d ... ignored
";
        let outcomes = parse_outcomes(log);
        assert_eq!(outcomes["dra_scale_e2e"], (1, 1));
        assert_eq!(outcomes["smoke"], (1, 0));
        let entry = default_entries()[0];
        let text = table(&[
            (entry, Ok(outcomes)),
            (entry, Err("etcd did not start".into())),
        ]);
        assert!(
            text.contains("| dra_scale_e2e | FAIL (1 of 2) | not run |"),
            "{text}"
        );
        assert!(text.contains("| smoke | pass (1) | not run |"), "{text}");
        assert!(
            text.contains("| cluster | up | error: etcd did not start |"),
            "{text}"
        );
    }
}
