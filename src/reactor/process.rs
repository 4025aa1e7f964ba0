//! Starting a child process without copying the daemon: a vfork-style clone whose child sets
//! the parent-death signal itself, then execs the program; and the handle to the running child.
//!
//! Why not `std::process::Command`: the parent-death signal (see [`spawn`]) can only be set by
//! the child, which needs a pre-exec hook, which makes the standard library fork instead of
//! posix_spawn. Forking a multi-threaded daemon of tens of MiB for every cocoon call copies its
//! page tables and write-protects its memory: in a 1,000-pod burst those forks and the
//! copy-on-write faults they left behind were about 60 % of the daemon's CPU. Re-executing the
//! daemon's own binary as a trampoline avoided the copy but paid a second process start per
//! call (35 % of a burst's host CPU). Here the child shares the daemon's memory until its exec,
//! as posix_spawn's does, and runs a handful of raw system calls before it.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ChildStderr, ChildStdin, ChildStdout, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};

use rustix::process::{Pid, Signal, WaitOptions};

/// What one of the child's standard streams is connected to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stdio {
    /// /dev/null.
    Null,
    /// A pipe whose other end the caller gets in [`Process`].
    Piped,
}

/// A process to start: `argv[0]` is the program (looked up in PATH when it has no slash: the
/// child's PATH when `env` sets one), `env` adds to or overrides the daemon's environment.
#[derive(Clone, Debug)]
pub(crate) struct ProcessSpec {
    pub(crate) argv: Vec<String>,
    pub(crate) env: Vec<(String, String)>,
    pub(crate) stdin: Stdio,
    pub(crate) stdout: Stdio,
    pub(crate) stderr: Stdio,
    /// In a process group of its own (group id = its pid), so that a wrapper and what it
    /// starts can be killed together.
    pub(crate) own_group: bool,
    /// The child's nice value, where the daemon may set it (raising the priority takes
    /// CAP_SYS_NICE; without it the child keeps the spawning thread's).
    pub(crate) nice: Option<i32>,
}

impl ProcessSpec {
    pub(crate) fn new(argv: Vec<String>) -> Self {
        ProcessSpec {
            argv,
            env: Vec::new(),
            stdin: Stdio::Null,
            stdout: Stdio::Null,
            stderr: Stdio::Null,
            own_group: false,
            nice: None,
        }
    }
}

/// A started child: its pid until it is reaped, and the daemon's ends of its pipes.
#[derive(Debug)]
pub(crate) struct Process {
    pid: Pid,
    pub(crate) stdin: Option<ChildStdin>,
    pub(crate) stdout: Option<ChildStdout>,
    pub(crate) stderr: Option<ChildStderr>,
    /// Set once reaped: the pid may name another process from then on.
    status: Option<ExitStatus>,
}

impl Process {
    pub(crate) fn id(&self) -> u32 {
        self.pid.as_raw_nonzero().get().unsigned_abs()
    }

    pub(crate) fn pid(&self) -> Pid {
        self.pid
    }

    /// SIGKILL, unless it was reaped already (its pid may be another process's by then).
    pub(crate) fn kill(&mut self) -> io::Result<()> {
        if self.status.is_some() {
            return Ok(());
        }
        rustix::process::kill_process(self.pid, Signal::KILL).map_err(io::Error::from)
    }

    /// Waits for the exit and reaps; stdin is closed first, so a child reading it ends.
    pub(crate) fn wait(&mut self) -> io::Result<ExitStatus> {
        drop(self.stdin.take());
        loop {
            if let Some(status) = self.reap(WaitOptions::empty())? {
                return Ok(status);
            }
        }
    }

