//! Harness of the fleet bench: N real daemons (own node name, fake cocoon, state) against one
//! fake API server, and what the bench reads: request counts, Lease renewals, /proc RSS and CPU.
#![allow(dead_code)]

use crate::daemon_support::{self, World};
use crate::registry_support::Registry;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use vk_cocoon::sandbox::apiserver::{ApiServer, ApiServerHandle, ApiServerOptions, RequestCount};
use vk_cocoon::sandbox::demo_pod;

/// The nodes of one cluster.
pub struct Fleet {
    pub api: Arc<ApiServerHandle>,
    pub registry: Arc<Registry>,
    pub worlds: Vec<World>,
}

/// The name of node `i` of a fleet.
pub fn node_name(i: usize) -> String {
    format!("fleet-{i:03}")
}

/// The identity node `node` authenticates as (its client certificate's CN).
pub fn user_of(node: &str) -> String {
    format!("system:node:{node}")
}

/// The node an identity belongs to, if it is a node's.
pub fn node_of(user: &str) -> Option<&str> {
    user.strip_prefix("system:node:")
}

/// A clone pod of the seeded snapshot `base`, bound to `node`.
pub fn fleet_pod(node: &str, name: &str) -> Pod {
    let mut p = demo_pod("default", name, "clone", "base");
    if let Some(spec) = p.spec.as_mut() {
        spec.node_name = Some(node.to_string());
    }
    p
}

