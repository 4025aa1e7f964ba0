//! Post-clone fix-up transitions: classification, `vm exec` attempts within the budget, the
//! post-clone annotations, exhaustion, the Windows renew nudge and resumption after a restart.

use super::super::ops::PostCloneMode;
use super::*;
use base64::Engine;

const STATIC_VM: &str = r#"{"id":"VM1","hypervisor":"cloud-hypervisor","state":"running","pid":42,"config":{"name":"vk-ns-demo-0"},"network_configs":[{"tap":"t","mac":"02:00:00:00:00:01","network":{"ip":"10.1.0.5","prefix":24,"gateway":"10.1.0.1"}}]}"#;

fn fc_vm(id: &str) -> String {
    format!(
        r#"{{"id":"{id}","hypervisor":"firecracker","state":"running","pid":42,"config":{{"name":"vk-ns-demo-0"}},"network_configs":[{{"tap":"t","mac":"02:00:00:00:00:07"}}]}}"#
    )
}

/// Drive a managed clone of `ann` up to the clone's answer `vm`; returns its effects.
fn clone_with(h: &mut H, ann: &[(&'static str, String)], vm: &str) -> Vec<Effect> {
    let (op, _) = drive_to_clone(h, mk("a", "u1", ann));
    h.cocoon(op, Answer::ok(vm))
}

fn exec_of(e: &[Effect]) -> Option<(OpId, Vec<String>, Duration)> {
    cocoon_ops(e).into_iter().find_map(|(op, cmd)| match cmd {
        CocoonCmd::VmExec {
            id,
            command,
            deadline,
        } => {
            let mut argv = vec![id];
            argv.extend(command);
            Some((op, argv, deadline))
        }
        _ => None,
    })
}

/// Whether `e` writes a status whose Ready condition is true.
fn ready_in(e: &[Effect]) -> bool {
    statuses(e).iter().any(|(_, s)| {
        s.conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True")
    })
}

/// A status write of `s`, for `ready_in`.
fn status_effect(s: &PodStatus) -> Effect {
    Effect::PatchPodStatus {
        op: 0,
        key: PodKey::new("ns", "a"),
        uid: String::new(),
        status: std::sync::Arc::new(s.clone()),
    }
}

fn post_clone_states(e: &[Effect]) -> Vec<String> {
    annotation_patches(e)
        .into_iter()
        .filter_map(|(_, a)| a.get(ANN_POST_CLONE_STATE).cloned().flatten())
        .collect()
}

#[test]
fn static_ch_clone_runs_the_networkd_script_then_publishes_ready() {
    let mut h = H::new(ProviderConfig::default());
    let e = clone_with(&mut h, &managed("a", "vk-ns-demo-0"), STATIC_VM);
    assert!(
        events(&e).iter().all(|(r, _)| *r != "PostCloneUnsupported"),
        "{e:?}"
    );
    let (op, argv, deadline) = exec_of(&e).expect("vm exec");
    assert_eq!(argv[..3], ["VM1", "sh", "-c"].map(String::from));
    assert!(argv[3].contains("echo 'vk-ns-demo-0' > /etc/hostname"));
    assert!(argv[3].contains("Address=10.1.0.5/24\\nGateway=10.1.0.1"));
    assert_eq!(deadline, Duration::from_secs(180));
    // No `running` marker on a pod that carries none: a restart with no marker runs the
    // fix-up again, finding the create from the ledger (see the restart test below). Nor any
    // other write yet: the Running-not-Ready status is held, id / ip wait for `ready`.
    assert!(annotation_patches(&e).is_empty(), "{e:?}");
    assert!(statuses(&e).is_empty(), "{e:?}");
    // Not Ready while the guest still has the source's network, even when it answers probes.
    assert!(!ready_in(&probe_ok(&mut h, "a", "u1")));

    let e = h.cocoon(op, Answer::ok(""));
    // `done` gets no write of its own: it rides on the lifecycle `ready` patch below.
    assert!(post_clone_states(&e).is_empty(), "{e:?}");
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "PostCloneSucceeded" && m == "kind=linux_static attempts=1"));
    assert!(has_metric(
        &e,
        &MetricUpdate::PostClone {
            kind: "linux_static",
            result: "ok"
        }
    ));
    assert!(has_metric(
        &e,
        &MetricUpdate::PostCloneAttempts {
            result: "ok",
            attempts: 1
        }
    ));
    // The static address is the IP: Ready at once.
    assert!(ready_in(&e), "{e:?}");
    let (ready_op, _) = statuses(&e)
        .into_iter()
        .find(|(_, s)| ready_in(&[status_effect(s)]))
        .expect("the Ready status");
    // Once the cluster shows Ready, one patch records both `ready` and the fix-up's `done`.
    let patches = annotation_patches(&h.kube_ok(ready_op));
    assert_eq!(patches.len(), 1, "{patches:?}");
    assert_eq!(
        patches[0].1.get(ANN_LIFECYCLE_STATE),
        Some(&Some("ready".to_string()))
    );
    assert_eq!(
        patches[0].1.get(ANN_POST_CLONE_STATE),
        Some(&Some("done".to_string()))
    );
    assert_eq!(patches[0].1.get(ANN_VM_ID), Some(&Some("VM1".to_string())));
}

