//! Process tier, registry transfers: the real daemon pulls snapshots from a docker-registry on
//! loopback through its transfer queue, which runs at most MAX_TRANSFER_JOBS (3) jobs at once.

use crate::daemon_support;

use std::collections::BTreeSet;
use std::fs;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use daemon_support::{running_with_vm, World};
use vk_cocoon::sandbox::demo_pod;

/// Pids of live `<bin> snapshot import ...` processes.
fn live_imports(bin: &str) -> BTreeSet<u32> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return BTreeSet::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let raw = fs::read(e.path().join("cmdline")).ok()?;
            let argv: Vec<&[u8]> = raw.split(|b| *b == 0).collect();
            (argv.len() >= 3
                && argv[0] == bin.as_bytes()
                && argv[1] == b"snapshot"
                && argv[2] == b"import")
                .then_some(pid)
        })
        .collect()
}

const PODS: usize = 5;
const IMPORT_MS: u64 = 1500;

#[test]
fn more_pulls_than_transfer_slots_run_three_at_a_time_and_all_pods_start() {
    let mut w = World::new();
    w.seed_snapshot("base");
    // Publish the seed under PODS tags on the world's registry (the daemon's OCI_REGISTRY).
    for i in 0..PODS {
        w.push_base_snapshot("base", &format!("t{i}"));
    }
    // Every import takes IMPORT_MS, so pulls that may overlap do.
    fs::write(
        w.path("state/faults.json"),
        format!("{{\"snapshot import\": {{\"slow_ms\": {IMPORT_MS}}}}}"),
    )
    .unwrap();
    w.start_daemon();

    // Clone pods of `base:tN`: local snapshot `base:tN` is missing, so each one is pulled.
    let bin = w.path("bin/cocoon").to_string_lossy().into_owned();
    let stop = AtomicBool::new(false);
    let seen: Mutex<(usize, BTreeSet<u32>)> = Mutex::new((0, BTreeSet::new()));
    let started = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                let live = live_imports(&bin);
                let mut g = seen.lock().unwrap();
                g.0 = g.0.max(live.len());
                g.1.extend(live);
                drop(g);
                std::thread::sleep(Duration::from_millis(3));
            }
        });
        for i in 0..PODS {
            let pod = demo_pod("default", &format!("p{i}"), "clone", &format!("base:t{i}"));
            w.api.create_pod(&pod).expect("create pod");
        }
        for i in 0..PODS {
            w.wait(
                &format!("pod p{i} Running"),
                Duration::from_secs(60),
                || running_with_vm(&w, &format!("p{i}")),
            );
        }
        stop.store(true, Ordering::SeqCst);
    });
    let took = started.elapsed();
    let (peak, pids) = seen.into_inner().unwrap();
    eprintln!(
        "{PODS} pulls: peak {peak} imports alive, {} seen, {took:?}",
        pids.len()
    );
    assert_eq!(
        peak, 3,
        "at most MAX_TRANSFER_JOBS imports at once, and that many overlap"
    );
    assert_eq!(
        pids.len(),
        PODS,
        "one import per pod, none repeated or skipped"
    );
    assert!(
        took >= Duration::from_millis(2 * IMPORT_MS),
        "two waves of slow imports: {took:?}"
    );
    assert!(live_imports(&bin).is_empty(), "no import left running");
    // Nothing stayed queued: every pull finished, and each pod cloned its own pulled snapshot.
    let metrics = w.metrics();
    let ok_pulls = metrics
        .lines()
        .find(|l| l.contains("snapshot_pull_total{") && l.contains("result=\"ok\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok());
    assert_eq!(ok_pulls, Some(PODS as f64), "{metrics}");
    let (ok, list) = w.cocoon(&["snapshot", "list"]);
    assert!(ok, "{list}");
    for i in 0..PODS {
        assert!(
            list.contains(&format!("base:t{i}")),
            "pulled base:t{i}: {list}"
        );
    }
}

/// The push spool is the daemon's own directory: `vk-spool` beside the staging dir, mode 0700.
/// A symlink planted there stops the start; a directory too wide is narrowed; a push writes its
/// spool files there (the directory changes) and leaves none behind.
#[test]
fn the_push_spool_is_a_private_directory_of_the_daemon() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let mut w = World::new();
    let spool = w.dir.path().join("vk-spool");
    std::os::unix::fs::symlink(std::env::temp_dir(), &spool).expect("plant a symlink");
    let mut child = w.spawn_daemon();
    let status = w.wait(
        "the daemon refuses to start",
        Duration::from_secs(30),
        || child.try_wait().ok().flatten(),
    );
    assert_eq!(status.code(), Some(1), "{}", w.log());
    assert!(
        w.log().contains(&format!(
            "spool directory {}: is a symlink",
            spool.display()
        )),
        "{}",
        w.log()
    );

    fs::remove_file(&spool).expect("remove the symlink");
    fs::create_dir(&spool).expect("mkdir");
    fs::set_permissions(&spool, fs::Permissions::from_mode(0o755)).expect("chmod");
    w.seed_snapshot("base");
    w.start_daemon();
    let mode = |p: &std::path::Path| fs::symlink_metadata(p).expect("stat spool").mode() & 0o777;
    assert_eq!(mode(&spool), 0o700, "narrowed at start");
    let changed = || fs::symlink_metadata(&spool).expect("stat").mtime_nsec();
    let before = (
        fs::symlink_metadata(&spool).expect("stat").mtime(),
        changed(),
    );

    w.api
        .create_pod(&demo_pod("default", "spooled", "clone", "base"))
        .expect("create pod");
    w.wait("Running", Duration::from_secs(60), || {
        running_with_vm(&w, "spooled")
    });
    daemon_support::set_hibernate(&w, "spooled", true);
    let client = w.registry_client();
    w.wait("the hibernate tag pushed", Duration::from_secs(120), || {
        vk_cocoon::snapshots::manifest_info(&client, "vk-default-spooled", "hibernate")
            .ok()
            .flatten()
    });
    let after = (
        fs::symlink_metadata(&spool).expect("stat").mtime(),
        changed(),
    );
    assert_ne!(before, after, "the push spooled in the daemon's directory");
    assert_eq!(mode(&spool), 0o700);
    assert_eq!(
        fs::read_dir(&spool).expect("list").count(),
        0,
        "nothing left"
    );
}
