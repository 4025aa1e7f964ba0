//! Where a fresh bring-up clones or runs from: the image's local snapshot (inspected, pulled
//! once per node at a time, its manifest read first) or the image materialised for a run.

use super::*;

impl Provider {
    /// The image's snapshot is missing: its pull starts once no other pod pulls it (one pull
    /// per snapshot on the node at a time: each pull replaces the local snapshot).
    pub(super) fn create_pull(&mut self, key: &PodKey, c: &CreateOp) {
        if self.pull_running(&c.local_snapshot, key) {
            let at = self.now + PULL_WAIT_POLL;
            return self.advance(key, CreateStep::PullWait, Ask::Timer(at));
        }
        // Whose snapshot the image is, before anything of it is pulled.
        self.pulls.insert(c.local_snapshot.clone(), key.clone());
        let (repo, tag) = crate::snapshots::reference::split_image_ref(&c.spec.image);
        let ask = Ask::effect(|op| Effect::ReadSnapshotTag { op, repo, tag });
        self.advance(key, CreateStep::ImageTag, ask)
    }

    /// Whether another pod's pull of this local snapshot is still running (an entry whose pod
    /// no longer pulls, its op ended by a delete, is dropped).
    fn pull_running(&mut self, local: &str, key: &PodKey) -> bool {
        let Some(puller) = self.pulls.get(local) else {
            return false;
        };
        let pulling = puller != key
            && self.slots.get(puller).is_some_and(|s| {
                s.op().and_then(CreateOp::of).is_some_and(|c| {
                    matches!(c.step, CreateStep::ImageTag | CreateStep::PullSnapshot)
                        && c.local_snapshot == local
                })
            });
        if !pulling {
            self.pulls.remove(local);
        }
        pulling
    }
}

/// `mode=run` image materialisation: with a registry and an OCI ref the snapshots room
/// decides (cloud image import, snapshot artifact refusal, pull fallback); otherwise
/// `cocoon image pull`.
fn materialise(cfg: &ProviderConfig, image: &str, force: bool) -> Ask {
    let image = image.to_string();
    if cfg.registry && !spec::is_http_url(&image) {
        Ask::effect(move |op| Effect::MaterialiseImage { op, image, force })
    } else {
        Ask::Cocoon(CocoonCmd::ImagePull {
            reference: image,
            force,
        })
    }
}

impl CreateOp {
    /// An answer to this create in its source phase: the image's snapshot (inspected,
    /// pulled), a fork flight landed, the host's source check, the image made available.
    pub(super) fn on_source_answer(&mut self, cx: &mut Cx, res: Res) -> CreateNext {
        match (self.step.clone(), res) {
            (CreateStep::SnapInspect { pulled }, Res::Cocoon(r)) => {
                self.image_snapshot_inspected(cx, pulled, r)
            }
            (CreateStep::ForkWait { .. }, Res::Fork(r)) => self.fork_landed(cx, r),
            (CreateStep::ImageTag, Res::Evidence(r)) => self.image_tag_read(cx, r),
            (CreateStep::SourceCheck { rule }, Res::Source(v)) => self.source_checked(cx, rule, v),
            (CreateStep::PullSnapshot, Res::Transfer(r)) => self.snapshot_pulled(cx, r),
            (CreateStep::ImageInspect, Res::Cocoon(r)) => {
                if r.succeeded() {
                    return self.clone_snapshot(cx);
                }
                let ask = materialise(cx.cfg, &self.snapshot_image, false);
                Next::Ask(CreateStep::MaterialiseBase, ask)
            }
            (CreateStep::MaterialiseBase, res) => match res.transfer_or_cocoon() {
                Ok(_) => self.clone_snapshot(cx),
                Err(e) => {
                    let msg = format!("make base image {} available: {e}", self.snapshot_image);
                    Self::failed(msg, true)
                }
            },
            (CreateStep::MaterialiseRun, res) => self.run_image_ready(cx, res),
            (step, res) => Next::Unexpected(step, res),
        }
    }

    /// The poll timer of a pod waiting for another pod's pull: look at the snapshot again.
    pub(super) fn on_timer(&self) -> CreateNext {
        if !matches!(self.step, CreateStep::PullWait) {
            return Next::Wait;
        }
        let name = self.local_snapshot.clone();
        let ask = Ask::SharedRead(CocoonCmd::SnapshotInspect { name });
        Next::Ask(CreateStep::SnapInspect { pulled: false }, ask)
    }

    /// The fresh bring-up, once the pod's source passed its rules (`source_check`).
    pub(super) fn fresh_bring_up(&mut self, cx: &Cx) -> CreateNext {
        match self.source_gate(cx) {
            Some(wait_or_refusal) => wait_or_refusal,
            None => self.bring_up_from_source(cx),
        }
    }