#[test]
fn firecracker_clones_are_cloned_and_fixed_instead_of_refused() {
    let mut h = H::new(ProviderConfig::default());
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_BACKEND, "firecracker".into()));
    let first = h.feed(Input::PodUpserted(Box::new(mk("a", "u1", &ann))));
    let e = no_evidence(&mut h, &first);
    let e = answer(&mut h, &e, "snapshot rm fork-vk-ns-demo-0", Answer::ok(""));
    let e = answer(
        &mut h,
        &e,
        "snapshot inspect team/agent:v3",
        Answer::ok(r#"{"id":"S","name":"team/agent:v3","hypervisor":"firecracker"}"#),
    );
    let (op, cmd) = one_cocoon(&e);
    assert!(argv(&cmd).starts_with("vm clone"), "{}", argv(&cmd));
    let e = h.cocoon(op, Answer::ok(fc_vm("FC1")));
    // A DHCP guest: the lease first (it names the clone's MAC), then the fix-up.
    let lop = lookup(&e).expect("lease lookup");
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(None),
    });
    let (op, argv, _) = exec_of(&e).expect("vm exec");
    assert!(argv[3].contains(
        "ip link set eth0 down\nip link set eth0 address 02:00:00:00:00:07\nip link set eth0 up"
    ));
    assert!(argv[3].contains("DHCP=ipv4"));
    let e = h.cocoon(op, Answer::ok(""));
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "PostCloneSucceeded" && m == "kind=linux_fc attempts=1"));
    // IP wait: the lease shows up on a later poll.
    let lop = lookup(&e).expect("lease poll");
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.0.0.44".into())),
    });
    assert!(statuses(&e)
        .iter()
        .any(|(_, s)| published(s) && s.pod_ip.as_deref() == Some("10.0.0.44")));
}

#[test]
fn failed_attempts_retry_every_three_seconds_with_a_warning_each() {
    let mut h = H::new(ProviderConfig::default());
    let e = clone_with(&mut h, &managed("a", "vk-ns-demo-0"), STATIC_VM);
    let (op, _, _) = exec_of(&e).unwrap();
    let e = h.cocoon(
        op,
        Answer::failed("Error: exec: dial agent: connection refused"),
    );
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "PostCloneExecAttemptFailed"
            && m == "attempt 1: Error: exec: dial agent: connection refused"));
    assert!(exec_of(&e).is_none());
    assert!(exec_of(&h.advance(Duration::from_millis(2900))).is_none());
    let e = h.advance(Duration::from_millis(100));
    let (op, _, deadline) = exec_of(&e).expect("second attempt at 3 s");
    assert_eq!(deadline, Duration::from_secs(177), "the rest of the budget");
    let e = h.cocoon(op, Answer::failed("exit status 1"));
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "PostCloneExecAttemptFailed" && m.starts_with("attempt 2:")));
    let e = h.advance(Duration::from_secs(3));
    let (op, _, _) = exec_of(&e).expect("third attempt");
    let e = h.cocoon(op, Answer::ok(""));
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "PostCloneSucceeded" && m.ends_with("attempts=3")));
    assert!(has_metric(
        &e,
        &MetricUpdate::PostCloneAttempts {
            result: "ok",
            attempts: 3
        }
    ));
}

