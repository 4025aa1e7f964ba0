//! Startup reconcile: adopt VMs by ID and name, apply the orphan policy, and resume the work
//! each adopted pod still owes (stale `creating` records settle first, in `stale_creates`).

use super::hibernate::drops_nic;
use super::*;
use crate::provider::fixup;

impl Provider {
    // ----- startup reconcile ----------------------------------------------------------------

    pub(super) fn startup(&mut self, pods: Vec<Pod>, vms: Vec<VmInfo>) {
        let (stale, ready): (Vec<VmInfo>, Vec<VmInfo>) =
            vms.into_iter().partition(|v| v.state == VmState::Creating);
        self.startup = Some(Startup {
            pods,
            vms: ready,
            queue: stale,
            in_flight: 0,
            watched: Vec::new(),
        });
        self.pump_stale();
    }

    pub(super) fn orphan(&mut self, vm: VmInfo) {
        match self.cfg.orphan_policy {
            OrphanPolicy::Destroy => {
                log::warn!("provider: destroying orphan vm {} ({})", vm.name, vm.id);
                self.fire_and_forget_cocoon(CocoonCmd::VmRm { id: vm.id.clone() });
                self.forget_owner(Owned::Vm, &vm.name);
                self.release_leases(&vm);
            }
            OrphanPolicy::Alert => {
                self.metric(MetricUpdate::OrphanVm);
                log::warn!(
                    "provider: orphan vm name={} id={} state={} ip={}",
                    vm.name,
                    vm.id,
                    vm.state.as_str(),
                    vm.primary_ip()
                );
                if !vm.name.is_empty() {
                    self.by_name.insert(vm.name.clone(), vm);
                }
            }
            OrphanPolicy::Keep => {
                if !vm.name.is_empty() {
                    self.by_name.insert(vm.name.clone(), vm);
                }
            }
        }
    }

    pub(super) fn finish_startup(&mut self) {
        let Some(s) = self.startup.take() else {
            return;
        };
        // The ledger keeps the VMs that exist (or whose create may still land).
        let listed: std::collections::HashSet<String> = s
            .vms
            .iter()
            .chain(s.watched.iter())
            .map(|v| v.name.clone())
            .collect();
        self.trim_vm_owners(&listed);
        let by_id: BTreeMap<String, VmInfo> =
            s.vms.iter().map(|v| (v.id.clone(), v.clone())).collect();
        let by_name: BTreeMap<String, VmInfo> = s
            .vms
            .iter()
            .filter(|v| !v.name.is_empty())
            .map(|v| (v.name.clone(), v.clone()))
            .collect();
        // The oldest pod claims first: a VM shared by name goes back to the pod that had it,
        // not to whichever the list returns first; the others are refused at their create.
        let mut pods = s.pods;
        pods.sort_by(|a, b| {
            let at = |p: &Pod| p.metadata.creation_timestamp.as_ref().map(|t| t.0);
            at(a)
                .cmp(&at(b))
                .then_with(|| PodKey::of(a).cmp(&PodKey::of(b)))
        });
        self.adoption = Some(Box::new(Adoption {
            pods: pods.into(),
            vms: s.vms,
            watched: s.watched,
            by_id,
            by_name,
            claimed: Default::default(),
            taken: Default::default(),
            adopted: 0,
            kicks: None,
        }));
        self.adopt_chunk();
    }

    /// One chunk of the startup adoption: up to `ADOPT_CHUNK` pods matched to their VMs, or,
    /// once all are, kicked (owed work, then whatever each needs). Between the two, with every
    /// claim known, the unclaimed VMs get the orphan policy. The next chunk waits for the next
    /// tick; after the last one the buffered pod and VM events are handled.
    pub(super) fn adopt_chunk(&mut self) {
        let Some(mut a) = self.adoption.take() else {
            return;
        };
        let mut budget = ADOPT_CHUNK;
        while budget > 0 {
            if let Some(kicks) = a.kicks.as_mut() {
                let Some(key) = kicks.pop_front() else {
                    break;
                };
                self.owed_work(&key);
                self.kick(&key);
                budget -= 1;
                continue;
            }
            match a.pods.pop_front() {
                Some(pod) => {
                    self.adopt_pod(&mut a, pod);
                    budget -= 1;
                }
                None => {
                    self.sweep_orphans(&a);
                    a.kicks = Some(self.slots.keys().cloned().collect());
                }
            }
        }
        if a.kicks.as_ref().is_some_and(|k| k.is_empty()) {
            self.started = true;
            for input in std::mem::take(&mut self.buffered) {
                self.dispatch(input);
            }
            return;
        }
        self.adoption = Some(a);
        let at = self.now + ADOPT_PAUSE;
        self.arm(at, TimerEntry::Adopt);
    }

