//! Owed-work classification of an unmarked CH Windows clone after a restart: hibernate evidence
//! means a woken VM (only the IP wait is owed), none means a fresh clone (its fix-up is owed).

use super::hibernate::registry;
use super::*;

const VM: &str = "vk-ns-demo-0";
/// A CH Windows VM with one DHCP NIC, as a wake or a fresh clone leaves it.
const WINDOWS_VM: &str = r#"{"id":"W1","hypervisor":"cloud-hypervisor","state":"running","pid":42,"config":{"name":"vk-ns-demo-0"},"network_configs":[{"tap":"t","mac":"02:00:00:00:00:01"}]}"#;

/// A daemon restarting with `cfg` beside the running VM W1 of the CH Windows clone `a`, which
/// has lifecycle `creating` and no post-clone-state marker.
fn restart(cfg: ProviderConfig) -> (H, Vec<Effect>) {
    let mut ann = managed("a", VM);
    ann.push((ANN_OS, "windows".into()));
    ann.push((ANN_BACKEND, "cloud-hypervisor".into()));
    ann.push((ANN_VM_ID, "W1".into()));
    ann.push((ANN_LIFECYCLE_STATE, "creating".into()));
    let mut h = H {
        p: Provider::new(cfg),
        now: Instant::now(),
        wall: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
        quiet_reclaimer: true,
        ledger: Default::default(),
        hold_ledger: false,
    };
    let vm = crate::vm::read_vm(WINDOWS_VM).unwrap();
    let e = h.feed(Input::StartupListed {
        pods: vec![mk("a", "u1", &ann)],
        vms: vec![vm],
        owners: Default::default(),
    });
    (h, e)
}

fn evidence_op(e: &[Effect]) -> Option<OpId> {
    e.iter().find_map(|x| match x {
        Effect::CheckHibernateEvidence { op, vm_name } if vm_name == VM => Some(*op),
        _ => None,
    })
}

fn exec_of(e: &[Effect]) -> bool {
    cocoon_ops(e)
        .iter()
        .any(|(_, c)| matches!(c, CocoonCmd::VmExec { .. }))
}

fn tag() -> HibernateTag {
    HibernateTag {
        base_image: "team/agent:v3".into(),
        snapshot_id: "S1".into(),
        from_node: "node-b".into(),
        owner_namespace: "ns".into(),
        ..Default::default()
    }
}

/// Dispatched as its own resumed op: counted, announced, and asking the registry first.
fn dispatched(e: &[Effect]) -> OpId {
    assert!(events(e)
        .iter()
        .any(|(r, m)| *r == "ResumedAfterRestart" && m == "op=classify_drop_nic"));
    assert!(has_metric(
        e,
        &MetricUpdate::StartupResume {
            op: "classify_drop_nic"
        }
    ));
    assert!(!exec_of(e), "nothing runs in the guest before the answer");
    evidence_op(e).expect("the hibernate evidence lookup")
}

#[test]
fn with_hibernate_evidence_a_woken_vm_only_waits_for_its_ip() {
    let (mut h, e) = restart(registry());
    let op = dispatched(&e);
    let e = h.feed(Input::HibernateEvidence {
        op,
        result: Ok(Some(tag())),
    });
    assert!(!exec_of(&e), "its hot-added NIC is not cycled by a fix-up");
    let lop = lookup(&e).expect("the IP wait");
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.0.0.7".into())),
    });
    assert!(!exec_of(&e));
    assert!(annotation_patches(&e)
        .iter()
        .all(|(_, a)| !a.contains_key(ANN_POST_CLONE_STATE)));
}

#[test]
fn without_hibernate_evidence_a_fresh_clone_gets_its_fix_up() {
    let (mut h, e) = restart(registry());
    let op = dispatched(&e);
    let e = h.feed(Input::HibernateEvidence {
        op,
        result: Ok(None),
    });
    let exec = cocoon_ops(&e)
        .into_iter()
        .find_map(|(_, c)| match c {
            CocoonCmd::VmExec { command, .. } => Some(command),
            _ => None,
        })
        .expect("the Windows fix-up");
    assert_eq!(exec[0], "powershell");
}

#[test]
fn a_failing_lookup_is_retried_with_backoff_then_given_up_after_30_minutes() {
    let (mut h, e) = restart(registry());
    let mut op = dispatched(&e);
    let mut waits = Vec::new();
    let mut gave_up = None;
    for _ in 0..200 {
        let e = h.feed(Input::HibernateEvidence {
            op,
            result: Err(TransferError::Transient("registry: 503".into())),
        });
        assert!(!exec_of(&e));
        if let Some(m) = events(&e)
            .into_iter()
            .find(|(r, _)| *r == "ResumeClassifyFailed")
        {
            gave_up = Some((m.1, e));
            break;
        }
        assert!(evidence_op(&e).is_none(), "asked again only after a pause");
        // Step through the pause a second at a time until the lookup is asked again.
        let mut waited = 0;
        op = loop {
            let e = h.advance(Duration::from_secs(1));
            waited += 1;
            assert!(!exec_of(&e));
            if let Some(op) = evidence_op(&e) {
                break op;
            }
            assert!(waited < 60, "no lookup after {waited} s");
        };
        waits.push(waited);
    }
    assert_eq!(waits[..7], [1, 2, 4, 8, 16, 30, 30]);
    assert!(waits.iter().all(|w| *w <= 30));
    let total: u64 = waits.iter().sum();
    assert!((29 * 60..=30 * 60).contains(&total), "{total} s");
    let (msg, e) = gave_up.expect("ResumeClassifyFailed after 30 min");
    assert!(
        msg.contains("classify_drop_nic") && msg.contains("503"),
        "{msg}"
    );
    assert!(annotation_patches(&e)
        .iter()
        .any(|(_, a)| a.get(ANN_LIFECYCLE_STATE) == Some(&Some("failed".into()))));
    // Nothing more is asked or run.
    let e = h.advance(Duration::from_secs(120));
    assert!(evidence_op(&e).is_none() && !exec_of(&e));
}

#[test]
fn a_delete_during_the_lookup_ends_it() {
    let (mut h, e) = restart(registry());
    let op = dispatched(&e);
    let mut ann = managed("a", VM);
    ann.push((ANN_OS, "windows".into()));
    ann.push((ANN_VM_ID, "W1".into()));
    let mut gone = mk("a", "u1", &ann);
    gone.metadata.deletion_timestamp =
        Some(Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap()));
    let e = h.feed(Input::PodUpserted(Box::new(gone)));
    assert!(
        cocoon_ops(&e)
            .iter()
            .any(|(_, c)| argv(c).starts_with("vm rm") || argv(c).starts_with("vm inspect")),
        "the delete starts at once: {e:?}"
    );
    let e = h.feed(Input::HibernateEvidence {
        op,
        result: Ok(None),
    });
    assert!(!exec_of(&e), "a late answer runs nothing");
}

#[test]
fn without_a_registry_there_is_no_evidence_to_ask_and_the_fix_up_runs() {
    let (_, e) = restart(ProviderConfig::default());
    assert!(evidence_op(&e).is_none());
    assert!(exec_of(&e));
}
