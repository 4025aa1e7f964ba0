//! Transition tests of the provider core: drive `Provider::handle` with virtual time and
//! answer its effects by hand, asserting the effects each branch of the spec demands.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};

use super::cocoon::{CocoonCmd, CocoonResult, VmInfo};
use super::spec::*;
use super::status;
use super::*;

struct H {
    p: Provider,
    now: Instant,
    wall: SystemTime,
}

impl H {
    fn new(cfg: ProviderConfig) -> Self {
        let mut h = H {
            p: Provider::new(cfg),
            now: Instant::now(),
            wall: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
        };
        let e = h.feed(Input::StartupListed {
            pods: vec![],
            vms: vec![],
        });
        assert!(e.is_empty(), "{e:?}");
        h
    }

    fn feed(&mut self, i: Input) -> Vec<Effect> {
        self.p.handle(i, self.now, self.wall)
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

    fn cocoon(&mut self, op: OpId, r: CocoonResult) -> Vec<Effect> {
        self.feed(Input::CocoonDone { op, result: r })
    }

    fn kube_ok(&mut self, op: OpId) -> Vec<Effect> {
        self.feed(Input::KubeDone { op, result: Ok(()) })
    }
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
    super::cocoon::parse_vm(&vm_json(id, name, state, "02:00:00:00:00:01")).unwrap()
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

fn argv(cmd: &CocoonCmd) -> String {
    cmd.argv().join(" ")
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

/// Answer the hibernate-evidence check (§5 step 6) that opens a fresh managed create with
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
    h.cocoon(op, CocoonResult::failed("Error: snapshot not found"))
}

/// Drive a managed clone create of `p` to its ReadyWait; returns (effects so far, vm id).
fn create_clone(h: &mut H, p: Pod, vm_id: &str) -> Vec<Effect> {
    let vm_name = p.metadata.annotations.as_ref().unwrap()[ANN_VM_NAME].clone();
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    let e = no_evidence(h, &e);
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), format!("snapshot rm fork-{vm_name}"));
    let e = h.cocoon(op, CocoonResult::failed("snapshot not found"));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "snapshot inspect team/agent:v3");
    let e = h.cocoon(
        op,
        CocoonResult::ok(r#"{"id":"S","name":"team/agent:v3","hypervisor":"cloud-hypervisor"}"#),
    );
    let (op, cmd) = one_cocoon(&e);
    assert!(argv(&cmd).starts_with(&format!("vm clone --output json --name {vm_name}")));
    let e = h.cocoon(
        op,
        CocoonResult::ok(vm_json(vm_id, &vm_name, "running", "02:00:00:00:00:01")),
    );
    let lop = lookup(&e).expect("lease lookup");
    h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.0.0.9".into())),
    })
}

#[test]
fn clone_create_publishes_running_then_ready_status_before_annotation() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    let e = create_clone(&mut h, p, "VM1");
    let ann = annotation_patches(&e);
    assert!(ann
        .iter()
        .any(|(_, a)| a.get(ANN_VM_ID) == Some(&Some("VM1".into()))
            && a.get(ANN_VM_IP) == Some(&Some("10.0.0.9".into()))));
    assert!(e
        .iter()
        .any(|x| matches!(x, Effect::StartProbe { ip, .. } if ip == "10.0.0.9")));
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "ok",
            reason: ""
        }
    ));
    // Ready publication: status patch first, the lifecycle=ready annotation only after it landed.
    let st = statuses(&e);
    let (sop, ready) = st
        .iter()
        .find(|(_, s)| status::is_ready(s))
        .cloned()
        .expect("ready status");
    assert_eq!(ready.pod_ip.as_deref(), Some("10.0.0.9"));
    assert_eq!(ready.phase.as_deref(), Some("Running"));
    assert!(!annotation_patches(&e)
        .iter()
        .any(|(_, a)| a.get(ANN_LIFECYCLE_STATE) == Some(&Some("ready".into()))));
    let e = h.kube_ok(sop);
    let ann = annotation_patches(&e);
    assert_eq!(ann.len(), 1);
    assert_eq!(ann[0].1[ANN_LIFECYCLE_STATE].as_deref(), Some("ready"));
    let got = h.p.get_pod(&PodKey::new("ns", "a")).unwrap();
    assert!(status::is_ready(got.status.as_ref().unwrap()));
}

#[test]
fn clone_waits_for_the_lease_before_ready() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    let e = no_evidence(&mut h, &e);
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, CocoonResult::ok(""));
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, CocoonResult::ok(r#"{"id":"S","name":"x"}"#));
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(
        op,
        CocoonResult::ok(vm_json(
            "VM1",
            "vk-ns-demo-0",
            "running",
            "02:00:00:00:00:01",
        )),
    );
    let lop = lookup(&e).unwrap();
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(None),
    });
    // Running but not ready, waiting for the lease.
    let st = statuses(&e);
    assert_eq!(st.len(), 1);
    assert_eq!(st[0].1.phase.as_deref(), Some("Running"));
    assert!(!status::is_ready(&st[0].1));
    assert!(lookup(&e).is_none());
    let e = h.advance(Duration::from_millis(200));
    let lop = lookup(&e).expect("polls the lease again");
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.1.1.1".into())),
    });
    assert!(statuses(&e).iter().any(|(_, s)| status::is_ready(s)));
    // The lease never coming: 45 s later it fails clearly.
    let mut h = H::new(ProviderConfig::default());
    let p = mk("b", "u2", &managed("b", "vk-ns-demo-1"));
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    let e = no_evidence(&mut h, &e);
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, CocoonResult::ok(""));
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, CocoonResult::ok(r#"{"id":"S","name":"x"}"#));
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(
        op,
        CocoonResult::ok(vm_json(
            "VM2",
            "vk-ns-demo-1",
            "running",
            "02:00:00:00:00:02",
        )),
    );
    let all_lookups = |e: &[Effect]| -> Vec<OpId> {
        e.iter()
            .filter_map(|x| match x {
                Effect::LookupLease { op, .. } => Some(*op),
                _ => None,
            })
            .collect()
    };
    let mut lops = all_lookups(&e);
    let mut all = Vec::new();
    for _ in 0..300 {
        for op in std::mem::take(&mut lops) {
            all.extend(h.feed(Input::LeaseLooked {
                op,
                result: Ok(None),
            }));
        }
        let e = h.advance(Duration::from_millis(200));
        lops = all_lookups(&e);
        all.extend(e);
    }
    assert!(events(&all)
        .iter()
        .any(|(r, _)| *r == "PostCloneIPWaitTimeout"));
    assert!(annotation_patches(&all)
        .iter()
        .any(|(_, a)| a.get(ANN_LIFECYCLE_STATE) == Some(&Some("failed".into()))));
}

