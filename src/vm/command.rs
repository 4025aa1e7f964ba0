//! The typed command the core asks for: one cocoon (or cocoon-macos) call as verb, argv,
//! deadline and mode, spelled by this room's argv builders. Describes calls; never runs one.

use std::time::Duration;

use super::argv;
use super::{CallMode, CloneOptions, CocoonCall, Deadlines, RunOptions, Verb};

/// A cocoon invocation the core wants performed: the core's vocabulary, mapped one to one onto
/// the vm room's argv builders and deadlines (the only place that spells cocoon's argv).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CocoonCmd {
    VmInspect {
        reference: String,
    },
    VmClone(CloneOptions),
    VmRun(RunOptions),
    VmStart {
        id: String,
    },
    VmRm {
        id: String,
    },
    ReconcileStaleCreate {
        id: String,
    },
    SnapshotInspect {
        name: String,
    },
    /// `snapshot save --name <name> <vm_id>`, killed at `deadline` when one is given, else at
    /// the verb's transfer deadline.
    SnapshotSave {
        name: String,
        vm_id: String,
        deadline: Option<Duration>,
    },
    SnapshotRm {
        name: String,
    },
    SnapshotList,
    ImageInspect {
        reference: String,
    },
    ImagePull {
        reference: String,
        force: bool,
    },
    /// `vm net --nics N VMID`: hot-resize the VM's NICs (CH + Windows hibernate and rollback).
    VmNet {
        id: String,
        nics: u32,
    },
    /// `vm exec <id> -- <command>` (post-clone fix-ups): output discarded, killed at
    /// `deadline` (the rest of the fix-up's budget: a hung attempt is abandoned there).
    VmExec {
        id: String,
        command: Vec<String>,
        deadline: Duration,
    },
    /// A `cocoon-macos` call (`VK_COCOON_MACOS_BIN`) of a managed macOS guest.
    Macos(crate::guest::macos::MacosCmd),
}

impl CocoonCmd {
    /// The cocoon verb, which decides the deadline and the error classification.
    pub fn verb(&self) -> Verb {
        match self {
            CocoonCmd::VmInspect { .. } => Verb::VmInspect,
            CocoonCmd::VmClone(_) => Verb::VmClone,
            CocoonCmd::VmRun(_) => Verb::VmRun,
            CocoonCmd::VmStart { .. } => Verb::VmStart,
            CocoonCmd::VmRm { .. } => Verb::VmRm,
            CocoonCmd::ReconcileStaleCreate { .. } => Verb::VmReconcileStaleCreate,
            CocoonCmd::SnapshotInspect { .. } => Verb::SnapshotInspect,
            CocoonCmd::SnapshotSave { .. } => Verb::SnapshotSave,
            CocoonCmd::SnapshotRm { .. } => Verb::SnapshotRm,
            CocoonCmd::SnapshotList => Verb::SnapshotList,
            CocoonCmd::ImageInspect { .. } => Verb::ImageInspect,
            CocoonCmd::ImagePull { .. } => Verb::ImagePull,
            CocoonCmd::VmNet { .. } => Verb::VmNet,
            CocoonCmd::VmExec { .. } => Verb::VmExec,
            // The cocoon verb of the same meaning: its error classification applies.
            CocoonCmd::Macos(m) => {
                use crate::guest::macos::MacosCmd;
                match m {
                    MacosCmd::Inspect { .. } => Verb::VmInspect,
                    MacosCmd::Start { .. } => Verb::VmStart,
                    MacosCmd::Run(_) => Verb::VmRun,
                    MacosCmd::Rm { .. } => Verb::VmRm,
                    MacosCmd::ImageInspect { .. } => Verb::ImageInspect,
                    MacosCmd::ImagePull { .. } => Verb::ImagePull,
                }
            }
        }
    }

    /// The argument vector after the binary (`VK_COCOON_BIN`, or `VK_COCOON_MACOS_BIN` for
    /// [`CocoonCmd::Macos`]).
    pub fn argv(&self) -> Vec<String> {
        match self {
            CocoonCmd::Macos(m) => m.argv(),
            CocoonCmd::VmInspect { reference } => argv::vm_inspect(reference),
            CocoonCmd::VmClone(o) => argv::vm_clone(o),
            CocoonCmd::VmRun(o) => argv::vm_run(o),
            CocoonCmd::VmStart { id } => argv::vm_start(id),
            CocoonCmd::VmRm { id } => argv::vm_rm(id),
            CocoonCmd::ReconcileStaleCreate { id } => argv::vm_reconcile_stale_create(id),
            CocoonCmd::SnapshotInspect { name } => argv::snapshot_inspect(name),
            CocoonCmd::SnapshotSave { name, vm_id, .. } => argv::snapshot_save(name, vm_id),
            CocoonCmd::SnapshotRm { name } => argv::snapshot_rm(name),
            CocoonCmd::SnapshotList => argv::snapshot_list(),
            CocoonCmd::ImageInspect { reference } => argv::image_inspect(reference),
            CocoonCmd::ImagePull { reference, force } => argv::image_pull(reference, *force),
            CocoonCmd::VmNet { id, nics } => argv::vm_net(id, *nics),
            CocoonCmd::VmExec { id, command, .. } => argv::vm_exec(&super::ExecOptions {
                vm: id.clone(),
                command: command.clone(),
                ..Default::default()
            }),
        }
    }

