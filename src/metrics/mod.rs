//! The Prometheus registry, every metric family, and the plain-HTTP /metrics endpoint.
//! Collectors read /proc and sysfs through procfs; nothing here forks.

pub mod collectors;
pub mod stats;
