//! The fleet bench: what N nodes cost one API server at rest, during pod churn, and when the API
//! server restarts (every node re-watches at once; with a lost watch cache every node relists).
//!
//!     cargo test --release --test benches fleet_bench -- --ignored --nocapture
//!
//! FLEET_NODES (default 20) real daemons, each with its own node name, fake cocoon and state,
//! FLEET_PODS (default 20) pods each; 50 x 100 works too (about 5 minutes here). Phases:
//! FLEET_REST_SECS (60) at rest, FLEET_CHURN_SECS (60) of churn at FLEET_CHURN pod
//! replacements per node per minute (6), then two API server restarts, each down for
//! FLEET_DOWN_SECS (5) and watched for FLEET_OBSERVE_SECS (30) after it comes back: the first
//! keeps its data and watch history (every node must resume its watch, none may relist), the
//! second loses its watch cache (every node relists, and no more than 40 % of the fleet in any
//! one second). BENCH_DIR and BENCH_BIN_DIR as for daemon_bench (the latter runs another build,
//! say the daemon before a change, against the same bench).

use crate::fleet_support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use fleet_support::{
    fleet_pod, lease_lateness, per_node_per_minute, per_second, proc_sample, quantile,
    relisting_nodes_per_second, Fleet, LeaseRecorder,
};
use vk_cocoon::sandbox::apiserver::ApiServerHandle;

/// The largest share of the fleet that may relist in any one second after the API server lost
/// its watch cache (each node relists at a random moment of the 8 s after its 410).
const MAX_RELIST_FRACTION: f64 = 0.4;

fn knob(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn bench_dir() -> std::path::PathBuf {
    std::env::var_os("BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            let shm = std::path::Path::new("/dev/shm");
            if shm.is_dir() {
                shm.to_path_buf()
            } else {
                std::env::temp_dir()
            }
        })
}

fn print_rates(title: &str, rates: &BTreeMap<String, f64>) {
    let total: f64 = rates.values().sum();
    println!("{title}: {total:.1} requests per node per minute");
    for (k, v) in rates {
        println!("    {k:<28} {v:8.2}");
    }
}

/// Lateness of the renewals seen in `[from, to)`: (max, p99) in seconds, and how many.
fn lateness(renewals: &fleet_support::Renewals, from: Instant, to: Instant) -> (f64, f64, usize) {
    let mut v = lease_lateness(renewals, from, to);
    let n = v.len();
    let p99 = quantile(&mut v, 0.99);
    (v.last().copied().unwrap_or(0.0), p99, n)
}

