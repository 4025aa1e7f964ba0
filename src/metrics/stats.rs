//! The shared per-VM and node resource sample: cgroup cpu.stat, /proc/<pid>/stat,
//! COW file blocks, /proc/<pid>/net/dev, /proc/stat, /proc/meminfo, statfs. Reads files only; never forks.
//!
//! One `StatsHub` is shared by the kubelet API (/stats/summary, /metrics/resource) and the 9091
//! collectors. The daemon tells it which VMs are tracked (`set_vms`); any consumer asks for
//! `sample(now)`, which is recomputed at most once per TTL (2 s) and otherwise served from cache.

use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// How long a sample is reused before the files are read again.
pub const SAMPLE_TTL: Duration = Duration::from_secs(2);

/// Where the sample reads from. Injectable so tests can point at fixture trees.
#[derive(Clone, Debug)]
pub struct StatsPaths {
    /// Normally `/proc`.
    pub proc_root: PathBuf,
    /// Normally `/sys/fs/cgroup`.
    pub cgroup_root: PathBuf,
    /// `COCOON_CGROUP_PARENT`, default `cocoon.slice`.
    pub cgroup_parent: String,
    /// `COCOON_ROOT_DIR`, default `/var/lib/cocoon`: run dirs and the statfs target.
    pub cocoon_root: PathBuf,
}

impl Default for StatsPaths {
    fn default() -> Self {
        StatsPaths {
            proc_root: PathBuf::from("/proc"),
            cgroup_root: PathBuf::from("/sys/fs/cgroup"),
            cgroup_parent: "cocoon.slice".to_string(),
            cocoon_root: PathBuf::from("/var/lib/cocoon"),
        }
    }
}

/// One VM the daemon tracks, as plain data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrackedVm {
    pub vm_id: String,
    pub vm_name: String,
    pub namespace: String,
    pub pod: String,
    pub pod_uid: String,
    /// Hypervisor PID; 0 means "not running" and the VM is skipped.
    pub pid: u32,
    /// First NIC's tap device name, if any.
    pub tap: Option<String>,
    /// cocoon `hypervisor` value: `firecracker`, `qemu` (a macOS guest) or anything else
    /// (cloud-hypervisor).
    pub backend: String,
    /// A macOS guest's disk file: its size is the guest's disk figure.
    pub disk: Option<PathBuf>,
}

impl TrackedVm {
    /// A macOS guest (`cocoon-macos`'s QEMU, hypervisor tag `qemu`).
    pub fn is_macos(&self) -> bool {
        self.backend == crate::guest::macos::HYPERVISOR
    }

    /// The run-dir name for this backend: `firecracker` or `cloudhypervisor`.
    pub fn backend_dir(&self) -> &'static str {
        if self.backend == "firecracker" {
            "firecracker"
        } else {
            "cloudhypervisor"
        }
    }
}

/// The figures of one VM at sample time.
#[derive(Clone, Debug, PartialEq)]
pub struct VmSample {
    pub vm: TrackedVm,
    /// cgroup `usage_usec`.
    pub cpu_usage_usec: u64,
    /// cgroup `throttled_usec`.
    pub cpu_throttled_usec: u64,
    /// cgroup `nr_throttled`.
    pub cpu_throttled_periods: u64,
    /// RSS pages × page size.
    pub rss_bytes: u64,
    /// Allocated bytes of the COW disk.
    pub cow_bytes: u64,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    /// The rest of the tap's `/proc/<pid>/net/dev` row (same read as the bytes).
    pub net: NetCounters,
}

/// Packet, error and drop counters of one `/proc/<pid>/net/dev` row.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetCounters {
    pub rx_packets: u64,
    pub rx_errors: u64,
    pub rx_dropped: u64,
    pub tx_packets: u64,
    pub tx_errors: u64,
    pub tx_dropped: u64,
}

impl VmSample {
    pub fn cpu_seconds(&self) -> f64 {
        self.cpu_usage_usec as f64 / 1e6
    }
    pub fn cpu_throttled_seconds(&self) -> f64 {
        self.cpu_throttled_usec as f64 / 1e6
    }
}

/// Node-wide figures.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeSample {
    /// Sum of the `cpu ` line of /proc/stat, in USER_HZ ticks.
    pub cpu_ticks: u64,
    /// (MemTotal − MemAvailable) × 1024.
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    pub storage_total_bytes: u64,
    pub storage_available_bytes: u64,
    /// `cpuN` lines of /proc/stat: the logical CPUs the kernel accounts (cAdvisor's
    /// `machine_cpu_cores`).
    pub cpu_cores: u32,
}