    /// The exit status when the child has exited (reaping it), None while it runs.
    pub(crate) fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        self.reap(WaitOptions::NOHANG)
    }

    fn reap(&mut self, options: WaitOptions) -> io::Result<Option<ExitStatus>> {
        if let Some(status) = self.status {
            return Ok(Some(status));
        }
        match rustix::process::waitpid(Some(self.pid), options) {
            Ok(Some((_, status))) => {
                let status = ExitStatus::from_raw(status.as_raw());
                self.status = Some(status);
                Ok(Some(status))
            }
            Ok(None) => Ok(None),
            Err(rustix::io::Errno::INTR) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}

/// Bytes of stack for the child between the clone and the exec: it runs a few system-call
/// wrappers and no Rust code that allocates, recurses or unwinds.
const CHILD_STACK: usize = 64 * 1024;

/// Starts `spec` and returns once the child has exec'd (or failed to, with the reason).
///
/// The child gets SIGKILL when the *thread* that called this ends (PR_SET_PDEATHSIG), so a
/// crashed or killed daemon leaves no cocoon call or exec session running unsupervised; nobody
/// would be left to read its pipes or reap it, and every cocoon operation is recoverable by the
/// restarted daemon's reconcile. Hypervisors are not affected: the setting is not inherited by
/// the grandchildren cocoon forks. It survives the exec, as long as the program is not setuid.
///
/// Like the standard library's spawn, the child starts with an empty signal mask and SIGPIPE
/// at its default (the daemon ignores it), and inherits only descriptors without close-on-exec.
pub(crate) fn spawn(spec: &ProcessSpec) -> io::Result<Process> {
    let program = spec
        .argv
        .first()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "empty argv"))?;
    let path = c_string(resolve(program, &spec.env)?.as_os_str().as_bytes())?;
    let argv = spec
        .argv
        .iter()
        .map(|a| c_string(a.as_bytes()))
        .collect::<io::Result<Vec<_>>>()?;
    let envp = environment(&spec.env)?;
    let argv_ptrs = null_terminated(&argv);
    let envp_ptrs = null_terminated(&envp);

    let null = above_stdio(OwnedFd::from(
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")?,
    ))?;
    type Stream = (RawFd, Option<OwnedFd>, Option<OwnedFd>);
    let stream = |mode: Stdio, child_reads: bool| -> io::Result<Stream> {
        if mode == Stdio::Null {
            return Ok((null.as_raw_fd(), None, None));
        }
        let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
        let (theirs, ours) = if child_reads {
            (read, write)
        } else {
            (write, read)
        };
        let theirs = above_stdio(theirs)?;
        Ok((theirs.as_raw_fd(), Some(theirs), Some(ours)))
    };
    // The child's ends (`_theirs`) stay open here until the child has exec'd, then close.
    let (stdin_fd, _stdin_theirs, stdin_ours) = stream(spec.stdin, true)?;
    let (stdout_fd, _stdout_theirs, stdout_ours) = stream(spec.stdout, false)?;
    let (stderr_fd, _stderr_theirs, stderr_ours) = stream(spec.stderr, false)?;

    let args = ChildArgs {
        path: path.as_ptr(),
        argv: argv_ptrs.as_ptr(),
        envp: envp_ptrs.as_ptr(),
        stdio: [stdin_fd, stdout_fd, stderr_fd],
        own_group: spec.own_group,
        nice: spec.nice,
        parent: rustix::process::getpid().as_raw_nonzero().get(),
        error: AtomicI32::new(0),
    };
    let pid = clone_and_exec(&args)?;
    match args.error.load(Ordering::SeqCst) {
        0 => Ok(Process {
            pid,
            stdin: stdin_ours.map(ChildStdin::from),
            stdout: stdout_ours.map(ChildStdout::from),
            stderr: stderr_ours.map(ChildStderr::from),
            status: None,
        }),
        errno => {
            // The child exited with 127 before its exec: reap it and report why.
            let mut failed = Process {
                pid,
                stdin: None,
                stdout: None,
                stderr: None,
                status: None,
            };
            let _ = failed.wait();
            Err(io::Error::from_raw_os_error(errno))
        }
    }
}

/// What the child reads between the clone and the exec: pointers into the spawning thread's
/// memory, which the child shares and which stays put while that thread is suspended.
struct ChildArgs {
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    /// The descriptors that become the child's 0, 1 and 2; each is 3 or more.
    stdio: [RawFd; 3],
    own_group: bool,
    nice: Option<i32>,
    /// The daemon's pid: the child's parent unless the daemon died before the signal was set.
    parent: libc::pid_t,
    /// The errno of the step that failed in the child, 0 when it exec'd.
    error: AtomicI32,
}

