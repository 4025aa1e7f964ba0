//! Hypervisor process watch: a pidfd per running VM's hypervisor in the loop's poll, so a VM
//! that dies is reported at once instead of when cocoon's event ticker next looks.
//!
//! The PID is the one cocoon reported for the VM (clone, run, inspect, list). A pidfd turns
//! readable when its process exits; that is reported as a `MODIFIED` event with state
//! `stopped`, which the core handles as any VM event (VM-gone handling inspects before acting, so a
//! false alarm costs one inspect). Cocoon's event stream stays the authority beside it.
//!
//! An exit is reported once per PID. The core keeps listing the VM as running with that PID
//! until its check has inspected and restarted or removed it, and a pidfd opened on an exited
//! (not yet reaped) process is readable at once: re-watching it would report the same exit on
//! every loop turn, thousands of times per kill, and starve the very check that handles it.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};

use mio::unix::SourceFd;
use mio::{Interest, Token};
use rustix::process::{pidfd_open, Pid, PidfdFlags};

use crate::reactor::Reactor;
use crate::vm::{VmInfo, VmState};

struct Watched {
    vm: VmInfo,
    fd: OwnedFd,
}

/// The pidfds of the tracked running VMs, by poll token and by VM ID.
#[derive(Default)]
pub struct HypervisorWatch {
    by_token: HashMap<Token, Watched>,
    by_vm: HashMap<String, Token>,
    /// The hypervisor PID whose exit was reported, by VM ID: not watched again. An entry
    /// goes when the VM is no longer tracked as running or runs under another PID.
    reported: HashMap<String, i64>,
}

impl HypervisorWatch {
    /// Whether the watch already covers exactly the running VMs of `tracked` with a PID: one
    /// lookup per VM and no allocation, so it can run after every turn that changed anything.
    fn covers<'a>(&self, tracked: impl Iterator<Item = &'a VmInfo>) -> bool {
        let mut wanted = 0;
        let mut reported = 0;
        for vm in tracked.filter(|vm| watchable(vm)) {
            if self.already_reported(vm) {
                reported += 1;
                continue;
            }
            let watched = self
                .by_vm
                .get(vm.id.as_str())
                .and_then(|t| self.by_token.get(t));
            if watched.is_none_or(|w| w.vm.pid != vm.pid) {
                return false;
            }
            wanted += 1;
        }
        wanted == self.by_vm.len() && reported == self.reported.len()
    }

    /// Whether this VM's current hypervisor PID already had its exit reported.
    fn already_reported(&self, vm: &VmInfo) -> bool {
        self.reported.get(vm.id.as_str()) == Some(&vm.pid)
    }

    /// Watch every running VM that `tracked()` lists with a PID, stop watching the others.
    pub fn sync<'a, M: Send + 'static, I: Iterator<Item = &'a VmInfo>>(
        &mut self,
        reactor: &mut Reactor<M>,
        tracked: impl Fn() -> I,
    ) {
        if self.covers(tracked()) {
            return;
        }
        let tracked = tracked();
        let mut wanted: HashMap<&str, &VmInfo> = HashMap::new();
        for vm in tracked.filter(|vm| watchable(vm)) {
            wanted.insert(vm.id.as_str(), vm);
        }
        let stale: Vec<Token> = self
            .by_token
            .iter()
            .filter(|(_, w)| {
                wanted
                    .get(w.vm.id.as_str())
                    .is_none_or(|v| v.pid != w.vm.pid)
            })
            .map(|(t, _)| *t)
            .collect();
        for token in stale {
            self.forget(reactor, token);
        }
        self.reported
            .retain(|id, pid| wanted.get(id.as_str()).is_some_and(|v| v.pid == *pid));
        for (id, vm) in wanted {
            if self.by_vm.contains_key(id) || self.already_reported(vm) {
                continue;
            }
            let Some(pid) = i32::try_from(vm.pid).ok().and_then(Pid::from_raw) else {
                continue;
            };
            // A PID that is gone already fails here; cocoon's stream reports that VM.
            let fd = match pidfd_open(pid, PidfdFlags::empty()) {
                Ok(fd) => fd,
                Err(e) => {
                    log::debug!("hypervisor watch: pidfd of vm {id} (pid {pid:?}): {e}");
                    continue;
                }
            };
            let token = reactor.token_in(super::routing::HYPERVISORS);
            let raw = fd.as_raw_fd();
            if let Err(e) =
                reactor
                    .registry()
                    .register(&mut SourceFd(&raw), token, Interest::READABLE)
            {
                log::warn!("hypervisor watch: cannot poll the pidfd of vm {id}: {e}");
                continue;
            }
            self.by_vm.insert(id.to_string(), token);
            self.by_token.insert(token, Watched { vm: vm.clone(), fd });
        }
    }

    /// The pidfd of `token` turned readable: its hypervisor exited. Returns the VM as the
    /// event to report (state `stopped`) and stops watching it.
    pub fn exited<M: Send + 'static>(
        &mut self,
        reactor: &mut Reactor<M>,
        token: Token,
    ) -> Option<VmInfo> {
        let mut vm = self.forget(reactor, token)?;
        self.reported.insert(vm.id.clone(), vm.pid);
        log::info!(
            "hypervisor of vm {} ({}) pid {} exited",
            vm.name,
            vm.id,
            vm.pid
        );
        vm.state = VmState::Stopped;
        Some(vm)
    }

    fn forget<M: Send + 'static>(
        &mut self,
        reactor: &mut Reactor<M>,
        token: Token,
    ) -> Option<VmInfo> {
        let w = self.by_token.remove(&token)?;
        self.by_vm.remove(&w.vm.id);
        let raw = w.fd.as_raw_fd();
        let _ = reactor.registry().deregister(&mut SourceFd(&raw));
        Some(w.vm)
    }
}

