//! Transition tests of managed macOS guests: create through `cocoon-macos`, adoption, the dead
//! QEMU restart, VNC port reservation and the password rule, hibernate refused, delete.

use super::*;

const IMAGE: &str = "ghcr.io/org/sonoma:14";

fn vnc_on() -> ProviderConfig {
    ProviderConfig {
        macos_vnc: true,
        ..Default::default()
    }
}

fn mac_pod(name: &str, uid: &str, extra: &[(&'static str, &str)]) -> Pod {
    let mut ann = vec![
        (ANN_VM_NAME, format!("vk-ns-{name}")),
        (ANN_MANAGED, "true".to_string()),
        (ANN_IMAGE, IMAGE.to_string()),
        (ANN_OS, "macos".to_string()),
    ];
    ann.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
    mk(name, uid, &ann)
}

fn inspect_json(name: &str, pid: i64, vnc: Option<u16>) -> String {
    let vnc = vnc.map(|d| d.to_string()).unwrap_or_else(|| "null".into());
    format!(
        r#"{{"name":"vk-ns-{name}","pid":{pid},"mac":"02:00:00:00:aa:01","tap":"tap-m","disk":"/var/lib/cocoon-macos/{name}.qcow2","vnc":{vnc}}}"#
    )
}

fn pid_check(e: &[Effect]) -> Option<(OpId, i64)> {
    e.iter().find_map(|x| match x {
        Effect::CheckPid { op, pid } => Some((*op, *pid)),
        _ => None,
    })
}

fn pid_answer(h: &mut H, e: &[Effect], alive: bool) -> Vec<Effect> {
    let (op, _) = pid_check(e).expect("a liveness check");
    h.feed(Input::PidChecked { op, alive })
}

/// The one `cocoon-macos` call in `e` (its argv, which never holds the VNC password).
fn one_macos(e: &[Effect]) -> (OpId, String) {
    let (op, cmd) = one_cocoon(e);
    assert!(cmd.is_macos(), "not a cocoon-macos call: {cmd:?}");
    (op, argv(&cmd))
}

fn vnc_annotation(e: &[Effect]) -> Option<Option<String>> {
    annotation_patches(e)
        .into_iter()
        .find_map(|(_, a)| a.get("vm.cocoonstack.io/vnc-port").cloned())
}

/// A new pod whose VM does not exist: inspect, image inspect, and the `vm run` it ends in.
fn to_run(h: &mut H, name: &str, uid: &str, extra: &[(&'static str, &str)]) -> (OpId, String) {
    let e = h.feed(Input::PodUpserted(Box::new(mac_pod(name, uid, extra))));
    let (op, a) = one_macos(&e);
    assert_eq!(a, format!("vm inspect vk-ns-{name}"));
    let e = h.cocoon(
        op,
        Answer::failed(format!("Error: vm not found: vk-ns-{name}")),
    );
    let (op, a) = one_macos(&e);
    assert_eq!(a, format!("image inspect {IMAGE}"));
    let e = h.cocoon(op, Answer::ok("{}"));
    one_macos(&e)
}

/// A pod adopting its running VM on `display`.
fn adopt(h: &mut H, name: &str, uid: &str, display: u16) -> Vec<Effect> {
    let e = h.feed(Input::PodUpserted(Box::new(mac_pod(name, uid, &[]))));
    let (op, _) = one_macos(&e);
    let e = h.cocoon(op, Answer::ok(inspect_json(name, 500, Some(display))));
    pid_answer(h, &e, true)
}

#[test]
fn a_new_guest_is_run_with_its_vnc_display_and_goes_ready_by_its_probe() {
    let mut h = H::new(vnc_on());
    let (op, a) = to_run(&mut h, "mac-0", "u1", &[]);
    assert_eq!(
        a,
        format!(
            "vm run --name vk-ns-mac-0 --cpus 4 --memory 8192 --vnc 0 \
             --exit-on-reboot --random-smbios --net cni {IMAGE}"
        )
    );
    let e = h.cocoon(op, Answer::ok(""));
    let (op, a) = one_macos(&e);
    assert_eq!(a, "vm inspect vk-ns-mac-0");
    let e = h.cocoon(op, Answer::ok(inspect_json("mac-0", 77, Some(0))));
    let ann = annotation_patches(&e);
    let ids = ann
        .iter()
        .find(|(_, a)| a.contains_key(ANN_VM_ID))
        .expect("id annotation");
    assert_eq!(ids.1[ANN_VM_ID].as_deref(), Some("qemu-vk-ns-mac-0"));
    assert_eq!(vnc_annotation(&e), Some(Some("5900".into())));
    let probe = e.iter().find_map(|x| match x {
        Effect::StartProbe {
            probe_port, mac, ..
        } => Some((*probe_port, mac.clone())),
        _ => None,
    });
    // No probe-port: the SSH port, whose banner the probe must read.
    assert_eq!(probe, Some((Some(22), "02:00:00:00:aa:01".into())));
    assert!(h.p.probe_wants_ssh_banner(&PodKey::new("ns", "mac-0")));
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "ok",
            reason: ""
        }
    ));
    // Not Ready before the probe answers.
    assert!(statuses(&e).iter().all(|(_, s)| !ready(s)));
    let e = probe_ok(&mut h, "mac-0", "u1");
    assert!(statuses(&e).iter().any(|(_, s)| ready(s)), "{e:?}");
}

fn ready(s: &PodStatus) -> bool {
    s.conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

#[test]
fn two_guests_of_one_image_share_its_inspect_and_pull() {
    let mut h = H::new(vnc_on());
    let mut inspects = Vec::new();
    for (name, uid) in [("mac-a", "ua"), ("mac-b", "ub")] {
        let e = h.feed(Input::PodUpserted(Box::new(mac_pod(name, uid, &[]))));
        let (op, _) = one_macos(&e);
        inspects.push(h.cocoon(
            op,
            Answer::failed(format!("Error: vm not found: vk-ns-{name}")),
        ));
    }
    // The second pod joined the first one's image inspect: no second process.
    let (op, a) = one_macos(&inspects[0]);
    assert_eq!(a, format!("image inspect {IMAGE}"));
    assert!(cocoon_ops(&inspects[1]).is_empty(), "{:?}", inspects[1]);
    let e = h.cocoon(op, Answer::failed("Error: image not found"));
    let (op, a) = one_macos(&e);
    assert_eq!(a, format!("image pull {IMAGE}"));
    // One pull answers both: each goes on to its own `vm run`.
    let e = h.cocoon(op, Answer::ok(""));
    let runs: Vec<String> = cocoon_ops(&e).iter().map(|(_, c)| argv(c)).collect();
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert!(runs.iter().all(|a| a.starts_with("vm run ")));
    assert!(
        runs[0].contains("--vnc 0 ") && runs[1].contains("--vnc 1 "),
        "{runs:?}"
    );
}

#[test]
fn a_running_guest_is_adopted_with_the_port_it_serves() {
    let mut h = H::new(vnc_on());
    let e = h.feed(Input::PodUpserted(Box::new(mac_pod("mac-1", "u1", &[]))));
    let (op, _) = one_macos(&e);
    let e = h.cocoon(op, Answer::ok(inspect_json("mac-1", 500, Some(7))));
    assert_eq!(pid_check(&e).map(|(_, p)| p), Some(500));
    let e = pid_answer(&mut h, &e, true);
    assert!(cocoon_ops(&e).is_empty(), "adoption runs nothing: {e:?}");
    assert_eq!(vnc_annotation(&e), Some(Some("5907".into())));
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "ok",
            reason: "adopted"
        }
    ));
    // Its port is taken: the next guest gets the lowest other one.
    let (_, a) = to_run(&mut h, "mac-2", "u2", &[]);
    assert!(a.contains("--vnc 0 "), "{a}");
}

