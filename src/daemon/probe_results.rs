//! Probe results as the provider sees them: the engine's readiness and IP changes become
//! `Input::Readiness` for the pod they concern.

use crate::probes::ProbeEvent;
use crate::provider::{Input, PodKey};

use super::Daemon;

impl Daemon {
    /// Readiness and IP changes from the probe engine, for the provider.
    pub(super) fn probe_events(&mut self, out: Vec<ProbeEvent>) {
        for e in out {
            let (pod, uid, ready, message, ip) = match e {
                ProbeEvent::Readiness {
                    pod,
                    uid,
                    ready,
                    message,
                    ip,
                    ..
                } => (pod, uid, ready, message, ip),
                ProbeEvent::IpChanged {
                    pod,
                    uid,
                    ip,
                    ready,
                    ..
                } => {
                    let latest = self.probes.manager().result(&pod);
                    let message = latest.map(|r| r.message.clone()).unwrap_or_default();
                    (pod, uid, ready, message, ip)
                }
            };
            let Some((ns, name)) = pod.split_once('/') else {
                continue;
            };
            self.pending.push_back(Input::Readiness {
                key: PodKey::new(ns, name),
                uid,
                ready,
                message,
                ip: Some(ip.map(|i| i.to_string()).unwrap_or_default()),
            });
        }
    }
}
