//! Performing the provider's effects: cocoon children, Kubernetes calls, lease lookups,
//! probes, registry transfers on the worker pool, Events and metrics.
//!
//! Each effect that owes an answer queues it (now or when its child / job ends) as the next
//! provider input with the same op id; the daemon never retries: the core decides.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes as SarAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::{ChildRole, Daemon, Work};
use crate::kube::{Client, KubeError as ApiError};
use crate::kubelet::{AuthAnswer, AuthRequest, UserInfo};
use crate::metrics::Metrics;
use crate::probes::ProbeTarget;
use crate::provider::{
    Answer, Effect, HibernateTag, Input, KubeError, MetricUpdate, OpId, PodKey, SourceVerdict,
};
use crate::snapshots::cocoon_child::transfer_error;
use crate::snapshots::reference::split_image_ref;
use crate::snapshots::{
    manifest_info, pull_cloud_image, pull_snapshot, push_snapshot, ArtifactKind, CloudImageRequest,
    PullRequest, PushKnobs, PushRequest, RegistryClient, TransferError,
};
use crate::vm::{argv, CocoonCall, CocoonError, Deadlines, Verb};

/// A registry job waiting in the daemon's transfer queue.
pub(super) type TransferJob =
    Box<dyn FnOnce(&RegistryClient) -> Result<String, TransferError> + Send>;

/// The answer to a registry effect when OCI_REGISTRY is not set.
fn no_registry() -> TransferError {
    TransferError::Invalid("no OCI registry is configured (OCI_REGISTRY)".into())
}

/// cocoon's JSON answers are small; a `vm list` of a dense host is the largest.
const STDOUT_LIMIT: usize = 16 << 20;
const STDERR_LIMIT: usize = 64 << 10;
/// cocoon calls the provider may have running at once; the rest wait in order.
pub(super) const MAX_COCOON_CALLS: usize = 32;
/// Slots beyond `MAX_COCOON_CALLS` that only the calls of `jumps_the_queue` may take.
const PRIORITY_RESERVE: usize = 4;

/// The cocoon calls that go ahead of queued creates, take the reserved slots and have their
/// answers handled ahead of other inputs: checking (`vm inspect`), restarting (`vm start`) and
/// removing (`vm rm`) a VM. They are short, and a dead VM's pod waits on them.
pub(super) fn jumps_the_queue(verb: Verb) -> bool {
    matches!(verb, Verb::VmInspect | Verb::VmStart | Verb::VmRm)
}

