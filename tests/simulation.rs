//! Simulation tier of the provider core: a simulated cocoon and API server (plain data), virtual
//! time, hundreds of pods and random faults; each run is reproducible from its printed seed.
//!
//! Faults: cocoon calls fail or hang (the side effect happens, the answer is a timeout), API
//! calls answer 409 / 429 / 500, the watch drops (events lost, then a re-list), VMs crash or
//! vanish, and the provider restarts at arbitrary points (a new `Provider` fed a fresh
//! `StartupListed`; answers owed to the old one are lost). After the chaos phase the world
//! runs fault-free and the invariants are checked: exactly one running VM per live pod, no VM
//! without a live pod (orphan policy destroy), every live pod Running + Ready with the podIP and
//! id annotation of its VM, no pod object left terminating, bad pods have no VM. Checked as the
//! run goes: a Running pod never goes back to Pending, a running VM is never removed while a
//! live pod not being deleted names it, nothing is written for a pod after its grace-0 delete.
//! Probe agents are simulated: a probe succeeds while the pod's VM runs.
//!
//! A second run drives the pod writes through the daemon's kube lane scheduler (the very same
//! one): a low client QPS, API answers taking up to 500 ms, and a check that each pod's writes
//! reach the API server in the order the core issued them.
//!
//! A third run adds fork-from pods: a source pod and pods forking its VM, with fork snapshot
//! saves that fail, hang, or leave a half-saved record holding the `fork-<source>` name; they
//! must converge like any other pod (one VM each, Running + Ready).
//!
//! A fourth run is the hibernate run: a simulated registry (the `<vm>:hibernate` tags) and
//! local snapshots, pods toggling `hibernate`, and the faults of that path: saves that fail,
//! pushes that fail half-way (blobs sent, the tag unchanged), the registry down during a wake.
//! Its invariants: a pod asking for hibernate ends with no VM, its tag in the registry and
//! lifecycle `hibernated`; one asking for none ends Running + Ready as any other.
//!
//! A fifth run is the attacker run: the hibernate run plus namespace `evil`, whose pods the
//! chaos creates at random, each trying one rule against the victims of `sim` and of
//! `evil-team` (whose plain names `vk-evil-team-<pod>` also read as pod `team-<pod>` of `evil`):
//! a victim's VM name (exact, or re-parsed, with or without restore-from-hibernate), a victim
//! VM's id or a 3+ character prefix of it (managed or unmanaged), a victim's VM snapshot as
//! image (`<vm>` or `<vm>:hibernate`), fork-from a victim's VM, and pods named like victims
//! that hibernate; tracked attacker pods rename their VM to a victim's, and hibernate toggles
//! hit attackers and `evil-team` alike. The simulated cocoon resolves references as cocoon does
//! (exact ID, exact name, unique ID prefix of 3+ characters) and the registry keeps the owner
//! annotations of each push. Each VM, local snapshot and tag is owned by the namespace of the
//! pod on whose behalf the core made it (`Provider::op_pods` maps an effect's op to its pods).
//! The invariant, checked at every effect: nothing owned by namespace X is cloned from,
//! imported over, pulled, pushed from or over, saved, started, removed, exec'd into, probed,
//! lease-looked-up or written as a pod's id / podIP for a pod of namespace Y != X (lookups the
//! core then refuses are allowed). At the end an attacker pod is Failed, without a VM, or on a
//! VM of its own; the victims converge as in the other runs (a victim of `evil-team` whose
//! two-reading name the attacker made first has lost it by the rules and is exempt).
//!
//! `SIM_SEED=<n>` replays one seed; `SIM_SEEDS=<k>` runs k fresh random seeds; by default a
//! fixed seed list runs, and beside it a small random sample of fresh seeds, each printed with
//! the command that replays it (`SIM_SAMPLE`). `SIM_TRACE=<text>` prints each input/effect
//! whose debug form has it.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use vk_cocoon::daemon::lane::{Job, KubeLane, LaneLimits, PodWrite, WriteKind};
use vk_cocoon::kube::ratelimit::TokenBucket;
use vk_cocoon::provider::spec::{
    ANN_FORK_FROM, ANN_GENERATION, ANN_HIBERNATE, ANN_IMAGE, ANN_LIFECYCLE_STATE, ANN_MANAGED,
    ANN_RESTORE, ANN_VM_ID, ANN_VM_IP, ANN_VM_NAME,
};
use vk_cocoon::provider::status;
use vk_cocoon::provider::{
    Answer, Effect, HibernateTag, Input, KubeError, OpId, PodKey, Provider, ProviderConfig,
    TransferError, VmEventKind, VmInfo,
};
use vk_cocoon::vm::CocoonCmd;

/// xorshift64*: tiny, deterministic, good enough for fault injection.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
}

#[derive(Clone, Debug)]
struct SimVm {
    id: String,
    name: String,
    state: String,
    mac: String,
}

impl SimVm {
    fn json(&self) -> String {
        format!(
            r#"{{"id":"{}","hypervisor":"cloud-hypervisor","state":"{}","pid":{},"config":{{"name":"{}"}},"network_configs":[{{"tap":"t","mac":"{}"}}]}}"#,
            self.id,
            self.state,
            if self.state == "running" { 100 } else { 0 },
            self.name,
            self.mac
        )
    }
    fn info(&self) -> VmInfo {
        vk_cocoon::vm::read_vm(&self.json()).expect("sim vm json")
    }
    fn ip(&self) -> String {
        let n = u32::from_str_radix(&self.mac.replace(':', "")[6..], 16).unwrap_or(0);
        format!("10.{}.{}.{}", (n >> 16) & 255, (n >> 8) & 255, n & 255)
    }
}

/// The hibernate run's registry and local snapshots.
#[derive(Default)]
struct SimHibernate {
    /// Local snapshots: name → id.
    snapshots: BTreeMap<String, String>,
    /// Registry `<vm>:hibernate` tags: VM name → id of the snapshot pushed.
    tags: BTreeMap<String, String>,
    /// The owner annotations each tag was pushed with (VM name → namespace, pod uid).
    tag_owners: BTreeMap<String, (String, String)>,
    next_snap: u64,
    registry_down_until: Option<Instant>,
    /// Incarnations that asked for hibernate at some point (they may go back to Pending).
    asked: std::collections::BTreeSet<String>,
}

/// The attacker run: namespace `evil` against the victims of `sim` and `evil-team` (whose
/// plain VM names `vk-evil-team-<pod>` also read as pod `team-<pod>` of `evil`), and the
/// ground truth of who owns what: the namespace of the pod on whose behalf the core made it.
#[derive(Default)]
struct SimAttack {
    /// VM id → owner namespace (set by the clone that made it).
    vm_owner: BTreeMap<String, String>,
    /// VM name → the namespace of the last clone of that name.
    vm_name_owner: BTreeMap<String, String>,
    /// Local snapshot name → owner namespace (set by the save or import that made it).
    snap_owner: BTreeMap<String, String>,
    /// Registry `repo:tag` → owner namespace (set by the push that made it).
    tag_owner: BTreeMap<String, String>,
    /// The victims of `evil-team`: pod name → VM name (the operator keeps them).
    team: BTreeMap<String, String>,
    /// Attacker pod names handed out.
    next: u64,
}

/// The attacker's namespace and the victims' namespace whose names it can re-parse.
const EVIL: &str = "evil";
const TEAM: &str = "evil-team";

impl SimHibernate {
    /// The manifest of `<vm>:hibernate`, with the owner annotations it was pushed with.
    fn tag(&self, vm: &str) -> Option<HibernateTag> {
        let (ns, uid) = self.tag_owners.get(vm).cloned().unwrap_or_default();
        self.tags.get(vm).map(|id| HibernateTag {
            base_image: "team/agent:v1".into(),
            snapshot_id: id.clone(),
            from_node: "sim".into(),
            owner_namespace: ns,
            owner_pod_uid: uid,
            ..Default::default()
        })
    }
}

/// What gets delivered to the provider later.
enum Delivery {
    Input(Input),
    Watch(Input),
    /// A kube lane write reaches the API server and its answer comes back.
    LaneWrite(PodWrite),
    /// The probe agent of a pod probes its VM (Ready needs a probe that succeeded).
    Probe(PodKey),
}

/// The daemon's kube lane as the simulation runs it: the scheduler, the client's token
/// bucket, the slow API server's latency bound, and what each pod had issued and applied.
struct SimLane {
    lane: KubeLane,
    bucket: TokenBucket,
    max_latency_ms: u64,
    /// When the scheduler wants to be asked again (the next token).
    wake: Option<Instant>,
    /// Per pod, the newest op id carried by each write applied so far, in apply order.
    applied: HashMap<PodKey, Vec<OpId>>,
    order_violations: Vec<String>,
    /// The deepest backlog seen (proof that writes really waited).
    max_queued: usize,
}

struct Sim {
    rng: Rng,
    now: Instant,
    wall: SystemTime,
    start: Instant,
    provider: Provider,
    /// Incremented at each provider restart; deliveries for older epochs are dropped.
    epoch: u64,
    queue: BinaryHeap<Reverse<(Instant, u64, u64)>>,
    pending: HashMap<u64, (u64, Delivery)>,
    seq: u64,
    // --- simulated API server
    api: BTreeMap<PodKey, Pod>,
    next_uid: u64,
    watch_down_until: Option<Instant>,
    /// Delivery time of the newest watch event (events arrive in order).
    last_watch_at: Instant,
    // --- simulated cocoon
    vms: BTreeMap<String, SimVm>,
    next_vm: u64,
    /// Fork snapshots (`fork-*` only; other snapshot names keep their fixed answers): name →
    /// `None` when complete, `Some(holder id)` for the half-saved record of a save cut short.
    fork_snaps: BTreeMap<String, Option<String>>,
    /// The VM ID each complete fork snapshot was saved from: a clone from `fork-<source>` must
    /// copy the VM now named `<source>`, never an earlier VM of that name.
    fork_saved_from: BTreeMap<String, String>,
    next_snap: u64,
    // --- the "operator": desired pod names → vm name (None = bad pod without a VM name)
    desired: BTreeMap<String, Option<String>>,
    /// Desired pods that fork another VM: pod name → source VM name. These and their source
    /// are never deleted by the chaos (a fork of a deleted source cannot converge).
    fork_of: BTreeMap<String, String>,
    faults: bool,
    stats: BTreeMap<&'static str, u64>,
    /// Some: pod writes go through the kube lane (see `SimLane`).
    lane: Option<SimLane>,
    /// Probe agents the provider started: pod → (uid, VM id).
    probes: BTreeMap<PodKey, (String, String)>,
    /// The ownership ledger on the simulated disk: each write lands when asked, survives
    /// restarts, and is answered after a latency.
    ledger: vk_cocoon::provider::owners::Owners,
    // --- invariants checked as the run goes
    /// Incarnations the API has seen Running.
    ran: std::collections::BTreeSet<String>,
    /// Incarnations deleted with grace 0: nothing may be written for them afterwards.
    gone: std::collections::BTreeSet<String>,
    violations: Vec<String>,
    /// Some: the hibernate run.
    hib: Option<SimHibernate>,
    /// Some: the attacker run (a hibernate run with namespace `evil`).
    attack: Option<SimAttack>,
    /// The namespaces of the pods on whose behalf the effect being performed was issued.
    acting: Vec<PodKey>,
}

fn new_pod(name: &str, uid: &str, vm: Option<&str>, generation: u64) -> Pod {
    new_pod_in("sim", name, uid, vm, generation)
}