impl NodeSample {
    /// CPU seconds as the spec defines them: ticks / 100.
    pub fn cpu_seconds(&self) -> f64 {
        self.cpu_ticks as f64 / 100.0
    }
}

/// One complete sample.
#[derive(Clone, Debug)]
pub struct Sample {
    /// Wall-clock time of the sample (for timestamps in the outputs).
    pub taken_at: SystemTime,
    /// Monotonic time of the sample (for the TTL).
    pub taken_mono: Instant,
    pub node: NodeSample,
    /// Tracked VMs with a non-zero PID, in the order the daemon gave them.
    pub vms: Vec<VmSample>,
    /// Files that could not be read for reasons other than "absent" (scrape-error signal).
    pub errors: u32,
}

/// Reads one sample from the files under `paths`. Missing per-VM files count as 0.
pub fn read_sample(paths: &StatsPaths, vms: &[TrackedVm], now: Instant) -> Sample {
    let mut errors = 0u32;
    let mut buf = String::with_capacity(4096);
    let page = procfs::page_size();
    let ticks_per_second = procfs::ticks_per_second().max(1);
    let mut out = Vec::with_capacity(vms.len());
    for vm in vms.iter().filter(|v| v.pid != 0) {
        let mut s = VmSample {
            vm: vm.clone(),
            cpu_usage_usec: 0,
            cpu_throttled_usec: 0,
            cpu_throttled_periods: 0,
            rss_bytes: 0,
            cow_bytes: 0,
            rx_bytes: 0,
            tx_bytes: 0,
            net: NetCounters::default(),
        };
        let cpu_stat = paths
            .cgroup_root
            .join(&paths.cgroup_parent)
            .join(format!("vm-{}.scope", vm.vm_id))
            .join("cpu.stat");
        match read_into(&cpu_stat, &mut buf) {
            Ok(true) => {
                let c = parse_cpu_stat(&buf);
                s.cpu_usage_usec = c.usage_usec;
                s.cpu_throttled_usec = c.throttled_usec;
                s.cpu_throttled_periods = c.nr_throttled;
            }
            Ok(false) => {}
            Err(_) => errors += 1,
        }
        let pid_dir = paths.proc_root.join(vm.pid.to_string());
        match read_into(&pid_dir.join("stat"), &mut buf) {
            Ok(true) => {
                s.rss_bytes = parse_stat_rss_pages(&buf).unwrap_or(0) * page;
                if vm.is_macos() {
                    // A macOS guest's QEMU runs in no cocoon cgroup: its CPU is the process's.
                    let ticks = parse_stat_cpu_ticks(&buf).unwrap_or(0);
                    s.cpu_usage_usec = ticks.saturating_mul(1_000_000) / ticks_per_second;
                }
            }
            Ok(false) => {}
            Err(_) => errors += 1,
        }
        s.cow_bytes = match (&vm.disk, vm.is_macos()) {
            (Some(disk), true) => fs::metadata(disk).map(|m| m.len()).unwrap_or(0),
            (None, true) => 0,
            _ => cow_allocated_bytes(paths, vm),
        };
        if let Some(tap) = vm.tap.as_deref().filter(|t| !t.is_empty()) {
            match read_into(&pid_dir.join("net/dev"), &mut buf) {
                Ok(true) => {
                    if let Some((rx, tx, net)) = parse_net_dev_row(&buf, tap) {
                        s.rx_bytes = rx;
                        s.tx_bytes = tx;
                        s.net = net;
                    }
                }
                Ok(false) => {}
                Err(_) => errors += 1,
            }
        }
        out.push(s);
    }
    let mut node = NodeSample::default();
    match read_into(&paths.proc_root.join("stat"), &mut buf) {
        Ok(true) => {
            node.cpu_ticks = parse_proc_stat_cpu(&buf).unwrap_or(0);
            node.cpu_cores = count_proc_stat_cpus(&buf);
        }
        _ => errors += 1,
    }
    match read_into(&paths.proc_root.join("meminfo"), &mut buf) {
        Ok(true) => {
            let (total, avail) = parse_meminfo(&buf);
            node.memory_total_bytes = total * 1024;
            node.memory_used_bytes = total.saturating_sub(avail) * 1024;
        }
        _ => errors += 1,
    }
    match rustix::fs::statvfs(&paths.cocoon_root) {
        Ok(st) => {
            node.storage_total_bytes = st.f_blocks.saturating_mul(st.f_frsize);
            node.storage_available_bytes = st.f_bavail.saturating_mul(st.f_frsize);
        }
        Err(_) => errors += 1,
    }
    Sample {
        taken_at: crate::wall_clock::now(),
        taken_mono: now,
        node,
        vms: out,
        errors,
    }
}