#[test]
fn exhausted_budget_marks_failed_with_hint_and_errors_and_keeps_the_vm() {
    let mut h = H::new(ProviderConfig::default());
    let e = clone_with(&mut h, &managed("a", "vk-ns-demo-0"), STATIC_VM);
    let (mut op, argv, _) = exec_of(&e).unwrap();
    let script = argv[3].clone();
    let mut attempts = 0;
    let last = loop {
        attempts += 1;
        h.now += Duration::from_secs(10);
        let e = h.cocoon(op, Answer::failed(format!("boom {attempts}")));
        assert!(events(&e)
            .iter()
            .all(|(r, _)| *r != "PostCloneExecExhausted"));
        let e = h.advance(Duration::from_secs(3));
        if events(&e)
            .iter()
            .any(|(r, _)| *r == "PostCloneExecExhausted")
        {
            break e;
        }
        op = exec_of(&e).expect("next attempt").0;
    };
    // Attempts of 10 s plus 3 s pauses: the 14th fails at 179 s, its pause ends the budget.
    assert_eq!(attempts, 14);
    let ex = events(&last);
    let (_, msg) = ex
        .iter()
        .find(|(r, _)| *r == "PostCloneExecExhausted")
        .unwrap();
    assert!(msg.starts_with("clone vk-ns-demo-0: attempt 1: boom 1; attempt 2: boom 2"));
    let patch = annotation_patches(&last)
        .into_iter()
        .map(|(_, a)| a)
        .find(|a| a.contains_key(ANN_POST_CLONE_STATE))
        .unwrap();
    assert_eq!(patch[ANN_POST_CLONE_STATE].as_deref(), Some("failed"));
    let hint = base64::engine::general_purpose::STANDARD
        .decode(
            patch["vm.cocoonstack.io/post-clone-hint"]
                .as_deref()
                .unwrap(),
        )
        .unwrap();
    assert_eq!(String::from_utf8(hint).unwrap(), script);
    let errors = patch["vm.cocoonstack.io/post-clone-errors"]
        .as_deref()
        .unwrap();
    assert!(errors.contains("attempt 14: boom 14"));
    assert!(has_metric(
        &last,
        &MetricUpdate::PostClone {
            kind: "linux_static",
            result: "failed"
        }
    ));
    assert!(has_metric(
        &last,
        &MetricUpdate::PostCloneAttempts {
            result: "failed",
            attempts: 14
        }
    ));
    assert!(annotation_patches(&last).iter().any(|(_, a)| a
        .get(ANN_LIFECYCLE_STATE)
        .is_some_and(|v| v.as_deref() == Some("failed"))));
    // The VM stays for repair: nothing removes it, and no attempt follows.
    let later = h.advance(Duration::from_secs(600));
    assert!(cocoon_ops(&last)
        .iter()
        .chain(cocoon_ops(&later).iter())
        .all(|(_, c)| !argv_is(c, "vm rm") && !matches!(c, CocoonCmd::VmExec { .. })));
}

fn argv_is(c: &CocoonCmd, prefix: &str) -> bool {
    argv(c).starts_with(prefix)
}

#[test]
fn a_hung_attempt_is_abandoned_at_the_budget() {
    let mut h = H::new(ProviderConfig::default());
    let e = clone_with(&mut h, &managed("a", "vk-ns-demo-0"), STATIC_VM);
    let (op, _, deadline) = exec_of(&e).unwrap();
    // The daemon kills the child at its deadline, the end of the budget.
    h.now += deadline;
    let e = h.cocoon(op, Answer::timed_out_call());
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "PostCloneExecExhausted"
            && m.contains("attempt 1: vm exec did not finish within the fix-up's budget")));
    assert!(exec_of(&e).is_none());
}

