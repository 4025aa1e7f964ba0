//! cocoon calls and the VM event stream through the real reactor and the fake cocoon binary:
//! round trip, 200 concurrent clones, deadline kills, stream latency and restart back-off.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use vk_cocoon::reactor::{Event, Reactor};
use vk_cocoon::sandbox::fake_cocoon::{self, FaultFile, VerbFault};
use vk_cocoon::vm::*;

use crate::load_support;

const STREAM_TIMER: u64 = 77;

struct Env {
    dir: tempfile::TempDir,
    bin: String,
    no_process: bool,
}

impl Env {
    fn new(no_process: bool) -> Option<Env> {
        let bin = env!("CARGO_BIN_EXE_vk-cocoon-sandbox").to_string();
        let probe = Command::new(&bin)
            .args(["fake-cocoon", "version"])
            .output()
            .ok()?;
        if !String::from_utf8_lossy(&probe.stdout).contains("cocoon fake") {
            eprintln!("SKIP: vk-cocoon-sandbox does not dispatch `fake-cocoon` yet (main.rs)");
            return None;
        }
        let dir = tempfile::tempdir().ok()?;
        // The daemon runs `cocoon` by path; a symlink named cocoon selects the fake.
        let link = dir.path().join("cocoon");
        std::os::unix::fs::symlink(&bin, &link).ok()?;
        Some(Env {
            bin: link.display().to_string(),
            dir,
            no_process,
        })
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn env(&self) -> Vec<(String, String)> {
        let mut v = vec![(
            "FAKE_COCOON_STATE".to_string(),
            self.state().display().to_string(),
        )];
        if self.no_process {
            v.push(("FAKE_COCOON_NO_PROCESS".into(), "1".into()));
        }
        v
    }

    fn spawn(&self, r: &mut Reactor<()>, call: &CocoonCall) -> vk_cocoon::reactor::ChildId {
        let mut spec = call.child_spec(&self.bin);
        spec.env = self.env();
        r.spawn(spec).expect("spawn cocoon")
    }

    /// Runs one call to completion on the reactor.
    fn run(&self, r: &mut Reactor<()>, call: &CocoonCall) -> CallOutcome {
        let id = self.spawn(r, call);
        let mut evs = Vec::new();
        loop {
            r.poll(&mut evs).expect("poll");
            for e in evs.drain(..) {
                if let Event::ChildExit(x) = e {
                    if x.id == id {
                        return CallOutcome::from_exit(x);
                    }
                }
            }
        }
    }

    fn call(&self, r: &mut Reactor<()>, argv: Vec<String>) -> (CocoonCall, CallOutcome) {
        let verb = Verb::of_argv(&argv).expect("verb");
        let call = CocoonCall::new(verb, argv, &Deadlines::default());
        let out = self.run(r, &call);
        (call, out)
    }

    fn seed(&self, r: &mut Reactor<()>) -> Vm {
        let (c, o) = self.call(r, argv::image_pull("ghcr.io/example/ubuntu:24.04", false));
        c.check(&o).expect("pull");
        let (c, o) = self.call(
            r,
            argv::vm_run(&RunOptions {
                image: "ghcr.io/example/ubuntu:24.04".into(),
                name: "seed".into(),
                ..Default::default()
            }),
        );
        let vm = parse_vm(&c, &o).expect("run");
        let (c, o) = self.call(r, argv::snapshot_save("base", "seed"));
        c.check(&o).expect("save");
        vm
    }
}

fn reactor() -> Reactor<()> {
    Reactor::new(1, 16).expect("reactor")
}

#[test]
fn clone_inspect_rm_round_trip() {
    let Some(env) = Env::new(false) else { return };
    let mut r = reactor();
    env.seed(&mut r);
    let mut o = CloneOptions::from_snapshot("base");
    o.name = "vk-default-web-0".into();
    o.cpu = cpu_policy(Some(2000), None);
    let (c, out) = env.call(&mut r, argv::vm_clone(&o));
    let vm = parse_vm(&c, &out).expect("clone parses");
    assert_eq!(vm.state_kind(), VmState::Running);
    let (c, out) = env.call(&mut r, argv::vm_inspect(&vm.id));
    let live = parse_vm(&c, &out).expect("inspect parses");
    assert_eq!(live.name(), "vk-default-web-0");
    assert!(live.pid > 0);
    assert!(
        Path::new(&format!("/proc/{}", live.pid)).exists(),
        "backed by a real process"
    );
    let (c, out) = env.call(&mut r, argv::vm_rm(&vm.id));
    c.check(&out).expect("rm");
    let (c, out) = env.call(&mut r, argv::vm_inspect(&vm.id));
    let e = parse_vm(&c, &out).unwrap_err();
    assert!(e.is_not_found(), "{e}");
    // The backing process is gone (killed by rm; reaped by init).
    let deadline = Instant::now() + Duration::from_secs(30);
    while fake_cocoon_pid_alive(live.pid) {
        assert!(Instant::now() < deadline, "vm process survived rm");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn fake_cocoon_pid_alive(pid: i64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            let state = s
                .rfind(')')
                .and_then(|i| s[i + 1..].split_whitespace().next().map(str::to_string))
                .unwrap_or_default();
            state != "Z" && state != "X"
        })
        .unwrap_or(false)
}

#[test]
fn two_hundred_clones_at_once_all_complete() {
    let Some(env) = Env::new(true) else { return };
    let mut r = reactor();
    env.seed(&mut r);
    let d = Deadlines::default();
    let mut pending = std::collections::HashMap::new();
    for i in 0..200 {
        let mut o = CloneOptions::from_snapshot("base");
        o.name = format!("burst-{i}");
        let call = CocoonCall::new(Verb::VmClone, argv::vm_clone(&o), &d);
        let id = env.spawn(&mut r, &call);
        pending.insert(id, call);
    }
    let mut evs = Vec::new();
    let mut ids = std::collections::HashSet::new();
    while !pending.is_empty() {
        r.poll(&mut evs).expect("poll");
        for e in evs.drain(..) {
            if let Event::ChildExit(x) = e {
                let call = pending.remove(&x.id).expect("our child");
                let vm = parse_vm(&call, &CallOutcome::from_exit(x)).expect("clone ok");
                assert!(ids.insert(vm.id));
            }
        }
    }
    assert_eq!(ids.len(), 200);
    let (c, out) = env.call(&mut r, argv::vm_list());
    assert_eq!(parse_vm_list(&c, &out).unwrap().len(), 201);
}

#[test]
fn hung_call_is_killed_at_its_deadline() {
    let Some(env) = Env::new(true) else { return };
    let mut r = reactor();
    let mut faults = FaultFile::new();
    faults.insert(
        "vm inspect".into(),
        VerbFault {
            hang: true,
            ..Default::default()
        },
    );
    fake_cocoon::write_faults(&env.state(), &faults).unwrap();
    let call = CocoonCall::new(
        Verb::VmInspect,
        argv::vm_inspect("x"),
        &Deadlines::default(),
    )
    .with_deadline(Some(Duration::from_millis(300)));
    let t0 = Instant::now();
    let out = env.run(&mut r, &call);
    let took = t0.elapsed();
    let e = parse_vm(&call, &out).unwrap_err();
    assert_eq!(e.kind, ErrorKind::TimedOut);
    assert!(e.is_transient() && e.is_inconclusive());
    assert!(took >= Duration::from_millis(300), "killed early: {took:?}");
    // The fault hangs for ever: any end at all is the deadline's kill.
    assert!(took < Duration::from_secs(20), "killed late: {took:?}");
}

/// Polls the reactor, feeding the stream, until `want` matches an event or `limit` passes.
fn wait_event(
    r: &mut Reactor<()>,
    stream: &mut EventStream,
    limit: Duration,
    mut want: impl FnMut(&VmEvent) -> bool,
) -> Option<(VmEvent, Instant)> {
    // Events the stream handed over after the one an earlier wait wanted (one read can
    // carry several) are this wait's first candidates.
    let held = UNSEEN.with(|u| std::mem::take(&mut *u.borrow_mut()));
    let mut held = held.into_iter();
    while let Some(ev) = held.next() {
        if want(&ev) {
            UNSEEN.with(|u| u.borrow_mut().extend(held));
            return Some((ev, Instant::now()));
        }
    }
    let end = Instant::now() + limit;
    let guard = r.timer_at(end, 999);
    let mut evs = Vec::new();
    loop {
        r.poll(&mut evs).expect("poll");
        for e in evs.drain(..) {
            if let Some(out) = stream.handle(r, &e) {
                let mut events = out.events.into_iter();
                while let Some(ev) = events.next() {
                    if want(&ev) {
                        let at = Instant::now();
                        r.cancel_timer(guard);
                        UNSEEN.with(|u| u.borrow_mut().extend(events));
                        return Some((ev, at));
                    }
                }
            }
        }
        if Instant::now() >= end {
            return None;
        }
    }
}

thread_local! {
    /// Stream events read but not yet looked at by a `wait_event` (per test thread).
    static UNSEEN: std::cell::RefCell<Vec<VmEvent>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[test]
fn event_stream_sees_a_stopped_vm_within_100ms() {
    let Some(env) = Env::new(true) else { return };
    let mut r = reactor();
    let seeded = env.seed(&mut r);
    let mut stream = EventStream::new(&env.bin, env.env(), STREAM_TIMER, Instant::now());
    stream.start(&mut r);
    let (added, _) = wait_event(&mut r, &mut stream, Duration::from_secs(30), |e| {
        e.kind == EventKind::Added && e.vm.id == seeded.id
    })
    .expect("ADDED for the existing VM");
    assert_eq!(added.vm.state_kind(), VmState::Running);

    let mut latencies = Vec::new();
    let ((), wakeup) = load_support::with_wakeup_probe(|| {
        for round in 0..5 {
            let t0 = Instant::now();
            fake_cocoon::stop_vm(&env.state(), &seeded.id, false).unwrap();
            let (ev, at) = wait_event(&mut r, &mut stream, Duration::from_secs(30), |e| {
                e.kind == EventKind::Modified && e.vm.id == seeded.id && !e.vm.is_running()
            })
            .unwrap_or_else(|| panic!("round {round}: no MODIFIED event"));
            assert_eq!(ev.vm.state_kind(), VmState::Stopped);
            latencies.push(at - t0);
            fake_cocoon::set_state(&env.state(), &seeded.id, "running").unwrap();
            wait_event(&mut r, &mut stream, Duration::from_secs(30), |e| {
                e.vm.id == seeded.id && e.vm.is_running()
            })
            .expect("back to running");
        }
    });
    latencies.sort();
    eprintln!("stop -> typed event latencies: {latencies:?}");
    // cocoon's ticker would take seconds (5 s period); a loaded host delays the stream's
    // child by the time it waits for a CPU, which only a quiet host leaves out.
    assert!(
        latencies[2] < Duration::from_secs(1),
        "median latency {:?}",
        latencies[2]
    );
    if load_support::quiet_host(wakeup) {
        assert!(
            latencies[2] < Duration::from_millis(100),
            "median latency {:?} over 100 ms",
            latencies[2]
        );
        assert!(latencies[4] < Duration::from_secs(1));
    }

    // A vanished VM arrives as DELETED.
    fake_cocoon::vanish_vm(&env.state(), &seeded.id).unwrap();
    let (ev, _) = wait_event(&mut r, &mut stream, Duration::from_secs(30), |e| {
        e.kind == EventKind::Deleted
    })
    .expect("DELETED");
    assert_eq!(ev.vm.id, seeded.id);
    stream.stop(&mut r);
}

/// Waits for the stream's child to be (re)spawned; returns when it happened.
fn wait_spawn(r: &mut Reactor<()>, stream: &mut EventStream, limit: Duration) -> (Instant, bool) {
    let end = Instant::now() + limit;
    let guard = r.timer_at(end, 998);
    let mut evs = Vec::new();
    let mut resync = false;
    loop {
        r.poll(&mut evs).expect("poll");
        for e in evs.drain(..) {
            if let Some(out) = stream.handle(r, &e) {
                resync |= out.resync;
            }
        }
        if stream.child().is_some() {
            r.cancel_timer(guard);
            return (Instant::now(), resync);
        }
        assert!(
            Instant::now() < end,
            "stream was not restarted in {limit:?}"
        );
    }
}

/// Polls until the stream child has exited.
fn wait_exit(r: &mut Reactor<()>, stream: &mut EventStream) -> (ExitKind, Instant) {
    let mut evs = Vec::new();
    let guard = r.timer_at(Instant::now() + Duration::from_secs(30), 997);
    loop {
        r.poll(&mut evs).expect("poll");
        for e in evs.drain(..) {
            if let Some(out) = stream.handle(r, &e) {
                if let Some((kind, _)) = out.ended {
                    r.cancel_timer(guard);
                    return (kind, Instant::now());
                }
            }
        }
    }
}

#[test]
fn killed_stream_child_restarts_with_backoff() {
    let Some(env) = Env::new(true) else { return };
    let mut r = reactor();
    let seeded = env.seed(&mut r);
    let mut stream = EventStream::new(&env.bin, env.env(), STREAM_TIMER, Instant::now());
    stream.start(&mut r);
    wait_event(&mut r, &mut stream, Duration::from_secs(30), |e| {
        e.vm.id == seeded.id
    })
    .expect("connected");

    // Kill a connected stream: abnormal exit, back-off reset by the connect => 1 s.
    // The next start fails once (exit 1, no output) => 2 s, then it runs again.
    let mut faults = FaultFile::new();
    faults.insert(
        "vm status".into(),
        VerbFault {
            fail_count: 1,
            fail_message: "status: meta store unavailable".into(),
            ..Default::default()
        },
    );
    fake_cocoon::write_faults(&env.state(), &faults).unwrap();
    let id = stream.child().expect("running");
    let wakeup_probe = load_support::WakeupProbe::start();
    r.kill(id);
    let (kind, died) = wait_exit(&mut r, &mut stream);
    assert_eq!(kind, ExitKind::Signal(9));
    let (respawned, resync) = wait_spawn(&mut r, &mut stream, Duration::from_secs(30));
    let gap1 = respawned - died;
    assert!(resync, "a restart owes a re-sync list");
    let (kind, failed) = wait_exit(&mut r, &mut stream);
    assert_eq!(kind, ExitKind::Code(1));
    let (respawned2, _) = wait_spawn(&mut r, &mut stream, Duration::from_secs(30));
    let gap2 = respawned2 - failed;
    eprintln!("restart gaps: {gap1:?}, {gap2:?}");
    // Never early, whatever the load; on time only where the host had a CPU to give.
    assert!(gap1 >= Duration::from_millis(950), "{gap1:?}");
    assert!(gap2 >= Duration::from_millis(1950), "{gap2:?}");
    if load_support::quiet_host(wakeup_probe.stop()) {
        assert!(gap1 < Duration::from_millis(1600), "{gap1:?}");
        assert!(gap2 < Duration::from_millis(2600), "{gap2:?}");
    }
    // And it works again.
    fake_cocoon::stop_vm(&env.state(), &seeded.id, false).unwrap();
    wait_event(&mut r, &mut stream, Duration::from_secs(30), |e| {
        e.vm.id == seeded.id && !e.vm.is_running()
    })
    .expect("events flow after restarts");
    stream.stop(&mut r);
}

#[test]
fn export_streams_out_and_import_streams_in() {
    let Some(env) = Env::new(true) else { return };
    let mut r = reactor();
    env.seed(&mut r);
    let d = Deadlines::default();
    // Export: stdout arrives as chunks; nothing is captured in the exit report.
    let export = CocoonCall::new(Verb::SnapshotExport, argv::snapshot_export("base"), &d);
    assert_eq!(export.mode, CallMode::Streaming);
    let id = env.spawn(&mut r, &export);
    let mut archive = Vec::new();
    let mut chunks = 0;
    let mut evs = Vec::new();
    let exit = 'outer: loop {
        r.poll(&mut evs).unwrap();
        for e in evs.drain(..) {
            match e {
                Event::ChildOutput { id: cid, data, .. } if cid == id => {
                    chunks += 1;
                    archive.extend_from_slice(&data);
                }
                Event::ChildExit(x) if x.id == id => break 'outer CallOutcome::from_exit(x),
                _ => {}
            }
        }
    };
    export.check(&exit).expect("export ok");
    assert!(exit.stdout.is_empty());
    assert!(chunks >= 1 && archive.len() > 256 << 10);
    assert_eq!(&archive[..13], b"snapshot.json");

    // Import: the archive is written to the stdin pipe in pieces, then stdin is closed.
    let import = CocoonCall::new(
        Verb::SnapshotImport,
        argv::snapshot_import("copy", None),
        &d,
    );
    assert!(import.stdin_pipe);
    let id = env.spawn(&mut r, &import);
    for piece in archive.chunks(64 << 10) {
        r.write_stdin(id, piece).unwrap();
    }
    r.close_stdin(id);
    let out = loop {
        r.poll(&mut evs).unwrap();
        if let Some(x) = evs.drain(..).find_map(|e| match e {
            Event::ChildExit(x) if x.id == id => Some(x),
            _ => None,
        }) {
            break CallOutcome::from_exit(x);
        }
    };
    import.check(&out).expect("import ok");
    let (c, o) = env.call(&mut r, argv::snapshot_inspect("copy"));
    assert_eq!(
        parse_snapshot(&c, &o).unwrap().image,
        "ghcr.io/example/ubuntu:24.04"
    );
}

#[test]
fn run_fallback_inspect_when_run_prints_created() {
    let Some(env) = Env::new(true) else { return };
    let mut r = reactor();
    env.seed(&mut r);
    let mut faults = FaultFile::new();
    faults.insert(
        "vm run".into(),
        VerbFault {
            print_created: true,
            ..Default::default()
        },
    );
    fake_cocoon::write_faults(&env.state(), &faults).unwrap();
    let (c, o) = env.call(
        &mut r,
        argv::vm_run(&RunOptions {
            image: "ghcr.io/example/ubuntu:24.04".into(),
            name: "second".into(),
            ..Default::default()
        }),
    );
    let printed = parse_vm(&c, &o).unwrap();
    assert_eq!(printed.state_kind(), VmState::Created);
    assert!(run_needs_inspect(&printed));
    let (c, o) = env.call(&mut r, argv::vm_inspect(&printed.id));
    assert!(parse_vm(&c, &o).unwrap().is_running());
}

#[test]
fn failed_listing_in_the_stream_reads_as_deleted_then_added() {
    let Some(env) = Env::new(true) else { return };
    let mut r = reactor();
    let seeded = env.seed(&mut r);
    let mut faults = FaultFile::new();
    faults.insert(
        "vm status".into(),
        VerbFault {
            blank_lists: 1,
            garbage_count: 1,
            garbage: "{\"event\":\"ADDED\",\"vm\":".into(),
            ..Default::default()
        },
    );
    fake_cocoon::write_faults(&env.state(), &faults).unwrap();
    let mut stream = EventStream::new(&env.bin, env.env(), STREAM_TIMER, Instant::now());
    stream.start(&mut r);
    // The garbage line is skipped, not fatal; the real ADDED follows.
    wait_event(&mut r, &mut stream, Duration::from_secs(30), |e| {
        e.kind == EventKind::Added && e.vm.id == seeded.id
    })
    .expect("ADDED after garbage");
    // Any change triggers a refresh whose listing fails: DELETED, then ADDED again.
    fake_cocoon::set_state(&env.state(), &seeded.id, "running").unwrap();
    fake_cocoon::set_state(&env.state(), "seed", "stopped").unwrap();
    wait_event(&mut r, &mut stream, Duration::from_secs(30), |e| {
        e.kind == EventKind::Deleted && e.vm.id == seeded.id
    })
    .expect("DELETED from the failed listing");
    wait_event(&mut r, &mut stream, Duration::from_secs(30), |e| {
        e.kind == EventKind::Added && e.vm.id == seeded.id
    })
    .expect("ADDED again");
    stream.stop(&mut r);
}