    /// The bring-up from the pod's source: a directory, a fork, an image to run, or the
    /// image's local clone snapshot.
    pub(in crate::provider::core) fn bring_up_from_source(&mut self, cx: &Cx) -> CreateNext {
        let spec = &self.spec;
        if let Some(dir) = spec.clone_from_dir.clone() {
            let args = clone_args(cx.cfg, spec, CloneSource::FromDir(dir), true);
            self.boot(cx, CocoonCmd::VmClone(args))
        } else if !spec.fork_from.is_empty() {
            Next::Then(CreateThen::Fork(spec.fork_from.clone()))
        } else if spec.mode == Mode::Run {
            let ask = materialise(cx.cfg, &spec.image, spec.force_pull);
            Next::Ask(CreateStep::MaterialiseRun, ask)
        } else {
            let name = self.local_snapshot.clone();
            let ask = Ask::SharedRead(CocoonCmd::SnapshotInspect { name });
            Next::Ask(CreateStep::SnapInspect { pulled: false }, ask)
        }
    }

    /// A pull answered: the snapshot is free for the next puller.
    fn pull_released(&self, cx: &Cx) -> Chore {
        Chore::PullReleased(self.local_snapshot.clone(), cx.key.clone())
    }

    /// Whether this pod may clone the local snapshot of its image: one recorded for its
    /// namespace; with no record, a base image (its repository is no VM's name) or a VM
    /// snapshot whose name proves the namespace.
    fn image_snapshot_readable(&self, cx: &Cx) -> bool {
        let (repo, _) = crate::snapshots::reference::split_image_ref(&self.spec.image);
        match cx.owners.get(Owned::Snapshot, &self.local_snapshot) {
            Some(o) => o.namespace == cx.key.namespace,
            None => !isolation::vm_repository(&repo) || isolation::owned_by(None, &repo, cx.key),
        }
    }

    /// A VM snapshot image of another namespace (or of none a record or name ties to this
    /// pod's) is refused.
    fn snapshot_refused(&self, cx: &Cx) -> CreateNext {
        let msg = format!(
            "pod {}: image {} is a VM snapshot not recorded for namespace {}; a pod clones \
             only its own namespace's VM snapshots",
            cx.key, self.spec.image, cx.key.namespace
        );
        Next::Then(CreateThen::Refused(
            isolation::EVENT_SNAPSHOT_NOT_IN_NS,
            isolation::REASON_SNAPSHOT_NOT_IN_NS,
            msg,
        ))
    }

    /// The image's manifest, read before its pull: a VM snapshot of another namespace (or of
    /// none the record or name ties to the pod's) is refused; otherwise exactly the manifest
    /// read is pulled (by its digest), a VM snapshot once its owner is on record.
    fn image_tag_read(
        &mut self,
        cx: &mut Cx,
        r: Result<Option<HibernateTag>, TransferError>,
    ) -> CreateNext {
        let key = cx.key;
        let (repo, tag) = crate::snapshots::reference::split_image_ref(&self.spec.image);
        let local = self.local_snapshot.clone();
        let found = match r {
            Ok(found) => found,
            Err(e) => {
                cx.metric(MetricUpdate::SnapshotPull { result: "failed" });
                let msg = format!("read the manifest of {}: {e}", self.spec.image);
                return Self::chore_then(vec![self.pull_released(cx)], Self::failed(msg, true));
            }
        };
        let vm_snapshot = found.as_ref().map_or(isolation::vm_repository(&repo), |t| {
            isolation::vm_snapshot_tag(&repo, t)
        });
        let owner = found.as_ref().map(|t| t.owner_namespace.as_str());
        if vm_snapshot && !isolation::owned_by(owner, &repo, key) {
            return Self::chore_then(vec![self.pull_released(cx)], self.snapshot_refused(cx));
        }
        let target = found
            .as_ref()
            .map(|t| t.digest.clone())
            .filter(|d| !d.is_empty())
            .unwrap_or(tag);
        let pull = Effect::PullSnapshot {
            op: 0,
            repo,
            tag: target,
            local_name: local.clone(),
        };
        let ask = match found.filter(|_| vm_snapshot) {
            Some(t) => {
                let ns = if t.owner_namespace.is_empty() {
                    key.namespace.clone()
                } else {
                    t.owner_namespace
                };
                let owner = Owner::new(&ns, &t.owner_pod_uid);
                Provider::owned_then(Owned::Snapshot, &local, owner, Deferred::Effect(pull))
            }
            None => Ask::effect(move |op| ledger::with_op_id(pull, op)),
        };
        Next::Ask(CreateStep::PullSnapshot, ask)
    }

