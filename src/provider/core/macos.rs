//! Managed macOS guests: the `cocoon-macos` steps of the create and delete ops, the node-unique
//! VNC port reservation, Ready from the probe, and the watch that restarts a dead QEMU.
//!
//! Why branches of the create / delete ops and not an op of their own: a macOS pod goes through
//! the same per-pod lifecycle (tracking, lifecycle triple, failure and backoff, delete fence,
//! preemption by a delete) as any other; only the commands differ. A second state machine would
//! duplicate all of that and drift from it. So `start_create` hands a managed macOS pod to
//! [`Provider::macos_create`], whose steps (`CreateStep::Macos*`, a machine:
//! `CreateOp::on_macos_answer`, carried out by `macos_create_next`) end in the shared
//! `fail_create` or in [`Provider::macos_up`]; the delete op takes one `MacosRm` step instead of
//! its snapshot steps. Adopting a running guest after a restart is the create's first step
//! (`vm inspect` + liveness): macOS VMs are never in `cocoon vm list`, so the startup reconcile
//! leaves their pods untracked and the create that follows adopts them before any VNC port is
//! handed to a new guest of the same pod.

use super::delete::Deleting;
use super::*;
use crate::guest::macos::{self as contract, MacosCmd, MacosRun, MacosVm};
use crate::vm::NicInfo;

/// Annotation of the VNC port of a managed macOS guest.
pub(super) const ANN_VNC_PORT: &str = "vm.cocoonstack.io/vnc-port";
/// The watch's period, which is also the shortest time between two restarts of one QEMU and
/// between two MAC backfills.
pub(super) const MACOS_WATCH_EVERY: Duration = Duration::from_secs(10);

fn macos(cmd: MacosCmd) -> Ask {
    Ask::Cocoon(CocoonCmd::Macos(cmd))
}

/// A call pods asking the same share (one process, one answer to all): the image inspect and
/// pull, de-duplicated per image as the contract wants.
fn shared(cmd: MacosCmd) -> Ask {
    Ask::SharedRead(CocoonCmd::Macos(cmd))
}

/// The VM record of a macOS guest from `cocoon-macos vm inspect`.
fn vm_info(vm: &MacosVm) -> VmInfo {
    VmInfo {
        id: contract::vm_id(&vm.name),
        name: vm.name.clone(),
        hypervisor: contract::HYPERVISOR.into(),
        state: VmState::Running,
        pid: vm.pid,
        nics: if vm.mac.is_empty() {
            Vec::new()
        } else {
            vec![NicInfo {
                tap: vm.tap.clone(),
                mac: vm.mac.clone(),
                ..Default::default()
            }]
        },
        disk: vm.disk.clone(),
        ..Default::default()
    }
}

/// Whether the spec is a managed macOS guest.
pub(super) fn is_macos(spec: &VmSpec) -> bool {
    spec.managed && spec.os == Os::Macos
}

impl Provider {
    /// Input checks of a macOS pod before anything is tracked: the image is required and both
    /// it and the VM name go on `cocoon-macos`'s command line.
    pub(super) fn macos_input_error(&self, spec: &VmSpec) -> Option<String> {
        if spec.image.trim().is_empty() {
            return Some(format!(
                "macOS guest {} needs an image ({})",
                spec.vm_name,
                spec::ANN_IMAGE
            ));
        }
        if !contract::argument_ok(&spec.vm_name) {
            return Some(format!(
                "macOS guest name {:?} is not a plain name ({})",
                spec.vm_name,
                spec::ANN_VM_NAME
            ));
        }
        if !contract::argument_ok(&spec.image) {
            return Some(format!(
                "macOS guest image {:?} is not a plain image reference ({})",
                spec.image,
                spec::ANN_IMAGE
            ));
        }
        None
    }

    /// The create of a tracked macOS pod: look for its VM first (adoption).
    pub(super) fn macos_create(&mut self, key: &PodKey, uid: String, spec: VmSpec) {
        let name = spec.vm_name.clone();
        self.set_op(
            key,
            CreateOp::new(uid, spec, CreateStep::MacosInspect, self.now),
        );
        self.advance(
            key,
            CreateStep::MacosInspect,
            macos(MacosCmd::Inspect { name }),
        );
    }