#[test]
#[ignore]
fn bench_fleet_api_load() {
    let nodes = knob("FLEET_NODES", 20) as usize;
    let pods = knob("FLEET_PODS", 20) as usize;
    let rest = Duration::from_secs(knob("FLEET_REST_SECS", 60));
    let churn = Duration::from_secs(knob("FLEET_CHURN_SECS", 60));
    let churn_rate = knob("FLEET_CHURN", 6).max(1);
    let down = Duration::from_secs(knob("FLEET_DOWN_SECS", 5));
    let observe = Duration::from_secs(knob("FLEET_OBSERVE_SECS", 30));
    let parent = bench_dir();
    println!(
        "fleet: {nodes} nodes x {pods} pods under {}; rest {rest:?}, churn {churn:?} at \
         {churn_rate} replacements per node per minute, API server down {down:?} twice",
        parent.display()
    );
    let t = Instant::now();
    let mut fleet = Fleet::start(nodes, &parent, &[]);
    println!("{nodes} daemons started in {:?}", t.elapsed());
    let api = fleet.api.clone();
    let names = fleet.nodes();
    assert!(
        api.wait_for_watches(nodes, Duration::from_secs(120)),
        "every node watches its pods ({} of {nodes})",
        api.open_watches()
    );

    // Pods, created round-robin over the nodes (as a scheduler spreads a ReplicaSet).
    let t = Instant::now();
    let mut live: Vec<std::collections::VecDeque<String>> = vec![Default::default(); nodes];
    for j in 0..pods {
        for (i, node) in names.iter().enumerate() {
            let name = format!("{node}-p{j}");
            api.create_pod(&fleet_pod(node, &name)).expect("create pod");
            live[i].push_back(name);
        }
    }
    let took = fleet.wait_running(
        nodes * pods,
        Duration::from_secs(60 + (nodes * pods) as u64),
    );
    println!(
        "{} pods Running in {took:?} ({:.1} pods/s over the fleet); created in {:?}",
        nodes * pods,
        (nodes * pods) as f64 / took.as_secs_f64(),
        t.elapsed() - took
    );
    let leases = LeaseRecorder::start(api.clone());
    // Let the bring-up's writes drain and a status period pass before the quiet minute counts.
    std::thread::sleep(Duration::from_secs(15));

    // 1. Rest.
    let ticks = fleet_support::clock_ticks();
    let before: Vec<_> = fleet
        .pids()
        .iter()
        .map(|p| proc_sample(*p, ticks))
        .collect();
    let rest_from = Instant::now();
    std::thread::sleep(rest);
    let rest_to = Instant::now();
    let after: Vec<_> = fleet
        .pids()
        .iter()
        .map(|p| proc_sample(*p, ticks))
        .collect();
    let rest_counts = api.request_counts_between(rest_from, rest_to);
    let secs = (api.accounting_second(rest_to) - api.accounting_second(rest_from)) as f64;
    print_rates("at rest", &per_node_per_minute(&rest_counts, nodes, secs));
    let mut rss: Vec<f64> = after.iter().map(|s| s.rss_kib as f64 / 1024.0).collect();
    let mut cpu: Vec<f64> = before
        .iter()
        .zip(&after)
        .map(|(b, a)| a.cpu.saturating_sub(b.cpu).as_secs_f64() / rest.as_secs_f64() * 100.0)
        .collect();
    println!(
        "per node at rest with {pods} pods: RSS p50 {:.1} MiB max {:.1} MiB; CPU p50 {:.2} % \
         max {:.2} % of a core",
        quantile(&mut rss, 0.5),
        quantile(&mut rss, 1.0),
        quantile(&mut cpu, 0.5),
        quantile(&mut cpu, 1.0)
    );

    // 2. Churn: one node at a time, its oldest pod deleted (gracefully, as kubectl does) and a
    // new one created, `churn_rate` times per node per minute.
    let every = Duration::from_secs(60).div_f64((churn_rate as usize * nodes) as f64);
    let churn_from = Instant::now();
    let mut next = churn_from;
    let mut replaced = 0usize;
    while next < churn_from + churn {
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
        let i = replaced % nodes;
        if let Some(old) = live[i].pop_front() {
            let _ = api.delete_pod("default", &old, Some(30));
        }
        let name = format!("{}-c{replaced}", names[i]);
        api.create_pod(&fleet_pod(&names[i], &name))
            .expect("create pod");
        live[i].push_back(name);
        replaced += 1;
        next += every;
    }
    let churn_to = Instant::now();
    let churn_counts = api.request_counts_between(churn_from, churn_to);
    let secs = (api.accounting_second(churn_to) - api.accounting_second(churn_from)) as f64;
    print_rates(
        &format!("during churn ({replaced} pods replaced, {churn_rate} per node per minute)"),
        &per_node_per_minute(&churn_counts, nodes, secs),
    );
    let t = Instant::now();
    settle(&fleet, &api, nodes * pods);
    println!("churn settled {:?} after it stopped", t.elapsed());
    let (max, p99, n) = lateness(&leases.peek(), rest_from, Instant::now());
    println!("Lease lateness at rest and churn ({n} renewals): max {max:.2} s, p99 {p99:.2} s");
    fleet.assert_alive();

    // 3. Restarts: one that keeps the watch history, one that loses it.
    let kept = restart(&fleet, &api, down, observe, false);
    let kept_relists: usize = relisting_nodes_per_second(&kept).values().sum();
    fleet.assert_alive();
    let lost = restart(&fleet, &api, down, observe, true);
    let per_sec = relisting_nodes_per_second(&lost);
    let lost_relists: usize = per_sec.values().sum();
    let peak = per_sec.values().copied().max().unwrap_or(0);
    fleet.assert_alive();
    let renewals = leases.stop();
    let (max, p99, n) = lateness(&renewals, churn_to, Instant::now());
    println!("Lease lateness around the restarts ({n} renewals): max {max:.2} s, p99 {p99:.2} s");
    assert_eq!(
        kept_relists, 0,
        "an API server back with its data and history: every node resumes its watch"
    );
    assert!(
        lost_relists >= nodes,
        "a lost watch cache: every node relists ({lost_relists} relists for {nodes} nodes)"
    );
    let fraction = peak as f64 / nodes as f64;
    println!(
        "largest share of the fleet relisting in one second: {peak} of {nodes} ({:.0} %)",
        fraction * 100.0
    );
    assert!(
        fraction <= MAX_RELIST_FRACTION,
        "{peak} of {nodes} nodes relisted in one second: {per_sec:?}"
    );
}