/// Allocated bytes of the VM's COW disk under `COCOON_ROOT_DIR`: CH `overlay.qcow2`, else
/// `cow.raw`; FC only `cow.raw`. 0 when there is none (a macOS guest's disk lives elsewhere).
pub fn cow_allocated_bytes(paths: &StatsPaths, vm: &TrackedVm) -> u64 {
    if vm.is_macos() {
        return 0;
    }
    use std::os::unix::fs::MetadataExt;
    let dir = paths
        .cocoon_root
        .join("run")
        .join(vm.backend_dir())
        .join(&vm.vm_id);
    let candidates: &[&str] = if vm.backend_dir() == "firecracker" {
        &["cow.raw"]
    } else {
        &["overlay.qcow2", "cow.raw"]
    };
    for name in candidates {
        if let Ok(md) = fs::metadata(dir.join(name)) {
            return md.blocks().saturating_mul(512);
        }
    }
    0
}

/// Reads a whole file into `buf`. Ok(false) when the file (or its process) does not exist.
fn read_into(path: &Path, buf: &mut String) -> io::Result<bool> {
    buf.clear();
    match fs::File::open(path) {
        Ok(mut f) => match f.read_to_string(buf) {
            Ok(_) => Ok(true),
            // A process that exits between open and read gives ESRCH; treat as absent.
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Ok(false),
            Err(e) => Err(e),
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Ok(false),
        Err(e) => Err(e),
    }
}

/// The three cgroup v2 cpu.stat keys the spec uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuStat {
    pub usage_usec: u64,
    pub throttled_usec: u64,
    pub nr_throttled: u64,
}

pub fn parse_cpu_stat(text: &str) -> CpuStat {
    let mut c = CpuStat::default();
    for line in text.lines() {
        let mut it = line.split_ascii_whitespace();
        let (Some(k), Some(v)) = (it.next(), it.next()) else {
            continue;
        };
        let Ok(v) = v.parse::<u64>() else { continue };
        match k {
            "usage_usec" => c.usage_usec = v,
            "throttled_usec" => c.throttled_usec = v,
            "nr_throttled" => c.nr_throttled = v,
            _ => {}
        }
    }
    c
}

/// Field 24 (rss, in pages) of /proc/<pid>/stat. The comm field (2) may contain spaces and
/// parentheses, so fields are counted after the last `)`.
pub fn parse_stat_rss_pages(text: &str) -> Option<u64> {
    let rest = &text[text.rfind(')')? + 1..];
    // After ')' the next field is field 3 (state); field 24 is the 22nd after it.
    rest.split_ascii_whitespace().nth(21)?.parse().ok()
}

/// Fields 14 and 15 (utime, stime, in ticks) of /proc/<pid>/stat.
pub fn parse_stat_cpu_ticks(text: &str) -> Option<u64> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut it = rest.split_ascii_whitespace().skip(11);
    let u: u64 = it.next()?.parse().ok()?;
    let s: u64 = it.next()?.parse().ok()?;
    Some(u + s)
}

/// rx bytes (1st field) and tx bytes (9th field) of the `<tap>:` line of /proc/<pid>/net/dev.
pub fn parse_net_dev(text: &str, tap: &str) -> Option<(u64, u64)> {
    parse_net_dev_row(text, tap).map(|(rx, tx, _)| (rx, tx))
}

/// The `<tap>:` line of /proc/<pid>/net/dev: rx bytes, tx bytes and the packet, error and drop
/// counters (fields 2-4 and 10-12). Rows cut short after the bytes give zero counters.
pub fn parse_net_dev_row(text: &str, tap: &str) -> Option<(u64, u64, NetCounters)> {
    for line in text.lines().skip(2) {
        let Some((name, rest)) = line.split_once(':') else {
            continue;
        };
        if name.trim() != tap {
            continue;
        }
        let f: Vec<&str> = rest.split_ascii_whitespace().collect();
        let rx = f.first()?.parse().ok()?;
        let tx = f.get(8)?.parse().ok()?;
        let at = |i: usize| f.get(i).and_then(|v| v.parse().ok()).unwrap_or(0);
        let net = NetCounters {
            rx_packets: at(1),
            rx_errors: at(2),
            rx_dropped: at(3),
            tx_packets: at(9),
            tx_errors: at(10),
            tx_dropped: at(11),
        };
        return Some((rx, tx, net));
    }
    None
}