    /// The VNC port this pod holds, reserving one when it holds none: the port of its
    /// annotation (a restart or re-create keeps its port), else `hint`, else the lowest free.
    /// `Ok(None)` without a password (no VNC at all); `Err` when all 100 ports are taken.
    fn reserve_vnc(&mut self, key: &PodKey, hint: Option<u16>) -> Result<Option<u16>, String> {
        if !self.cfg.macos_vnc {
            return Ok(None);
        }
        if let Some((&port, _)) = self.vnc_ports.iter().find(|(_, k)| *k == key) {
            return Ok(Some(port));
        }
        // A pod gone from the API without a delete of ours (its create failed, then it was
        // removed) holds its port no longer.
        let slots = &self.slots;
        self.vnc_ports.retain(|_, k| {
            slots
                .get(k)
                .is_some_and(|s| s.latest.is_some() || s.tracked.is_some())
        });
        let annotated = self
            .slots
            .get(key)
            .and_then(|s| s.tracked.as_ref())
            .and_then(|t| t.pod.metadata.annotations.as_ref())
            .and_then(|a| a.get(ANN_VNC_PORT))
            .and_then(|v| v.trim().parse::<u16>().ok());
        let free =
            |p: &u16| contract::display_of_port(*p).is_some() && !self.vnc_ports.contains_key(p);
        let port = annotated
            .filter(free)
            .or(hint.filter(free))
            .or_else(|| (contract::VNC_FIRST_PORT..=contract::VNC_LAST_PORT).find(free));
        match port {
            Some(p) => {
                self.vnc_ports.insert(p, key.clone());
                Ok(Some(p))
            }
            None => Err(format!(
                "no free VNC port: all of {}-{} are reserved by other macOS guests",
                contract::VNC_FIRST_PORT,
                contract::VNC_LAST_PORT
            )),
        }
    }

    /// The port a running guest actually serves VNC on becomes its reservation (reality wins
    /// over what was reserved before it was seen).
    fn hold_vnc(&mut self, key: &PodKey, display: Option<u16>) -> Option<u16> {
        if !self.cfg.macos_vnc {
            return None;
        }
        let Some(port) = display.and_then(contract::port_of_display) else {
            return self
                .vnc_ports
                .iter()
                .find(|(_, k)| *k == key)
                .map(|(p, _)| *p);
        };
        if let Some(other) = self.vnc_ports.get(&port).filter(|k| *k != key) {
            log::warn!("provider: {key}: its VM serves VNC port {port}, reserved for {other}");
        }
        self.vnc_ports.retain(|_, k| k != key);
        self.vnc_ports.insert(port, key.clone());
        Some(port)
    }

    /// The display of the pod's VNC port for `vm start` / `vm run`, or the failed create.
    fn vnc_display_or_fail(
        &mut self,
        key: &PodKey,
        c: &CreateOp,
        hint: Option<u16>,
    ) -> Option<Option<u16>> {
        match self.reserve_vnc(key, hint) {
            Ok(port) => Some(port.and_then(contract::display_of_port)),
            Err(e) => {
                let msg = format!("macOS guest {}: {e}", c.spec.vm_name);
                self.fail_create(key, &c.uid, &msg, true);
                None
            }
        }
    }

    /// Carries out what a step of the macOS create `c` decided.
    pub(super) fn macos_create_next(&mut self, key: &PodKey, c: CreateOp, next: MacosCreateNext) {
        let Some((c, then)) = self.apply(key, c, next) else {
            return;
        };
        match then {
            MacosThen::Up(vm, adopted) => self.macos_up(key, &vm, adopted),
            MacosThen::Start { hint } => {
                let Some(vnc_display) = self.vnc_display_or_fail(key, &c, hint) else {
                    return;
                };
                let name = c.spec.vm_name.clone();
                let start = macos(MacosCmd::Start { name, vnc_display });
                self.advance(key, CreateStep::MacosStart, start)
            }
            // `vm run` of a new guest: the pod's VNC port, even vCPUs, whole MiB.
            MacosThen::Run => {
                let Some(vnc_display) = self.vnc_display_or_fail(key, &c, None) else {
                    return;
                };
                let r = &c.spec.resources;
                let run = MacosRun {
                    name: c.spec.vm_name.clone(),
                    cpus: contract::even_cpus(r.vcpus()),
                    memory_mib: contract::memory_mib(r.memory_bytes()),
                    vnc_display,
                    storage_bytes: c.spec.storage_bytes,
                    image: c.spec.image.clone(),
                };
                self.advance(key, CreateStep::MacosRun, macos(MacosCmd::Run(run)))
            }
            MacosThen::Failed(msg) => self.fail_create(key, &c.uid, &msg, true),
        }
    }