#[test]
fn bad_input_fails_clearly_without_touching_cocoon() {
    let cases: Vec<(Vec<(&'static str, String)>, &str)> = vec![
        (vec![(ANN_MANAGED, "true".into())], "missing_vmname"),
        (
            vec![(ANN_VM_NAME, "v".into()), (ANN_MODE, "boot".into())],
            "bad_mode",
        ),
        (
            vec![(ANN_VM_NAME, "v".into()), (ANN_BACKEND, "qemu".into())],
            "bad_backend",
        ),
        (
            vec![
                (ANN_VM_NAME, "v".into()),
                (ANN_MODE, "run".into()),
                (ANN_CLONE_FROM_DIR, "/x".into()),
            ],
            "conflicting_annotations",
        ),
        (
            vec![
                (ANN_VM_NAME, "v".into()),
                (ANN_CLONE_FROM_DIR, "rel/dir".into()),
            ],
            "bad_clone_from_dir",
        ),
        (
            vec![
                (ANN_VM_NAME, "v".into()),
                (ANN_CLONE_FROM_DIR, "/a/./b".into()),
            ],
            "bad_clone_from_dir",
        ),
        (
            vec![(ANN_VM_NAME, "v".into()), (ANN_STORAGE, "ten gigs".into())],
            "bad_quantity",
        ),
    ];
    for (ann, reason) in cases {
        let mut h = H::new(ProviderConfig::default());
        let p = mk("a", "u1", &ann);
        let e = h.feed(Input::PodUpserted(Box::new(p.clone())));
        assert!(cocoon_ops(&e).is_empty(), "{reason}: {e:?}");
        let st = statuses(&e);
        assert_eq!(st.len(), 1, "{reason}");
        assert_eq!(st[0].1.reason.as_deref(), Some("ProviderFailed"));
        assert!(
            events(&e).iter().any(|(r, _)| *r == "ProviderCreateFailed"),
            "{reason}"
        );
        let result = if reason == "missing_vmname" {
            "skipped"
        } else {
            "failed"
        };
        assert!(
            has_metric(
                &e,
                &MetricUpdate::PodLifecycle {
                    op: "create",
                    result,
                    reason
                }
            ),
            "{reason}: {e:?}"
        );
        // The same pod again changes nothing; no retry storm either.
        assert!(h.feed(Input::PodUpserted(Box::new(p))).is_empty());
        assert!(h
            .advance(Duration::from_secs(60))
            .iter()
            .all(|e| !matches!(e, Effect::Cocoon { .. })));
    }
}

#[test]
fn unsupported_requests_fail_create_clearly() {
    for extra in [
        (ANN_FORK_FROM, "vk-ns-demo-0"),
        (ANN_RESTORE, "true"),
        (ANN_OS, "windows"),
        (ANN_BACKEND, "firecracker"),
    ] {
        let mut h = H::new(ProviderConfig::default());
        let mut ann = managed("a", "vk-ns-demo-1");
        ann.push((extra.0, extra.1.into()));
        let e = h.feed(Input::PodUpserted(Box::new(mk("a", "u", &ann))));
        assert!(cocoon_ops(&e).is_empty(), "{extra:?}");
        assert!(
            events(&e)
                .iter()
                .any(|(r, m)| *r == "ProviderCreateFailed" && m.contains("not supported yet")),
            "{extra:?}"
        );
        assert!(has_metric(
            &e,
            &MetricUpdate::PodLifecycle {
                op: "create",
                result: "failed",
                reason: "unsupported"
            }
        ));
    }
}

#[test]
fn missing_snapshot_is_pulled_with_registry_and_fails_without() {
    let mut h = H::new(ProviderConfig::default());
    let e = h.feed(Input::PodUpserted(Box::new(mk(
        "a",
        "u1",
        &managed("a", "vk-ns-demo-0"),
    ))));
    let e = no_evidence(&mut h, &e);
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, CocoonResult::ok(""));
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(
        op,
        CocoonResult::failed("Error: inspect: snapshot not found"),
    );
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "CreateBringUpFailed" && m.contains("no registry")));
    assert!(statuses(&e)
        .iter()
        .any(|(_, s)| s.reason.as_deref() == Some("ProviderFailed")));
    // Retried with backoff: 5 ms later the create runs again (first inspecting the name).
    let e = h.advance(Duration::from_millis(5));
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm inspect vk-ns-demo-0");

    let mut h = H::new(ProviderConfig {
        registry: true,
        ..Default::default()
    });
    let e = h.feed(Input::PodUpserted(Box::new(mk(
        "a",
        "u1",
        &managed("a", "vk-ns-demo-0"),
    ))));
    let e = no_evidence(&mut h, &e);
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, CocoonResult::ok(""));
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, CocoonResult::failed("snapshot not found"));
    let pull = e.iter().find_map(|x| match x {
        Effect::PullSnapshot {
            op,
            repo,
            tag,
            local_name,
        } => Some((*op, repo.clone(), tag.clone(), local_name.clone())),
        _ => None,
    });
    let (pop, repo, tag, local) = pull.expect("pull");
    assert_eq!(
        (repo.as_str(), tag.as_str(), local.as_str()),
        ("team/agent", "v3", "team/agent:v3")
    );
    let e = h.feed(Input::TransferDone {
        op: pop,
        result: Ok(String::new()),
    });
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "snapshot inspect team/agent:v3");
    // Recorded OCI base image whose digest is present ⇒ clone with --pull.
    let e = h.cocoon(
        op,
        CocoonResult::ok(
            r#"{"id":"S","name":"x","image":"ubuntu:24.04","image_digest":"sha256:ab"}"#,
        ),
    );
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "image inspect sha256:ab");
    let e = h.cocoon(op, CocoonResult::ok("{}"));
    let (_, cmd) = one_cocoon(&e);
    assert!(argv(&cmd).contains(" --pull "), "{}", argv(&cmd));
}