/// The clone itself: the calling thread is suspended until the child has exec'd or exited.
fn clone_and_exec(args: &ChildArgs) -> io::Result<Pid> {
    let mut stack = vec![0u8; CHILD_STACK];
    // The stack grows down from its end, which must be 16-byte aligned.
    let top = stack.as_mut_ptr_range().end;
    let top = top.wrapping_sub(top as usize % 16);
    // All signals blocked while the child shares our memory: no handler of the daemon's may run
    // on the child's side (a signal-hook handler there would report a signal to the daemon that
    // the daemon never got). The child resets the handlers before unblocking.
    // SAFETY: sigfillset initialises the set it is given; pthread_sigmask reads `all` and
    // writes the old mask into `old`, both valid for the call.
    let old = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        old
    };
    // SAFETY: CLONE_VM | CLONE_VFORK is what posix_spawn does: the child runs `child_main` on
    // `stack` (alive, and not used by this thread, until clone returns, because CLONE_VFORK
    // suspends this thread until the child execs or exits) in our address space. `args` and
    // everything it points to (the C strings and pointer arrays of `spawn`) outlive the call
    // for the same reason. `child_main` only reads `args`, writes its atomic `error`, and makes
    // async-signal-safe calls; it never returns into our stack frames.
    let pid = unsafe {
        libc::clone(
            child_main,
            top.cast(),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            std::ptr::from_ref(args).cast_mut().cast(),
        )
    };
    let clone_error = io::Error::last_os_error();
    // SAFETY: restores the mask saved above; `old` is a valid, initialised set.
    unsafe {
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
    }
    drop(stack);
    if pid < 0 {
        return Err(clone_error);
    }
    Pid::from_raw(pid).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidData))
}

/// The child's side. It shares the daemon's memory and the spawning thread's thread pointer, so
/// it allocates nothing, takes no lock, touches no thread-local but errno and cannot panic.
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `ChildArgs` that `clone_and_exec` passed, alive while we run.
    let args = unsafe { &*arg.cast::<ChildArgs>() };
    // SAFETY: see `child_steps`; called once, in the cloned child.
    let errno = unsafe { child_steps(args) };
    args.error.store(errno.max(1), Ordering::SeqCst);
    // SAFETY: _exit ends the child without running the daemon's exit handlers or destructors.
    unsafe { libc::_exit(127) }
}

/// Prepares the child and execs; returns only on failure, with the errno. Each call here is a
/// thin system-call wrapper (async-signal-safe); see `child_main` for what may not happen here.
///
/// # Safety
/// Only in the child `clone_and_exec` started, whose memory is the daemon's until the exec.
unsafe fn child_steps(args: &ChildArgs) -> libc::c_int {
    let errno = || {
        io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EINVAL)
    };
    // Handlers of the daemon (signal-hook's, the runtime's stack-overflow ones) back to the
    // default before the signals are unblocked; SIGPIPE too, which the daemon ignores. Other
    // ignored signals stay ignored, as with the standard library. SIGABRT is skipped: the
    // daemon installs no handler for it, and musl's sigaction takes a lock for it.
    for sig in 1..=64 {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP || sig == libc::SIGABRT {
            continue;
        }
        let mut current: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(sig, std::ptr::null(), &mut current) != 0 {
            continue; // a number the C library reserves or the kernel lacks
        }
        let handled =
            current.sa_sigaction != libc::SIG_DFL && current.sa_sigaction != libc::SIG_IGN;
        if handled || sig == libc::SIGPIPE {
            let mut default: libc::sigaction = std::mem::zeroed();
            default.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(sig, &default, std::ptr::null_mut());
        }
    }
    let mut none: libc::sigset_t = std::mem::zeroed();
    libc::sigemptyset(&mut none);
    if libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut()) != 0 {
        return errno();
    }
    // The sources are all 3 or more (`above_stdio`), so no dup2 overwrites a later source;
    // the copies lose close-on-exec, the sources keep it.
    for (target, &source) in args.stdio.iter().enumerate() {
        if libc::dup2(source, target as libc::c_int) < 0 {
            return errno();
        }
    }
    if args.own_group && libc::setpgid(0, 0) != 0 {
        return errno();
    }
    if let Some(nice) = args.nice {
        // Best effort: a daemon without CAP_SYS_NICE runs the child at the default.
        libc::setpriority(libc::PRIO_PROCESS, 0, nice);
    }
    if libc::prctl(
        libc::PR_SET_PDEATHSIG,
        libc::SIGKILL as libc::c_ulong,
        0,
        0,
        0,
    ) != 0
    {
        return errno();
    }
    // The daemon may have died between the clone and the prctl: then no signal would come.
    if libc::getppid() != args.parent {
        return libc::ESRCH;
    }
    libc::execve(args.path, args.argv, args.envp);
    errno()
}

