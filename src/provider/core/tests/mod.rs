//! Transition tests of the provider core: drive `Provider::handle` with virtual time and
//! answer its effects by hand. This file is the harness; each operation's tests sit beside it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};

use crate::provider::spec::*;
use crate::provider::status;
use crate::provider::*;
use crate::vm::{Answer, CocoonCmd, VmInfo};

mod check;
mod classify;
mod confirm_hibernated;
mod cpu_class;
mod create;
mod delete;
mod fork;
mod hibernate;
mod isolation;
mod kube_writes;
mod macos;
mod ownership;
mod post_clone;
mod read_facts;
mod reclaim;
mod source_check;
mod startup;
mod wake;

struct H {
    p: Provider,
    now: Instant,
    wall: SystemTime,
    /// Answer the snapshot reclaimer's `snapshot list` out of sight with a failure, so the
    /// other operations' tests see only their own effects, and every "if it exists" snapshot
    /// removal runs as on a node not listed yet (the reclaimer's tests turn it off).
    quiet_reclaimer: bool,
    /// The ownership ledger as the edge would have written it: every `RecordOwners` is
    /// applied here and answered at once with success (unless `hold_ledger`).
    ledger: crate::provider::owners::Owners,
    /// Leave `RecordOwners` effects unanswered in what `feed` returns.
    hold_ledger: bool,
}

impl H {
    fn new(cfg: ProviderConfig) -> Self {
        let (h, e) = H::starting(cfg, vec![], vec![]);
        assert!(e.is_empty(), "{e:?}");
        h
    }

    /// A daemon whose startup lists these pods and VMs; returns the startup's effects too.
    fn starting(cfg: ProviderConfig, pods: Vec<Pod>, vms: Vec<VmInfo>) -> (Self, Vec<Effect>) {
        H::starting_with(cfg, pods, vms, Default::default())
    }

    /// A daemon whose startup lists these pods and VMs with this ownership ledger.
    fn starting_with(
        cfg: ProviderConfig,
        pods: Vec<Pod>,
        vms: Vec<VmInfo>,
        owners: crate::provider::owners::Owners,
    ) -> (Self, Vec<Effect>) {
        let mut h = H {
            p: Provider::new(cfg),
            now: Instant::now(),
            wall: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
            quiet_reclaimer: true,
            ledger: owners.clone(),
            hold_ledger: false,
        };
        let e = h.feed(Input::StartupListed { pods, vms, owners });
        (h, e)
    }

    fn feed(&mut self, i: Input) -> Vec<Effect> {
        let mut out = self.p.handle(i, self.now, self.wall);
        while !self.hold_ledger {
            let Some(at) = out
                .iter()
                .position(|e| matches!(e, Effect::RecordOwners { .. }))
            else {
                break;
            };
            let Effect::RecordOwners { op, changes } = out.remove(at) else {
                break;
            };
            for c in &changes {
                self.ledger.apply(c);
            }
            let answer = Input::OwnersRecorded { op, result: Ok(()) };
            out.extend(self.p.handle(answer, self.now, self.wall));
        }
        while self.quiet_reclaimer {
            let Some(at) = out.iter().position(|e| {
                matches!(
                    e,
                    Effect::Cocoon {
                        cmd: CocoonCmd::SnapshotList,
                        ..
                    }
                )
            }) else {
                break;
            };
            let Effect::Cocoon { op, .. } = out.remove(at) else {
                break;
            };
            let answer = Input::CocoonDone {
                op,
                result: Answer::failed("Error: snapshot list: left unanswered here"),
            };
            out.extend(self.p.handle(answer, self.now, self.wall));
        }
        out
    }

    fn advance(&mut self, d: Duration) -> Vec<Effect> {
        self.now += d;
        self.wall += d;
        let mut out = Vec::new();
        while let Some(t) = self.p.poll_timeout() {
            if t > self.now {
                break;
            }
            out.extend(self.feed(Input::Tick));
        }
        out
    }

    fn cocoon(&mut self, op: OpId, r: Answer) -> Vec<Effect> {
        self.feed(Input::CocoonDone { op, result: r })
    }

    fn kube_ok(&mut self, op: OpId) -> Vec<Effect> {
        self.feed(Input::KubeDone { op, result: Ok(()) })
    }
}

/// A ledger recording each VM name of `pairs` for its namespace (VMs this daemon created).
fn owned_vms(pairs: &[(&str, &str)]) -> crate::provider::owners::Owners {
    let mut o = crate::provider::owners::Owners::default();
    for (name, ns) in pairs {
        o.vms.insert(
            name.to_string(),
            crate::provider::owners::Owner::new(ns, ""),
        );
    }
    o
}

