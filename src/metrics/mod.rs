//! The Prometheus registry, every metric family, and the plain-HTTP /metrics endpoint.
//! Collectors read /proc and sysfs through procfs; nothing here forks.

pub mod admission;
pub mod cadvisor;
pub mod collectors;
pub mod families;
pub mod http;
pub mod probes;
pub mod process;
pub mod stats;

pub use families::{escape_label, DuplicateFamily, Metrics, TextSource, PREFIX};

/// Content type of the text exposition format.
pub const TEXT_CONTENT_TYPE: &str = prometheus::TEXT_FORMAT;
