//! The MIG manager's decisions: node label protocol (state values, pausing and
//! restoring GPU clients) and per-GPU step plans from the actual GPU state to
//! the selected mig-parted config. The executor that calls the GPU backend and
//! the cluster lives outside core and only follows these decisions.

pub mod labels;
pub mod plan;
pub mod target;

pub use labels::{
    FAILURE_REASON_ANNOTATION, GPU_CLIENTS, GpuClient, LabelEdits, MIG_CONFIG_STATE_LABEL,
    MigConfigState, PAUSE_RECORD_ANNOTATION, PauseRecord, plan_pause, plan_restore,
};
pub use plan::{
    BusyInstance, GpuPlan, MigMode, ObservedCi, ObservedGi, ObservedGpu, Step, TargetGi, TargetGpu,
    from_scratch_calls, plan_gpu,
};
pub use target::{GpuFacts, SelectError, SelectedGpu, select};
