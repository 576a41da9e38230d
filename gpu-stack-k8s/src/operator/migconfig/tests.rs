use gpu_stack_core::operator::migconfig::{LayoutSource, generate};

use super::*;

const EXAMPLE: &str = r#"
apiVersion: gpustack.io/v1alpha1
kind: MigConfig
metadata:
  name: inference
spec:
  nodeSelector:
    pool: inference
  layouts:
    - gpuModel: H100-SXM5-80GB
      profiles:
        1g.10gb: 4
        3g.40gb: 1
    - gpuModel: A100-SXM4-40GB
      config: all-balanced
    - migEnabled: false
"#;

#[test]
fn a_document_becomes_the_planner_input() {
    let m: MigConfig = gpu_stack_core::yaml_guard::from_str(EXAMPLE).unwrap();
    assert!(m.profile_problems().is_empty());
    let input = m.input();
    assert_eq!(input.name, "inference");
    assert_eq!(input.rules.len(), 3);
    assert!(matches!(&input.rules[0].source, LayoutSource::Profiles(p) if p.len() == 2));
    assert_eq!(
        input.rules[1].source,
        LayoutSource::Named("all-balanced".into())
    );
    assert_eq!(input.rules[2].source, LayoutSource::Disabled);
    let shipped = gpu_stack_core::migparted::MigPartedConfig::default_config().unwrap();
    assert_eq!(
        generate(&input, &shipped).unwrap().name,
        "gpustack-inference"
    );
}

#[test]
fn what_admission_would_refuse_is_named_by_the_operator_too() {
    let m: MigConfig = serde_json::from_value(serde_json::json!({
        "apiVersion": "gpustack.io/v1alpha1",
        "kind": "MigConfig",
        "metadata": {"name": "bad"},
        "spec": {"layouts": [
            {"profiles": {"1x.10gb": 1}},
            {"config": "all-balanced", "migEnabled": false},
        ]},
    }))
    .unwrap();
    let p = m.profile_problems();
    assert_eq!(p.len(), 2, "{p:#?}");
    assert!(p[0].starts_with("MigConfig bad: spec.layouts[0].profiles:"));
    assert!(p[1].contains("layouts[1]: set exactly one of"));
}

/// The committed CRD (deploy/crds, copied into the chart) is what the types
/// generate; `GPU_STACK_BLESS=1` rewrites it.
#[test]
fn crd_is_up_to_date() {
    crate::operator::committed::check("crds/gpustack.io_migconfigs.yaml", &crd_yaml().unwrap());
}
