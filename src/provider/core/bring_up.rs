//! After a create's VM exists: settle it (adopt, IP, lifecycle), wait for the lease and
//! publish Ready; probe results (readiness) land here too. A failed create is `create`'s.

use super::*;
use crate::provider::fixup;

impl Provider {
    /// The VM exists (booted or adopted): resolve its IP, then finish.
    pub(super) fn vm_up(&mut self, key: &PodKey, vm: VmInfo, adopted: bool) {
        let Some(c) = self.op_of_mut::<CreateOp>(key) else {
            return;
        };
        let spec = c.spec.clone();
        let started = c.started;
        c.adopted = adopted;
        if !adopted {
            let mode = if spec.mode_raw.is_empty() {
                "clone".to_string()
            } else {
                spec.mode_raw.clone()
            };
            let secs = self.now.saturating_duration_since(started).as_secs_f64();
            self.metric(MetricUpdate::VmBootDuration {
                namespace: key.namespace.clone(),
                mode,
                backend: spec.backend.clone(),
                seconds: secs,
            });
        }
        let cloned = !(adopted || spec.fresh_boot());
        let ip = vm.primary_ip();
        if ip.is_empty() && !vm.primary_mac().is_empty() {
            if let Some(c) = self.op_of_mut::<CreateOp>(key) {
                c.vm = Some(vm.clone());
            }
            let mac = vm.primary_mac();
            if adopted {
                // Adoption publishes Ready now: mark as not cloned.
                if let Some(c) = self.op_of_mut::<CreateOp>(key) {
                    c.spec.mode = Mode::Run;
                    c.spec.clone_from_dir = None;
                    c.spec.fork_from.clear();
                }
            }
            let ask = Ask::effect(|op| Effect::LookupLease { op, mac });
            return self.advance(key, CreateStep::Lease, ask);
        }
        self.finish_create(key, vm, cloned, &ip)
    }

    /// The end of a create once the VM is up, then the VM event that arrived meanwhile, if any.
    pub(super) fn finish_create(&mut self, key: &PodKey, vm: VmInfo, cloned: bool, ip: &str) {
        let meanwhile = self
            .op_of_mut::<CreateOp>(key)
            .and_then(|c| c.vm_event_meanwhile.take());
        self.settle_create(key, vm, cloned, ip);
        if let Some((kind, vm)) = meanwhile {
            self.vm_event(kind, vm);
        }
    }

