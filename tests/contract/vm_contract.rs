//! The `vm` room against the cocoon CLI contract: argv for each option combination, the spec's JSON
//! examples, error classification and hostile output. Pure; no processes.

use std::time::Duration;
use vk_cocoon::vm::argv;
use vk_cocoon::vm::*;

fn v(s: &str) -> Vec<String> {
    s.split(' ').map(String::from).collect()
}

#[test]
fn clone_argv_minimal_and_full() {
    let o = CloneOptions::from_snapshot("team/agent:v3");
    assert_eq!(
        argv::vm_clone(&o),
        v("vm clone --output json -- team/agent:v3")
    );

    let full = CloneOptions {
        source: CloneSource::Snapshot("SNAP".into()),
        name: "vk-ns-demo-0".into(),
        network: "cocoon-dhcp".into(),
        no_direct_io: true,
        pull: true,
        restore_mode: Some(RestoreMode::Mmap),
        nics: Some(2),
        cpu: cpu_policy(Some(2000), Some(4000)),
        backend: Backend::CloudHypervisor,
    };
    assert_eq!(
        argv::vm_clone(&full),
        v("vm clone --output json --name vk-ns-demo-0 --network cocoon-dhcp --no-direct-io --pull \
           --restore-mode mmap --nics 2 --cpu-weight 79 --cpu-quota-us 400000 --cpu-period-us 100000 -- SNAP")
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect::<Vec<_>>()
    );
}

#[test]
fn clone_argv_nics_zero_restore_modes_and_weight_only() {
    let mut o = CloneOptions::from_snapshot("S");
    o.nics = Some(0);
    o.restore_mode = Some(RestoreMode::Copy);
    o.cpu = cpu_policy(None, None);
    assert_eq!(
        argv::vm_clone(&o),
        v("vm clone --output json --restore-mode copy --nics 0 --cpu-weight 1 -- S")
    );
    o.restore_mode = Some(RestoreMode::OnDemand);
    o.nics = None;
    o.cpu = CpuPolicy::default();
    assert_eq!(
        argv::vm_clone(&o),
        v("vm clone --output json --restore-mode ondemand -- S")
    );
}

#[test]
fn clone_argv_firecracker_drops_restore_mode_and_nics() {
    let mut o = CloneOptions::from_snapshot("S");
    o.backend = Backend::Firecracker;
    o.nics = Some(3);
    o.restore_mode = Some(RestoreMode::Mmap);
    o.cpu = cpu_policy(Some(500), None);
    assert_eq!(
        argv::vm_clone(&o),
        v("vm clone --output json --cpu-weight 20 -- S")
    );
}

#[test]
fn clone_argv_from_dir_is_last_and_implies_one_pull() {
    let mut o = CloneOptions::from_snapshot("ignored");
    o.source = CloneSource::FromDir("/var/lib/cocoon/vk-staging/x".into());
    o.name = "n".into();
    assert_eq!(
        argv::vm_clone(&o),
        v("vm clone --output json --name n --pull --from-dir /var/lib/cocoon/vk-staging/x")
    );
    o.pull = true;
    let a = argv::vm_clone(&o);
    assert_eq!(a.iter().filter(|s| *s == "--pull").count(), 1);
    assert_eq!(
        &a[a.len() - 2..],
        &v("--from-dir /var/lib/cocoon/vk-staging/x")[..]
    );
}

