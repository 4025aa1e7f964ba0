//! Registry transfers of the edge: snapshot pulls and pushes, image materialisation, tag
//! deletions and peer restores as jobs on the worker pool, and the manifest reads creates wait on.
//!
//! Each answers `Input::TransferDone` (a manifest read `Input::HibernateEvidence`) with its op.
//! At most `MAX_TRANSFER_JOBS` run at once; the rest wait in order in the daemon's queue.

use std::path::Path;
use std::time::Instant;

use crate::provider::owners::Owner;
use crate::provider::{HibernateTag, Input, OpId};
use crate::snapshots::cocoon_child::transfer_error;
use crate::snapshots::reference::split_image_ref;
use crate::snapshots::{
    manifest_info, pull_cloud_image, pull_snapshot, push_snapshot, ArtifactKind, CloudImageRequest,
    PullRequest, PushKnobs, PushRequest, RegistryClient, TransferError,
};
use crate::vm::{argv, CocoonCall, CocoonError, Deadlines, Verb};

use super::{Daemon, Work};

/// A registry job waiting in the daemon's transfer queue.
pub(super) type TransferJob =
    Box<dyn FnOnce(&RegistryClient) -> Result<String, TransferError> + Send>;

/// The answer to a registry effect when OCI_REGISTRY is not set.
fn no_registry() -> TransferError {
    TransferError::Invalid("no OCI registry is configured (OCI_REGISTRY)".into())
}

impl Daemon {
    /// `Effect::PullSnapshot`: the snapshot `repo:tag` becomes local snapshot `local_name`.
    pub(super) fn pull_snapshot(
        &mut self,
        op: OpId,
        repo: String,
        tag: String,
        local_name: String,
    ) {
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

    /// `Effect::PushSnapshot`: local snapshot `repo` goes to the registry as `repo:tag`.
    pub(super) fn push_snapshot(
        &mut self,
        op: OpId,
        local_name: String,
        repo: String,
        tag: String,
        base_image: String,
        owner: Owner,
    ) {
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

    /// `Effect::MaterialiseImage`: the image a `mode=run` pod boots from (see
    /// `materialise_image`).
    pub(super) fn materialise(&mut self, op: OpId, image: String, force: bool) {
        let bin = self.cocoon_bin();
        self.transfer(op, move |registry| {
            materialise_image(registry, &bin, &image, force)
        });
    }

    /// `Effect::DeleteSnapshotTag`.
    pub(super) fn delete_snapshot_tag(&mut self, op: OpId, repo: String, tag: String) {
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

    /// `Effect::PeerRestore`: a snapshot staged from the node that holds it, the registry as
    /// its fallback; answers the staged directory.
    pub(super) fn peer_restore(
        &mut self,
        op: OpId,
        namespace: String,
        vm_name: String,
        from_node: String,
        local_name: String,
    ) {
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

    /// One manifest GET of `repo:tag` on the pool, outside the transfer queue: a create must
    /// not wait for unrelated multi-GiB pulls to learn whether its VM was hibernated, nor
    /// whose snapshot an image is.
    pub(super) fn read_tag(&mut self, op: OpId, repo: String, tag: String) {
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
