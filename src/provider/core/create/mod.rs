//! Create: spec checks, hibernate evidence, snapshot / image inspection and pulls, up to the
//! clone or run. The bring-up after the VM exists is in `bring_up`.
//!
//! This file starts a create (on the provider: its gates read every pod's state) and steps it
//! as a machine: `CreateOp::on_answer` and `on_timer` read only `Cx` and hand the phase's
//! function a step of its own, `lookup` (a VM already there, adopted; the hibernate
//! evidence), `source` (the image's snapshot or the image a fresh bring-up starts from; with
//! `fork` and `source_check`) and `boot` (the clone or run call and its answer). What needs
//! the provider comes back as a `CreateThen` carried out by `create_next`: the restore, the
//! fork flight, a pull shared across pods, the VM up, the ending (`failures`). A macOS guest's
//! steps are `CreateOp::on_macos_answer` in `macos`, carried out by `macos_create_next`.

use super::machine::Chore;
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
            _ => {
                let ask = evidence_ask(self.cfg.registry, &spec.vm_name);
                self.advance(key, CreateStep::Evidence, ask)
            }
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

    /// The poll timer of a pod waiting for another pod's pull.
    pub(super) fn create_timer(&mut self, key: &PodKey, c: CreateOp) {
        let next = c.on_timer();
        self.create_next(key, c, next)
    }

    /// An answer to the running create `c` (the op as it stands in the slot): its machine's,
    /// the macOS guest's steps for a macOS guest (`macos`).
    pub(super) fn create_step(&mut self, key: &PodKey, mut c: CreateOp, res: Res) {
        if c.superseded(&self.cx(key)) {
            // The pod is being deleted (or gone): building its VM further only makes more to
            // undo. The delete that follows looks the VM up by name, so whatever this create
            // made (even the VM this very answer reports) is removed before the object goes.
            log::info!("provider: {key}: create stopped, the pod is being deleted");
            return self.end_op(key);
        }
        if macos::is_macos(&c.spec) {
            let next = c.on_macos_answer(&mut self.cx(key), res);
            return self.macos_create_next(key, c, next);
        }
        let next = c.on_answer(&mut self.cx(key), res);
        self.create_next(key, c, next)
    }

    /// Carries out what a step of the create `c` decided.
    fn create_next(&mut self, key: &PodKey, c: CreateOp, next: CreateNext) {
        let Some((c, then)) = self.apply(key, c, next) else {
            return;
        };
        if let CreateThen::Chore(chores, next) = then {
            chores.into_iter().for_each(|ch| self.chore(ch));
            return self.create_next(key, c, *next);
        }
        // The follow-ups below read the create as the step left it.
        self.set_op(key, c.clone());
        match then {
            // Carried out above.
            CreateThen::Chore(..) => {}
            CreateThen::Restore { mark } => {
                if let Some(t) = self.slot(key).tracked.as_mut().filter(|_| mark) {
                    t.spec.restore_from_hibernate = true;
                }
                self.start_wake(key, true)
            }
            CreateThen::Fork(source) => self.fork_begin(key, &source),
            CreateThen::Pull => self.create_pull(key, &c),
            CreateThen::Up(vm, adopted) => self.vm_up(key, vm, adopted),
            CreateThen::Finished { vm, cloned, ip } => self.finish_create(key, vm, cloned, &ip),
            CreateThen::Refused(event, reason, msg) => self.refuse_create(key, event, reason, msg),
            CreateThen::Failed(msg, how) => self.fail_create_with(key, &c.uid, &msg, how),
        }
    }
}

/// The ask of the hibernate evidence: with a registry the tag `<vm>:hibernate`; without one,
/// a local snapshot named after the VM.
fn evidence_ask(registry: bool, vm_name: &str) -> Ask {
    let vm_name = vm_name.to_string();
    if registry {
        Ask::effect(|op| Effect::CheckHibernateEvidence { op, vm_name })
    } else {
        Ask::Cocoon(CocoonCmd::SnapshotInspect { name: vm_name })
    }
}

/// What a create's step leaves to the provider: the chores its answers call for, its
/// hand-overs (the restore, the fresh bring-up, the VM up) and its endings.
pub(super) enum CreateThen {
    /// Chores, then what follows.
    Chore(Vec<Chore>, Box<CreateNext>),
    /// Restore the VM from its hibernate snapshot (`mark`: the pod's record says so first).
    Restore { mark: bool },
    /// `fork-from`: the node's fork-snapshot flight of this source VM (`fork`).
    Fork(String),
    /// The image's snapshot is missing: pulled, once no other pod pulls it (`source`).
    Pull,
    /// The VM is up (`true`: adopted, not booted by this create).
    Up(VmInfo, bool),
    /// The create is done: the VM (cloned or not) and the IP known so far.
    Finished {
        vm: VmInfo,
        cloned: bool,
        ip: String,
    },
    /// Refused for good: Warning event, metric reason, message.
    Refused(&'static str, &'static str, String),
    /// Failed with this message, as `CreateFailure` says.
    Failed(String, CreateFailure),
}

pub(super) type CreateNext = Next<CreateStep, CreateThen>;