#[test]
fn the_status_reconciler_repairs_a_lost_vnc_port_write() {
    let mut h = H::new(vnc_on());
    adopt(&mut h, "mac-1", "u1", 7);
    // The API copy never got the annotation (a lost write): the first reconcile (10 s) writes
    // it again; a copy that has it is left alone.
    let e = h.advance(Duration::from_secs(10));
    assert_eq!(vnc_annotation(&e), Some(Some("5907".into())), "{e:?}");
    let with = mac_pod("mac-1", "u1", &[("vm.cocoonstack.io/vnc-port", "5907")]);
    h.feed(Input::PodUpserted(Box::new(with)));
    let e = h.advance(Duration::from_secs(30));
    assert_eq!(vnc_annotation(&e), None, "{e:?}");
    // A port other than the one it holds is corrected.
    let stale = mac_pod("mac-1", "u1", &[("vm.cocoonstack.io/vnc-port", "5990")]);
    h.feed(Input::PodUpserted(Box::new(stale)));
    let e = h.advance(Duration::from_secs(30));
    assert_eq!(vnc_annotation(&e), Some(Some("5907".into())), "{e:?}");
}

#[test]
fn ready_is_published_even_while_the_watch_checks_the_qemu() {
    let mut h = H::new(vnc_on());
    adopt(&mut h, "mac-1", "u1", 1);
    // The watch's liveness check is out when the probe first succeeds.
    let e = h.advance(Duration::from_secs(10));
    assert!(pid_check(&e).is_some());
    let e = probe_ok(&mut h, "mac-1", "u1");
    assert!(statuses(&e).iter().any(|(_, s)| ready(s)), "{e:?}");
}

