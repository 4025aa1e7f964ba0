//! Reactor behaviour through its public API: timers, children, workers, signals.
//! Children are coreutils programs run by argv (tee, cat, sleep, true, head, env); no shell.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use vk_cocoon::reactor::{
    ChildExit, ChildId, ChildSpec, Event, OutputMode, QueueFull, Reactor, StdinMode, Stream,
};

type R = Reactor<u64>;

fn reactor() -> R {
    Reactor::new(2, 16).expect("reactor")
}

/// Polls until `pred` has seen what it wants, failing after `limit`.
fn pump(r: &mut R, limit: Duration, mut pred: impl FnMut(&Event<u64>) -> bool) {
    let stop = Instant::now() + limit;
    // A guard timer so poll returns even if nothing else happens.
    let guard = r.timer_at(stop, u64::MAX);
    let mut out = Vec::new();
    loop {
        out.clear();
        r.poll(&mut out).expect("poll");
        for ev in &out {
            if let Event::Timer { key: u64::MAX, .. } = ev {
                panic!("condition not reached within {limit:?}");
            }
            if pred(ev) {
                r.cancel_timer(guard);
                return;
            }
        }
    }
}

fn wait_exit(r: &mut R, id: ChildId, limit: Duration) -> ChildExit {
    let mut found = None;
    pump(r, limit, |ev| match ev {
        Event::ChildExit(e) if e.id == id => {
            found = Some(e.clone());
            true
        }
        _ => false,
    });
    found.expect("exit")
}

/// Polls until a spawner thread has started child `id`; its pid.
fn wait_started(r: &mut R, id: ChildId) -> u32 {
    let stop = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    loop {
        if let Some(pid) = r.pid(id) {
            return pid;
        }
        assert!(Instant::now() < stop, "{id} never started");
        r.timer_after(Duration::from_millis(5), u64::MAX - 1);
        out.clear();
        r.poll(&mut out).expect("poll");
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 13) as u8)
        .collect()
}

fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read/write the struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

