//! Create: spec checks, hibernate evidence, snapshot / image inspection and pulls, up to the
//! clone or run. The bring-up after the VM exists is in `bring_up`.
//!
//! This file starts a create and routes its answers and timer (`create_step`) to the
//! function of the phase: `lookup` (a VM already there, adopted; the hibernate evidence),
//! `source` (the image's snapshot or the image a fresh bring-up starts from), `boot` (the
//! clone or run call and its answer) and `failures` (a create refused or failed).

use super::*;
use crate::vm::PidFile;

mod boot;
mod failures;
mod lookup;
mod source;

pub(super) use boot::clone_args;

/// Metric reason of a create refused because another live pod holds the VM.
const REASON_VM_OWNED: &str = "vm_owned_by_another_pod";
/// Metric reason of a pod refused by the snapshot CPU-class gate (create, update, startup).
pub(super) const REASON_CPU_CLASS: &str = "snapshot_cpu_class_mismatch";

impl Provider {
    // ----- create ---------------------------------------------------------------------------

    pub(super) fn start_create(&mut self, key: &PodKey, pod: Arc<Pod>) {
        let uid = pod_uid(&pod);
        let spec = match spec::parse(&pod) {
            Ok(s) => s,
            Err(e) => return self.reject(key, &pod, e),
        };
        if let Some(message) = isolation::vm_name_refusal(key, &spec.vm_name) {
            return self.refuse_vm_name(key, &pod, message);
        }
        if let Err(message) = self.cpu_class_gate(key, &spec) {
            let e = SpecError {
                reason: REASON_CPU_CLASS,
                message,
            };
            return self.reject(key, &pod, e);
        }
        // A macOS guest's name and image go on cocoon-macos's command line: checked first.
        if let Some(msg) = macos::is_macos(&spec)
            .then(|| self.macos_input_error(&spec))
            .flatten()
        {
            let e = SpecError {
                reason: "invalid_macos_spec",
                message: format!("pod {key}: {msg}"),
            };
            return self.reject(key, &pod, e);
        }
        if let Some(msg) = self.vm_claimed_elsewhere(key, &uid, &spec) {
            let e = SpecError {
                reason: REASON_VM_OWNED,
                message: format!("pod {key}: {msg}"),
            };
            return self.reject(key, &pod, e);
        }
        if let Some(message) = self.unheld_vm_refusal(key, &spec) {
            return self.refuse_vm_name(key, &pod, message);
        }
        self.warn_fallbacks(key, &uid, &spec);
        let start_time = pod
            .status
            .as_ref()
            .and_then(|s| s.start_time.clone())
            .unwrap_or_else(|| self.wall.clone());
        let failures = {
            let slot = self.slot(key);
            slot.idle.clear_rejection();
            slot.tracked = Some(Tracked {
                uid: uid.clone(),
                pod: pod.clone(),
                spec: spec.clone(),
                vm: None,
                ip: String::new(),
                start_time: Some(start_time),
                probe: None,
            });
            slot.failures
        };
        self.begin_creating(key);
        self.hold_statuses(key, &uid);
        if macos::is_macos(&spec) {
            return self.macos_create(key, uid, spec);
        }
        // Adopt an existing VM of this name.
        if let Some(vm) = self.by_name.get(&spec.vm_name).cloned() {
            let op = CreateOp::new(uid, spec, CreateStep::Boot, self.now);
            self.set_op(key, op);
            self.lifecycle_metric("create", "ok", "adopted");
            return self.vm_up(key, vm, true);
        }
        if !spec.managed {
            return self.start_unmanaged_create(key, uid, spec);
        }
        let first = if failures > 0 {
            CreateStep::InspectByName
        } else {
            CreateStep::Evidence
        };
        let mut op = CreateOp::new(uid, spec.clone(), first, self.now);
        op.local_snapshot = spec::local_snapshot_name(&spec.image);
        let first = op.step.clone();
        self.set_op(key, op);
        match first {
            // A retry after a failure: a previous attempt may have left a VM (hung clone).
            CreateStep::InspectByName => self.advance(
                key,
                CreateStep::InspectByName,
                Ask::Cocoon(CocoonCmd::VmInspect {
                    reference: spec.vm_name.clone(),
                }),
            ),
            _ => self.check_evidence(key, &spec.vm_name),
        }
    }