#[test]
fn the_port_of_a_pod_that_left_without_a_delete_is_free_again() {
    let mut h = H::new(vnc_on());
    let (op, a) = to_run(&mut h, "mac-0", "u1", &[]);
    assert!(a.contains("--vnc 0 "), "{a}");
    // The run fails; the pod is then removed from the API outright (no graceful delete).
    h.cocoon(op, Answer::failed("Error: qemu: no KVM"));
    h.feed(Input::PodDeleted(Box::new(mac_pod("mac-0", "u1", &[]))));
    let (_, a) = to_run(&mut h, "mac-1", "u2", &[]);
    assert!(a.contains("--vnc 0 "), "{a}");
}

#[test]
fn a_guest_whose_qemu_is_dead_is_started_on_its_display() {
    let mut h = H::new(vnc_on());
    let e = h.feed(Input::PodUpserted(Box::new(mac_pod("mac-1", "u1", &[]))));
    let (op, _) = one_macos(&e);
    let e = h.cocoon(op, Answer::ok(inspect_json("mac-1", 500, Some(4))));
    let e = pid_answer(&mut h, &e, false);
    let (op, a) = one_macos(&e);
    assert_eq!(a, "vm start --vnc 4 vk-ns-mac-1");
    let e = h.cocoon(op, Answer::ok(""));
    let (op, a) = one_macos(&e);
    assert_eq!(a, "vm inspect vk-ns-mac-1");
    let e = h.cocoon(op, Answer::ok(inspect_json("mac-1", 501, Some(4))));
    assert_eq!(vnc_annotation(&e), Some(Some("5904".into())));
}

#[test]
fn without_a_password_there_is_no_vnc_and_an_annotated_port_is_preferred_with_one() {
    let mut h = H::new(ProviderConfig::default());
    let (op, a) = to_run(&mut h, "mac-0", "u1", &[]);
    assert!(!a.contains("--vnc"), "{a}");
    let e = h.cocoon(op, Answer::ok(""));
    let (op, _) = one_macos(&e);
    let e = h.cocoon(op, Answer::ok(inspect_json("mac-0", 9, None)));
    // No port served: the annotation is removed (null), never written as 0.
    assert_eq!(vnc_annotation(&e), Some(None));

    let mut h = H::new(vnc_on());
    let (_, a) = to_run(
        &mut h,
        "mac-0",
        "u1",
        &[("vm.cocoonstack.io/vnc-port", "5950")],
    );
    assert!(a.contains("--vnc 50 "), "{a}");
    // A probe-port is a plain TCP connect, not an SSH banner.
    to_run(&mut h, "mac-p", "up", &[(ANN_PROBE_PORT, "2222")]);
    assert!(!h.p.probe_wants_ssh_banner(&PodKey::new("ns", "mac-p")));
    assert!(h.p.probe_wants_ssh_banner(&PodKey::new("ns", "mac-0")));
    // An annotation outside the range is ignored.
    let (_, a) = to_run(
        &mut h,
        "mac-1",
        "u2",
        &[("vm.cocoonstack.io/vnc-port", "6001")],
    );
    // (5900 went to mac-p above.)
    assert!(a.contains("--vnc 1 "), "{a}");
}