#[test]
fn timers_fire_in_deadline_order_and_never_early() {
    let mut r = reactor();
    let base = Instant::now();
    let offsets = [50u64, 10, 30, 20, 40, 30];
    let mut due = HashMap::new();
    for (i, ms) in offsets.iter().enumerate() {
        let at = base + Duration::from_millis(*ms);
        r.timer_at(at, i as u64);
        due.insert(i as u64, at);
    }
    let mut fired = Vec::new();
    let mut out = Vec::new();
    while fired.len() < offsets.len() {
        out.clear();
        r.poll(&mut out).unwrap();
        for ev in &out {
            match ev {
                Event::Timer { key, .. } => {
                    let now = Instant::now();
                    assert!(now >= due[key], "timer {key} fired early");
                    assert!(
                        r.now() >= due[key],
                        "reactor clock before deadline of {key}"
                    );
                    fired.push(*key);
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    // Deadline order; equal deadlines (keys 2 and 5 at 30 ms) in arming order.
    assert_eq!(fired, vec![1, 3, 2, 5, 4, 0]);
    assert_eq!(r.timers_armed(), 0);
}

#[test]
fn cancelled_timers_never_fire() {
    let mut r = reactor();
    let base = Instant::now();
    let a = r.timer_at(base + Duration::from_millis(10), 1);
    let _b = r.timer_at(base + Duration::from_millis(60), 2);
    let c = r.timer_at(base + Duration::from_millis(30), 3);
    assert!(r.cancel_timer(a));
    assert!(r.cancel_timer(c));
    assert!(!r.cancel_timer(c), "second cancel reports not armed");
    let mut out = Vec::new();
    r.poll(&mut out).unwrap();
    assert_eq!(out.len(), 1);
    assert!(
        matches!(out[0], Event::Timer { key: 2, .. }),
        "{:?}",
        out[0]
    );
    assert!(Instant::now() >= base + Duration::from_millis(60));
}

#[test]
fn large_interleaved_stdout_and_stderr_are_captured_completely() {
    // tee copies stdin to stdout and to /dev/stderr in alternating writes, so a
    // reactor that drained one pipe before the other would deadlock here.
    let mut r = reactor();
    let input = pattern(6 << 20, 7);
    let id = r
        .spawn(
            ChildSpec::new(["tee", "/dev/stderr"])
                .stdin(StdinMode::Bytes(input.clone()))
                .stdout(OutputMode::Capture { limit: 8 << 20 })
                .stderr(OutputMode::Capture { limit: 8 << 20 })
                .deadline(Duration::from_secs(30)),
        )
        .unwrap();
    let exit = wait_exit(&mut r, id, Duration::from_secs(40));
    assert!(exit.success(), "{exit:?}");
    assert!(!exit.timed_out && !exit.killed);
    assert_eq!(exit.stdout.len(), input.len());
    assert!(exit.stdout == input, "stdout differs");
    assert!(exit.stderr == input, "stderr differs");
    assert!(!exit.stdout_truncated && !exit.stderr_truncated);
}

#[test]
fn capture_is_bounded_and_flags_truncation() {
    let mut r = reactor();
    let input = pattern(1 << 20, 3);
    let id = r
        .spawn(
            ChildSpec::new(["cat"])
                .stdin(StdinMode::Bytes(input.clone()))
                .stdout(OutputMode::Capture { limit: 1000 }),
        )
        .unwrap();
    let exit = wait_exit(&mut r, id, Duration::from_secs(20));
    assert!(exit.success());
    assert_eq!(exit.stdout, input[..1000]);
    assert!(exit.stdout_truncated);
    assert!(!exit.stderr_truncated);
}

#[test]
fn streamed_output_arrives_in_chunks_before_the_exit() {
    let mut r = reactor();
    let input = pattern(3 << 20, 11);
    let id = r
        .spawn(
            ChildSpec::new(["tee", "/dev/stderr"])
                .stdin(StdinMode::Bytes(input.clone()))
                .stdout(OutputMode::Stream)
                .stderr(OutputMode::Capture { limit: 4 << 20 }),
        )
        .unwrap();
    let mut streamed = Vec::new();
    let mut chunks = 0;
    let mut exit = None;
    pump(&mut r, Duration::from_secs(30), |ev| match ev {
        Event::ChildOutput {
            id: cid,
            stream,
            data,
        } => {
            assert_eq!(*cid, id);
            assert_eq!(*stream, Stream::Stdout);
            streamed.extend_from_slice(data);
            chunks += 1;
            false
        }
        Event::ChildExit(e) => {
            exit = Some(e.clone());
            true
        }
        _ => false,
    });
    let exit = exit.unwrap();
    assert!(exit.success());
    assert!(
        exit.stdout.is_empty(),
        "streamed output is not also captured"
    );
    assert!(streamed == input, "streamed bytes differ");
    assert!(chunks > 1);
    assert!(exit.stderr == input);
}

#[test]
fn stdin_pipe_is_written_in_order_and_closed_on_request() {
    let mut r = reactor();
    let id = r
        .spawn(ChildSpec::new(["cat"]).stdin(StdinMode::Pipe))
        .unwrap();
    let big = pattern(300_000, 5); // more than a pipe holds: needs buffered writes
    r.write_stdin(id, b"hello ").unwrap();
    r.write_stdin(id, &big).unwrap();
    r.write_stdin(id, b" world").unwrap();
    r.close_stdin(id);
    assert!(
        r.write_stdin(id, b"late").is_err(),
        "write after close is refused"
    );
    let exit = wait_exit(&mut r, id, Duration::from_secs(20));
    let mut want = b"hello ".to_vec();
    want.extend_from_slice(&big);
    want.extend_from_slice(b" world");
    assert!(exit.stdout == want);
}

#[test]
fn hung_child_is_killed_at_its_deadline() {
    let mut r = reactor();
    let start = Instant::now();
    let id = r
        .spawn(ChildSpec::new(["sleep", "30"]).deadline(Duration::from_millis(300)))
        .unwrap();
    let exit = wait_exit(&mut r, id, Duration::from_secs(40));
    let took = start.elapsed();
    assert!(exit.timed_out);
    assert_eq!(exit.signal(), Some(libc::SIGKILL));
    assert_eq!(exit.code(), None);
    assert!(took >= Duration::from_millis(300), "killed early: {took:?}");
    // `sleep 30` ended by anything but the deadline would take 30 s; a loaded host only
    // delays the kill.
    assert!(took < Duration::from_secs(20), "killed late: {took:?}");
    assert_not_zombie(exit.pid);
}

/// With a grace the deadline sends SIGTERM first: a child that stops on it ends there.
#[test]
fn a_child_with_a_grace_gets_sigterm_at_its_deadline() {
    let mut r = reactor();
    let start = Instant::now();
    let spec = ChildSpec::new(["sleep", "30"])
        .deadline(Duration::from_millis(300))
        .term_grace(Duration::from_secs(20));
    let id = r.spawn(spec).unwrap();
    let exit = wait_exit(&mut r, id, Duration::from_secs(40));
    assert!(exit.timed_out);
    assert_eq!(exit.signal(), Some(libc::SIGTERM));
    // Well before the 20 s grace ran out (a loaded host only delays it).
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "{:?}",
        start.elapsed()
    );
}

/// A child that ignores SIGTERM gets SIGKILL once the grace has run out.
#[test]
fn a_child_ignoring_sigterm_is_killed_after_its_grace() {
    let mut r = reactor();
    let start = Instant::now();
    let spec = ChildSpec::new(["env", "--ignore-signal=TERM", "sleep", "30"])
        .deadline(Duration::from_millis(300))
        .term_grace(Duration::from_millis(700));
    let id = r.spawn(spec).unwrap();
    let exit = wait_exit(&mut r, id, Duration::from_secs(40));
    let took = start.elapsed();
    assert!(exit.timed_out);
    assert_eq!(exit.signal(), Some(libc::SIGKILL));
    assert!(
        took >= Duration::from_millis(1000),
        "killed before the grace: {took:?}"
    );
    assert!(took < Duration::from_secs(20), "killed late: {took:?}");
    assert_not_zombie(exit.pid);
}

#[test]
fn kill_reports_killed() {
    let mut r = reactor();
    let id = r.spawn(ChildSpec::new(["sleep", "30"])).unwrap();
    r.kill(id);
    let exit = wait_exit(&mut r, id, Duration::from_secs(40));
    assert!(exit.killed && !exit.timed_out);
    assert_eq!(exit.signal(), Some(libc::SIGKILL));
}

#[test]
fn spawn_of_missing_program_is_reported_as_an_exit_that_never_ran() {
    let mut r = reactor();
    let id = r
        .spawn(ChildSpec::new(["/nonexistent/vk-cocoon-test"]).deadline(Duration::from_secs(60)))
        .expect("the spawn is only requested here");
    let exit = wait_exit(&mut r, id, Duration::from_secs(40));
    let err = exit.spawn_error.clone().expect("a spawn error");
    assert_eq!(err.kind, std::io::ErrorKind::NotFound);
    assert!(exit.status.is_none() && !exit.success());
    assert!(r.spawn(ChildSpec::default()).is_err(), "empty argv");
    assert_eq!(r.children_running(), 0);
    assert_eq!(r.timers_armed(), 0, "its deadline timer is cancelled");
}

/// The loop never waits for a fork+exec: `spawn` returns before the child is known to run
/// (its pid comes with a later poll), however many are asked for at once.
#[test]
fn spawn_returns_before_the_child_runs() {
    let mut r = reactor();
    let ids: Vec<ChildId> = (0..50)
        .map(|_| r.spawn(ChildSpec::new(["true"])).unwrap())
        .collect();
    assert!(ids.iter().all(|id| r.pid(*id).is_none()));
    assert_eq!(r.children_running(), 50);
    let mut left: std::collections::HashSet<ChildId> = ids.into_iter().collect();
    pump(&mut r, Duration::from_secs(30), |ev| {
        if let Event::ChildExit(e) = ev {
            assert!(e.success(), "{e:?}");
            assert!(e.pid > 0);
            left.remove(&e.id);
        }
        left.is_empty()
    });
    assert_eq!(r.children_running(), 0);
}

/// What is asked of a child while it is still starting is applied once it runs: a kill, a
/// deadline that passed, stdin written and closed.
#[test]
fn a_starting_child_gets_its_kill_deadline_and_stdin_once_it_runs() {
    let mut r = reactor();
    let killed = r.spawn(ChildSpec::new(["sleep", "30"])).unwrap();
    r.kill(killed);
    let timed = r
        .spawn(ChildSpec::new(["sleep", "30"]).deadline(Duration::ZERO))
        .unwrap();
    let cat = r
        .spawn(ChildSpec::new(["cat"]).stdin(StdinMode::Pipe))
        .unwrap();
    r.write_stdin(cat, b"early ").unwrap();
    r.write_stdin(cat, b"bytes").unwrap();
    assert_eq!(r.stdin_queued(cat), 11);
    r.close_stdin(cat);
    assert!(r.write_stdin(cat, b"late").is_err(), "stdin is closing");

    let mut exits = HashMap::new();
    pump(&mut r, Duration::from_secs(10), |ev| {
        if let Event::ChildExit(e) = ev {
            exits.insert(e.id, e.clone());
        }
        exits.len() == 3
    });
    let exit = &exits[&killed];
    assert!(exit.killed && !exit.timed_out, "{exit:?}");
    assert_eq!(exit.signal(), Some(libc::SIGKILL));
    let exit = &exits[&timed];
    assert!(exit.timed_out, "{exit:?}");
    assert_eq!(exit.signal(), Some(libc::SIGKILL));
    let exit = &exits[&cat];
    assert!(exit.success(), "{exit:?}");
    assert_eq!(exit.stdout, b"early bytes");
}

/// A streamed child paused while starting stays paused once it runs: no output until resumed.
#[test]
fn a_child_paused_while_starting_sends_nothing_until_resumed() {
    let mut r = reactor();
    let id = r
        .spawn(
            ChildSpec::new(["cat"])
                .stdin(StdinMode::Pipe)
                .stdout(OutputMode::Stream),
        )
        .unwrap();
    r.pause_output(id);
    r.write_stdin(id, b"hello\n").unwrap();
    wait_started(&mut r, id);
    // cat echoes at once and keeps running; nothing may arrive while paused.
    let until = Instant::now() + Duration::from_millis(300);
    r.timer_at(until, 7);
    let mut out = Vec::new();
    loop {
        out.clear();
        r.poll(&mut out).expect("poll");
        for ev in &out {
            assert!(
                !matches!(ev, Event::ChildOutput { .. }),
                "output while paused: {ev:?}"
            );
        }
        if out.iter().any(|e| matches!(e, Event::Timer { key: 7, .. })) {
            break;
        }
    }
    r.resume_output(id);
    r.close_stdin(id);
    let mut got = Vec::new();
    pump(&mut r, Duration::from_secs(10), |ev| match ev {
        Event::ChildOutput { data, .. } => {
            got.extend_from_slice(data);
            false
        }
        Event::ChildExit(e) => e.id == id,
        _ => false,
    });
    assert_eq!(got, b"hello\n");
}

/// The child has exited (its output sits in the pipe) before the loop looks at
/// it, so exit readiness and pipe readiness arrive together in either order.
fn early_exit_loses_no_output(r: &mut R) {
    for round in 0..20u8 {
        let input = pattern(40_000 + usize::from(round) * 1000, round);
        let id = r
            .spawn(ChildSpec::new(["tee", "/dev/stderr"]).stdin(StdinMode::Bytes(input.clone())))
            .unwrap();
        // Give the child time to write everything and exit before polling.
        std::thread::sleep(Duration::from_millis(30));
        let exit = wait_exit(r, id, Duration::from_secs(10));
        assert!(exit.success());
        assert!(exit.stdout == input, "round {round}: stdout lost bytes");
        assert!(exit.stderr == input, "round {round}: stderr lost bytes");
    }
}

#[test]
fn child_exiting_before_its_pipes_drain_loses_no_output() {
    let mut r = reactor();
    early_exit_loses_no_output(&mut r);
}

#[test]
fn sigchld_fallback_loses_no_output_either() {
    let mut r = reactor();
    r.use_sigchld_for_exits().unwrap();
    early_exit_loses_no_output(&mut r);
    let id = r
        .spawn(ChildSpec::new(["sleep", "30"]).deadline(Duration::from_millis(100)))
        .unwrap();
    let exit = wait_exit(&mut r, id, Duration::from_secs(40));
    assert!(exit.timed_out);
}

fn assert_not_zombie(pid: u32) {
    // Either gone, or (recycled) not our zombie child.
    let me = std::process::id().to_string();
    if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        let after = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
        let fields: Vec<&str> = after.split_whitespace().collect();
        let is_ours = fields.get(1) == Some(&me.as_str());
        assert!(
            !(is_ours && fields.first() == Some(&"Z")),
            "pid {pid} is a zombie"
        );
    }
}

#[test]
fn five_hundred_concurrent_children_leave_no_zombie() {
    raise_fd_limit();
    let mut r = reactor();
    let mut ids = HashMap::new();
    for i in 0..500u32 {
        let argv = if i % 2 == 0 {
            vec!["true".to_string()]
        } else {
            vec![
                "head".to_string(),
                "-c".to_string(),
                format!("{}", i * 10),
                "/dev/zero".to_string(),
            ]
        };
        let id = r
            .spawn(ChildSpec::new(argv).deadline(Duration::from_secs(60)))
            .unwrap();
        ids.insert(id, i);
    }
    let mut pids = Vec::new();
    pump(&mut r, Duration::from_secs(120), |ev| {
        if let Event::ChildExit(e) = ev {
            let i = ids.remove(&e.id).expect("each child reported once");
            assert!(e.success(), "{e:?}");
            let want = if i % 2 == 0 { 0 } else { (i * 10) as usize };
            assert_eq!(e.stdout.len(), want);
            pids.push(e.pid);
        }
        ids.is_empty()
    });
    assert_eq!(pids.len(), 500);
    assert_eq!(r.children_running(), 0);
    assert_eq!(r.timers_armed(), 0, "deadline timers are cancelled on exit");
    for pid in pids {
        assert_not_zombie(pid);
    }
}

#[test]
fn dropping_the_reactor_kills_and_reaps_children() {
    let mut r = reactor();
    let id = r.spawn(ChildSpec::new(["sleep", "30"])).unwrap();
    let pid = wait_started(&mut r, id);
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
    drop(r);
    // Killed and reaped: the pid is gone (or, if recycled already, no longer our child).
    let me = std::process::id().to_string();
    if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        let after = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
        assert_ne!(
            after.split_whitespace().nth(1),
            Some(me.as_str()),
            "pid {pid} still our child"
        );
    }
}

#[test]
fn worker_result_wakes_the_loop() {
    let mut r = reactor();
    let start = Instant::now();
    r.submit(|| {
        std::thread::sleep(Duration::from_millis(50));
        42
    })
    .unwrap();
    let mut out = Vec::new();
    // No timers armed: only the worker's wake can end this poll.
    r.poll(&mut out).unwrap();
    assert!(matches!(out.as_slice(), [Event::Work(42)]), "{out:?}");
    assert!(start.elapsed() >= Duration::from_millis(50));

    let n = r.notifier();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        n.post(7);
        n.post(8);
    });
    let mut got = Vec::new();
    while got.len() < 2 {
        out.clear();
        r.poll(&mut out).unwrap();
        for ev in out.drain(..) {
            if let Event::Work(m) = ev {
                got.push(m);
            }
        }
    }
    assert_eq!(got, vec![7, 8]);
}