#[test]
fn run_argv_orders_flags() {
    let o = RunOptions {
        image: "ghcr.io/example/ubuntu:24.04".into(),
        ..Default::default()
    };
    assert_eq!(
        argv::vm_run(&o),
        v("vm run --output json -- ghcr.io/example/ubuntu:24.04")
    );
    let full = RunOptions {
        image: "https://cloud-images.example/win.qcow2".into(),
        name: "vk-a-b".into(),
        cpu: vcpu_count(Some(1500), None),
        cpu_policy: cpu_policy(Some(1500), Some(3000)),
        memory: memory_arg(Some("4Gi"), None).unwrap_or_default(),
        storage: resources::bytes_arg("20Gi").unwrap_or_default(),
        network: "net1".into(),
        windows: true,
        backend: Backend::CloudHypervisor,
        no_direct_io: true,
    };
    assert_eq!(
        argv::vm_run(&full),
        v("vm run --output json --name vk-a-b --cpu 2 --cpu-weight 59 --cpu-quota-us 300000 \
--cpu-period-us 100000 --memory 4294967296 --storage 21474836480 --network net1 --windows --no-direct-io \
-- https://cloud-images.example/win.qcow2")
    );
    let fc = RunOptions {
        image: "img".into(),
        backend: Backend::Firecracker,
        memory: "weird".into(),
        ..Default::default()
    };
    assert_eq!(
        argv::vm_run(&fc),
        v("vm run --output json --memory weird --fc -- img")
    );
}

#[test]
fn simple_verbs() {
    assert_eq!(argv::vm_inspect("X"), v("vm inspect -- X"));
    assert_eq!(argv::vm_list(), v("vm list -o json"));
    assert_eq!(argv::vm_rm("X"), v("vm rm --force -- X"));
    assert_eq!(argv::vm_start("X"), v("vm start -- X"));
    assert_eq!(argv::vm_logs("X", 0, false), v("vm logs -- X"));
    assert_eq!(argv::vm_logs("X", 50, false), v("vm logs --tail 50 -- X"));
    assert_eq!(argv::vm_logs("X", 50, true), v("vm logs --tail 50 -f -- X"));
    assert_eq!(argv::vm_logs("X", 0, true), v("vm logs -f -- X"));
    assert_eq!(argv::vm_net("X", 2), v("vm net --nics 2 -- X"));
    assert_eq!(
        argv::vm_reconcile_stale_create("X"),
        v("vm reconcile-stale-create -o json -- X")
    );
    assert_eq!(
        argv::vm_status_events(),
        v("vm status --event --format json")
    );
    assert_eq!(
        argv::snapshot_save("fork-a", "X"),
        v("snapshot save --name fork-a -- X")
    );
    assert_eq!(argv::snapshot_inspect("a:b"), v("snapshot inspect -- a:b"));
    assert_eq!(argv::snapshot_rm("a"), v("snapshot rm -- a"));
    assert_eq!(
        argv::snapshot_import("a", None),
        v("snapshot import --name a")
    );
    assert_eq!(
        argv::snapshot_import("a", Some("d")),
        v("snapshot import --name a --description d")
    );
    assert_eq!(argv::snapshot_export("a"), v("snapshot export -o - -- a"));
    assert_eq!(argv::image_pull("r", false), v("image pull -- r"));
    assert_eq!(argv::image_pull("r", true), v("image pull --force -- r"));
    // An annotation value that looks like a flag stays an image name.
    assert_eq!(argv::image_pull("--help", false), v("image pull -- --help"));
    assert_eq!(argv::image_inspect("r"), v("image inspect -- r"));
    assert_eq!(argv::image_import("r"), v("image import -- r"));
}