    /// The guest runs (launched or adopted): id / ip / vnc-port annotations, track, probe,
    /// Running. Ready comes from the probe ([`Provider::macos_readiness`]).
    fn macos_up(&mut self, key: &PodKey, mvm: &MacosVm, adopted: bool) {
        let Some(c) = self.op_of_mut::<CreateOp>(key) else {
            return;
        };
        let (uid, spec, started) = (c.uid.clone(), c.spec.clone(), c.started);
        let vm = vm_info(mvm);
        let port = self.hold_vnc(key, mvm.vnc_display);
        if !adopted {
            let secs = self.now.saturating_duration_since(started).as_secs_f64();
            self.metric(MetricUpdate::VmBootDuration {
                namespace: key.namespace.clone(),
                mode: if spec.mode_raw.is_empty() {
                    "run".into()
                } else {
                    spec.mode_raw.clone()
                },
                backend: spec.backend.clone(),
                seconds: secs,
            });
            self.lifecycle_metric("create", "ok", "");
        }
        // An adopted guest keeps the address its pod shows until the probe, which looks the
        // lease up by MAC on its first run, says otherwise (no blank ip written meanwhile).
        let ip = self
            .slot(key)
            .tracked
            .as_ref()
            .map(|t| t.ip.clone())
            .filter(|ip| !ip.is_empty() || !adopted)
            .unwrap_or_else(|| spec.vm_ip.clone());
        let mut ann = BTreeMap::new();
        ann.insert(ANN_VM_ID.to_string(), Some(vm.id.clone()));
        ann.insert(ANN_VM_IP.to_string(), Some(ip.clone()));
        // Written only when a port is served; an earlier one the guest no longer has goes.
        ann.insert(ANN_VNC_PORT.to_string(), port.map(|p| p.to_string()));
        if let Some(intent) = self.slot(key).intent.as_ref().filter(|i| i.uid == uid) {
            ann.extend(intent.patch());
        }
        self.send_annotations(key, &uid, ann, false);
        let deleting_now = self.slot(key).latest.as_ref().is_some_and(|p| deleting(p));
        {
            let slot = self.slot(key);
            slot.failures = 0;
            slot.retry_at = None;
            if let Some(t) = slot.tracked.as_mut() {
                t.vm = Some(vm.clone());
                t.ip = ip.clone();
                t.spec.vm_id = vm.id.clone();
                t.probe = Some(initial_probe(&ip));
            }
            slot.finish_op();
        }
        if !deleting_now {
            self.macos_start_probe(key);
        }
        self.event(
            key,
            &uid,
            EventType::Normal,
            "ProviderCreateSuccess",
            "Create pod in provider successfully",
        );
        self.arm_macos_watch();
        if !adopted {
            // An adopted guest's pod already shows its status; the probe's first answer
            // publishes it again (a Running, not-Ready write here would flap a Ready pod).
            self.push_status(key, false);
        }
        self.reconcile_slot(key);
    }