    /// Matches one listed pod to its VM (by ID, else by name) and adopts it.
    fn adopt_pod(&mut self, a: &mut Adoption, pod: Pod) {
        let pod = Arc::new(pod);
        let key = PodKey::of(&pod);
        self.slot(&key).latest = Some(pod.clone());
        if terminal(&pod) {
            return;
        }
        let spec = match spec::parse(&pod) {
            Ok(spec) => spec,
            Err(e) => return self.adopt_unreadable(a, &key, &pod, &e),
        };
        // Managed macOS guests are not cocoon's (never in its list): left untracked here,
        // their create adopts a running guest through `cocoon-macos vm inspect`.
        if super::macos::is_macos(&spec) {
            return;
        }
        if isolation::vm_name_refusal(&key, &spec.vm_name).is_some() {
            // Not this namespace's VM name: never tracked (its create refuses the pod). The VM
            // of that name is claimed all the same, so it is not destroyed as an orphan on
            // account of a pod that only named it: the next start with no pod naming it
            // applies the orphan policy.
            if let Some(vm) = a.by_name.get(&spec.vm_name) {
                a.claimed.insert(vm.id.clone());
            }
            return;
        }
        let vm = if !spec.vm_id.is_empty() {
            // Looked up by its exact ID (a map, never cocoon's prefix resolution).
            let known = a.by_id.get(&spec.vm_id);
            // An id is honoured only for the VM of the name the pod gives; the create
            // that follows refuses the pod.
            if known.is_some_and(|v| v.name != spec.vm_name) {
                return;
            }
            // A managed pod's id annotation can lag its VM: the write recording a re-created
            // VM's id may be lost with a crash (queued in the kube lane). The VM of the
            // name the pod gives is still its own; destroying it as an orphan would kill
            // a running VM and boot it again.
            match known {
                Some(v) => Some(v.clone()),
                None if spec.managed => {
                    let v = a.by_name.get(&spec.vm_name).cloned();
                    if v.is_some() {
                        self.metric(MetricUpdate::ReconcileAdoptByName);
                    }
                    v
                }
                None => None,
            }
        } else {
            let v = a.by_name.get(&spec.vm_name).cloned();
            if v.is_some() {
                self.metric(MetricUpdate::ReconcileAdoptByName);
            }
            v
        };
        let vm = match vm {
            Some(v) => v,
            // An unmanaged pod whose id names no listed VM exactly is left to its create,
            // whose lookup refuses or retries it.
            None if spec.managed && spec.hibernate => {
                self.track_hibernated(&key, &pod, spec);
                return;
            }
            None if vanished_while_down(&pod, &spec, &a.watched) => {
                self.track_vanished_at_startup(&key, &pod, spec);
                return;
            }
            None => return,
        };
        // A VM recorded for another namespace (or, unrecorded, one neither its name nor the
        // pod's exact id ties to the pod's) is not adopted: its create refuses the pod. It is
        // left alone all the same (claimed): no VM is destroyed on account of a pod that
        // only named it; the next start with no pod naming it applies the orphan policy. Nor
        // does that pod's claim keep the VM from the pod it is recorded for, listed later.
        if !self.vm_adoptable(&key, &spec.vm_id, &vm) {
            a.claimed.insert(vm.id.clone());
            return;
        }
        if !a.taken.insert(vm.id.clone()) {
            return;
        }
        a.claimed.insert(vm.id.clone());
        a.adopted += 1;
        self.startup_cpu_class_gate(&key, &pod, &spec);
        self.adopt_at_startup(&key, &pod, spec, vm);
    }

