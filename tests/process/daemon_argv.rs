//! Process tier, tenant values on cocoon's command line: a pod annotation that would read as a
//! flag never reaches cocoon; the pod fails with the contract's rule instead.

use crate::daemon_support;

use std::time::Duration;

use daemon_support::{tail, World};
use vk_cocoon::sandbox::demo_pod;

#[test]
fn a_flag_like_image_to_run_is_refused_before_cocoon_sees_it() {
    let mut w = World::new();
    w.start_daemon();
    w.api
        .create_pod(&demo_pod("default", "flaggy", "run", "--all"))
        .expect("create pod");
    w.wait(
        "a Warning naming the image reference rule",
        Duration::from_secs(60),
        || {
            w.events_for("flaggy")
                .into_iter()
                .find(|(_, m)| m.contains("\"--all\" is not a cocoon image reference"))
        },
    );
    // Neither the image pull (on a worker) nor any spawn of the loop carried the value.
    let log = w.log();
    let spawned: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("cocoon op ") && l.contains("--all"))
        .filter(|l| !l.contains("not run"))
        .collect();
    assert!(
        spawned.is_empty(),
        "spawned: {spawned:?}\n{}",
        tail(&log, 40)
    );
    assert!(w.vms().is_empty(), "{:?}", w.vms());
}
