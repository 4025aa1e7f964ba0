//! Quantities and capacity: the host's facts, the VK_NODE_* overrides and the reserve.
//! Computes the capacity and allocatable the Node object advertises.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::NodeOptions;

/// Parse a Kubernetes quantity ("16", "500m", "64Gi", "1e3") into its numeric value.
pub fn parse_quantity(s: &str) -> Result<f64, NotAQuantity> {
    crate::vm::resources::parse_quantity_f64(s).ok_or_else(|| NotAQuantity(s.to_string()))
}

/// The text given where a Kubernetes quantity belongs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotAQuantity(pub String);

impl std::fmt::Display for NotAQuantity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?} is not a Kubernetes quantity", self.0)
    }
}

impl std::error::Error for NotAQuantity {}

/// A capacity override (`VK_NODE_CPU`, …) that is not a quantity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapacityError {
    /// The setting's name.
    pub setting: &'static str,
    pub value: NotAQuantity,
}

impl std::fmt::Display for CapacityError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.setting, self.value)
    }
}

impl std::error::Error for CapacityError {}

/// What the host would not tell at startup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostFactsError {
    /// /proc/meminfo unreadable: the reader's message.
    Meminfo(String),
    /// statvfs of the cocoon root failed.
    Statfs {
        dir: PathBuf,
        errno: rustix::io::Errno,
    },
}

impl std::fmt::Display for HostFactsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostFactsError::Meminfo(e) => write!(f, "/proc/meminfo: {e}"),
            HostFactsError::Statfs { dir, errno } => write!(f, "statfs {}: {errno}", dir.display()),
        }
    }
}

impl std::error::Error for HostFactsError {}

