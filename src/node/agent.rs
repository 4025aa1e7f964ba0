//! The node agent: registration, lease renewals and status refreshes on a pure schedule.
//! `tick` performs the due blocking calls; failures back off and never stop the schedule.

use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::{
    api_time, build_lease, build_node, node_patch, renew_lease, status_patch, storage_allocatable,
    NodeOptions, Resources, LEASE_NAMESPACE, LEASE_RENEW, STATUS_INTERVAL, STORAGE_REFRESH,
};
use crate::backoff::{salt, Backoff, Jitter};
use crate::kube::{Client, KubeError};
use crate::metrics::stats::{cow_allocated_bytes, StatsHub};

/// What `tick` did, for logs, metrics and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeAgentStats {
    pub registrations: u64,
    pub lease_renewals: u64,
    pub status_updates: u64,
    pub failures: u64,
}

/// Node registration, Lease heartbeat and status refresh. `tick` performs the due blocking calls
/// (each bounded by the client's timeout); failures back off and never stop the schedule.
pub struct NodeAgent {
    opts: NodeOptions,
    resources: Resources,
    node_uid: Option<String>,
    lease: Option<Lease>,
    next_register: Instant,
    next_lease: Instant,
    next_status: Instant,
    next_storage: Instant,
    /// lastTransitionTime of the fixed conditions: when this agent started.
    since: Time,
    register_backoff: Backoff,
    lease_backoff: Backoff,
    status_backoff: Backoff,
    /// Reports wall-clock steps (the agent reads both clocks on every tick).
    clock_steps: crate::wall_clock::StepWatch,
    /// The tracked VMs whose COW disks count as storage the node still offers (see
    /// `refresh_storage`); None counts free bytes only.
    cow_of: Option<StatsHub>,
    pub stats: NodeAgentStats,
}

impl NodeAgent {
    pub fn new(opts: NodeOptions, resources: Resources, now: Instant) -> NodeAgent {
        let jitter = Jitter::new(salt(&opts.name));
        NodeAgent {
            opts,
            resources,
            node_uid: None,
            lease: None,
            next_register: now,
            next_lease: now,
            next_status: now + STATUS_INTERVAL,
            next_storage: now + STORAGE_REFRESH,
            since: api_time(crate::wall_clock::now()),
            register_backoff: Backoff::new(Duration::from_secs(1), Duration::from_secs(30)),
            // Jittered: after an API server outage the fleet's renewals come back spread out.
            lease_backoff: Backoff::new(Duration::from_millis(200), Duration::from_secs(7))
                .with_jitter(jitter),
            status_backoff: Backoff::new(Duration::from_secs(1), Duration::from_secs(30)),
            clock_steps: crate::wall_clock::StepWatch::default(),
            cow_of: None,
            stats: NodeAgentStats::default(),
        }
    }

    pub fn options(&self) -> &NodeOptions {
        &self.opts
    }

    /// Counts the COW disks of `hub`'s tracked VMs into the storage allocatable from now on.
    pub fn count_cow_of(&mut self, hub: StatsHub) {
        self.cow_of = Some(hub);
    }

    /// Allocated bytes of the tracked VMs' COW disks (stat calls only; on the node thread).
    fn tracked_cow_bytes(&self) -> u64 {
        self.cow_of.as_ref().map_or(0, |hub| {
            hub.vms()
                .iter()
                .map(|vm| cow_allocated_bytes(hub.paths(), vm))
                .fold(0u64, u64::saturating_add)
        })
    }

    pub fn resources(&self) -> &Resources {
        &self.resources
    }

    /// The server node's UID once registered.
    pub fn node_uid(&self) -> Option<&str> {
        self.node_uid.as_deref()
    }

    pub fn registered(&self) -> bool {
        self.node_uid.is_some()
    }

    /// Replace capacity/allocatable (e.g. storage recomputed) and push status at the next tick.
    pub fn set_resources(&mut self, r: Resources, now: Instant) {
        if r != self.resources {
            self.resources = r;
            self.next_status = self.next_status.min(now);
        }
    }

    /// Ask for a status write at the next tick.
    pub fn push_status(&mut self, now: Instant) {
        self.next_status = self.next_status.min(now);
    }

    /// When `tick` must next run.
    pub fn next_due(&self) -> Instant {
        if self.node_uid.is_none() {
            self.next_register
        } else {
            self.next_lease.min(self.next_status).min(self.next_storage)
        }
    }