#[test]
fn when_all_vnc_ports_are_reserved_the_create_fails_and_gets_the_port_freed_by_a_delete() {
    let mut h = H::new(vnc_on());
    for d in 0..100u16 {
        let e = adopt(&mut h, &format!("m{d}"), &format!("u{d}"), d);
        assert_eq!(vnc_annotation(&e), Some(Some((5900 + d).to_string())));
    }
    let e = h.feed(Input::PodUpserted(Box::new(mac_pod("late", "ul", &[]))));
    let (op, _) = one_macos(&e);
    let e = h.cocoon(op, Answer::failed("Error: vm not found: vk-ns-late"));
    let (op, _) = one_macos(&e);
    let e = h.cocoon(op, Answer::ok("{}"));
    assert!(cocoon_ops(&e).is_empty(), "no vm run without a port: {e:?}");
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "CreateBringUpFailed" && m.contains("no free VNC port")));
    assert!(statuses(&e)
        .iter()
        .any(|(_, s)| s.reason.as_deref() == Some("ProviderFailed")));

    // Deleting the guest on display 42 frees its port.
    let mut gone = mac_pod("m42", "u42", &[]);
    gone.metadata.deletion_timestamp =
        Some(Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap()));
    let e = h.feed(Input::PodUpserted(Box::new(gone)));
    let (op, a) = one_macos(&e);
    assert_eq!(a, "vm rm vk-ns-m42");
    let e = h.cocoon(op, Answer::ok(""));
    assert!(
        matches!(e.iter().find(|x| matches!(x, Effect::ReleaseLeases { .. })),
        Some(Effect::ReleaseLeases { macs }) if macs == &["02:00:00:00:aa:01".to_string()])
    );
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "delete",
            result: "ok",
            reason: ""
        }
    ));
    // The late pod's retry (backoff) now runs on display 42.
    let e = h.advance(Duration::from_secs(2));
    let (op, _) = one_macos(&e);
    let e = h.cocoon(op, Answer::failed("Error: vm not found: vk-ns-late"));
    let (op, _) = one_macos(&e);
    let e = h.cocoon(op, Answer::ok("{}"));
    let (_, a) = one_macos(&e);
    assert!(a.starts_with("vm run ") && a.contains("--vnc 42 "), "{a}");
}

#[test]
fn a_delete_that_cocoon_macos_refuses_keeps_the_guest_and_a_missing_vm_counts_as_removed() {
    let mut h = H::new(vnc_on());
    adopt(&mut h, "mac-1", "u1", 1);
    let mut gone = mac_pod("mac-1", "u1", &[]);
    gone.metadata.deletion_timestamp =
        Some(Time(k8s_openapi::jiff::Timestamp::from_second(1).unwrap()));
    let e = h.feed(Input::PodUpserted(Box::new(gone)));
    let (op, _) = one_macos(&e);
    let e = h.cocoon(op, Answer::failed("Error: qemu: permission denied"));
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "ProviderDeleteFailed" && m.contains("VM kept")));
    assert!(deletes(&e).is_empty());
    let e = h.advance(Duration::from_secs(2));
    let (op, a) = one_macos(&e);
    assert_eq!(a, "vm rm vk-ns-mac-1");
    let e = h.cocoon(op, Answer::failed("Error: vm not found: vk-ns-mac-1"));
    assert_eq!(deletes(&e).len(), 1, "{e:?}");
}

#[test]
fn a_dead_qemu_is_restarted_by_the_watch_no_more_often_than_every_ten_seconds() {
    let mut h = H::new(vnc_on());
    adopt(&mut h, "mac-1", "u1", 3);
    // Alive: the watch looks every 10 s and runs nothing.
    let e = h.advance(Duration::from_secs(10));
    assert_eq!(pid_check(&e).map(|(_, p)| p), Some(500));
    let e = pid_answer(&mut h, &e, true);
    assert!(cocoon_ops(&e).is_empty());
    // Dead: inspect (same pid), then `vm start` with its display.
    let e = h.advance(Duration::from_secs(10));
    let e = pid_answer(&mut h, &e, false);
    let (op, a) = one_macos(&e);
    assert_eq!(a, "vm inspect vk-ns-mac-1");
    let e = h.cocoon(op, Answer::ok(inspect_json("mac-1", 500, Some(3))));
    let (op, a) = one_macos(&e);
    assert_eq!(a, "vm start --vnc 3 vk-ns-mac-1");
    let e = h.cocoon(op, Answer::ok(""));
    let (op, _) = one_macos(&e);
    let e = h.cocoon(op, Answer::ok(inspect_json("mac-1", 600, Some(3))));
    assert!(cocoon_ops(&e).is_empty());
    // Nothing before the next round; it checks the new QEMU.
    assert!(h.advance(Duration::from_millis(9_900)).is_empty());
    let e = h.advance(Duration::from_millis(100));
    assert_eq!(pid_check(&e).map(|(_, p)| p), Some(600));
    // The new one died at once: restarted again, 10 s after the first restart.
    let e = pid_answer(&mut h, &e, false);
    let (op, _) = one_macos(&e);
    let e = h.cocoon(op, Answer::ok(inspect_json("mac-1", 600, Some(3))));
    let (_, a) = one_macos(&e);
    assert!(a.starts_with("vm start"), "{a}");
}