/// The program as exec will find it: a name without a slash is looked up in PATH (the child's,
/// when `env` sets one). Not found is the spawn error "No such file or directory".
fn resolve(program: &str, env: &[(String, String)]) -> io::Result<PathBuf> {
    if program.contains('/') {
        return Ok(PathBuf::from(program));
    }
    let path = env
        .iter()
        .rev()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.into())
        .or_else(|| std::env::var_os("PATH"))
        .unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| executable(candidate))
        .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))
}

fn executable(p: &Path) -> bool {
    p.is_file() && rustix::fs::access(p, rustix::fs::Access::EXEC_OK).is_ok()
}

/// The daemon's environment with `overrides` applied, as `KEY=VALUE` strings.
fn environment(overrides: &[(String, String)]) -> io::Result<Vec<CString>> {
    let mut vars: Vec<(Vec<u8>, Vec<u8>)> = std::env::vars_os()
        .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
        .collect();
    for (key, value) in overrides {
        match vars.iter_mut().find(|(k, _)| k == key.as_bytes()) {
            Some(var) => var.1 = value.as_bytes().to_vec(),
            None => vars.push((key.as_bytes().to_vec(), value.as_bytes().to_vec())),
        }
    }
    vars.into_iter()
        .map(|(mut k, v)| {
            k.push(b'=');
            k.extend_from_slice(&v);
            c_string(&k)
        })
        .collect()
}

fn c_string(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "an argument or environment entry holds a NUL byte",
        )
    })
}