    /// Recomputes the storage allocatable from the root filesystem's free space plus what the
    /// tracked VMs' COW disks already hold (a guest writing into its own disk takes nothing from
    /// what the scheduler may still place); a change is pushed with the next status write, at
    /// once. CPU, memory, hugepages and pods stay fixed.
    pub fn refresh_storage(&mut self, avail_bytes: u64, now: Instant) {
        let offered = avail_bytes.saturating_add(self.tracked_cow_bytes());
        let Some(q) = storage_allocatable(&self.opts, offered) else {
            return;
        };
        if self.resources.allocatable.get("ephemeral-storage") != Some(&q) {
            let mut r = self.resources.clone();
            r.allocatable.insert("ephemeral-storage".into(), q);
            self.set_resources(r, now);
        }
    }

    /// Do whatever is due at `now`: register, renew the lease, refresh status.
    pub fn tick(&mut self, client: &Client, now: Instant) {
        let wall = crate::wall_clock::now();
        if let Some(step) = self.clock_steps.look(now, wall) {
            log::warn!(
                "node {}: the wall clock stepped by {step:+} s; Lease, status and Event times \
                 follow it, renewals, timeouts and cooldowns keep their monotonic schedule",
                self.opts.name
            );
        }
        if self.node_uid.is_none() {
            if now < self.next_register {
                return;
            }
            match self.register(client, wall) {
                Ok(uid) => {
                    log::info!("node {} registered (uid {uid})", self.opts.name);
                    self.node_uid = Some(uid);
                    self.stats.registrations += 1;
                    self.register_backoff.reset();
                    self.next_lease = now;
                    self.next_status = now + STATUS_INTERVAL;
                }
                Err(e) => {
                    self.stats.failures += 1;
                    let d = self.register_backoff.fail();
                    log::warn!(
                        "node {}: registration failed: {e}; retrying in {d:?}",
                        self.opts.name
                    );
                    self.next_register = now + d;
                    return;
                }
            }
        }
        if now >= self.next_lease {
            match self.renew(client, wall) {
                Ok(()) => {
                    self.stats.lease_renewals += 1;
                    self.lease_backoff.reset();
                    self.next_lease = now + LEASE_RENEW;
                }
                Err(e) => {
                    self.stats.failures += 1;
                    let d = self.lease_backoff.fail();
                    log::warn!(
                        "node {}: lease renewal failed: {e}; retrying in {d:?}",
                        self.opts.name
                    );
                    self.next_lease = now + d;
                }
            }
        }
        if now >= self.next_storage {
            self.next_storage = now + STORAGE_REFRESH;
            match rustix::fs::statvfs(&self.opts.root_dir) {
                Ok(fs) => self.refresh_storage(fs.f_bavail.saturating_mul(fs.f_bsize), now),
                Err(e) => log::warn!(
                    "node {}: statfs {}: {e}; storage allocatable kept",
                    self.opts.name,
                    self.opts.root_dir.display()
                ),
            }
        }
        if now >= self.next_status && self.node_uid.is_some() {
            let patch = status_patch(&self.opts, &self.resources, &api_time(wall), &self.since);
            match client.patch_node_status(&self.opts.name, &patch) {
                Ok(_) => {
                    self.stats.status_updates += 1;
                    self.status_backoff.reset();
                    self.next_status = now + STATUS_INTERVAL;
                }
                Err(e) => {
                    self.stats.failures += 1;
                    let d = self.status_backoff.fail();
                    log::warn!(
                        "node {}: status update failed: {e}; retrying in {d:?}",
                        self.opts.name
                    );
                    self.next_status = now + d;
                    if e.is_not_found() {
                        // Deleted under us: register again (create) rather than log forever.
                        self.node_uid = None;
                        self.lease = None;
                        self.next_register = now;
                    }
                }
            }
        }
    }

    /// Create a missing node, or bring an existing one up to date: labels and taint by a merge
    /// patch of those keys only (never a whole-object write, which would drop what others
    /// added meanwhile or fields newer than this build), then status.
    fn register(&mut self, client: &Client, wall: SystemTime) -> Result<String, KubeError> {
        let now = api_time(wall);
        for _ in 0..5 {
            match client.get_node(&self.opts.name) {
                Err(e) if e.is_not_found() => {
                    let node = build_node(&self.opts, &self.resources, &now);
                    match client.create_node(&node) {
                        Ok(n) => return uid_of(&n),
                        Err(e) if e.is_already_exists() => continue,
                        Err(e) => return Err(e),
                    }
                }
                Err(e) => return Err(e),
                Ok(mut existing) => {
                    if let Some(patch) = node_patch(&existing, &self.opts) {
                        match client.patch_node(&self.opts.name, &patch) {
                            Ok(n) => existing = n,
                            Err(e) if e.is_conflict() => continue,
                            Err(e) => return Err(e),
                        }
                    }
                    let n = client.patch_node_status(
                        &self.opts.name,
                        &status_patch(&self.opts, &self.resources, &now, &self.since),
                    )?;
                    return uid_of(&n).or_else(|_| uid_of(&existing));
                }
            }
        }
        Err(KubeError::Transport(
            "node registration kept conflicting".into(),
        ))
    }