/// Number of per-CPU `cpuN` lines of /proc/stat.
pub fn count_proc_stat_cpus(text: &str) -> u32 {
    let per_cpu = text.lines().filter(|l| {
        l.strip_prefix("cpu")
            .and_then(|r| r.split(' ').next())
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    });
    u32::try_from(per_cpu.count()).unwrap_or(u32::MAX)
}

/// Sum of the fields of the aggregate `cpu ` line of /proc/stat (ticks).
pub fn parse_proc_stat_cpu(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let mut sum = 0u64;
    for f in line.split_ascii_whitespace().skip(1) {
        sum = sum.saturating_add(f.parse::<u64>().ok()?);
    }
    Some(sum)
}

/// (MemTotal, MemAvailable) in KiB.
pub fn parse_meminfo(text: &str) -> (u64, u64) {
    let mut total = 0;
    let mut avail = 0;
    for line in text.lines() {
        let mut it = line.split_ascii_whitespace();
        let key = it.next();
        let val = it.next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        match key {
            Some("MemTotal:") => total = val,
            Some("MemAvailable:") => avail = val,
            _ => {}
        }
    }
    (total, avail)
}

struct HubInner {
    vms: Arc<Vec<TrackedVm>>,
    cached: Option<Arc<Sample>>,
    /// The cached sample was read for another VM list (background mode): served until the
    /// refresh it triggers lands.
    outdated: bool,
    /// A background refresh is running.
    refreshing: bool,
    /// Number of times the files were actually read (for tests and the benchmark).
    reads: u64,
}

/// The shared sample cache. Cheap to clone (an `Arc`); safe to use from the collectors.
#[derive(Clone)]
pub struct StatsHub {
    paths: Arc<StatsPaths>,
    ttl: Duration,
    inner: Arc<Mutex<HubInner>>,
    process_start: SystemTime,
    background: bool,
}

impl StatsHub {
    pub fn new(paths: StatsPaths) -> Self {
        Self::with_ttl(paths, SAMPLE_TTL)
    }

    pub fn with_ttl(paths: StatsPaths, ttl: Duration) -> Self {
        StatsHub {
            paths: Arc::new(paths),
            ttl,
            inner: Arc::new(Mutex::new(HubInner {
                vms: Arc::new(Vec::new()),
                cached: None,
                outdated: false,
                refreshing: false,
                reads: 0,
            })),
            process_start: crate::wall_clock::now(),
            background: false,
        }
    }

    /// Stale-while-refresh mode for the daemon: once a sample exists, a scrape never waits for
    /// the files; a sample older than the TTL is served while one helper thread (not a process)
    /// reads the next one. Reading 1,000 VMs' files takes tens of milliseconds, more than a
    /// scrape may cost.
    pub fn background_refresh(mut self) -> Self {
        self.background = true;
        self
    }

    pub fn paths(&self) -> &StatsPaths {
        &self.paths
    }

    /// When the daemon process started (the node `startTime` of the summary).
    pub fn process_start(&self) -> SystemTime {
        self.process_start
    }

    /// Replaces the tracked VM list. The next sample after the TTL reflects it; a change of
    /// the list also drops the cached sample so a removed VM is not reported again.
    ///
    /// In background mode the cached sample stays, without the VMs no longer tracked, and the
    /// next sample refreshes it on the helper thread: the caller (the loop thread, many times
    /// a second during a burst) never waits for the files of every VM.
    pub fn set_vms(&self, vms: Vec<TrackedVm>) {
        let mut g = lock(&self.inner);
        if *g.vms == vms {
            return;
        }
        if !self.background {
            g.vms = Arc::new(vms);
            g.cached = None;
            return;
        }
        if let Some(old) = g.cached.take() {
            let ids: std::collections::HashSet<&str> =
                vms.iter().map(|v| v.vm_id.as_str()).collect();
            g.cached = Some(
                if old.vms.iter().all(|s| ids.contains(s.vm.vm_id.as_str())) {
                    old
                } else {
                    let mut kept = (*old).clone();
                    kept.vms.retain(|s| ids.contains(s.vm.vm_id.as_str()));
                    Arc::new(kept)
                },
            );
        }
        g.vms = Arc::new(vms);
        g.outdated = true;
    }