impl Daemon {
    pub(super) fn perform(&mut self, effect: Effect) {
        match effect {
            Effect::Cocoon { op, cmd } => {
                let verb = cmd.verb();
                if jumps_the_queue(verb) {
                    // A liveness check (is the VM gone?), a restart or a removal must not wait
                    // behind a burst of creates: they go ahead of the queue, first-in first-out
                    // among them.
                    self.cocoon_queue
                        .insert(self.cocoon_priority_queued, (op, cmd));
                    self.cocoon_priority_queued += 1;
                    if self.cocoon_running >= MAX_COCOON_CALLS + PRIORITY_RESERVE {
                        // The bench counts the "vm inspect waits for a slot" lines.
                        log::debug!(
                            "cocoon op {op}: {} waits for a slot ({} run)",
                            verb.as_str(),
                            self.cocoon_running
                        );
                    }
                } else {
                    self.cocoon_queue.push_back((op, cmd));
                }
                self.start_cocoon_calls();
            }
            Effect::CheckPid { op, pid } => {
                let alive = crate::vm::process_alive(pid);
                self.pending.push_back(Input::PidChecked { op, alive });
            }
            Effect::ReadVmPid {
                op,
                vm_id,
                firecracker,
            } => {
                let pid =
                    crate::vm::read_pid_file(&self.config.cocoon_root_dir, &vm_id, firecracker);
                // Ahead of the backlog: the hypervisor watch is armed once the core has the
                // PID, in this very turn, not after a burst's queued inputs.
                self.urgent_inputs.push_back(Input::VmPidRead { op, pid });
            }
            Effect::LookupLease { op, mac } => {
                let result = match self.leases.lookup(&mac, crate::wall_clock::now()) {
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
            Effect::PatchPodStatus { .. }
            | Effect::PatchPodAnnotations { .. }
            | Effect::DeletePod { .. } => {
                // Answered with `KubeDone` when the kube lane has written it (kube_jobs.rs).
                if let Some(write) = super::lane::PodWrite::from_effect(&effect, Instant::now()) {
                    self.queue_pod_write(write);
                }
            }
            Effect::Event {
                key,
                uid,
                type_,
                reason,
                message,
            } => {
                let pod = pod_ref(&key, &uid);
                log::info!("event {} {key}: {reason}: {message}", type_.as_str());
                let now = self.reactor.now();
                self.events
                    .record(&pod, type_, reason, &message, now, crate::wall_clock::now());
            }
            Effect::StartProbe {
                key,
                uid,
                vm_id,
                ip,
                mac,
                probe_port,
            } => {
                let mut target =
                    ProbeTarget::from_parts(&key.namespace, &uid, &vm_id, &ip, &mac, probe_port);
                target.static_ip = self
                    .provider
                    .pod_vm(&key)
                    .and_then(|vm| vm.nics.first())
                    .is_some_and(|nic| !nic.static_ip.is_empty());
                target.ssh_banner = self.provider.probe_wants_ssh_banner(&key);
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
            Effect::StopProbe { key } => {
                self.probes.forget(&mut self.reactor, &key.to_string());
            }
            Effect::ReleaseLeases { macs } => {
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
            Effect::RemoveStagedDir { dir } => {
                let root = self.config.staging_dir.clone();
                // Off the loop: unlinking a multi-GiB memory file can take a while.
                let spawned = std::thread::Builder::new()
                    .name("vk-unstage".into())
                    .spawn(move || crate::peer::staging::remove_entry(&root, Path::new(&dir)));
                if let Err(e) = spawned {
                    log::warn!("staged dir left for the sweep: no thread: {e}");
                }
            }
            Effect::PullSnapshot {
                op,
                repo,
                tag,
                local_name,
            } => {
                let bin = self.cocoon_bin();
                let metrics = self.metrics.clone();
                let pull = PullRequest::new(&repo, &tag, &local_name, bin);
                self.transfer(op, move |registry| {
                    let started = Instant::now();
                    let r = pull_snapshot(registry, &pull).map(|_| String::new());
                    metrics
                        .snapshot_pull_duration_seconds
                        .observe(started.elapsed().as_secs_f64());
                    r
                });
            }
            Effect::PushSnapshot {
                op,
                local_name,
                repo,
                tag,
                base_image,
                owner,
            } => {
                let metrics = self.metrics.clone();
                let push = PushRequest {
                    name: repo.clone(),
                    tag,
                    cocoon_bin: self.cocoon_bin(),
                    base_image: Some(base_image).filter(|b| !b.is_empty()),
                    from_node: Some(self.config.node_name.clone()),
                    annotations: crate::snapshots::format::owner_annotations(
                        &owner.namespace,
                        &owner.pod_uid,
                    ),
                    knobs: push_knobs(&self.config),
                    temp_dir: Some(self.config.spool_dir()),
                };
                // The snapshots room pushes local snapshot `name` to repository `name`: the
                // provider names both after the VM (`local_name == repo`).
                let _ = local_name;
                // The pod the snapshot is pushed for: its namespace labels the histogram.
                let namespace = owner.namespace.clone();
                let pushed = self.peer.pushed.clone();
                self.transfer(op, move |registry| {
                    let started = Instant::now();
                    let r = push_snapshot(registry, &push);
                    metrics
                        .snapshot_push_duration_seconds
                        .with_label_values(&[&namespace])
                        .observe(started.elapsed().as_secs_f64());
                    let report = r?;
                    // What a peer must name to be served this snapshot.
                    if let Err(e) = pushed.record(
                        &push.name,
                        &push.tag,
                        &report.manifest_digest,
                        &report.snapshot_id,
                    ) {
                        log::warn!(
                            "recording the push of {}:{}: {e}; peers restore it from the registry",
                            push.name,
                            push.tag
                        );
                    }
                    Ok(String::new())
                });
            }
            Effect::MaterialiseImage { op, image, force } => {
                let bin = self.cocoon_bin();
                self.transfer(op, move |registry| {
                    materialise_image(registry, &bin, &image, force)
                });
            }
            Effect::CheckHibernateEvidence { op, vm_name } => {
                self.read_tag(op, vm_name, "hibernate".into())
            }
            Effect::ReadSnapshotTag { op, repo, tag } => self.read_tag(op, repo, tag),
            Effect::CheckSource { op, check } => {
                let job = move || Work::SourceChecked {
                    op,
                    verdict: super::source_checks::run(&check),
                };
                if self.reactor.submit(job).is_err() {
                    let verdict = SourceVerdict::Unavailable("worker queue full".into());
                    self.pending.push_back(Input::SourceChecked { op, verdict });
                }
            }
            Effect::DeleteSnapshotTag { op, repo, tag } => {
                let pushed = self.peer.pushed.clone();
                self.transfer(op, move |registry| {
                    // Forgotten first: no peer is served a snapshot whose tag is going.
                    if let Err(e) = pushed.forget_tag(&repo, &tag) {
                        log::warn!("peer push record, forgetting {repo}:{tag}: {e}");
                    }
                    let r = registry.reference(&repo, &tag)?;
                    registry.delete_manifest(&r).map(|_| String::new())
                });
            }
            Effect::SacPass { op, vm_id, plan } => self.sac_pass(op, &vm_id, plan),
            Effect::RecordOwners { op, changes } => {
                // Off the loop: the ledger's own thread writes and answers.
                if !self.ledger.send(op, changes) {
                    let result = Err("the ownership ledger writer has stopped".to_string());
                    self.pending.push_back(Input::OwnersRecorded { op, result });
                }
            }
            Effect::PeerRestore {
                op,
                namespace,
                vm_name,
                from_node,
                local_name,
            } => {
                let job = crate::peer::job::PeerJob {
                    namespace,
                    vm_name,
                    from_node,
                    local_name,
                };
                let site = crate::peer::job::PeerSite {
                    node_name: self.config.node_name.clone(),
                    node_ip: self.config.node_ip,
                    peer_port: self.config.peer_addr.port,
                    staging_root: self.config.staging_dir.clone(),
                    tls: self.peer.client_tls.clone(),
                };
                let nodes = self.peer.nodes.clone();
                let metrics = self.metrics.clone();
                self.transfer(op, move |registry| {
                    crate::peer::job::run(&job, &site, registry, &nodes, &metrics)
                        .map(|dir| dir.to_string_lossy().into_owned())
                });
            }
            Effect::Metric(update) => apply_metric(&self.metrics, update),
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

    /// One manifest GET of `repo:tag` on the pool, outside the transfer queue: a create must
    /// not wait for unrelated multi-GiB pulls to learn whether its VM was hibernated, nor
    /// whose snapshot an image is.
    fn read_tag(&mut self, op: OpId, repo: String, tag: String) {
        let Some(registry) = self.registry.clone() else {
            let result = Err(no_registry());
            self.pending
                .push_back(Input::HibernateEvidence { op, result });
            return;
        };
        let job = move || {
            let result = manifest_info(&registry, &repo, &tag).map(|found| {
                found.map(|info| HibernateTag {
                    base_image: info.base_image().unwrap_or("").to_string(),
                    snapshot_id: info.snapshot_id.clone().unwrap_or_default(),
                    from_node: info.from_node().unwrap_or("").to_string(),
                    owner_namespace: info.owner_namespace().unwrap_or("").to_string(),
                    owner_pod_uid: info.owner_pod_uid().unwrap_or("").to_string(),
                    digest: info.digest.clone(),
                })
            });
            Work::Evidence { op, result }
        };
        if self.reactor.submit(job).is_err() {
            let result = Err(TransferError::Transient("worker queue full".into()));
            self.pending
                .push_back(Input::HibernateEvidence { op, result });
        }
    }

    /// Starts queued cocoon calls while fewer than `MAX_COCOON_CALLS` run: a burst of pods must
    /// not fork a thousand CLI processes at once (a stampede on cocoon's lock). A call's
    /// deadline counts from its start, not from its queueing.
    /// VM checks, restarts and removals (they lead the queue) may also take `PRIORITY_RESERVE`
    /// slots beyond the limit: a VM-gone check never waits for a burst's clones to finish.
    pub(super) fn start_cocoon_calls(&mut self) {
        loop {
            let limit = if self.cocoon_priority_queued > 0 {
                MAX_COCOON_CALLS + PRIORITY_RESERVE
            } else {
                MAX_COCOON_CALLS
            };
            if self.cocoon_running >= limit {
                return;
            }
            let Some((op, cmd)) = self.cocoon_queue.pop_front() else {
                return;
            };
            self.cocoon_priority_queued = self.cocoon_priority_queued.saturating_sub(1);
            let bin = if cmd.is_macos() {
                self.config.cocoon_macos_bin.clone()
            } else {
                self.cocoon_bin()
            };
            let bin = bin.to_string_lossy().into_owned();
            // The last line of defence: a name that is not the contract's never reaches argv.
            if let Err(e) = argv::check(&cmd.argv()) {
                log::warn!("cocoon op {op}: not run: {e}");
                self.pending.push_back(Input::CocoonDone {
                    op,
                    result: Answer::not_started(format!(
                        "Error: vk-cocoon refused to run {bin}: {e}"
                    )),
                });
                continue;
            }
            log::debug!("cocoon op {op}: {bin} {}", cmd.argv().join(" "));
            let call = cmd.call().with_limits(STDOUT_LIMIT, STDERR_LIMIT);
            let mut spec = call.child_spec(&bin);
            if let crate::provider::CocoonCmd::Macos(m) = &cmd {
                spec.term_grace = m.term_grace();
            }
            spec.env = cmd.child_env(self.config.macos_vnc_password.as_deref());
            // The spawn itself runs on the reactor's spawner threads; a child that cannot be
            // started answers later as a `ChildExit` with its spawn error.
            match self.reactor.spawn(spec) {
                Ok(id) => {
                    let macos = match cmd {
                        crate::provider::CocoonCmd::Macos(m) => Some(m),
                        _ => None,
                    };
                    self.children.insert(id, ChildRole::Op { op, call, macos });
                    self.cocoon_running += 1;
                }
                Err(e) => self.pending.push_back(Input::CocoonDone {
                    op,
                    result: Answer::not_started(format!("Error: run {bin}: {e}")),
                }),
            }
        }
    }

    /// A provider cocoon call ended: its answer is the op's next input (ahead of the backlog
    /// for the calls of `jumps_the_queue`), and its slot goes to the next queued call.
    pub(super) fn cocoon_call_done(
        &mut self,
        op: OpId,
        call: CocoonCall,
        macos: Option<crate::guest::macos::MacosCmd>,
        exit: crate::reactor::ChildExit,
    ) {
        self.cocoon_running = self.cocoon_running.saturating_sub(1);
        let answer = crate::vm::Answer::of_exit(&call, &exit);
        let result = match &macos {
            Some(m) => m.classify(answer),
            None => answer,
        };
        let input = Input::CocoonDone { op, result };
        if jumps_the_queue(call.verb) {
            self.urgent_inputs.push_back(input);
        } else {
            self.pending.push_back(input);
        }
        self.start_cocoon_calls();
    }

    /// Queues a registry job for the worker pool; its answer comes back as `TransferDone`.
    /// The node-wide gates (v2 pulls ≤ 2, zstd/chunked pushes ≤ 1) live in the
    /// shared [`RegistryClient`] and are taken inside the job, so at most
    /// `MAX_TRANSFER_JOBS` jobs run at once and a gated job never pins the last worker.
    fn transfer(
        &mut self,
        op: OpId,
        job: impl FnOnce(&RegistryClient) -> Result<String, TransferError> + Send + 'static,
    ) {
        if self.registry.is_none() {
            self.pending.push_back(Input::TransferDone {
                op,
                result: Err(no_registry()),
            });
            return;
        }
        self.transfer_queue.push_back((op, Box::new(job)));
        self.start_transfers();
    }

    /// Submits queued transfers in order while fewer than `MAX_TRANSFER_JOBS` run.
    pub(super) fn start_transfers(&mut self) {
        while self.transfers_running < super::MAX_TRANSFER_JOBS {
            let Some(registry) = self.registry.clone() else {
                return;
            };
            let Some((op, job)) = self.transfer_queue.pop_front() else {
                return;
            };
            let submitted = self.reactor.submit(move || Work::Transfer {
                op,
                result: job(&registry),
            });
            if submitted.is_err() {
                self.pending.push_back(Input::TransferDone {
                    op,
                    result: Err(TransferError::Transient(
                        "transfer queue full; retrying later".into(),
                    )),
                });
            } else {
                self.transfers_running += 1;
            }
        }
    }
}

pub(super) fn map_kube_error(e: &ApiError) -> KubeError {
    match e {
        ApiError::NotFound(_) => KubeError::NotFound,
        ApiError::Conflict(_) => KubeError::Conflict,
        ApiError::Invalid(_) => KubeError::Invalid,
        other => KubeError::Other(other.to_string()),
    }
}

/// `{"metadata":{"uid":..,"annotations":{k: v | null}}}` for a merge of annotations.
pub(super) fn annotation_patch(
    uid: Option<String>,
    annotations: BTreeMap<String, Option<String>>,
) -> serde_json::Value {
    let map: serde_json::Map<String, serde_json::Value> = annotations
        .into_iter()
        .map(|(k, v)| {
            (
                k,
                v.map_or(serde_json::Value::Null, serde_json::Value::String),
            )
        })
        .collect();
    let mut meta = serde_json::json!({ "annotations": map });
    if let Some(uid) = uid {
        meta["uid"] = uid.into();
    }
    serde_json::json!({ "metadata": meta })
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

fn push_knobs(config: &crate::config::Config) -> PushKnobs {
    PushKnobs {
        zstd_level: config.snapshot_zstd_level,
        chunk_size: config.snapshot_chunk_size_mib << 20,
        concurrency: config.snapshot_transfer_concurrency,
        memory_budget: config.snapshot_memory_budget_mib << 20,
    }
}

/// `mode=run` image materialisation with a registry: a cloud-image artifact streams into
/// `cocoon image import` (unless already present and not forced), a snapshot artifact is
/// refused, anything else (or a registry error) falls back to `cocoon image pull`. Answers the
/// reference to boot from.
fn materialise_image(
    registry: &RegistryClient,
    cocoon: &Path,
    image: &str,
    force: bool,
) -> Result<String, TransferError> {
    let image_pull = |cocoon: &Path, image: &str, force: bool| {
        image_pull(cocoon, image, force).map_err(transfer_error)
    };
    if image.starts_with("http://") || image.starts_with("https://") {
        return image_pull(cocoon, image, force);
    }
    let (repo, tag) = split_image_ref(image);
    match manifest_info(registry, &repo, &tag) {
        Ok(Some(info)) if info.kind == ArtifactKind::CloudImage => {
            let sep = if tag.starts_with("sha256:") { '@' } else { ':' };
            let local = format!("{repo}{sep}{tag}");
            // Absent is an answer; anything else (a call killed at its deadline included)
            // fails the materialisation.
            let present = match run_short(cocoon, Verb::ImageInspect, argv::image_inspect(&local)) {
                Ok(()) => true,
                Err(e) if e.is_not_found() => false,
                Err(e) => return Err(transfer_error(e)),
            };
            if !force && present {
                return Ok(local);
            }
            let req = CloudImageRequest {
                repo,
                tag,
                local_name: local.clone(),
                cocoon_bin: cocoon.to_path_buf(),
            };
            pull_cloud_image(registry, &req).map(|_| local)
        }
        Ok(Some(info)) if info.kind.is_snapshot() => Err(TransferError::WrongArtifact(format!(
            "image {image} is a snapshot artifact; use mode=clone instead of mode=run"
        ))),
        Ok(_) => image_pull(cocoon, image, force),
        Err(e) => {
            log::info!(
                "registry lookup of {image} failed ({e}); falling back to cocoon image pull"
            );
            image_pull(cocoon, image, force)
        }
    }
}

fn image_pull(cocoon: &Path, image: &str, force: bool) -> Result<String, CocoonError> {
    run_short(cocoon, Verb::ImagePull, argv::image_pull(image, force))?;
    Ok(image.to_string())
}

/// Runs a short cocoon call (argv from the vm room's builders) on a worker thread with the vm
/// room's blocking runner, under the verb's configured deadline: killed and reaped there.
fn run_short(cocoon: &Path, verb: Verb, args: Vec<String>) -> Result<(), CocoonError> {
    let call = CocoonCall::new(verb, args, &Deadlines::configured());
    crate::vm::blocking::run_checked(cocoon, &call)
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

/// TokenReview then SubjectAccessReview for one kubelet API request (worker thread).
pub(super) fn authorize(kube: &Arc<Client>, req: &AuthRequest) -> AuthAnswer {
    let user = match (&req.user, &req.token) {
        (Some(user), _) => user.clone(),
        (None, Some(token)) => {
            let review = TokenReview {
                spec: TokenReviewSpec {
                    token: token.clone(),
                    ..TokenReviewSpec::default()
                },
                ..TokenReview::default()
            };
            match kube.create_token_review(&review) {
                Ok(r) => {
                    let status = r.status.unwrap_or_default();
                    if !status.authenticated.unwrap_or(false) {
                        return AuthAnswer::Unauthenticated;
                    }
                    let u = status.user.unwrap_or_default();
                    UserInfo {
                        name: u.username.unwrap_or_default(),
                        uid: u.uid.unwrap_or_default(),
                        groups: u.groups.unwrap_or_default(),
                        extra: u.extra.unwrap_or_default().into_iter().collect(),
                    }
                }
                Err(e) => return AuthAnswer::Error(format!("token review: {e}")),
            }
        }
        (None, None) => return AuthAnswer::Unauthenticated,
    };
    let review = access_review(&user, req);
    match kube.create_subject_access_review(&review) {
        Ok(r) => AuthAnswer::Decided {
            user,
            allowed: r.status.is_some_and(|s| s.allowed),
        },
        Err(e) => AuthAnswer::Error(format!("subject access review: {e}")),
    }
}

/// The SubjectAccessReview for a caller: name, uid, groups and `extra` as the TokenReview
/// gave them (authorisers may decide on extra, e.g. scopes), the request's attributes.
fn access_review(user: &UserInfo, req: &AuthRequest) -> SubjectAccessReview {
    SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.name.clone()),
            uid: Some(user.uid.clone()).filter(|u| !u.is_empty()),
            groups: Some(user.groups.clone()),
            extra: Some(user.extra.clone().into_iter().collect())
                .filter(|e: &std::collections::BTreeMap<String, Vec<String>>| !e.is_empty()),
            resource_attributes: Some(SarAttributes {
                verb: Some(req.attributes.verb.clone()),
                resource: Some("nodes".into()),
                subresource: Some(req.attributes.subresource.clone()),
                name: Some(req.attributes.node_name.clone()),
                version: Some("v1".into()),
                ..SarAttributes::default()
            }),
            ..SubjectAccessReviewSpec::default()
        },
        ..SubjectAccessReview::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_access_review_carries_the_callers_extra() {
        let user = UserInfo {
            name: "sa".into(),
            extra: [("scopes".to_string(), vec!["read".to_string()])].into(),
            ..Default::default()
        };
        let req = AuthRequest {
            token: Some("t".into()),
            user: None,
            attributes: crate::kubelet::auth::attributes("POST", "/exec/a/b/c", "n"),
        };
        let spec = access_review(&user, &req).spec;
        assert_eq!(
            spec.extra.unwrap_or_default().get("scopes"),
            Some(&vec!["read".to_string()])
        );
        let plain = UserInfo::default();
        assert!(access_review(&plain, &req).spec.extra.is_none());
    }

    #[test]
    fn annotation_patches_delete_with_null_and_guard_with_uid() {
        let mut a = BTreeMap::new();
        a.insert("vm.cocoonstack.io/id".to_string(), Some("vm-1".to_string()));
        a.insert(
            "vm.cocoonstack.io/lifecycle-state-message".to_string(),
            None,
        );
        let p = annotation_patch(Some("u-1".into()), a);
        assert_eq!(p["metadata"]["uid"], "u-1");
        assert_eq!(p["metadata"]["annotations"]["vm.cocoonstack.io/id"], "vm-1");
        assert!(
            p["metadata"]["annotations"]["vm.cocoonstack.io/lifecycle-state-message"].is_null()
        );
    }
}