#[test]
fn full_worker_queue_is_refused() {
    let mut r: R = Reactor::new(1, 1).unwrap();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
    r.submit(move || {
        let _ = started_tx.send(());
        let _ = release_rx.recv();
        1
    })
    .unwrap();
    started_rx.recv().unwrap(); // the only worker is now busy
    r.submit(|| 2).unwrap(); // fills the queue of one
    assert_eq!(r.submit(|| 3), Err(QueueFull));
    release_tx.send(()).unwrap();
    let mut got = Vec::new();
    let mut out = Vec::new();
    while got.len() < 2 {
        out.clear();
        r.poll(&mut out).unwrap();
        got.extend(out.drain(..).filter_map(|e| {
            if let Event::Work(m) = e {
                Some(m)
            } else {
                None
            }
        }));
    }
    assert_eq!(got, vec![1, 2]);
}

#[test]
fn watched_signal_arrives_as_event() {
    let mut r = reactor();
    r.watch_signals(&[libc::SIGUSR2]).unwrap();
    signal_hook::low_level::raise(libc::SIGUSR2).unwrap();
    let mut out = Vec::new();
    r.poll(&mut out).unwrap();
    assert!(
        out.iter()
            .any(|e| matches!(e, Event::Signal(s) if *s == libc::SIGUSR2)),
        "{out:?}"
    );
}