    /// The end of a create once the VM is up: id/ip annotations, track the VM, probe, Running,
    /// Ready.
    pub(super) fn settle_create(&mut self, key: &PodKey, vm: VmInfo, cloned: bool, ip: &str) {
        let Some(c) = self.op_of_mut::<CreateOp>(key) else {
            return;
        };
        let (uid, spec) = (c.uid.clone(), c.spec.clone());
        let c_snapshot_image = c.snapshot_image.clone();
        let booted = !c.adopted;
        let ip = if ip.is_empty() {
            self.slot(key)
                .tracked
                .as_ref()
                .map(|t| t.ip.clone())
                .unwrap_or_default()
        } else {
            ip.to_string()
        };
        let mut ann = BTreeMap::new();
        ann.insert(ANN_VM_ID.to_string(), Some(vm.id.clone()));
        ann.insert(ANN_VM_IP.to_string(), Some(ip.clone()));
        if spec.managed {
            // No write of their own: id / ip ride on the pod's next annotation patch, normally
            // the lifecycle `ready` after the Ready status (a fix-up's `running` marker or a
            // `failed` if one comes first). A restart before it finds the VM by the pod's
            // name, recorded for the pod's uid in the ownership ledger, and adopts it.
            self.owe_annotations(key, &uid, ann);
        }
        if spec.managed {
            self.by_name.insert(spec.vm_name.clone(), vm.clone());
            self.own_adopted(key, &uid, &spec.vm_name);
        }
        let deleting_now = self
            .slot(key)
            .latest
            .as_ref()
            .map(|p| deleting(p))
            .unwrap_or(false);
        {
            let slot = self.slot(key);
            slot.failures = 0;
            slot.retry_at = None;
            if let Some(t) = slot.tracked.as_mut() {
                t.vm = Some(vm.clone());
                t.ip = ip.clone();
                t.spec.vm_id = vm.id.clone();
                t.spec.vm_ip = ip.clone();
                t.probe = Some(initial_probe(&ip));
            }
        }
        if !deleting_now {
            self.out.push(Effect::StartProbe {
                key: key.clone(),
                uid: uid.clone(),
                vm_id: vm.id.clone(),
                ip: ip.clone(),
                mac: vm.primary_mac(),
                probe_port: spec.probe_port,
            });
        }
        self.event(
            key,
            &uid,
            EventType::Normal,
            "ProviderCreateSuccess",
            "Create pod in provider successfully",
        );
        if booted {
            // An adoption counted itself as `{create,ok,adopted}` where it was recognised.
            self.lifecycle_metric("create", "ok", "");
        }
        if cloned {
            let cloud_image = spec::is_http_url(&c_snapshot_image);
            if ip.is_empty() && fixup::classify(spec.os, &vm).is_none() {
                // Just looked the lease up: poll again in 200 ms.
                self.set_op(
                    key,
                    ReadyWaitOp {
                        uid,
                        vm_id: vm.id.clone(),
                        step: ReadyWaitStep::Pause,
                        until: self.now + IP_WAIT,
                        nudge_at: None,
                        mode: PostCloneMode::Clone,
                    },
                );
                self.push_status(key, false);
                let at = self.now + IP_POLL;
                return self.set_pod_timer(key, at);
            }
            return self.post_clone_or_ready_wait(key, &vm, cloud_image, PostCloneMode::Clone);
        }
        if booted && spec.managed && spec.os == Os::Windows {
            // A Windows guest booted from an image: its static addresses go in over SAC
            // before it is Ready (nothing to do without a static NIC).
            return self.sac_then_ready_wait(key, &vm, PostCloneMode::Clone);
        }
        self.slot(key).finish_op();
        self.publish_ready(key);
        self.reconcile_slot(key);
    }

    /// A newly learned IP: remember it, re-write the ip annotation, refresh the probe default.
    pub(super) fn set_ip(&mut self, key: &PodKey, ip: &str) {
        let slot = self.slot(key);
        let Some(t) = slot.tracked.as_mut() else {
            return;
        };
        if t.ip == ip {
            return;
        }
        t.ip = ip.to_string();
        t.spec.vm_ip = ip.to_string();
        if matches!(&t.probe, Some((false, m)) if m == "waiting for dhcp lease")
            || t.probe.is_none()
        {
            t.probe = Some(initial_probe(ip));
        }
        let (uid, managed, vm_id) = (
            t.uid.clone(),
            t.spec.managed,
            t.vm.as_ref().map(|v| v.id.clone()).unwrap_or_default(),
        );
        if managed {
            let mut ann = BTreeMap::new();
            ann.insert(ANN_VM_ID.to_string(), Some(vm_id));
            ann.insert(ANN_VM_IP.to_string(), Some(ip.to_string()));
            // Not written yet (a create's id / ip wait for its `ready`): the new ip waits too.
            if self.vm_id_owed(key, &uid) {
                return self.owe_annotations(key, &uid, ann);
            }
            self.send_annotations(key, &uid, ann, false);
        }
    }

    // ----- readiness ------------------------------------------------------------------------

    pub(super) fn readiness(
        &mut self,
        key: &PodKey,
        uid: &str,
        ready: bool,
        message: String,
        ip: Option<String>,
    ) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        let Some(t) = slot.tracked.as_mut() else {
            return;
        };
        if t.uid != uid || t.vm.is_none() {
            return;
        }
        t.probe = Some((ready, message));
        if let Some(ip) = ip {
            if !ip.is_empty() && ip != t.ip {
                self.set_ip(key, &ip);
                if let Some(w) = self.op_of::<ReadyWaitOp>(key).cloned() {
                    return self.ready_wait_poll(key, w);
                }
            }
        }
        if self.macos_readiness(key, ready) {
            return;
        }
        self.push_status(key, false);
    }
}