/// A byte count as the shortest exact binary quantity ("2Mi", "1Gi", else plain bytes).
pub fn binary_quantity(bytes: u64) -> String {
    for (suffix, shift) in [
        ("Ei", 60),
        ("Pi", 50),
        ("Ti", 40),
        ("Gi", 30),
        ("Mi", 20),
        ("Ki", 10),
    ] {
        if bytes != 0 && bytes.is_multiple_of(1u64 << shift) {
            return format!("{}{suffix}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// What the host offers, read once at startup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostFacts {
    pub cpus: u64,
    pub mem_total_bytes: u64,
    /// HugePages_Total (count) and Hugepagesize (bytes); 0 when absent.
    pub hugepages_total: u64,
    pub hugepage_size_bytes: u64,
    pub fs_total_bytes: u64,
    pub fs_avail_bytes: u64,
}

impl HostFacts {
    /// Read CPU count, /proc/meminfo and statvfs(root_dir).
    pub fn read(root_dir: &Path) -> Result<HostFacts, HostFactsError> {
        use procfs::Current;
        let cpus = std::thread::available_parallelism()
            .map(|n| n.get() as u64)
            .unwrap_or(1);
        let mem = procfs::Meminfo::current().map_err(|e| HostFactsError::Meminfo(e.to_string()))?;
        let fs = rustix::fs::statvfs(root_dir).map_err(|errno| HostFactsError::Statfs {
            dir: root_dir.to_path_buf(),
            errno,
        })?;
        Ok(HostFacts {
            cpus,
            mem_total_bytes: mem.mem_total,
            hugepages_total: mem.hugepages_total.unwrap_or(0),
            hugepage_size_bytes: mem.hugepagesize.unwrap_or(0),
            fs_total_bytes: fs.f_blocks.saturating_mul(fs.f_bsize),
            fs_avail_bytes: fs.f_bavail.saturating_mul(fs.f_bsize),
        })
    }
}

/// Capacity and allocatable, as the Node carries them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Resources {
    pub capacity: BTreeMap<String, Quantity>,
    pub allocatable: BTreeMap<String, Quantity>,
}

pub(super) fn reduce(v: f64, reserve: u8) -> u64 {
    let keep = u128::from(100 - reserve.min(100));
    if v.fract() == 0.0 && (0.0..9.0e18).contains(&v) {
        // Whole numbers (bytes, cores) in exact integer arithmetic.
        return (v as u128 * keep / 100) as u64;
    }
    (v * keep as f64 / 100.0 + 1e-9).floor().max(0.0) as u64
}

fn fmt_num(v: f64) -> String {
    if v.fract() == 0.0 && v < 1e18 {
        format!("{}", v as u64)
    } else {
        format!("{}m", (v * 1000.0).round() as u64)
    }
}

/// Compute capacity/allocatable at startup: overrides win, allocatable is
/// reduced by the reserve percentage (rounded down), pods are copied unreduced.
pub fn compute_resources(o: &NodeOptions, h: &HostFacts) -> Result<Resources, CapacityError> {
    let q = |s: String| Quantity(s);
    let mut r = Resources::default();
    let reserve = o.reserve_percent.min(100);
    let named = |setting: &'static str, v: &str| {
        parse_quantity(v).map_err(|value| CapacityError { setting, value })
    };
    // cpu
    let (cpu_cap, cpu_val) = match &o.cpu {
        Some(s) => (s.trim().to_string(), named("VK_NODE_CPU", s)?),
        None => (h.cpus.to_string(), h.cpus as f64),
    };
    r.capacity.insert("cpu".into(), q(cpu_cap));
    r.allocatable
        .insert("cpu".into(), q(reduce(cpu_val, reserve).to_string()));
    // memory
    let (mem_cap, mem_val) = match &o.mem {
        Some(s) => (s.trim().to_string(), named("VK_NODE_MEM", s)?),
        None => (h.mem_total_bytes.to_string(), h.mem_total_bytes as f64),
    };
    r.capacity.insert("memory".into(), q(mem_cap));
    r.allocatable
        .insert("memory".into(), q(reduce(mem_val, reserve).to_string()));
    // ephemeral-storage: allocatable from the available bytes, not the total
    let (st_cap, st_avail) = match &o.storage {
        Some(s) => (s.trim().to_string(), named("VK_NODE_STORAGE", s)?),
        None => (h.fs_total_bytes.to_string(), h.fs_avail_bytes as f64),
    };
    r.capacity.insert("ephemeral-storage".into(), q(st_cap));
    r.allocatable.insert(
        "ephemeral-storage".into(),
        q(reduce(st_avail, reserve).to_string()),
    );
    // hugepages
    let huge = match &o.hugepages {
        Some(s) => {
            let size = if h.hugepage_size_bytes > 0 {
                h.hugepage_size_bytes
            } else {
                2 << 20
            };
            Some((size, s.trim().to_string(), named("VK_NODE_HUGEPAGES", s)?))
        }
        None if h.hugepages_total > 0 && h.hugepage_size_bytes > 0 => {
            let total = h.hugepages_total.saturating_mul(h.hugepage_size_bytes);
            Some((h.hugepage_size_bytes, total.to_string(), total as f64))
        }
        None => None,
    };
    if let Some((size, cap, val)) = huge {
        let name = format!("hugepages-{}", binary_quantity(size));
        r.capacity.insert(name.clone(), q(cap));
        r.allocatable
            .insert(name, q(reduce(val, reserve).to_string()));
    }
    // pods
    let pods = named("VK_NODE_PODS", &o.pods)?;
    r.capacity.insert("pods".into(), q(fmt_num(pods)));
    r.allocatable.insert("pods".into(), q(fmt_num(pods)));
    Ok(r)
}

/// The ephemeral-storage allocatable for `avail_bytes` free on the root filesystem (less the
/// reserve); None when VK_NODE_STORAGE fixes it (available = total = the override).
pub fn storage_allocatable(o: &NodeOptions, avail_bytes: u64) -> Option<Quantity> {
    if o.storage.is_some() {
        return None;
    }
    Some(Quantity(
        reduce(avail_bytes as f64, o.reserve_percent.min(100)).to_string(),
    ))
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{get, host, opts};
    use super::*;

    #[test]
    fn quantities() {
        assert_eq!(parse_quantity("3100m").unwrap(), 3.1);
        assert_eq!(parse_quantity("64Gi").unwrap(), 68719476736.0);
        assert_eq!(parse_quantity("1e3").unwrap(), 1000.0);
        assert_eq!(parse_quantity("2k").unwrap(), 2000.0);
        assert!(parse_quantity("12 cores").is_err());
        assert!(parse_quantity("").is_err());
        assert_eq!(binary_quantity(2 << 20), "2Mi");
        assert_eq!(binary_quantity(1 << 30), "1Gi");
        assert_eq!(binary_quantity(1000), "1000");
    }

    #[test]
    fn capacity_and_allocatable_from_host() {
        let r = compute_resources(&opts(), &host()).unwrap();
        assert_eq!(get(&r.capacity, "cpu"), "16");
        assert_eq!(get(&r.allocatable, "cpu"), "12");
        assert_eq!(get(&r.capacity, "memory"), (64u64 << 30).to_string());
        assert_eq!(
            get(&r.allocatable, "memory"),
            ((64u64 << 30) * 80 / 100).to_string()
        );
        assert_eq!(get(&r.capacity, "ephemeral-storage"), "1000");
        assert_eq!(get(&r.allocatable, "ephemeral-storage"), "400");
        assert_eq!(
            get(&r.capacity, "hugepages-2Mi"),
            (512u64 << 21).to_string()
        );
        assert_eq!(
            get(&r.allocatable, "hugepages-2Mi"),
            ((512u64 << 21) * 8 / 10).to_string()
        );
        assert_eq!(get(&r.capacity, "pods"), "256");
        assert_eq!(get(&r.allocatable, "pods"), "256");
    }

    #[test]
    fn overrides_win_and_round_down() {
        let mut o = opts();
        o.cpu = Some("3100m".into());
        o.mem = Some("10Gi".into());
        o.storage = Some("100".into());
        o.hugepages = Some("1Gi".into());
        o.reserve_percent = 20;
        let mut h = host();
        h.hugepages_total = 0;
        h.hugepage_size_bytes = 0;
        let r = compute_resources(&o, &h).unwrap();
        assert_eq!(get(&r.capacity, "cpu"), "3100m");
        assert_eq!(get(&r.allocatable, "cpu"), "2");
        assert_eq!(get(&r.capacity, "memory"), "10Gi");
        assert_eq!(
            get(&r.allocatable, "memory"),
            (8u64 * 1024 * 1024 * 1024).to_string()
        );
        assert_eq!(get(&r.allocatable, "ephemeral-storage"), "80");
        assert_eq!(get(&r.capacity, "hugepages-2Mi"), "1Gi");
        o.mem = Some("lots".into());
        assert!(compute_resources(&o, &h)
            .unwrap_err()
            .to_string()
            .contains("VK_NODE_MEM"));
        // No hugepages on the host and no override: no hugepages resource.
        o.mem = None;
        o.hugepages = None;
        let r = compute_resources(&o, &h).unwrap();
        assert!(!r.capacity.keys().any(|k| k.starts_with("hugepages-")));
    }

    #[test]
    fn host_facts_are_read() {
        let h = HostFacts::read(Path::new("/")).unwrap();
        assert!(h.cpus >= 1 && h.mem_total_bytes > 0 && h.fs_total_bytes > 0);
    }
}