    pub fn vms(&self) -> Arc<Vec<TrackedVm>> {
        lock(&self.inner).vms.clone()
    }

    /// The current sample, read from the files only if the cached one is older than the TTL.
    pub fn sample(&self, now: Instant) -> Arc<Sample> {
        let vms = {
            let mut g = lock(&self.inner);
            if let Some(s) = &g.cached {
                if now.saturating_duration_since(s.taken_mono) < self.ttl && !g.outdated {
                    return s.clone();
                }
                if self.background {
                    let stale = s.clone();
                    if !g.refreshing {
                        g.refreshing = true;
                        let hub = self.clone();
                        let vms = g.vms.clone();
                        let spawned = std::thread::Builder::new()
                            .name("stats-refresh".into())
                            .spawn(move || {
                                let fresh = Arc::new(read_sample(&hub.paths, &vms, Instant::now()));
                                let mut g = lock(&hub.inner);
                                g.reads += 1;
                                g.refreshing = false;
                                if Arc::ptr_eq(&g.vms, &vms) {
                                    g.cached = Some(fresh);
                                    g.outdated = false;
                                } else if g.outdated {
                                    // The list moved on while reading (a burst): keep what
                                    // was read for the VMs still tracked; the next sample
                                    // refreshes again.
                                    let current = g.vms.clone();
                                    let ids: std::collections::HashSet<&str> =
                                        current.iter().map(|v| v.vm_id.as_str()).collect();
                                    let mut kept = (*fresh).clone();
                                    kept.vms.retain(|s| ids.contains(s.vm.vm_id.as_str()));
                                    g.cached = Some(Arc::new(kept));
                                }
                            });
                        if spawned.is_err() {
                            g.refreshing = false;
                        }
                    }
                    return stale;
                }
            }
            g.vms.clone()
        };
        // Read outside the lock so a 9091 scrape on another thread never waits on file I/O of
        // a concurrent refresh longer than one refresh.
        let fresh = Arc::new(read_sample(&self.paths, &vms, now));
        let mut g = lock(&self.inner);
        g.reads += 1;
        if Arc::ptr_eq(&g.vms, &vms) {
            g.cached = Some(fresh.clone());
            g.outdated = false;
        }
        fresh
    }

    /// How many times the files were read (each read is one refresh of the whole sample).
    pub fn refresh_count(&self) -> u64 {
        lock(&self.inner).reads
    }
}