    /// An unmanaged pod (`managed: false`): its VM exists already, named by the pod's
    /// pre-assigned id; it is only looked up and adopted.
    fn start_unmanaged_create(&mut self, key: &PodKey, uid: String, spec: VmSpec) {
        if spec.vm_id.is_empty() || spec.vm_ip.is_empty() {
            let msg = format!(
                "unmanaged vm {} missing pre-assigned IP/VMID {}",
                spec.vm_name,
                spec::CONTRACT_HINT
            );
            self.slot(key).finish_op();
            return self.fail_create(key, &uid, &msg, false);
        }
        let op = CreateOp::new(uid, spec.clone(), CreateStep::UnmanagedInspect, self.now);
        self.set_op(key, op);
        if let Some(t) = self.slot(key).tracked.as_mut() {
            t.ip = spec.vm_ip.clone();
        }
        if !super::delete::lookup_reference_ok(&spec.vm_id) {
            let msg = format!("pod {key}: {ANN_VM_ID} {:?} is not a VM ID", spec.vm_id);
            let (event, reason) = (
                isolation::EVENT_VM_REFERENCE,
                isolation::REASON_VM_REFERENCE,
            );
            return self.refuse_create(key, event, reason, msg);
        }
        // The id must name exactly one VM by its exact ID, of the pod's VM name.
        let ask = Ask::Cocoon(CocoonCmd::VmInspect {
            reference: spec.vm_id.clone(),
        });
        self.advance(key, CreateStep::UnmanagedInspect, ask)
    }

    /// The poll timer of a pod waiting for another pod's pull: look at the snapshot again.
    pub(super) fn create_timer(&mut self, key: &PodKey, c: CreateOp) {
        if !matches!(c.step, CreateStep::PullWait) {
            return;
        }
        let name = c.local_snapshot.clone();
        self.advance(
            key,
            CreateStep::SnapInspect { pulled: false },
            Ask::SharedRead(CocoonCmd::SnapshotInspect { name }),
        )
    }

