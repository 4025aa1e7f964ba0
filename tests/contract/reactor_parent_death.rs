//! Children of the reactor die with the thread that owns the reactor (the daemon's loop thread),
//! although spawner threads fork them: a crashed daemon leaves no cocoon call or exec session
//! running unsupervised.

use std::time::{Duration, Instant};

use vk_cocoon::reactor::{ChildSpec, Event, Reactor};

/// The state letter of /proc/<pid>/stat (R, S, Z, ...), None once the pid is gone.
fn state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 2..].chars().next()
}

#[test]
fn a_child_is_killed_when_its_spawning_thread_dies() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut reactor: Reactor<()> = Reactor::new(1, 4).unwrap();
        let id = reactor.spawn(ChildSpec::new(["sleep", "30"])).unwrap();
        // The pid is known once the loop has taken the started child back.
        let mut out: Vec<Event<()>> = Vec::new();
        let pid = loop {
            if let Some(pid) = reactor.pid(id) {
                break pid;
            }
            reactor.timer_after(Duration::from_millis(5), 0);
            out.clear();
            reactor.poll(&mut out).unwrap();
        };
        tx.send(pid).unwrap();
        // Leak the reactor: its drop would kill the child itself, as a crash would not.
        std::mem::forget(reactor);
    })
    .join()
    .unwrap();
    let pid = rx.recv().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match state(pid) {
            // Killed and not reaped (the reactor that would reap it is gone): a zombie.
            Some('Z') | None => break,
            s => assert!(
                Instant::now() < deadline,
                "child {pid} still alive ({s:?}) after its spawning thread died"
            ),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: reaps our own zombie child; waitpid has no memory-safety preconditions.
    unsafe {
        libc::waitpid(pid as libc::pid_t, std::ptr::null_mut(), 0);
    }
}