    /// The status reconciler's endpoint check of a macOS guest: the vnc-port annotation the
    /// API copy should carry when it differs from what it carries (`Some(None)`: remove a port
    /// the guest no longer serves).
    pub(super) fn macos_vnc_drift(&self, key: &PodKey) -> Option<Option<String>> {
        let slot = self.slots.get(key)?;
        let t = slot.tracked.as_ref().filter(|t| is_macos(&t.spec))?;
        let api = slot.latest.as_ref()?;
        let want = self
            .vnc_ports
            .iter()
            .find(|(_, k)| *k == key)
            .map(|(p, _)| p.to_string());
        let has = api
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANN_VNC_PORT))
            .cloned();
        (t.vm.is_some() && want != has).then_some(want)
    }

    /// (Re)starts the pod's probe with its current VM record: `probe-port` ⇒ TCP connect,
    /// else the SSH banner on port 22.
    fn macos_start_probe(&mut self, key: &PodKey) {
        let Some(t) = self.slots.get(key).and_then(|s| s.tracked.as_ref()) else {
            return;
        };
        let Some(vm) = t.vm.as_ref() else {
            return;
        };
        self.out.push(Effect::StartProbe {
            key: key.clone(),
            uid: t.uid.clone(),
            vm_id: vm.id.clone(),
            ip: t.ip.clone(),
            mac: vm.primary_mac(),
            probe_port: Some(t.spec.probe_port.unwrap_or(crate::probes::SSH_PORT)),
        });
    }

    /// Whether the pod's probe must read an SSH banner: a macOS guest with no probe-port.
    pub fn probe_wants_ssh_banner(&self, key: &PodKey) -> bool {
        self.slots
            .get(key)
            .and_then(|s| s.tracked.as_ref())
            .is_some_and(|t| is_macos(&t.spec) && t.spec.probe_port.is_none())
    }

    /// A probe result of a macOS guest: Ready is published by the probe (probe ready, pod not
    /// failed), not at the end of the create. Returns whether it published.
    pub(super) fn macos_readiness(&mut self, key: &PodKey, ready: bool) -> bool {
        let Some(slot) = self.slots.get(key) else {
            return false;
        };
        let Some(t) = slot.tracked.as_ref() else {
            return false;
        };
        // The watch's liveness check may be running: it changes nothing Ready depends on, and
        // a readiness change is reported once, so it must not be lost to it.
        let busy = slot.op().is_some_and(|o| MacosWatchOp::of(o).is_none());
        if !ready || !is_macos(&t.spec) || busy || deleting(&t.pod) {
            return false;
        }
        let owed = slot
            .intent
            .as_ref()
            .is_none_or(|i| i.uid != t.uid || i.state == State::Creating);
        if owed {
            self.publish_ready(key);
        }
        owed
    }

    /// `vm rm` removed the VM (or found none): its leases and restart record go with it.
    pub(super) fn macos_removed(&mut self, key: &PodKey, t: &Tracked, d: &DeleteOp) {
        if let Some(vm) = t.vm.as_ref() {
            self.release_leases(vm);
            self.last_restart.remove(&vm.id);
        }
        self.delete_vm_gone(key, t, d)
    }

    // ----- the watch: dead QEMU restart and MAC backfill ------------------------------------

    pub(super) fn arm_macos_watch(&mut self) {
        if !self.macos_watch_armed {
            self.macos_watch_armed = true;
            let at = self.now + MACOS_WATCH_EVERY;
            self.arm(at, TimerEntry::MacosWatch);
        }
    }

    /// Every 10 s: each tracked macOS guest with no op running gets its liveness check.
    pub(super) fn macos_watch_tick(&mut self) {
        self.macos_watch_armed = false;
        let due: Vec<(PodKey, String, i64)> = self
            .slots
            .iter()
            .filter(|(_, s)| s.op().is_none())
            .filter_map(|(k, s)| {
                let t = s.tracked.as_ref()?;
                let vm = t.vm.as_ref()?;
                (is_macos(&t.spec) && !deleting(&t.pod)).then(|| (k.clone(), t.uid.clone(), vm.pid))
            })
            .collect();
        let any = self.slots.values().any(|s| {
            s.tracked
                .as_ref()
                .is_some_and(|t| is_macos(&t.spec) && t.vm.is_some())
        });
        for (key, uid, pid) in due {
            self.set_op(
                &key,
                MacosWatchOp {
                    uid,
                    step: MacosWatchStep::Alive,
                },
            );
            let ask = Ask::effect(move |op| Effect::CheckPid { op, pid });
            self.advance(&key, MacosWatchStep::Alive, ask);
        }
        if any {
            self.arm_macos_watch();
        }
    }

    /// An answer to the watch round `w`.
    pub(super) fn macos_watch_step(&mut self, key: &PodKey, w: MacosWatchOp, res: Res) {
        let next = w.on_answer(&self.cx(key), res);
        let Some((_, then)) = self.apply(key, w, next) else {
            return;
        };
        match then {
            // A fresher record of the running guest: new pid, backfilled MAC, disk. The probe
            // is restarted when the MAC changed (it looks the guest's address up by MAC).
            Watched::Refresh(m) => {
                let tracked_vm = self.slot(key).tracked.as_mut().and_then(|t| t.vm.as_mut());
                if let Some(vm) = tracked_vm {
                    let fresh = vm_info(&m);
                    let mac_changed =
                        !fresh.primary_mac().is_empty() && fresh.primary_mac() != vm.primary_mac();
                    vm.pid = fresh.pid;
                    vm.disk = fresh.disk;
                    if mac_changed {
                        vm.nics = fresh.nics;
                        self.macos_start_probe(key);
                    }
                }
                self.end_op(key)
            }
            // `vm start` of a dead QEMU, at most once per 10 s per VM.
            Watched::Restart(vm) => {
                let recent = self
                    .last_restart
                    .get(&vm.id)
                    .is_some_and(|at| self.now.saturating_duration_since(*at) < MACOS_WATCH_EVERY);
                if recent {
                    return self.end_op(key);
                }
                self.note_restart(&vm.id);
                self.metric(MetricUpdate::VmRestart {
                    namespace: key.namespace.clone(),
                    pod: key.name.clone(),
                });
                log::warn!("provider: {key}: QEMU of {} is dead; starting it", vm.name);
                let vnc_display = self
                    .vnc_ports
                    .iter()
                    .find(|(_, k)| *k == key)
                    .and_then(|(p, _)| contract::display_of_port(*p));
                let name = vm.name;
                let start = macos(MacosCmd::Start { name, vnc_display });
                self.advance(key, MacosWatchStep::Start, start)
            }
        }
    }
}