#[test]
fn a_mac_that_fails_its_check_fails_the_fix_up_without_running_anything() {
    let mut h = H::new(ProviderConfig::default());
    let vm = STATIC_VM.replace("02:00:00:00:00:01", "02:00:00:00:00:01;reboot");
    let e = clone_with(&mut h, &managed("a", "vk-ns-demo-0"), &vm);
    assert!(exec_of(&e).is_none());
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "PostCloneExecExhausted" && m.contains("is not six hex pairs")));
    assert_eq!(post_clone_states(&e), ["failed"]);
    assert!(cocoon_ops(&e).iter().all(|(_, c)| !argv_is(c, "vm rm")));
}

#[test]
fn all_dhcp_ch_clones_need_no_fix_up() {
    let mut h = H::new(ProviderConfig::default());
    let e = create_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")), "VM1");
    assert!(exec_of(&e).is_none());
    assert!(post_clone_states(&e).is_empty());
    assert!(statuses(&e).iter().any(|(_, s)| published(s)));
}

#[test]
fn windows_dhcp_clones_reset_their_nics_then_get_one_renew_nudge() {
    let mut h = H::new(ProviderConfig::default());
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_OS, "windows".into()));
    let e = clone_with(
        &mut h,
        &ann,
        &vm_json("W1", "vk-ns-demo-0", "running", "02:00:00:00:00:09"),
    );
    let lop = lookup(&e).expect("lease");
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(None),
    });
    let (op, argv, _) = exec_of(&e).expect("powershell");
    assert_eq!(argv[1..4], ["powershell", "-nop", "-c"].map(String::from));
    let mut e = h.cocoon(op, Answer::ok(""));
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "PostCloneSucceeded" && m == "kind=windows attempts=1"));
    // No lease for 30 s: then one `ipconfig /renew`.
    let mut nudges = Vec::new();
    for _ in 0..400 {
        // Every lookup (the wait's and the drift repair's) finds no lease.
        for op in e.iter().filter_map(|x| match x {
            Effect::LookupLease { op, .. } => Some(*op),
            _ => None,
        }) {
            h.feed(Input::LeaseLooked {
                op,
                result: Ok(None),
            });
        }
        if let Some((op, argv, _)) = exec_of(&e) {
            nudges.push((h.now, argv.clone()));
            let r = h.cocoon(op, Answer::ok(""));
            assert!(has_metric(
                &r,
                &MetricUpdate::WakeRenewNudge { result: "ok" }
            ));
            e = r;
            continue;
        }
        e = h.advance(Duration::from_millis(200));
        if events(&e)
            .iter()
            .any(|(r, _)| *r == "PostCloneIPWaitTimeout")
        {
            break;
        }
    }
    assert_eq!(nudges.len(), 1, "{nudges:?}");
    assert_eq!(
        nudges[0].1,
        ["W1", "cmd", "/c", "ipconfig", "/renew"].map(String::from)
    );
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "PostCloneIPWaitTimeout"
            && m == "clone vk-ns-demo-0: dhcp lease not observed within 45s"));
}

#[test]
fn the_wake_mode_names_the_wake_when_the_fix_up_is_exhausted() {
    let mut h = H::new(ProviderConfig::default());
    let e = create_clone(&mut h, mk("a", "u1", &managed("a", "vk-ns-demo-0")), "VM1");
    assert!(statuses(&e).iter().any(|(_, s)| published(s)));
    // The wake path hands its restored VM (a static one here) to the fix-up.
    let vm = crate::vm::read_vm(STATIC_VM).unwrap();
    let key = PodKey::new("ns", "a");
    h.p.post_clone_or_ready_wait(&key, &vm, false, PostCloneMode::Wake);
    let e = std::mem::take(&mut h.p.out);
    let (op, _, _) = exec_of(&e).expect("wake runs the fix-up");
    let mut e = h.cocoon(op, Answer::failed("no agent"));
    for _ in 0..100 {
        if events(&e)
            .iter()
            .any(|(r, _)| *r == "PostCloneExecExhausted")
        {
            break;
        }
        e = h.advance(Duration::from_secs(3));
        if let Some((op, _, _)) = exec_of(&e) {
            h.now += Duration::from_secs(20);
            e = h.cocoon(op, Answer::failed("no agent"));
        }
    }
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "PostCloneExecExhausted" && m.starts_with("wake vk-ns-demo-0: ")));
}