#[test]
fn a_missing_mac_is_backfilled_by_the_watch_and_the_probe_restarted() {
    let mut h = H::new(vnc_on());
    let e = h.feed(Input::PodUpserted(Box::new(mac_pod("mac-1", "u1", &[]))));
    let (op, _) = one_macos(&e);
    let e = h.cocoon(
        op,
        Answer::ok(r#"{"name":"vk-ns-mac-1","pid":500,"vnc":1}"#),
    );
    pid_answer(&mut h, &e, true);
    let e = h.advance(Duration::from_secs(10));
    let e = pid_answer(&mut h, &e, true);
    let (op, a) = one_macos(&e);
    assert_eq!(a, "vm inspect vk-ns-mac-1");
    let e = h.cocoon(op, Answer::ok(inspect_json("mac-1", 500, Some(1))));
    assert!(e.iter().any(|x| matches!(x,
        Effect::StartProbe { mac, .. } if mac == "02:00:00:00:aa:01")));
}

#[test]
fn hibernate_is_refused_for_macos_guests_and_lifted_when_withdrawn() {
    let mut h = H::new(vnc_on());
    adopt(&mut h, "mac-1", "u1", 1);
    probe_ok(&mut h, "mac-1", "u1");
    let e = h.feed(Input::PodUpserted(Box::new(mac_pod(
        "mac-1",
        "u1",
        &[(ANN_HIBERNATE, "true")],
    ))));
    assert!(cocoon_ops(&e).is_empty());
    assert!(events(&e).iter().any(|(r, m)| *r == "HibernateUnsupported"
        && m == "hibernate: macOS guest vk-ns-mac-1 does not support hibernate"));
    assert!(annotation_patches(&e).iter().any(|(_, a)| a
        .get(ANN_LIFECYCLE_STATE)
        .is_some_and(|v| v.as_deref() == Some("failed"))));
    let e = h.feed(Input::PodUpserted(Box::new(mac_pod("mac-1", "u1", &[]))));
    assert!(cocoon_ops(&e).is_empty());
    assert!(statuses(&e).iter().any(|(_, s)| ready(s)), "{e:?}");
}

#[test]
fn macos_input_that_could_reach_the_command_line_is_refused_without_running_anything() {
    let mut h = H::new(vnc_on());
    let mut ann = managed("a", "vk-ns-mac-1");
    ann.retain(|(k, _)| *k != ANN_IMAGE);
    ann.push((ANN_OS, "macos".into()));
    ann.push((ANN_IMAGE, "--vnc-password=x".into()));
    let e = h.feed(Input::PodUpserted(Box::new(mk("a", "u", &ann))));
    assert!(cocoon_ops(&e).is_empty());
    assert!(events(&e)
        .iter()
        .any(|(r, m)| *r == "ProviderCreateFailed" && m.contains("not a plain image")));
    assert!(has_metric(
        &e,
        &MetricUpdate::PodLifecycle {
            op: "create",
            result: "failed",
            reason: "invalid_macos_spec"
        }
    ));
}

#[test]
fn after_a_restart_a_macos_pod_is_adopted_by_its_create_not_left_untracked() {
    let mut p = Provider::new(vnc_on());
    let now = Instant::now();
    let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let mut pod = mac_pod(
        "mac-1",
        "u1",
        &[
            (ANN_VM_ID, "qemu-vk-ns-mac-1"),
            (ANN_VM_IP, "127.89.0.3"),
            ("vm.cocoonstack.io/vnc-port", "5903"),
        ],
    );
    // Running before the restart, with no VM in cocoon's list: a cocoon guest would be
    // checked for a VM gone meanwhile; a macOS guest is not cocoon's.
    pod.status = Some(PodStatus {
        phase: Some("Running".into()),
        ..Default::default()
    });
    let mut e = p.handle(
        Input::StartupListed {
            pods: vec![pod],
            vms: vec![],
            owners: Default::default(),
        },
        now,
        wall,
    );
    e.retain(|x| {
        !matches!(
            x,
            Effect::Cocoon {
                cmd: CocoonCmd::SnapshotList,
                ..
            }
        )
    });
    let (op, a) = one_macos(&e);
    assert_eq!(a, "vm inspect vk-ns-mac-1");
    let e = p.handle(
        Input::CocoonDone {
            op,
            result: Answer::ok(inspect_json("mac-1", 500, Some(3))),
        },
        now,
        wall,
    );
    let (op, _) = pid_check(&e).expect("liveness check");
    let e = p.handle(Input::PidChecked { op, alive: true }, now, wall);
    assert_eq!(vnc_annotation(&e), Some(Some("5903".into())));
    // Its address is kept (not blanked) until the probe looks the lease up.
    let ips: Vec<Option<String>> = annotation_patches(&e)
        .into_iter()
        .filter_map(|(_, a)| a.get(ANN_VM_IP).cloned())
        .collect();
    assert_eq!(ips, vec![Some("127.89.0.3".to_string())]);
    assert!(cocoon_ops(&e).is_empty());
}
