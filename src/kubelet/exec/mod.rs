//! Kubelet API `/exec` and `/attach`: options, the `cocoon vm exec` argv, protocol negotiation
//! (SPDY/3.1 or WebSocket channel.k8s.io), the exit-status message, and the session wrapper.
//!
//! Pure byte-level protocol state machines; the server owns sockets and children.

pub mod spdy;
pub mod websocket;

use serde_json::json;

use super::routes::{parse_bool, OptionError, Request};

/// The remote-command protocol versions, best first.
pub const SPDY_VERSIONS: [&str; 5] = [
    "v5.channel.k8s.io",
    "v4.channel.k8s.io",
    "v3.channel.k8s.io",
    "v2.channel.k8s.io",
    "channel.k8s.io",
];
/// WebSocket subprotocols we accept, best first.
pub const WS_PROTOCOLS: [&str; 5] = [
    "v5.channel.k8s.io",
    "v4.channel.k8s.io",
    "v4.base64.channel.k8s.io",
    "channel.k8s.io",
    "base64.channel.k8s.io",
];

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExecOptions {
    pub command: Vec<String>,
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
    pub tty: bool,
}

/// Parses `command`, `input`, `output`, `error`, `tty`. Errors are 400 texts.
pub fn parse_options(req: &Request, attach: bool) -> Result<ExecOptions, OptionError> {
    let flag = |n: &str| -> Result<bool, OptionError> {
        match req.query_value(n) {
            None => Ok(false),
            Some(v) => parse_bool(v).ok_or_else(|| OptionError::Invalid {
                name: n.to_string(),
                value: v.to_string(),
                expected: None,
            }),
        }
    };
    let o = ExecOptions {
        command: req
            .query_values("command")
            .into_iter()
            .map(str::to_string)
            .collect(),
        stdin: flag("input")? || flag("stdin")?,
        stdout: flag("output")? || flag("stdout")?,
        stderr: flag("error")? || flag("stderr")?,
        tty: flag("tty")?,
    };
    if !o.stdin && !o.stdout && !o.stderr {
        return Err(OptionError::Refused(
            "you must specify at least 1 of stdin, stdout, stderr",
        ));
    }
    if o.tty && o.stderr {
        return Err(OptionError::Refused("tty and stderr cannot both be true"));
    }
    if !attach && o.command.is_empty() {
        return Err(OptionError::Refused("you must specify a command"));
    }
    Ok(o)
}

/// `cocoon vm exec [-i] <id> -- <argv>` (cocoon's CLI contract), built by the vm room's argv
/// builder.
pub fn exec_argv(cocoon_bin: &str, vm_id: &str, o: &ExecOptions) -> Vec<String> {
    let mut a = vec![cocoon_bin.to_string()];
    a.extend(crate::vm::argv::vm_exec(&crate::vm::ExecOptions {
        vm: vm_id.to_string(),
        interactive: o.stdin,
        env: Vec::new(),
        command: o.command.clone(),
    }));
    a
}

/// How the child ended, as the exec protocol reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExecOutcome {
    Exited(i32),
    Failed(String),
}

/// The v4/v5 error-channel message: a metav1.Status.
pub fn status_json(outcome: &ExecOutcome, attach: bool) -> String {
    match outcome {
        ExecOutcome::Exited(0) => json!({"metadata":{},"status":"Success"}).to_string(),
        ExecOutcome::Exited(code) => json!({
            "metadata": {},
            "status": "Failure",
            "message": format!("command terminated with non-zero exit code: error executing command [{}], exit code {code}", if attach { "attach" } else { "exec" }),
            "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]}
        })
        .to_string(),
        ExecOutcome::Failed(e) => json!({
            "metadata": {},
            "status": "Failure",
            "message": format!("Internal error occurred: {}: {e}", if attach { "error attaching to container" } else { "error executing command in container" }),
            "reason": "InternalError",
            "code": 500
        })
        .to_string(),
    }
}