#[test]
fn a_delete_during_the_fix_up_ends_it_and_its_late_answer_is_ignored() {
    let mut h = H::new(ProviderConfig::default());
    let ann = managed("a", "vk-ns-demo-0");
    let e = clone_with(&mut h, &ann, STATIC_VM);
    let (op, _, _) = exec_of(&e).unwrap();
    let mut p = mk("a", "u1", &ann);
    p.metadata.deletion_timestamp =
        Some(Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap()));
    let e = h.feed(Input::PodUpserted(Box::new(p)));
    assert!(
        cocoon_ops(&e).iter().any(|(_, c)| argv_is(c, "vm ")),
        "the delete starts at once: {e:?}"
    );
    let late = h.cocoon(op, Answer::ok(""));
    assert!(events(&late)
        .iter()
        .all(|(r, _)| *r != "PostCloneSucceeded"));
    assert!(post_clone_states(&late).is_empty());
}

fn restart_with(pcs: Option<&str>, vm: &str) -> Vec<Effect> {
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_VM_ID, "VM1".into()));
    ann.push((ANN_LIFECYCLE_STATE, "creating".into()));
    if let Some(s) = pcs {
        ann.push((ANN_POST_CLONE_STATE, s.into()));
    }
    let mut h = H {
        p: Provider::new(ProviderConfig::default()),
        now: Instant::now(),
        wall: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
        quiet_reclaimer: true,
        ledger: Default::default(),
        hold_ledger: false,
    };
    let vm = crate::vm::read_vm(vm).unwrap();
    h.feed(Input::StartupListed {
        pods: vec![mk("a", "u1", &ann)],
        vms: vec![vm],
        owners: Default::default(),
    })
}

#[test]
fn after_a_restart_the_post_clone_state_decides_what_is_resumed() {
    let e = restart_with(Some("running"), STATIC_VM);
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "ResumedAfterRestart" && m == "op=post_clone"));
    assert!(has_metric(
        &e,
        &MetricUpdate::StartupResume { op: "post_clone" }
    ));
    assert!(exec_of(&e).is_some());

    let e = restart_with(Some("done"), STATIC_VM);
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "ResumedAfterRestart" && m == "op=ready_wait"));
    assert!(exec_of(&e).is_none());
    assert!(statuses(&e).iter().any(|(_, s)| published(s)));

    let e = restart_with(Some("failed"), STATIC_VM);
    assert!(exec_of(&e).is_none());
    assert!(events(&e).iter().all(|(r, _)| *r != "ResumedAfterRestart"));

    // No marker: a static clone is owed its fix-up.
    let e = restart_with(None, STATIC_VM);
    assert!(exec_of(&e).is_some());
}

#[test]
fn a_failed_marker_is_never_overwritten_by_running() {
    // A pod whose marker says failed (an operator re-queued it without clearing the marker).
    let mut h = H::new(ProviderConfig::default());
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_POST_CLONE_STATE, "failed".into()));
    let e = clone_with(&mut h, &ann, STATIC_VM);
    let (op, _, _) = exec_of(&e).expect("the fix-up still runs");
    assert!(post_clone_states(&e).is_empty());
    let e = h.cocoon(op, Answer::ok(""));
    assert!(post_clone_states(&e).is_empty());
    assert!(events(&e).iter().any(|(r, _)| *r == "PostCloneSucceeded"));
}

const WINDOWS_STATIC_VM: &str = r#"{"id":"W2","hypervisor":"cloud-hypervisor","state":"running","pid":42,"config":{"name":"vk-ns-demo-0"},"network_configs":[{"tap":"t","mac":"02:00:00:00:00:01"},{"tap":"u","mac":"02:00:00:00:00:02","network":{"ip":"10.1.0.5","prefix":16,"gateway":"10.1.0.1"}}]}"#;

#[test]
fn windows_clones_are_restored_by_copy_whatever_the_node_default() {
    let mut h = H::new(ProviderConfig::default());
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_OS, "windows".into()));
    let first = h.feed(Input::PodUpserted(Box::new(mk("a", "u1", &ann))));
    let e = no_evidence(&mut h, &first);
    let e = answer(&mut h, &e, "snapshot rm fork-vk-ns-demo-0", Answer::ok(""));
    let e = answer(
        &mut h,
        &e,
        "snapshot inspect team/agent:v3",
        Answer::ok(r#"{"id":"S","name":"team/agent:v3"}"#),
    );
    let (_, cmd) = one_cocoon(&e);
    assert!(argv(&cmd).contains("--restore-mode copy"), "{}", argv(&cmd));
}

