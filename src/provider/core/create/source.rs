//! Where a fresh bring-up clones or runs from: the image's local snapshot (inspected, pulled
//! once per node at a time, its manifest read first) or the image materialised for a run.

use super::*;

impl Provider {
    /// The fresh bring-up, once the pod's source passed its rules (`source_check`).
    pub(super) fn fresh_bring_up(&mut self, key: &PodKey, c: &CreateOp) {
        if self.source_gate(key, c) {
            self.bring_up_from_source(key, c)
        }
    }

    /// The bring-up from the pod's source: a directory, a fork, an image to run, or the
    /// image's local clone snapshot.
    pub(in crate::provider::core) fn bring_up_from_source(&mut self, key: &PodKey, c: &CreateOp) {
        let spec = &c.spec;
        if let Some(dir) = spec.clone_from_dir.clone() {
            let args = clone_args(&self.cfg, spec, CloneSource::FromDir(dir), true);
            self.boot(key, CocoonCmd::VmClone(args))
        } else if !spec.fork_from.is_empty() {
            self.fork_begin(key, &spec.fork_from)
        } else if spec.mode == Mode::Run {
            let ask = self.materialise(&spec.image, spec.force_pull);
            self.advance(key, CreateStep::MaterialiseRun, ask)
        } else {
            self.advance(
                key,
                CreateStep::SnapInspect { pulled: false },
                Ask::SharedRead(CocoonCmd::SnapshotInspect {
                    name: c.local_snapshot.clone(),
                }),
            )
        }
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

    /// A pull answered: the snapshot is free for the next puller.
    fn pull_done<T>(&mut self, key: &PodKey, c: &CreateOp, r: T) -> T {
        if self.pulls.get(&c.local_snapshot) == Some(key) {
            self.pulls.remove(&c.local_snapshot);
        }
        r
    }

    /// Whether pod `key` may clone the local snapshot of its image: one recorded for its
    /// namespace; with no record, a base image (its repository is no VM's name) or a VM
    /// snapshot whose name proves the namespace.
    fn image_snapshot_readable(&self, key: &PodKey, c: &CreateOp) -> bool {
        let (repo, _) = crate::snapshots::reference::split_image_ref(&c.spec.image);
        match self.owner_of(Owned::Snapshot, &c.local_snapshot) {
            Some(o) => o.namespace == key.namespace,
            None => !isolation::vm_repository(&repo) || isolation::owned_by(None, &repo, key),
        }
    }

    /// The image's manifest, read before its pull: a VM snapshot of another namespace (or of
    /// none the record or name ties to the pod's) is refused; otherwise exactly the manifest
    /// read is pulled (by its digest), a VM snapshot once its owner is on record.
    pub(super) fn image_tag_read(
        &mut self,
        key: &PodKey,
        c: &CreateOp,
        r: Result<Option<HibernateTag>, TransferError>,
    ) {
        let (repo, tag) = crate::snapshots::reference::split_image_ref(&c.spec.image);
        let local = c.local_snapshot.clone();
        let found = match r {
            Ok(found) => found,
            Err(e) => {
                self.pull_done(key, c, ());
                self.metric(MetricUpdate::SnapshotPull { result: "failed" });
                let msg = format!("read the manifest of {}: {e}", c.spec.image);
                return self.fail_create(key, &c.uid, &msg, true);
            }
        };
        let vm_snapshot = found.as_ref().map_or(isolation::vm_repository(&repo), |t| {
            isolation::vm_snapshot_tag(&repo, t)
        });
        let owner = found.as_ref().map(|t| t.owner_namespace.as_str());
        if vm_snapshot && !isolation::owned_by(owner, &repo, key) {
            self.pull_done(key, c, ());
            let msg = format!(
                "pod {key}: image {} is a VM snapshot not recorded for namespace {}; a pod \
                 clones only its own namespace's VM snapshots",
                c.spec.image, key.namespace
            );
            return self.refuse_create(
                key,
                isolation::EVENT_SNAPSHOT_NOT_IN_NS,
                isolation::REASON_SNAPSHOT_NOT_IN_NS,
                msg,
            );
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
                Self::owned_then(Owned::Snapshot, &local, owner, Deferred::Effect(pull))
            }
            None => Ask::effect(move |op| ledger::with_op_id(pull, op)),
        };
        self.advance(key, CreateStep::PullSnapshot, ask)
    }