/// Every builder's output passes the last check with contract names, and each name slot
/// refuses a value outside its character set: a flag-like value, a space, an overlong name.
#[test]
fn the_last_check_knows_every_name_slot() {
    let ok = [
        argv::vm_inspect("vk-ns-demo-0"),
        argv::vm_inspect("Q3MZ5T2XKJ7A4LW6PDNB2RVHEY"),
        argv::vm_rm("Q3MZ5T2XKJ7A4LW6PDNB2RVHEY"),
        argv::vm_start("a"),
        argv::vm_logs("a", 5, true),
        argv::vm_net("a", 2),
        argv::vm_reconcile_stale_create("a"),
        argv::vm_list(),
        argv::vm_status_events(),
        argv::snapshot_save("fork-vk-ns-a", "vk-ns-a"),
        argv::snapshot_inspect("team/agent:v3"),
        argv::snapshot_rm("vk-ns-a-hibernate-import"),
        argv::snapshot_export("vk-ns-a"),
        argv::snapshot_import("team/agent:v3", None),
        argv::snapshot_list(),
        argv::image_pull("https://cloud-images.example/a.qcow2?x=1&y=2", true),
        argv::image_inspect("sha256:9f2c"),
        argv::image_import("ghcr.io/org/img@sha256:ab"),
        argv::vm_exec(&ExecOptions {
            vm: "a".into(),
            command: v("-- sh -c true"),
            ..Default::default()
        }),
    ];
    for a in ok {
        assert_eq!(argv::check(&a), Ok(()), "{a:?}");
    }
    let mut run = RunOptions {
        name: "vk-ns-a".into(),
        image: "ghcr.io/o/i:1".into(),
        ..Default::default()
    };
    assert_eq!(argv::check(&argv::vm_run(&run)), Ok(()));
    let mut clone = CloneOptions::from_snapshot("team/agent:v3");
    clone.name = "vk-ns-a".into();
    assert_eq!(argv::check(&argv::vm_clone(&clone)), Ok(()));
    clone.source = CloneSource::FromDir("/srv/x".into());
    assert_eq!(argv::check(&argv::vm_clone(&clone)), Ok(()));

    let long = "a".repeat(64);
    let refused = [
        argv::vm_inspect("--all"),
        argv::vm_inspect("-h"),
        argv::vm_inspect(""),
        argv::vm_inspect("a b"),
        argv::vm_inspect("team/agent"),
        argv::vm_inspect(&long),
        argv::vm_rm("x\n"),
        argv::snapshot_rm("--force"),
        argv::snapshot_save(&long, "a"),
        argv::snapshot_save("ok", "--all"),
        argv::snapshot_import("-x", None),
        argv::image_pull("--help", false),
        argv::image_inspect("a b"),
        argv::vm_exec(&ExecOptions {
            vm: "-i".into(),
            command: v("true"),
            ..Default::default()
        }),
        // A positional without its `--` is refused too: a builder that lost it.
        v("vm inspect a"),
    ];
    for a in refused {
        assert!(argv::check(&a).is_err(), "{a:?} passed");
    }
    run.name = "-n".into();
    assert!(argv::check(&argv::vm_run(&run)).is_err());
    run.name = "vk-ns-a".into();
    run.image = "-x".into();
    assert!(argv::check(&argv::vm_run(&run)).is_err());
    clone.source = CloneSource::Snapshot("a".into());
    clone.name = "bad name".into();
    let e = argv::check(&argv::vm_clone(&clone)).unwrap_err();
    assert!(
        e.0.contains("\"bad name\" is not a cocoon VM name or ID"),
        "{e}"
    );
}

#[test]
fn exec_argv_sorts_env_and_separates_command() {
    let o = ExecOptions {
        vm: "X".into(),
        interactive: true,
        env: vec![("Z".into(), "1".into()), ("A".into(), "b=c".into())],
        command: v("-- sh -c true"),
    };
    assert_eq!(
        argv::vm_exec(&o),
        v("vm exec -i -e A=b=c -e Z=1 -- X -- -- sh -c true")
    );
    let plain = ExecOptions {
        vm: "X".into(),
        command: v("ls"),
        ..Default::default()
    };
    assert_eq!(argv::vm_exec(&plain), v("vm exec -- X -- ls"));
    let d = Deadlines::default();
    assert!(CocoonCall::new(Verb::VmExec, argv::vm_exec(&o), &d).stdin_pipe);
    assert!(!CocoonCall::new(Verb::VmExec, argv::vm_exec(&plain), &d).stdin_pipe);
}