/// A Windows clone with a static second NIC, up to its SAC pass; returns the pass's op.
fn windows_static_to_sac(h: &mut H) -> (OpId, crate::guest::sac::SacPlan) {
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_OS, "windows".into()));
    let e = clone_with(h, &ann, WINDOWS_STATIC_VM);
    // The first NIC is DHCP: its lease is looked up first.
    let lop = lookup(&e).expect("lease");
    let e = h.feed(Input::LeaseLooked {
        op: lop,
        result: Ok(Some("10.0.0.7".into())),
    });
    let (op, argv, _) = exec_of(&e).expect("powershell");
    assert_eq!(argv[1], "powershell");
    let e = h.cocoon(op, Answer::ok(""));
    assert!(events(&e).iter().all(|(r, _)| *r != "PostCloneSucceeded"));
    e.iter()
        .find_map(|x| match x {
            Effect::SacPass { op, vm_id, plan } => {
                assert_eq!(vm_id, "W2");
                Some((*op, plan.clone()))
            }
            _ => None,
        })
        .expect("SAC pass after the NIC reset")
}

#[test]
fn windows_static_clones_get_their_addresses_over_sac_then_ready() {
    let mut h = H::new(ProviderConfig::default());
    let (op, plan) = windows_static_to_sac(&mut h);
    assert_eq!(plan.nic_count, 2);
    assert_eq!(plan.statics.len(), 1);
    assert_eq!(plan.statics[0].index, 1);
    assert_eq!(plan.statics[0].mask.to_string(), "255.255.0.0");
    let e = h.feed(Input::SacDone { op, result: Ok(()) });
    assert!(has_metric(
        &e,
        &MetricUpdate::PostClone {
            kind: "sac",
            result: "ok"
        }
    ));
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "PostCloneSucceeded" && m == "kind=windows attempts=1"));
    // `done` waits for the pod's next annotation patch (the lifecycle `ready`).
    assert!(post_clone_states(&e).is_empty(), "{e:?}");
}

#[test]
fn a_failed_sac_pass_fails_the_pod_with_its_own_reason_and_windows_static_ip_failed() {
    let mut h = H::new(ProviderConfig::default());
    let (op, _) = windows_static_to_sac(&mut h);
    let e = h.feed(Input::SacDone {
        op,
        result: Err(crate::guest::sac::SacError {
            reason: crate::guest::sac::VERIFY_FAILED,
            message: "SAC interface 11 never showed Ip=10.1.0.5 after 10 tries".into(),
        }),
    });
    let ev = events(&e);
    assert!(ev.iter().any(|(r, _)| *r == "PostCloneSACVerifyFailed"));
    assert!(ev.iter().any(|(r, m)| *r == "WindowsStaticIPFailed"
        && m == "clone vk-ns-demo-0: SAC interface 11 never showed Ip=10.1.0.5 after 10 tries"));
    assert!(ev.iter().all(|(r, _)| *r != "PostCloneSucceeded"));
    assert_eq!(post_clone_states(&e), ["failed"]);
    assert!(has_metric(
        &e,
        &MetricUpdate::PostClone {
            kind: "sac",
            result: "failed"
        }
    ));
    assert!(!ready_in(&probe_ok(&mut h, "a", "u1")));
}

