//! dcgm-exporter's counters file with every commented-out row turned on: each
//! row is either emitted or refused with the reason it cannot be (never
//! "unknown field").

use gpu_stack_core::metrics::counters::SkipReason;
use gpu_stack_core::metrics::{Field, MetricKind, parse_counters};

const ALL_FIELDS: &str = include_str!("data/metrics/dcgm-exporter-all-fields.csv");

#[test]
fn every_row_of_the_full_file_is_emitted_or_refused_with_its_reason() {
    let report = parse_counters(ALL_FIELDS).unwrap();
    let rows = ALL_FIELDS
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.trim().starts_with('#'))
        .count();
    assert_eq!(
        report.set.metrics.len() + report.set.labels.len() + report.skipped.len(),
        rows
    );
    let mut no_source = Vec::new();
    for s in &report.skipped {
        match &s.reason {
            SkipReason::NoSource(name, why) => {
                assert!(!why.is_empty());
                no_source.push(name.clone());
            }
            // The file lists the PCIe byte rates twice (a commented counter row
            // near the top and the gauge row in the profiling block).
            SkipReason::Duplicate(Field::ProfPcieTxBytes | Field::ProfPcieRxBytes, _) => {}
            other => panic!("line {}: unexpected {other:?}: {s}", s.line),
        }
    }
    assert_eq!(no_source.len(), 13, "{no_source:?}");
    assert!(no_source.iter().all(|n| n.ends_with("_TOTAL")));
    assert_eq!(report.set.labels.len(), 9);
    for field in [
        Field::PowerViolation,
        Field::EccDbeVolTotal,
        Field::RetiredPending,
        Field::NvlinkCrcFlitErrorCountTotal,
        Field::NvlinkBandwidthL0,
        Field::ProfSmOccupancy,
        Field::ProfPipeFp16Active,
        Field::ClockEventsCount,
        Field::ClockEventsTotal,
        Field::XidErrorsTotal,
        Field::GpuHealthStatus,
        Field::P2pStatus,
    ] {
        assert!(report.set.has_metric(field), "{field}");
    }
    let reason = report
        .skipped
        .iter()
        .find(|s| matches!(&s.reason, SkipReason::NoSource(n, _) if n == "DCGM_FI_PROF_SM_CYCLES_ACTIVE_TOTAL"))
        .unwrap()
        .to_string();
    assert!(reason.contains("is not enabled"), "{reason}");
    assert!(reason.contains("DCGM's profiling module"), "{reason}");
    assert!(!reason.contains("check the spelling"), "{reason}");
    let tx = report
        .set
        .metrics
        .iter()
        .find(|m| m.field == Field::ProfPcieTxBytes)
        .unwrap();
    assert_eq!(
        tx.kind,
        MetricKind::Counter,
        "the first row of a field wins"
    );
}

#[test]
fn unknown_names_still_say_check_the_spelling_and_are_capped() {
    let long = "X".repeat(5000);
    let text = format!(
        "DCGM_FI_DEV_GPU_TEMP, gauge, t\nDCGM_FI_DEV_TEMPERATURE, gauge, t\n{long}, gauge, t\n"
    );
    let report = parse_counters(&text).unwrap();
    let msgs: Vec<String> = report.skipped.iter().map(ToString::to_string).collect();
    assert!(msgs[0].contains("check the spelling"), "{}", msgs[0]);
    assert!(msgs[1].len() < 400, "{}", msgs[1].len());
}
