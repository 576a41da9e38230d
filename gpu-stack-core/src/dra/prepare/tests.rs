use super::*;
use crate::catalog;
use crate::dra::devices::tests::{h100, system};
use crate::dra::devices::{PublishGpu, gpu_devices};
use crate::mig::parse_layout;

fn geometry() -> &'static MigGeometry {
    catalog::lookup("H100-SXM5-80GB")
        .unwrap()
        .mig
        .as_ref()
        .unwrap()
}

fn published(index: u32) -> GpuDevices {
    gpu_devices(
        &PublishGpu {
            info: &h100(index),
            geometry: Some(geometry()),
            foreign: &[],
        },
        &system(),
    )
}

fn alloc(devices: &[&str]) -> Vec<AllocatedDevice> {
    devices
        .iter()
        .enumerate()
        .map(|(i, d)| AllocatedDevice {
            request: format!("r{i}"),
            device: d.to_string(),
        })
        .collect()
}

#[test]
fn mig_devices_become_instances_beside_what_the_gpu_holds() {
    let (p0, p1) = (published(0), published(1));
    let gpus = [
        PrepareGpu {
            published: &p0,
            geometry: Some(geometry()),
            current: parse_layout("1g.10gb@0").unwrap(),
        },
        PrepareGpu {
            published: &p1,
            geometry: Some(geometry()),
            current: vec![],
        },
    ];
    let plan = plan_claim(
        &gpus,
        &Checkpoint::new(),
        "uid-1",
        &alloc(&["gpu-0-mig-1g10gb-19-1", "gpu-1-mig-3g40gb-9-4"]),
        ValidateOptions::default(),
    )
    .unwrap();
    assert_eq!(
        plan.targets[&0],
        Some(parse_layout("1g.10gb@0,1g.10gb@1").unwrap())
    );
    assert_eq!(plan.targets[&1], Some(parse_layout("3g.40gb@4").unwrap()));
    let mig = plan.devices[1].mig.as_ref().unwrap();
    assert_eq!((mig.profile_id, mig.start, mig.size), (9, 4, 4));
}

#[test]
fn an_overlap_or_an_old_driver_rule_refuses_the_claim_with_the_reason() {
    let p0 = published(0);
    let gpus = [PrepareGpu {
        published: &p0,
        geometry: Some(geometry()),
        current: parse_layout("4g.40gb@0").unwrap(),
    }];
    let err = plan_claim(
        &gpus,
        &Checkpoint::new(),
        "u",
        &alloc(&["gpu-0-mig-3g40gb-9-4"]),
        ValidateOptions {
            pre_r510_driver: true,
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("R510"), "{err}");
    let err = plan_claim(
        &gpus,
        &Checkpoint::new(),
        "u",
        &alloc(&["gpu-0-mig-1g10gb-19-2"]),
        ValidateOptions::default(),
    )
    .unwrap_err();
    assert!(
        matches!(err, PrepareError::InvalidLayout { gpu: 0, .. }),
        "{err}"
    );
}

#[test]
fn a_whole_gpu_needs_no_instances_and_unknown_devices_are_named() {
    let p0 = published(0);
    let busy = [PrepareGpu {
        published: &p0,
        geometry: Some(geometry()),
        current: parse_layout("1g.10gb@0").unwrap(),
    }];
    let err = plan_claim(
        &busy,
        &Checkpoint::new(),
        "u",
        &alloc(&["gpu-0"]),
        Default::default(),
    )
    .unwrap_err();
    assert!(matches!(err, PrepareError::GpuBusy { gpu: 0, .. }), "{err}");
    let idle = [PrepareGpu {
        published: &p0,
        geometry: Some(geometry()),
        current: vec![],
    }];
    let plan = plan_claim(
        &idle,
        &Checkpoint::new(),
        "u",
        &alloc(&["gpu-0"]),
        Default::default(),
    )
    .unwrap();
    assert_eq!(plan.targets[&0], None);
    let err = plan_claim(
        &idle,
        &Checkpoint::new(),
        "u",
        &alloc(&["gpu-9"]),
        Default::default(),
    )
    .unwrap_err();
    assert_eq!(err, PrepareError::UnknownDevice("gpu-9".into()));
    assert_eq!(
        plan_claim(&idle, &Checkpoint::new(), "u", &[], Default::default()).unwrap_err(),
        PrepareError::NothingAllocated
    );
}

#[test]
fn checkpoints_round_trip_and_bad_ones_are_refused() {
    let mut c = Checkpoint::new();
    c.claims.insert(
        "uid".into(),
        ClaimEntry {
            namespace: "ns".into(),
            name: "claim".into(),
            state: ClaimState::Preparing,
            devices: vec![PreparedDevice {
                requests: vec!["r".into()],
                device: "gpu-0-mig-1g10gb-19-0".into(),
                gpu: 0,
                gpu_uuid: "GPU-a".into(),
                mig: Some(PreparedMig {
                    profile: "1g.10gb".into(),
                    profile_id: 19,
                    start: 0,
                    size: 1,
                    uuid: None,
                }),
                cdi_devices: vec![],
            }],
        },
    );
    assert_eq!(Checkpoint::decode(&c.encode()).unwrap(), c);
    assert_eq!(c.owned_on("GPU-a").len(), 1);
    assert!(matches!(
        Checkpoint::decode(b"{\"version\": 9, \"claims\": {}}"),
        Err(CheckpointError::Version(9))
    ));
    assert!(matches!(
        Checkpoint::decode(b"[1,2"),
        Err(CheckpointError::Invalid(_))
    ));
    assert!(matches!(
        Checkpoint::decode(&vec![b' '; MAX_CHECKPOINT_BYTES + 1]),
        Err(CheckpointError::TooLarge(_))
    ));
}

#[test]
fn drivers_before_r510_are_recognised() {
    assert!(pre_r510("470.82.01"));
    assert!(!pre_r510("510.47.03"));
    assert!(!pre_r510("570.195.03"));
    assert!(!pre_r510("garbage"));
}

#[test]
fn a_full_checkpoint_takes_no_new_claim_and_what_it_takes_reads_back() {
    let mut c = Checkpoint::new();
    let entry = ClaimEntry {
        namespace: "ns".into(),
        name: "c".into(),
        state: ClaimState::Prepared,
        devices: Vec::new(),
    };
    for i in 0..MAX_CHECKPOINT_CLAIMS {
        let uid = format!("uid-{i}");
        assert!(c.room_for(&uid).is_ok());
        c.claims.insert(uid, entry.clone());
    }
    assert!(matches!(c.room_for("one-more"), Err(CheckpointError::Full)));
    // A claim already recorded is prepared again without growing it.
    assert!(c.room_for("uid-7").is_ok());
    // Everything it took reads back at the next start.
    assert_eq!(
        Checkpoint::decode(&c.encode()).unwrap().claims.len(),
        MAX_CHECKPOINT_CLAIMS
    );
}
