//! Benchmarks (ignored by default): reactor overhead per cocoon call beyond the child's own run
//! time, and event-stream latency from a fake state change to the typed event.
//! Run: cargo test --test benches vm_bench -- --ignored --nocapture --test-threads 1

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use vk_cocoon::reactor::{ChildSpec, Event, OutputMode, Reactor};
use vk_cocoon::sandbox::fake_cocoon;
use vk_cocoon::vm::*;

fn fake_bin() -> Option<String> {
    let bin = env!("CARGO_BIN_EXE_vk-cocoon-sandbox").to_string();
    let probe = Command::new(&bin)
        .args(["fake-cocoon", "version"])
        .output()
        .ok()?;
    String::from_utf8_lossy(&probe.stdout)
        .contains("cocoon fake")
        .then_some(bin)
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Runs `argv` `n` times sequentially through the reactor and directly; returns per-call medians.
fn compare(argv: &[String], env: &[(String, String)], n: usize) -> (Duration, Duration) {
    let mut r: Reactor<()> = Reactor::new(1, 4).expect("reactor");
    let mut via_reactor = Vec::with_capacity(n);
    let mut evs = Vec::new();
    for _ in 0..n {
        let mut spec = ChildSpec::new(argv.to_vec())
            .stdout(OutputMode::Capture { limit: 1 << 20 })
            .stderr(OutputMode::Capture { limit: 64 << 10 });
        spec.env = env.to_vec();
        let t0 = Instant::now();
        let id = r.spawn(spec).expect("spawn");
        'wait: loop {
            r.poll(&mut evs).expect("poll");
            for e in evs.drain(..) {
                if let Event::ChildExit(x) = e {
                    if x.id == id {
                        break 'wait;
                    }
                }
            }
        }
        via_reactor.push(t0.elapsed());
    }
    let mut direct = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        let out = Command::new(&argv[0])
            .args(&argv[1..])
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .output()
            .expect("run");
        assert!(out.status.success() || argv[0] != "/bin/true");
        direct.push(t0.elapsed());
    }
    via_reactor.sort();
    direct.sort();
    (pct(&via_reactor, 0.5), pct(&direct, 0.5))
}

#[test]
#[ignore]
fn bench_call_overhead() {
    let Some(bin) = fake_bin() else {
        eprintln!("SKIP: no fake-cocoon dispatch");
        return;
    };
    let n = 200;
    let (r, d) = compare(&["/bin/true".to_string()], &[], n);
    eprintln!(
        "/bin/true: reactor median {r:?}, direct median {d:?}, overhead {:?}",
        r.saturating_sub(d)
    );
    let dir = tempfile::tempdir().unwrap();
    let env = vec![
        (
            "FAKE_COCOON_STATE".to_string(),
            dir.path().display().to_string(),
        ),
        ("FAKE_COCOON_NO_PROCESS".to_string(), "1".to_string()),
    ];
    let pull = Command::new(&bin)
        .args(["fake-cocoon", "image", "pull", "img"])
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .unwrap();
    assert!(pull.status.success());
    let run = Command::new(&bin)
        .args([
            "fake-cocoon",
            "vm",
            "run",
            "--output",
            "json",
            "--name",
            "b",
            "img",
        ])
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .unwrap();
    assert!(run.status.success());
    let mut argv = vec![bin.clone(), "fake-cocoon".to_string()];
    argv.extend(argv::vm_inspect("b"));
    let (r, d) = compare(&argv, &env, n);
    eprintln!(
        "fake vm inspect: reactor median {r:?}, direct median {d:?}, overhead {:?}",
        r.saturating_sub(d)
    );
}

#[test]
#[ignore]
fn bench_event_latency() {
    let Some(bin) = fake_bin() else {
        eprintln!("SKIP: no fake-cocoon dispatch");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("cocoon");
    std::os::unix::fs::symlink(&bin, &link).unwrap();
    let state = dir.path().join("state");
    let env = vec![
        ("FAKE_COCOON_STATE".to_string(), state.display().to_string()),
        ("FAKE_COCOON_NO_PROCESS".to_string(), "1".to_string()),
    ];
    for args in [
        vec!["image", "pull", "img"],
        vec!["vm", "run", "--output", "json", "--name", "lat", "img"],
    ] {
        let ok = Command::new(&link)
            .args(&args)
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .output()
            .unwrap();
        assert!(ok.status.success());
    }
    let mut r: Reactor<()> = Reactor::new(1, 4).unwrap();
    let mut stream = EventStream::new(&link.display().to_string(), env, 1, Instant::now());
    stream.start(&mut r);
    let mut evs = Vec::new();
    let mut wait = |r: &mut Reactor<()>, stream: &mut EventStream, want: &str| -> Instant {
        loop {
            r.poll(&mut evs).unwrap();
            for e in evs.drain(..) {
                if let Some(out) = stream.handle(r, &e) {
                    if out.events.iter().any(|ev| ev.vm.state == want) {
                        return Instant::now();
                    }
                }
            }
        }
    };
    wait(&mut r, &mut stream, "running");
    let mut lat = Vec::new();
    for i in 0..200 {
        let want = if i % 2 == 0 { "stopped" } else { "running" };
        let t0 = Instant::now();
        fake_cocoon::set_state(&state, "lat", want).unwrap();
        let at = wait(&mut r, &mut stream, want);
        lat.push(at - t0);
    }
    lat.sort();
    eprintln!(
        "event latency over {} changes: p50 {:?}, p90 {:?}, p99 {:?}, max {:?}",
        lat.len(),
        pct(&lat, 0.5),
        pct(&lat, 0.9),
        pct(&lat, 0.99),
        lat[lat.len() - 1]
    );
    stream.stop(&mut r);
}
