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

use crate::provider::PodKey;
use crate::reactor::Reactor;
use crate::vm::{VmInfo, VmState};

struct Watched {
    pod: PodKey,
    vm: VmInfo,
    fd: OwnedFd,
}

/// The pidfds of the tracked pods' running VMs, by poll token and by pod. Kept per pod so that
/// after an input only the pods it changed are looked at, not every tracked VM.
#[derive(Default)]
pub struct HypervisorWatch {
    by_token: HashMap<Token, Watched>,
    by_pod: HashMap<PodKey, Token>,
    /// The VM ID and hypervisor PID whose exit was reported, by pod: not watched again. An
    /// entry goes when the pod's VM is no longer running or runs under another ID or PID.
    reported: HashMap<PodKey, (String, i64)>,
}

impl HypervisorWatch {
    /// Watch `pod`'s VM (`vm`: its tracked VM now, if any) when it runs with a hypervisor PID
    /// whose exit was not reported yet; stop watching what the pod's VM no longer is.
    pub fn sync<M: Send + 'static>(
        &mut self,
        reactor: &mut Reactor<M>,
        pod: &PodKey,
        vm: Option<&VmInfo>,
    ) {
        let vm = vm.filter(|vm| watchable(vm));
        let same = |id: &str, pid: i64| vm.is_some_and(|vm| vm.id == id && vm.pid == pid);
        if self
            .reported
            .get(pod)
            .is_some_and(|(id, pid)| !same(id, *pid))
        {
            self.reported.remove(pod);
        }
        if let Some(&token) = self.by_pod.get(pod) {
            if self
                .by_token
                .get(&token)
                .is_some_and(|w| same(&w.vm.id, w.vm.pid))
            {
                return;
            }
            self.forget(reactor, token);
        }
        let Some(vm) = vm else { return };
        if self.reported.contains_key(pod) {
            return;
        }
        let Some(pid) = i32::try_from(vm.pid).ok().and_then(Pid::from_raw) else {
            return;
        };
        let id = &vm.id;
        // A PID that is gone already fails here; cocoon's stream reports that VM.
        let fd = match pidfd_open(pid, PidfdFlags::empty()) {
            Ok(fd) => fd,
            Err(e) => {
                log::debug!("hypervisor watch: pidfd of vm {id} (pid {pid:?}): {e}");
                return;
            }
        };
        let token = reactor.token_in(super::routing::HYPERVISORS);
        let raw = fd.as_raw_fd();
        if let Err(e) = reactor
            .registry()
            .register(&mut SourceFd(&raw), token, Interest::READABLE)
        {
            log::warn!("hypervisor watch: cannot poll the pidfd of vm {id}: {e}");
            return;
        }
        self.by_pod.insert(pod.clone(), token);
        self.by_token.insert(
            token,
            Watched {
                pod: pod.clone(),
                vm: vm.clone(),
                fd,
            },
        );
    }

    /// The pidfd of `token` turned readable: its hypervisor exited. Returns the VM as the
    /// event to report (state `stopped`) and stops watching it.
    pub fn exited<M: Send + 'static>(
        &mut self,
        reactor: &mut Reactor<M>,
        token: Token,
    ) -> Option<VmInfo> {
        let (pod, mut vm) = self.forget(reactor, token)?;
        log::info!(
            "hypervisor of vm {} ({}) pid {} exited",
            vm.name,
            vm.id,
            vm.pid
        );
        self.reported.insert(pod, (vm.id.clone(), vm.pid));
        vm.state = VmState::Stopped;
        Some(vm)
    }

    fn forget<M: Send + 'static>(
        &mut self,
        reactor: &mut Reactor<M>,
        token: Token,
    ) -> Option<(PodKey, VmInfo)> {
        let w = self.by_token.remove(&token)?;
        self.by_pod.remove(&w.pod);
        let raw = w.fd.as_raw_fd();
        let _ = reactor.registry().deregister(&mut SourceFd(&raw));
        Some((w.pod, w.vm))
    }

    /// How many hypervisors are watched and how many exits are remembered (tests).
    #[cfg(test)]
    fn sizes(&self) -> (usize, usize) {
        (self.by_token.len(), self.reported.len())
    }
}