impl Fleet {
    /// `nodes` daemons under `parent`, started one after the other (each has bound its
    /// listeners when this returns). Each logs at info: at debug, twenty daemons' logs cost
    /// this 2-core host more CPU than the daemons themselves.
    pub fn start(nodes: usize, parent: &Path, extra_env: &[(&str, &str)]) -> Fleet {
        let api = Arc::new(ApiServer::start(ApiServerOptions::default()).expect("fake API server"));
        let registry = Arc::new(Registry::start(Some(parent), None));
        let mut worlds = Vec::with_capacity(nodes);
        for i in 0..nodes {
            let mut w = World::join(
                api.clone(),
                registry.clone(),
                parent,
                &node_name(i),
                "127.0.0.1",
            );
            w.extra_env = vec![
                ("FAKE_COCOON_NO_PROCESS".into(), "1".into()),
                ("VK_LOG_LEVEL".into(), "info".into()),
            ];
            w.extra_env.extend(
                extra_env
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string())),
            );
            w.seed_snapshot("base");
            w.start_daemon();
            worlds.push(w);
        }
        Fleet {
            api,
            registry,
            worlds,
        }
    }

    pub fn nodes(&self) -> Vec<String> {
        self.worlds.iter().map(|w| w.node.clone()).collect()
    }

    pub fn pids(&self) -> Vec<u32> {
        self.worlds
            .iter()
            .filter_map(|w| w.daemon.as_ref().map(|c| c.id()))
            .collect()
    }

    /// Pods Running with a VM id, per node name.
    pub fn running_per_node(&self) -> HashMap<String, usize> {
        let mut out = HashMap::new();
        for node in self.api.scan_objects("pods", |p| {
            let running = p["status"]["phase"] == "Running"
                && p["metadata"]["annotations"]["vm.cocoonstack.io/id"]
                    .as_str()
                    .is_some_and(|id| !id.is_empty());
            running.then(|| p["spec"]["nodeName"].as_str().unwrap_or("").to_string())
        }) {
            *out.entry(node).or_insert(0) += 1;
        }
        out
    }

    /// Waits until `want` pods run in total; panics with the laggards after `limit`.
    pub fn wait_running(&self, want: usize, limit: Duration) -> Duration {
        let t = Instant::now();
        loop {
            let per_node = self.running_per_node();
            if per_node.values().sum::<usize>() >= want {
                return t.elapsed();
            }
            if t.elapsed() > limit {
                let w = &self.worlds[0];
                panic!(
                    "{} of {want} pods Running after {limit:?}: {per_node:?}\n{}",
                    per_node.values().sum::<usize>(),
                    daemon_support::tail(&w.log(), 30)
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// Every daemon is still alive.
    pub fn assert_alive(&mut self) {
        for w in &mut self.worlds {
            let exited = w.daemon.as_mut().and_then(|c| c.try_wait().ok().flatten());
            assert!(
                exited.is_none(),
                "daemon of {} exited ({exited:?})\n{}",
                w.node,
                daemon_support::tail(&w.log(), 30)
            );
        }
    }
}

// ------------------------------------------------------------------------------------------
// Request accounting
// ------------------------------------------------------------------------------------------

/// Requests per node per minute by "verb resource", over `secs` seconds of `counts`, averaged
/// over `nodes` nodes; requests of identities that are not nodes are left out.
pub fn per_node_per_minute(
    counts: &[RequestCount],
    nodes: usize,
    secs: f64,
) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for c in counts.iter().filter(|c| node_of(&c.user).is_some()) {
        *out.entry(format!("{} {}", c.verb, c.resource))
            .or_insert(0.0) += c.count as f64;
    }
    let scale = 60.0 / secs.max(1e-9) / nodes.max(1) as f64;
    out.values_mut().for_each(|v| *v *= scale);
    out
}

/// Node requests in each second of `counts`: (total, watches, pod lists, lease calls).
pub fn per_second(counts: &[RequestCount]) -> BTreeMap<u64, [u64; 4]> {
    let mut out: BTreeMap<u64, [u64; 4]> = BTreeMap::new();
    for c in counts.iter().filter(|c| node_of(&c.user).is_some()) {
        let row = out.entry(c.second).or_default();
        row[0] += c.count;
        match (c.verb.as_str(), c.resource.as_str()) {
            ("watch", _) => row[1] += c.count,
            ("list", "pods") => row[2] += c.count,
            (_, "leases") => row[3] += c.count,
            _ => {}
        }
    }
    out
}

/// Distinct nodes that listed their pods (a relist) in each second of `counts`.
pub fn relisting_nodes_per_second(counts: &[RequestCount]) -> BTreeMap<u64, usize> {
    let mut seen: BTreeMap<u64, std::collections::BTreeSet<&str>> = BTreeMap::new();
    for c in counts
        .iter()
        .filter(|c| c.verb == "list" && c.resource == "pods")
    {
        if let Some(node) = node_of(&c.user) {
            seen.entry(c.second).or_default().insert(node);
        }
    }
    seen.into_iter().map(|(s, n)| (s, n.len())).collect()
}

// ------------------------------------------------------------------------------------------
// Lease renewals
// ------------------------------------------------------------------------------------------

/// Every node's renewals seen so far, as (seen at, renewTime µs), in order.
pub type Renewals = HashMap<String, Vec<(Instant, i64)>>;

/// Polls every node Lease's renewTime (microseconds since the epoch) every 200 ms, on a thread
/// of its own, recording each distinct renewal with when it was seen.
pub struct LeaseRecorder {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Renewals>>,
    thread: std::thread::JoinHandle<()>,
}

impl LeaseRecorder {
    pub fn start(api: Arc<ApiServerHandle>) -> LeaseRecorder {
        let stop = Arc::new(AtomicBool::new(false));
        let seen: Arc<Mutex<Renewals>> = Arc::default();
        let (flag, record) = (stop.clone(), seen.clone());
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                let now = Instant::now();
                let leases = api.scan_objects("leases", |l| {
                    let name = l["metadata"]["name"].as_str()?.to_string();
                    let lease: k8s_openapi::api::coordination::v1::Lease =
                        serde_json::from_value(l.clone()).ok()?;
                    Some((name, lease.spec?.renew_time?.0.as_microsecond()))
                });
                let mut seen = record.lock().unwrap_or_else(|e| e.into_inner());
                for (name, renewed) in leases {
                    let v = seen.entry(name).or_default();
                    if v.last().is_none_or(|(_, r)| *r != renewed) {
                        v.push((now, renewed));
                    }
                }
                drop(seen);
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        LeaseRecorder { stop, seen, thread }
    }

    /// The renewals recorded so far.
    pub fn peek(&self) -> Renewals {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Stops polling; the renewals recorded.
    pub fn stop(self) -> Renewals {
        self.stop.store(true, Ordering::Relaxed);
        let seen = self.seen;
        if let Err(panic) = self.thread.join() {
            std::panic::resume_unwind(panic);
        }
        let renewals = seen.lock().unwrap_or_else(|e| e.into_inner()).clone();
        renewals
    }
}

/// How late each renewal seen in `[from, to)` was: the gap since the node's previous renewal
/// less the 10 s renew period (0 when on time), in seconds, over all nodes.
pub fn lease_lateness(renewals: &Renewals, from: Instant, to: Instant) -> Vec<f64> {
    let period = vk_cocoon::node::LEASE_RENEW.as_secs_f64();
    let mut out = Vec::new();
    for v in renewals.values() {
        for pair in v.windows(2) {
            let (seen, renewed) = pair[1];
            if seen >= from && seen < to {
                let gap = (renewed - pair[0].1) as f64 / 1e6;
                out.push((gap - period).max(0.0));
            }
        }
    }
    out
}

/// The `p` quantile of `v` (0 when empty).
pub fn quantile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

// ------------------------------------------------------------------------------------------
// /proc
// ------------------------------------------------------------------------------------------

/// RSS (KiB, VmRSS of /proc/<pid>/status) and CPU time (utime + stime of /proc/<pid>/stat).
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcSample {
    pub rss_kib: u64,
    pub cpu: Duration,
}

/// Clock ticks per second of /proc/<pid>/stat's times (`getconf CLK_TCK`, else Linux's 100).
pub fn clock_ticks() -> u64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .filter(|t| *t > 0)
        .unwrap_or(100)
}

pub fn proc_sample(pid: u32, ticks: u64) -> ProcSample {
    let rss_kib = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command (which may hold spaces) start at state: utime and stime are the
    // 12th and 13th after it.
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<u64> = after
        .split_whitespace()
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    let used = fields.get(11).copied().unwrap_or(0) + fields.get(12).copied().unwrap_or(0);
    ProcSample {
        rss_kib,
        cpu: Duration::from_secs_f64(used as f64 / ticks.max(1) as f64),
    }
}
