//! The boot itself: the clone or run call, what it answered (the VM, its PID), and the
//! leftover a failed boot may leave under the VM name.

use super::*;

impl Provider {
    /// Asks cocoon for the VM just booted (its state, its PID); `vm` stands if it cannot say.
    pub(super) fn run_inspect(&mut self, key: &PodKey, vm: VmInfo) {
        let reference = vm.id.clone();
        if let Some(c) = self.op_of_mut::<CreateOp>(key) {
            c.vm = Some(vm);
        }
        let ask = Ask::Cocoon(CocoonCmd::VmInspect { reference });
        self.advance(key, CreateStep::RunInspect, ask)
    }

    /// The clone or run answered: the VM is up (its PID read when the answer has none), or
    /// the failure's leftover is looked for.
    pub(super) fn booted(&mut self, key: &PodKey, c: &CreateOp, r: Answer) {
        let spec = &c.spec;
        if spec.clone_from_dir.is_some() {
            self.metric(MetricUpdate::CloneFromDir {
                result: if r.succeeded() { "ok" } else { "failed" },
            });
        }
        let what = if spec.fresh_boot() {
            "vm run"
        } else {
            "vm clone"
        };
        if !r.succeeded() {
            // The snapshot or image the shared facts said was there may be gone.
            self.read_facts.forget_all();
            // A clone killed at its deadline (or failing half-way) can leave a VM
            // record behind; if the pod is deleted before the retry, nothing would
            // ever remove it. Look before reporting the failure.
            let error = format!("{what} {}: {}", spec.vm_name, r.error_text());
            return self.advance(
                key,
                CreateStep::BootFailedInspect { error },
                Ask::Cocoon(CocoonCmd::VmInspect {
                    reference: spec.vm_name.clone(),
                }),
            );
        }
        let vm = match r.vm() {
            Ok(v) => v,
            // The call succeeded but its answer names no VM (no id, or unreadable): one
            // lookup by name says what it made, as after a failed bring-up (a running VM of
            // this name is the pod's; anything else is removed and the create retried).
            Err(e) => {
                let error = format!("{what} {} answered without a VM record: {e}", spec.vm_name);
                return self.advance(
                    key,
                    CreateStep::BootFailedInspect { error },
                    Ask::Cocoon(CocoonCmd::VmInspect {
                        reference: spec.vm_name.clone(),
                    }),
                );
            }
        };
        self.by_name.insert(spec.vm_name.clone(), vm.clone());
        let fresh_run = spec.fresh_boot();
        if fresh_run && !vm.running() {
            return self.run_inspect(key, vm);
        }
        // A clone answers with pid 0 (cocoon reads the PID back only later); without
        // one the VM has no stats until a restart re-adopts it (stats skip pid-0 VMs).
        // The hypervisor's pid file tells it without another cocoon process.
        if vm.pid == 0 {
            if let Some(c) = self.op_of_mut::<CreateOp>(key) {
                c.vm = Some(vm.clone());
            }
            let (vm_id, firecracker) = (vm.id.clone(), vm.hypervisor == "firecracker");
            let ask = Ask::effect(move |op| Effect::ReadVmPid {
                op,
                vm_id,
                firecracker,
            });
            return self.advance(key, CreateStep::PidFile, ask);
        }
        self.vm_up(key, vm, false)
    }

    /// What a failed bring-up left under the VM name: a running VM is the bring-up finished
    /// after all, a stopped one is removed before the failure is reported.
    pub(super) fn boot_failed_inspected(
        &mut self,
        key: &PodKey,
        c: &CreateOp,
        error: String,
        r: Answer,
    ) {
        let spec = &c.spec;
        // Only a VM of this very name is the bring-up's: cocoon may answer a lookup by
        // name with a VM whose ID starts with it, which is left alone.
        let vm = r.vm().ok();
        match vm.filter(|v| r.succeeded() && isolation::vm_named(v, &spec.vm_name)) {
            // The bring-up finished after all (a slow clone past its deadline).
            Some(vm) if vm.running() => {
                self.by_name.insert(spec.vm_name.clone(), vm.clone());
                self.vm_up(key, vm, false)
            }
            Some(vm) => {
                let ask = Ask::Cocoon(CocoonCmd::VmRm { id: vm.id });
                self.advance(key, CreateStep::BootFailedRm { error }, ask)
            }
            None => {
                if r.vm_not_found() {
                    self.forget_owner(Owned::Vm, &spec.vm_name);
                }
                self.fail_create(key, &c.uid, &error, true)
            }
        }
    }

    pub(in crate::provider::core) fn do_clone(&mut self, key: &PodKey) {
        let Some(c) = self.op_of_mut::<CreateOp>(key) else {
            return;
        };
        let (spec, local, img) = (
            c.spec.clone(),
            c.local_snapshot.clone(),
            c.snapshot_image.clone(),
        );
        let args = clone_args(
            &self.cfg,
            &spec,
            CloneSource::Snapshot(local),
            !img.is_empty(),
        );
        self.boot(key, CocoonCmd::VmClone(args));
    }

    /// The bring-up call (`vm clone` / `vm run`), once the VM's owner (the pod's namespace) is
    /// on record: a crash after it leaves the VM owned, never ownerless.
    pub(in crate::provider::core) fn boot(&mut self, key: &PodKey, cmd: CocoonCmd) {
        let Some(c) = self.op_of_mut::<CreateOp>(key) else {
            return;
        };
        let owner = Owner::new(&key.namespace, &c.uid);
        let name = c.spec.vm_name.clone();
        if let Some(msg) = self.vm_record_refusal(key, &name) {
            let (event, reason) = (
                isolation::EVENT_VM_NOT_IN_NS,
                isolation::REASON_VM_NOT_IN_NS,
            );
            return self.refuse_create(key, event, reason, msg);
        }
        let ask = Self::owned_then(Owned::Vm, &name, owner, Deferred::Cocoon(cmd));
        self.advance(key, CreateStep::Boot, ask)
    }
}

/// The `vm clone` of `spec` from `source` (`pull`: the snapshot's base image is pulled too).
pub(in crate::provider::core) fn clone_args(
    cfg: &ProviderConfig,
    spec: &VmSpec,
    source: CloneSource,
    pull: bool,
) -> CloneOptions {
    CloneOptions {
        name: spec.vm_name.clone(),
        network: spec.network.clone(),
        no_direct_io: spec.no_direct_io,
        pull,
        // Windows guests are restored by copy whatever VK_RESTORE_MODE says (the
        // contract's clone rule for them).
        restore_mode: if spec.firecracker() {
            None
        } else if spec.os == Os::Windows {
            Some(crate::vm::RestoreMode::Copy)
        } else {
            Some(cfg.restore_mode)
        },
        nics: None,
        cpu: spec.resources.cpu_policy(),
        backend: spec.backend_kind(),
        source,
    }
}