#[test]
fn a_windows_guest_booted_with_a_static_nic_gets_the_sac_pass_before_ready() {
    let mut h = H::new(ProviderConfig::default());
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_OS, "windows".into()));
    ann.push((ANN_MODE, "run".into()));
    ann.push((ANN_IMAGE, "https://images.example/win.qcow2".into()));
    let first = h.feed(Input::PodUpserted(Box::new(mk("a", "u1", &ann))));
    let mut e = no_evidence(&mut h, &first);
    // Answer the bring-up calls until the VM runs.
    let vm = WINDOWS_STATIC_VM.replace("\"W2\"", "\"R1\"");
    for _ in 0..6 {
        if lookup(&e).is_some() || e.iter().any(|x| matches!(x, Effect::SacPass { .. })) {
            break;
        }
        // The image's host passes the daemon's look (`source_check`).
        let check = e.iter().find_map(|x| match x {
            Effect::CheckSource { op, .. } => Some(*op),
            _ => None,
        });
        if let Some(op) = check {
            let verdict = SourceVerdict::Allowed;
            e = h.feed(Input::SourceChecked { op, verdict });
            continue;
        }
        let (op, cmd) = one_cocoon(&e);
        let a = argv(&cmd);
        e = if a.starts_with("vm run") {
            h.cocoon(op, Answer::ok(vm.clone()))
        } else {
            h.cocoon(op, Answer::ok(r#"{"id":"I","name":"x"}"#))
        };
    }
    if let Some(op) = lookup(&e) {
        e = h.feed(Input::LeaseLooked {
            op,
            result: Ok(Some("10.0.0.7".into())),
        });
    }
    assert!(exec_of(&e).is_none(), "a booted guest needs no NIC reset");
    let op = e
        .iter()
        .find_map(|x| match x {
            Effect::SacPass { op, .. } => Some(*op),
            _ => None,
        })
        .expect("SAC pass");
    assert!(!ready_in(&probe_ok(&mut h, "a", "u1")));
    let e = h.feed(Input::SacDone { op, result: Ok(()) });
    assert!(ready_in(&e), "{e:?}");
    assert!(events(&e).iter().all(|(r, _)| *r != "PostCloneSucceeded"));
    assert!(post_clone_states(&e).is_empty());
}

#[test]
fn a_resumed_windows_clone_whose_fix_up_was_done_runs_the_sac_pass_again() {
    let mut ann = managed("a", "vk-ns-demo-0");
    ann.push((ANN_OS, "windows".into()));
    ann.push((ANN_VM_ID, "W2".into()));
    ann.push((ANN_LIFECYCLE_STATE, "creating".into()));
    ann.push((ANN_POST_CLONE_STATE, "done".into()));
    let mut h = H {
        p: Provider::new(ProviderConfig::default()),
        now: Instant::now(),
        wall: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
        quiet_reclaimer: true,
        ledger: Default::default(),
        hold_ledger: false,
    };
    let vm = crate::vm::read_vm(WINDOWS_STATIC_VM).unwrap();
    let e = h.feed(Input::StartupListed {
        pods: vec![mk("a", "u1", &ann)],
        vms: vec![vm],
        owners: Default::default(),
    });
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "ResumedAfterRestart" && m == "op=ready_wait"));
    assert!(exec_of(&e).is_none());
    assert!(e.iter().any(|x| matches!(x, Effect::SacPass { .. })));
}

/// A crash between the clone and the `ready` of a fresh pod leaves nothing on the pod (its
/// `creating`, id and ip are never written before `ready`): the ledger's record of the VM for
/// this very pod uid, durable before the clone, stands for the create in flight, and the
/// restart resumes it (the fix-up runs again). A record without the uid (adopted from an
/// older daemon) or of another uid is no create of this pod: the VM is adopted as before.
#[test]
fn a_restart_resumes_a_fresh_pods_create_that_the_ledger_records() {
    let restart = |owner_uid: &str| {
        let mut owners = crate::provider::owners::Owners::default();
        owners.vms.insert(
            "vk-ns-demo-0".into(),
            crate::provider::owners::Owner::new("ns", owner_uid),
        );
        let vm = Answer::ok(STATIC_VM).vm().unwrap();
        let pod = mk("a", "u1", &managed("a", "vk-ns-demo-0"));
        H::starting_with(ProviderConfig::default(), vec![pod], vec![vm], owners).1
    };
    let e = restart("u1");
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "ResumedAfterRestart" && m == "op=post_clone"));
    assert!(exec_of(&e).is_some());
    for other in ["", "u0"] {
        let e = restart(other);
        assert!(exec_of(&e).is_none(), "{other:?}: {e:?}");
        assert!(events(&e).iter().all(|(r, _)| *r != "ResumedAfterRestart"));
        assert!(statuses(&e).iter().any(|(_, s)| published(s)));
    }
}
