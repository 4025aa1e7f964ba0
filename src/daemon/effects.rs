//! Performing the provider's effects: one dispatch over small functions per effect family.
//! Cocoon calls are in `cocoon_calls.rs`, registry transfers in `transfers.rs`, pod writes in
//! the kube lane (`kube_jobs.rs`); here are host lookups, Events, probes, jobs off the loop
//! (lease releases, staged dirs, source checks, SAC passes, the ledger) and metrics.
//!
//! Each effect that owes an answer queues it (now or when its child / job ends) as the next
//! provider input with the same op id; the daemon never retries: the core decides.

use std::path::Path;
use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::lane::PodWrite;
use super::{Daemon, Work};
use crate::kube::events::EventType;
use crate::metrics::Metrics;
use crate::probes::ProbeTarget;
use crate::provider::owners::OwnerChange;
use crate::provider::{Effect, Input, MetricUpdate, OpId, PodKey, SourceCheck, SourceVerdict};

impl Daemon {
    /// Performs one effect: the dispatch by family.
    pub(super) fn perform(&mut self, effect: Effect) {
        match effect {
            // Cocoon calls and host lookups.
            Effect::Cocoon { op, cmd } => self.queue_cocoon_call(op, cmd),
            Effect::CheckPid { op, pid } => {
                let alive = crate::vm::process_alive(pid);
                self.pending.push_back(Input::PidChecked { op, alive });
            }
            Effect::ReadVmPid {
                op,
                vm_id,
                firecracker,
            } => self.read_vm_pid(op, &vm_id, firecracker),
            Effect::LookupLease { op, mac } => self.lookup_lease(op, &mac),
            // Kubernetes writes and Events.
            Effect::PatchPodStatus { .. }
            | Effect::PatchPodAnnotations { .. }
            | Effect::DeletePod { .. } => {
                // Answered with `KubeDone` when the kube lane has written it (kube_jobs.rs).
                if let Some(write) = PodWrite::from_effect(&effect, Instant::now()) {
                    self.queue_pod_write(write);
                }
            }
            Effect::Event {
                key,
                uid,
                type_,
                reason,
                message,
            } => self.record_event(&key, &uid, type_, reason, &message),
            // Probes.
            Effect::StartProbe {
                key,
                uid,
                vm_id,
                ip,
                mac,
                probe_port,
            } => self.start_probe(&key, &uid, &vm_id, &ip, &mac, probe_port),
            Effect::StopProbe { key } => {
                self.probes.forget(&mut self.reactor, &key.to_string());
            }
            // Jobs off the loop.
            Effect::ReleaseLeases { macs } => self.release_leases(macs),
            Effect::RemoveStagedDir { dir } => self.remove_staged_dir(dir),
            Effect::CheckSource { op, check } => self.check_source(op, check),
            Effect::SacPass { op, vm_id, plan } => self.sac_pass(op, &vm_id, plan),
            Effect::RecordOwners { op, changes } => self.record_owners(op, changes),
            // Registry transfers (transfers.rs).
            Effect::PullSnapshot {
                op,
                repo,
                tag,
                local_name,
            } => self.pull_snapshot(op, repo, tag, local_name),
            Effect::PushSnapshot {
                op,
                local_name,
                repo,
                tag,
                base_image,
                owner,
            } => self.push_snapshot(op, local_name, repo, tag, base_image, owner),
            Effect::MaterialiseImage { op, image, force } => self.materialise(op, image, force),
            Effect::CheckHibernateEvidence { op, vm_name } => {
                self.read_tag(op, vm_name, "hibernate".into())
            }
            Effect::ReadSnapshotTag { op, repo, tag } => self.read_tag(op, repo, tag),
            Effect::DeleteSnapshotTag { op, repo, tag } => self.delete_snapshot_tag(op, repo, tag),
            Effect::PeerRestore {
                op,
                namespace,
                vm_name,
                from_node,
                local_name,
            } => self.peer_restore(op, namespace, vm_name, from_node, local_name),
            Effect::Metric(update) => apply_metric(&self.metrics, update),
        }
    }

    /// The PID file of a VM's hypervisor.
    fn read_vm_pid(&mut self, op: OpId, vm_id: &str, firecracker: bool) {
        let pid = crate::vm::read_pid_file(&self.config.cocoon_root_dir, vm_id, firecracker);
        // Ahead of the backlog: the hypervisor watch is armed once the core has the
        // PID, in this very turn, not after a burst's queued inputs.
        self.urgent_inputs.push_back(Input::VmPidRead { op, pid });
    }

