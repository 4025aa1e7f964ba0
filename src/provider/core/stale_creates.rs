//! Stale `creating` records found at startup: each is settled by `cocoon vm
//! reconcile-stale-create` (or inspected); a record still being written is watched until it lands.

use super::*;

impl Provider {
    pub(super) fn pump_stale(&mut self) {
        loop {
            let Some(s) = self.startup.as_mut() else {
                return;
            };
            if s.queue.is_empty() && s.in_flight == 0 {
                return self.finish_startup();
            }
            if s.in_flight >= STALE_FANOUT || s.queue.is_empty() {
                return;
            }
            let vm = s.queue.remove(0);
            s.in_flight += 1;
            let op = self.op_id();
            self.waiters.insert(
                op,
                Waiter::StaleCreate {
                    vm: vm.clone(),
                    watcher: false,
                },
            );
            self.out.push(Effect::Cocoon {
                op,
                cmd: CocoonCmd::ReconcileStaleCreate { id: vm.id },
            });
        }
    }

    pub(super) fn stale_done(&mut self, vm: Option<VmInfo>, watch: Option<VmInfo>) {
        if let Some(s) = self.startup.as_mut() {
            s.in_flight = s.in_flight.saturating_sub(1);
            if let Some(v) = vm {
                s.vms.push(v);
            }
            if let Some(v) = watch {
                s.watched.push(v.clone());
                let at = self.now + RECHECK_FIRST;
                let until = self.now + RECHECK_BUDGET;
                self.arm(
                    at,
                    TimerEntry::StaleWatch {
                        vm: v,
                        delay: RECHECK_FIRST,
                        until,
                    },
                );
            }
        }
        self.pump_stale();
    }

    pub(super) fn stale_result(&mut self, vm: VmInfo, watcher: bool, res: Res) {
        let Res::Cocoon(r) = res else {
            return;
        };
        let outcome = if r.succeeded() {
            r.stale_outcome().ok()
        } else {
            None
        };
        let label = outcome.as_ref().map_or("error", StaleCreateOutcome::as_str);
        self.metric(MetricUpdate::StaleCreateReconcile {
            outcome: label.to_string(),
        });
        let name_free = matches!(
            outcome,
            Some(StaleCreateOutcome::Collected | StaleCreateOutcome::NotFound)
        );
        if watcher {
            if name_free {
                // The watch is over: its delay record goes with it.
                self.stale_watch_state.remove(&vm.id);
                return;
            }
            return self.stale_inspect(vm, true);
        }
        match outcome {
            _ if name_free => self.stale_done(None, None),
            Some(StaleCreateOutcome::NotCreating) => self.stale_inspect(vm, false),
            _ => self.stale_done(None, Some(vm)),
        }
    }

    pub(super) fn stale_inspect(&mut self, vm: VmInfo, watcher: bool) {
        let op = self.op_id();
        self.waiters.insert(
            op,
            Waiter::StaleInspect {
                vm: vm.clone(),
                watcher,
            },
        );
        self.out.push(Effect::Cocoon {
            op,
            cmd: CocoonCmd::VmInspect { reference: vm.id },
        });
    }

    pub(super) fn stale_inspect_result(&mut self, vm: VmInfo, watcher: bool, res: Res) {
        let Res::Cocoon(r) = res else {
            return;
        };
        let parsed = if r.succeeded() { r.vm().ok() } else { None };
        enum V {
            Drop,
            Keep(VmInfo),
            Watch,
            Orphan(VmInfo),
        }
        let verdict = if r.vm_not_found() {
            V::Drop
        } else {
            match parsed {
                None => V::Watch,
                Some(v) if v.running() => V::Keep(v),
                Some(v) if matches!(v.state, VmState::Creating | VmState::Created) => V::Watch,
                Some(v) => V::Orphan(v),
            }
        };
        if watcher {
            // A watch that ends takes its delay record with it (a re-armed one keeps it).
            if !matches!(verdict, V::Watch) {
                self.stale_watch_state.remove(&vm.id);
            }
            match verdict {
                V::Drop => {}
                V::Keep(v) => self.stale_vm_landed(v),
                V::Orphan(v) => self.orphan(v),
                V::Watch => self.rearm_stale_watch(vm),
            }
            return;
        }
        match verdict {
            V::Drop => self.stale_done(None, None),
            V::Keep(v) => self.stale_done(Some(v), None),
            V::Watch => self.stale_done(None, Some(vm)),
            V::Orphan(v) => {
                self.orphan(v);
                self.stale_done(None, None)
            }
        }
    }

    /// A create left running by an earlier process finished after startup. A pod that names
    /// the VM gets it (a live one adopts it, a deleting one's delete finds and removes it);
    /// with no pod naming it, it is removed: that pod is gone and nothing else ever would.
    pub(super) fn stale_vm_landed(&mut self, vm: VmInfo) {
        let named_by = self
            .slots
            .iter()
            .find(|(k, s)| {
                s.latest.as_ref().is_some_and(|p| {
                    p.metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get(spec::ANN_VM_NAME))
                        .is_some_and(|n| !vm.name.is_empty() && *n == vm.name)
                }) && isolation::vm_name_refusal(k, &vm.name).is_none()
            })
            .map(|(k, _)| k.clone());
        match named_by {
            Some(key) => {
                self.by_name.insert(vm.name.clone(), vm);
                self.kick(&key);
            }
            None if self.cfg.orphan_policy == OrphanPolicy::Keep => self.orphan(vm),
            None => {
                log::warn!(
                    "provider: removing vm {} ({}): its create outlived the pod",
                    vm.name,
                    vm.id
                );
                self.fire_and_forget_cocoon(CocoonCmd::VmRm { id: vm.id.clone() });
                self.forget_owner(Owned::Vm, &vm.name);
                self.release_leases(&vm);
            }
        }
    }

    pub(super) fn rearm_stale_watch(&mut self, vm: VmInfo) {
        // The watch entry carries its own delay; the latest one was stored on the vm key.
        if let Some((delay, until)) = self.stale_watch_state.remove(&vm.id) {
            let delay = (delay * 2).min(RECHECK_MAX);
            if self.now + delay > until {
                log::warn!(
                    "provider: stale creating vm {} unresolved after 30 min",
                    vm.id
                );
                return;
            }
            let at = self.now + delay;
            self.arm(at, TimerEntry::StaleWatch { vm, delay, until });
        }
    }

    pub(super) fn stale_watch_tick(&mut self, vm: VmInfo, delay: Duration, until: Instant) {
        self.stale_watch_state.insert(vm.id.clone(), (delay, until));
        let op = self.op_id();
        self.waiters.insert(
            op,
            Waiter::StaleCreate {
                vm: vm.clone(),
                watcher: true,
            },
        );
        self.out.push(Effect::Cocoon {
            op,
            cmd: CocoonCmd::ReconcileStaleCreate { id: vm.id },
        });
    }
}