/// A VM the watch covers: running, with an ID and a hypervisor PID.
/// A running cocoon VM with a PID. A macOS guest's QEMU is not cocoon's: its liveness is the
/// macOS watch's (a dead QEMU is restarted, not reported as a VM gone).
fn watchable(vm: &VmInfo) -> bool {
    vm.state == VmState::Running
        && vm.pid > 0
        && !vm.id.is_empty()
        && vm.hypervisor != crate::guest::macos::HYPERVISOR
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reactor::Event;
    use std::time::Duration;

    fn vm(id: &str, pid: u32) -> VmInfo {
        VmInfo {
            id: id.into(),
            name: format!("vk-default-{id}"),
            state: VmState::Running,
            pid: i64::from(pid),
            ..VmInfo::default()
        }
    }

    /// A VM whose hypervisor PID changed (a restart learned by inspect) is watched under its new
    /// PID, and only the new process's exit is reported.
    #[test]
    fn a_macos_guests_qemu_is_left_to_the_macos_watch() {
        let qemu = VmInfo {
            id: "qemu-m".into(),
            hypervisor: "qemu".into(),
            state: VmState::Running,
            pid: 5,
            ..Default::default()
        };
        assert!(!watchable(&qemu));
        let ch = VmInfo {
            hypervisor: "cloud-hypervisor".into(),
            ..qemu
        };
        assert!(watchable(&ch));
    }

    #[test]
    fn a_changed_hypervisor_pid_is_watched_anew() {
        let mut reactor: Reactor<()> = Reactor::new(0, 1).unwrap();
        let mut old = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let mut new = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let mut watch = HypervisorWatch::default();
        let before = [vm("a", old.id())];
        watch.sync(&mut reactor, || before.iter());
        assert!(watch.covers(before.iter()));
        let after = [vm("a", new.id())];
        assert!(!watch.covers(after.iter()), "the PID change is seen");
        watch.sync(&mut reactor, || after.iter());
        assert!(watch.covers(after.iter()));

        old.kill().unwrap();
        old.wait().unwrap();
        new.kill().unwrap();
        new.wait().unwrap();
        let mut events = Vec::new();
        reactor.timer_after(Duration::from_secs(5), 0);
        while !events.iter().any(|e| matches!(e, Event::Io(_))) {
            reactor.poll(&mut events).unwrap();
            assert!(!events.iter().any(|e| matches!(e, Event::Timer { .. })));
        }
        let Some(Event::Io(ready)) = events.iter().find(|e| matches!(e, Event::Io(_))) else {
            unreachable!()
        };
        let gone = watch.exited(&mut reactor, ready.token).expect("watched");
        assert_eq!(gone.pid, i64::from(new.id()));
        // Once the VM is no longer tracked, the next sync keeps nothing about it.
        watch.sync(&mut reactor, std::iter::empty);
        assert!(watch.covers(std::iter::empty()));
    }

    /// A killed hypervisor nobody has reaped yet (its pidfd opens and is readable at once) while
    /// the core still lists its VM as running under that PID: its exit is reported once, not
    /// on every turn until the check catches up. A restart under a new PID is watched again.
    #[test]
    fn an_exit_is_reported_once_per_pid_while_the_vm_still_reads_running() {
        let mut reactor: Reactor<()> = Reactor::new(0, 1).unwrap();
        let mut first = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let mut watch = HypervisorWatch::default();
        let tracked = [vm("a", first.id())];
        watch.sync(&mut reactor, || tracked.iter());
        first.kill().unwrap(); // not reaped: a zombie, as a dead hypervisor may be for a while
        let io_within = |reactor: &mut Reactor<()>, d: Duration| {
            let mut events = Vec::new();
            reactor.timer_after(d, 0);
            loop {
                reactor.poll(&mut events).unwrap();
                if let Some(Event::Io(ready)) = events.iter().find(|e| matches!(e, Event::Io(_))) {
                    return Some(ready.token);
                }
                if events.iter().any(|e| matches!(e, Event::Timer { .. })) {
                    return None;
                }
            }
        };
        let token = io_within(&mut reactor, Duration::from_secs(5)).expect("the exit is seen");
        assert!(watch.exited(&mut reactor, token).is_some());
        // The core has not inspected yet: the VM still reads running under the dead PID.
        watch.sync(&mut reactor, || tracked.iter());
        assert!(watch.covers(tracked.iter()), "nothing left to watch");
        assert_eq!(
            io_within(&mut reactor, Duration::from_millis(300)),
            None,
            "the same exit reported again"
        );
        first.wait().unwrap();
        // Restarted under a new PID: watched, and its exit reported.
        let mut second = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let restarted = [vm("a", second.id())];
        assert!(!watch.covers(restarted.iter()));
        watch.sync(&mut reactor, || restarted.iter());
        second.kill().unwrap();
        let token = io_within(&mut reactor, Duration::from_secs(5)).expect("the new exit is seen");
        let gone = watch.exited(&mut reactor, token).expect("watched");
        assert_eq!(gone.pid, i64::from(second.id()));
        second.wait().unwrap();
        // The VM is no longer tracked: nothing is kept about it.
        watch.sync(&mut reactor, std::iter::empty);
        assert!(watch.reported.is_empty() && watch.covers(std::iter::empty()));
    }
}