    /// An answer to the running create `c` (the op as it stands in the slot).
    pub(super) fn create_step(&mut self, key: &PodKey, c: CreateOp, res: Res) {
        let spec = &c.spec;
        let superseded = self.slots.get(key).is_some_and(|s| {
            s.latest
                .as_ref()
                .is_none_or(|p| pod_uid(p) == c.uid && deleting(p))
        });
        if superseded {
            // The pod is being deleted (or gone): building its VM further only makes more to
            // undo. The delete that follows looks the VM up by name, so whatever this create
            // made (even the VM this very answer reports) is removed before the object goes.
            log::info!("provider: {key}: create stopped, the pod is being deleted");
            return self.end_op(key);
        }
        if macos::is_macos(spec) {
            return self.macos_create_step(key, c.clone(), res);
        }
        match (c.step.clone(), res) {
            (CreateStep::InspectByName, Res::Cocoon(r)) => {
                self.create_inspected_by_name(key, &c, r)
            }
            (CreateStep::UnmanagedInspect, Res::Cocoon(r)) => self.unmanaged_found(key, &c, r),
            (CreateStep::RmStaleByName, Res::Cocoon(r)) => {
                if !r.succeeded() && !r.vm_not_found() {
                    let msg = format!("remove leftover vm {}: {}", spec.vm_name, r.error_text());
                    return self.fail_create(key, &c.uid, &msg, true);
                }
                self.forget_owner(Owned::Vm, &spec.vm_name);
                self.check_evidence(key, &spec.vm_name)
            }
            (CreateStep::Evidence, Res::Evidence(found)) => self.evidence_verdict(key, &c, found),
            (CreateStep::Evidence, Res::Cocoon(r)) => self.local_evidence(key, &c, r),
            (CreateStep::RmFork, Res::Cocoon(r)) => {
                // Failure only logged, as the create contract says.
                let name = spec::fork_snapshot_name(&spec.vm_name);
                if !r.succeeded() && !r.snapshot_not_found() {
                    log::warn!("provider: {key}: remove {name}: {}", r.error_text());
                }
                self.snapshot_removed(&name, &r);
                self.fresh_bring_up(key, &c)
            }
            (CreateStep::SnapInspect { pulled }, Res::Cocoon(r)) => {
                self.image_snapshot_inspected(key, &c, pulled, r)
            }
            (CreateStep::ForkWait { .. }, Res::Fork(r)) => self.fork_landed(key, &c, r),
            (CreateStep::ImageTag, Res::Evidence(r)) => self.image_tag_read(key, &c, r),
            (CreateStep::SourceCheck { rule }, Res::Source(v)) => {
                self.source_checked(key, &c, rule, v)
            }
            (CreateStep::PullSnapshot, Res::Transfer(r)) => self.snapshot_pulled(key, &c, r),
            (CreateStep::ImageInspect, Res::Cocoon(r)) => {
                if r.succeeded() {
                    return self.do_clone(key);
                }
                let ask = self.materialise(&c.snapshot_image, false);
                self.advance(key, CreateStep::MaterialiseBase, ask)
            }
            (CreateStep::MaterialiseBase, res) => match res.transfer_or_cocoon() {
                Ok(_) => self.do_clone(key),
                Err(e) => {
                    let msg = format!("make base image {} available: {e}", c.snapshot_image);
                    self.fail_create(key, &c.uid, &msg, true)
                }
            },
            (CreateStep::MaterialiseRun, res) => self.run_image_ready(key, &c, res),
            (CreateStep::Boot, Res::Cocoon(r)) => self.booted(key, &c, r),
            (CreateStep::PidFile, Res::VmPid(pid)) => {
                let mut vm = c.vm.clone().unwrap_or_default();
                match pid {
                    PidFile::Live(pid) => {
                        vm.pid = pid;
                        self.by_name.insert(spec.vm_name.clone(), vm.clone());
                        self.vm_up(key, vm, false)
                    }
                    // cocoon's own `pid` comes from this very file: with the VM's run
                    // directory where we look and no file in it, an inspect would answer
                    // pid 0 too. The VM is up as the bring-up's answer says.
                    PidFile::NoFile => self.vm_up(key, vm, false),
                    // A PID that is not alive (the hypervisor may have died), or a run
                    // directory elsewhere (another cocoon layout): cocoon answers, once.
                    PidFile::Dead | PidFile::NoRunDir => self.run_inspect(key, vm),
                }
            }
            (CreateStep::BootFailedInspect { error }, Res::Cocoon(r)) => {
                self.boot_failed_inspected(key, &c, error, r)
            }
            (CreateStep::BootFailedRm { error }, Res::Cocoon(r)) => {
                if !r.succeeded() && !r.vm_not_found() {
                    log::warn!(
                        "provider: {key}: remove leftover of failed bring-up: {}",
                        r.error_text()
                    );
                } else {
                    self.forget_owner(Owned::Vm, &spec.vm_name);
                }
                self.fail_create(key, &c.uid, &error, true)
            }
            (CreateStep::RunInspect, Res::Cocoon(r)) => {
                let vm = match (r.succeeded(), r.vm()) {
                    (true, Ok(v)) => v,
                    _ => c.vm.clone().unwrap_or_default(),
                };
                self.vm_up(key, vm, false)
            }
            (CreateStep::Lease, Res::Lease(r)) => {
                let ip = match r {
                    Ok(Some(ip)) => ip,
                    _ => String::new(),
                };
                let vm = c.vm.clone().unwrap_or_default();
                let cloned = !spec.fresh_boot();
                self.finish_create(key, vm, cloned, &ip)
            }
            (step, res) => self.unexpected_answer(key, &step, &res),
        }
    }
}