#[test]
fn backend_mismatch_refuses_to_clone() {
    let mut h = H::new(ProviderConfig::default());
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_BACKEND, "cloud-hypervisor".into()));
    let e = h.feed(Input::PodUpserted(Box::new(mk("a", "u1", &ann))));
    let e = no_evidence(&mut h, &e);
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, CocoonResult::ok(""));
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(
        op,
        CocoonResult::ok(r#"{"id":"S","name":"x","hypervisor":"firecracker"}"#),
    );
    assert!(cocoon_ops(&e).is_empty());
    assert!(events(&e)
        .iter()
        .any(|(_, m)| m
            .contains("was taken with firecracker but CocoonSet requests cloud-hypervisor")));
}

#[test]
fn run_mode_pulls_the_image_then_runs_with_resources() {
    use k8s_openapi::api::core::v1::ResourceRequirements;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    let mut h = H::new(ProviderConfig::default());
    let mut ann = managed("a", "vk-ns-tb-shell");
    ann.push((ANN_MODE, "run".into()));
    ann.push((ANN_FORCE_PULL, "true".into()));
    ann.push((ANN_STORAGE, "20Gi".into()));
    let mut p = mk("a", "u1", &ann);
    p.spec.as_mut().unwrap().containers[0].resources = Some(ResourceRequirements {
        limits: Some([("cpu".to_string(), Quantity("2".into()))].into()),
        requests: Some([("memory".to_string(), Quantity("4Gi".into()))].into()),
        ..Default::default()
    });
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    let e = no_evidence(&mut h, &e);
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, CocoonResult::ok(""));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "image pull --force team/agent:v3");
    let e = h.cocoon(op, CocoonResult::ok(""));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(
        argv(&cmd),
        "vm run --output json --name vk-ns-tb-shell --cpu 2 --cpu-weight 79 --cpu-quota-us 200000 \
         --cpu-period-us 100000 --memory 4294967296 --storage 21474836480 team/agent:v3"
    );
    // Not running / pid 0 ⇒ one extra inspect.
    let e = h.cocoon(
        op,
        CocoonResult::ok(r#"{"id":"R1","state":"created","pid":0}"#),
    );
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm inspect R1");
    let e = h.cocoon(
        op,
        CocoonResult::ok(vm_json(
            "R1",
            "vk-ns-tb-shell",
            "running",
            "02:00:00:00:00:09",
        )),
    );
    let lop = lookup(&e).unwrap();
    assert!(e.iter().any(
        |x| matches!(x, Effect::Metric(MetricUpdate::VmBootDuration { mode, .. }) if mode == "run")
    ));
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.0.0.3".into())),
    });
    // Not cloned ⇒ Ready published at once.
    assert!(statuses(&e).iter().any(|(_, s)| status::is_ready(s)));
}

#[test]
fn clone_from_dir_uses_from_dir_and_counts() {
    let mut h = H::new(ProviderConfig::default());
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_CLONE_FROM_DIR, "/srv/snap".into()));
    let e = h.feed(Input::PodUpserted(Box::new(mk("a", "u1", &ann))));
    let e = no_evidence(&mut h, &e);
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, CocoonResult::ok(""));
    let (op, cmd) = one_cocoon(&e);
    let a = argv(&cmd);
    assert!(a.ends_with("--from-dir /srv/snap"), "{a}");
    assert!(a.contains("--pull"));
    let e = h.cocoon(op, CocoonResult::failed("boom"));
    assert!(has_metric(
        &e,
        &MetricUpdate::CloneFromDir { result: "failed" }
    ));
}

#[test]
fn unmanaged_pod_adopts_preassigned_vm_without_cocoon() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk(
        "s",
        "u1",
        &[
            (ANN_VM_NAME, "vk-ns-static".into()),
            (ANN_VM_ID, "PRE".into()),
            (ANN_VM_IP, "10.9.9.9".into()),
        ],
    );
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    assert!(cocoon_ops(&e).is_empty());
    assert!(statuses(&e)
        .iter()
        .any(|(_, s)| status::is_ready(s) && s.pod_ip.as_deref() == Some("10.9.9.9")));
    // Missing IP ⇒ error.
    let mut h = H::new(ProviderConfig::default());
    let p = mk(
        "s",
        "u1",
        &[
            (ANN_VM_NAME, "vk-ns-static".into()),
            (ANN_VM_ID, "PRE".into()),
        ],
    );
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    assert!(events(&e)
        .iter()
        .any(|(_, m)| m.contains("missing pre-assigned IP/VMID")));
}

fn deleting_pod(mut p: Pod, running: bool) -> Pod {
    p.metadata.deletion_timestamp = Some(Time(
        k8s_openapi::chrono::DateTime::from_timestamp(1, 0).unwrap(),
    ));
    p.metadata.deletion_grace_period_seconds = Some(30);
    if running {
        p.status = Some(status::running(
            "10.0.0.9",
            true,
            None,
            None,
            &Time(k8s_openapi::chrono::DateTime::from_timestamp(1, 0).unwrap()),
        ));
    }
    p
}

