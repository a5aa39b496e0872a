//! The load driver: workloads, the runner, reports and the strategy comparison.