    /// The image's local clone snapshot, inspected (before or after its pull): cloned when
    /// present, the pod's namespace's and of the hypervisor asked for; pulled when missing.
    fn image_snapshot_inspected(&mut self, cx: &mut Cx, pulled: bool, r: Answer) -> CreateNext {
        // Another snapshot than the one asked for (an ID-prefix match) is none.
        let found = match r.succeeded() {
            true => match isolation::inspected_snapshot(&r, &self.local_snapshot) {
                Ok(s) => s,
                Err(e) => return Self::failed(e.to_string(), true),
            },
            false => None,
        };
        // force-pull: the snapshot comes from the registry at least once after this create
        // began (a pull another pod finished meanwhile counts), as `image pull --force` does
        // for an image to run. The pull replaces the local copy.
        let stale = self.spec.force_pull
            && cx.cfg.registry
            && !pulled
            && cx
                .pulled_at
                .get(&self.local_snapshot)
                .is_none_or(|at| *at < self.started);
        let Some(snap) = found.filter(|_| !stale) else {
            let why = if r.succeeded() {
                "cocoon answered with another snapshot".to_string()
            } else {
                r.error_text()
            };
            return self.image_snapshot_missing(cx, pulled, why);
        };
        if !self.image_snapshot_readable(cx) {
            return self.snapshot_refused(cx);
        }
        if !pulled {
            cx.metric(MetricUpdate::SnapshotPull { result: "ok" });
        }
        let spec = &self.spec;
        let want = if spec.backend.is_empty() {
            spec::BACKEND_CH
        } else {
            spec.backend.as_str()
        };
        if !snap.hypervisor.is_empty() && !spec.backend.is_empty() && snap.hypervisor != want {
            let msg = format!(
                "snapshot {} was taken with {} but CocoonSet requests {}",
                self.local_snapshot, snap.hypervisor, spec.backend
            );
            return Self::failed(msg, false);
        }
        self.snapshot_image = snap.image.clone();
        if !snap.image.is_empty()
            && !spec::is_http_url(&snap.image)
            && !snap.image_digest.is_empty()
        {
            let reference = snap.image_digest.clone();
            let ask = Ask::SharedRead(CocoonCmd::ImageInspect { reference });
            return Next::Ask(CreateStep::ImageInspect, ask);
        }
        self.clone_snapshot(cx)
    }

    /// No usable local snapshot of the image (`why`): the create fails after a pull or with
    /// no registry, and pulls it otherwise.
    fn image_snapshot_missing(&self, cx: &mut Cx, pulled: bool, why: String) -> CreateNext {
        let local = &self.local_snapshot;
        let msg = match (pulled, cx.cfg.registry) {
            (true, _) => format!("snapshot {local} still missing after pull: {why}"),
            (false, false) => {
                format!("snapshot {local} not found locally and no registry is configured: {why}")
            }
            (false, true) => return Next::Then(CreateThen::Pull),
        };
        cx.metric(MetricUpdate::SnapshotPull { result: "failed" });
        Self::failed(msg, true)
    }

    /// The pull of the image's snapshot answered: inspected again, or the create fails.
    fn snapshot_pulled(&mut self, cx: &mut Cx, r: Result<String, TransferError>) -> CreateNext {
        let released = self.pull_released(cx);
        match r {
            Ok(_) => {
                cx.metric(MetricUpdate::SnapshotPull { result: "ok" });
                let name = self.local_snapshot.clone();
                let chores = vec![released, Chore::Pulled(name.clone())];
                let ask = Ask::Cocoon(CocoonCmd::SnapshotInspect { name });
                Self::chore_then(
                    chores,
                    Next::Ask(CreateStep::SnapInspect { pulled: true }, ask),
                )
            }
            Err(e) => {
                cx.metric(MetricUpdate::SnapshotPull { result: "failed" });
                let msg = format!("pull snapshot {}: {e}", self.spec.image);
                Self::chore_then(vec![released], Self::failed(msg, true))
            }
        }
    }

    /// `mode=run`: the image is available (or not): `vm run` of it.
    fn run_image_ready(&mut self, cx: &Cx, res: Res) -> CreateNext {
        let spec = &self.spec;
        match res.transfer_or_cocoon() {
            Ok(boot) => {
                let boot = if boot.is_empty() {
                    spec.image.clone()
                } else {
                    boot
                };
                let r = &spec.resources;
                let args = RunOptions {
                    name: spec.vm_name.clone(),
                    cpu: r.vcpus(),
                    cpu_policy: r.cpu_policy(),
                    memory: r.memory_bytes().map(|b| b.to_string()).unwrap_or_default(),
                    storage: spec
                        .storage_bytes
                        .map(|b| b.to_string())
                        .unwrap_or_default(),
                    network: spec.network.clone(),
                    windows: spec.os == Os::Windows,
                    backend: spec.backend_kind(),
                    no_direct_io: spec.no_direct_io,
                    image: boot,
                };
                self.boot(cx, CocoonCmd::VmRun(args))
            }
            Err(e) => {
                let msg = format!("make image {} available: {e}", spec.image);
                Self::failed(msg, true)
            }
        }
    }
}