#[test]
fn delete_snapshots_pushes_removes_then_deletes_the_object() {
    let mut h = H::new(ProviderConfig {
        registry: true,
        ..Default::default()
    });
    let mut p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    p.metadata.owner_references = Some(vec![OwnerReference {
        kind: "CocoonSet".into(),
        name: "demo".into(),
        ..Default::default()
    }]);
    let mut ann = p.metadata.annotations.clone().unwrap();
    ann.insert(ANN_SNAPSHOT_POLICY.into(), "main-only".into());
    p.metadata.annotations = Some(ann);
    create_clone(&mut h, p.clone(), "VM1");
    let e = h.feed(Input::PodUpserted(Box::new(deleting_pod(p, true))));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm inspect VM1");
    let e = h.cocoon(
        op,
        CocoonResult::ok(vm_json(
            "VM1",
            "vk-ns-demo-0",
            "running",
            "02:00:00:00:00:01",
        )),
    );
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "snapshot save --name vk-ns-demo-0 VM1");
    let e = h.cocoon(op, CocoonResult::ok(""));
    let push = e.iter().find_map(|x| match x {
        Effect::PushSnapshot {
            op,
            repo,
            tag,
            base_image,
            ..
        } => Some((*op, repo.clone(), tag.clone(), base_image.clone())),
        _ => None,
    });
    let (pop, repo, tag, base) = push.unwrap();
    assert_eq!(
        (repo.as_str(), tag.as_str(), base.as_str()),
        ("vk-ns-demo-0", "latest", "team/agent:v3")
    );
    let e = h.feed(Input::TransferDone {
        op: pop,
        result: Ok(String::new()),
    });
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm rm --force VM1");
    let e = h.cocoon(op, CocoonResult::ok(""));
    assert!(e.iter().any(|x| matches!(x, Effect::ReleaseLeases { macs } if macs == &vec!["02:00:00:00:00:01".to_string()])));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "snapshot rm vk-ns-demo-0");
    let e = h.cocoon(op, CocoonResult::ok(""));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "snapshot rm fork-vk-ns-demo-0");
    let e = h.cocoon(op, CocoonResult::ok(""));
    assert!(statuses(&e)
        .iter()
        .any(|(_, s)| s.phase.as_deref() == Some("Succeeded")));
    assert_eq!(deletes(&e).len(), 1);
    assert_eq!(deletes(&e)[0].1, Some(0));
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "delete",
            result: "ok",
            reason: ""
        }
    ));
    assert!(h.p.get_pod(&PodKey::new("ns", "a")).is_none());
}

#[test]
fn delete_of_sub_agent_under_main_only_skips_snapshot_and_failure_keeps_vm_and_retries() {
    let mut h = H::new(ProviderConfig {
        registry: true,
        ..Default::default()
    });
    let mut ann = managed("b", "vk-ns-demo-2");
    ann.push((ANN_SNAPSHOT_POLICY, "main-only".into()));
    let mut p = mk("b", "u2", &ann);
    p.metadata.owner_references = Some(vec![OwnerReference {
        kind: "CocoonSet".into(),
        name: "demo".into(),
        ..Default::default()
    }]);
    create_clone(&mut h, p.clone(), "VM2");
    let e = h.feed(Input::PodUpserted(Box::new(deleting_pod(p, true))));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm rm --force VM2");
    let e = h.cocoon(op, CocoonResult::failed("device busy"));
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "ProviderDeleteFailed" && m.contains("VM kept")));
    assert!(deletes(&e).is_empty());
    let e = h.advance(Duration::from_millis(5));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm rm --force VM2");
    // Already absent counts as removed.
    let e = h.cocoon(op, CocoonResult::failed("Error: vm VM2: VM not found"));
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "snapshot rm vk-ns-demo-2");
}

#[test]
fn pod_deleted_while_watch_was_down_still_loses_its_vm() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    create_clone(&mut h, p, "VM1");
    // Relist without the pod.
    let e = h.feed(Input::PodsRelisted(vec![]));
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm rm --force VM1");
}

#[test]
fn not_running_pod_being_deleted_is_force_deleted_at_once() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &[(ANN_MANAGED, "true".into())]); // bad pod, never tracked
    h.feed(Input::PodUpserted(Box::new(p.clone())));
    let e = h.feed(Input::PodUpserted(Box::new(deleting_pod(p, false))));
    assert_eq!(deletes(&e).len(), 1);
    assert_eq!(deletes(&e)[0].1, Some(0));
    assert!(cocoon_ops(&e).is_empty());
}

#[test]
fn vm_gone_evicts_with_failed_status_then_deletes() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    create_clone(&mut h, p, "VM1");
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Deleted,
        vm: vm_info("VM1", "vk-ns-demo-0", "stopped"),
    });
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm inspect VM1");
    let e = h.cocoon(op, CocoonResult::failed("vm not found"));
    assert!(e.iter().any(|x| matches!(x, Effect::ReleaseLeases { .. })));
    let st = statuses(&e);
    assert_eq!(st.len(), 1);
    let s = &st[0].1;
    assert_eq!(s.phase.as_deref(), Some("Failed"));
    let term = s.container_statuses.as_ref().unwrap()[0]
        .state
        .as_ref()
        .unwrap()
        .terminated
        .clone()
        .unwrap();
    assert_eq!(
        (term.exit_code, term.reason.as_deref()),
        (1, Some("VMGone"))
    );
    assert!(
        deletes(&e).is_empty(),
        "status is written before the delete"
    );
    let e = h.kube_ok(st[0].0);
    let d = deletes(&e);
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].1, None);
    let e = h.feed(Input::KubeDone {
        op: d[0].0,
        result: Err(KubeError::Other("500".into())),
    });
    assert!(has_metric(&e, &MetricUpdate::PodEvictFailure));
    let e = h.advance(Duration::from_millis(200));
    let d = deletes(&e);
    assert_eq!(d.len(), 1, "eviction delete retried");
    h.kube_ok(d[0].0);
    assert!(h.p.get_pod(&PodKey::new("ns", "a")).is_none());
}

#[test]
fn stopped_vm_is_restarted_then_cooldown_evicts() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    create_clone(&mut h, p, "VM1");
    let stopped = vm_info("VM1", "vk-ns-demo-0", "stopped");
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Modified,
        vm: stopped.clone(),
    });
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(
        op,
        CocoonResult::ok(vm_json(
            "VM1",
            "vk-ns-demo-0",
            "stopped",
            "02:00:00:00:00:01",
        )),
    );
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm start VM1");
    let e = h.cocoon(op, CocoonResult::ok(""));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm inspect VM1");
    h.cocoon(
        op,
        CocoonResult::ok(vm_json(
            "VM1",
            "vk-ns-demo-0",
            "running",
            "02:00:00:00:00:01",
        )),
    );
    h.advance(Duration::from_secs(10));
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Modified,
        vm: stopped,
    });
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(
        op,
        CocoonResult::ok(vm_json("VM1", "vk-ns-demo-0", "error", "02:00:00:00:00:01")),
    );
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm rm --force VM1");
    let e = h.cocoon(op, CocoonResult::ok(""));
    let st = statuses(&e);
    assert_eq!(st[0].1.reason.as_deref(), Some("RestartCooldown"));
}

