//! Parser for dcgm-exporter counters CSV files (`-f FILE`): one
//! `DCGM field, prometheus type, help` row per line, `#` comments, blank lines.
//!
//! A row that cannot be used (unknown field, unknown type, a field that cannot
//! have that type) is reported with its line number and skipped; the rest of the
//! file still applies. Only a file with no usable metric at all is an error.

use std::fmt;

use super::catalog::{Field, MetricKind, ValueKind, unsupported_reason};

/// One usable row of a counters file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CounterSpec {
    /// The DCGM field (also the metric name).
    pub field: Field,
    /// The type printed in `# TYPE` (or [`MetricKind::Label`]).
    pub kind: MetricKind,
    /// The help text printed in `# HELP`, as written in the file.
    pub help: String,
    /// 1-based line number in the source file.
    pub line: usize,
}

/// The metric set selected by a counters file: series families in file order,
/// and the fields emitted as labels on every series.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CounterSet {
    /// Families to emit, in the order the file lists them.
    pub metrics: Vec<CounterSpec>,
    /// Fields emitted as labels (for example `DCGM_FI_DRIVER_VERSION`).
    pub labels: Vec<CounterSpec>,
}

impl CounterSet {
    /// The built-in default set ([`super::catalog::DEFAULT_COUNTERS_CSV`]).
    pub fn default_set() -> Self {
        match parse_counters(super::catalog::DEFAULT_COUNTERS_CSV) {
            Ok(report) => report.set,
            // The embedded file is covered by tests; an empty set is the
            // only possible outcome of a broken edit and renders nothing.
            Err(_) => CounterSet::default(),
        }
    }

    /// Whether the set emits a series family for `field`.
    pub fn has_metric(&self, field: Field) -> bool {
        self.metrics.iter().any(|m| m.field == field)
    }

    /// Whether the set emits `field` as a label.
    pub fn has_label(&self, field: Field) -> bool {
        self.labels.iter().any(|m| m.field == field)
    }
}

/// Why a row was skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SkipReason {
    /// The row has fewer than three comma-separated columns.
    MissingColumns,
    /// The field name is not one this exporter can produce.
    UnknownField(String),
    /// A DCGM field with no NVML source; the text says why.
    NoSource(String, &'static str),
    /// The type column is not `gauge|counter|histogram|summary|label`.
    UnknownType(String),
    /// The field exists but cannot be emitted with that type.
    UnsupportedKind(Field, MetricKind),
    /// The field was already listed on an earlier line.
    Duplicate(Field, usize),
}

/// A row that was reported and skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedLine {
    /// 1-based line number.
    pub line: usize,
    /// Why it was skipped.
    pub reason: SkipReason,
}

impl fmt::Display for SkippedLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: ", self.line)?;
        match &self.reason {
            SkipReason::MissingColumns => write!(
                f,
                "expected `DCGM field, prometheus type, help`; the row is skipped"
            ),
            SkipReason::UnknownField(name) => write!(
                f,
                "unknown field `{name}`; the row is skipped (check the spelling against the DCGM field names this exporter supports)"
            ),
            SkipReason::NoSource(name, why) => {
                write!(f, "`{name}` is not enabled: {why}; the row is skipped")
            }
            SkipReason::UnknownType(t) => write!(
                f,
                "unknown metric type `{}`; the row is skipped (use gauge, counter, histogram, summary or label)",
                capped(t)
            ),
            SkipReason::UnsupportedKind(field, kind) => write!(
                f,
                "field `{field}` cannot be emitted as a {kind}; the row is skipped (use {})",
                if field.value_kind() == ValueKind::Text {
                    "label"
                } else {
                    "gauge or counter"
                }
            ),
            SkipReason::Duplicate(field, first) => write!(
                f,
                "field `{field}` is already listed on line {first}; the row is skipped"
            ),
        }
    }
}

/// The result of parsing a counters file: the usable set and what was skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseReport {
    /// The metric set to emit.
    pub set: CounterSet,
    /// Rows reported and skipped, in line order.
    pub skipped: Vec<SkippedLine>,
}

/// A counters file that cannot be used at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CountersError {
    /// No row selected a metric this exporter can produce.
    #[error(
        "the counters file selects no metric this exporter can produce ({skipped} row(s) skipped); list at least one known DCGM field, e.g. `DCGM_FI_DEV_GPU_TEMP, gauge, GPU temperature (in C).`"
    )]
    NoMetrics {
        /// How many rows were skipped.
        skipped: usize,
    },
}

/// A name from the file as echoed in a message: at most 80 characters.
fn capped(name: &str) -> String {
    const MAX: usize = 80;
    match name.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}...", &name[..cut]),
        None => name.to_string(),
    }
}

