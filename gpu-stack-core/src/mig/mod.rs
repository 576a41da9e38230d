//! MIG (Multi-Instance GPU): profile names, per-GPU geometry, layout
//! validation, fitting a multiset of profiles, enumerating layouts, minimal
//! reconfiguration and fleet planning.
//!
//! Everything works on explicit placements (`profile@start`, in memory-slice
//! units), the way `CreateGpuInstanceWithPlacement` creates instances, so a
//! layout that passes [`validate`] can be created in any order.

mod geometry;
mod name;
mod plan;
mod search;
mod validate;

pub use geometry::{
    CiProfile, Demand, DemandError, GeometryError, GeometrySource, GiProfile, MediaEngines,
    MigGeometry, PlacedInstance, PlacedInstanceError, Placement, derive_ci_profiles, format_layout,
    parse_demand, parse_layout,
};
pub use name::{MediaVariant, MigProfileName, ProfileNameError};
pub use plan::{FleetGpu, FleetPlan, GpuPlan, PlanError, ProfileOutcome, plan_fleet};
pub use search::{
    EnumerateError, FitError, Reconfiguration, check_demand, enumerate_layouts,
    enumerate_maximal_layouts, fit, reconfigure, reconfigure_to_layout,
};
pub use validate::{ValidateOptions, Violation, validate, validate_with};