    /// The DHCP lease of a MAC in the lease file.
    fn lookup_lease(&mut self, op: OpId, mac: &str) {
        let result = match self.leases.lookup(mac, crate::wall_clock::now()) {
            Ok(lease) => Ok(lease.map(|l| l.ip.to_string())),
            Err(e) => {
                if self.leases.should_log(&e) {
                    log::warn!("lease file: {e}");
                }
                Err(e)
            }
        };
        self.pending.push_back(Input::LeaseLooked { op, result });
    }

    /// A Kubernetes Event about a pod, logged and queued for the kube lane.
    fn record_event(
        &mut self,
        key: &PodKey,
        uid: &str,
        type_: EventType,
        reason: &'static str,
        message: &str,
    ) {
        let pod = pod_ref(key, uid);
        log::info!("event {} {key}: {reason}: {message}", type_.as_str());
        let now = self.reactor.now();
        self.events
            .record(&pod, type_, reason, message, now, crate::wall_clock::now());
    }

    /// Starts probing a pod's VM; the engine's first results go to the provider at once.
    fn start_probe(
        &mut self,
        key: &PodKey,
        uid: &str,
        vm_id: &str,
        ip: &str,
        mac: &str,
        probe_port: Option<u16>,
    ) {
        let mut target = ProbeTarget::from_parts(&key.namespace, uid, vm_id, ip, mac, probe_port);
        target.static_ip = self
            .provider
            .pod_vm(key)
            .and_then(|vm| vm.nics.first())
            .is_some_and(|nic| !nic.static_ip.is_empty());
        target.ssh_banner = self.provider.probe_wants_ssh_banner(key);
        let now = self.reactor.now();
        let out = self.probes.start(
            &mut self.reactor,
            &key.to_string(),
            Some(target),
            now,
            crate::wall_clock::now(),
        );
        self.probe_events(out);
    }

    /// Releases a removed VM's DHCP leases on the pool (cocoon-net's lease expiry is the
    /// fallback when it is off or full).
    fn release_leases(&mut self, macs: Vec<String>) {
        if !self.releaser.enabled() || macs.is_empty() {
            return;
        }
        let releaser = self.releaser.clone();
        let job = move || {
            let mut failed = Vec::new();
            let mut released = 0;
            for (mac, r) in releaser.release_all(&macs) {
                match r {
                    Ok(()) => released += 1,
                    Err(e) => failed.push(format!("{mac}: {e}")),
                }
            }
            Work::LeasesReleased { released, failed }
        };
        if self.reactor.submit(job).is_err() {
            log::warn!("lease release skipped: worker queue full");
        }
    }

    /// Removes a staged peer-restore directory.
    fn remove_staged_dir(&mut self, dir: String) {
        let root = self.config.staging_dir.clone();
        // Off the loop: unlinking a multi-GiB memory file can take a while.
        let spawned = std::thread::Builder::new()
            .name("vk-unstage".into())
            .spawn(move || crate::peer::staging::remove_entry(&root, Path::new(&dir)));
        if let Err(e) = spawned {
            log::warn!("staged dir left for the sweep: no thread: {e}");
        }
    }

    /// The host's check of a source a pod names, on the pool.
    fn check_source(&mut self, op: OpId, check: SourceCheck) {
        let job = move || Work::SourceChecked {
            op,
            verdict: super::source_checks::run(&check),
        };
        if self.reactor.submit(job).is_err() {
            let verdict = SourceVerdict::Unavailable("worker queue full".into());
            self.pending.push_back(Input::SourceChecked { op, verdict });
        }
    }

    /// Ownership changes for the ledger.
    fn record_owners(&mut self, op: OpId, changes: Vec<OwnerChange>) {
        // Off the loop: the ledger's own thread writes and answers.
        if !self.ledger.send(op, changes) {
            let result = Err("the ownership ledger writer has stopped".to_string());
            self.pending.push_back(Input::OwnersRecorded { op, result });
        }
    }