/// Parses the text of a counters CSV file.
pub fn parse_counters(text: &str) -> Result<ParseReport, CountersError> {
    let mut set = CounterSet::default();
    let mut skipped = Vec::new();
    let mut seen: Vec<(Field, usize)> = Vec::new();
    for (idx, raw) in text.lines().enumerate() {
        let line = idx + 1;
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let mut cols = trimmed.splitn(3, ',');
        let (Some(name), Some(kind), Some(help)) = (cols.next(), cols.next(), cols.next()) else {
            skipped.push(SkippedLine {
                line,
                reason: SkipReason::MissingColumns,
            });
            continue;
        };
        let (name, kind, help) = (name.trim(), kind.trim(), help.trim());
        let Some(field) = Field::from_name(name) else {
            let name = capped(name);
            let reason = match unsupported_reason(&name) {
                Some(why) => SkipReason::NoSource(name, why),
                None => SkipReason::UnknownField(name),
            };
            skipped.push(SkippedLine { line, reason });
            continue;
        };
        let Some(kind) = MetricKind::parse(kind) else {
            skipped.push(SkippedLine {
                line,
                reason: SkipReason::UnknownType(kind.to_string()),
            });
            continue;
        };
        let usable = match (field.value_kind(), kind) {
            (ValueKind::Text, MetricKind::Label) => true,
            (ValueKind::Text, _) | (_, MetricKind::Label) => false,
            (_, MetricKind::Gauge | MetricKind::Counter) => true,
            (_, MetricKind::Histogram | MetricKind::Summary) => false,
        };
        if !usable {
            skipped.push(SkippedLine {
                line,
                reason: SkipReason::UnsupportedKind(field, kind),
            });
            continue;
        }
        if let Some(&(_, first)) = seen.iter().find(|(f, _)| *f == field) {
            skipped.push(SkippedLine {
                line,
                reason: SkipReason::Duplicate(field, first),
            });
            continue;
        }
        seen.push((field, line));
        let spec = CounterSpec {
            field,
            kind,
            help: help.to_string(),
            line,
        };
        if kind == MetricKind::Label {
            set.labels.push(spec);
        } else {
            set.metrics.push(spec);
        }
    }
    if set.metrics.is_empty() {
        return Err(CountersError::NoMetrics {
            skipped: skipped.len(),
        });
    }
    Ok(ParseReport { set, skipped })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::catalog::DEFAULT_COUNTERS_CSV;
    use proptest::prelude::*;

    #[test]
    fn default_file_has_dcgm_default_set_plus_xid_count() {
        let report = parse_counters(DEFAULT_COUNTERS_CSV).unwrap();
        assert!(report.skipped.is_empty(), "{:?}", report.skipped);
        assert_eq!(report.set.metrics.len(), 26);
        assert_eq!(report.set.labels.len(), 1);
        assert_eq!(report.set.labels[0].field, Field::DriverVersion);
        let first = &report.set.metrics[0];
        assert_eq!(first.field, Field::SmClock);
        assert_eq!(first.help, "SM clock frequency (in MHz).");
        let energy = report
            .set
            .metrics
            .iter()
            .find(|m| m.field == Field::TotalEnergyConsumption)
            .unwrap();
        assert_eq!(energy.kind, MetricKind::Counter);
        assert_eq!(CounterSet::default_set(), report.set);
    }

    #[test]
    fn unknown_field_is_reported_with_its_line_and_the_rest_applies() {
        let text = "# comment\nDCGM_FI_DEV_GPU_TEMP, gauge, GPU temperature (in C).\n\nDCGM_FI_DEV_WARP_DRIVE, gauge, Nope.\nDCGM_FI_DEV_SM_CLOCK, gauge, SM clock frequency (in MHz).\n";
        let report = parse_counters(text).unwrap();
        assert_eq!(report.set.metrics.len(), 2);
        assert_eq!(report.skipped.len(), 1);
        assert_eq!(report.skipped[0].line, 4);
        let msg = report.skipped[0].to_string();
        assert!(
            msg.starts_with("line 4: unknown field `DCGM_FI_DEV_WARP_DRIVE`"),
            "{msg}"
        );
    }

    #[test]
    fn bad_types_missing_columns_duplicates_and_wrong_kinds_are_skipped() {
        let text = "DCGM_FI_DEV_GPU_TEMP, gauge, a\nDCGM_FI_DEV_SM_CLOCK, meter, b\nDCGM_FI_DEV_MEM_CLOCK gauge\nDCGM_FI_DEV_GPU_TEMP, gauge, again\nDCGM_FI_DRIVER_VERSION, gauge, v\nDCGM_FI_DEV_FB_FREE, label, f\nDCGM_FI_DEV_FB_USED, histogram, u\n";
        let report = parse_counters(text).unwrap();
        let lines: Vec<usize> = report.skipped.iter().map(|s| s.line).collect();
        assert_eq!(lines, vec![2, 3, 4, 5, 6, 7]);
        assert!(matches!(report.skipped[0].reason, SkipReason::UnknownType(ref t) if t == "meter"));
        assert_eq!(report.skipped[1].reason, SkipReason::MissingColumns);
        assert_eq!(
            report.skipped[2].reason,
            SkipReason::Duplicate(Field::GpuTemp, 1)
        );
        assert_eq!(report.set.metrics.len(), 1);
    }

    #[test]
    fn a_file_without_any_usable_metric_is_an_error() {
        let err = parse_counters("DCGM_FI_NOPE, gauge, x\n# only comments\n").unwrap_err();
        assert_eq!(err, CountersError::NoMetrics { skipped: 1 });
        assert!(err.to_string().contains("at least one known DCGM field"));
        assert!(parse_counters("").is_err());
    }

    #[test]
    fn help_may_contain_commas() {
        let report = parse_counters("DCGM_FI_DEV_GPU_TEMP, gauge, hot, very hot\n").unwrap();
        assert_eq!(report.set.metrics[0].help, "hot, very hot");
    }

    proptest! {
        #[test]
        fn parsing_never_panics_and_every_row_is_used_or_reported(text in "[A-Z_a-z, #\\n0-9.]{0,400}") {
            let rows = text.lines().filter(|l| { let t = l.trim(); !t.is_empty() && !t.starts_with('#') }).count();
            match parse_counters(&text) {
                Ok(r) => prop_assert_eq!(r.set.metrics.len() + r.set.labels.len() + r.skipped.len(), rows),
                Err(CountersError::NoMetrics { skipped }) => prop_assert!(skipped <= rows),
            }
        }
    }
}
