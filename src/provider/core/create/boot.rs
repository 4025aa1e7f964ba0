//! The boot itself: the clone or run call, what it answered (the VM, its PID), and the
//! leftover a failed boot may leave under the VM name.

use super::*;

impl CreateOp {
    /// Asks cocoon for the VM just booted (its state, its PID); `vm` stands if it cannot say.
    pub(super) fn run_inspect(&mut self, vm: VmInfo) -> CreateNext {
        let reference = vm.id.clone();
        self.vm = Some(vm);
        let ask = Ask::Cocoon(CocoonCmd::VmInspect { reference });
        Next::Ask(CreateStep::RunInspect, ask)
    }

    /// The clone or run answered: the VM is up (its PID read when the answer has none), or
    /// the failure's leftover is looked for.
    pub(super) fn booted(&mut self, cx: &mut Cx, r: Answer) -> CreateNext {
        let vm_name = self.spec.vm_name.clone();
        if self.spec.clone_from_dir.is_some() {
            cx.metric(MetricUpdate::CloneFromDir {
                result: if r.succeeded() { "ok" } else { "failed" },
            });
        }
        let fresh_run = self.spec.fresh_boot();
        let what = if fresh_run { "vm run" } else { "vm clone" };
        let look = |error: String| {
            let ask = Ask::Cocoon(CocoonCmd::VmInspect {
                reference: vm_name.clone(),
            });
            Next::Ask(CreateStep::BootFailedInspect { error }, ask)
        };
        if !r.succeeded() {
            // A clone killed at its deadline (or failing half-way) can leave a VM
            // record behind; if the pod is deleted before the retry, nothing would
            // ever remove it. Look before reporting the failure.
            let error = format!("{what} {vm_name}: {}", r.error_text());
            // The snapshot or image the shared facts said was there may be gone.
            return Self::chore_then(vec![Chore::ReadFactsStale], look(error));
        }
        let vm = match r.vm() {
            Ok(v) => v,
            // The call succeeded but its answer names no VM (no id, or unreadable): one
            // lookup by name says what it made, as after a failed bring-up (a running VM of
            // this name is the pod's; anything else is removed and the create retried).
            Err(e) => {
                return look(format!(
                    "{what} {vm_name} answered without a VM record: {e}"
                ))
            }
        };
        let named = vec![Chore::VmNamed(vm_name.clone(), vm.clone())];
        let next = if fresh_run && !vm.running() {
            self.run_inspect(vm)
        } else if vm.pid == 0 {
            // A clone answers with pid 0 (cocoon reads the PID back only later); without
            // one the VM has no stats until a restart re-adopts it (stats skip pid-0 VMs).
            // The hypervisor's pid file tells it without another cocoon process.
            self.vm = Some(vm.clone());
            let (vm_id, firecracker) = (vm.id.clone(), vm.hypervisor == "firecracker");
            let ask = Ask::effect(move |op| Effect::ReadVmPid {
                op,
                vm_id,
                firecracker,
            });
            Next::Ask(CreateStep::PidFile, ask)
        } else {
            Next::Then(CreateThen::Up(vm, false))
        };
        Self::chore_then(named, next)
    }

    /// What a failed bring-up left under the VM name: a running VM is the bring-up finished
    /// after all, a stopped one is removed before the failure is reported.
    pub(super) fn boot_failed_inspected(&self, error: String, r: Answer) -> CreateNext {
        let vm_name = self.spec.vm_name.clone();
        // Only a VM of this very name is the bring-up's: cocoon may answer a lookup by
        // name with a VM whose ID starts with it, which is left alone.
        let vm = r.vm().ok();
        match vm.filter(|v| r.succeeded() && isolation::vm_named(v, &vm_name)) {
            // The bring-up finished after all (a slow clone past its deadline).
            Some(vm) if vm.running() => {
                let named = vec![Chore::VmNamed(vm_name, vm.clone())];
                Self::chore_then(named, Next::Then(CreateThen::Up(vm, false)))
            }
            Some(vm) => {
                let ask = Ask::Cocoon(CocoonCmd::VmRm { id: vm.id });
                Next::Ask(CreateStep::BootFailedRm { error }, ask)
            }
            None if r.vm_not_found() => {
                let forget = vec![Chore::ForgetOwner(Owned::Vm, vm_name)];
                Self::chore_then(forget, Self::failed(error, true))
            }
            None => Self::failed(error, true),
        }
    }
}

impl CreateOp {
    /// The clone of the image's local snapshot (its base image pulled with it if it has one).
    pub(super) fn clone_snapshot(&self, cx: &Cx) -> CreateNext {
        let from = CloneSource::Snapshot(self.local_snapshot.clone());
        let pull = !self.snapshot_image.is_empty();
        let args = clone_args(cx.cfg, &self.spec, from, pull);
        self.boot(cx, CocoonCmd::VmClone(args))
    }

    /// The bring-up call (`vm clone` / `vm run`), once the VM's owner (the pod's namespace) is
    /// on record: a crash after it leaves the VM owned, never ownerless.
    pub(in crate::provider::core) fn boot(&self, cx: &Cx, cmd: CocoonCmd) -> CreateNext {
        let name = self.spec.vm_name.clone();
        if let Some(msg) = cx.vm_record_refusal(&name) {
            let (event, reason) = (
                isolation::EVENT_VM_NOT_IN_NS,
                isolation::REASON_VM_NOT_IN_NS,
            );
            return Next::Then(CreateThen::Refused(event, reason, msg));
        }
        let owner = Owner::new(&cx.key.namespace, &self.uid);
        let ask = Provider::owned_then(Owned::Vm, &name, owner, Deferred::Cocoon(cmd));
        Next::Ask(CreateStep::Boot, ask)
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