    /// A listed pod whose annotations no longer parse: its VM is claimed, and tracked only
    /// when the pod still names it or the ledger records it for this very pod.
    fn adopt_unreadable(&mut self, a: &mut Adoption, key: &PodKey, pod: &Arc<Pod>, e: &SpecError) {
        // Startup reconcile matches by ID: a pod whose annotations no longer parse
        // still names its VM, which is claimed (never destroyed as an orphan because of
        // input we could not read) and kept tracked as at runtime, with a Warning. It
        // is tracked only when it still gives that VM's name (one of its namespace's),
        // or the ledger records that VM for this very pod: an ID alone never hands a
        // pod a VM.
        let recorded_for_pod = |v: &VmInfo| {
            self.owner_of(Owned::Vm, &v.name).is_some_and(|o| {
                o.namespace == key.namespace && !o.pod_uid.is_empty() && o.pod_uid == pod_uid(pod)
            })
        };
        let found = unreadable_pods_vm(key, pod, &a.by_id, &a.by_name).or_else(|| {
            let ann = pod.metadata.annotations.as_ref()?;
            let v = a.by_id.get(ann.get(ANN_VM_ID)?)?;
            recorded_for_pod(v).then(|| v.clone())
        });
        let Some(vm) = found else {
            let named = pod
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANN_VM_ID));
            if let Some(v) = named.and_then(|id| a.by_id.get(id)) {
                a.claimed.insert(v.id.clone());
            }
            return;
        };
        if a.claimed.contains(&vm.id) {
            return;
        }
        a.claimed.insert(vm.id.clone());
        a.taken.insert(vm.id.clone());
        let id = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANN_VM_ID));
        if !self.vm_adoptable(key, id.map_or("", String::as_str), &vm) {
            // Claimed (never destroyed on input we could not read), not tracked.
            return;
        }
        a.adopted += 1;
        let uid = pod_uid(pod);
        self.event(
            key,
            &uid,
            EventType::Warning,
            "ProviderUpdateFailed",
            &e.message,
        );
        let spec = spec::salvage(pod, &vm.name, &vm.id);
        self.adopt_at_startup(key, pod, spec, vm);
    }

    /// Every listed pod has claimed its VM: the rest get the orphan policy, and the periodic
    /// reconcilers start.
    fn sweep_orphans(&mut self, a: &Adoption) {
        let mut orphans = 0usize;
        for vm in a.vms.iter() {
            if a.claimed.contains(&vm.id) {
                continue;
            }
            orphans += 1;
            self.orphan(vm.clone());
        }
        log::info!(
            "provider: startup reconcile: {} pods adopted, {orphans} orphan VMs",
            a.adopted
        );
        let first = self.now + DRIFT_FIRST;
        self.arm(first, TimerEntry::Drift);
        let lc = self.now + LIFECYCLE_EVERY;
        self.arm(lc, TimerEntry::Lifecycle);
        // The snapshot reclaimer's first run, right after the pods are known.
        self.arm(self.now, TimerEntry::Reclaim);
    }

    /// The snapshot CPU-class gate at startup, for a pod whose VM runs here. The contract makes
    /// a mismatch fatal to startup; that would take every VM of the node out of management
    /// (no status, probes, deletes) over one pod's selector, and a restart loop fixes nothing.
    /// The VM is kept and adopted as any other (never destroyed as an orphan), and the mismatch
    /// is reported loudly: error log, Warning `SnapshotCPUClassMismatch`, and
    /// `pod_lifecycle_total{startup,failed,snapshot_cpu_class_mismatch}`. The update gate then
    /// refuses every change of that pod (hibernate included) until the node class is fixed.
    /// A pod with no VM here is left to its create, whose gate refuses it.
    pub(super) fn startup_cpu_class_gate(&mut self, key: &PodKey, pod: &Pod, spec: &VmSpec) {
        let Err(msg) = self.cpu_class_gate(key, spec) else {
            return;
        };
        log::error!(
            "provider: startup reconcile: {msg}; its vm {} is kept",
            spec.vm_name
        );
        self.lifecycle_metric("startup", "failed", create::REASON_CPU_CLASS);
        let uid = pod_uid(pod);
        self.event(
            key,
            &uid,
            EventType::Warning,
            "SnapshotCPUClassMismatch",
            &format!("{msg}; the running vm {} is kept", spec.vm_name),
        );
    }

    pub(super) fn adopt_at_startup(
        &mut self,
        key: &PodKey,
        pod: &Arc<Pod>,
        spec: VmSpec,
        vm: VmInfo,
    ) {
        let uid = pod_uid(pod);
        let ann = pod.metadata.annotations.clone().unwrap_or_default();
        let ip = if !vm.primary_ip().is_empty() {
            vm.primary_ip()
        } else {
            spec.vm_ip.clone()
        };
        if spec.managed && (spec.vm_id != vm.id || spec.vm_ip != ip) {
            let mut a = BTreeMap::new();
            a.insert(ANN_VM_ID.to_string(), Some(vm.id.clone()));
            a.insert(ANN_VM_IP.to_string(), Some(ip.clone()));
            self.send_annotations(key, &uid, a, false);
        }
        // Recorded for this very pod before the adoption records it: a create of this daemon
        // made the VM (the record is durable before the clone).
        let ledger_create = self
            .owner_of(Owned::Vm, &vm.name)
            .is_some_and(|o| !o.pod_uid.is_empty() && o.pod_uid == uid);
        if spec.managed && !vm.name.is_empty() {
            self.by_name.insert(vm.name.clone(), vm.clone());
            self.own_adopted(key, &uid, &vm.name);
        }
        let start_time = pod
            .status
            .as_ref()
            .and_then(|s| s.start_time.clone())
            .or_else(|| Some(self.wall.clone()));
        let probe_port = spec.probe_port;
        let slot = self.slot(key);
        slot.intent = Intent::seed(&uid, &ann);
        slot.ledger_create = ledger_create;
        slot.tracked = Some(Tracked {
            uid: uid.clone(),
            pod: pod.clone(),
            spec,
            vm: Some(vm.clone()),
            ip: ip.clone(),
            start_time,
            probe: Some(initial_probe(&ip)),
        });
        if !deleting(pod) {
            self.out.push(Effect::StartProbe {
                key: key.clone(),
                uid,
                vm_id: vm.id.clone(),
                ip,
                mac: vm.primary_mac(),
                probe_port,
            });
            self.refresh_ip(key);
        }
    }

    /// A pod asking for hibernate whose VM is gone. Tracked without a VM, so waking it is an
    /// update. One whose record says a VM ran under it (`records_a_vm`) may be hibernated (the
    /// removal finished before a restart) or may have lost its VM mid-hibernate: its record
    /// stays untouched and its owed work looks the snapshot up (`confirm_hibernated`). One
    /// recording no VM has nothing to lose: stale ids are cleared and it is hibernated.
    fn track_hibernated(&mut self, key: &PodKey, pod: &Arc<Pod>, spec: VmSpec) {
        let uid = pod_uid(pod);
        let ann = pod.metadata.annotations.clone().unwrap_or_default();
        let intent = Intent::seed(&uid, &ann);
        let spec = if confirm_hibernated::records_a_vm(&spec, intent.as_ref()) {
            spec
        } else {
            if !spec.vm_id.is_empty() || !spec.vm_ip.is_empty() {
                let mut a = BTreeMap::new();
                for k in [ANN_VM_ID, ANN_VM_IP, spec::ANN_POST_CLONE_STATE] {
                    a.insert(k.to_string(), None);
                }
                self.send_annotations(key, &uid, a, false);
            }
            VmSpec {
                vm_id: String::new(),
                vm_ip: String::new(),
                ..spec
            }
        };
        let start_time = pod.status.as_ref().and_then(|s| s.start_time.clone());
        let slot = self.slot(key);
        slot.intent = intent;
        slot.tracked = Some(Tracked {
            uid,
            pod: pod.clone(),
            spec,
            vm: None,
            ip: String::new(),
            start_time,
            probe: None,
        });
    }

    /// A pod that ran on a VM no longer there: its VM-gone event went to the previous process
    /// (or came while none ran). It is tracked on the VM it records, so the owed work checks
    /// that VM as the event would have: inspect, and evict `VMGone` when it is not found. The
    /// Go daemon leaves such a pod untracked for a fresh CreatePod, whose failure writes
    /// Pending over the Running the cluster saw; a VM that vanishes at runtime is evicted,
    /// and one that vanished across a restart is no different.
    pub(super) fn track_vanished_at_startup(&mut self, key: &PodKey, pod: &Arc<Pod>, spec: VmSpec) {
        let uid = pod_uid(pod);
        let ann = pod.metadata.annotations.clone().unwrap_or_default();
        // The check inspects `id`; cocoon takes a name there too.
        let vm = VmInfo {
            id: recorded_reference(&spec),
            name: spec.vm_name.clone(),
            state: VmState::default(),
            ..Default::default()
        };
        let start_time = pod.status.as_ref().and_then(|s| s.start_time.clone());
        let ip = spec.vm_ip.clone();
        let slot = self.slot(key);
        slot.intent = Intent::seed(&uid, &ann);
        slot.tracked = Some(Tracked {
            uid,
            pod: pod.clone(),
            spec,
            vm: Some(vm),
            ip,
            start_time,
            probe: Some((false, "vm gone".into())),
        });
    }

    /// Owed work after a restart, in-scope ops: `creating` pods with a VM resume their
    /// post-clone fix-up or the IP wait, by their post-clone-state; `ready` pods get their
    /// status pushed.
    pub(super) fn owed_work(&mut self, key: &PodKey) {
        let Some(slot) = self.slots.get(key) else {
            return;
        };
        let (Some(t), Some(pod)) = (slot.tracked.clone(), slot.latest.clone()) else {
            return;
        };
        if deleting(&pod) {
            return;
        }
        if t.vm.is_none() {
            let intent = slot.intent.as_ref().filter(|i| i.uid == t.uid);
            if t.spec.managed
                && t.spec.hibernate
                && confirm_hibernated::records_a_vm(&t.spec, intent)
            {
                self.start_confirm_hibernated(key);
            }
            return;
        }
        let vm = t.vm.clone().unwrap_or_default();
        if t.spec.hibernate && t.spec.managed && t.spec.os != Os::Macos {
            // The hibernate the pod asks for (interrupted or never begun) resumes from the
            // start: a save that landed is replaced, a tag pushed is overwritten only by its
            // replacement, and a stopped VM is started first (a save needs it running).
            self.metric(MetricUpdate::StartupResume { op: "hibernate" });
            self.event(
                key,
                &t.uid,
                EventType::Normal,
                "ResumedAfterRestart",
                "op=hibernate",
            );
            return self.start_hibernate(key, !vm.running());
        }
        if t.spec.managed && !vm.running() {
            // Adopted a VM that is not running (its crash event went to the previous process):
            // handle it as a VM-gone event would (restart, or evict when it is gone).
            return self.start_check(key, t.uid.clone(), vm.id, CheckStep::Inspect { attempt: 1 });
        }
        let ann = pod.metadata.annotations.clone().unwrap_or_default();
        let recorded = ann
            .get(spec::ANN_LIFECYCLE_STATE)
            .map(String::as_str)
            .unwrap_or("");
        // An unknown text is a record too, just not one this build acts on.
        let unrecorded = recorded.is_empty();
        let state = State::parse(recorded);
        let pcs = ann.get(spec::ANN_POST_CLONE_STATE).cloned();
        // Adopted by name (the pod had no VM id): a create made this VM but the daemon stopped
        // before recording it, so a `failed` on the pod is an earlier attempt's and stale.
        let stale_failure =
            t.spec.vm_id.is_empty() && state == Some(State::Failed) && pcs.is_none();
        if stale_failure && t.spec.managed {
            self.set_lifecycle(key, State::Creating, "");
        }
        // No record but the ledger's: a create made the VM and stopped before its `ready`
        // (a fresh pod's `creating` is never written, see `begin_creating`).
        let ledger_create = std::mem::take(&mut self.slot(key).ledger_create);
        let creating = state == Some(State::Creating)
            || (unrecorded && (pcs.is_some() || ledger_create))
            || stale_failure;
        if !creating || !t.spec.managed {
            if unrecorded && t.spec.managed {
                // Adopted without any lifecycle record: publish Ready as an adoption does.
                return self.publish_ready(key);
            }
            return self.push_status(key, false);
        }
        if pcs.as_deref() == Some("failed") {
            return self.push_status(key, false);
        }
        let cloned = !(t.spec.mode == Mode::Run && t.spec.clone_from_dir.is_none());
        // `running`: the fix-up was cut short, run it again; `done`: only the IP wait is owed;
        // no marker: whatever the clone needs. A CH Windows VM with no marker may have been
        // woken from a hibernation that dropped its NIC, which must not be cycled by a fix-up:
        // the registry's hibernate evidence tells (without a registry there is none to ask,
        // and the clone's needs decide).
        let op = match pcs.as_deref() {
            Some("running") => "post_clone",
            Some("done") => "ready_wait",
            None if drops_nic(&t.spec) && self.cfg.registry => "classify_drop_nic",
            _ if cloned && fixup::classify(t.spec.os, &vm).is_some() => "post_clone",
            _ => "ready_wait",
        };
        log::warn!("provider: {key}: resuming {op} after restart");
        self.metric(MetricUpdate::StartupResume { op });
        self.event(
            key,
            &t.uid,
            EventType::Normal,
            "ResumedAfterRestart",
            &format!("op={op}"),
        );
        if op == "classify_drop_nic" {
            return self.start_classify(key, t.uid.clone(), vm.id.clone(), cloned);
        }
        if op == "post_clone" {
            return self.post_clone_or_ready_wait(key, &vm, false, PostCloneMode::Clone);
        }
        // `ready_wait` re-runs the SAC pass of a Windows guest with a static NIC first: a
        // restart may have cut it short after the NIC reset was recorded done.
        self.sac_then_ready_wait(key, &vm, PostCloneMode::Clone);
    }
}