/// The v1–v3 error-channel message: nothing on success, the plain text otherwise.
pub fn status_text(outcome: &ExecOutcome) -> Option<String> {
    match outcome {
        ExecOutcome::Exited(0) => None,
        ExecOutcome::Exited(code) => Some(format!(
            "command terminated with non-zero exit code: exit status {code}"
        )),
        ExecOutcome::Failed(e) => Some(e.clone()),
    }
}

/// Which transport an upgrade request asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Upgrade {
    Spdy { version: String },
    WebSocket { protocol: String, accept: String },
}

/// Negotiates the transport and version. Errors carry the HTTP status and text.
pub fn negotiate(req: &Request) -> Result<Upgrade, (u16, String)> {
    let upgrade = req.header("upgrade").unwrap_or("").to_ascii_lowercase();
    if upgrade == "websocket" {
        let key = req
            .header("sec-websocket-key")
            .ok_or((400, "missing Sec-WebSocket-Key".to_string()))?;
        let offered = req.header_list("sec-websocket-protocol");
        let protocol = WS_PROTOCOLS
            .iter()
            .find(|p| offered.iter().any(|o| o == *p))
            .ok_or_else(|| (400, format!("unable to upgrade: unsupported WebSocket subprotocol(s) {offered:?}; server supports {WS_PROTOCOLS:?}")))?;
        return Ok(Upgrade::WebSocket {
            protocol: protocol.to_string(),
            accept: websocket::accept_key(key),
        });
    }
    if upgrade.starts_with("spdy/3.1") {
        let offered = req.header_list("x-stream-protocol-version");
        if offered.is_empty() {
            return Err((
                400,
                "unable to upgrade: X-Stream-Protocol-Version is required".into(),
            ));
        }
        // The first client entry that we support (as the real kubelet picks).
        let version = offered
            .iter()
            .find(|o| SPDY_VERSIONS.contains(&o.as_str()))
            .ok_or_else(|| (403, format!("unable to upgrade: unable to negotiate protocol: client supports {offered:?}, server supports {SPDY_VERSIONS:?}")))?;
        return Ok(Upgrade::Spdy {
            version: version.clone(),
        });
    }
    Err((
        400,
        "unable to upgrade: an Upgrade: SPDY/3.1 or websocket request is required".into(),
    ))
}

/// Events a session reports from client bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SessionEvent {
    /// All streams the request needs exist: start the command.
    Ready,
    Stdin(Vec<u8>),
    StdinEof,
    /// The client went away or sent a close.
    Closed,
    /// The client broke the protocol; the connection is to be closed.
    ProtocolError(String),
}

/// One upgraded exec/attach connection.
pub enum Session {
    Ws(websocket::WsSession),
    Spdy(Box<spdy::SpdySession>),
}