    /// The image's local clone snapshot, inspected (before or after its pull): cloned when
    /// present, the pod's namespace's and of the hypervisor asked for; pulled when missing.
    pub(super) fn image_snapshot_inspected(
        &mut self,
        key: &PodKey,
        c: &CreateOp,
        pulled: bool,
        r: Answer,
    ) {
        let spec = &c.spec;
        // Another snapshot than the one asked for (an ID-prefix match) is none.
        let found = match r.succeeded() {
            true => match isolation::inspected_snapshot(&r, &c.local_snapshot) {
                Ok(s) => s,
                Err(e) => return self.fail_create(key, &c.uid, &e.to_string(), true),
            },
            false => None,
        };
        // force-pull: the snapshot comes from the registry at least once after this create
        // began (a pull another pod finished meanwhile counts), as `image pull --force` does
        // for an image to run. The pull replaces the local copy.
        let stale = spec.force_pull
            && self.cfg.registry
            && !pulled
            && self
                .pulled_at
                .get(&c.local_snapshot)
                .is_none_or(|at| *at < c.started);
        let found = found.filter(|_| !stale);
        let Some(snap) = found else {
            let why = if r.succeeded() {
                "cocoon answered with another snapshot".to_string()
            } else {
                r.error_text()
            };
            if pulled {
                self.metric(MetricUpdate::SnapshotPull { result: "failed" });
                let msg = format!(
                    "snapshot {} still missing after pull: {why}",
                    c.local_snapshot
                );
                return self.fail_create(key, &c.uid, &msg, true);
            }
            if !self.cfg.registry {
                self.metric(MetricUpdate::SnapshotPull { result: "failed" });
                let msg = format!(
                    "snapshot {} not found locally and no registry is configured: {why}",
                    c.local_snapshot
                );
                return self.fail_create(key, &c.uid, &msg, true);
            }
            if self.pull_running(&c.local_snapshot, key) {
                let at = self.now + PULL_WAIT_POLL;
                return self.advance(key, CreateStep::PullWait, Ask::Timer(at));
            }
            // Whose snapshot the image is, before anything of it is pulled.
            self.pulls.insert(c.local_snapshot.clone(), key.clone());
            let (repo, tag) = crate::snapshots::reference::split_image_ref(&spec.image);
            let ask = Ask::effect(|op| Effect::ReadSnapshotTag { op, repo, tag });
            return self.advance(key, CreateStep::ImageTag, ask);
        };
        if !self.image_snapshot_readable(key, c) {
            let msg = format!(
                "pod {key}: image {} is a VM snapshot not recorded for namespace {}; \
                     a pod clones only its own namespace's VM snapshots",
                spec.image, key.namespace
            );
            return self.refuse_create(
                key,
                isolation::EVENT_SNAPSHOT_NOT_IN_NS,
                isolation::REASON_SNAPSHOT_NOT_IN_NS,
                msg,
            );
        }
        if !pulled {
            self.metric(MetricUpdate::SnapshotPull { result: "ok" });
        }
        let want = if spec.backend.is_empty() {
            spec::BACKEND_CH
        } else {
            spec.backend.as_str()
        };
        if !snap.hypervisor.is_empty() && !spec.backend.is_empty() && snap.hypervisor != want {
            let msg = format!(
                "snapshot {} was taken with {} but CocoonSet requests {}",
                c.local_snapshot, snap.hypervisor, spec.backend
            );
            return self.fail_create(key, &c.uid, &msg, false);
        }
        if let Some(c) = self.op_of_mut::<CreateOp>(key) {
            c.snapshot_image = snap.image.clone();
        }
        if !snap.image.is_empty()
            && !spec::is_http_url(&snap.image)
            && !snap.image_digest.is_empty()
        {
            return self.advance(
                key,
                CreateStep::ImageInspect,
                Ask::SharedRead(CocoonCmd::ImageInspect {
                    reference: snap.image_digest.clone(),
                }),
            );
        }
        self.do_clone(key)
    }

    /// The pull of the image's snapshot answered: inspected again, or the create fails.
    pub(super) fn snapshot_pulled(
        &mut self,
        key: &PodKey,
        c: &CreateOp,
        r: Result<String, TransferError>,
    ) {
        match self.pull_done(key, c, r) {
            Ok(_) => {
                self.metric(MetricUpdate::SnapshotPull { result: "ok" });
                self.pulled_at.insert(c.local_snapshot.clone(), self.now);
                self.advance(
                    key,
                    CreateStep::SnapInspect { pulled: true },
                    Ask::Cocoon(CocoonCmd::SnapshotInspect {
                        name: c.local_snapshot.clone(),
                    }),
                )
            }
            Err(e) => {
                self.metric(MetricUpdate::SnapshotPull { result: "failed" });
                let msg = format!("pull snapshot {}: {e}", c.spec.image);
                self.fail_create(key, &c.uid, &msg, true)
            }
        }
    }

    /// `mode=run`: the image is available (or not): `vm run` of it.
    pub(super) fn run_image_ready(&mut self, key: &PodKey, c: &CreateOp, res: Res) {
        let spec = &c.spec;
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
                self.boot(key, CocoonCmd::VmRun(args))
            }
            Err(e) => {
                let msg = format!("make image {} available: {e}", spec.image);
                self.fail_create(key, &c.uid, &msg, true)
            }
        }
    }

    /// `mode=run` image materialisation: with a registry and an OCI ref the snapshots room
    /// decides (cloud image import, snapshot artifact refusal, pull fallback); otherwise
    /// `cocoon image pull`.
    pub(in crate::provider::core) fn materialise(&self, image: &str, force: bool) -> Ask {
        let image = image.to_string();
        if self.cfg.registry && !spec::is_http_url(&image) {
            Ask::effect(move |op| Effect::MaterialiseImage { op, image, force })
        } else {
            Ask::Cocoon(CocoonCmd::ImagePull {
                reference: image,
                force,
            })
        }
    }
}