fn lock(m: &Mutex<HubInner>) -> std::sync::MutexGuard<'_, HubInner> {
    // A panic while holding this lock cannot leave the plain data inconsistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_rss_counts_after_comm_with_spaces() {
        let text = "1234 (a b) c) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 777 22 23\n";
        // Fields after ')' : S(3) 1(4) ... field 24 is the 22nd token after ')'.
        assert_eq!(parse_stat_rss_pages(text), Some(777));
        assert_eq!(parse_stat_rss_pages("garbage"), None);
        assert_eq!(parse_stat_rss_pages("1 (x) S 1"), None);
    }

    #[test]
    fn cpu_stat_keys() {
        let c = parse_cpu_stat("usage_usec 1500000\nuser_usec 1\nnr_periods 9\nnr_throttled 4\nthrottled_usec 250000\nbogus\nx y\n");
        assert_eq!(
            c,
            CpuStat {
                usage_usec: 1_500_000,
                throttled_usec: 250_000,
                nr_throttled: 4
            }
        );
    }

    #[test]
    fn net_dev_picks_tap_row() {
        let t = "Inter-|   Receive                                                |  Transmit\n face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n    lo: 100 1 0 0 0 0 0 0 200 2 0 0 0 0 0 0\ntap0: 11 1 0 0 0 0 0 0 99 2 0 0 0 0 0 0\n";
        assert_eq!(parse_net_dev(t, "tap0"), Some((11, 99)));
        assert_eq!(parse_net_dev(t, "lo"), Some((100, 200)));
        assert_eq!(parse_net_dev(t, "tap1"), None);
        assert_eq!(parse_net_dev("a\nb\ntap0: x y\n", "tap0"), None);
        let (_, _, net) = parse_net_dev_row(t, "tap0").unwrap();
        assert_eq!((net.rx_packets, net.tx_packets), (1, 2));
        let t2 = "h1\nh2\n eth0: 10 20 3 4 0 0 0 0 30 40 5 6 0 0 0 0\n";
        let (_, _, net) = parse_net_dev_row(t2, "eth0").unwrap();
        assert_eq!(
            net,
            NetCounters {
                rx_packets: 20,
                rx_errors: 3,
                rx_dropped: 4,
                tx_packets: 40,
                tx_errors: 5,
                tx_dropped: 6
            }
        );
    }

    #[test]
    fn proc_stat_and_meminfo() {
        assert_eq!(
            parse_proc_stat_cpu("cpu  1 2 3 4 5 6 7 8 0 0\ncpu0 1 1\n"),
            Some(36)
        );
        assert_eq!(parse_proc_stat_cpu("intr 1\n"), None);
        assert_eq!(
            count_proc_stat_cpus("cpu  1 2\ncpu0 1 1\ncpu1 1 1\ncpufreq 3\nintr 1\n"),
            2
        );
        assert_eq!(
            parse_meminfo("MemTotal: 1000 kB\nMemFree: 5 kB\nMemAvailable: 400 kB\n"),
            (1000, 400)
        );
    }

    #[test]
    fn a_macos_guest_counts_its_qemu_cpu_and_the_size_of_its_disk_file() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let paths = StatsPaths {
            proc_root: root.join("proc"),
            cgroup_root: root.join("cg"),
            cgroup_parent: "cocoon.slice".into(),
            cocoon_root: root.join("cocoon"),
        };
        fs::create_dir_all(root.join("proc/77")).unwrap();
        // utime 300 + stime 100 ticks; rss 5 pages.
        let fields: Vec<String> = (3..=30)
            .map(|i| match i {
                14 => "300".into(),
                15 => "100".into(),
                24 => "5".into(),
                _ => "0".into(),
            })
            .collect();
        fs::write(
            root.join("proc/77/stat"),
            format!("77 (qemu system) {}\n", fields.join(" ")),
        )
        .unwrap();
        let disk = root.join("mac.img");
        fs::File::create(&disk).unwrap().set_len(64 << 20).unwrap();
        let vm = TrackedVm {
            vm_id: "qemu-m".into(),
            vm_name: "m".into(),
            namespace: "ns".into(),
            pod: "p".into(),
            pod_uid: "u".into(),
            pid: 77,
            tap: None,
            backend: "qemu".into(),
            disk: Some(disk),
        };
        let s = read_sample(&paths, &[vm], Instant::now());
        let m = &s.vms[0];
        let hz = procfs::ticks_per_second() as f64;
        assert!(
            (m.cpu_seconds() - 400.0 / hz).abs() < 1e-6,
            "{}",
            m.cpu_seconds()
        );
        assert_eq!(m.rss_bytes, 5 * procfs::page_size());
        // The file's size (a sparse 64 MiB image), not its allocated blocks.
        assert_eq!(m.cow_bytes, 64 << 20);
    }

    #[test]
    fn fixture_tree_sample_and_ttl() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let paths = StatsPaths {
            proc_root: root.join("proc"),
            cgroup_root: root.join("cg"),
            cgroup_parent: "cocoon.slice".into(),
            cocoon_root: root.join("cocoon"),
        };
        fs::create_dir_all(root.join("proc/42/net")).unwrap();
        fs::write(root.join("proc/stat"), "cpu  100 0 100 0 0 0 0 0 0 0\n").unwrap();
        fs::write(
            root.join("proc/meminfo"),
            "MemTotal: 2000 kB\nMemAvailable: 500 kB\n",
        )
        .unwrap();
        let fields: Vec<String> = (3..=30)
            .map(|i| if i == 24 { "10".into() } else { "0".into() })
            .collect();
        fs::write(
            root.join("proc/42/stat"),
            format!("42 (hv) {}\n", fields.join(" ")),
        )
        .unwrap();
        fs::write(
            root.join("proc/42/net/dev"),
            "h1\nh2\ntapx: 5 0 0 0 0 0 0 0 7 0\n",
        )
        .unwrap();
        fs::create_dir_all(root.join("cg/cocoon.slice/vm-abc.scope")).unwrap();
        fs::write(
            root.join("cg/cocoon.slice/vm-abc.scope/cpu.stat"),
            "usage_usec 2000000\nnr_throttled 3\nthrottled_usec 500000\n",
        )
        .unwrap();
        fs::create_dir_all(root.join("cocoon/run/cloudhypervisor/abc")).unwrap();
        fs::write(
            root.join("cocoon/run/cloudhypervisor/abc/cow.raw"),
            vec![1u8; 8192],
        )
        .unwrap();
        let vm = |id: &str, pid: u32| TrackedVm {
            vm_id: id.into(),
            vm_name: format!("vk-{id}"),
            namespace: "ns".into(),
            pod: format!("p-{id}"),
            pod_uid: "u".into(),
            pid,
            tap: Some("tapx".into()),
            backend: "cloud-hypervisor".into(),
            disk: None,
        };
        let hub = StatsHub::new(paths);
        hub.set_vms(vec![vm("abc", 42), vm("zero", 0), vm("gone", 999_999)]);
        let t0 = Instant::now();
        let s = hub.sample(t0);
        assert_eq!(s.vms.len(), 2, "pid 0 skipped");
        let a = &s.vms[0];
        assert_eq!(a.cpu_seconds(), 2.0);
        assert_eq!(a.cpu_throttled_seconds(), 0.5);
        assert_eq!(a.cpu_throttled_periods, 3);
        assert_eq!(a.rss_bytes, 10 * procfs::page_size());
        assert!(a.cow_bytes >= 8192, "allocated blocks of cow.raw");
        assert_eq!((a.rx_bytes, a.tx_bytes), (5, 7));
        let g = &s.vms[1];
        assert_eq!(
            (g.cpu_usage_usec, g.rss_bytes, g.cow_bytes, g.rx_bytes),
            (0, 0, 0, 0)
        );
        assert_eq!(s.node.cpu_seconds(), 2.0);
        assert_eq!(s.node.memory_used_bytes, 1500 * 1024);
        assert!(s.node.storage_total_bytes > 0);
        // Within the TTL the same sample comes back without touching the files.
        fs::write(
            root.join("cg/cocoon.slice/vm-abc.scope/cpu.stat"),
            "usage_usec 9000000\n",
        )
        .unwrap();
        let again = hub.sample(t0 + Duration::from_millis(1999));
        assert!(Arc::ptr_eq(&s, &again));
        assert_eq!(hub.refresh_count(), 1);
        let later = hub.sample(t0 + Duration::from_secs(2));
        assert_eq!(later.vms[0].cpu_seconds(), 9.0);
        assert_eq!(hub.refresh_count(), 2);

        // Background mode: a stale sample is served at once and replaced by a helper thread.
        let bg = StatsHub::new(hub.paths().clone()).background_refresh();
        bg.set_vms(hub.vms().to_vec());
        let first = bg.sample(t0);
        assert_eq!(
            first.vms[0].cpu_seconds(),
            9.0,
            "no sample yet: read synchronously"
        );
        fs::write(
            root.join("cg/cocoon.slice/vm-abc.scope/cpu.stat"),
            "usage_usec 4000000\n",
        )
        .unwrap();
        let stale = bg.sample(t0 + Duration::from_secs(5));
        assert!(
            Arc::ptr_eq(&first, &stale),
            "stale sample served without waiting"
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while bg.refresh_count() < 2 {
            assert!(
                Instant::now() < deadline,
                "background refresh never finished"
            );
            std::thread::yield_now();
        }
        let fresh = bg.sample(Instant::now());
        assert_eq!(fresh.vms[0].cpu_seconds(), 4.0);

        // A changed VM list (the loop sets one many times a second during a burst) never
        // makes a sample read the files on the caller: the last sample is served at once,
        // without the VMs no longer tracked, and a helper thread reads the new list.
        let reads = bg.refresh_count();
        bg.set_vms(vec![vm("gone", 999_999), vm("new", 42)]);
        let served = bg.sample(Instant::now());
        assert_eq!(bg.refresh_count(), reads, "read on the caller's thread");
        let ids: Vec<&str> = served.vms.iter().map(|v| v.vm.vm_id.as_str()).collect();
        assert_eq!(ids, ["gone"], "a removed VM reported again");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let s = bg.sample(Instant::now());
            if s.vms.iter().any(|v| v.vm.vm_id == "new") {
                break;
            }
            assert!(Instant::now() < deadline, "the new VM never sampled");
            std::thread::yield_now();
        }
    }
}