    /// The SAC pass on a thread of its own: it waits minutes at worst (dial, prompt and
    /// verification retries) and must not hold a pool worker that transfers need.
    fn sac_pass(&mut self, op: OpId, vm_id: &str, plan: crate::guest::sac::SacPlan) {
        let socket = self
            .config
            .cocoon_root_dir
            .join("run/cloudhypervisor")
            .join(vm_id)
            .join("console.sock");
        let notifier = self.reactor.notifier();
        let spawned = std::thread::Builder::new()
            .name("vk-sac".into())
            .spawn(move || {
                let result = crate::guest::dialer::run(&socket, plan);
                notifier.post(Work::Sac { op, result });
            });
        if let Err(e) = spawned {
            let result = Err(crate::guest::sac::SacError {
                reason: crate::guest::sac::DIAL_FAILED,
                message: format!("start the SAC dialer: {e}"),
            });
            self.pending.push_back(Input::SacDone { op, result });
        }
    }
}

/// The involved object of an Event: just enough of the pod.
fn pod_ref(key: &PodKey, uid: &str) -> Pod {
    Pod {
        metadata: ObjectMeta {
            namespace: Some(key.namespace.clone()),
            name: Some(key.name.clone()),
            uid: Some(uid.to_string()),
            ..ObjectMeta::default()
        },
        ..Pod::default()
    }
}

pub(super) fn apply_metric(m: &Metrics, update: MetricUpdate) {
    match update {
        MetricUpdate::PodLifecycle { op, result, reason } => m
            .pod_lifecycle_total
            .with_label_values(&[op, result, reason])
            .inc(),
        MetricUpdate::VmBootDuration {
            namespace,
            mode,
            backend,
            seconds,
        } => m
            .vm_boot_duration_seconds
            .with_label_values(&[&namespace, &mode, &backend])
            .observe(seconds),
        MetricUpdate::OrphanVm => m.orphan_vm_total.inc(),
        MetricUpdate::VmInspectTransientFail => m.vm_inspect_transient_fail_total.inc(),
        MetricUpdate::PodEvictFailure => m.pod_evict_failure_total.inc(),
        MetricUpdate::ReconcileAdoptByName => m.reconcile_adopt_by_name_total.inc(),
        MetricUpdate::StaleCreateReconcile { outcome } => m
            .stale_create_reconcile_total
            .with_label_values(&[&outcome])
            .inc(),
        MetricUpdate::StartupResume { op } => m.startup_resume_total.with_label_values(&[op]).inc(),
        MetricUpdate::SnapshotPull { result } => {
            m.snapshot_pull_total.with_label_values(&[result]).inc()
        }
        MetricUpdate::SnapshotSave { result } => {
            m.snapshot_save_total.with_label_values(&[result]).inc()
        }
        MetricUpdate::SnapshotPush { result } => {
            m.snapshot_push_total.with_label_values(&[result]).inc()
        }
        MetricUpdate::HibernateEvidence { verdict } => m
            .hibernate_evidence_total
            .with_label_values(&[verdict])
            .inc(),
        MetricUpdate::CloneFromDir { result } => {
            m.clone_from_dir_total.with_label_values(&[result]).inc()
        }
        MetricUpdate::SnapshotVerify { result } => {
            m.snapshot_verify_total.with_label_values(&[result]).inc()
        }
        MetricUpdate::SnapshotSaveDuration { namespace, seconds } => m
            .snapshot_save_duration_seconds
            .with_label_values(&[&namespace])
            .observe(seconds),
        MetricUpdate::Hibernate {
            namespace,
            phase,
            result,
        } => m
            .hibernate_total
            .with_label_values(&[&namespace, phase, result])
            .inc(),
        MetricUpdate::Wake { result } => m.wake_total.with_label_values(&[result]).inc(),
        MetricUpdate::WakeIpWait { namespace, result } => m
            .wake_ip_wait_total
            .with_label_values(&[&namespace, result])
            .inc(),
        MetricUpdate::PostClone { kind, result } => {
            m.postclone_total.with_label_values(&[kind, result]).inc()
        }
        MetricUpdate::PostCloneAttempts { result, attempts } => m
            .postclone_retry_attempts
            .with_label_values(&[result])
            .observe(f64::from(attempts)),
        MetricUpdate::WakeRenewNudge { result } => {
            m.wake_renew_nudge_total.with_label_values(&[result]).inc()
        }
        MetricUpdate::VmRestart { namespace, pod } => m
            .vm_restarts_total
            .with_label_values(&[&namespace, &pod])
            .inc(),
    }
}