/// A VM the watch covers: a running cocoon VM with an ID and a hypervisor PID. A macOS guest's QEMU is not cocoon's: its liveness is the
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

    fn pod() -> PodKey {
        PodKey::new("default", "a")
    }

    /// The token of the first pidfd that turns readable within `d`, if any.
    fn exit_within(reactor: &mut Reactor<()>, d: Duration) -> Option<Token> {
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
    }

    fn sleeper() -> std::process::Child {
        std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap()
    }

    /// A VM whose hypervisor PID changed (a restart learned by inspect) is watched under its new
    /// PID, and only the new process's exit is reported.
    #[test]
    fn a_changed_hypervisor_pid_is_watched_anew() {
        let mut reactor: Reactor<()> = Reactor::new(0, 1).unwrap();
        let mut old = sleeper();
        let mut new = sleeper();
        let mut watch = HypervisorWatch::default();
        watch.sync(&mut reactor, &pod(), Some(&vm("a", old.id())));
        assert_eq!(watch.sizes(), (1, 0));
        watch.sync(&mut reactor, &pod(), Some(&vm("a", new.id())));
        assert_eq!(watch.sizes(), (1, 0), "the old PID's watch went");

        old.kill().unwrap();
        old.wait().unwrap();
        new.kill().unwrap();
        new.wait().unwrap();
        let token = exit_within(&mut reactor, Duration::from_secs(5)).expect("an exit is seen");
        let gone = watch.exited(&mut reactor, token).expect("watched");
        assert_eq!(gone.pid, i64::from(new.id()));
        assert_eq!(gone.state, VmState::Stopped);
        // Once the pod has no VM, nothing is kept about it.
        watch.sync(&mut reactor, &pod(), None);
        assert_eq!(watch.sizes(), (0, 0));
    }

    /// A VM that stops running, or a pod that goes, takes its watch with it; a pod whose input
    /// changed nothing about its VM keeps the same watch.
    #[test]
    fn a_watch_follows_its_pods_vm() {
        let mut reactor: Reactor<()> = Reactor::new(0, 1).unwrap();
        let mut child = sleeper();
        let mut watch = HypervisorWatch::default();
        let running = vm("a", child.id());
        watch.sync(&mut reactor, &pod(), Some(&running));
        let token = *watch.by_pod.get(&pod()).expect("watched");
        watch.sync(&mut reactor, &pod(), Some(&running));
        assert_eq!(
            watch.by_pod.get(&pod()),
            Some(&token),
            "the same watch kept"
        );
        let stopped = VmInfo {
            state: VmState::Stopped,
            ..running.clone()
        };
        watch.sync(&mut reactor, &pod(), Some(&stopped));
        assert_eq!(watch.sizes(), (0, 0));
        watch.sync(&mut reactor, &pod(), Some(&running));
        assert_eq!(watch.sizes(), (1, 0));
        // Another pod's VM is its own watch; the first pod going leaves it alone.
        let other = PodKey::new("other", "a");
        watch.sync(&mut reactor, &other, Some(&running));
        watch.sync(&mut reactor, &pod(), None);
        assert_eq!(watch.sizes(), (1, 0));
        assert!(watch.by_pod.contains_key(&other));
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// A killed hypervisor nobody has reaped yet (its pidfd opens and is readable at once) while
    /// the core still lists its VM as running under that PID: its exit is reported once, not
    /// on every turn until the check catches up. A restart under a new PID is watched again.
    #[test]
    fn an_exit_is_reported_once_per_pid_while_the_vm_still_reads_running() {
        let mut reactor: Reactor<()> = Reactor::new(0, 1).unwrap();
        let mut first = sleeper();
        let mut watch = HypervisorWatch::default();
        let tracked = vm("a", first.id());
        watch.sync(&mut reactor, &pod(), Some(&tracked));
        first.kill().unwrap(); // not reaped: a zombie, as a dead hypervisor may be for a while
        let token = exit_within(&mut reactor, Duration::from_secs(5)).expect("the exit is seen");
        assert!(watch.exited(&mut reactor, token).is_some());
        // The core has not inspected yet: the VM still reads running under the dead PID.
        watch.sync(&mut reactor, &pod(), Some(&tracked));
        assert_eq!(watch.sizes(), (0, 1), "nothing left to watch");
        assert_eq!(
            exit_within(&mut reactor, Duration::from_millis(300)),
            None,
            "the same exit reported again"
        );
        first.wait().unwrap();
        // Restarted under a new PID: watched, and its exit reported.
        let mut second = sleeper();
        watch.sync(&mut reactor, &pod(), Some(&vm("a", second.id())));
        assert_eq!(watch.sizes(), (1, 0));
        second.kill().unwrap();
        let token =
            exit_within(&mut reactor, Duration::from_secs(5)).expect("the new exit is seen");
        let gone = watch.exited(&mut reactor, token).expect("watched");
        assert_eq!(gone.pid, i64::from(second.id()));
        second.wait().unwrap();
        // The pod is no longer tracked: nothing is kept about it.
        watch.sync(&mut reactor, &pod(), None);
        assert_eq!(watch.sizes(), (0, 0));
    }
}