#[test]
fn every_verb_round_trips_through_of_argv_and_has_a_sane_call() {
    let d = Deadlines::default();
    for verb in Verb::ALL {
        let words: Vec<String> = verb.as_str().split(' ').map(String::from).collect();
        assert_eq!(Verb::of_argv(&words), Some(verb));
        let call = CocoonCall::new(verb, words, &d);
        match verb {
            Verb::VmStatusEvents => assert_eq!(call.deadline, None),
            Verb::VmInspect => assert_eq!(call.deadline, Some(Duration::from_secs(30))),
            Verb::VmList => assert_eq!(call.deadline, Some(Duration::from_secs(120))),
            Verb::VmClone | Verb::VmRun => {
                assert_eq!(call.deadline, Some(Duration::from_secs(600)))
            }
            // Saving or moving a snapshot is big data: one hour, for every caller.
            Verb::SnapshotSave | Verb::SnapshotImport | Verb::SnapshotExport | Verb::ImagePull => {
                assert_eq!(call.deadline, Some(Duration::from_secs(3600)))
            }
            _ => {}
        }
        assert!(call.stderr_limit > 0);
    }
    let c = CocoonCall::new(
        Verb::VmClone,
        argv::vm_clone(&CloneOptions::from_snapshot("s")),
        &d,
    )
    .with_deadline(Some(Duration::from_secs(5)));
    assert_eq!(c.deadline, Some(Duration::from_secs(5)));
    assert_eq!(c.full_argv("/bin/cocoon")[0], "/bin/cocoon");
    assert_eq!(c.command_text(), "cocoon vm clone --output json -- s");
}

const INSPECT_EXAMPLE: &str = r#"{
  "id": "Q3MZ5T2XKJ7A4LW6PDNB2RVHEY",
  "hypervisor": "cloud-hypervisor",
  "state": "running",
  "config": {
    "cpu": 2, "memory": 4294967296, "storage": 21474836480,
    "image": "ghcr.io/example/ubuntu:24.04", "image_digest": "sha256:9f2c...",
    "image_type": "oci", "network": "cocoon-dhcp", "name": "vk-ns-demo-0"
  },
  "pid": 481516,
  "socket_path": "/var/lib/cocoon/run/cloudhypervisor/Q3MZ5T2XKJ7A4LW6PDNB2RVHEY/api.sock",
  "network_configs": [
    { "tap": "tapQ3MZ5T2X-0", "mac": "02:5e:8a:11:22:33", "num_queues": 4,
      "queue_size": 512, "backend": "cni",
      "netns_path": "/var/run/netns/cocoon-Q3MZ5T2XKJ7A4LW6PDNB2RVHEY",
      "network": { "ip": "10.88.0.23", "gateway": "10.88.0.1", "prefix": 16 } }
  ],
  "storage_configs": [
    { "path": "/var/lib/cocoon/oci/blobs/ab12....erofs", "ro": true, "serial": "layer0", "role": "layer" },
    { "path": "/var/lib/cocoon/run/cloudhypervisor/Q3MZ5T2XKJ7A4LW6PDNB2RVHEY/cow.raw", "ro": false, "serial": "cocoon-cow", "role": "cow" }
  ],
  "first_booted": true,
  "snapshot_ids": { "7MPT5A6ZS2FNZWQGFN24AZLREW": {} },
  "created_at": "2026-04-27T11:37:00.123456789Z",
  "updated_at": "2026-04-27T11:37:02.5Z",
  "started_at": "2026-04-27T11:37:02.5Z"
}"#;

const SNAPSHOT_EXAMPLE: &str = r#"{
  "cpu": 2, "memory": 4294967296, "storage": 21474836480,
  "image": "https://cloud-images.example/jammy.img", "image_digest": "sha256:51aa...",
  "image_type": "cloudimg",
  "id": "7MPT5A6ZS2FNZWQGFN24AZLREW", "name": "team/agent:v3",
  "image_blob_ids": { "51aa...": {} }, "hypervisor": "cloud-hypervisor", "nics": 1,
  "created_at": "2026-04-27T12:00:00Z"
}"#;

fn call(verb: Verb, args: &str) -> CocoonCall {
    CocoonCall::new(verb, v(args), &Deadlines::default())
}