fn new_pod_in(ns: &str, name: &str, uid: &str, vm: Option<&str>, generation: u64) -> Pod {
    let mut ann: BTreeMap<String, String> = BTreeMap::new();
    if let Some(vm) = vm {
        ann.insert(ANN_VM_NAME.into(), vm.into());
    }
    ann.insert(ANN_MANAGED.into(), "true".into());
    ann.insert(ANN_IMAGE.into(), "team/agent:v1".into());
    ann.insert(ANN_GENERATION.into(), generation.to_string());
    Pod {
        metadata: ObjectMeta {
            namespace: Some(ns.into()),
            name: Some(name.into()),
            uid: Some(uid.into()),
            annotations: Some(ann),
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "agent".into(),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: Some(PodStatus {
            phase: Some("Pending".into()),
            ..Default::default()
        }),
    }
}

fn uid_of(p: &Pod) -> String {
    p.metadata.uid.clone().unwrap_or_default()
}

/// A thing an effect acts on: how the report names it, and its owner namespace if known.
type Touched = (String, Option<String>);

/// The op an effect's answer carries (None: effects answered by no op).
fn effect_op(e: &Effect) -> Option<OpId> {
    match e {
        Effect::Cocoon { op, .. }
        | Effect::ReadVmPid { op, .. }
        | Effect::LookupLease { op, .. }
        | Effect::PullSnapshot { op, .. }
        | Effect::PushSnapshot { op, .. }
        | Effect::DeleteSnapshotTag { op, .. }
        | Effect::PeerRestore { op, .. }
        | Effect::CheckHibernateEvidence { op, .. }
        | Effect::ReadSnapshotTag { op, .. } => Some(*op),
        _ => None,
    }
}

impl Sim {
    fn new(seed: u64) -> Sim {
        let now = Instant::now();
        Sim {
            rng: Rng(seed.max(1)),
            now,
            start: now,
            wall: SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000),
            provider: Provider::new(ProviderConfig::default()),
            epoch: 0,
            queue: BinaryHeap::new(),
            pending: HashMap::new(),
            seq: 0,
            api: BTreeMap::new(),
            next_uid: 1,
            watch_down_until: None,
            last_watch_at: now,
            vms: BTreeMap::new(),
            next_vm: 1,
            fork_snaps: BTreeMap::new(),
            fork_saved_from: BTreeMap::new(),
            next_snap: 1,
            desired: BTreeMap::new(),
            fork_of: BTreeMap::new(),
            faults: true,
            stats: BTreeMap::new(),
            lane: None,
            probes: BTreeMap::new(),
            ledger: Default::default(),
            ran: Default::default(),
            gone: Default::default(),
            violations: Vec::new(),
            hib: None,
            attack: None,
            acting: Vec::new(),
        }
    }

    /// The provider's configuration: a registry in the hibernate run.
    fn config(&self) -> ProviderConfig {
        ProviderConfig {
            registry: self.hib.is_some(),
            ..ProviderConfig::default()
        }
    }

    fn registry_down(&self) -> bool {
        self.hib
            .as_ref()
            .and_then(|h| h.registry_down_until)
            .is_some_and(|t| t > self.now)
    }

    /// The hibernate run's answer to a registry effect; None outside that run.
    fn registry(&mut self, e: &Effect) -> Option<Delivery> {
        let down = self.registry_down();
        // Manifest reads draw nothing (they joined the registry's answers later: the other
        // runs' seeds keep their trajectories).
        let reads = matches!(e, Effect::ReadSnapshotTag { .. });
        let push_breaks = !reads && self.faults && self.rng.chance(100);
        let acting = self.acting_ns();
        let h = self.hib.as_mut()?;
        let unavailable = || TransferError::Transient("sim: registry unavailable".into());
        // What the answer made, for the attacker run's owner records: (snapshot?, name).
        let mut made: Option<(bool, String)> = None;
        let d = match e {
            Effect::PushSnapshot {
                op,
                local_name,
                repo,
                tag,
                owner,
                ..
            } => {
                let result = if down {
                    Err(unavailable())
                } else if push_breaks {
                    // Half-way: blobs went up, the manifest (the tag) did not.
                    Err(TransferError::Transient(
                        "sim: push broke after the blobs".into(),
                    ))
                } else if let Some(id) = h.snapshots.get(local_name) {
                    if tag == "hibernate" {
                        h.tags.insert(repo.clone(), id.clone());
                        let o = (owner.namespace.clone(), owner.pod_uid.clone());
                        h.tag_owners.insert(repo.clone(), o);
                        made = Some((false, format!("{repo}:{tag}")));
                    }
                    Ok(String::new())
                } else {
                    Err(TransferError::Cocoon(format!(
                        "export {local_name}: not found"
                    )))
                };
                Input::TransferDone { op: *op, result }
            }
            Effect::PullSnapshot {
                op,
                repo,
                tag,
                local_name,
            } => {
                let result = if down {
                    Err(unavailable())
                } else if tag == "hibernate" && h.tags.contains_key(repo) {
                    h.next_snap += 1;
                    h.snapshots
                        .insert(local_name.clone(), format!("SNAPI{}", h.next_snap));
                    made = Some((true, local_name.clone()));
                    Ok(String::new())
                } else {
                    Err(TransferError::NotFound(format!("{repo}:hibernate")))
                };
                Input::TransferDone { op: *op, result }
            }
            Effect::DeleteSnapshotTag { op, repo, .. } => {
                let result = if down {
                    Err(unavailable())
                } else {
                    h.tags.remove(repo);
                    h.tag_owners.remove(repo);
                    Ok(String::new())
                };
                Input::TransferDone { op: *op, result }
            }
            Effect::CheckHibernateEvidence { op, vm_name } => {
                let result = if down {
                    Err(unavailable())
                } else {
                    Ok(h.tag(vm_name))
                };
                Input::HibernateEvidence { op: *op, result }
            }
            // A manifest read: the hibernate tags with their owner annotations, the base
            // image (no owner), nothing else.
            Effect::ReadSnapshotTag { op, repo, tag } => {
                let result = if tag == "hibernate" {
                    Ok(h.tag(repo))
                } else if repo == "team/agent" {
                    Ok(Some(HibernateTag::default()))
                } else {
                    Ok(None)
                };
                Input::HibernateEvidence { op: *op, result }
            }
            _ => return None,
        };
        if let (Some((snapshot, name)), Some(ns), Some(a)) = (made, acting, self.attack.as_mut()) {
            let map = if snapshot {
                &mut a.snap_owner
            } else {
                &mut a.tag_owner
            };
            map.insert(name, ns);
        }
        Some(Delivery::Input(d))
    }

    /// The hibernate run's local snapshot verbs; None outside that run (or for other verbs).
    fn snapshot_verb(&mut self, cmd: &CocoonCmd) -> Option<Answer> {
        let save_breaks = self.faults && self.hib.is_some() && self.rng.chance(100);
        let running = |vms: &BTreeMap<String, SimVm>, id: &str| {
            vms.get(id).is_some_and(|v| v.state == "running")
        };
        let vm_running = match cmd {
            CocoonCmd::SnapshotSave { vm_id, .. } => self
                .find_vm(vm_id)
                .is_some_and(|id| running(&self.vms, &id)),
            _ => false,
        };
        let acting = self.acting_ns();
        let mut saved = None;
        let h = self.hib.as_mut()?;
        let r = match cmd {
            CocoonCmd::SnapshotSave { name, vm_id, .. } => {
                if !vm_running {
                    Answer::failed(format!("Error: save: vm {vm_id} is not running"))
                } else if h.snapshots.contains_key(name) {
                    Answer::failed(format!("Error: snapshot name \"{name}\" already exists"))
                } else if save_breaks {
                    Answer::failed("Error: save: sim: disk full")
                } else {
                    h.next_snap += 1;
                    h.snapshots
                        .insert(name.clone(), format!("SNAP{}", h.next_snap));
                    saved = Some(name.clone());
                    Answer::ok("")
                }
            }
            CocoonCmd::SnapshotRm { name } => match h.snapshots.remove(name) {
                Some(_) => Answer::ok(""),
                None => Answer::failed("Error: rm: snapshot not found"),
            },
            CocoonCmd::SnapshotInspect { name } if name != "team/agent:v1" => {
                match h.snapshots.get(name) {
                    Some(id) => Answer::ok(format!(
                        r#"{{"id":"{id}","name":"{name}","image":"team/agent:v1","hypervisor":"cloud-hypervisor"}}"#
                    )),
                    None => Answer::failed("Error: snapshot not found"),
                }
            }
            CocoonCmd::VmClone(a) => {
                let vk_cocoon::vm::CloneSource::Snapshot(src) = &a.source else {
                    return None;
                };
                if src != "team/agent:v1" && !h.snapshots.contains_key(src) {
                    return Some(Answer::failed(format!(
                        "Error: clone: snapshot \"{src}\": snapshot not found"
                    )));
                }
                return None;
            }
            _ => return None,
        };
        if let (Some(name), Some(ns), Some(a)) = (saved, acting, self.attack.as_mut()) {
            a.snap_owner.insert(name, ns);
        }
        Some(r)
    }

    fn count(&mut self, what: &'static str) {
        *self.stats.entry(what).or_insert(0) += 1;
    }

    fn later(&mut self, after: Duration, d: Delivery) {
        self.seq += 1;
        let at = self.now + after;
        self.queue.push(Reverse((at, self.seq, self.epoch)));
        self.pending.insert(self.seq, (self.epoch, d));
    }

    fn latency(&mut self) -> Duration {
        Duration::from_millis(1 + self.rng.below(30))
    }

    fn feed(&mut self, input: Input) {
        let trace = std::env::var("SIM_TRACE").ok();
        let shown = trace.as_ref().map(|t| {
            let i = format!("{input:?}");
            (t.clone(), i.contains(t.as_str()), i)
        });
        let effects = self.provider.handle(input, self.now, self.wall);
        if let Some((t, hit, i)) = shown {
            let ms = (self.now - self.start).as_millis();
            let eff: Vec<String> = effects
                .iter()
                .map(|e| format!("{e:?}"))
                .filter(|e| e.contains(t.as_str()))
                .collect();
            if hit || !eff.is_empty() {
                println!("[{ms} ms] IN {}", &i[..i.len().min(1000)]);
                for e in eff {
                    println!("    OUT {}", &e[..e.len().min(1000)]);
                }
            }
        }
        // The attacker run: who each effect is for, read before any is performed.
        let who: Vec<Vec<PodKey>> = if self.attack.is_some() {
            effects
                .iter()
                .map(|e| {
                    effect_op(e)
                        .map(|op| self.provider.op_pods(op))
                        .unwrap_or_default()
                })
                .collect()
        } else {
            Vec::new()
        };
        for (i, e) in effects.into_iter().enumerate() {
            self.acting = who.get(i).cloned().unwrap_or_default();
            if self.attack.is_some() {
                self.isolation_check(&e);
            }
            self.perform(e);
        }
        self.acting.clear();
    }

    /// The namespace the effect being performed acts for (the first pod's; None for
    /// node-wide work).
    fn acting_ns(&self) -> Option<String> {
        self.acting.first().map(|k| k.namespace.clone())
    }

    /// Records that what `set` names now belongs to the acting namespace (attacker run only).
    fn own(&mut self, set: impl FnOnce(&mut SimAttack, String)) {
        if let (Some(ns), Some(a)) = (self.acting_ns(), self.attack.as_mut()) {
            set(a, ns);
        }
    }

    /// The invariant of the attacker run: nothing of namespace X (a VM, a local snapshot, a
    /// registry tag) is acted on for a pod of namespace Y != X. `vm inspect`, `snapshot
    /// inspect` and manifest reads are lookups and pass; what the core then does is checked.
    fn isolation_check(&mut self, e: &Effect) {
        let Some(a) = self.attack.as_ref() else {
            return;
        };
        let vm_of = |sim: &Sim, r: &str| {
            sim.find_vm(r).map(|id| {
                let name = sim.vms.get(&id).map(|v| v.name.clone()).unwrap_or_default();
                let owner = a.vm_owner.get(&id).cloned();
                (format!("vm {id} ({name})"), owner)
            })
        };
        let snap_of = |sim: &Sim, name: &str| {
            let exists = sim
                .hib
                .as_ref()
                .is_some_and(|h| h.snapshots.contains_key(name));
            exists.then(|| (format!("snapshot {name}"), a.snap_owner.get(name).cloned()))
        };
        let tag_of = |sim: &Sim, repo: &str, tag: &str| {
            let exists =
                tag == "hibernate" && sim.hib.as_ref().is_some_and(|h| h.tags.contains_key(repo));
            let t = format!("{repo}:{tag}");
            exists.then(|| (format!("tag {t}"), a.tag_owner.get(&t).cloned()))
        };
        // (what is done, the thing it touches with its owner, the pods it is for)
        let mut touched: Vec<(String, Option<Touched>)> = Vec::new();
        let mut for_pods = self.acting.clone();
        match e {
            Effect::Cocoon { cmd, .. } => match cmd {
                CocoonCmd::VmClone(c) => {
                    if let vk_cocoon::vm::CloneSource::Snapshot(src) = &c.source {
                        touched.push((format!("vm clone {} from", c.name), snap_of(self, src)));
                    }
                }
                CocoonCmd::VmStart { id } => touched.push(("vm start".into(), vm_of(self, id))),
                CocoonCmd::VmRm { id } => touched.push(("vm rm".into(), vm_of(self, id))),
                CocoonCmd::VmExec { id, .. } => touched.push(("vm exec".into(), vm_of(self, id))),
                CocoonCmd::VmNet { id, .. } => touched.push(("vm net".into(), vm_of(self, id))),
                CocoonCmd::SnapshotSave { name, vm_id, .. } => {
                    touched.push((format!("snapshot save {name} of"), vm_of(self, vm_id)))
                }
                CocoonCmd::SnapshotRm { name } => {
                    touched.push(("snapshot rm".into(), snap_of(self, name)))
                }
                _ => {}
            },
            Effect::ReadVmPid { vm_id, .. } => {
                touched.push(("pid read of".into(), vm_of(self, vm_id)))
            }
            Effect::LookupLease { mac, .. } => {
                let id = self
                    .vms
                    .values()
                    .find(|v| &v.mac == mac)
                    .map(|v| v.id.clone());
                if let Some(id) = id {
                    touched.push(("lease lookup of".into(), vm_of(self, &id)));
                }
            }
            Effect::PullSnapshot {
                repo,
                tag,
                local_name,
                ..
            } => {
                touched.push(("registry pull of".into(), tag_of(self, repo, tag)));
                touched.push((
                    format!("import of {repo}:{tag} over"),
                    snap_of(self, local_name),
                ));
            }
            Effect::PushSnapshot {
                local_name,
                repo,
                tag,
                ..
            } => {
                touched.push((
                    format!("push to {repo}:{tag} of"),
                    snap_of(self, local_name),
                ));
                touched.push(("push over".into(), tag_of(self, repo, tag)));
            }
            Effect::DeleteSnapshotTag { repo, tag, .. } => {
                touched.push(("registry delete of".into(), tag_of(self, repo, tag)))
            }
            Effect::PeerRestore {
                namespace, vm_name, ..
            } => {
                for_pods = vec![PodKey::new(namespace.as_str(), "<peer restore>")];
                touched.push(("peer restore of".into(), tag_of(self, vm_name, "hibernate")));
            }
            Effect::StartProbe { key, vm_id, .. } => {
                for_pods = vec![key.clone()];
                touched.push(("probe agent on".into(), vm_of(self, vm_id)));
            }
            Effect::PatchPodAnnotations {
                key, annotations, ..
            } => {
                if let Some(Some(id)) = annotations.get(ANN_VM_ID) {
                    for_pods = vec![key.clone()];
                    touched.push((format!("{ANN_VM_ID} written as"), vm_of(self, id)));
                }
            }
            Effect::PatchPodStatus { key, status, .. } => {
                let ip = status.pod_ip.clone().unwrap_or_default();
                if !ip.is_empty() {
                    if let Some(id) = self
                        .vms
                        .values()
                        .find(|v| v.ip() == ip)
                        .map(|v| v.id.clone())
                    {
                        for_pods = vec![key.clone()];
                        touched.push(("podIP written as the IP of".into(), vm_of(self, &id)));
                    }
                }
            }
            _ => {}
        }
        let mut found = Vec::new();
        for (what, thing) in touched {
            let Some((thing, Some(owner))) = thing else {
                continue;
            };
            for k in &for_pods {
                if k.namespace != owner {
                    found.push(format!(
                        "isolation: {what} {thing} of namespace {owner} issued for pod {k}"
                    ));
                }
            }
        }
        self.violations.extend(found);
    }

    // ----- API server ---------------------------------------------------------------------

    fn watch_event(&mut self, input: Input) {
        if self.watch_down_until.is_some() {
            return; // lost; the re-list after the outage carries the truth
        }
        // A watch is one ordered stream: an event never overtakes an earlier one.
        let at = (self.now + self.latency()).max(self.last_watch_at);
        self.last_watch_at = at;
        self.later(at - self.now, Delivery::Watch(input));
    }

    fn api_changed(&mut self, key: &PodKey) {
        if let Some(p) = self.api.get(key).cloned() {
            self.watch_event(Input::PodUpserted(Box::new(p)));
        }
    }

    fn api_fault(&mut self) -> Option<KubeError> {
        if !self.faults || !self.rng.chance(40) {
            return None;
        }
        self.count("api_fault");
        Some(match self.rng.below(3) {
            0 => KubeError::Other("429 Too Many Requests".into()),
            1 => KubeError::Other("500 Internal Server Error".into()),
            _ => KubeError::Other("410 Gone".into()),
        })
    }

    fn api_remove(&mut self, key: &PodKey) {
        if let Some(p) = self.api.remove(key) {
            self.watch_event(Input::PodDeleted(Box::new(p)));
        }
    }

    /// A pod write: applied at once and answered after the latency, or, with the kube lane,
    /// queued there and applied when the scheduler sends it.
    fn kube_write(&mut self, write: PodWrite) {
        if self.lane.is_some() {
            if let Some(l) = self.lane.as_mut() {
                l.lane.push(write);
                l.max_queued = l.max_queued.max(l.lane.queued());
            }
            return self.pump_lane();
        }
        let r = match self.api_fault() {
            Some(e) => Err(e),
            None => self.apply_write(&write),
        };
        let l = self.latency();
        for op in write.ops {
            self.later(
                l,
                Delivery::Input(Input::KubeDone {
                    op,
                    result: r.clone(),
                }),
            );
        }
    }

    /// What the API server does with one pod write.
    fn apply_write(&mut self, w: &PodWrite) -> Result<(), KubeError> {
        let key = &w.key;
        match &w.kind {
            WriteKind::Status { uid, status } => {
                if self.gone.contains(uid) {
                    self.violations.push(format!(
                        "{key}: status written for {uid} after its grace-0 delete"
                    ));
                }
                let p = Sim::guard(&mut self.api, key, uid)?;
                p.status = Some((**status).clone());
                match status.phase.as_deref() {
                    Some("Running") => {
                        self.ran.insert(uid.clone());
                    }
                    // The hibernate run allows two ways back: a hibernated pod is Pending
                    // with no VM, and a create that fails closed on a registry outage (a VM
                    // gone while the daemon restarted, its evidence unreadable) shows the
                    // framework's ProviderFailed status, which is Pending.
                    Some("Pending")
                        if self.ran.contains(uid)
                            && !self.hib.as_ref().is_some_and(|h| {
                                h.asked.contains(uid)
                                    || status.reason.as_deref() == Some("ProviderFailed")
                            }) =>
                    {
                        self.violations
                            .push(format!("{key}: Running pod {uid} went back to Pending"))
                    }
                    _ => {}
                }
                self.api_changed(key);
            }
            WriteKind::Annotations { uid, annotations } => {
                if uid.as_ref().is_some_and(|u| self.gone.contains(u)) {
                    self.violations.push(format!(
                        "{key}: annotations written after its grace-0 delete"
                    ));
                }
                let p = match uid {
                    Some(u) => Sim::guard(&mut self.api, key, u)?,
                    None => self.api.get_mut(key).ok_or(KubeError::NotFound)?,
                };
                let a = p.metadata.annotations.get_or_insert_with(BTreeMap::new);
                for (k, v) in annotations {
                    match v {
                        Some(v) => a.insert(k.clone(), v.clone()),
                        None => a.remove(k),
                    };
                }
                self.api_changed(key);
            }
            WriteKind::Delete { uid, grace } => {
                let p = Sim::guard(&mut self.api, key, uid)?;
                if *grace == Some(0) {
                    self.gone.insert(uid.clone());
                    self.api_remove(key);
                } else if p.metadata.deletion_timestamp.is_none() {
                    p.metadata.deletion_timestamp = Some(Time(
                        k8s_openapi::jiff::Timestamp::from_second(1).unwrap_or_default(),
                    ));
                    p.metadata.deletion_grace_period_seconds = Some(30);
                    self.api_changed(key);
                }
            }
        }
        Ok(())
    }

    /// Sends every write the lane's scheduler allows now; each lands after its latency.
    fn pump_lane(&mut self) {
        let now = self.now;
        loop {
            let Some(l) = self.lane.as_mut() else {
                return;
            };
            let Some(job) = l.lane.dispatch(now, &mut l.bucket, false) else {
                l.wake = l.lane.wake_at(now, &l.bucket, false);
                return;
            };
            let Job::Write(write) = job else {
                continue;
            };
            let max = l.max_latency_ms;
            let latency = Duration::from_millis(1 + self.rng.below(max));
            self.later(latency, Delivery::LaneWrite(write));
        }
    }

    /// A lane write reaches the API server: applied (unless a fault answers it), checked for
    /// per-pod order, and every op it carries answered.
    fn lane_write_done(&mut self, write: PodWrite) {
        let r = match self.api_fault() {
            Some(e) => Err(e),
            None => self.apply_write(&write),
        };
        if let Some(l) = self.lane.as_mut() {
            l.lane.finished(&write);
            let newest = write.ops.iter().copied().max().unwrap_or(0);
            let seen = l.applied.entry(write.key.clone()).or_default();
            if let Some(&last) = seen.last() {
                if newest <= last {
                    l.order_violations.push(format!(
                        "{}: write carrying op {newest} applied after one carrying op {last}",
                        write.key
                    ));
                }
            }
            seen.push(newest);
        }
        for op in write.ops {
            self.feed(Input::KubeDone {
                op,
                result: r.clone(),
            });
        }
        self.pump_lane();
    }

    fn guard<'a>(
        api: &'a mut BTreeMap<PodKey, Pod>,
        key: &PodKey,
        uid: &str,
    ) -> Result<&'a mut Pod, KubeError> {
        match api.get_mut(key) {
            None => Err(KubeError::NotFound),
            Some(p) if uid_of(p) != uid => Err(KubeError::Conflict),
            Some(p) => Ok(p),
        }
    }

    // ----- effects ------------------------------------------------------------------------

    fn perform(&mut self, e: Effect) {
        match e {
            Effect::Cocoon { op, cmd } => self.cocoon(op, cmd),
            // The hypervisor's pid file: there while the VM runs, unless cocoon's layout is
            // not the one the daemon knows (then the daemon asks cocoon).
            Effect::ReadVmPid { op, vm_id, .. } => {
                let running = self.vms.get(&vm_id).is_some_and(|v| v.state == "running");
                let pid = if self.faults && self.rng.chance(100) {
                    vk_cocoon::vm::PidFile::NoRunDir
                } else if running {
                    vk_cocoon::vm::PidFile::Live(100)
                } else {
                    vk_cocoon::vm::PidFile::Dead
                };
                let l = self.latency();
                self.later(l, Delivery::Input(Input::VmPidRead { op, pid }));
            }
            Effect::LookupLease { op, mac } => {
                let ip = self.vms.values().find(|v| v.mac == mac).map(|v| v.ip());
                let l = self.latency();
                self.later(
                    l,
                    Delivery::Input(Input::LeaseLooked { op, result: Ok(ip) }),
                );
            }
            Effect::PatchPodStatus { .. }
            | Effect::PatchPodAnnotations { .. }
            | Effect::DeletePod { .. } => {
                if let Some(w) = PodWrite::from_effect(&e, self.now) {
                    self.kube_write(w);
                }
            }
            Effect::PullSnapshot { .. }
            | Effect::PushSnapshot { .. }
            | Effect::DeleteSnapshotTag { .. }
            | Effect::CheckHibernateEvidence { .. }
            | Effect::ReadSnapshotTag { .. }
                if self.hib.is_some() =>
            {
                let l = self.latency();
                if let Some(d) = self.registry(&e) {
                    self.later(l, d);
                }
            }
            Effect::PullSnapshot { op, .. }
            | Effect::PushSnapshot { op, .. }
            | Effect::DeleteSnapshotTag { op, .. }
            | Effect::MaterialiseImage { op, .. } => {
                let l = self.latency();
                self.later(
                    l,
                    Delivery::Input(Input::TransferDone {
                        op,
                        result: Ok(String::new()),
                    }),
                );
            }
            // No peer holds raw snapshot files in the simulation: the core falls back.
            Effect::PeerRestore { op, .. } => {
                let l = self.latency();
                self.later(
                    l,
                    Delivery::Input(Input::TransferDone {
                        op,
                        result: Err(vk_cocoon::snapshots::TransferError::Transient(
                            "no peer in the simulation".into(),
                        )),
                    }),
                );
            }
            Effect::CheckHibernateEvidence { op, .. } => {
                let l = self.latency();
                self.later(
                    l,
                    Delivery::Input(Input::HibernateEvidence {
                        op,
                        result: Ok(None),
                    }),
                );
            }
            Effect::SacPass { op, .. } => {
                let l = self.latency();
                self.later(l, Delivery::Input(Input::SacDone { op, result: Ok(()) }));
            }
            // The simulated images are base images: their manifests name no owner.
            Effect::ReadSnapshotTag { op, .. } => {
                let l = self.latency();
                let result = Ok(Some(HibernateTag::default()));
                self.later(l, Delivery::Input(Input::HibernateEvidence { op, result }));
            }
            Effect::RecordOwners { op, changes } => {
                for c in &changes {
                    self.ledger.apply(c);
                }
                let l = self.latency();
                let result = Ok(());
                self.later(l, Delivery::Input(Input::OwnersRecorded { op, result }));
            }
            // The simulated pods name no http(s) image: nothing to refuse.
            Effect::CheckSource { op, .. } => {
                let l = self.latency();
                let verdict = vk_cocoon::provider::SourceVerdict::Allowed;
                self.later(l, Delivery::Input(Input::SourceChecked { op, verdict }));
            }
            // The simulated pods are cocoon guests: no macOS QEMU runs here.
            Effect::CheckPid { op, .. } => {
                let l = self.latency();
                let alive = false;
                self.later(l, Delivery::Input(Input::PidChecked { op, alive }));
            }
            Effect::StartProbe {
                key, uid, vm_id, ..
            } => {
                self.probes.insert(key.clone(), (uid, vm_id));
                let l = self.latency();
                self.later(l, Delivery::Probe(key));
            }
            Effect::StopProbe { key } => {
                self.probes.remove(&key);
            }
            Effect::Event { .. }
            | Effect::ReleaseLeases { .. }
            | Effect::RemoveStagedDir { .. }
            | Effect::Metric(_) => {}
        }
    }

    /// `vm rm`: a running VM is never removed while a live pod that is not being deleted
    /// (nor failed) names it.
    fn removed(&mut self, id: &str) -> Option<SimVm> {
        let v = self.vms.remove(id)?;
        if v.state == "running" {
            // The attacker's pods name victims' VMs: they own none of them.
            let owner = self.api.iter().find(|(k, p)| {
                k.namespace != EVIL
                    && p.metadata.deletion_timestamp.is_none()
                    && !matches!(
                        p.status.as_ref().and_then(|s| s.phase.as_deref()),
                        Some("Failed" | "Succeeded")
                    )
                    && p.metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get(ANN_VM_NAME))
                        == Some(&v.name)
            });
            // A pod that asked for hibernate has its VM removed by the hibernate itself (the
            // wish may have flipped back while the removal was on its way).
            let hibernating = owner.is_some_and(|(_, p)| {
                self.hib
                    .as_ref()
                    .is_some_and(|h| h.asked.contains(&uid_of(p)))
            });
            if let Some((key, _)) = owner.filter(|_| !hibernating) {
                self.violations
                    .push(format!("{key}: its running vm {} removed", v.id));
            }
        }
        Some(v)
    }

    /// cocoon's resolution of a VM reference: an exact ID, an exact name, or an ID prefix of
    /// 3+ characters that only one VM has.
    fn find_vm(&self, r: &str) -> Option<String> {
        if self.vms.contains_key(r) {
            return Some(r.to_string());
        }
        if let Some(v) = self.vms.values().find(|v| v.name == r) {
            return Some(v.id.clone());
        }
        if r.len() < 3 {
            return None;
        }
        let mut prefixed = self
            .vms
            .range(r.to_string()..)
            .take_while(|(id, _)| id.starts_with(r));
        match (prefixed.next(), prefixed.next()) {
            (Some((id, _)), None) => Some(id.clone()),
            _ => None,
        }
    }

    fn cocoon(&mut self, op: OpId, cmd: CocoonCmd) {
        // Fault kinds of fork runs: the fork snapshot save fails outright (nothing saved), or
        // its process dies half-way (OOM-killed, or killed with a daemon that died) leaving a
        // half-saved record that holds the name.
        if let CocoonCmd::SnapshotSave { name, .. } = &cmd {
            if name.starts_with("fork-") && self.faults {
                let roll = self.rng.below(1000);
                if roll < 200 {
                    self.count("fork_save_fail");
                    let result = Answer::failed("Error: save: injected failure");
                    let l = self.latency();
                    return self.later(l, Delivery::Input(Input::CocoonDone { op, result }));
                }
                if roll < 350 && !self.fork_snaps.contains_key(name) {
                    self.count("fork_save_half");
                    self.next_snap += 1;
                    let holder = format!("HALF{}", self.next_snap);
                    self.fork_snaps.insert(name.clone(), Some(holder));
                    let result = Answer::failed("signal: killed");
                    let l = self.latency();
                    return self.later(l, Delivery::Input(Input::CocoonDone { op, result }));
                }
            }
        }
        // The snapshot reclaimer's listing is answered at once and draws nothing from the
        // generator. It shows what exists: the complete fork snapshots and the hibernate run's
        // local snapshots (a half-saved record is invisible, as in cocoon).
        if cmd == CocoonCmd::SnapshotList {
            let forks = self
                .fork_snaps
                .iter()
                .filter(|(_, holder)| holder.is_none())
                .map(|(name, _)| (format!("F{name}"), name.clone()));
            let local = self.hib.iter().flat_map(|h| {
                h.snapshots
                    .iter()
                    .map(|(name, id)| (id.clone(), name.clone()))
            });
            let items: Vec<String> = forks
                .chain(local)
                .map(|(id, name)| format!(r#"{{"id":"{id}","name":"{name}"}}"#))
                .collect();
            let result = Answer::ok(format!("[{}]", items.join(",")));
            self.later(
                Duration::ZERO,
                Delivery::Input(Input::CocoonDone { op, result }),
            );
            return;
        }
        let fail = self.faults && self.rng.chance(30);
        let hang = self.faults && !fail && self.rng.chance(10);
        let result = if fail {
            self.count("cocoon_fail");
            Answer::failed("Error: transient backend failure")
        } else {
            let r = self.cocoon_exec(&cmd, hang);
            if hang {
                self.count("cocoon_hang");
                Answer::timed_out_call()
            } else {
                r
            }
        };
        let delay = if hang { cmd.deadline() } else { self.latency() };
        self.later(delay, Delivery::Input(Input::CocoonDone { op, result }));
    }

    fn cocoon_exec(&mut self, cmd: &CocoonCmd, hang: bool) -> Answer {
        if let Some(r) = self.snapshot_verb(cmd) {
            return r;
        }
        match cmd {
            CocoonCmd::VmClone(a) => {
                if let vk_cocoon::vm::CloneSource::Snapshot(src) = &a.source {
                    if let Some(source) = src.strip_prefix("fork-") {
                        if !matches!(self.fork_snaps.get(src), Some(None)) {
                            return Answer::failed(format!(
                                "Error: clone: snapshot \"{src}\": snapshot not found"
                            ));
                        }
                        let saved_from = self.fork_saved_from.get(src).cloned();
                        let now_named = self.find_vm(source);
                        if now_named.is_some() && saved_from != now_named {
                            self.violations.push(format!(
                                "vm {} cloned from stale {src} (saved from {saved_from:?}, \
                                 {source} is now {now_named:?})",
                                a.name
                            ));
                        }
                    }
                }
                if let Some(id) = self.find_vm(&a.name) {
                    return Answer::failed(format!(
                        "vm name \"{}\" already exists (id: {id})",
                        a.name
                    ));
                }
                let n = self.next_vm;
                self.next_vm += 1;
                let vm = SimVm {
                    id: format!("VM{n:05}"),
                    name: a.name.clone(),
                    // A hung clone may leave a half-made record behind.
                    state: if hang && self.rng.chance(500) {
                        "creating".into()
                    } else {
                        "running".into()
                    },
                    mac: format!(
                        "02:00:00:{:02x}:{:02x}:{:02x}",
                        (n >> 16) & 255,
                        (n >> 8) & 255,
                        n & 255
                    ),
                };
                // cocoon's clone answers before it reads the PID back: pid 0.
                let json = vm.json().replace(r#""pid":100"#, r#""pid":0"#);
                let (id, name) = (vm.id.clone(), vm.name.clone());
                self.own(|a, ns| {
                    a.vm_owner.insert(id, ns.clone());
                    a.vm_name_owner.insert(name, ns);
                });
                self.vms.insert(vm.id.clone(), vm);
                Answer::ok(json)
            }
            CocoonCmd::VmRun(_) => Answer::failed("sim: run not used"),
            CocoonCmd::VmInspect { reference } => match self.find_vm(reference) {
                Some(id) => Answer::ok(self.vms[&id].json()),
                None => Answer::failed(format!("Error: inspect: vm {reference}: VM not found")),
            },
            CocoonCmd::VmStart { id } => {
                match self.find_vm(id).and_then(|i| self.vms.get_mut(&i)) {
                    Some(v) => {
                        v.state = "running".into();
                        Answer::ok("")
                    }
                    None => Answer::failed(format!("vm {id}: VM not found")),
                }
            }
            CocoonCmd::VmRm { id } => match self.find_vm(id).and_then(|i| self.removed(&i)) {
                Some(v) => {
                    let info = v.info();
                    let l = self.latency();
                    self.later(
                        l,
                        Delivery::Input(Input::VmEvent {
                            kind: VmEventKind::Deleted,
                            vm: info,
                        }),
                    );
                    Answer::ok("")
                }
                None => Answer::failed(format!("vm {id}: VM not found")),
            },
            CocoonCmd::ReconcileStaleCreate { id } => match self.vms.get(id) {
                Some(v) if v.state == "creating" => {
                    self.vms.remove(id);
                    Answer::ok(format!(r#"{{"id":"{id}","outcome":"collected"}}"#))
                }
                Some(_) => Answer::ok(format!(r#"{{"id":"{id}","outcome":"not-creating"}}"#)),
                None => Answer::ok(r#"{"outcome":"not-found"}"#),
            },
            CocoonCmd::SnapshotInspect { name } if name.starts_with("fork-") => {
                match self.fork_snaps.get(name) {
                    Some(None) => Answer::ok(format!(
                        r#"{{"id":"F{name}","name":"{name}","hypervisor":"cloud-hypervisor"}}"#
                    )),
                    // A half-saved record is invisible.
                    _ => Answer::failed("Error: inspect: snapshot not found"),
                }
            }
            CocoonCmd::SnapshotRm { name } if self.fork_snap_ref(name).is_some() => {
                if let Some(n) = self.fork_snap_ref(name) {
                    self.fork_snaps.remove(&n);
                    self.fork_saved_from.remove(&n);
                }
                Answer::ok("")
            }
            CocoonCmd::SnapshotSave { name, vm_id, .. } if name.starts_with("fork-") => {
                match self.vms.get(vm_id) {
                    Some(v) if v.state == "running" => {}
                    Some(_) => return Answer::failed(format!("save: vm {vm_id} is not running")),
                    None => return Answer::failed(format!("save: vm {vm_id}: VM not found")),
                }
                match self.fork_snaps.get(name) {
                    Some(None) => {
                        return Answer::failed(format!(
                            "Error: snapshot name \"{name}\" already exists"
                        ))
                    }
                    Some(Some(h)) => {
                        return Answer::failed(format!(
                            "Error: snapshot name \"{name}\" already in use by {h}"
                        ))
                    }
                    None => {}
                }
                self.count("fork_save");
                self.fork_snaps.insert(name.clone(), None);
                self.fork_saved_from.insert(name.clone(), vm_id.clone());
                Answer::ok("")
            }
            CocoonCmd::SnapshotInspect { name } if name == "team/agent:v1" => Answer::ok(
                r#"{"id":"SNAP1","name":"team/agent:v1","hypervisor":"cloud-hypervisor"}"#,
            ),
            CocoonCmd::SnapshotInspect { .. } => Answer::failed("snapshot not found"),
            CocoonCmd::SnapshotRm { .. } => Answer::failed("rm: snapshot not found"),
            CocoonCmd::SnapshotSave { .. } => Answer::ok(""),
            CocoonCmd::SnapshotList => Answer::ok("[]"),
            CocoonCmd::ImageInspect { .. } | CocoonCmd::ImagePull { .. } => Answer::ok("{}"),
            CocoonCmd::VmNet { .. } => Answer::ok(""),
            CocoonCmd::VmExec { id, .. } => match self.find_vm(id).and_then(|i| self.vms.get(&i)) {
                Some(v) if v.state == "running" => Answer::ok(""),
                _ => Answer::failed(format!("exec: vm {id} is not running")),
            },
            CocoonCmd::Macos(_) => Answer::failed("Error: cocoon-macos is not simulated"),
        }
    }

    /// The fork snapshot `r` resolves to for `snapshot rm`: a complete one by name, a
    /// half-saved one by its holder id.
    fn fork_snap_ref(&self, r: &str) -> Option<String> {
        self.fork_snaps
            .iter()
            .find(|(n, h)| (*n == r && h.is_none()) || h.as_deref() == Some(r))
            .map(|(n, _)| n.clone())
    }

    // ----- world actions ------------------------------------------------------------------

    fn restart_provider(&mut self) {
        self.count("restart");
        self.epoch += 1;
        self.probes.clear();
        self.provider = Provider::new(self.config());
        if let Some(l) = self.lane.as_mut() {
            // The lane dies with the process: queued writes are lost, in-flight ones may or
            // may not land (their deliveries belong to the old epoch and are dropped), and the
            // new provider numbers its ops afresh.
            let limits = lane_limits();
            l.lane = KubeLane::new(limits);
            l.applied.clear();
            l.wake = None;
        }
        let pods: Vec<Pod> = self.api.values().cloned().collect();
        let vms: Vec<VmInfo> = self.vms.values().map(|v| v.info()).collect();
        let owners = self.ledger.clone();
        self.feed(Input::StartupListed { pods, vms, owners });
    }

    fn operator(&mut self) {
        // Recreate desired pods that are absent (after eviction or deletion by the chaos).
        let names: Vec<(String, Option<String>)> = self
            .desired
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (name, vm) in names {
            let key = PodKey::new("sim", &name);
            if !self.api.contains_key(&key) {
                let uid = format!("uid-{}", self.next_uid);
                self.next_uid += 1;
                let mut pod = new_pod(&name, &uid, vm.as_deref(), 1);
                if let Some(source) = self.fork_of.get(&name) {
                    if let Some(a) = pod.metadata.annotations.as_mut() {
                        a.insert(ANN_FORK_FROM.into(), source.clone());
                    }
                }
                self.api.insert(key.clone(), pod);
                self.api_changed(&key);
            }
        }
        let team: Vec<(String, String)> = self
            .attack
            .iter()
            .flat_map(|a| a.team.iter().map(|(k, v)| (k.clone(), v.clone())))
            .collect();
        for (name, vm) in team {
            let key = PodKey::new(TEAM, &name);
            if !self.api.contains_key(&key) {
                let uid = format!("uid-{}", self.next_uid);
                self.next_uid += 1;
                let pod = new_pod_in(TEAM, &name, &uid, Some(&vm), 1);
                self.api.insert(key.clone(), pod);
                self.api_changed(&key);
            }
        }
    }

    /// The victims' live pods with their VM names (`sim` and `evil-team`).
    fn victims(&self) -> Vec<(PodKey, String)> {
        self.api
            .iter()
            .filter(|(k, p)| k.namespace != EVIL && p.metadata.deletion_timestamp.is_none())
            .filter_map(|(k, p)| {
                let vm = p.metadata.annotations.as_ref()?.get(ANN_VM_NAME)?;
                Some((k.clone(), vm.clone()))
            })
            .collect()
    }

    fn evil_pods(&self) -> Vec<PodKey> {
        self.api
            .iter()
            .filter(|(k, p)| k.namespace == EVIL && p.metadata.deletion_timestamp.is_none())
            .map(|(k, _)| k.clone())
            .collect()
    }

    fn pick<T: Clone>(&mut self, xs: &[T]) -> Option<T> {
        (!xs.is_empty()).then(|| xs[self.rng.below(xs.len() as u64) as usize].clone())
    }

    /// One move of the attacker: a new pod trying one of the rules at random, a tracked pod
    /// renaming its VM to a victim's, a hibernate toggle, or a delete.
    fn attack_step(&mut self) {
        let evil = self.evil_pods();
        match self.rng.below(10) {
            0..=5 if evil.len() < 24 => self.attacker_pod(),
            6 => {
                // A tracked attacker pod renames its VM to a victim's.
                let running: Vec<PodKey> = evil
                    .into_iter()
                    .filter(|k| {
                        self.api.get(k).is_some_and(|p| {
                            p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                        })
                    })
                    .collect();
                let (Some(k), Some((_, vm))) = (self.pick(&running), {
                    let v = self.victims();
                    self.pick(&v)
                }) else {
                    return;
                };
                if let Some(p) = self.api.get_mut(&k) {
                    let a = p.metadata.annotations.get_or_insert_with(BTreeMap::new);
                    a.insert(ANN_VM_NAME.into(), vm);
                    self.api_changed(&k);
                    self.count("attack_rename");
                }
            }
            7..=8 => {
                // Hibernate toggles on the attacker's pods (some named like victims) and on
                // the victims of `evil-team`.
                let team: Vec<PodKey> = self
                    .api
                    .keys()
                    .filter(|k| k.namespace == TEAM)
                    .cloned()
                    .collect();
                let all: Vec<PodKey> = evil.into_iter().chain(team).collect();
                let Some(k) = self.pick(&all) else {
                    return;
                };
                if let Some(p) = self.api.get_mut(&k) {
                    let uid = uid_of(p);
                    let a = p.metadata.annotations.get_or_insert_with(BTreeMap::new);
                    let on = a.get(ANN_HIBERNATE).map(String::as_str) != Some("true");
                    a.insert(ANN_HIBERNATE.into(), on.to_string());
                    if let Some(h) = self.hib.as_mut() {
                        h.asked.insert(uid);
                    }
                    self.api_changed(&k);
                    self.count("attack_hibernate_toggle");
                }
            }
            _ => {
                let Some(k) = self.pick(&evil) else {
                    return;
                };
                if let Some(p) = self.api.get_mut(&k) {
                    p.metadata.deletion_timestamp = Some(Time(
                        k8s_openapi::jiff::Timestamp::from_second(1).unwrap_or_default(),
                    ));
                    p.metadata.deletion_grace_period_seconds = Some(30);
                    self.api_changed(&k);
                    self.count("attack_delete");
                }
            }
        }
    }

    /// A new attacker pod in namespace `evil`, pointing at a victim's resources by one rule.
    fn attacker_pod(&mut self) {
        let victims = self.victims();
        let Some((vkey, vname)) = self.pick(&victims) else {
            return;
        };
        let victim_vms: Vec<(String, String)> = self
            .vms
            .values()
            .filter(|v| {
                self.attack
                    .as_ref()
                    .is_some_and(|a| a.vm_owner.get(&v.id).is_some_and(|o| o != EVIL))
            })
            .map(|v| (v.id.clone(), v.name.clone()))
            .collect();
        let Some(a) = self.attack.as_mut() else {
            return;
        };
        a.next += 1;
        let n = a.next;
        let mut name = format!("a{n}");
        let own = format!("vk-evil-a{n}");
        let mut vm = own.clone();
        let mut ann: Vec<(&str, String)> = Vec::new();
        let rule = match self.rng.below(6) {
            // Its VM name is a victim's: refused by name (`sim`), or admitted by name and
            // refused by the holder or the ledger (`evil-team`, re-parsed as pod
            // `team-<pod>` of `evil`), with or without an explicit restore of its tag.
            0 => {
                if vkey.namespace == TEAM {
                    name = format!("team-{}", vkey.name);
                    if self.rng.chance(400) {
                        ann.push((ANN_RESTORE, "true".into()));
                    }
                }
                vm = vname;
                "attack_vm_name"
            }
            // Its id annotation is a victim VM's id or a 3+ character prefix of it, managed
            // (adoption by id) or unmanaged (the id is the VM), under its own or the
            // victim's VM name.
            1 => {
                let Some((id, victim_name)) = self.pick(&victim_vms) else {
                    return;
                };
                let cut = 3 + self.rng.below(id.len() as u64 - 2) as usize;
                ann.push((ANN_VM_ID, id[..cut.min(id.len())].to_string()));
                if self.rng.chance(500) {
                    ann.push((ANN_MANAGED, "false".into()));
                    ann.push((ANN_VM_IP, "192.0.2.7".into()));
                }
                if self.rng.chance(500) {
                    vm = victim_name;
                }
                "attack_vm_id"
            }
            // Its image is a victim VM's snapshot: the local `<vm>` of a hibernate, or the
            // registry's `<vm>:hibernate`.
            2 => {
                let image = if self.rng.chance(500) {
                    vname
                } else {
                    format!("{vname}:hibernate")
                };
                ann.push((ANN_IMAGE, image));
                "attack_image"
            }
            // It forks a victim's VM.
            3 => {
                ann.push((ANN_FORK_FROM, vname));
                "attack_fork"
            }
            // Named like a victim pod, its own VM name, hibernating at times: its snapshots,
            // tags and imports sit beside the victim's.
            _ => {
                let like = if vkey.namespace == TEAM {
                    format!("team-{}", vkey.name)
                } else {
                    vkey.name.clone()
                };
                if !self.api.contains_key(&PodKey::new(EVIL, &like)) {
                    name = like;
                }
                vm = format!("vk-evil-{name}");
                if self.rng.chance(300) {
                    ann.push((ANN_HIBERNATE, "true".into()));
                }
                "attack_lookalike"
            }
        };
        let key = PodKey::new(EVIL, &name);
        if self.api.contains_key(&key) {
            return;
        }
        let uid = format!("uid-{}", self.next_uid);
        self.next_uid += 1;
        let mut pod = new_pod_in(EVIL, &name, &uid, Some(&vm), 1);
        if let Some(a) = pod.metadata.annotations.as_mut() {
            for (k, v) in ann {
                if k == ANN_HIBERNATE {
                    if let Some(h) = self.hib.as_mut() {
                        h.asked.insert(uid.clone());
                    }
                }
                a.insert(k.into(), v);
            }
        }
        self.api.insert(key.clone(), pod);
        self.api_changed(&key);
        self.count(rule);
    }

    fn chaos_step(&mut self, n_pods: &mut u64) {
        match self.rng.below(100) {
            0..=9 => {
                // A user deletes a pod (graceful: the API sets deletionTimestamp).
                let pick = self.pick_desired();
                if let Some(name) = pick.filter(|n| !self.fork_protected(n)) {
                    self.desired.remove(&name);
                    let key = PodKey::new("sim", &name);
                    if let Some(p) = self.api.get_mut(&key) {
                        if p.metadata.deletion_timestamp.is_none() {
                            p.metadata.deletion_timestamp = Some(Time(
                                k8s_openapi::jiff::Timestamp::from_second(1).unwrap_or_default(),
                            ));
                            p.metadata.deletion_grace_period_seconds = Some(30);
                            self.api_changed(&key);
                        }
                    }
                    self.count("user_delete");
                }
            }
            10..=19 => {
                let i = *n_pods;
                *n_pods += 1;
                self.desired
                    .insert(format!("p{i}"), Some(format!("vk-sim-p{i}")));
                self.count("scale_up");
            }
            20..=29 => {
                // A generation bump / label change on a live pod.
                if let Some(name) = self.pick_desired() {
                    let key = PodKey::new("sim", &name);
                    if let Some(p) = self.api.get_mut(&key) {
                        let a = p.metadata.annotations.get_or_insert_with(BTreeMap::new);
                        let g: u64 = a
                            .get(ANN_GENERATION)
                            .and_then(|g| g.parse().ok())
                            .unwrap_or(0);
                        a.insert(ANN_GENERATION.into(), (g + 1).to_string());
                        self.api_changed(&key);
                        self.count("update");
                    }
                }
            }
            30..=37 => {
                // A VM crashes (stopped) or vanishes.
                let ids: Vec<String> = self.vms.keys().cloned().collect();
                if !ids.is_empty() {
                    let id = ids[self.rng.below(ids.len() as u64) as usize].clone();
                    if self.rng.chance(500) {
                        if let Some(v) = self.vms.remove(&id) {
                            let l = self.latency();
                            self.later(
                                l,
                                Delivery::Input(Input::VmEvent {
                                    kind: VmEventKind::Deleted,
                                    vm: v.info(),
                                }),
                            );
                            self.count("vm_vanish");
                        }
                    } else if let Some(v) = self.vms.get_mut(&id) {
                        v.state = "stopped".into();
                        let info = v.info();
                        let l = self.latency();
                        self.later(
                            l,
                            Delivery::Input(Input::VmEvent {
                                kind: VmEventKind::Modified,
                                vm: info,
                            }),
                        );
                        self.count("vm_crash");
                    }
                }
            }
            38..=40 if self.watch_down_until.is_none() => {
                let d = Duration::from_millis(200 + self.rng.below(3000));
                self.watch_down_until = Some(self.now + d);
                self.count("watch_drop");
            }
            41 => self.restart_provider(),
            42..=44 if !self.fork_of.is_empty() => {
                // Fork runs: the source pod is replaced (deleted, and recreated by the
                // operator); its fresh bring-up drops `fork-<source>`, so forks save again.
                let key = PodKey::new("sim", "src");
                if let Some(p) = self.api.get_mut(&key) {
                    if p.metadata.deletion_timestamp.is_none() {
                        p.metadata.deletion_timestamp = Some(Time(
                            k8s_openapi::jiff::Timestamp::from_second(1).unwrap_or_default(),
                        ));
                        p.metadata.deletion_grace_period_seconds = Some(30);
                        self.api_changed(&key);
                        self.count("fork_source_replaced");
                    }
                }
            }
            42..=51 if self.hib.is_some() => {
                // The operator asks a live pod to hibernate, or to wake.
                if let Some(name) = self.pick_desired() {
                    let key = PodKey::new("sim", &name);
                    if let Some(p) = self.api.get_mut(&key) {
                        let uid = uid_of(p);
                        let a = p.metadata.annotations.get_or_insert_with(BTreeMap::new);
                        let on = a.get(ANN_HIBERNATE).map(String::as_str) != Some("true");
                        a.insert(ANN_HIBERNATE.into(), on.to_string());
                        if let Some(h) = self.hib.as_mut() {
                            h.asked.insert(uid);
                        }
                        self.api_changed(&key);
                        self.count(if on { "hibernate" } else { "wake" });
                    }
                }
            }
            54..=61 if self.attack.is_some() => self.attack_step(),
            52..=53 if self.hib.is_some() && !self.registry_down() => {
                let d = Duration::from_millis(200 + self.rng.below(3000));
                let until = self.now + d;
                if let Some(h) = self.hib.as_mut() {
                    h.registry_down_until = Some(until);
                    self.count("registry_down");
                }
            }
            _ => {}
        }
    }

    /// A fork pod or a fork source: kept by the chaos (it still crashes their VMs).
    fn fork_protected(&self, name: &str) -> bool {
        self.fork_of.contains_key(name)
            || self
                .fork_of
                .values()
                .any(|src| self.desired.get(name) == Some(&Some(src.clone())))
    }

    fn pick_desired(&mut self) -> Option<String> {
        let live: Vec<String> = self.desired.keys().cloned().collect();
        if live.is_empty() {
            return None;
        }
        Some(live[self.rng.below(live.len() as u64) as usize].clone())
    }

    /// Advance virtual time to `until`, delivering everything due in order.
    fn run_until(&mut self, until: Instant) {
        loop {
            let next_q = self.queue.peek().map(|Reverse((t, _, _))| *t);
            let next_p = self.provider.poll_timeout();
            let next_l = self.lane.as_ref().and_then(|l| l.wake);
            let next = [next_q, next_p, self.watch_down_until, next_l]
                .into_iter()
                .flatten()
                .min();
            let Some(next) = next.filter(|t| *t <= until) else {
                self.advance_to(until);
                return;
            };
            self.advance_to(next);
            if let Some(w) = self.watch_down_until {
                if w <= self.now {
                    self.watch_down_until = None;
                    let pods: Vec<Pod> = self.api.values().cloned().collect();
                    self.feed(Input::PodsRelisted(pods));
                    continue;
                }
            }
            if next_q == Some(next) {
                let Some(Reverse((_, seq, epoch))) = self.queue.pop() else {
                    continue;
                };
                let Some((_, d)) = self.pending.remove(&seq) else {
                    continue;
                };
                if epoch != self.epoch {
                    continue; // owed to a provider that no longer exists
                }
                match d {
                    Delivery::Input(i) => self.feed(i),
                    Delivery::Watch(i) => {
                        if self.watch_down_until.is_none() {
                            self.feed(i)
                        }
                    }
                    Delivery::LaneWrite(w) => self.lane_write_done(w),
                    Delivery::Probe(key) => self.probe(key),
                }
            } else if next_l == Some(next) {
                if let Some(l) = self.lane.as_mut() {
                    l.wake = None;
                }
                self.pump_lane();
            } else {
                self.feed(Input::Tick);
            }
        }
    }

    /// One probe: ready when the pod's VM runs (its IP answers), then probe again later.
    fn probe(&mut self, key: PodKey) {
        let Some((uid, vm_id)) = self.probes.get(&key).cloned() else {
            return;
        };
        let vm = self.vms.get(&vm_id).filter(|v| v.state == "running");
        let (ready, message, ip) = match vm {
            Some(v) => (true, "ping ok", v.ip()),
            None => (false, "ping failed", String::new()),
        };
        self.feed(Input::Readiness {
            key: key.clone(),
            uid,
            ready,
            message: message.into(),
            ip: Some(ip),
        });
        self.later(Duration::from_millis(500), Delivery::Probe(key));
    }

    fn advance_to(&mut self, t: Instant) {
        if t > self.now {
            self.wall += t - self.now;
            self.now = t;
        }
    }

    /// Whether the attacker holds a VM or tag under the name `vm_name` it made itself.
    fn squatted(&self, vm_name: &str) -> bool {
        self.attack.as_ref().is_some_and(|a| {
            a.vm_name_owner.get(vm_name).map(String::as_str) == Some(EVIL)
                || a.tag_owner
                    .get(&format!("{vm_name}:hibernate"))
                    .map(String::as_str)
                    == Some(EVIL)
        })
    }

    /// How an attacker pod ended: Failed, or without a VM, or on a VM of its own namespace
    /// (a pod that named only its own things). Never on another namespace's VM (the one the
    /// core tracks for it, or the one whose IP its status shows).
    fn attacker_end(
        &self,
        key: &PodKey,
        pod: &Pod,
        live_vm_names: &mut std::collections::BTreeSet<String>,
    ) -> Vec<String> {
        let Some(a) = self.attack.as_ref() else {
            return Vec::new();
        };
        let mut held: Vec<(&str, String)> = Vec::new();
        if let Some(v) = self.provider.pod_vm(key) {
            live_vm_names.insert(v.name.clone());
            held.push(("tracked on", v.id.clone()));
        }
        let ip = pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.clone())
            .unwrap_or_default();
        if let Some(v) = self.vms.values().find(|v| !ip.is_empty() && v.ip() == ip) {
            held.push(("showing the IP of", v.id.clone()));
        }
        // Its own VM under the name it gave (a renamed pod's tracked VM is added above).
        let own_name = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ANN_VM_NAME))
            .filter(|n| a.vm_name_owner.get(*n).map(String::as_str) == Some(EVIL));
        if let Some(n) = own_name {
            live_vm_names.insert(n.clone());
        }
        held.into_iter()
            .filter(|(_, id)| a.vm_owner.get(id).map(String::as_str) != Some(EVIL))
            .map(|(how, id)| {
                format!(
                    "{key}: attacker pod ends {how} vm {id} of namespace {:?}",
                    a.vm_owner.get(&id)
                )
            })
            .collect()
    }

    fn check_invariants(&self, seed: u64) -> Vec<String> {
        let mut errs: Vec<String> = self.violations.iter().take(20).cloned().collect();
        let mut by_name: BTreeMap<&str, Vec<&SimVm>> = BTreeMap::new();
        for v in self.vms.values() {
            by_name.entry(v.name.as_str()).or_default().push(v);
        }
        let mut live_vm_names: std::collections::BTreeSet<String> = Default::default();
        for (key, pod) in &self.api {
            if pod.metadata.deletion_timestamp.is_some() {
                errs.push(format!("{key}: still terminating"));
                continue;
            }
            let ann = pod.metadata.annotations.clone().unwrap_or_default();
            let Some(vm_name) = ann.get(ANN_VM_NAME) else {
                let st = pod.status.clone().unwrap_or_default();
                if st.reason.as_deref() != Some("ProviderFailed") {
                    errs.push(format!(
                        "{key}: bad pod without ProviderFailed status: {st:?}"
                    ));
                }
                continue;
            };
            if key.namespace == EVIL {
                errs.extend(self.attacker_end(key, pod, &mut live_vm_names));
                continue;
            }
            live_vm_names.insert(vm_name.clone());
            // A victim of `evil-team` whose name (of two readings) the attacker took first has
            // lost it by the rules: first come, the ledger then settles it.
            if key.namespace == TEAM && self.squatted(vm_name) {
                continue;
            }
            let vms = by_name.get(vm_name.as_str()).cloned().unwrap_or_default();
            if ann.get(ANN_HIBERNATE).is_some_and(|h| h == "true") {
                let st = pod.status.clone().unwrap_or_default();
                let tagged = self
                    .hib
                    .as_ref()
                    .is_some_and(|h| h.tags.contains_key(vm_name));
                // A pod that never ran has nothing to hibernate: no tag is owed for it.
                let ran = self.ran.contains(&uid_of(pod));
                if !vms.is_empty()
                    || (ran && !tagged)
                    || ann.get(ANN_LIFECYCLE_STATE).map(String::as_str) != Some("hibernated")
                    || ann.contains_key(ANN_VM_ID)
                    || st.phase.as_deref() != Some("Pending")
                {
                    errs.push(format!(
                        "{key}: asks for hibernate but has {} VMs, tag {tagged}, phase {:?}, \
                         annotations {:?}",
                        vms.len(),
                        st.phase,
                        ann.iter()
                            .filter(|(k, _)| k.contains("lifecycle") || k.ends_with("/id"))
                            .collect::<Vec<_>>()
                    ));
                }
                continue;
            }
            if vms.len() != 1 {
                errs.push(format!("{key}: {} VMs named {vm_name}", vms.len()));
                continue;
            }
            let vm = vms[0];
            if vm.state != "running" {
                errs.push(format!("{key}: vm {} is {}", vm.id, vm.state));
            }
            let st = pod.status.clone().unwrap_or_default();
            if st.phase.as_deref() != Some("Running") || !status::is_ready(&st) {
                errs.push(format!(
                    "{key}: status not Running+Ready: {:?} {:?}, lifecycle annotations {:?}",
                    st.phase,
                    status::summary(&st),
                    ann.iter()
                        .filter(|(k, _)| k.contains("lifecycle"))
                        .collect::<Vec<_>>()
                ));
            }
            if st.pod_ip.as_deref() != Some(vm.ip().as_str()) {
                errs.push(format!(
                    "{key}: podIP {:?} but vm ip {}",
                    st.pod_ip,
                    vm.ip()
                ));
            }
            if ann.get(ANN_VM_ID) != Some(&vm.id) {
                errs.push(format!(
                    "{key}: id annotation {:?} but vm {}",
                    ann.get(ANN_VM_ID),
                    vm.id
                ));
            }
        }
        for v in self.vms.values() {
            if !live_vm_names.contains(&v.name) {
                errs.push(format!("orphan vm {} ({}) state {}", v.id, v.name, v.state));
            }
        }
        if !errs.is_empty() {
            errs.insert(
                0,
                format!("seed {seed}: {} invariant violations", errs.len()),
            );
        }
        errs
    }
}

/// The lane's worker slots as the daemon sizes them.
fn lane_limits() -> LaneLimits {
    LaneLimits {
        slots: 16,
        ..LaneLimits::default()
    }
}

/// How the simulated daemon reaches the API server.
#[derive(Clone, Copy)]
enum ApiPath {
    /// Every write at once, answered within 30 ms (the core alone).
    Direct,
    /// Through the kube lane at `qps` (burst = qps), answers within `max_latency_ms`.
    Lane { qps: u32, max_latency_ms: u64 },
}

fn run_seed(seed: u64, pods: u64, path: ApiPath) -> (Vec<String>, BTreeMap<&'static str, u64>) {
    run_world(seed, pods, path, 0, false)
}

/// One seeded run. `forks`: that many pods fork the VM of one source pod (0: no fork-from in
/// the run); `hibernate`: the hibernate run (registry, toggles, its faults).
fn run_world(
    seed: u64,
    pods: u64,
    path: ApiPath,
    forks: u64,
    hibernate: bool,
) -> (Vec<String>, BTreeMap<&'static str, u64>) {
    run_world_with(seed, pods, path, forks, hibernate, false)
}

/// The attacker run: the hibernate run with the victims of `evil-team` and the attacker
/// namespace `evil` (see `SimAttack`).
fn run_attack(seed: u64, pods: u64) -> (Vec<String>, BTreeMap<&'static str, u64>) {
    run_world_with(seed, pods, ApiPath::Direct, 0, true, true)
}

fn run_world_with(
    seed: u64,
    pods: u64,
    path: ApiPath,
    forks: u64,
    hibernate: bool,
    attack: bool,
) -> (Vec<String>, BTreeMap<&'static str, u64>) {
    let mut sim = Sim::new(seed);
    if hibernate || attack {
        sim.hib = Some(SimHibernate::default());
        sim.provider = Provider::new(sim.config());
    }
    if attack {
        let team = (0..6)
            .map(|i| (format!("p{i}"), format!("vk-{TEAM}-p{i}")))
            .collect();
        sim.attack = Some(SimAttack {
            team,
            ..Default::default()
        });
    }
    if let ApiPath::Lane {
        qps,
        max_latency_ms,
    } = path
    {
        sim.lane = Some(SimLane {
            lane: KubeLane::new(lane_limits()),
            bucket: TokenBucket::new(f64::from(qps), qps, sim.now),
            max_latency_ms,
            wake: None,
            applied: HashMap::new(),
            order_violations: Vec::new(),
            max_queued: 0,
        });
    }
    sim.feed(Input::StartupListed {
        pods: vec![],
        vms: vec![],
        owners: Default::default(),
    });
    let mut n = 0u64;
    for _ in 0..pods {
        sim.desired
            .insert(format!("p{n}"), Some(format!("vk-sim-p{n}")));
        n += 1;
    }
    for i in 0..5 {
        sim.desired.insert(format!("bad{i}"), None);
    }
    if forks > 0 {
        sim.desired.insert("src".into(), Some("vk-sim-src".into()));
        for i in 0..forks {
            sim.desired
                .insert(format!("fork{i}"), Some(format!("vk-sim-fork{i}")));
            sim.fork_of.insert(format!("fork{i}"), "vk-sim-src".into());
        }
    }
    // Chaos phase: 60 s of virtual time, a world action every ~50 ms.
    let chaos_end = sim.start + Duration::from_secs(60);
    while sim.now < chaos_end {
        sim.operator();
        sim.chaos_step(&mut n);
        let step = Duration::from_millis(10 + sim.rng.below(80));
        let t = sim.now + step;
        sim.run_until(t);
    }
    // Calm phase: no faults; the operator keeps recreating; everything must converge.
    sim.faults = false;
    if let Some(w) = sim.watch_down_until {
        sim.run_until(w);
    }
    // The hibernate run waits longer: a hung `snapshot save` holds its pod for the save's
    // one-hour deadline.
    let calm_rounds = if hibernate { 160 } else { 40 };
    for _ in 0..calm_rounds {
        sim.operator();
        let t = sim.now + Duration::from_secs(30);
        sim.run_until(t);
    }
    let mut errs = sim.check_invariants(seed);
    if sim.attack.is_some() {
        let team = sim.api.keys().filter(|k| k.namespace == TEAM).count() as u64;
        let squatted = sim
            .api
            .iter()
            .filter(|(k, p)| {
                k.namespace == TEAM
                    && p.metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get(ANN_VM_NAME))
                        .is_some_and(|n| sim.squatted(n))
            })
            .count() as u64;
        let ends: Vec<Option<String>> = sim
            .api
            .iter()
            .filter(|(k, _)| k.namespace == EVIL)
            .map(|(_, p)| p.status.as_ref().and_then(|s| s.phase.clone()))
            .collect();
        for phase in ends {
            sim.count(match phase.as_deref() {
                Some("Failed") => "attacker_ends_failed",
                Some("Running") => "attacker_ends_running_own_vm",
                _ => "attacker_ends_other",
            });
        }
        sim.stats.insert("team_victims", team);
        sim.stats.insert("team_victims_squatted", squatted);
    }
    // Memory follows what is alive, not what was ever seen: once calm, no table of the core
    // holds more records than there are pods or VMs (the node-wide timers aside).
    let (pods_alive, vms_alive) = (sim.api.len(), sim.vms.len());
    for (table, records) in sim.provider.table_sizes() {
        let bound = match table {
            "by_name" | "last_restart" | "stale_watch_state" => vms_alive,
            // Pruned to the named VMs whenever a pod lets go of one, then that one is added.
            "last_holder_ns" => vms_alive + 1,
            "timers" => pods_alive + 8,
            _ => pods_alive,
        };
        if records > bound {
            errs.push(format!(
                "seed {seed}: the core's {table} holds {records} records with {pods_alive} \
                 pods and {vms_alive} VMs alive ({n} pod names ever)"
            ));
        }
    }
    // Every half-saved fork record was cleared by the fork that next needed the name.
    for (name, holder) in &sim.fork_snaps {
        if let Some(h) = holder {
            errs.push(format!(
                "seed {seed}: half-saved fork snapshot {name} ({h}) left"
            ));
        }
    }
    if let Some(l) = &sim.lane {
        let st = &l.lane.stats;
        sim.stats.insert("lane_writes", st.dispatched);
        sim.stats
            .insert("lane_statuses_replaced", st.statuses_replaced);
        sim.stats
            .insert("lane_annotations_merged", st.annotations_merged);
        sim.stats.insert("lane_max_queued", l.max_queued as u64);
        if l.max_queued < 100 {
            errs.push(format!(
                "seed {seed}: the lane never had a backlog (max {} queued)",
                l.max_queued
            ));
        }
        errs.extend(l.order_violations.iter().take(10).cloned());
        if !l.lane.idle() {
            errs.push(format!(
                "seed {seed}: the kube lane never drained: {} queued, {} in flight",
                l.lane.queued(),
                l.lane.in_flight()
            ));
        }
    }
    if !sim.provider.is_started() {
        errs.push("provider never finished its startup reconcile".into());
    }
    (errs, sim.stats)
}

#[test]
fn hundreds_of_pods_converge_under_random_faults() {
    // A bench seed replays with its pod count: `SIM_PODS=12 SIM_SEED=<seed>`.
    let pods = std::env::var("SIM_PODS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    let seeds: Vec<(u64, u64)> = if let Ok(s) = std::env::var("SIM_SEED") {
        vec![(s.parse().expect("SIM_SEED must be an integer"), pods)]
    } else if let Some(k) = std::env::var("SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
    {
        // Fresh random seeds: exploratory (some seeds still expose open bugs; see the report).
        let base = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        (0..k)
            .map(|i| {
                (
                    base.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1,
                    pods,
                )
            })
            .collect()
    } else {
        // Default (CI): fixed seeds that converge today, a reproducible regression bar.
        // The later ones each found a convergence bug (see the commit that added them).
        let mut fixed: Vec<(u64, u64)> = [
            13196924985261725019,
            7,
            42,
            1796209989208618451,
            1796209783831172057,
            10505585523906328427,
            14860280418073547793,
            9720271524794428527,
            14074957089731273881,
            // A status retry overwrote a newer status (Running back to Pending) and a retry
            // wrote after the grace-0 delete.
            15495708445137128063,
        ]
        .into_iter()
        .map(|s| (s, pods))
        .collect();
        // Seeds of the random bench (12 pods each), one per bug each found:
        fixed.extend([
            // A Running pod whose VM vanished across a restart was created afresh, and the
            // first failure of that create wrote Pending over Running.
            (6486371116797803375, 12),
            (13775078680272321061, 12),
            // ... the same when the write recording the VM's id was lost with the restart.
            (9420393115335475707, 12),
            // A VM removed right after its restart: the event came while the check's
            // re-inspect ran and was dropped, leaving the pod Running on no VM.
            (15495709133369170621, 12),
            (13289722062095991953, 12),
            // A restart whose `vm start` gave no answer in time was taken for a failure and
            // its VM removed, though the start had gone through.
            (10113027074977682677, 12),
            (14317729196565689761, 12),
            // A bad pod's Failed status retry fell due while its grace-0 DELETE was on its way
            // and was sent after it.
            (9769298844641026897, 12),
            (6129124985284959465, 12),
            // A VM removed (or stopped) while the startup reconcile still settled a stale
            // create: its event came before any pod was tracked and was dropped, leaving the
            // adopted pod Running on a VM that was gone (or stopped).
            (1889015535896807287, 12),
            (11675319387681154619, 12),
            // A pod's slot re-opened by a late answer after its removal was never dropped:
            // one record more than the pods alive.
            (16803948176258868631, 12),
            (10960979051672267165, 12),
        ]);
        fixed
    };
    let started = Instant::now();
    let mut failed = Vec::new();
    for (seed, pods) in seeds {
        println!(
            "simulation seed {seed} (replay: SIM_PODS={pods} SIM_SEED={seed} cargo test --test simulation)"
        );
        let (errs, stats) = run_seed(seed, pods, ApiPath::Direct);
        println!("  faults/actions: {stats:?}");
        failed.extend(errs.into_iter().take(10));
    }
    println!("simulation wall time {:?}", started.elapsed());
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

#[test]
fn a_slow_rate_limited_api_keeps_each_pods_writes_in_order_and_converges() {
    let seeds: Vec<u64> = match std::env::var("SIM_SEED") {
        Ok(s) => vec![s.parse().expect("SIM_SEED must be an integer")],
        // 42, 99 and 7 failed until startup adopted a managed pod's VM by name when its id
        // annotation lagged (the id write lost in the lane with a restart). 3 and
        // 1796209989208618451 ended with a pod Running but not Ready (its probe said
        // "ping ok"; its lifecycle said `failed` or nothing) until the VM-gone and
        // restart fixes of the reliability work; kept as regressions.
        Err(_) => vec![42, 99, 7, 3, 1796209989208618451],
    };
    let started = Instant::now();
    let mut failed = Vec::new();
    for seed in seeds {
        println!("kube lane simulation seed {seed} (replay: SIM_SEED={seed})");
        let (errs, stats) = run_seed(
            seed,
            300,
            ApiPath::Lane {
                qps: 20,
                max_latency_ms: 500,
            },
        );
        println!("  faults/actions: {stats:?}");
        failed.extend(errs.into_iter().take(10));
    }
    println!("kube lane simulation wall time {:?}", started.elapsed());
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

#[test]
fn forks_of_one_source_converge_under_failing_and_half_finished_saves() {
    let seeds: Vec<u64> = match std::env::var("SIM_SEED") {
        Ok(s) => vec![s.parse().expect("SIM_SEED must be an integer")],
        Err(_) => vec![42, 7, 1796209989208618451, 5, 11],
    };
    let mut failed = Vec::new();
    let mut totals: BTreeMap<&'static str, u64> = BTreeMap::new();
    for seed in seeds {
        println!("fork simulation seed {seed} (replay: SIM_SEED={seed})");
        let (errs, stats) = run_world(seed, 40, ApiPath::Direct, 8, false);
        println!("  faults/actions: {stats:?}");
        for (k, v) in stats {
            *totals.entry(k).or_insert(0) += v;
        }
        failed.extend(errs.into_iter().take(10));
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    // The fault kinds really happened across the seeds.
    for kind in ["fork_save", "fork_save_fail", "fork_save_half"] {
        assert!(
            totals.get(kind).copied().unwrap_or(0) > 0,
            "{kind}: {totals:?}"
        );
    }
    assert!(
        totals.get("restart").copied().unwrap_or(0) > 0,
        "{totals:?}"
    );
}

#[test]
fn hibernate_and_wake_converge_under_save_push_and_registry_faults() {
    let seeds: Vec<u64> = match std::env::var("SIM_SEED") {
        Ok(s) => vec![s.parse().expect("SIM_SEED must be an integer")],
        // 1234 found a removal racing a withdrawn hibernate and a hibernated pod left showing
        // Running after a restart. 3 found a VM removed from outside mid-hibernate (after a
        // failed push, before its id was cleared) taken for hibernated after a restart,
        // though no snapshot of it existed. 12345 (a random sample's) found the retry of an
        // id annotation write landing after the hibernate had cleared the id.
        // 18279911453126379311 (CI's sample) found a restore whose pod was edited while the
        // create was in flight never going Ready: Ready was refused as an older generation.
        Err(_) => vec![
            7,
            42,
            1796209989208618451,
            11,
            1234,
            3,
            12345,
            18279911453126379311,
        ],
    };
    let mut failed = Vec::new();
    for seed in seeds {
        println!("hibernate simulation seed {seed} (replay: SIM_SEED={seed})");
        let (errs, stats) = run_world(seed, 60, ApiPath::Direct, 0, true);
        println!("  faults/actions: {stats:?}");
        for what in ["hibernate", "wake", "registry_down"] {
            if stats.get(what).copied().unwrap_or(0) == 0 {
                failed.push(format!("seed {seed}: no {what} happened"));
            }
        }
        failed.extend(errs.into_iter().take(10));
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

#[test]
fn an_attacker_namespace_never_reads_another_namespaces_vms_or_snapshots() {
    let seeds: Vec<u64> = if let Ok(s) = std::env::var("SIM_SEED") {
        vec![s.parse().expect("SIM_SEED must be an integer")]
    } else if let Some(k) = std::env::var("SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
    {
        let base = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        (0..k)
            .map(|i| base.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1)
            .collect()
    } else {
        // Fresh seeds (`SIM_SEEDS`) still fail to converge about one in ten, none by a read
        // across namespaces: a victim of `evil-team` refused for good as "owned by another
        // pod" when an attacker naming its VM was created first after a restart, and the
        // convergence bugs the other runs' random seeds find; each failing seed prints its
        // replay.
        vec![7, 42]
    };
    let started = Instant::now();
    let mut failed = Vec::new();
    let mut totals: BTreeMap<&'static str, u64> = BTreeMap::new();
    for seed in &seeds {
        let seed = *seed;
        println!("attacker simulation seed {seed} (replay: SIM_SEED={seed})");
        let (errs, stats) = run_attack(seed, 40);
        println!("  faults/actions: {stats:?}");
        for (k, v) in stats {
            *totals.entry(k).or_insert(0) += v;
        }
        failed.extend(errs.into_iter().take(10));
    }
    println!("attacker simulation wall time {:?}", started.elapsed());
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    // Every rule was tried across the seeds.
    for rule in [
        "attack_vm_name",
        "attack_vm_id",
        "attack_image",
        "attack_fork",
        "attack_lookalike",
        "attack_rename",
        "attack_hibernate_toggle",
    ] {
        assert!(
            totals.get(rule).copied().unwrap_or(0) > 0,
            "{rule}: {totals:?}"
        );
    }
}

/// One seed of a random sample: which run it is and how to replay it alone.
#[derive(Clone, Copy)]
enum SampleRun {
    /// `hundreds_of_pods_converge_under_random_faults` with 12 pods, as the random bench.
    Pods12,
    Forks,
    Hibernate,
}

impl SampleRun {
    fn run(self, seed: u64) -> (Vec<String>, BTreeMap<&'static str, u64>) {
        match self {
            SampleRun::Pods12 => run_seed(seed, 12, ApiPath::Direct),
            SampleRun::Forks => run_world(seed, 40, ApiPath::Direct, 8, false),
            SampleRun::Hibernate => run_world(seed, 60, ApiPath::Direct, 0, true),
        }
    }

    fn replay(self, seed: u64) -> String {
        let test = match self {
            SampleRun::Pods12 => "hundreds_of_pods_converge_under_random_faults",
            SampleRun::Forks => {
                "forks_of_one_source_converge_under_failing_and_half_finished_saves"
            }
            SampleRun::Hibernate => {
                "hibernate_and_wake_converge_under_save_push_and_registry_faults"
            }
        };
        let pods = match self {
            SampleRun::Pods12 => "SIM_PODS=12 ",
            _ => "",
        };
        format!("{pods}SIM_SEED={seed} cargo test --test simulation {test}")
    }
}

/// Beside the fixed lists, every run (CI's included) tries a small random sample of fresh
/// seeds: `SIM_SAMPLE` (default 100) seeds of the 12-pod run and one in 20 as many of the fork
/// run (about a minute of one core in a debug build); `SIM_SAMPLE=0` skips it. The hibernate
/// and attacker runs are not sampled by default: about 3 % of fresh hibernate seeds (a pod left
/// terminating, a hibernate left Running after a failed save) and about one attacker seed in
/// ten still fail to converge; `SIM_SAMPLE_HIBERNATE=<k>` adds k hibernate seeds. Each seed
/// is printed with the command that replays it, and a failure names the failing ones. `SIM_SAMPLE_BASE=<n>` draws the same sample again.
#[test]
fn a_random_sample_of_fresh_seeds_converges() {
    let env = |k: &str| std::env::var(k).ok().and_then(|s| s.parse::<u64>().ok());
    if std::env::var_os("SIM_SEED").is_some() {
        return;
    }
    let n = env("SIM_SAMPLE").unwrap_or(100);
    let base = env("SIM_SAMPLE_BASE").unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let runs: Vec<SampleRun> = std::iter::repeat_n(SampleRun::Pods12, n as usize)
        .chain(std::iter::repeat_n(SampleRun::Forks, (n / 20) as usize))
        .chain(std::iter::repeat_n(
            SampleRun::Hibernate,
            env("SIM_SAMPLE_HIBERNATE").unwrap_or(0) as usize,
        ))
        .collect();
    println!(
        "random simulation sample: {} seeds (SIM_SAMPLE_BASE={base} draws them again)",
        runs.len()
    );
    let started = Instant::now();
    let mut failed = Vec::new();
    for (i, run) in runs.into_iter().enumerate() {
        let seed = base.wrapping_add((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1;
        println!("  seed {seed}: {}", run.replay(seed));
        let (errs, _) = run.run(seed);
        if !errs.is_empty() {
            failed.push(format!(
                "seed {seed} failed (replay: {}):\n  {}",
                run.replay(seed),
                errs.iter()
                    .take(10)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join("\n  ")
            ));
        }
    }
    println!("random simulation sample wall time {:?}", started.elapsed());
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// Bench mode: `SIM_BENCH_SEEDS` fresh random seeds (default 10,000) of `SIM_BENCH_PODS` pods
/// each (default 12), on every core, with provider restarts at random points among the chaos.
/// Prints each failing seed (replay it with `SIM_PODS=12 SIM_SEED=<seed>`); each one found becomes a fixed seed
/// of the default list once fixed.
/// `cargo test --release --test simulation -- --ignored --nocapture`
#[test]
#[ignore]
fn bench_random_seeds_converge() {
    let env = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(d)
    };
    let (seeds, pods) = (env("SIM_BENCH_SEEDS", 10_000), env("SIM_BENCH_PODS", 12));
    let base = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    let next = std::sync::atomic::AtomicU64::new(0);
    let failed = std::sync::Mutex::new(Vec::<(u64, String)>::new());
    let restarts = std::sync::atomic::AtomicU64::new(0);
    let started = Instant::now();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= seeds {
                    return;
                }
                let seed = base.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1;
                let (errs, stats) = run_seed(seed, pods, ApiPath::Direct);
                restarts.fetch_add(
                    stats.get("restart").copied().unwrap_or(0),
                    std::sync::atomic::Ordering::Relaxed,
                );
                if !errs.is_empty() {
                    println!("FAILED seed {seed}: {}", errs.join(" | "));
                    if let Ok(mut f) = failed.lock() {
                        f.push((seed, errs.join("\n")));
                    }
                }
            });
        }
    });
    let failed = failed.into_inner().unwrap_or_default();
    println!(
        "simulation bench: {seeds} random seeds of {pods} pods, {} provider restarts, {} failed, {:?}",
        restarts.load(std::sync::atomic::Ordering::Relaxed),
        failed.len(),
        started.elapsed()
    );
    assert!(
        failed.is_empty(),
        "failing seeds: {:?}",
        failed.iter().map(|(s, _)| s).collect::<Vec<_>>()
    );
}