/// What a watch round's step leaves to the provider.
enum Watched {
    /// The guest runs: this fresher record refreshes the tracked VM, and the round ends.
    Refresh(MacosVm),
    /// The guest's QEMU is dead: it is started (unless it was just restarted).
    Restart(VmInfo),
}

impl MacosWatchOp {
    fn on_answer(&self, cx: &Cx, res: Res) -> Next<MacosWatchStep, Watched> {
        let Some(t) = cx.tracked else {
            return Next::Wait;
        };
        let Some(vm) = t.vm.clone().filter(|_| t.uid == self.uid) else {
            return Next::End;
        };
        let (key, name) = (cx.key, t.spec.vm_name.clone());
        let inspected = |r: &Answer| {
            contract::parse_inspect(&r.stdout)
                .ok()
                .filter(|_| r.succeeded())
        };
        match (self.step.clone(), res) {
            (MacosWatchStep::Alive, Res::Pid(alive)) => {
                if alive && !vm.primary_mac().is_empty() {
                    return Next::End;
                }
                let step = MacosWatchStep::Inspect { dead: !alive };
                Next::Ask(step, macos(MacosCmd::Inspect { name }))
            }
            (MacosWatchStep::Inspect { dead }, Res::Cocoon(r)) => match inspected(&r) {
                // A record with a new pid may be a QEMU started meanwhile: check that one.
                Some(m) if dead && m.pid != vm.pid => {
                    let pid = m.pid;
                    let ask = Ask::effect(move |op| Effect::CheckPid { op, pid });
                    Next::Ask(MacosWatchStep::InspectAlive { vm: m }, ask)
                }
                Some(_) if dead => Next::Then(Watched::Restart(vm)),
                Some(m) => Next::Then(Watched::Refresh(m)),
                None => {
                    log::warn!(
                        "provider: {key}: cocoon-macos vm inspect {name}: {}",
                        r.error_text()
                    );
                    Next::End
                }
            },
            (MacosWatchStep::InspectAlive { vm: m }, Res::Pid(alive)) => {
                if alive {
                    return Next::Then(Watched::Refresh(m));
                }
                Next::Then(Watched::Restart(vm))
            }
            (MacosWatchStep::Start, Res::Cocoon(r)) => {
                if !r.succeeded() {
                    // Tried again by the next round once the 10 s have passed.
                    log::warn!(
                        "provider: {key}: restart dead QEMU of {name}: {}",
                        r.error_text()
                    );
                    return Next::End;
                }
                Next::Ask(MacosWatchStep::Refresh, macos(MacosCmd::Inspect { name }))
            }
            (MacosWatchStep::Refresh, Res::Cocoon(r)) => match inspected(&r) {
                Some(m) => Next::Then(Watched::Refresh(m)),
                None => Next::End,
            },
            (step, res) => Next::Unexpected(step, res),
        }
    }
}

/// What a macOS create's step leaves to the provider: the VNC port reservation the launch
/// needs, the guest up, the failure.
pub(super) enum MacosThen {
    /// The guest runs (`true`: adopted, not launched by this create): `macos_up`.
    Up(MacosVm, bool),
    /// `vm start` of the pod's guest found dead, on the pod's VNC port (`hint`: the port the
    /// guest served).
    Start { hint: Option<u16> },
    /// `vm run` of a new guest on the pod's VNC port.
    Run,
    /// The create failed with this message and is retried (`fail_create`).
    Failed(String),
}

pub(super) type MacosCreateNext = Next<CreateStep, MacosThen>;

