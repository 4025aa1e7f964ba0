//! The hypervisor's PID file in cocoon's run directory (`<root>/run/<backend dir>/<id>/ch.pid`,
//! `fc.pid` for Firecracker), read as a typed answer instead of asking `vm inspect`.
//!
//! cocoon's own `pid` field comes from the same file (it is non-zero only while the record
//! says running and the file exists), so when the VM's run directory is where the daemon
//! looks, an absent file is also what an inspect would say: no PID. Only a run directory
//! elsewhere (cocoon configured with another run dir) leaves cocoon as the one to ask.

use std::path::Path;

/// What the PID file of a VM says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PidFile {
    /// The file names this live process.
    Live(i64),
    /// The file is there but names no live process (or nothing that reads as a PID): the
    /// hypervisor is gone or was never started.
    Dead,
    /// The run directory is there, the file is not: no hypervisor PID recorded, which is
    /// what cocoon's own record says too.
    NoFile,
    /// No run directory of that VM where the daemon looks (another layout, or an ID that
    /// cannot be a file name): only cocoon can tell.
    NoRunDir,
}

/// Reads the PID file of VM `vm_id` under cocoon root `root`. A VM ID is cocoon's own answer,
/// but it becomes a path here: anything but a plain file name is not looked up.
pub fn read_pid_file(root: &Path, vm_id: &str, firecracker: bool) -> PidFile {
    let plain = !vm_id.is_empty()
        && vm_id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if !plain {
        return PidFile::NoRunDir;
    }
    let (dir, file) = if firecracker {
        ("firecracker", "fc.pid")
    } else {
        ("cloudhypervisor", "ch.pid")
    };
    let run_dir = root.join("run").join(dir).join(vm_id);
    let text = match std::fs::read_to_string(run_dir.join(file)) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return if run_dir.is_dir() {
                PidFile::NoFile
            } else {
                PidFile::NoRunDir
            };
        }
        Err(_) => return PidFile::Dead,
    };
    match text.trim().parse::<i64>() {
        Ok(pid) if process_alive(pid) => PidFile::Live(pid),
        _ => PidFile::Dead,
    }
}

/// Whether process `pid` exists and is not a zombie (`/proc/<pid>/stat`). A zombie is a dead
/// process its parent has not reaped yet.
pub fn process_alive(pid: i64) -> bool {
    if pid <= 0 {
        return false;
    }
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state is the first field after the parenthesised command (which may hold spaces).
    let state = stat
        .rfind(')')
        .and_then(|i| stat.get(i + 1..))
        .and_then(|rest| rest.split_whitespace().next());
    !matches!(state, Some("Z") | Some("X") | None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vm_pid_is_read_from_the_backends_pid_file_when_its_process_lives() {
        let root = tempfile::tempdir().expect("tempdir");
        let write = |dir: &str, id: &str, file: &str, text: &str| {
            let d = root.path().join("run").join(dir).join(id);
            std::fs::create_dir_all(&d).expect("mkdir");
            std::fs::write(d.join(file), text).expect("write");
        };
        let me = i64::from(std::process::id());
        write("cloudhypervisor", "CH1", "ch.pid", &format!("{me}\n"));
        write("firecracker", "FC1", "fc.pid", &me.to_string());
        write("cloudhypervisor", "BAD", "ch.pid", "not a pid");
        write("cloudhypervisor", "NOPID", "cow.raw", "");
        let mut child = std::process::Command::new("true").spawn().expect("spawn");
        let gone = i64::from(child.id());
        child.wait().expect("reap");
        write("cloudhypervisor", "GONE", "ch.pid", &gone.to_string());

        let read = |id: &str, fc: bool| read_pid_file(root.path(), id, fc);
        assert_eq!(read("CH1", false), PidFile::Live(me));
        assert_eq!(read("FC1", true), PidFile::Live(me));
        assert_eq!(
            read("CH1", true),
            PidFile::NoRunDir,
            "a Firecracker VM has fc.pid under firecracker/"
        );
        assert_eq!(read("BAD", false), PidFile::Dead);
        assert_eq!(read("GONE", false), PidFile::Dead, "the process has exited");
        assert_eq!(read("NOPID", false), PidFile::NoFile);
        assert_eq!(read("MISSING", false), PidFile::NoRunDir);
        assert_eq!(
            read("../cloudhypervisor/CH1", false),
            PidFile::NoRunDir,
            "no path in an ID"
        );
    }

    #[test]
    fn no_process_is_alive_at_pid_0_or_below() {
        assert!(!process_alive(0));
        assert!(!process_alive(-1));
        assert!(process_alive(i64::from(std::process::id())));
    }
}
