//! Children started without a fork of the daemon: the daemon's own binary, spawned with
//! posix_spawn, sets the parent-death signal and then execs the real program.
//!
//! Why: the parent-death signal (see `child::die_with_parent`) can only be set by the child
//! itself, which needs a pre-exec hook, which makes the standard library fork instead of
//! posix_spawn (vfork-like). Forking a multi-threaded daemon of tens of MiB for every cocoon
//! call copies its page tables and write-protects its memory: in the 1,000-pod bench the
//! spawner threads' forks and the copy-on-write faults and TLB shootdowns they cause on the loop
//! thread were about 60 % of the daemon's CPU. posix_spawn shares the daemon's memory until the
//! exec, and this trampoline, a fresh image, sets the signal (which survives its exec).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The trampoline's first argument: `<exe> __exec-child <daemon pid> <program> <args...>`.
/// Not a command for people; `vk-cocoon --help` does not list it.
pub const TRAMPOLINE_ARG: &str = "__exec-child";

/// The binary every spawn goes through, once a daemon enabled it.
static TRAMPOLINE: OnceLock<PathBuf> = OnceLock::new();

/// Makes every reactor spawn of this process go through `exe`, a binary whose `main` calls
/// [`run_if_asked`] first. Without it (library users, tests of the reactor) children are forked
/// with a pre-exec hook. Returns false, changing nothing, when `exe` cannot be executed.
pub fn enable(exe: PathBuf) -> bool {
    if !can_run(&exe) {
        return false;
    }
    let _ = TRAMPOLINE.set(exe);
    true
}

/// The argv that runs `argv` through the trampoline, when one is enabled and `argv[0]` can be
/// executed. A program that cannot (missing, not executable) is left to the direct spawn, so it
/// still fails as a spawn error rather than as an exit of the trampoline.
pub(crate) fn wrap(argv: &[String], env: &[(String, String)]) -> Option<Vec<String>> {
    let exe = TRAMPOLINE.get()?;
    let program = argv.first()?;
    if !executable(program, env) {
        return None;
    }
    let mut wrapped = Vec::with_capacity(argv.len() + 3);
    wrapped.push(exe.to_string_lossy().into_owned());
    wrapped.push(TRAMPOLINE_ARG.to_string());
    wrapped.push(std::process::id().to_string());
    wrapped.extend(argv.iter().cloned());
    Some(wrapped)
}

/// Whether `program` names an executable file, looked up in PATH (the child's, when the spec
/// sets one) when it has no slash, as the exec will.
fn executable(program: &str, env: &[(String, String)]) -> bool {
    if program.contains('/') {
        return can_run(Path::new(program));
    }
    let path = env
        .iter()
        .rev()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.into())
        .or_else(|| std::env::var_os("PATH"))
        .unwrap_or_default();
    std::env::split_paths(&path).any(|dir| can_run(&dir.join(program)))
}

fn can_run(p: &Path) -> bool {
    p.is_file() && rustix::fs::access(p, rustix::fs::Access::EXEC_OK).is_ok()
}

/// In the trampoline: sets the parent-death signal and execs the program. Returns None when
/// this process was not started as a trampoline; otherwise only on failure, with the exit code.
pub fn run_if_asked() -> Option<i32> {
    let mut args = std::env::args_os().skip(1);
    if args.next()? != TRAMPOLINE_ARG {
        return None;
    }
    let parent = args
        .next()
        .and_then(|p| p.to_str().and_then(|p| p.parse::<i32>().ok()));
    let Some(program) = args.next() else {
        eprintln!("vk-cocoon: {TRAMPOLINE_ARG}: no program");
        return Some(127);
    };
    if let Err(e) =
        rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
    {
        eprintln!("vk-cocoon: {TRAMPOLINE_ARG}: parent-death signal: {e}");
        return Some(127);
    }
    // The daemon may have died between the spawn and the prctl: no signal would come then.
    if parent.is_none() || rustix::process::getppid().map(|p| p.as_raw_nonzero().get()) != parent {
        return Some(127);
    }
    let err = std::process::Command::new(&program).args(args).exec();
    eprintln!("vk-cocoon: exec {}: {err}", Path::new(&program).display());
    Some(127)
}