    /// Environment the child gets beyond the daemon's: a macOS launch's VNC password, derived
    /// from the configured secret (`COCOON_MACOS_VNC_PASSWORD`) and its VM name.
    pub fn child_env(&self, macos_vnc_secret: Option<&str>) -> Vec<(String, String)> {
        match self {
            CocoonCmd::Macos(m) => m.vnc_env(macos_vnc_secret).into_iter().collect(),
            _ => Vec::new(),
        }
    }

    /// Whether this call runs `VK_COCOON_MACOS_BIN` instead of cocoon.
    pub fn is_macos(&self) -> bool {
        matches!(self, CocoonCmd::Macos(_))
    }

    /// How long the daemon lets the child run before killing it: the contract's per-verb
    /// deadline (every verb the core runs has one).
    pub fn deadline(&self) -> Duration {
        match self {
            CocoonCmd::VmExec { deadline, .. }
            | CocoonCmd::SnapshotSave {
                deadline: Some(deadline),
                ..
            } => return *deadline,
            CocoonCmd::Macos(m) => return m.deadline(),
            _ => {}
        }
        let d = Deadlines::configured();
        d.for_verb(self.verb()).unwrap_or(d.control)
    }

    /// The typed call the daemon runs: verb, argv, this command's deadline, the verb's mode.
    /// The core's `vm exec` (post-clone fix-ups) has its output captured for the error text
    /// and discarded on success, which is the combined mode, not a stream to a client.
    pub fn call(&self) -> CocoonCall {
        let mut call = CocoonCall::new(self.verb(), self.argv(), &Deadlines::configured())
            .with_deadline(Some(self.deadline()));
        if call.mode == CallMode::Streaming {
            call.mode = CallMode::Combined;
        }
        call
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::{Backend, CloneSource, CpuPolicy};

    /// Only a VM check is started ahead of other children and at the loop's priority: a VM
    /// start or a clone leaves a hypervisor behind, which would inherit it.
    #[test]
    fn only_a_vm_check_is_an_urgent_child() {
        let urgent = |cmd: CocoonCmd| cmd.call().child_spec("/usr/bin/cocoon").urgent;
        assert!(urgent(CocoonCmd::VmInspect {
            reference: "vk-a-b".into()
        }));
        assert!(!urgent(CocoonCmd::VmStart { id: "x".into() }));
        assert!(!urgent(CocoonCmd::VmRm { id: "x".into() }));
        assert!(!urgent(CocoonCmd::VmClone(CloneOptions::from_snapshot(
            "img"
        ))));
    }

    #[test]
    fn clone_argv_follows_the_n_generation_order() {
        let cmd = CocoonCmd::VmClone(CloneOptions {
            name: "vk-ns-demo-0".into(),
            network: "net1".into(),
            no_direct_io: true,
            pull: true,
            restore_mode: Some(crate::vm::RestoreMode::Mmap),
            cpu: CpuPolicy {
                weight: 79,
                quota_us: 200000,
                period_us: 100000,
            },
            ..CloneOptions::from_snapshot("team/agent:v3")
        });
        assert_eq!(
            cmd.argv().join(" "),
            "vm clone --output json --name vk-ns-demo-0 --network net1 --no-direct-io --pull \
             --restore-mode mmap --cpu-weight 79 --cpu-quota-us 200000 --cpu-period-us 100000 -- team/agent:v3"
        );
    }

    #[test]
    fn clone_from_dir_implies_pull_and_ends_with_the_dir() {
        let cmd = CocoonCmd::VmClone(CloneOptions {
            name: "a".into(),
            cpu: CpuPolicy {
                weight: 1,
                ..Default::default()
            },
            source: CloneSource::FromDir("/srv/snap".into()),
            ..CloneOptions::from_snapshot("")
        });
        assert_eq!(
            cmd.argv().join(" "),
            "vm clone --output json --name a --pull --cpu-weight 1 --from-dir /srv/snap"
        );
    }

    #[test]
    fn run_argv_has_flags_before_image() {
        let cmd = CocoonCmd::VmRun(RunOptions {
            name: "v".into(),
            cpu: 2,
            cpu_policy: CpuPolicy {
                weight: 79,
                ..Default::default()
            },
            memory: "4294967296".into(),
            backend: Backend::Firecracker,
            image: "ubuntu:24.04".into(),
            ..Default::default()
        });
        assert_eq!(
            cmd.argv().join(" "),
            "vm run --output json --name v --cpu 2 --cpu-weight 79 --memory 4294967296 --fc -- ubuntu:24.04"
        );
    }
}