#[test]
fn transient_inspect_errors_defer_a_recheck() {
    let mut h = H::new(ProviderConfig::default());
    create_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")), "VM1");
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Deleted,
        vm: vm_info("VM1", "", ""),
    });
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, CocoonResult::failed("connection refused"));
    assert!(cocoon_ops(&e).is_empty());
    let e = h.advance(Duration::from_millis(200));
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, CocoonResult::failed("connection refused"));
    assert!(has_metric(&e, &MetricUpdate::VmInspectTransientFail));
    let e = h.advance(Duration::from_secs(1));
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm inspect VM1");
    let e = h.cocoon(
        op,
        CocoonResult::ok(vm_json(
            "VM1",
            "vk-ns-demo-0",
            "running",
            "02:00:00:00:00:01",
        )),
    );
    assert!(statuses(&e).is_empty());
    assert!(h
        .advance(Duration::from_secs(5))
        .iter()
        .all(|x| !matches!(x, Effect::Cocoon { .. })));
}

#[test]
fn startup_adopts_by_id_and_name_and_destroys_orphans() {
    let mut h = H {
        p: Provider::new(ProviderConfig::default()),
        now: Instant::now(),
        wall: SystemTime::UNIX_EPOCH,
    };
    let mut by_id = managed("a", "vk-ns-demo-0");
    by_id.push((ANN_VM_ID, "V1".into()));
    by_id.push((ANN_LIFECYCLE_STATE, "ready".into()));
    let by_name = managed("b", "vk-ns-demo-1");
    let pods = vec![mk("a", "u1", &by_id), mk("b", "u2", &by_name)];
    let vms = vec![
        vm_info("V1", "vk-ns-demo-0", "running"),
        vm_info("V2", "vk-ns-demo-1", "running"),
        vm_info("V3", "vk-ns-gone-0", "running"),
        vm_info("V4", "vk-ns-half-0", "creating"),
    ];
    // A pod event before startup is buffered.
    assert!(h
        .feed(Input::PodUpserted(Box::new(mk(
            "c",
            "u3",
            &managed("c", "vk-ns-demo-2")
        ))))
        .is_empty());
    let e = h.feed(Input::StartupListed { pods, vms });
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm reconcile-stale-create V4 -o json");
    let e = h.cocoon(op, CocoonResult::ok(r#"{"id":"V4","outcome":"collected"}"#));
    assert!(has_metric(
        &e,
        &MetricUpdate::StaleCreateReconcile {
            outcome: "collected".into()
        }
    ));
    assert!(has_metric(&e, &MetricUpdate::ReconcileAdoptByName));
    let cmds: Vec<String> = cocoon_ops(&e).iter().map(|(_, c)| argv(c)).collect();
    assert!(cmds.contains(&"vm rm --force V3".to_string()), "{cmds:?}");
    assert!(!cmds
        .iter()
        .any(|c| c.contains("V1") || c.contains("V2") || c.contains("V4")));
    // The buffered pod is created after the reconcile.
    assert!(
        cmds.contains(&"snapshot inspect vk-ns-demo-2".to_string()),
        "{cmds:?}"
    );
    assert!(annotation_patches(&e)
        .iter()
        .any(|(_, a)| a.get(ANN_VM_ID) == Some(&Some("V2".into()))));
    assert_eq!(
        e.iter()
            .filter(|x| matches!(x, Effect::StartProbe { .. }))
            .count(),
        2
    );
    assert!(h.p.pod_vm(&PodKey::new("ns", "a")).is_some());
    assert_eq!(h.p.vm_table_sizes().get("ns"), Some(&2));
}

#[test]
fn orphan_alert_counts_and_keeps_for_adoption() {
    let mut h = H {
        p: Provider::new(ProviderConfig {
            orphan_policy: OrphanPolicy::Alert,
            ..Default::default()
        }),
        now: Instant::now(),
        wall: SystemTime::UNIX_EPOCH,
    };
    let e = h.feed(Input::StartupListed {
        pods: vec![],
        vms: vec![vm_info("V9", "vk-ns-demo-0", "running")],
    });
    assert!(has_metric(&e, &MetricUpdate::OrphanVm));
    assert!(cocoon_ops(&e).is_empty());
    // A later create for that name adopts it, no clone.
    let e = h.feed(Input::PodUpserted(Box::new(mk(
        "a",
        "u1",
        &managed("a", "vk-ns-demo-0"),
    ))));
    assert!(cocoon_ops(&e).is_empty());
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "ok",
            reason: "adopted"
        }
    ));
    let lop = lookup(&e).unwrap();
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.0.0.1".into())),
    });
    assert!(statuses(&e).iter().any(|(_, s)| status::is_ready(s)));
}

#[test]
fn hibernate_request_changes_nothing_but_warns_once() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    create_clone(&mut h, p.clone(), "VM1");
    let mut q = p.clone();
    q.metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert(ANN_HIBERNATE.into(), "true".into());
    let e = h.feed(Input::PodUpserted(Box::new(q.clone())));
    assert!(cocoon_ops(&e).is_empty());
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "HibernateUnsupported" && m.contains("not supported yet")));
    q.metadata.labels = Some([("x".to_string(), "y".to_string())].into());
    let e = h.feed(Input::PodUpserted(Box::new(q)));
    assert!(events(&e).is_empty());
    assert!(h.p.pod_vm(&PodKey::new("ns", "a")).is_some());
}

#[test]
fn drift_republishes_a_clobbered_status_and_readiness_updates_flow() {
    let mut h = H::new(ProviderConfig::default());
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    let e = create_clone(&mut h, p.clone(), "VM1");
    let (sop, _) = statuses(&e)
        .into_iter()
        .find(|(_, s)| status::is_ready(s))
        .unwrap();
    h.kube_ok(sop);
    // Someone marks the API pod NotReady: the 10 s reconciler republishes.
    let mut q = p.clone();
    q.status = Some(status::running(
        "10.0.0.9",
        false,
        None,
        None,
        &Time(k8s_openapi::chrono::DateTime::from_timestamp(1, 0).unwrap()),
    ));
    q.metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert(ANN_VM_IP.into(), "10.0.0.9".into());
    q.metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert(ANN_VM_ID.into(), "VM1".into());
    h.feed(Input::PodUpserted(Box::new(q)));
    let e = h.advance(Duration::from_secs(10));
    assert!(
        statuses(&e).iter().any(|(_, s)| status::is_ready(s)),
        "{e:?}"
    );
    // Probe says not ready ⇒ status flips.
    let e = h.feed(Input::Readiness {
        key: PodKey::new("ns", "a"),
        uid: "u1".into(),
        ready: false,
        message: "ping failed: timeout".into(),
        ip: None,
    });
    let st = statuses(&e);
    assert_eq!(st.len(), 1);
    assert!(!status::is_ready(&st[0].1));
    // Stale uid is ignored.
    let e = h.feed(Input::Readiness {
        key: PodKey::new("ns", "a"),
        uid: "old".into(),
        ready: true,
        message: "ping ok".into(),
        ip: None,
    });
    assert!(e.is_empty());
}