impl CreateOp {
    /// An answer to the create of a macOS guest: adoption of the guest already running, else
    /// the image (inspected, pulled when missing), the launch and the inspect of what runs.
    pub(super) fn on_macos_answer(&mut self, cx: &mut Cx, res: Res) -> MacosCreateNext {
        let name = self.spec.vm_name.clone();
        let failed = |msg: String| Next::Then(MacosThen::Failed(msg));
        match (self.step.clone(), res) {
            (CreateStep::MacosInspect, Res::Cocoon(r)) => self.macos_inspected(r),
            (CreateStep::MacosAlive { vm }, Res::Pid(alive)) => {
                if alive {
                    cx.metric(MetricUpdate::PodLifecycle {
                        op: "create",
                        result: "ok",
                        reason: "adopted",
                    });
                    return Next::Then(MacosThen::Up(vm, true));
                }
                let hint = vm.vnc_display.and_then(contract::port_of_display);
                Next::Then(MacosThen::Start { hint })
            }
            (CreateStep::MacosImageInspect, Res::Cocoon(r)) => {
                if r.succeeded() {
                    return Next::Then(MacosThen::Run);
                }
                let image = self.spec.image.clone();
                let ask = shared(MacosCmd::ImagePull { image });
                Next::Ask(CreateStep::MacosImagePull, ask)
            }
            (CreateStep::MacosImagePull, Res::Cocoon(r)) => {
                if r.succeeded() {
                    return Next::Then(MacosThen::Run);
                }
                let image = &self.spec.image;
                failed(format!(
                    "cocoon-macos image pull {image}: {}",
                    r.error_text()
                ))
            }
            (CreateStep::MacosStart | CreateStep::MacosRun, Res::Cocoon(r)) => {
                if !r.succeeded() {
                    let verb = if matches!(self.step, CreateStep::MacosRun) {
                        "run"
                    } else {
                        "start"
                    };
                    return failed(format!("cocoon-macos vm {verb} {name}: {}", r.error_text()));
                }
                let ask = macos(MacosCmd::Inspect { name });
                Next::Ask(CreateStep::MacosLaunched, ask)
            }
            (CreateStep::MacosLaunched, Res::Cocoon(r)) => {
                let parsed = if r.succeeded() {
                    contract::parse_inspect(&r.stdout).map_err(|e| e.to_string())
                } else {
                    Err(format!(
                        "cocoon-macos vm inspect {name} after launch: {}",
                        r.error_text()
                    ))
                };
                match parsed {
                    Ok(vm) => Next::Then(MacosThen::Up(vm, false)),
                    Err(e) => failed(e),
                }
            }
            (step, res) => Next::Unexpected(step, res),
        }
    }

    /// The look for the guest of this name before anything is made: one running is adopted
    /// (once its liveness is checked); with none, the image comes first.
    fn macos_inspected(&self, r: Answer) -> MacosCreateNext {
        let name = &self.spec.vm_name;
        let failed = |msg: String| Next::Then(MacosThen::Failed(msg));
        if r.succeeded() {
            return match contract::parse_inspect(&r.stdout) {
                // Only the guest of this very name is adopted.
                Ok(vm) if vm.name != *name => failed(format!(
                    "cocoon-macos vm inspect {name} answered for another guest"
                )),
                Ok(vm) => {
                    let pid = vm.pid;
                    let ask = Ask::effect(move |op| Effect::CheckPid { op, pid });
                    Next::Ask(CreateStep::MacosAlive { vm }, ask)
                }
                Err(e) => failed(e.to_string()),
            };
        }
        if !r.vm_not_found() {
            return failed(format!(
                "cocoon-macos vm inspect {name}: {}",
                r.error_text()
            ));
        }
        let image = self.spec.image.clone();
        let ask = shared(MacosCmd::ImageInspect { image });
        Next::Ask(CreateStep::MacosImageInspect, ask)
    }
}

impl DeleteOp {
    /// The delete of a managed macOS guest: `cocoon-macos vm rm <name>`, no snapshot work.
    pub(super) fn macos_rm(&self, cx: &mut Cx, t: &Tracked) -> Next<DeleteStep, Deleting> {
        if !contract::argument_ok(&t.spec.vm_name) {
            // Nothing of ours can carry such a name: there is no VM to remove.
            cx.metric(MetricUpdate::PodLifecycle {
                op: "delete",
                result: "skipped",
                reason: "no_vm",
            });
            return Next::Then(Deleting::Forgotten);
        }
        let name = t.spec.vm_name.clone();
        Next::Ask(DeleteStep::MacosRm, macos(MacosCmd::Rm { name }))
    }
}