#[test]
fn user_sources_report_readiness_under_their_token() {
    use std::io::Write;
    let mut r = reactor();
    let (mut a, mut b) = mio::net::UnixStream::pair().unwrap();
    let token = r.token();
    assert_ne!(token, r.token(), "tokens are unique");
    r.registry()
        .register(&mut a, token, mio::Interest::READABLE)
        .unwrap();
    b.write_all(b"x").unwrap();
    let mut out = Vec::new();
    r.poll(&mut out).unwrap();
    match out.as_slice() {
        [Event::Io(io)] => {
            assert_eq!(io.token, token);
            assert!(io.readable);
        }
        other => panic!("{other:?}"),
    }
}

/// Benchmark (run: `cargo test --release --test contract -- --ignored --nocapture reactor::bench_`):
/// spawn, capture and reap 1,000 `/bin/true` concurrently through the reactor, against a
/// shell running the same loop sequentially and in the background.
#[test]
#[ignore]
fn bench_spawn_capture_reap_1000_true() {
    raise_fd_limit();
    const N: usize = 1000;
    let mut r = reactor();
    let start = Instant::now();
    for _ in 0..N {
        r.spawn(ChildSpec::new(["/bin/true"])).unwrap();
    }
    let spawned = start.elapsed();
    let mut done = 0;
    pump(&mut r, Duration::from_secs(120), |ev| {
        if let Event::ChildExit(e) = ev {
            assert!(e.success());
            done += 1;
        }
        done == N
    });
    let reactor_time = start.elapsed();
    // The same with output to /dev/null: one fd per child (its pidfd) instead of three.
    let start = Instant::now();
    for _ in 0..N {
        r.spawn(
            ChildSpec::new(["/bin/true"])
                .stdout(OutputMode::Null)
                .stderr(OutputMode::Null),
        )
        .unwrap();
    }
    let mut done = 0;
    pump(&mut r, Duration::from_secs(120), |ev| {
        if let Event::ChildExit(_) = ev {
            done += 1;
        }
        done == N
    });
    let reactor_null_time = start.elapsed();
    let shell = |script: &str| {
        let t = Instant::now();
        let status = std::process::Command::new("sh")
            .args(["-c", script])
            .status()
            .unwrap();
        assert!(status.success());
        t.elapsed()
    };
    let seq = shell("i=0; while [ $i -lt 1000 ]; do /bin/true; i=$((i+1)); done");
    let bg = shell("i=0; while [ $i -lt 1000 ]; do /bin/true & i=$((i+1)); done; wait");
    let t = Instant::now();
    for _ in 0..N {
        std::process::Command::new("/bin/true").output().unwrap();
    }
    let std_seq = t.elapsed();
    println!(
        "BENCH 1000 x /bin/true: reactor concurrent {reactor_time:?} (spawn loop {spawned:?}), \
         without output pipes {reactor_null_time:?}; \
         sh sequential {seq:?}; sh background+wait {bg:?}; std Command::output sequential {std_seq:?}"
    );
}