/// The VM an unparseable pod names: a VM of the name it gives (one of its namespace's), found
/// by its ID annotation (exactly) or by that name.
fn unreadable_pods_vm(
    key: &PodKey,
    pod: &Pod,
    by_id: &BTreeMap<String, VmInfo>,
    by_name: &BTreeMap<String, VmInfo>,
) -> Option<VmInfo> {
    let ann = pod.metadata.annotations.as_ref()?;
    let name = ann.get(spec::ANN_VM_NAME)?;
    if isolation::vm_name_refusal(key, name).is_some() {
        return None;
    }
    ann.get(ANN_VM_ID)
        .and_then(|id| by_id.get(id))
        .filter(|v| v.name == *name)
        .or_else(|| by_name.get(name))
        .cloned()
}

/// A managed pod the cluster saw Running (only a pod with a VM is written Running) whose VM
/// is gone: neither its ID nor its name is listed, nor held by a stale create still settling.
fn vanished_while_down(pod: &Pod, spec: &VmSpec, watched: &[VmInfo]) -> bool {
    let ran = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
    ran && spec.managed
        && !spec.hibernate
        && !deleting(pod)
        && super::delete::lookup_reference_ok(&recorded_reference(spec))
        && !watched.iter().any(|v| {
            (!spec.vm_id.is_empty() && v.id == spec.vm_id)
                || (!v.name.is_empty() && v.name == spec.vm_name)
        })
}

/// How a pod names its VM to `vm inspect`: its ID annotation, else its VM name (the write
/// recording the ID can be lost with a crash). It reaches cocoon's argv, so it must read as
/// a plain reference.
fn recorded_reference(spec: &VmSpec) -> String {
    if spec.vm_id.is_empty() {
        spec.vm_name.clone()
    } else {
        spec.vm_id.clone()
    }
}