#[test]
fn same_name_recreate_adopts_the_vm_for_the_new_incarnation() {
    let mut h = H::new(ProviderConfig::default());
    create_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")), "VM1");
    let e = h.feed(Input::PodUpserted(Box::new(mk(
        "a",
        "u2",
        &managed("a", "vk-ns-demo-0"),
    ))));
    assert!(cocoon_ops(&e).is_empty());
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "ok",
            reason: "adopted"
        }
    ));
}

#[test]
fn cpu_class_mismatch_is_rejected() {
    let mut h = H::new(ProviderConfig {
        cpu_class: Some("x86-v3".into()),
        ..Default::default()
    });
    let mut p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    p.spec.as_mut().unwrap().node_selector =
        Some([(SELECTOR_CPU_CLASS.to_string(), "arm-v9".to_string())].into());
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    assert!(cocoon_ops(&e).is_empty());
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "failed",
            reason: "snapshot_cpu_class_mismatch"
        }
    ));
}

/// Expect exactly one cocoon call with this argv in `e`, answer it with `r`.
fn answer(h: &mut H, e: &[Effect], want: &str, r: CocoonResult) -> Vec<Effect> {
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
    let e = h.cocoon(op, CocoonResult::ok(""));
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, CocoonResult::ok(r#"{"id":"S","name":"x"}"#));
    let (op, cmd) = one_cocoon(&e);
    assert!(argv(&cmd).starts_with("vm clone"));
    (op, first)
}

#[test]
fn failed_pod_left_by_an_interrupted_eviction_is_deleted_after_restart() {
    let mut h = H::new(ProviderConfig::default());
    let mut p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    p.status = Some(status::evicted(
        "VMGone",
        "vm no longer exists",
        None,
        &Time(k8s_openapi::chrono::DateTime::from_timestamp(1, 0).unwrap()),
    ));
    let e = h.feed(Input::PodUpserted(Box::new(p.clone())));
    assert_eq!(deletes(&e), vec![(deletes(&e)[0].0, Some(0))]);
    assert!(cocoon_ops(&e).is_empty());

    // A Failed pod that is not ours to finish (a create rejected under restartPolicy Never)
    // stays as it is.
    let mut other = mk("b", "u2", &managed("b", "vk-ns-demo-1"));
    other.status = Some(PodStatus {
        phase: Some("Failed".into()),
        reason: Some("ProviderFailed".into()),
        ..Default::default()
    });
    let e = h.feed(Input::PodUpserted(Box::new(other)));
    assert!(e.is_empty(), "{e:?}");
}

#[test]
fn failed_bring_up_removes_the_record_it_left_or_adopts_a_finished_one() {
    let mut h = H::new(ProviderConfig::default());
    let (op, _) = drive_to_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")));
    let timed_out = CocoonResult {
        timed_out: true,
        ..Default::default()
    };
    let e = h.cocoon(op, timed_out.clone());
    let (op, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "vm inspect vk-ns-demo-0");
    assert!(
        statuses(&e).is_empty(),
        "failure reported only after the look"
    );
    let e = h.cocoon(
        op,
        CocoonResult::ok(vm_json(
            "VM7",
            "vk-ns-demo-0",
            "creating",
            "02:00:00:00:00:01",
        )),
    );
    let e = answer(&mut h, &e, "vm rm --force VM7", CocoonResult::ok(""));
    let st = statuses(&e);
    assert_eq!(st[0].1.reason.as_deref(), Some("ProviderFailed"));
    assert!(events(&e).iter().any(|(r, _)| *r == "ProviderCreateFailed"));

    // Second pod: the clone timed out but finished anyway: adopted, no second clone.
    let (op, _) = drive_to_clone(&mut h, mk("b", "u2", &managed("b", "vk-ns-demo-1")));
    let e = h.cocoon(op, timed_out);
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(
        op,
        CocoonResult::ok(vm_json(
            "VM8",
            "vk-ns-demo-1",
            "running",
            "02:00:00:00:00:02",
        )),
    );
    let lop = lookup(&e).expect("lease lookup of the adopted VM");
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.0.0.8".into())),
    });
    assert!(cocoon_ops(&e).is_empty());
    assert!(annotation_patches(&e)
        .iter()
        .any(|(_, a)| a.get(ANN_VM_ID) == Some(&Some("VM8".into()))));
}

#[test]
fn failed_rm_before_eviction_rechecks_instead_of_giving_up() {
    let mut h = H::new(ProviderConfig::default());
    create_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")), "VM1");
    let stopped = || vm_json("VM1", "vk-ns-demo-0", "stopped", "02:00:00:00:00:01");
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Modified,
        vm: vm_info("VM1", "vk-ns-demo-0", "stopped"),
    });
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, CocoonResult::ok(stopped()));
    let e = answer(
        &mut h,
        &e,
        "vm start VM1",
        CocoonResult::failed("backend busy"),
    );
    let e = answer(
        &mut h,
        &e,
        "vm rm --force VM1",
        CocoonResult::failed("backend busy"),
    );
    assert!(statuses(&e).is_empty(), "no eviction while the VM is kept");
    // One second later the deferred recheck looks again; the cooldown now removes and evicts.
    let e = h.advance(Duration::from_secs(1));
    let e = answer(&mut h, &e, "vm inspect VM1", CocoonResult::ok(stopped()));
    let e = answer(&mut h, &e, "vm rm --force VM1", CocoonResult::ok(""));
    assert_eq!(statuses(&e)[0].1.reason.as_deref(), Some("RestartCooldown"));
}