#[test]
fn spec_inspect_example_parses() {
    let c = call(Verb::VmInspect, "vm inspect Q3MZ");
    let vm = parse_vm(&c, &CallOutcome::ok(INSPECT_EXAMPLE.as_bytes())).unwrap();
    assert_eq!(vm.id, "Q3MZ5T2XKJ7A4LW6PDNB2RVHEY");
    assert_eq!(vm.state_kind(), VmState::Running);
    assert_eq!(vm.pid, 481516);
    assert_eq!(vm.name(), "vk-ns-demo-0");
    assert_eq!(vm.config.storage, 21474836480);
    assert_eq!(vm.primary_ip(), Some("10.88.0.23"));
    let nic = vm.primary_nic().unwrap();
    assert_eq!(nic.mac, "02:5e:8a:11:22:33");
    assert_eq!(nic.network.as_ref().unwrap().prefix, 16);
    assert_eq!(
        vm.cow_disk(),
        Some("/var/lib/cocoon/run/cloudhypervisor/Q3MZ5T2XKJ7A4LW6PDNB2RVHEY/cow.raw")
    );
    assert!(vm.snapshot_ids.contains_key("7MPT5A6ZS2FNZWQGFN24AZLREW"));
    assert_eq!(vm.backend_dir(), "cloudhypervisor");
    assert!(!run_needs_inspect(&vm));
    // Round trip through our own serialiser keeps the data.
    let again: Vm = serde_json::from_str(&serde_json::to_string(&vm).unwrap()).unwrap();
    assert_eq!(again, vm);
}