fn null_terminated(strings: &[CString]) -> Vec<*const libc::c_char> {
    strings
        .iter()
        .map(|s| s.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}

/// `fd` moved to a number of 3 or more (close-on-exec kept): a daemon started with a standard
/// stream closed gets 0, 1 or 2 for a new pipe, which the child's dup2s would overwrite.
fn above_stdio(fd: OwnedFd) -> io::Result<OwnedFd> {
    if fd.as_raw_fd() > 2 {
        return Ok(fd);
    }
    Ok(rustix::io::fcntl_dupfd_cloexec(&fd, 3)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};

    fn spec(argv: &[&str]) -> ProcessSpec {
        ProcessSpec {
            stdout: Stdio::Piped,
            ..ProcessSpec::new(argv.iter().map(|a| a.to_string()).collect())
        }
    }

    /// Runs `spec` to its end: its stdout and exit status.
    fn run(spec: &ProcessSpec) -> (String, ExitStatus) {
        let mut child = spawn(spec).unwrap();
        let mut out = String::new();
        if let Some(mut stdout) = child.stdout.take() {
            stdout.read_to_string(&mut out).unwrap();
        }
        (out, child.wait().unwrap())
    }

    #[test]
    fn runs_the_program_with_its_arguments_environment_and_exit_status() {
        let (out, status) = run(&spec(&["printf", "%s-%s", "a b", "c"]));
        assert_eq!(out, "a b-c");
        assert!(status.success());
        let mut with_env = spec(&["printenv", "VK_PROCESS_TEST", "HOME"]);
        with_env.env = vec![("VK_PROCESS_TEST".into(), "set".into())];
        let home = std::env::var("HOME").unwrap_or_default();
        assert_eq!(run(&with_env).0, format!("set\n{home}\n"), "added to ours");
        assert_eq!(run(&spec(&["false"])).1.code(), Some(1));
    }

    #[test]
    fn stdin_is_a_pipe_when_asked_and_dev_null_otherwise() {
        let mut cat = spec(&["cat"]);
        cat.stdin = Stdio::Piped;
        let mut child = spawn(&cat).unwrap();
        child.stdin.take().unwrap().write_all(b"hello").unwrap();
        let mut out = String::new();
        child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        assert_eq!(out, "hello");
        assert!(child.wait().unwrap().success());
        assert_eq!(run(&spec(&["cat"])).0, "", "stdin /dev/null");
    }

    #[test]
    fn a_program_that_cannot_run_is_a_spawn_error() {
        let err = spawn(&spec(&["/nonexistent/program"])).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
        let err = spawn(&spec(&["vk-no-such-program-anywhere"])).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
        // Found but not executable: the exec in the child fails, and says why.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("not-a-program");
        std::fs::write(&file, "data").unwrap();
        let err = spawn(&spec(&[&file.to_string_lossy()])).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{err}");
        let err = spawn(&spec(&["echo", "nul\0byte"])).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
    }

    /// The hex mask of one `Sig*` line of /proc/<pid>/status.
    fn mask(status: &str, field: &str) -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
            .unwrap()
    }

    #[test]
    fn the_child_starts_with_no_signal_blocked_and_sigpipe_at_default() {
        let sigpipe = 1u64 << (libc::SIGPIPE - 1);
        let mine = std::fs::read_to_string("/proc/thread-self/status").unwrap();
        assert_ne!(
            mask(&mine, "SigIgn:") & sigpipe,
            0,
            "the runtime ignores SIGPIPE"
        );
        // A spawning thread with a signal blocked, as the daemon's threads may have.
        let (out, _) = std::thread::spawn(|| {
            // SAFETY: blocks SIGUSR2 in this short-lived thread only; the sets are initialised.
            unsafe {
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, libc::SIGUSR2);
                libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            }
            run(&spec(&["cat", "/proc/self/status"]))
        })
        .join()
        .unwrap();
        assert_eq!(mask(&out, "SigBlk:"), 0, "{out}");
        assert_eq!(mask(&out, "SigIgn:") & sigpipe, 0, "{out}");
    }

    /// Field `n` of a /proc/<pid>/stat line, counting from the state after the command name
    /// (0: state, 2: process group, 16: nice).
    fn stat_field(stat: &str, n: usize) -> i64 {
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        after.split(' ').nth(n).unwrap().parse().unwrap()
    }

    const PGRP: usize = 2;
    const NICE: usize = 16;

    fn own_stat(field: usize) -> i64 {
        stat_field(
            &std::fs::read_to_string("/proc/thread-self/stat").unwrap(),
            field,
        )
    }

    #[test]
    fn a_child_gets_its_own_process_group_only_when_asked() {
        let mut own = spec(&["cat", "/proc/self/stat"]);
        assert_eq!(stat_field(&run(&own).0, PGRP), own_stat(PGRP));
        own.own_group = true;
        let (stat, _) = run(&own);
        let pid: i64 = stat.split(' ').next().unwrap().parse().unwrap();
        assert_eq!(stat_field(&stat, PGRP), pid);
    }

    #[test]
    fn a_nice_value_applies_to_the_child_only() {
        let ours = own_stat(NICE);
        let mut lower = spec(&["cat", "/proc/self/stat"]);
        // Raising the value (lowering the priority) needs no privilege.
        lower.nice = Some(ours as i32 + 3);
        assert_eq!(stat_field(&run(&lower).0, NICE), ours + 3);
        assert_eq!(own_stat(NICE), ours, "the spawning thread keeps its own");
        assert_eq!(
            stat_field(&run(&spec(&["cat", "/proc/self/stat"])).0, NICE),
            ours
        );
    }

    #[test]
    fn kill_and_try_wait_follow_the_child_and_never_signal_a_reaped_pid() {
        let mut child = spawn(&ProcessSpec::new(vec!["sleep".into(), "30".into()])).unwrap();
        assert!(child.try_wait().unwrap().is_none());
        child.kill().unwrap();
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        assert_eq!(child.try_wait().unwrap(), Some(status));
        child.kill().unwrap();
    }

    /// The state letter of /proc/<pid>/stat, None once the pid is gone.
    fn state(pid: u32) -> Option<char> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        stat[stat.rfind(')')? + 2..].chars().next()
    }

    #[test]
    fn a_child_dies_with_the_thread_that_spawned_it() {
        let pid = std::thread::spawn(|| {
            let child = spawn(&ProcessSpec::new(vec!["sleep".into(), "30".into()])).unwrap();
            child.id()
        })
        .join()
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        // Killed and not reaped (its handle was dropped): a zombie, or gone.
        while !matches!(state(pid), Some('Z') | None) {
            assert!(
                Instant::now() < deadline,
                "{pid} outlived its spawning thread"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = rustix::process::waitpid(Pid::from_raw(pid as i32), WaitOptions::empty());
    }
}
