//! Conformance of the fake cocoon: its outputs parse with the `vm` room's types, its errors
//! classify as cocoon's error texts do, archives round-trip, faults fire, parallel copies stay consistent.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use vk_cocoon::sandbox::fake_cocoon::{self, FaultFile, VerbFault};
use vk_cocoon::vm::*;

struct Fake {
    dir: tempfile::TempDir,
    bin: PathBuf,
    envs: Vec<(String, String)>,
}

impl Fake {
    /// `None` (test skipped) when the binary does not dispatch to the fake yet.
    fn new() -> Option<Fake> {
        let bin = PathBuf::from(env!("CARGO_BIN_EXE_vk-cocoon-sandbox"));
        let probe = Command::new(&bin)
            .args(["fake-cocoon", "version"])
            .output()
            .ok()?;
        if !String::from_utf8_lossy(&probe.stdout).contains("cocoon fake") {
            eprintln!("SKIP: vk-cocoon-sandbox does not dispatch `fake-cocoon` yet (main.rs)");
            return None;
        }
        Some(Fake {
            dir: tempfile::tempdir().ok()?,
            bin,
            envs: Vec::new(),
        })
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn cmd(&self, args: &[String]) -> Command {
        let mut c = Command::new(&self.bin);
        c.arg("fake-cocoon")
            .args(args)
            .env("FAKE_COCOON_STATE", self.state());
        for (k, v) in &self.envs {
            c.env(k, v);
        }
        c
    }

    fn run_with_stdin(&self, args: &[String], stdin: Option<&[u8]>) -> CallOutcome {
        let mut c = self.cmd(args);
        c.stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        let mut child = c.spawn().expect("spawn fake");
        if let Some(data) = stdin {
            let mut pipe = child.stdin.take().expect("stdin");
            pipe.write_all(data).expect("write stdin");
        }
        let out = child.wait_with_output().expect("wait fake");
        CallOutcome {
            exit: match out.status.code() {
                Some(c) => ExitKind::Code(c),
                None => ExitKind::Signal(9),
            },
            stdout: out.stdout,
            stderr: out.stderr,
            stdout_truncated: false,
            stderr_truncated: false,
            timed_out: false,
        }
    }

    fn call(&self, argv: Vec<String>) -> (CocoonCall, CallOutcome) {
        let verb = Verb::of_argv(&argv).expect("known verb");
        let call = CocoonCall::new(verb, argv, &Deadlines::default());
        let out = self.run_with_stdin(&call.argv, None);
        (call, out)
    }

    fn ok(&self, argv: Vec<String>) {
        let (call, out) = self.call(argv);
        call.check(&out).expect("call succeeds");
    }

    /// Pulls an image, runs a VM and snapshots it as `base`.
    fn seed(&self) -> Vm {
        self.ok(argv::image_pull("ghcr.io/example/ubuntu:24.04", false));
        let (call, out) = self.call(argv::vm_run(&RunOptions {
            image: "ghcr.io/example/ubuntu:24.04".into(),
            name: "seed".into(),
            cpu: 2,
            memory: "1073741824".into(),
            ..Default::default()
        }));
        let vm = parse_vm(&call, &out).expect("run output parses");
        self.ok(argv::snapshot_save("base", "seed"));
        vm
    }
}

fn s(v: &str) -> Vec<String> {
    v.split(' ').map(String::from).collect()
}

#[test]
fn outputs_parse_with_the_vm_types() {
    let Some(f) = Fake::new() else { return };
    let seeded = f.seed();
    assert_eq!(seeded.state_kind(), VmState::Running);
    assert!(seeded.pid > 0, "run prints the live pid");
    assert!(!run_needs_inspect(&seeded));
    assert_eq!(seeded.config.cpu, 2);
    assert_eq!(seeded.config.memory, 1 << 30);

    let mut o = CloneOptions::from_snapshot("base");
    o.name = "vk-ns-demo-0".into();
    o.restore_mode = Some(RestoreMode::Mmap);
    o.nics = Some(2);
    o.cpu = cpu_policy(Some(500), Some(1000));
    let (call, out) = f.call(argv::vm_clone(&o));
    let clone = parse_vm(&call, &out).expect("clone output parses");
    assert_eq!(clone.state, "running");
    assert_eq!(clone.pid, 0, "clone prints pid 0 like cocoon");
    assert_eq!(clone.name(), "vk-ns-demo-0");
    assert_eq!(clone.id.len(), 26);
    assert_eq!(clone.network_configs.len(), 2);
    let nic = clone.primary_nic().unwrap();
    assert_eq!(nic.tap, format!("tap{}-0", &clone.id[..8]));
    assert!(nic.mac.starts_with("02:") && nic.mac.len() == 17);
    assert!(clone.primary_ip().is_some());
    assert_eq!(clone.config.cpu_weight, 20);
    assert_eq!(clone.config.cpu_quota_us, 100_000);
    let cow = clone.cow_disk().expect("cow disk");
    assert!(Path::new(cow).exists(), "cow.raw is created for metrics");
    assert!(cow.contains("/run/cloudhypervisor/"));

    let (call, out) = f.call(argv::vm_inspect(&clone.id));
    let inspected = parse_vm(&call, &out).unwrap();
    assert!(inspected.pid > 0);
    assert!(inspected.attached_devices.is_some());
    let (call, out) = f.call(argv::vm_inspect("vk-ns-demo-0"));
    assert_eq!(parse_vm(&call, &out).unwrap().id, clone.id);
    let (call, out) = f.call(argv::vm_inspect(&clone.id[..5]));
    assert_eq!(parse_vm(&call, &out).unwrap().id, clone.id);

    let (call, out) = f.call(argv::vm_list());
    let list = parse_vm_list(&call, &out).unwrap();
    assert_eq!(list.len(), 2);

    let (call, out) = f.call(argv::snapshot_inspect("base"));
    let snap = parse_snapshot(&call, &out).unwrap();
    assert_eq!(snap.name, "base");
    assert_eq!(snap.hypervisor, "cloud-hypervisor");
    assert_eq!(snap.image, "ghcr.io/example/ubuntu:24.04");
    assert!(snap.image_digest.starts_with("sha256:"));
    assert!(!snap.image_blob_ids.is_empty());

    let (call, out) = f.call(argv::image_inspect("ghcr.io/example/ubuntu:24.04"));
    let img = parse_image(&call, &out).unwrap();
    assert_eq!(img.kind, "oci");
    assert!(img.size > 0);

    let (call, out) = f.call(argv::vm_reconcile_stale_create(&clone.id));
    assert_eq!(
        parse_stale_create_outcome(&call, &out).unwrap(),
        StaleCreateOutcome::NotCreating
    );
    let (call, out) = f.call(argv::vm_reconcile_stale_create("NOPE"));
    assert_eq!(
        parse_stale_create_outcome(&call, &out).unwrap(),
        StaleCreateOutcome::NotFound
    );

    // Removing the clone: its record, run dir and backing process go away.
    let (call, out) = f.call(argv::vm_rm(&clone.id));
    call.check(&out).unwrap();
    assert!(!Path::new(cow).exists());
    let (call, out) = f.call(argv::vm_inspect(&clone.id));
    assert!(parse_vm(&call, &out).unwrap_err().is_not_found());
}

/// The fake reads a command line as cobra does: before `--` an argument that starts with `-`
/// is a flag, after it a value. Without the separator a tenant's reference such as `--all` or
/// `-f` changes the command (an unknown flag, snapshot rm's `--force` with nothing left to
/// remove); the builders' `--` makes it a name that is looked up and not found.
#[test]
fn end_of_flags_turns_a_flag_like_reference_into_a_name() {
    let Some(f) = Fake::new() else { return };
    f.seed();
    let stderr =
        |args: &str| String::from_utf8_lossy(&f.run_with_stdin(&s(args), None).stderr).into_owned();
    assert!(stderr("vm inspect --all").contains("unknown flag: --all"));
    assert!(stderr("snapshot rm -f").contains("requires at least 1 arg"));
    assert!(stderr("vm clone --output json --name c --name").contains("flag needs an argument"));

    let (call, out) = f.call(argv::vm_inspect("--all"));
    assert_eq!(
        parse_vm(&call, &out).unwrap_err().kind,
        ErrorKind::VmNotFound
    );
    let (call, out) = f.call(argv::snapshot_rm("-f"));
    assert_eq!(
        call.check(&out).unwrap_err().kind,
        ErrorKind::SnapshotNotFound
    );
    let mut clone = CloneOptions::from_snapshot("--name");
    clone.name = "c".into();
    let (call, out) = f.call(argv::vm_clone(&clone));
    assert_eq!(
        parse_vm(&call, &out).unwrap_err().kind,
        ErrorKind::SnapshotNotFound
    );
    // `vm exec` takes its VM after the first `--` as well as before it, as cocoon does.
    for args in ["vm exec -- seed -- echo hi", "vm exec seed -- echo hi"] {
        let out = f.run_with_stdin(&s(args), None);
        assert_eq!(
            out.stdout,
            b"hi\n",
            "{args}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn errors_classify_as_section_9() {
    let Some(f) = Fake::new() else { return };
    f.seed();
    let (call, out) = f.call(argv::vm_inspect("missing"));
    let e = parse_vm(&call, &out).unwrap_err();
    assert_eq!(e.kind, ErrorKind::VmNotFound);
    assert!(e
        .to_string()
        .contains("exit status 1 (stderr: Error: inspect: vm missing: vm not found)"));
    let (call, out) = f.call(argv::vm_rm("missing"));
    assert_eq!(call.check(&out).unwrap_err().kind, ErrorKind::VmNotFound);
    let (call, out) = f.call(argv::snapshot_inspect("missing"));
    assert_eq!(
        parse_snapshot(&call, &out).unwrap_err().kind,
        ErrorKind::SnapshotNotFound
    );
    let (call, out) = f.call(argv::snapshot_rm("missing"));
    assert_eq!(
        call.check(&out).unwrap_err().kind,
        ErrorKind::SnapshotNotFound
    );
    let (call, out) = f.call(argv::image_inspect("nope:1"));
    assert_eq!(
        parse_image(&call, &out).unwrap_err().kind,
        ErrorKind::ImageNotFound
    );
    let (call, out) = f.call(argv::snapshot_save("base", "seed"));
    assert_eq!(
        call.check(&out).unwrap_err().kind,
        ErrorKind::SnapshotNameTaken { holder: None }
    );
    let (call, out) = f.call(argv::vm_clone(&CloneOptions::from_snapshot("nosuch")));
    assert_eq!(
        parse_vm(&call, &out).unwrap_err().kind,
        ErrorKind::SnapshotNotFound
    );
    // Framework errors.
    let out = f.run_with_stdin(&s("vm clone --bogus x"), None);
    assert_eq!(out.exit, ExitKind::Code(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "Error: unknown flag: --bogus\n"
    );
    let out = f.run_with_stdin(&s("frob"), None);
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "Error: unknown command \"frob\" for \"cocoon\"\nRun 'cocoon --help' for usage.\n"
    );
    let out = f.run_with_stdin(&s("vm frob"), None);
    assert_eq!(out.exit, ExitKind::Code(0));
    assert!(!out.stdout.is_empty());
    // Duplicate name.
    let mut o = CloneOptions::from_snapshot("base");
    o.name = "seed".into();
    let (call, out) = f.call(argv::vm_clone(&o));
    let e = parse_vm(&call, &out).unwrap_err();
    assert!(e.stderr_trimmed.contains("vm name \"seed\" already exists"));
}

#[test]
fn generation_b_quirks() {
    let Some(mut f) = Fake::new() else { return };
    f.envs.push(("FAKE_COCOON_GENERATION".into(), "B".into()));
    let (call, out) = f.call(argv::vm_list());
    assert_eq!(out.stdout, b"No VMs found.\n");
    assert!(parse_vm_list(&call, &out).unwrap().is_empty());
    let (call, out) = f.call(argv::vm_reconcile_stale_create("X"));
    let e = parse_stale_create_outcome(&call, &out).unwrap_err();
    assert_eq!(e.kind, ErrorKind::VerbUnsupported);
    assert!(e
        .stderr_trimmed
        .contains("unknown shorthand flag: 'o' in -o"));
    f.seed();
    let (call, out) = f.call(argv::vm_inspect("missing"));
    let e = parse_vm(&call, &out).unwrap_err();
    assert!(e.stderr_trimmed.ends_with("vm missing: VM not found"));
    assert!(e.is_not_found());
}

#[test]
fn snapshot_archives_round_trip_and_images_import() {
    let Some(f) = Fake::new() else { return };
    f.seed();
    let out = f.run_with_stdin(&argv::snapshot_export("base"), None);
    assert_eq!(out.exit, ExitKind::Code(0));
    assert_eq!(&out.stdout[..13], b"snapshot.json");
    // The envelope is the first member, version 1, without created_at.
    let size = u64::from_str_radix(
        std::str::from_utf8(&out.stdout[124..135])
            .unwrap()
            .trim_matches('\0'),
        8,
    )
    .unwrap() as usize;
    let env: SnapshotEnvelope = serde_json::from_slice(&out.stdout[512..512 + size]).unwrap();
    assert_eq!(env.version, 1);
    assert_eq!(env.config.name, "base");
    assert!(env.config.created_at.is_none());
    let archive = out.stdout;

    let imp = f.run_with_stdin(&argv::snapshot_import("pulled", None), Some(&archive));
    assert_eq!(
        imp.exit,
        ExitKind::Code(0),
        "{}",
        String::from_utf8_lossy(&imp.stderr)
    );
    let (call, out) = f.call(argv::snapshot_inspect("pulled"));
    let pulled = parse_snapshot(&call, &out).unwrap();
    assert_ne!(pulled.id, env.config.id, "import makes a fresh ID");
    assert_eq!(pulled.image, env.config.image);
    // A clone from the imported snapshot works.
    f.ok(argv::vm_clone(&CloneOptions::from_snapshot("pulled")));
    // Taken name.
    let (call, _) = f.call(argv::snapshot_import("pulled", None));
    let dup = f.run_with_stdin(&call.argv, Some(&archive));
    let e = call.check(&dup).unwrap_err();
    assert!(e.stderr_trimmed.contains("already in use by"));
    // gzip is detected by magic.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&archive).unwrap();
    let gz = gz.finish().unwrap();
    let imp = f.run_with_stdin(&argv::snapshot_import("gz", None), Some(&gz));
    assert_eq!(imp.exit, ExitKind::Code(0));
    // Garbage archive: typed failure, no panic.
    let bad = f.run_with_stdin(
        &argv::snapshot_import("bad", None),
        Some(b"not a tar at all"),
    );
    assert_eq!(bad.exit, ExitKind::Code(1));
    assert!(String::from_utf8_lossy(&bad.stderr).starts_with("Error: "));

    // Image import sniffs qcow2.
    let mut qcow = b"QFI\xfb".to_vec();
    qcow.extend(vec![0u8; 4096]);
    let imp = f.run_with_stdin(&argv::image_import("win-2022"), Some(&qcow));
    assert_eq!(imp.exit, ExitKind::Code(0));
    let (call, out) = f.call(argv::image_inspect("win-2022"));
    let img = parse_image(&call, &out).unwrap();
    assert_eq!(img.kind, "cloudimg");
    assert_eq!(img.size, 4100);
}

#[test]
fn faults_fire_as_configured() {
    let Some(f) = Fake::new() else { return };
    f.seed();
    let mut faults = FaultFile::new();
    faults.insert(
        "vm inspect".into(),
        VerbFault {
            fail_count: 2,
            fail_message: "inspect: transient backend error".into(),
            ..Default::default()
        },
    );
    faults.insert(
        "vm list".into(),
        VerbFault {
            garbage_count: 1,
            garbage: "{\"truncated".into(),
            ..Default::default()
        },
    );
    faults.insert(
        "vm clone".into(),
        VerbFault {
            placeholder_only: true,
            ..Default::default()
        },
    );
    fake_cocoon::write_faults(&f.state(), &faults).unwrap();
    for _ in 0..2 {
        let (call, out) = f.call(argv::vm_inspect("seed"));
        let e = parse_vm(&call, &out).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Other);
        assert!(e.is_inconclusive());
        assert!(e.stderr_trimmed.contains("transient backend error"));
    }
    let (call, out) = f.call(argv::vm_inspect("seed"));
    assert!(parse_vm(&call, &out).is_ok(), "third call succeeds");
    let (call, out) = f.call(argv::vm_list());
    assert!(matches!(
        parse_vm_list(&call, &out).unwrap_err().kind,
        ErrorKind::InvalidJson(_)
    ));
    assert_eq!(
        parse_vm_list(&call, &f.call(argv::vm_list()).1)
            .unwrap()
            .len(),
        1
    );

    // A crashed clone leaves a `creating` placeholder that reconcile collects.
    let mut o = CloneOptions::from_snapshot("base");
    o.name = "crashed".into();
    let (call, out) = f.call(argv::vm_clone(&o));
    assert!(parse_vm(&call, &out).is_err());
    let (call, out) = f.call(argv::vm_inspect("crashed"));
    let placeholder = parse_vm(&call, &out).unwrap();
    assert_eq!(placeholder.state_kind(), VmState::Creating);
    let (call, out) = f.call(argv::vm_reconcile_stale_create(&placeholder.id));
    assert_eq!(
        parse_stale_create_outcome(&call, &out).unwrap(),
        StaleCreateOutcome::Collected
    );
    let (call, out) = f.call(argv::vm_inspect("crashed"));
    assert!(parse_vm(&call, &out).unwrap_err().is_not_found());

    // A slow clone holds its placeholder: reconcile says busy meanwhile.
    let mut faults = FaultFile::new();
    faults.insert(
        "vm clone".into(),
        VerbFault {
            slow_ms: 1500,
            ..Default::default()
        },
    );
    fake_cocoon::write_faults(&f.state(), &faults).unwrap();
    let mut o = CloneOptions::from_snapshot("base");
    o.name = "slow".into();
    let mut slow = f.cmd(&argv::vm_clone(&o));
    let mut child = slow
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let id = loop {
        if let Some(v) = fake_cocoon::stored_vms(&f.state())
            .into_iter()
            .find(|v| v.vm.config.name == "slow")
        {
            break v.vm.id;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "placeholder never appeared"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    let (call, out) = f.call(argv::vm_reconcile_stale_create(&id));
    assert_eq!(
        parse_stale_create_outcome(&call, &out).unwrap(),
        StaleCreateOutcome::Busy
    );
    assert!(child.wait().unwrap().success());
}

#[test]
fn exec_logs_net_and_stop_semantics() {
    let Some(f) = Fake::new() else { return };
    f.seed();
    let exec = |cmd: &str, interactive: bool, stdin: Option<&[u8]>| {
        // `|` separates argv words so a word may hold spaces.
        let o = ExecOptions {
            vm: "seed".into(),
            interactive,
            env: vec![("B".into(), "2".into()), ("A".into(), "1".into())],
            command: cmd.split('|').map(String::from).collect(),
        };
        let call = CocoonCall::new(Verb::VmExec, argv::vm_exec(&o), &Deadlines::default());
        let out = f.run_with_stdin(&call.argv, stdin);
        (call, out)
    };
    let (call, out) = exec("sh|-c|exit 7", false, None);
    let e = call.check(&out).unwrap_err();
    assert_eq!(e.kind, ErrorKind::ExecExit(7));
    assert!(out.stderr.is_empty(), "no Error: line for guest status");
    let (_, out) = exec("echo|hi|there", false, None);
    assert_eq!(out.stdout, b"hi there\n");
    let (_, out) = exec("cat", true, Some(b"piped bytes"));
    assert_eq!(out.stdout, b"piped bytes");
    let (_, out) = exec("env", false, None);
    assert_eq!(out.stdout, b"A=1\nB=2\n");
    let log = std::fs::read_to_string(f.state().join("exec.log")).unwrap();
    assert_eq!(log.lines().count(), 4);

    let (call, out) = f.call(argv::vm_logs("seed", 1, false));
    call.check(&out).unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);

    let (call, out) = f.call(argv::vm_net("seed", 3));
    call.check(&out).unwrap();
    let (call, out) = f.call(argv::vm_inspect("seed"));
    assert_eq!(parse_vm(&call, &out).unwrap().network_configs.len(), 3);

    // The hypervisor dies on its own (N: stored stopped); vm start brings it back.
    fake_cocoon::stop_vm(&f.state(), "seed", false).unwrap();
    let (call, out) = f.call(argv::vm_inspect("seed"));
    let vm = parse_vm(&call, &out).unwrap();
    assert_eq!(vm.state_kind(), VmState::Stopped);
    assert_eq!(vm.last_transition_reason, "unexpected-exit");
    let (call, out) = exec("true", false, None);
    assert_eq!(call.check(&out).unwrap_err().kind, ErrorKind::Other);
    f.ok(argv::vm_start("seed"));
    let (call, out) = f.call(argv::vm_inspect("seed"));
    let vm = parse_vm(&call, &out).unwrap();
    assert!(vm.is_running() && vm.pid > 0);
    // B-style death: stored running, shown stale.
    fake_cocoon::stop_vm(&f.state(), "seed", true).unwrap();
    let (call, out) = f.call(argv::vm_inspect("seed"));
    assert_eq!(
        parse_vm(&call, &out).unwrap().state_kind(),
        VmState::StoppedStale
    );
}

#[test]
fn parallel_copies_stay_consistent() {
    let Some(mut f) = Fake::new() else { return };
    f.envs.push(("FAKE_COCOON_NO_PROCESS".into(), "1".into()));
    f.seed();
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = (0..24)
        .map(|i| {
            let f = f.clone();
            std::thread::spawn(move || {
                let mut o = CloneOptions::from_snapshot("base");
                o.name = format!("p-{i}");
                let (call, out) = f.call(argv::vm_clone(&o));
                parse_vm(&call, &out).map(|v| v.primary_ip().unwrap_or("").to_string())
            })
        })
        .collect();
    let mut ips: Vec<String> = handles
        .into_iter()
        .map(|h| h.join().unwrap().expect("clone ok"))
        .collect();
    ips.sort();
    ips.dedup();
    assert_eq!(ips.len(), 24, "every clone got its own IP");
    let (call, out) = f.call(argv::vm_list());
    assert_eq!(parse_vm_list(&call, &out).unwrap().len(), 25);
}

#[test]
fn symlink_named_cocoon_dispatches() {
    let Some(f) = Fake::new() else { return };
    let link = f.dir.path().join("cocoon");
    std::os::unix::fs::symlink(&f.bin, &link).unwrap();
    let out = Command::new(&link)
        .args(["vm", "list", "-o", "json"])
        .env("FAKE_COCOON_STATE", f.state())
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(out.stdout, b"[]\n");
}

#[test]
fn a_clone_of_a_saved_snapshot_has_the_guest_files_and_a_half_saved_record_is_removable() {
    let Some(f) = Fake::new() else { return };
    f.seed();
    let exec = |vm: &str, script: &str| {
        let o = ExecOptions {
            vm: vm.into(),
            interactive: false,
            env: vec![],
            command: vec!["sh".into(), "-c".into(), script.into()],
        };
        f.run_with_stdin(&argv::vm_exec(&o), None)
    };
    assert_eq!(
        exec("seed", "echo before the fork > /root/mark").exit,
        ExitKind::Code(0)
    );
    f.ok(argv::snapshot_save("fork-seed", "seed"));
    // Written after the save: not in the snapshot.
    assert_eq!(
        exec("seed", "echo after > /root/later").exit,
        ExitKind::Code(0)
    );
    let mut o = CloneOptions::from_snapshot("fork-seed");
    o.name = "child".into();
    f.ok(argv::vm_clone(&o));
    let out = exec("child", "cat /root/mark");
    assert_eq!(out.stdout, b"before the fork\n");
    let out = exec("child", "cat /root/later");
    assert_eq!(out.exit, ExitKind::Code(1));
    // The source keeps its own files.
    assert_eq!(exec("seed", "cat /root/later").stdout, b"after\n");

    // A save killed half-way leaves a record that holds the name, invisible to inspect.
    let mut faults = FaultFile::new();
    faults.insert(
        "snapshot save".into(),
        VerbFault {
            slow_ms: 60_000,
            ..Default::default()
        },
    );
    fake_cocoon::write_faults(&f.state(), &faults).unwrap();
    let mut saver = f
        .cmd(&argv::snapshot_save("fork-x", "seed"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let snaps = f.state().join("snapshots");
    let reserved = || {
        std::fs::read_dir(&snaps)
            .unwrap()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with(".pending-"))
    };
    let t0 = std::time::Instant::now();
    while !reserved() && t0.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(reserved());
    // While the save runs its record is in use.
    let (call, out) = f.call(argv::snapshot_save("fork-x", "seed"));
    let taken = call.check(&out).unwrap_err();
    assert!(
        matches!(taken.kind, ErrorKind::SnapshotNameTaken { .. }),
        "{taken:?}"
    );
    let holder = taken.stderr_trimmed.rsplit(' ').next().unwrap().to_string();
    let (call, out) = f.call(argv::snapshot_rm(&holder));
    assert!(call.check(&out).is_err(), "in use while its saver runs");
    saver.kill().unwrap();
    saver.wait().unwrap();
    let (call, out) = f.call(argv::snapshot_inspect("fork-x"));
    assert!(call.check(&out).is_err(), "half-saved is invisible");
    std::fs::remove_file(f.state().join("faults.json")).unwrap();
    let (call, out) = f.call(argv::snapshot_save("fork-x", "seed"));
    assert!(
        call.check(&out).is_err(),
        "the half-saved record still holds the name"
    );
    f.ok(argv::snapshot_rm(&holder));
    assert!(!reserved());
    f.ok(argv::snapshot_save("fork-x", "seed"));
    f.ok(argv::snapshot_inspect("fork-x"));
}