/// Waits until the churn's deletions are done and every live pod runs again.
fn settle(fleet: &Fleet, api: &ApiServerHandle, want: usize) {
    let t = Instant::now();
    loop {
        let terminating = api
            .scan_objects("pods", |p| {
                p["metadata"]["deletionTimestamp"].as_str().map(|_| ())
            })
            .len();
        let running: usize = fleet.running_per_node().values().sum();
        if terminating == 0 && running >= want {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "churn did not settle: {terminating} terminating, {running} of {want} Running"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Stops the API server for `down`, brings it back on the same port with the same data (and
/// its watch history unless `lose_cache`), watches `observe` more, and prints the reconnect
/// curve: node requests per second from 2 s before the stop. Returns that window's counts.
fn restart(
    fleet: &Fleet,
    api: &ApiServerHandle,
    down: Duration,
    observe: Duration,
    lose_cache: bool,
) -> Vec<vk_cocoon::sandbox::apiserver::RequestCount> {
    let nodes = fleet.worlds.len();
    std::thread::sleep(Duration::from_secs(2));
    let stop_at = Instant::now();
    if lose_cache {
        api.restart_losing_watch_cache(|| std::thread::sleep(down))
            .expect("restart");
    } else {
        api.stop();
        std::thread::sleep(down);
        api.restart().expect("restart");
    }
    let back_at = Instant::now();
    assert!(
        api.wait_for_watches(nodes, observe + Duration::from_secs(60)),
        "every node watches again ({} of {nodes})",
        api.open_watches()
    );
    let all_back = back_at.elapsed();
    std::thread::sleep(observe.saturating_sub(all_back));
    let from = stop_at - Duration::from_secs(2);
    let counts = api.request_counts_between(from, Instant::now());
    let back = api.accounting_second(back_at);
    let relisting = relisting_nodes_per_second(&counts);
    println!(
        "API server restart {} (down {down:?}): every node watching again {all_back:?} after it \
         came back; node requests per second (s from its return: total watch list lease; \
         share of the fleet relisting):",
        if lose_cache {
            "that lost its watch cache"
        } else {
            "with its data and watch history"
        }
    );
    for (s, row) in per_second(&counts) {
        let rel = relisting.get(&s).copied().unwrap_or(0);
        println!(
            "    {:+4} s  {:5} {:4} {:4} {:4}  {:3.0} %",
            s as i64 - back as i64,
            row[0],
            row[1],
            row[2],
            row[3],
            rel as f64 * 100.0 / nodes as f64
        );
    }
    let peak = per_second(&counts)
        .values()
        .map(|r| r[0])
        .max()
        .unwrap_or(0);
    let relists: usize = relisting.values().sum();
    println!(
        "    peak {peak} requests/s ({:.2} per node), {relists} relists",
        peak as f64 / nodes as f64
    );
    counts
}
