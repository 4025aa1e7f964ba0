//! The SAC dialer against a fake SAC console on a Unix socket that answers like the real one:
//! noise before the prompt, replies in pieces with delays, interfaces that show up late, a
//! console that appears only after a while, and an address that never takes.

use std::os::unix::net::UnixListener;
use std::time::{Duration, Instant};

use vk_cocoon::guest::dialer;
use vk_cocoon::guest::sac::{SacPlan, DIAL_FAILED, VERIFY_FAILED};
use vk_cocoon::sandbox::fake_sac::{serve, SacBehaviour};

fn plan() -> SacPlan {
    SacPlan::from_nics(&[
        ("".into(), 0, "".into()),
        ("10.1.0.5".into(), 24, "10.1.0.1".into()),
    ])
    .expect("plan")
}

fn two_nets() -> Vec<(u32, String)> {
    vec![(10, "169.254.10.1".into()), (11, "169.254.11.1".into())]
}

#[test]
fn the_static_nic_is_set_once_every_interface_is_listed() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("console.sock");
    let record = serve(
        UnixListener::bind(&sock).unwrap(),
        SacBehaviour {
            nets: two_nets(),
            partial_listings: 2,
            ..Default::default()
        },
    );
    let started = Instant::now();
    dialer::run(&sock, plan()).expect("SAC pass");
    // Two listings short of the second NIC: two 2 s pauses.
    assert!(started.elapsed() >= Duration::from_secs(4));
    let rec = record.lock().unwrap();
    assert_eq!(
        rec.nets,
        vec![(10, "169.254.10.1".into()), (11, "10.1.0.5".into())]
    );
    let sets: Vec<&String> = rec.commands.iter().filter(|c| c.len() > 1).collect();
    assert_eq!(sets, ["i 11 10.1.0.5 255.255.255.0 10.1.0.1"]);
    assert_eq!(rec.commands.iter().filter(|c| *c == "i").count(), 4);
}

#[test]
fn a_console_that_appears_late_is_dialled_again() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("console.sock");
    let late = sock.clone();
    let binder = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(2500));
        serve(
            UnixListener::bind(&late).unwrap(),
            SacBehaviour {
                nets: two_nets(),
                ..Default::default()
            },
        )
    });
    dialer::run(&sock, plan()).expect("SAC pass after redials");
    let record = binder.join().unwrap();
    assert!(record
        .lock()
        .unwrap()
        .commands
        .iter()
        .any(|c| c.starts_with("i 11 ")));
}

#[test]
fn an_address_that_never_takes_is_a_verify_failure_after_ten_sets() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("console.sock");
    let record = serve(
        UnixListener::bind(&sock).unwrap(),
        SacBehaviour {
            nets: two_nets(),
            ignore_sets: true,
            delay: Duration::from_millis(1),
            ..Default::default()
        },
    );
    let err = dialer::run(&sock, plan()).unwrap_err();
    assert_eq!(err.reason, VERIFY_FAILED, "{err:?}");
    let rec = record.lock().unwrap();
    assert_eq!(
        rec.commands
            .iter()
            .filter(|c| c.starts_with("i 11 "))
            .count(),
        10
    );
}

#[test]
fn a_socket_that_never_answers_the_prompt_is_a_dial_failure() {
    // Accepts and reads, never prompts: the dialer gives up on the prompt after 60 s. Too slow
    // for every run; the state machine's tests cover the clock. Here: a closed console.
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("console.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    std::thread::spawn(move || {
        for c in listener.incoming() {
            drop(c);
        }
    });
    let err = dialer::run(&sock, plan()).unwrap_err();
    assert_eq!(err.reason, DIAL_FAILED, "{err:?}");
}