    /// One lease renewal: optimistic PUT of the cached lease, else GET / create, then PUT.
    fn renew(&mut self, client: &Client, wall: SystemTime) -> Result<(), KubeError> {
        let uid = self.node_uid.clone().unwrap_or_default();
        let name = self.opts.name.clone();
        if let Some(cached) = self.lease.take() {
            match client.update_lease(&renew_lease(cached.clone(), &name, &uid, wall)) {
                Ok(l) => {
                    self.lease = Some(l);
                    return Ok(());
                }
                // Nothing came back: keep the cached lease, so that a server back with its data
                // takes the one PUT again, and do not GET from a server that is not there.
                Err(KubeError::Transport(e)) => {
                    self.lease = Some(cached);
                    return Err(KubeError::Transport(e));
                }
                Err(_) => {}
            }
        }
        for _ in 0..5 {
            match client.get_lease(LEASE_NAMESPACE, &name) {
                Err(e) if e.is_not_found() => {
                    match client.create_lease(&build_lease(&name, &uid, wall)) {
                        Ok(l) => {
                            self.lease = Some(l);
                            return Ok(());
                        }
                        Err(e) if e.is_already_exists() => continue,
                        Err(e) => return Err(e),
                    }
                }
                Err(e) => return Err(e),
                Ok(l) => match client.update_lease(&renew_lease(l, &name, &uid, wall)) {
                    Ok(l) => {
                        self.lease = Some(l);
                        return Ok(());
                    }
                    Err(e) if e.is_conflict() => continue,
                    Err(e) => return Err(e),
                },
            }
        }
        Err(KubeError::Transport("lease update kept conflicting".into()))
    }
}

fn uid_of(n: &Node) -> Result<String, KubeError> {
    n.metadata
        .uid
        .clone()
        .filter(|u| !u.is_empty())
        .ok_or_else(|| KubeError::Decode("node has no metadata.uid".into()))
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    use super::super::compute_resources;
    use super::super::fixtures::{host, opts};
    use super::super::resources::reduce;
    use super::*;

    #[test]
    fn storage_allocatable_adds_back_what_the_tracked_vms_cow_disks_hold() {
        use crate::metrics::stats::{StatsPaths, TrackedVm};
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let disk = |backend: &str, id: &str, file: &str, bytes: usize| {
            let d = run.join(backend).join(id);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join(file), vec![7u8; bytes]).unwrap();
            let f = std::fs::File::open(d.join(file)).unwrap();
            f.sync_all().unwrap();
            f.metadata().unwrap().blocks() * 512
        };
        let ch = disk("cloudhypervisor", "CH1", "overlay.qcow2", 3 << 20);
        let fc = disk("firecracker", "FC1", "cow.raw", 1 << 20);
        // Not tracked: another VM's disk and a macOS guest's (its disk is not a COW overlay).
        disk("cloudhypervisor", "OTHER", "cow.raw", 2 << 20);
        disk("cloudhypervisor", "MAC1", "cow.raw", 2 << 20);
        let vm = |id: &str, backend: &str| TrackedVm {
            vm_id: id.into(),
            vm_name: format!("vk-ns-{id}"),
            namespace: "ns".into(),
            pod: id.into(),
            pod_uid: "u".into(),
            pid: 1,
            tap: None,
            backend: backend.into(),
            disk: None,
        };
        let hub = StatsHub::new(StatsPaths {
            proc_root: dir.path().join("proc"),
            cgroup_root: dir.path().join("cg"),
            cgroup_parent: "cocoon.slice".into(),
            cocoon_root: dir.path().to_path_buf(),
        });
        hub.set_vms(vec![
            vm("CH1", "cloud-hypervisor"),
            vm("FC1", "firecracker"),
            vm("MAC1", "qemu"),
        ]);
        assert!(ch >= 3 << 20 && fc >= 1 << 20, "the disks hold blocks");
        let now = Instant::now();
        let free = 10u64 << 30;
        let reduced = |bytes: u64| Quantity(reduce(bytes as f64, 20).to_string());

        let mut agent = NodeAgent::new(opts(), compute_resources(&opts(), &host()).unwrap(), now);
        agent.refresh_storage(free, now);
        assert_eq!(
            agent.resources().allocatable.get("ephemeral-storage"),
            Some(&reduced(free)),
            "free bytes only until VMs are counted"
        );
        agent.count_cow_of(hub);
        agent.refresh_storage(free, now);
        assert_eq!(
            agent.resources().allocatable.get("ephemeral-storage"),
            Some(&reduced(free + ch + fc))
        );
    }
}
