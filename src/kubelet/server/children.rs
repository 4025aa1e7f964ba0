//! The kubelet server's children: `vm logs` and `vm exec` cocoon processes started for a request,
//! their output streamed to the connection (logs as a chunked body, exec through its session).

use mio::Token;

use super::conn::Phase;
use super::KubeletServer;
use crate::kubelet::exec::spdy::{Expected, SpdySession};
use crate::kubelet::exec::websocket::{handshake_response, WsSession};
use crate::kubelet::exec::{self, ExecOutcome, Session, Upgrade};
use crate::kubelet::logs::{self, LogShaper};
use crate::kubelet::routes::{self, Request};
use crate::reactor::{ChildExit, ChildId, ChildSpec, OutputMode, Reactor, StdinMode, Stream};

/// Stderr of a logs child kept for the error message.
const STDERR_KEEP: usize = 4096;
/// `kubectl attach` shows the VM console: the last lines of the log, then new ones.
pub const ATTACH_TAIL_LINES: u64 = 50;

impl KubeletServer {
    pub fn on_child_output<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        id: ChildId,
        stream: Stream,
        data: &[u8],
    ) {
        let Some(&token) = self.children.get(&id) else {
            return;
        };
        let idle = self.cfg.stream_idle_timeout;
        let limit = self.cfg.max_buffered_output;
        let now = r.now();
        let mut kill = false;
        if let Some(c) = self.conns.get_mut(&token) {
            match &mut c.phase {
                Phase::Logs {
                    shaper,
                    head_sent,
                    stderr,
                    ..
                } => match stream {
                    Stream::Stderr => {
                        stderr.extend_from_slice(data);
                        if stderr.len() > STDERR_KEEP {
                            let cut = stderr.len() - STDERR_KEEP;
                            stderr.drain(..cut);
                        }
                    }
                    Stream::Stdout => {
                        let body = shaper.shape(data, crate::wall_clock::now());
                        if !*head_sent {
                            c.out.extend_from_slice(
                                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\nTransfer-Encoding: chunked\r\nX-Content-Type-Options: nosniff\r\nConnection: close\r\n\r\n",
                            );
                            *head_sent = true;
                        }
                        routes::chunk(&body, &mut c.out);
                        if shaper.exhausted() {
                            c.out.extend_from_slice(routes::LAST_CHUNK);
                            kill = true;
                            c.phase = Phase::Closing;
                        }
                    }
                },
                Phase::Exec { session, .. } => {
                    match stream {
                        Stream::Stdout => session.stdout(data, &mut c.out),
                        Stream::Stderr => session.stderr(data, &mut c.out),
                    }
                    c.deadline = Some(now + idle);
                }
                _ => {}
            }
            let held = match &c.phase {
                Phase::Exec { session, .. } => session.pending_output(),
                _ => 0,
            };
            if c.out.len() + held > limit {
                log::warn!(
                    "kubelet: client too slow to read its stream ({} bytes queued); closing",
                    c.out.len()
                );
                c.out.clear();
                c.phase = Phase::Closing;
                kill = true;
            }
        }
        if kill {
            self.children.remove(&id);
            r.kill(id);
        }
        self.flush(r, token);
        self.rearm(r);
    }

    pub fn on_child_exit<M: Send + 'static>(&mut self, r: &mut Reactor<M>, exit: &ChildExit) {
        let Some(token) = self.children.remove(&exit.id) else {
            return;
        };
        let outcome = match (exit.code(), exit.signal()) {
            (Some(c), _) => ExecOutcome::Exited(c),
            (None, Some(s)) => ExecOutcome::Failed(format!("command was terminated by signal {s}")),
            (None, None) => match &exit.spawn_error {
                Some(e) => ExecOutcome::Failed(format!("cannot run cocoon: {e}")),
                None => ExecOutcome::Failed("command status unknown".into()),
            },
        };
        self.child_ended(r, token, outcome);
        self.rearm(r);
    }

    pub(super) fn start_logs<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        token: Token,
        req: &Request,
        ns: &str,
        pod: &str,
        container: &str,
    ) {
        let close = req.wants_close();
        let opts = match logs::parse_options(req) {
            Ok(o) => o,
            Err(e) => {
                return self.respond(r, token, routes::text(400, &e.to_string(), false), close)
            }
        };
        let vm_id = match self.pod_for(ns, pod, container) {
            Err(resp) => return self.respond(r, token, resp, close),
            Ok(p) => match &p.vm {
                None => {
                    return self.respond(
                        r,
                        token,
                        routes::text(200, "vk-cocoon: pod has no live VM\n", false),
                        close,
                    )
                }
                Some(v) if is_macos(v) => {
                    return self.respond(r, token, macos_unsupported("logs"), close)
                }
                Some(v) => v.id.clone(),
            },
        };
        if opts.tail_lines == Some(0) && !opts.follow {
            return self.respond(r, token, routes::text(200, "", false), close);
        }
        let call = logs::logs_call(&vm_id, &opts);
        let mut spec = ChildSpec::new(self.cocoon_argv(&call.argv))
            .stdin(StdinMode::Null)
            .stdout(OutputMode::Stream)
            .stderr(OutputMode::Stream);
        // The reactor kills a read that outlives the verb's deadline; a follow has none.
        spec.deadline = call.deadline;
        let spec = self.with_env(spec);
        match r.spawn(spec) {
            Ok(id) => {
                self.children.insert(id, token);
                if let Some(c) = self.conns.get_mut(&token) {
                    c.phase = Phase::Logs {
                        child: Some(id),
                        shaper: LogShaper::new(&opts),
                        head_sent: false,
                        stderr: Vec::new(),
                    };
                    // A follow stream may be quiet for a long time.
                    c.deadline = if opts.follow {
                        None
                    } else {
                        Some(r.now() + self.cfg.stream_idle_timeout)
                    };
                }
            }
            Err(e) => self.respond(
                r,
                token,
                routes::text(500, &format!("vk-cocoon: cannot run cocoon: {e}"), true),
                true,
            ),
        }
    }

    fn with_env(&self, mut spec: ChildSpec) -> ChildSpec {
        spec.env.extend(self.cfg.cocoon_env.iter().cloned());
        spec
    }

    fn cocoon_argv(&self, args: &[String]) -> Vec<String> {
        let mut a = self.cfg.cocoon.clone();
        a.extend(args.iter().cloned());
        a
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn upgrade_exec<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        token: Token,
        req: &Request,
        ns: &str,
        pod: &str,
        container: &str,
        attach: bool,
    ) {
        let close = req.wants_close();
        let vm = match self.pod_for(ns, pod, container) {
            Err(resp) => return self.respond(r, token, resp, close),
            Ok(p) => p.vm.clone(),
        };
        let opts = match exec::parse_options(req, attach) {
            Ok(o) => o,
            Err(e) => {
                return self.respond(r, token, routes::text(400, &e.to_string(), false), close)
            }
        };
        let upgrade = match exec::negotiate(req) {
            Ok(u) => u,
            Err((code, text)) => {
                return self.respond(r, token, routes::text(code, &text, false), close)
            }
        };
        let vm_id = match vm {
            None => {
                return self.respond(
                    r,
                    token,
                    routes::text(500, "vk-cocoon: pod has no live VM", false),
                    close,
                )
            }
            Some(v) if is_macos(&v) => {
                let what = if attach { "attach" } else { "exec" };
                return self.respond(r, token, macos_unsupported(what), close);
            }
            Some(v) => v.id,
        };
        let argv = if attach {
            let o = logs::LogOptions {
                tail_lines: Some(ATTACH_TAIL_LINES),
                follow: true,
                ..Default::default()
            };
            self.cocoon_argv(&logs::logs_call(&vm_id, &o).argv)
        } else {
            self.cocoon_argv(&exec::exec_argv("", &vm_id, &opts)[1..])
        };
        let now = r.now();
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        let (session, ready) = match upgrade {
            Upgrade::WebSocket { protocol, accept } => {
                c.out
                    .extend_from_slice(&handshake_response(&accept, &protocol));
                let s = WsSession::new(&protocol, opts.stdout, opts.stderr, opts.stdin, &mut c.out);
                (Session::Ws(s), true)
            }
            Upgrade::Spdy { version } => {
                c.out
                    .extend_from_slice(&SpdySession::handshake_response(&version));
                let resize =
                    opts.tty && version != "channel.k8s.io" && version != "v2.channel.k8s.io";
                let expected = Expected {
                    stdin: opts.stdin,
                    stdout: opts.stdout,
                    stderr: opts.stderr,
                    resize,
                };
                (
                    Session::Spdy(Box::new(SpdySession::new(&version, expected))),
                    false,
                )
            }
        };
        c.keep_alive = false;
        c.phase = Phase::Exec {
            session: Box::new(session),
            child: None,
            argv,
            stdin: opts.stdin && !attach,
            attach,
            stdin_buf: Vec::new(),
            stdin_eof: false,
            stdin_handed: 0,
            ended: false,
        };
        c.deadline = Some(
            now + if ready {
                self.cfg.stream_idle_timeout
            } else {
                self.cfg.stream_setup_timeout
            },
        );
        // Bytes the client pipelined after the upgrade request belong to the session.
        let rest = std::mem::take(&mut c.inbuf);
        if ready {
            self.start_exec(r, token);
        }
        if !rest.is_empty() {
            self.input(r, token, &rest);
        }
        self.flush(r, token);
    }

    pub(super) fn start_exec<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        let idle = self.cfg.stream_idle_timeout;
        let env = self.cfg.cocoon_env.clone();
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        let Phase::Exec {
            child,
            argv,
            stdin,
            stdin_buf,
            stdin_eof,
            attach,
            session,
            ended,
            ..
        } = &mut c.phase
        else {
            return;
        };
        if child.is_some() || *ended {
            return;
        }
        let spec = ChildSpec::new(argv.clone())
            .stdin(if *stdin {
                StdinMode::Pipe
            } else {
                StdinMode::Null
            })
            .stdout(OutputMode::Stream)
            .stderr(OutputMode::Stream);
        let mut spec = spec;
        spec.env.extend(env);
        match r.spawn(spec) {
            Ok(id) => {
                *child = Some(id);
                self.children.insert(id, token);
                if *stdin {
                    for d in stdin_buf.drain(..) {
                        let _ = r.write_stdin(id, &d);
                    }
                    if *stdin_eof {
                        r.close_stdin(id);
                    }
                }
                c.deadline = Some(r.now() + idle);
            }
            Err(e) => {
                session.finish(
                    &ExecOutcome::Failed(format!("cannot run cocoon: {e}")),
                    *attach,
                    &mut c.out,
                );
                c.phase = Phase::Closing;
                self.flush(r, token);
            }
        }
    }

    fn child_ended<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        token: Token,
        outcome: ExecOutcome,
    ) {
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        match std::mem::replace(&mut c.phase, Phase::Closing) {
            Phase::Logs {
                head_sent, stderr, ..
            } => {
                if head_sent {
                    c.out.extend_from_slice(routes::LAST_CHUNK);
                } else if outcome == ExecOutcome::Exited(0) {
                    c.out.extend_from_slice(&routes::text(200, "", true));
                } else {
                    let msg = String::from_utf8_lossy(&stderr).trim().to_string();
                    let msg = if msg.is_empty() {
                        format!("vk-cocoon: vm logs failed: {outcome:?}")
                    } else {
                        msg
                    };
                    let code = if msg.contains("not found") { 404 } else { 500 };
                    c.out.extend_from_slice(&routes::text(code, &msg, true));
                }
            }
            Phase::Exec {
                mut session,
                attach,
                argv,
                stdin,
                ..
            } => {
                session.finish(&outcome, attach, &mut c.out);
                if !session.done() {
                    // Output waits for the peer's window: keep reading its WINDOW_UPDATEs.
                    c.phase = Phase::Exec {
                        session,
                        child: None,
                        argv,
                        stdin,
                        attach,
                        stdin_buf: Vec::new(),
                        stdin_eof: true,
                        stdin_handed: 0,
                        ended: true,
                    };
                }
            }
            other => c.phase = other,
        }
        self.flush(r, token);
    }
}

/// A macOS guest runs under cocoon-macos, which has no exec, attach or console-log command.
fn is_macos(vm: &crate::kubelet::PodVm) -> bool {
    vm.backend == crate::guest::macos::HYPERVISOR
}

/// The answer for what a macOS guest cannot do here: said plainly, with the way in that works.
fn macos_unsupported(what: &str) -> Vec<u8> {
    let text = format!(
        "vk-cocoon: {what} is not available for macOS guests (cocoon-macos has no {what}); \
         reach the guest over SSH or VNC\n"
    );
    routes::text(400, &text, false)
}