impl Session {
    /// Feeds client bytes; appends reply bytes to `out` and events to `ev`.
    pub fn feed(&mut self, data: &[u8], out: &mut Vec<u8>, ev: &mut Vec<SessionEvent>) {
        match self {
            Session::Ws(s) => s.feed(data, out, ev),
            Session::Spdy(s) => s.feed(data, out, ev),
        }
    }
    pub fn stdout(&mut self, data: &[u8], out: &mut Vec<u8>) {
        match self {
            Session::Ws(s) => s.send(1, data, out),
            Session::Spdy(s) => s.send_stdout(data, out),
        }
    }
    pub fn stderr(&mut self, data: &[u8], out: &mut Vec<u8>) {
        match self {
            Session::Ws(s) => s.send(2, data, out),
            Session::Spdy(s) => s.send_stderr(data, out),
        }
    }
    /// The child has consumed `total` stdin bytes of this session so far: SPDY grants that
    /// much receive window back (WebSocket has no windows; its reading simply pauses).
    pub fn stdin_consumed(&mut self, total: u64, out: &mut Vec<u8>) {
        if let Session::Spdy(s) = self {
            s.stdin_consumed(total, out);
        }
    }
    /// Output held back by flow control (SPDY windows); WebSocket holds nothing.
    pub fn pending_output(&self) -> usize {
        match self {
            Session::Ws(_) => 0,
            Session::Spdy(s) => s.pending_output(),
        }
    }
    /// True once everything, the exit status included, has been handed to the connection.
    pub fn done(&self) -> bool {
        match self {
            Session::Ws(_) => true,
            Session::Spdy(s) => s.done(),
        }
    }
    /// Writes the exit status on the error channel and closes the session.
    pub fn finish(&mut self, outcome: &ExecOutcome, attach: bool, out: &mut Vec<u8>) {
        let msg = if self.json_status() {
            Some(status_json(outcome, attach))
        } else {
            status_text(outcome)
        };
        match self {
            Session::Ws(s) => s.finish(msg.as_deref(), out),
            Session::Spdy(s) => s.finish(msg.as_deref(), out),
        }
    }
    fn json_status(&self) -> bool {
        let v = match self {
            Session::Ws(s) => s.protocol(),
            Session::Spdy(s) => s.version(),
        };
        v.starts_with("v4.") || v.starts_with("v5.")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubelet::routes::parse_head;

    fn req(head: &str) -> Request {
        parse_head(head.as_bytes()).unwrap().unwrap().0
    }

    #[test]
    fn options_argv_and_status() {
        let r = req("POST /exec/a/b/agent?command=sh&command=-c&command=exit+3&input=1&output=1&error=1 HTTP/1.1\r\n\r\n");
        let o = parse_options(&r, false).unwrap();
        assert_eq!(
            exec_argv("/c", "vm1", &o),
            vec!["/c", "vm", "exec", "-i", "--", "vm1", "--", "sh", "-c", "exit 3"]
        );
        assert!(parse_options(&req("POST /exec/a/b/c?command=x HTTP/1.1\r\n\r\n"), false).is_err());
        assert!(parse_options(
            &req("POST /exec/a/b/c?output=1&error=1&tty=1&command=x HTTP/1.1\r\n\r\n"),
            false
        )
        .is_err());
        let s: serde_json::Value =
            serde_json::from_str(&status_json(&ExecOutcome::Exited(3), false)).unwrap();
        assert_eq!(s["reason"], "NonZeroExitCode");
        assert_eq!(s["details"]["causes"][0]["message"], "3");
        let ok: serde_json::Value =
            serde_json::from_str(&status_json(&ExecOutcome::Exited(0), false)).unwrap();
        assert_eq!(ok["status"], "Success");
    }

    #[test]
    fn negotiation() {
        let r = req("POST /exec/a/b/c HTTP/1.1\r\nUpgrade: SPDY/3.1\r\nConnection: Upgrade\r\nX-Stream-Protocol-Version: v9.channel.k8s.io\r\nX-Stream-Protocol-Version: v4.channel.k8s.io,v3.channel.k8s.io\r\n\r\n");
        assert_eq!(
            negotiate(&r),
            Ok(Upgrade::Spdy {
                version: "v4.channel.k8s.io".into()
            })
        );
        let r = req("POST /exec/a/b/c HTTP/1.1\r\nUpgrade: SPDY/3.1\r\n\r\n");
        assert_eq!(negotiate(&r).unwrap_err().0, 400);
        let r = req("POST /exec/a/b/c HTTP/1.1\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: v9.channel.k8s.io\r\n\r\n");
        assert_eq!(negotiate(&r).unwrap_err().0, 403);
        let r = req("GET /exec/a/b/c HTTP/1.1\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Protocol: v4.channel.k8s.io\r\n\r\n");
        assert_eq!(
            negotiate(&r),
            Ok(Upgrade::WebSocket {
                protocol: "v4.channel.k8s.io".into(),
                accept: "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=".into()
            })
        );
        assert_eq!(
            negotiate(&req("GET /exec/a/b/c HTTP/1.1\r\n\r\n"))
                .unwrap_err()
                .0,
            400
        );
    }
}
