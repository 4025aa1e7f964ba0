//! Transition tests of the local snapshot reclaimer: which local snapshots it removes, which
//! it verifies against the registry first, and which it keeps because a pod needs them.

use std::collections::BTreeSet;

use super::*;
use crate::snapshots::TransferError;

const EVERY: Duration = Duration::from_secs(600);

fn snapshot_list(e: &[Effect]) -> Option<OpId> {
    e.iter().find_map(|x| match x {
        Effect::Cocoon {
            op,
            cmd: CocoonCmd::SnapshotList,
        } => Some(*op),
        _ => None,
    })
}

fn removals(e: &[Effect]) -> Vec<String> {
    e.iter()
        .filter_map(|x| match x {
            Effect::Cocoon {
                cmd: CocoonCmd::SnapshotRm { name },
                ..
            } => Some(name.clone()),
            _ => None,
        })
        .collect()
}

fn verification(e: &[Effect]) -> Vec<(OpId, String)> {
    e.iter()
        .filter_map(|x| match x {
            Effect::CheckHibernateEvidence { op, vm_name } => Some((*op, vm_name.clone())),
            _ => None,
        })
        .collect()
}

fn listing(snaps: &[(&str, &str)]) -> Answer {
    let items: Vec<String> = snaps
        .iter()
        .map(|(id, name)| {
            format!(r#"{{"id":"{id}","name":"{name}","hypervisor":"cloud-hypervisor"}}"#)
        })
        .collect();
    Answer::ok(format!("[{}]", items.join(",")))
}

/// A node with one tracked pod (VM `vk-ns-demo-0`) and one being created (VM `vk-ns-b-0`
/// from image `vk-base:v2`), whose reclaimer run has just listed its snapshots.
fn listed(registry: bool, snaps: &[(&str, &str)]) -> (H, Vec<Effect>) {
    let mut h = H::new(ProviderConfig {
        registry,
        ..Default::default()
    });
    let p = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
    create_clone(&mut h, p, "VM1");
    // A second pod's create is under way (its first answer not in yet).
    let b = mk(
        "b",
        "u2",
        &[
            (ANN_VM_NAME, "vk-ns-b-0".into()),
            (ANN_MANAGED, "true".into()),
            (ANN_IMAGE, "vk-base:v2".into()),
        ],
    );
    h.feed(Input::PodUpserted(Box::new(b)));
    h.quiet_reclaimer = false;
    let e = h.advance(EVERY);
    let op = snapshot_list(&e).expect("a reclaimer run every 10 minutes");
    let e = h.cocoon(op, listing(snaps));
    (h, e)
}

const NODE_SNAPSHOTS: &[(&str, &str)] = &[
    ("S0", "vk-ns-demo-0"),
    ("S0I", "vk-ns-demo-0-hibernate-import"),
    ("SB2", "vk-base:v2"),
    ("SBV", "vk-ns-b-0"),
    ("SB1", "vk-base:v1"),
    ("S1I", "vk-old-1-hibernate-import"),
    ("S2", "vk-stale-2"),
    ("S3", "vk-gone-3"),
    ("S4", "vk-good-4"),
    ("S5", "vk-flaky-5"),
    ("SX", "operator-golden"),
    ("SF", "fork-vk-ns-demo-0"),
];

#[test]
fn frees_exactly_the_snapshots_no_pod_needs_and_the_registry_does_not_vouch_for() {
    let (mut h, e) = listed(true, NODE_SNAPSHOTS);
    let mut removed: BTreeSet<String> = removals(&e).into_iter().collect();
    let mut e = e;
    let mut verified = Vec::new();
    // One registry check at a time.
    loop {
        let v = verification(&e);
        assert!(v.len() <= 1, "{v:?}");
        let Some((op, name)) = v.into_iter().next() else {
            break;
        };
        verified.push(name.clone());
        let tag = |id: &str| {
            Ok(Some(HibernateTag {
                snapshot_id: id.into(),
                ..Default::default()
            }))
        };
        let result = match name.as_str() {
            "vk-stale-2" => tag("S2-newer-push"),
            "vk-gone-3" => Ok(None),
            "vk-good-4" => tag("S4"),
            "vk-flaky-5" => Err(TransferError::Transient("registry 503".into())),
            other => panic!("{other} must not be verified"),
        };
        e = h.feed(Input::HibernateEvidence { op, result });
        removed.extend(removals(&e));
    }
    verified.sort();
    assert_eq!(
        verified,
        ["vk-flaky-5", "vk-gone-3", "vk-good-4", "vk-stale-2"]
    );
    let expect: BTreeSet<String> = [
        "vk-old-1-hibernate-import",
        "vk-base:v1",
        "vk-stale-2",
        "fork-vk-stale-2",
        "vk-gone-3",
        "fork-vk-gone-3",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(removed, expect);

    // The next run starts 10 minutes later, not before.
    assert!(snapshot_list(&h.advance(EVERY - Duration::from_secs(1))).is_none());
    assert!(snapshot_list(&h.advance(Duration::from_secs(1))).is_some());
}

#[test]
fn without_a_registry_only_imports_and_tagged_snapshots_go() {
    let (_h, e) = listed(false, NODE_SNAPSHOTS);
    assert!(verification(&e).is_empty());
    let removed: BTreeSet<String> = removals(&e).into_iter().collect();
    let expect: BTreeSet<String> = ["vk-old-1-hibernate-import", "vk-base:v1"]
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(removed, expect);
}

#[test]
fn a_snapshot_a_pod_starts_using_during_the_run_is_kept() {
    let (mut h, e) = listed(true, &[("S7", "vk-ns-late-0")]);
    let (op, name) = verification(&e).pop().expect("one check");
    assert_eq!(name, "vk-ns-late-0");
    // Meanwhile a pod for that VM arrives and starts its create.
    let p = mk("late", "u7", &managed("late", "vk-ns-late-0"));
    h.feed(Input::PodUpserted(Box::new(p)));
    let e = h.feed(Input::HibernateEvidence {
        op,
        result: Ok(None),
    });
    assert!(removals(&e).is_empty(), "{e:?}");
}

#[test]
fn an_unreadable_listing_ends_the_run_and_the_next_one_still_comes() {
    let mut h = H::new(ProviderConfig {
        registry: true,
        ..Default::default()
    });
    h.quiet_reclaimer = false;
    let e = h.advance(Duration::ZERO);
    let op = snapshot_list(&e).expect("a first run at start");
    let e = h.cocoon(op, Answer::ok("{not json"));
    assert!(removals(&e).is_empty() && verification(&e).is_empty());
    assert!(snapshot_list(&h.advance(EVERY)).is_some());
}

/// A node whose startup listing is still outstanding: the `snapshot list` op, unanswered.
fn listing_outstanding(cfg: ProviderConfig) -> (H, OpId) {
    let mut h = H {
        p: Provider::new(cfg),
        now: Instant::now(),
        wall: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
        quiet_reclaimer: false,
        ledger: Default::default(),
        hold_ledger: false,
    };
    h.feed(Input::StartupListed {
        pods: vec![],
        vms: vec![],
        owners: Default::default(),
    });
    let op = snapshot_list(&h.advance(Duration::ZERO)).expect("a first run at start");
    h.quiet_reclaimer = true;
    (h, op)
}

/// Feed a managed clone pod up to its first call after the hibernate evidence (none).
fn fresh_create(h: &mut H, name: &str, uid: &str, vm: &str) -> Vec<Effect> {
    let p = mk(name, uid, &managed(name, vm));
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    no_evidence(h, &e)
}

fn delete(h: &mut H, name: &str, uid: &str, vm: &str) -> Vec<Effect> {
    let p = super::delete::deleting_pod(mk(name, uid, &managed(name, vm)), true);
    h.feed(Input::PodUpserted(Box::new(p)))
}

#[test]
fn a_listed_node_removes_only_the_snapshots_that_may_exist() {
    let (mut h, list) = listing_outstanding(ProviderConfig::default());
    h.cocoon(list, listing(&[("SF", "fork-vk-ns-b-0")]));

    // Not listed: the fresh bring-up goes straight to its image's snapshot.
    let e = fresh_create(&mut h, "a", "u1", "vk-ns-demo-0");
    finish_clone(&mut h, &e, "vk-ns-demo-0", "VM1");
    // Listed: removed first.
    let e = fresh_create(&mut h, "b", "u2", "vk-ns-b-0");
    let e = answer(&mut h, &e, "snapshot rm fork-vk-ns-b-0", Answer::ok(""));
    finish_clone(&mut h, &e, "vk-ns-b-0", "VM2");

    // Neither VM has a local snapshot left: a delete is the VM's removal and the object's.
    for (name, uid, vm, id) in [
        ("a", "u1", "vk-ns-demo-0", "VM1"),
        ("b", "u2", "vk-ns-b-0", "VM2"),
    ] {
        let e = delete(&mut h, name, uid, vm);
        let e = answer(&mut h, &e, &format!("vm rm --force {id}"), Answer::ok(""));
        assert!(cocoon_ops(&e).is_empty(), "{vm}: {e:?}");
        assert_eq!(deletes(&e).len(), 1, "{vm}: {e:?}");
    }
}

#[test]
fn a_snapshot_saved_while_the_listing_runs_is_still_removed_at_delete() {
    let (mut h, list) = listing_outstanding(ProviderConfig {
        registry: true,
        ..Default::default()
    });
    // Before the listing answers, every removal runs.
    let e = fresh_create(&mut h, "a", "u1", "vk-ns-demo-0");
    let e = answer(
        &mut h,
        &e,
        "snapshot rm fork-vk-ns-demo-0",
        Answer::failed("Error: rm: resolve \"fork-vk-ns-demo-0\": snapshot not found"),
    );
    finish_clone(&mut h, &e, "vk-ns-demo-0", "VM1");

    let p = super::delete::deleting_pod(super::delete::main_snapshotted_pod(), true);
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    let running = vm_json("VM1", "vk-ns-demo-0", "running", "02:00:00:00:00:01");
    let e = answer(&mut h, &e, "vm inspect VM1", Answer::ok(running));
    let (save, cmd) = one_cocoon(&e);
    assert_eq!(argv(&cmd), "snapshot save --name vk-ns-demo-0 VM1");
    // The listing was taken before the save landed: it shows neither snapshot.
    h.cocoon(list, listing(&[]));
    let e = h.cocoon(save, Answer::ok(""));
    let e = no_tag_yet(&mut h, e);
    let push = e.iter().find_map(|x| match x {
        Effect::PushSnapshot { op, .. } => Some(*op),
        _ => None,
    });
    let e = h.feed(Input::TransferDone {
        op: push.expect("a push"),
        result: Ok(String::new()),
    });
    let e = answer(&mut h, &e, "vm rm --force VM1", Answer::ok(""));
    // The saved snapshot goes; the fork snapshot, removed at the create, is not looked for.
    let e = answer(&mut h, &e, "snapshot rm vk-ns-demo-0", Answer::ok(""));
    assert!(cocoon_ops(&e).is_empty(), "{e:?}");
    assert_eq!(deletes(&e).len(), 1, "{e:?}");
}