#[test]
fn vm_event_during_a_create_is_looked_at_once_the_create_is_done() {
    let mut h = H::new(ProviderConfig::default());
    let (op, _) = drive_to_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")));
    let running = || vm_json("VM1", "vk-ns-demo-0", "running", "02:00:00:00:00:01");
    let e = h.cocoon(op, CocoonResult::ok(running()));
    let lop = lookup(&e).expect("lease lookup");
    // The fresh VM crashes while the lease lookup is in flight: nothing to look at yet.
    let e = h.feed(Input::VmEvent {
        kind: VmEventKind::Modified,
        vm: vm_info("VM1", "vk-ns-demo-0", "stopped"),
    });
    assert!(cocoon_ops(&e).is_empty());
    // No lease yet: the create settles into its wait for Ready, then the event is looked at.
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(None),
    });
    assert!(statuses(&e).iter().all(|(_, s)| !status::is_ready(s)));
    let e = answer(
        &mut h,
        &e,
        "vm inspect VM1",
        CocoonResult::ok(vm_json(
            "VM1",
            "vk-ns-demo-0",
            "stopped",
            "02:00:00:00:00:01",
        )),
    );
    let e = answer(&mut h, &e, "vm start VM1", CocoonResult::ok(""));
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, CocoonResult::ok(running()));
    // The check preempted the wait for Ready; it resumes, and the lease brings Ready.
    let lop = lookup(&e).expect("the wait for Ready resumed");
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.0.0.9".into())),
    });
    let (_, st) = statuses(&e)
        .into_iter()
        .find(|(_, s)| status::is_ready(s))
        .expect("ready published after the restart");
    assert_eq!(st.pod_ip.as_deref(), Some("10.0.0.9"));
}

#[test]
fn a_lifecycle_retry_never_overwrites_a_newer_state() {
    let mut h = H::new(ProviderConfig::default());
    let (op, first) = drive_to_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")));
    let (creating, a) = annotation_patches(&first)[0].clone();
    assert_eq!(a[ANN_LIFECYCLE_STATE].as_deref(), Some("creating"));
    // The `creating` flush fails at once: its retry was due in 500 ms.
    h.feed(Input::KubeDone {
        op: creating,
        result: Err(KubeError::Other("500".into())),
    });
    let e = h.cocoon(
        op,
        CocoonResult::ok(vm_json(
            "VM1",
            "vk-ns-demo-0",
            "running",
            "02:00:00:00:00:01",
        )),
    );
    let lop = lookup(&e).expect("lease lookup");
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.0.0.9".into())),
    });
    let (sop, _) = statuses(&e)
        .into_iter()
        .find(|(_, s)| status::is_ready(s))
        .expect("ready status");
    let e = h.kube_ok(sop);
    let (rop, _) = annotation_patches(&e)[0].clone();
    h.kube_ok(rop);
    // Ready is published before the retry is due: the retry must not go out.
    let e = h.advance(Duration::from_secs(2));
    assert!(
        annotation_patches(&e)
            .iter()
            .all(|(_, a)| a.get(ANN_LIFECYCLE_STATE) != Some(&Some("creating".into()))),
        "{e:?}"
    );
}

#[test]
fn a_status_retry_never_overwrites_a_newer_status() {
    let mut h = H::new(ProviderConfig::default());
    let (op, _) = drive_to_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")));
    let e = h.cocoon(
        op,
        CocoonResult::ok(vm_json(
            "VM1",
            "vk-ns-demo-0",
            "running",
            "02:00:00:00:00:01",
        )),
    );
    let lop = lookup(&e).expect("lease lookup");
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.0.0.9".into())),
    });
    let (ready_op, _) = statuses(&e)
        .into_iter()
        .find(|(_, s)| status::is_ready(s))
        .expect("ready status");
    // The Ready write fails (a retry is due in 500 ms); before it is due the probe reports
    // the pod not ready, and that newer status is written.
    h.feed(Input::KubeDone {
        op: ready_op,
        result: Err(KubeError::Other("429".into())),
    });
    let e = h.feed(Input::Readiness {
        key: PodKey::new("ns", "a"),
        uid: "u1".into(),
        ready: false,
        message: "probe failed".into(),
        ip: None,
    });
    let (newer, st) = statuses(&e).into_iter().next().expect("the newer status");
    assert!(!status::is_ready(&st));
    h.kube_ok(newer);
    let e = h.advance(Duration::from_secs(2));
    assert!(
        statuses(&e).iter().all(|(_, s)| !status::is_ready(s)),
        "the stale Ready status was retried over the newer one: {e:?}"
    );
}