fn pod(name: &str, uid: &str, ann: &[(&str, &str)]) -> Pod {
    Pod {
        metadata: ObjectMeta {
            namespace: Some("ns".into()),
            name: Some(name.into()),
            uid: Some(uid.into()),
            annotations: Some(
                ann.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
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

fn managed(name: &str, vm: &str) -> Vec<(&'static str, String)> {
    let _ = name;
    vec![
        (ANN_VM_NAME, vm.to_string()),
        (ANN_MANAGED, "true".into()),
        (ANN_IMAGE, "team/agent:v3".into()),
    ]
}

fn mk(name: &str, uid: &str, ann: &[(&'static str, String)]) -> Pod {
    let a: Vec<(&str, &str)> = ann.iter().map(|(k, v)| (*k, v.as_str())).collect();
    pod(name, uid, &a)
}

fn vm_json(id: &str, name: &str, state: &str, mac: &str) -> String {
    format!(
        r#"{{"id":"{id}","hypervisor":"cloud-hypervisor","state":"{state}","pid":42,"config":{{"name":"{name}"}},"network_configs":[{{"tap":"t","mac":"{mac}"}}]}}"#
    )
}

fn vm_info(id: &str, name: &str, state: &str) -> VmInfo {
    crate::vm::read_vm(&vm_json(id, name, state, "02:00:00:00:00:01")).unwrap()
}

fn cocoon_ops(e: &[Effect]) -> Vec<(OpId, CocoonCmd)> {
    e.iter()
        .filter_map(|x| match x {
            Effect::Cocoon { op, cmd } => Some((*op, cmd.clone())),
            _ => None,
        })
        .collect()
}

fn one_cocoon(e: &[Effect]) -> (OpId, CocoonCmd) {
    let c = cocoon_ops(e);
    assert_eq!(c.len(), 1, "expected one cocoon call in {e:?}");
    c[0].clone()
}

/// The command as a reader writes it: without the `--` that ends cocoon's flags (the vm
/// room's tests pin where that goes).
fn argv(cmd: &CocoonCmd) -> String {
    let mut a = cmd.argv();
    if let Some(dash) = a.iter().position(|x| x == "--") {
        a.remove(dash);
    }
    a.join(" ")
}

fn statuses(e: &[Effect]) -> Vec<(OpId, PodStatus)> {
    e.iter()
        .filter_map(|x| match x {
            Effect::PatchPodStatus { op, status, .. } => Some((*op, (**status).clone())),
            _ => None,
        })
        .collect()
}

fn annotation_patches(e: &[Effect]) -> Vec<(OpId, BTreeMap<String, Option<String>>)> {
    e.iter()
        .filter_map(|x| match x {
            Effect::PatchPodAnnotations {
                op, annotations, ..
            } => Some((*op, annotations.clone())),
            _ => None,
        })
        .collect()
}

/// A Ready publication's status: Running with the pod IP. Its Ready condition waits
/// for a probe that succeeded.
fn published(s: &PodStatus) -> bool {
    s.phase.as_deref() == Some("Running") && s.pod_ip.as_deref().is_some_and(|ip| !ip.is_empty())
}

/// The probe module reports a probe that succeeded.
fn probe_ok(h: &mut H, name: &str, uid: &str) -> Vec<Effect> {
    h.feed(Input::Readiness {
        key: PodKey::new("ns", name),
        uid: uid.into(),
        ready: true,
        message: "ping ok".into(),
        ip: None,
    })
}

fn events(e: &[Effect]) -> Vec<(&'static str, String)> {
    e.iter()
        .filter_map(|x| match x {
            Effect::Event {
                reason, message, ..
            } => Some((*reason, message.clone())),
            _ => None,
        })
        .collect()
}

fn deletes(e: &[Effect]) -> Vec<(OpId, Option<i64>)> {
    e.iter()
        .filter_map(|x| match x {
            Effect::DeletePod { op, grace, .. } => Some((*op, *grace)),
            _ => None,
        })
        .collect()
}

fn has_metric(e: &[Effect], m: &MetricUpdate) -> bool {
    e.iter().any(|x| matches!(x, Effect::Metric(y) if y == m))
}

fn lookup(e: &[Effect]) -> Option<OpId> {
    e.iter().find_map(|x| match x {
        Effect::LookupLease { op, .. } => Some(*op),
        _ => None,
    })
}

/// Answer the hibernate-evidence check that opens a fresh managed create with
/// "none": without a registry the `snapshot inspect <vm>` fails, with one the tag is absent.
fn no_evidence(h: &mut H, e: &[Effect]) -> Vec<Effect> {
    let check = e.iter().find_map(|x| match x {
        Effect::CheckHibernateEvidence { op, .. } => Some(*op),
        _ => None,
    });
    if let Some(op) = check {
        return h.feed(Input::HibernateEvidence {
            op,
            result: Ok(None),
        });
    }
    let (op, cmd) = one_cocoon(e);
    assert!(
        argv(&cmd).starts_with("snapshot inspect vk-"),
        "{}",
        argv(&cmd)
    );
    h.cocoon(op, Answer::failed("Error: snapshot not found"))
}

/// Answer the read of the tag a push would replace (`<vm>:hibernate` / `latest`) with "none
/// there yet", when `e` holds one; else `e` as it is.
fn no_tag_yet(h: &mut H, e: Vec<Effect>) -> Vec<Effect> {
    let op = e.iter().find_map(|x| match x {
        Effect::ReadSnapshotTag { op, tag, .. } if tag == "hibernate" || tag == "latest" => {
            Some(*op)
        }
        _ => None,
    });
    match op {
        Some(op) => h.feed(Input::HibernateEvidence {
            op,
            result: Ok(None),
        }),
        None => e,
    }
}

/// Answer the manifest read that precedes an image pull: a base image (no owner, no
/// from-node, no digest: the pull is by tag). Returns the answer's effects.
fn base_manifest(h: &mut H, e: &[Effect]) -> Vec<Effect> {
    let op = e
        .iter()
        .find_map(|x| match x {
            Effect::ReadSnapshotTag { op, .. } => Some(*op),
            _ => None,
        })
        .expect("the image's manifest is read before its pull");
    h.feed(Input::HibernateEvidence {
        op,
        result: Ok(Some(HibernateTag::default())),
    })
}

/// Drive a managed clone create of `p` to its ReadyWait; returns (effects so far, vm id).
fn create_clone(h: &mut H, p: Pod, vm_id: &str) -> Vec<Effect> {
    let vm_name = p.metadata.annotations.as_ref().unwrap()[ANN_VM_NAME].clone();
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    let e = no_evidence(h, &e);
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), format!("snapshot rm fork-{vm_name}"));
    let e = h.cocoon(op, Answer::failed("snapshot not found"));
    finish_clone(h, &e, &vm_name, vm_id)
}

/// Answer the rest of a clone create of VM `vm_name` from the `snapshot inspect` of its image
/// on; returns the effects of the last answer (the lease lookup's).
fn finish_clone(h: &mut H, e: &[Effect], vm_name: &str, vm_id: &str) -> Vec<Effect> {
    let (op, cmd) = one_cocoon(e);
    // A create after another of the image takes its kept answer (`read_facts`).
    let e = if argv(&cmd).starts_with("vm clone") {
        e.to_vec()
    } else {
        assert_eq!(argv(&cmd), "snapshot inspect team/agent:v3");
        h.cocoon(
            op,
            Answer::ok(r#"{"id":"S","name":"team/agent:v3","hypervisor":"cloud-hypervisor"}"#),
        )
    };
    let (op, cmd) = one_cocoon(&e);
    assert!(argv(&cmd).starts_with(&format!("vm clone --output json --name {vm_name}")));
    let e = h.cocoon(
        op,
        Answer::ok(vm_json(vm_id, vm_name, "running", "02:00:00:00:00:01")),
    );
    let lop = lookup(&e).expect("lease lookup");
    h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.0.0.9".into())),
    })
}

/// Expect exactly one cocoon call with this argv in `e`, answer it with `r`.
fn answer(h: &mut H, e: &[Effect], want: &str, r: Answer) -> Vec<Effect> {
    let (op, cmd) = one_cocoon(e);
    assert_eq!(argv(&cmd), want);
    h.cocoon(op, r)
}

/// Feed a managed clone pod and answer `snapshot rm fork-*` and `snapshot inspect`; returns the
/// op of the `vm clone` call and the effects of the pod's arrival.
fn drive_to_clone(h: &mut H, p: Pod) -> (OpId, Vec<Effect>) {
    let first = h.feed(Input::PodUpserted(Box::new(p)));
    let e = no_evidence(h, &first);
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, Answer::ok(""));
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, Answer::ok(r#"{"id":"S","name":"team/agent:v3"}"#));
    let (op, cmd) = one_cocoon(&e);
    assert!(argv(&cmd).starts_with("vm clone"));
    (op, first)
}