#[test]
fn spec_snapshot_image_and_stale_create_examples_parse() {
    let c = call(Verb::SnapshotInspect, "snapshot inspect team/agent:v3");
    let s = parse_snapshot(&c, &CallOutcome::ok(SNAPSHOT_EXAMPLE.as_bytes())).unwrap();
    assert_eq!(s.id, "7MPT5A6ZS2FNZWQGFN24AZLREW");
    assert_eq!(s.name, "team/agent:v3");
    assert_eq!(s.image_type, "cloudimg");
    assert_eq!(s.hypervisor, "cloud-hypervisor");
    assert!(s.image_blob_ids.contains_key("51aa..."));
    assert_eq!(s.nics, 1);

    let c = call(Verb::ImageInspect, "image inspect x");
    let img = parse_image(
        &c,
        &CallOutcome::ok(
            br#"{"id":"sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef","name":"ghcr.io/x/y:1","type":"oci","size":1234,"created_at":"2026-04-27T12:00:00Z"}"#,
        ),
    )
    .unwrap();
    assert_eq!(img.kind, "oci");
    assert_eq!(img.size, 1234);

    let c = call(
        Verb::VmReconcileStaleCreate,
        "vm reconcile-stale-create X -o json",
    );
    for (json, want) in [
        (
            r#"{"id":"X","outcome":"collected"}"#,
            StaleCreateOutcome::Collected,
        ),
        (r#"{"id":"X","outcome":"busy"}"#, StaleCreateOutcome::Busy),
        (
            r#"{"id":"X","outcome":"not-creating"}"#,
            StaleCreateOutcome::NotCreating,
        ),
        (r#"{"outcome":"not-found"}"#, StaleCreateOutcome::NotFound),
    ] {
        assert_eq!(
            parse_stale_create_outcome(&c, &CallOutcome::ok(json.as_bytes())).unwrap(),
            want
        );
    }
    let e = parse_stale_create_outcome(&c, &CallOutcome::ok(br#"{"id":"X"}"#)).unwrap_err();
    assert!(matches!(e.kind, ErrorKind::InvalidJson(_)));
    let old = CallOutcome::failed(1, b"Error: unknown shorthand flag: 'o' in -o\n");
    let e = parse_stale_create_outcome(&c, &old).unwrap_err();
    assert_eq!(e.kind, ErrorKind::VerbUnsupported);
}

#[test]
fn list_accepts_b_quirks_and_skips_idless_entries() {
    let c = call(Verb::VmList, "vm list -o json");
    // A Go nil slice prints `null`.
    for empty in [&b""[..], b"No VMs found.\n", b"[]\n", b"  \n", b"null\n"] {
        assert!(parse_vm_list(&c, &CallOutcome::ok(empty))
            .unwrap()
            .is_empty());
    }
    let arr = format!(
        r#"[{INSPECT_EXAMPLE}, {{"state":"running"}}, 42, {{"id":"B2","pid":null,"network_configs":null}}]"#
    );
    let vms = parse_vm_list(&c, &CallOutcome::ok(arr.as_bytes())).unwrap();
    assert_eq!(vms.len(), 2);
    assert_eq!(vms[1].id, "B2");
    assert!(matches!(
        parse_vm_list(&c, &CallOutcome::ok(b"No VMs here"))
            .unwrap_err()
            .kind,
        ErrorKind::InvalidJson(_)
    ));
    let sc = call(Verb::SnapshotList, "snapshot list -o json");
    assert!(
        parse_snapshot_list(&sc, &CallOutcome::ok(b"No snapshots found."))
            .unwrap()
            .is_empty()
    );
}

#[test]
fn hostile_output_gives_typed_errors() {
    let c = call(Verb::VmClone, "vm clone --output json S");
    let e = parse_vm(&c, &CallOutcome::ok(b"{not json")).unwrap_err();
    assert!(matches!(e.kind, ErrorKind::InvalidJson(_)));
    assert!(e
        .to_string()
        .starts_with("cocoon vm clone --output json S: invalid JSON"));
    let e = parse_vm(&c, &CallOutcome::ok(b"{}")).unwrap_err();
    assert_eq!(e.kind, ErrorKind::EmptyRecord);
    let e = parse_vm(&c, &CallOutcome::ok(br#"{"id":""}"#)).unwrap_err();
    assert_eq!(e.kind, ErrorKind::EmptyRecord);
    let e = parse_vm(&c, &CallOutcome::ok(b"")).unwrap_err();
    assert!(matches!(e.kind, ErrorKind::InvalidJson(_)));
    let e = parse_vm(&c, &CallOutcome::ok(br#"{"id":"X","pid":"oops"}"#)).unwrap_err();
    assert!(matches!(e.kind, ErrorKind::InvalidJson(_)));
    let mut huge = CallOutcome::ok(&[b'['; 100]);
    huge.stdout_truncated = true;
    assert_eq!(parse_vm(&c, &huge).unwrap_err().kind, ErrorKind::HugeOutput);

    // Non-zero exit without stderr.
    let e = parse_vm(&c, &CallOutcome::failed(3, b"")).unwrap_err();
    assert_eq!(e.exit, Some(3));
    assert_eq!(e.kind, ErrorKind::Other);
    assert_eq!(
        e.to_string(),
        "cocoon vm clone --output json S: exit status 3"
    );

    // Deadline kill and signal.
    let mut hung = CallOutcome::failed(0, b"partial");
    hung.exit = ExitKind::Signal(9);
    hung.timed_out = true;
    let e = parse_vm(&c, &hung).unwrap_err();
    assert_eq!(e.kind, ErrorKind::TimedOut);
    assert!(e.is_transient());
    hung.timed_out = false;
    assert_eq!(
        parse_vm(&c, &hung).unwrap_err().kind,
        ErrorKind::Signalled(9)
    );

    // Huge stderr is trimmed in the error text.
    let big = vec![b'e'; 100_000];
    let e = parse_vm(&c, &CallOutcome::failed(1, &big)).unwrap_err();
    assert!(e.stderr_trimmed.len() < 3000);
}

#[test]
fn error_text_shape_and_classification() {
    let c = call(Verb::VmInspect, "vm inspect FOO");
    let e = parse_vm(
        &c,
        &CallOutcome::failed(1, b"Error: inspect: vm FOO: VM not found\n"),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "cocoon vm inspect FOO: exit status 1 (stderr: Error: inspect: vm FOO: VM not found)"
    );
    assert_eq!(e.kind, ErrorKind::VmNotFound);
    assert!(e.is_not_found());
    let n = parse_vm(&c, &CallOutcome::failed(1, b"Error: vm not found")).unwrap_err();
    assert_eq!(n.kind, ErrorKind::VmNotFound);
    let nr = parse_vm(&c, &CallOutcome::failed(1, b"Error: start: VM not running")).unwrap_err();
    assert_eq!(nr.kind, ErrorKind::Other);
    assert!(nr.is_inconclusive());

    assert_eq!(
        classify(Verb::SnapshotInspect, "Error: inspect: snapshot not found"),
        ErrorKind::SnapshotNotFound
    );
    assert_eq!(
        classify(
            Verb::SnapshotRm,
            "Error: rm: resolve \"x\": No such snapshot"
        ),
        ErrorKind::SnapshotNotFound
    );
    assert_eq!(
        classify(
            Verb::ImageInspect,
            "Error: image \"r\": not found in any backend"
        ),
        ErrorKind::ImageNotFound
    );
    assert_eq!(
        classify(
            Verb::SnapshotRm,
            "Error: rm: snapshot 7MPT is in use by an active clone/restore/export"
        ),
        ErrorKind::SnapshotInUse
    );
    assert_eq!(
        classify(
            Verb::SnapshotSave,
            "Error: snapshot name \"a\" already exists"
        ),
        ErrorKind::SnapshotNameTaken { holder: None }
    );
    assert_eq!(
        classify(
            Verb::SnapshotSave,
            "Error: snapshot name \"a\" already exists (held by 7MPT5A)"
        ),
        ErrorKind::SnapshotNameTaken {
            holder: Some("7MPT5A".into())
        }
    );
    assert_eq!(
        classify(
            Verb::SnapshotSave,
            "Error: snapshot name \"a\" already in use by ABCDEF"
        ),
        ErrorKind::SnapshotNameTaken {
            holder: Some("ABCDEF".into())
        }
    );
    assert_eq!(
        classify(Verb::VmNet, "Error: backend does not support net resize"),
        ErrorKind::NetResizeUnsupported
    );

    // Combined mode embeds output.
    let rm = call(Verb::VmRm, "vm rm --force X");
    let mut out = CallOutcome::failed(1, b"Error: vm X: VM not found\n");
    out.stdout = b"stopping\n".to_vec();
    let e = rm.check(&out).unwrap_err();
    assert_eq!(
        e.to_string(),
        "cocoon vm rm --force X: exit status 1 (output: stopping\nError: vm X: VM not found)"
    );
    assert!(e.is_not_found());
    assert!(rm.check(&CallOutcome::ok(b"")).is_ok());
}

#[test]
fn exec_status_is_the_guest_status() {
    let c = call(Verb::VmExec, "vm exec X -- false");
    let e = c
        .check(&CallOutcome::failed(3, b"some guest stderr\n"))
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::ExecExit(3));
    let e = c
        .check(&CallOutcome::failed(
            1,
            b"Error: exec: dial agent: refused\n",
        ))
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Other);
    let e = c.check(&CallOutcome::failed(1, b"")).unwrap_err();
    assert_eq!(e.kind, ErrorKind::ExecExit(1));
}

#[test]
fn run_fallback_rule() {
    let c = call(Verb::VmRun, "vm run --output json img");
    let created = parse_vm(
        &c,
        &CallOutcome::ok(br#"{"id":"A","state":"created","pid":0,"config":{"name":"x"}}"#),
    )
    .unwrap();
    assert!(run_needs_inspect(&created));
    let zero_pid = parse_vm(
        &c,
        &CallOutcome::ok(br#"{"id":"A","state":"running","pid":0}"#),
    )
    .unwrap();
    assert!(run_needs_inspect(&zero_pid));
}

#[test]
fn the_provider_commands_are_the_contract_builders_and_deadlines() {
    use vk_cocoon::provider::CocoonCmd;
    let cases = [
        (
            CocoonCmd::VmInspect {
                reference: "X".into(),
            },
            argv::vm_inspect("X"),
        ),
        (CocoonCmd::VmRm { id: "X".into() }, argv::vm_rm("X")),
        (CocoonCmd::VmStart { id: "X".into() }, argv::vm_start("X")),
        (
            CocoonCmd::ReconcileStaleCreate { id: "X".into() },
            argv::vm_reconcile_stale_create("X"),
        ),
        (
            CocoonCmd::SnapshotSave {
                name: "s".into(),
                vm_id: "X".into(),
                deadline: None,
            },
            argv::snapshot_save("s", "X"),
        ),
        (
            CocoonCmd::ImagePull {
                reference: "reg:5000/os/ubuntu:24.04".into(),
                force: true,
            },
            argv::image_pull("reg:5000/os/ubuntu:24.04", true),
        ),
    ];
    let d = Deadlines::default();
    for (cmd, expected) in cases {
        assert_eq!(cmd.argv(), expected);
        assert_eq!(Verb::of_argv(&cmd.argv()), Some(cmd.verb()));
        assert_eq!(Some(cmd.deadline()), d.for_verb(cmd.verb()), "{cmd:?}");
    }
    // The two copies used to disagree: snapshot save is bounded by the one-hour transfer budget.
    let save = CocoonCmd::SnapshotSave {
        name: "s".into(),
        vm_id: "X".into(),
        deadline: None,
    };
    assert_eq!(save.deadline(), Duration::from_secs(3600));
    // A save whose caller bounds it (the fork flight) is killed at that bound instead.
    let bounded = CocoonCmd::SnapshotSave {
        name: "s".into(),
        vm_id: "X".into(),
        deadline: Some(Duration::from_secs(600)),
    };
    assert_eq!(bounded.deadline(), Duration::from_secs(600));
    assert_eq!(bounded.argv(), argv::snapshot_save("s", "X"));
}

#[test]
fn failed_results_are_classified_by_the_contract() {
    use vk_cocoon::vm::Answer;
    let gone = Answer::failed("Error: inspect: vm x: VM not found");
    assert_eq!(gone.kind(), Some(&ErrorKind::VmNotFound));
    assert!(gone.vm_not_found());
    let hung = Answer::timed_out_call();
    assert_eq!(hung.kind(), Some(&ErrorKind::TimedOut));
    assert!(hung.timed_out());
    assert!(!hung.vm_not_found());
    assert_eq!(Answer::ok("vm not found").kind(), None);
    let taken = Answer::failed("Error: snapshot name \"s\" already in use by ABC");
    assert!(taken.name_taken());
}

#[test]
fn a_finished_call_is_classified_once_for_its_verb() {
    use vk_cocoon::vm::Answer;
    // A snapshot verb's "not found" is the snapshot's, whatever else the text names.
    let call = CocoonCall::new(
        Verb::SnapshotInspect,
        argv::snapshot_inspect("s"),
        &Deadlines::default(),
    );
    let both = CallOutcome::failed(1, b"Error: vm not found; snapshot not found");
    let answer = Answer::of(&call, &both);
    assert_eq!(answer.kind(), Some(&ErrorKind::SnapshotNotFound));
    assert!(!answer.succeeded());
    // A signal is its own kind, and the message says so where stderr does not.
    let mut killed = CallOutcome::failed(0, b"");
    killed.exit = ExitKind::Signal(9);
    let answer = Answer::of(&call, &killed);
    assert_eq!(answer.kind(), Some(&ErrorKind::Signalled(9)));
    assert_eq!(answer.error_text(), "vk-cocoon: cocoon killed by signal 9");
    // Success keeps the record, read as the core's typed VM.
    let vm_call = CocoonCall::new(
        Verb::VmInspect,
        argv::vm_inspect("v"),
        &Deadlines::default(),
    );
    let answer = Answer::of(
        &vm_call,
        &CallOutcome::ok(br#"{"id":"V","state":"running","config":{"name":"v"}}"#),
    );
    assert!(answer.succeeded());
    assert_eq!(answer.vm().map(|vm| vm.name), Ok("v".to_string()));
}
