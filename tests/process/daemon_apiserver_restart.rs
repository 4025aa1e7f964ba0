//! Process test of an API server that restarts and loses its watch cache: while it is down
//! pods are created, deleted gracefully and force-deleted (writes no watch will deliver); it
//! comes back answering 410 Gone to every resumed watch. The daemon relists and acts on all
//! of it: nothing lost, no orphan VM, the untouched pod keeps its VM.

use crate::daemon_support;

use std::time::{Duration, Instant};

use daemon_support::{assert_loop_turns, running_with_vm, wait_turning, World};
use vk_cocoon::sandbox::demo_pod;

const LIMIT: Duration = Duration::from_secs(60);

#[test]
fn an_api_server_restart_that_loses_its_watch_cache_loses_no_pod_and_leaves_no_vm() {
    let mut w = World::new();
    w.seed_snapshot("base");
    w.start_daemon();
    let mut ids = Vec::new();
    for name in ["stays", "graceful", "forced"] {
        w.api
            .create_pod(&demo_pod("default", name, "clone", "base"))
            .expect("create pod");
    }
    for name in ["stays", "graceful", "forced"] {
        ids.push(
            w.wait(&format!("{name} Running"), LIMIT, || {
                running_with_vm(&w, name)
            })
            .1,
        );
    }
    assert!(
        w.api.wait_for_watches(1, LIMIT),
        "the daemon watches its pods"
    );
    let relists_before = w.log().matches("relisting").count();

    let down = Instant::now();
    w.api
        .restart_losing_watch_cache(|| {
            w.api
                .create_pod(&demo_pod("default", "newcomer", "clone", "base"))
                .expect("create while down");
            w.api
                .delete_pod("default", "graceful", Some(30))
                .expect("delete while down");
            w.api
                .delete_pod("default", "forced", Some(0))
                .expect("force-delete while down");
        })
        .expect("restart");
    assert!(
        w.pod("forced").is_none(),
        "the force-delete removed the object"
    );

    wait_turning(&w, "newcomer Running", LIMIT, || {
        running_with_vm(&w, "newcomer")
    });
    wait_turning(&w, "graceful gone", LIMIT, || {
        w.pod("graceful").is_none().then_some(())
    });
    wait_turning(&w, "the force-deleted pod's VM removed", LIMIT, || {
        (!w.vms().contains_key("vk-default-forced")).then_some(())
    });
    eprintln!(
        "API server restart with a lost watch cache: converged {:?} after it went down",
        down.elapsed()
    );
    let relists = w.log().matches("relisting").count() - relists_before;
    assert!(
        relists >= 1,
        "the daemon relisted after 410 Gone:\n{}",
        daemon_support::tail(&w.log(), 30)
    );
    let vms = w.vms();
    let names: Vec<&String> = vms.keys().collect();
    assert_eq!(
        names,
        ["vk-default-newcomer", "vk-default-stays"],
        "one VM per live pod, nothing else"
    );
    let (_, stays_id) = running_with_vm(&w, "stays").expect("stays Running");
    assert_eq!(stays_id, ids[0], "the untouched pod kept its VM");
    assert_loop_turns(&w, 30.0);
}
