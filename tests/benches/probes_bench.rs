//! Benchmark (ignored by default): N probe targets at the Ready cadence on the real reactor.
//! Reports CPU (user+system, % of one core), memory per probe and the longest engine call.
//!
//! cargo test --test benches probes_bench -- --ignored --nocapture
//! (VK_PROBES_BENCH_TARGETS, default 1000; VK_PROBES_BENCH_SECS, default 30)

use std::net::Ipv4Addr;
use std::time::{Duration, Instant, SystemTime};

use vk_cocoon::network::icmp::{Pinger, PingerMode};
use vk_cocoon::probes::{ProbeConfig, ProbeEngine, ProbeEvent, ProbeManager, ProbeTarget};
use vk_cocoon::reactor::Reactor;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// (user+system CPU seconds, resident bytes) of this process.
fn usage() -> (f64, u64) {
    let me = procfs::process::Process::myself().unwrap();
    let stat = me.stat().unwrap();
    let tps = procfs::ticks_per_second() as f64;
    let cpu = (stat.utime + stat.stime) as f64 / tps;
    let rss = stat.rss * procfs::page_size();
    (cpu, rss)
}

#[test]
#[ignore = "benchmark: run with --ignored --nocapture"]
fn ready_cadence_cpu_and_memory() {
    let targets = env_or("VK_PROBES_BENCH_TARGETS", 1000) as usize;
    let secs = env_or("VK_PROBES_BENCH_SECS", 30);
    let mut reactor: Reactor<()> = Reactor::new(1, 4).unwrap();
    let pinger = Pinger::open();
    if pinger.mode() == PingerMode::AssumeReachable {
        println!("SKIP: no ICMP socket; the benchmark would measure nothing");
        return;
    }
    let manager = ProbeManager::new(ProbeConfig::default(), None);
    let mut engine = ProbeEngine::new(manager, pinger, &mut reactor).unwrap();
    let (_, rss_before) = usage();

    let start = Instant::now();
    for i in 0..targets {
        let ip = Ipv4Addr::new(127, 1 + (i / 250) as u8, 0, (i % 250 + 1) as u8);
        let t = ProbeTarget::from_parts(
            "bench",
            "uid",
            &format!("vm-{i}"),
            &ip.to_string(),
            "",
            None,
        );
        let now = reactor.now();
        engine.start(
            &mut reactor,
            &format!("bench/p{i}"),
            Some(t),
            now,
            SystemTime::now(),
        );
    }
    let mut out = Vec::new();
    let mut ready = 0;
    let mut run = |reactor: &mut Reactor<()>,
                   engine: &mut ProbeEngine<_>,
                   until: Instant,
                   ready: &mut usize|
     -> Vec<Duration> {
        let mut took_all = Vec::new();
        while Instant::now() < until {
            let _guard = reactor.timer_at(until, 0);
            out.clear();
            reactor.poll(&mut out).unwrap();
            for ev in &out {
                let t = Instant::now();
                let events = engine.handle_event(reactor, ev, SystemTime::now());
                let took = t.elapsed();
                if let Some(events) = events {
                    took_all.push(took);
                    for e in events {
                        if let ProbeEvent::Readiness { ready: true, .. } = e {
                            *ready += 1;
                        }
                    }
                }
            }
        }
        took_all.sort();
        took_all
    };
    let pct = |v: &[Duration], p: f64| v[((v.len() - 1) as f64 * p) as usize];
    // Warm-up: every target answers its first probe and settles on the 5 s cadence.
    let warm = run(
        &mut reactor,
        &mut engine,
        start + Duration::from_secs(6),
        &mut ready,
    );
    assert_eq!(ready, targets, "every loopback target should be ready");
    let (cpu0, rss_ready) = usage();
    let t0 = Instant::now();
    let steady = run(
        &mut reactor,
        &mut engine,
        t0 + Duration::from_secs(secs),
        &mut ready,
    );
    let (cpu1, rss_end) = usage();
    let wall = t0.elapsed().as_secs_f64();
    let cpu_pct = (cpu1 - cpu0) / wall * 100.0;
    let per_probe = rss_end.saturating_sub(rss_before) as f64 / targets as f64;
    println!(
        "BENCH targets={targets} mode={} window={wall:.1}s cpu={:.3}s ({cpu_pct:.2}% of one core) \
         rss_before={}KiB rss_ready={}KiB rss_end={}KiB per_probe={per_probe:.0}B \
         engine_calls={} call_p50={:?} call_p99={:?} call_max={:?} call_max_warmup={:?}",
        engine.pinger_mode(),
        cpu1 - cpu0,
        rss_before / 1024,
        rss_ready / 1024,
        rss_end / 1024,
        steady.len(),
        pct(&steady, 0.5),
        pct(&steady, 0.99),
        steady.last().copied().unwrap_or_default(),
        warm.last().copied().unwrap_or_default(),
    );
    assert_eq!(engine.manager().agents(), targets);
    for i in 0..targets {
        engine.forget(&mut reactor, &format!("bench/p{i}"));
    }
    assert_eq!(engine.host_timers(), 0);
}