/// The effects of a fresh managed create of `ann` up to its evidence check, and that check's op.
fn evidence_check(h: &mut H, ann: &[(&'static str, String)]) -> OpId {
    let e = h.feed(Input::PodUpserted(Box::new(mk("a", "u1", ann))));
    assert!(
        cocoon_ops(&e).is_empty(),
        "nothing runs before the evidence"
    );
    e.iter()
        .find_map(|x| match x {
            Effect::CheckHibernateEvidence { op, vm_name } if vm_name == "vk-ns-demo-0" => {
                Some(*op)
            }
            _ => None,
        })
        .expect("evidence check")
}

fn evidence_failed(e: &[Effect], verdict: &'static str, says: &str) {
    assert!(cocoon_ops(e).is_empty(), "no VM is touched: {e:?}");
    assert!(has_metric(e, &MetricUpdate::HibernateEvidence { verdict }));
    assert!(
        events(e)
            .iter()
            .any(|(r, m)| *r == "HibernateEvidenceFailed" && m.contains(says)),
        "{:?}",
        events(e)
    );
    assert!(!events(e).iter().any(|(r, _)| *r == "CreateBringUpFailed"));
    assert!(statuses(e)
        .iter()
        .any(|(_, s)| s.reason.as_deref() == Some("ProviderFailed")));
}

#[test]
fn hibernate_tag_in_the_registry_never_gets_a_fresh_boot() {
    let registry = ProviderConfig {
        registry: true,
        ..Default::default()
    };
    // Same image (or none recorded): the Go daemon would restore; that is not built, so the
    // create fails clearly instead of booting a blank VM over the hibernated state.
    for recorded in ["", "team/agent:v3"] {
        let mut h = H::new(registry.clone());
        let op = evidence_check(&mut h, &managed("a", "vk-ns-demo-0"));
        let e = h.feed(Input::HibernateEvidence {
            op,
            result: Ok(Some(recorded.into())),
        });
        evidence_failed(
            &e,
            "restore_unsupported",
            "delete the tag vk-ns-demo-0:hibernate",
        );
        assert!(events(&e)
            .iter()
            .any(|(r, _)| *r == "HibernateSnapshotExists"));
        // Retried with backoff; once the tag is gone the fresh bring-up starts.
        let e = h.advance(Duration::from_millis(5));
        let e = answer(
            &mut h,
            &e,
            "vm inspect vk-ns-demo-0",
            CocoonResult::failed("Error: vm not found"),
        );
        let e = no_evidence(&mut h, &e);
        let (_, cmd) = one_cocoon(&e);
        assert_eq!(argv(&cmd), "snapshot rm fork-vk-ns-demo-0");
    }

    // Another base image: image_conflict.
    let mut h = H::new(registry.clone());
    let op = evidence_check(&mut h, &managed("a", "vk-ns-demo-0"));
    let e = h.feed(Input::HibernateEvidence {
        op,
        result: Ok(Some("team/agent:v2".into())),
    });
    evidence_failed(
        &e,
        "image_conflict",
        "of image team/agent:v2 but the pod asks for team/agent:v3",
    );

    // An explicit clone source: source_conflict.
    let mut h = H::new(registry.clone());
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_CLONE_FROM_DIR, "/srv/snap".into()));
    let op = evidence_check(&mut h, &ann);
    let e = h.feed(Input::HibernateEvidence {
        op,
        result: Ok(Some(String::new())),
    });
    evidence_failed(&e, "source_conflict", "explicit clone source");

    // The registry cannot answer: fail closed.
    let mut h = H::new(registry);
    let op = evidence_check(&mut h, &managed("a", "vk-ns-demo-0"));
    let e = h.feed(Input::HibernateEvidence {
        op,
        result: Err("get manifest vk-ns-demo-0:hibernate: HTTP 503".into()),
    });
    evidence_failed(&e, "unavailable", "HTTP 503");
    assert!(events(&e)
        .iter()
        .any(|(r, _)| *r == "HibernateEvidenceUnavailable"));
}

#[test]
fn without_a_registry_a_local_snapshot_named_after_the_vm_is_the_evidence() {
    let mut h = H::new(ProviderConfig::default());
    let e = h.feed(Input::PodUpserted(Box::new(mk(
        "a",
        "u1",
        &managed("a", "vk-ns-demo-0"),
    ))));
    let e = answer(
        &mut h,
        &e,
        "snapshot inspect vk-ns-demo-0",
        CocoonResult::ok(r#"{"id":"S9","name":"vk-ns-demo-0","image":"team/agent:v3"}"#),
    );
    evidence_failed(
        &e,
        "restore_unsupported",
        "remove the local snapshot vk-ns-demo-0",
    );

    // An inspect that hangs says nothing either way: fail closed.
    let mut h = H::new(ProviderConfig::default());
    let e = h.feed(Input::PodUpserted(Box::new(mk(
        "a",
        "u1",
        &managed("a", "vk-ns-demo-0"),
    ))));
    let hung = CocoonResult {
        timed_out: true,
        ..CocoonResult::failed("")
    };
    let e = answer(&mut h, &e, "snapshot inspect vk-ns-demo-0", hung);
    evidence_failed(&e, "unavailable", "timed out");
}

/// Pods cloning one snapshot at the same time share one `snapshot inspect` (and one image
/// inspect): the later pods wait on the running read and all go on with its answer.
#[test]
fn concurrent_clones_of_one_snapshot_share_the_source_inspect() {
    let mut h = H::new(ProviderConfig::default());
    let mut at_inspect = Vec::new();
    for (i, name) in ["a", "b", "c"].iter().enumerate() {
        let vm = format!("vk-ns-demo-{i}");
        let e = h.feed(Input::PodUpserted(Box::new(mk(
            name,
            &format!("u{i}"),
            &managed(name, &vm),
        ))));
        let e = no_evidence(&mut h, &e);
        let (op, cmd) = one_cocoon(&e);
        assert_eq!(argv(&cmd), format!("snapshot rm fork-{vm}"));
        at_inspect.push(h.cocoon(op, CocoonResult::failed("snapshot not found")));
    }
    // One inspect process for the three pods.
    let (inspect, cmd) = one_cocoon(&at_inspect[0]);
    assert_eq!(argv(&cmd), "snapshot inspect team/agent:v3");
    assert!(cocoon_ops(&at_inspect[1]).is_empty());
    assert!(cocoon_ops(&at_inspect[2]).is_empty());

    let snap = r#"{"id":"S","name":"team/agent:v3","hypervisor":"cloud-hypervisor",
        "image":"ubuntu:24.04","image_digest":"sha256:ab"}"#;
    let e = h.cocoon(inspect, CocoonResult::ok(snap));
    let image_inspects: Vec<_> = cocoon_ops(&e)
        .into_iter()
        .filter(|(_, c)| argv(c) == "image inspect sha256:ab")
        .collect();
    assert_eq!(image_inspects.len(), 1, "{e:?}");
    let e = h.cocoon(image_inspects[0].0, CocoonResult::ok("{}"));
    let mut clones: Vec<String> = cocoon_ops(&e)
        .iter()
        .map(|(_, c)| argv(c))
        .filter(|a| a.starts_with("vm clone"))
        .map(|a| a.split(' ').nth(5).unwrap_or_default().to_string())
        .collect();
    clones.sort();
    assert_eq!(clones, ["vk-ns-demo-0", "vk-ns-demo-1", "vk-ns-demo-2"]);
    // The next pod after the read ended starts a read of its own.
    let e = h.feed(Input::PodUpserted(Box::new(mk(
        "d",
        "u3",
        &managed("d", "vk-ns-demo-3"),
    ))));
    let e = no_evidence(&mut h, &e);
    let (op, _) = one_cocoon(&e);
    let e = h.cocoon(op, CocoonResult::ok(""));
    let (_, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "snapshot inspect team/agent:v3");
}