impl CreateStep {
    /// The steps of the source phase (`source`, `fork`, `source_check`).
    fn source_phase(&self) -> bool {
        matches!(
            self,
            CreateStep::SnapInspect { .. }
                | CreateStep::ImageTag
                | CreateStep::PullSnapshot
                | CreateStep::PullWait
                | CreateStep::ForkWait { .. }
                | CreateStep::SourceCheck { .. }
                | CreateStep::ImageInspect
                | CreateStep::MaterialiseBase
                | CreateStep::MaterialiseRun
        )
    }
}

impl CreateOp {
    /// Whether the pod of this create is being deleted (or gone from the API).
    pub(super) fn superseded(&self, cx: &Cx) -> bool {
        cx.latest
            .is_none_or(|p| pod_uid(p) == self.uid && deleting(p))
    }

    /// A failed bring-up (`CreateBringUpFailed`), retried or not.
    pub(super) fn failed(msg: String, retry: bool) -> CreateNext {
        Self::failed_as("CreateBringUpFailed", msg, retry)
    }

    /// A failed create with Warning `reason`, retried or not.
    pub(super) fn failed_as(reason: &'static str, msg: String, retry: bool) -> CreateNext {
        let how = CreateFailure {
            reason,
            metric_reason: "",
            retry,
            terminal: false,
        };
        Next::Then(CreateThen::Failed(msg, how))
    }

    pub(super) fn chore_then(chores: Vec<Chore>, next: CreateNext) -> CreateNext {
        Next::Then(CreateThen::Chore(chores, Box::new(next)))
    }

    /// An answer to this create in its lookup or boot phase.
    fn on_answer(&mut self, cx: &mut Cx, res: Res) -> CreateNext {
        if self.step.source_phase() {
            return self.on_source_answer(cx, res);
        }
        let key = cx.key;
        let vm_name = self.spec.vm_name.clone();
        match (self.step.clone(), res) {
            (CreateStep::InspectByName, Res::Cocoon(r)) => self.inspected_by_name(cx, r),
            (CreateStep::UnmanagedInspect, Res::Cocoon(r)) => self.unmanaged_found(cx, r),
            (CreateStep::RmStaleByName, Res::Cocoon(r)) => {
                if !r.succeeded() && !r.vm_not_found() {
                    let msg = format!("remove leftover vm {vm_name}: {}", r.error_text());
                    return Self::failed(msg, true);
                }
                let ask = evidence_ask(cx.cfg.registry, &vm_name);
                let chores = vec![Chore::ForgetOwner(Owned::Vm, vm_name)];
                Self::chore_then(chores, Next::Ask(CreateStep::Evidence, ask))
            }
            (CreateStep::Evidence, Res::Evidence(found)) => self.evidence_verdict(cx, found),
            (CreateStep::Evidence, Res::Cocoon(r)) => self.local_evidence(cx, r),
            (CreateStep::RmFork, Res::Cocoon(r)) => {
                // Failure only logged, as the create contract says.
                let name = spec::fork_snapshot_name(&vm_name);
                if !r.succeeded() && !r.snapshot_not_found() {
                    log::warn!("provider: {key}: remove {name}: {}", r.error_text());
                }
                let chores = vec![Chore::SnapshotRemoved(name, r)];
                Self::chore_then(chores, self.fresh_bring_up(cx))
            }
            (CreateStep::Boot, Res::Cocoon(r)) => self.booted(cx, r),
            (CreateStep::PidFile, Res::VmPid(pid)) => {
                let mut vm = self.vm.clone().unwrap_or_default();
                match pid {
                    PidFile::Live(pid) => {
                        vm.pid = pid;
                        let chores = vec![Chore::VmNamed(vm_name, vm.clone())];
                        Self::chore_then(chores, Next::Then(CreateThen::Up(vm, false)))
                    }
                    // cocoon's own `pid` comes from this very file: with the VM's run
                    // directory where we look and no file in it, an inspect would answer
                    // pid 0 too. The VM is up as the bring-up's answer says.
                    PidFile::NoFile => Next::Then(CreateThen::Up(vm, false)),
                    // A PID that is not alive (the hypervisor may have died), or a run
                    // directory elsewhere (another cocoon layout): cocoon answers, once.
                    PidFile::Dead | PidFile::NoRunDir => self.run_inspect(vm),
                }
            }
            (CreateStep::BootFailedInspect { error }, Res::Cocoon(r)) => {
                self.boot_failed_inspected(error, r)
            }
            (CreateStep::BootFailedRm { error }, Res::Cocoon(r)) => {
                if !r.succeeded() && !r.vm_not_found() {
                    let e = r.error_text();
                    log::warn!("provider: {key}: remove leftover of failed bring-up: {e}");
                    return Self::failed(error, true);
                }
                let chores = vec![Chore::ForgetOwner(Owned::Vm, vm_name)];
                Self::chore_then(chores, Self::failed(error, true))
            }
            (CreateStep::RunInspect, Res::Cocoon(r)) => {
                let vm = match (r.succeeded(), r.vm()) {
                    (true, Ok(v)) => v,
                    _ => self.vm.clone().unwrap_or_default(),
                };
                Next::Then(CreateThen::Up(vm, false))
            }
            (CreateStep::Lease, Res::Lease(r)) => {
                let ip = match r {
                    Ok(Some(ip)) => ip,
                    _ => String::new(),
                };
                let vm = self.vm.clone().unwrap_or_default();
                let cloned = !self.spec.fresh_boot();
                Next::Then(CreateThen::Finished { vm, cloned, ip })
            }
            (step, res) => Next::Unexpected(step, res),
        }
    }
}
