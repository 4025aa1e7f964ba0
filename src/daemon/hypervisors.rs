//! Hypervisor process watch: a pidfd per running VM's hypervisor in the loop's poll, so a VM
//! that dies is reported at once instead of when cocoon's event ticker next looks.
//!
//! The PID is the one cocoon reported for the VM (clone, run, inspect, list). A pidfd turns
//! readable when its process exits; that is reported as a `MODIFIED` event with state
//! `stopped`, which the core handles as any VM event (VM-gone handling inspects before acting, so a
//! false alarm costs one inspect). Cocoon's event stream stays the authority beside it.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};

use mio::unix::SourceFd;
use mio::{Interest, Token};
use rustix::process::{pidfd_open, Pid, PidfdFlags};

use crate::provider::cocoon::{VmInfo, VmState};
use crate::reactor::Reactor;

struct Watched {
    vm: VmInfo,
    fd: OwnedFd,
}

/// The pidfds of the tracked running VMs, by poll token and by VM ID.
#[derive(Default)]
pub struct HypervisorWatch {
    by_token: HashMap<Token, Watched>,
    by_vm: HashMap<String, Token>,
}

impl HypervisorWatch {
    pub fn owns(&self, token: Token) -> bool {
        self.by_token.contains_key(&token)
    }

    /// Watch every running VM of `tracked` with a PID, stop watching the others.
    pub fn sync<'a, M: Send + 'static>(
        &mut self,
        reactor: &mut Reactor<M>,
        tracked: impl Iterator<Item = &'a VmInfo>,
    ) {
        let mut wanted: HashMap<&str, &VmInfo> = HashMap::new();
        for vm in tracked {
            if vm.state == VmState::Running && vm.pid > 0 && !vm.id.is_empty() {
                wanted.insert(vm.id.as_str(), vm);
            }
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
        for (id, vm) in wanted {
            if self.by_vm.contains_key(id) {
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
            let token = reactor.token();
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
