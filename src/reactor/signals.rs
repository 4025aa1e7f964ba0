//! Signals of the reactor: watched signals and the SIGCHLD fallback arrive through self-pipes
//! (signal-hook writes a byte from the handler), registered under internal tokens.
//!
//! A watched signal is reported as `Event::Signal` once per wake-up however often it came;
//! SIGCHLD (only used when pidfds are unavailable) triggers a sweep of the children instead.

use std::io::{self, Read};

use mio::{Interest, Token};
use signal_hook::SigId;

use super::{Event, Internal, Reactor};

/// One signal's self-pipe: the handler registration and the end the loop reads.
pub(super) struct SignalPipe {
    sig_id: SigId,
    token: Token,
    reader: mio::net::UnixStream,
}

impl<M: Send + 'static> Reactor<M> {
    /// From now on the given signals are caught and reported as `Event::Signal(n)`
    /// (several deliveries between two wake-ups count once).
    pub fn watch_signals(&mut self, signals: &[i32]) -> io::Result<()> {
        for &sig in signals {
            let pipe = self.signal_pipe(sig, Internal::Signal(sig))?;
            self.signals.push(pipe);
        }
        Ok(())
    }

    /// A self-pipe for `sig`, its reader registered under a fresh internal token for `what`.
    fn signal_pipe(&mut self, sig: i32, what: Internal) -> io::Result<SignalPipe> {
        let (reader, writer) = std::os::unix::net::UnixStream::pair()?;
        reader.set_nonblocking(true)?;
        writer.set_nonblocking(true)?;
        let sig_id = signal_hook::low_level::pipe::register(sig, writer)?;
        let mut reader = mio::net::UnixStream::from_std(reader);
        let token = self.internal_token(what);
        if let Err(e) = self
            .poll
            .registry()
            .register(&mut reader, token, Interest::READABLE)
        {
            signal_hook::low_level::unregister(sig_id);
            return Err(e);
        }
        Ok(SignalPipe {
            sig_id,
            token,
            reader,
        })
    }

    /// Detect child exits through SIGCHLD instead of pidfds (used automatically
    /// when the kernel lacks pidfd_open; public so tests can exercise it).
    #[doc(hidden)]
    pub fn use_sigchld_for_exits(&mut self) -> io::Result<()> {
        if self.sigchld.is_none() {
            let pipe = self.signal_pipe(libc::SIGCHLD, Internal::SigChld)?;
            self.sigchld = Some(pipe);
            self.sweep_exits = true;
        }
        Ok(())
    }

    /// A watched signal's pipe turned readable: reported once, however many bytes wait.
    pub(super) fn signal_ready(&mut self, token: Token, sig: i32, out: &mut Vec<Event<M>>) {
        let pipe = self.signals.iter_mut().find(|p| p.token == token);
        if pipe.is_some_and(|p| drain_stream(&mut p.reader)) {
            out.push(Event::Signal(sig));
        }
    }

    /// SIGCHLD arrived (the fallback without pidfds): sweep the children for exits.
    pub(super) fn sigchld_ready(&mut self, out: &mut Vec<Event<M>>) {
        if let Some(p) = self.sigchld.as_mut() {
            drain_stream(&mut p.reader);
        }
        self.sweep_children(out);
    }

    /// Removes the signal handlers (on drop), leaving the process's default behaviour.
    pub(super) fn unregister_signals(&mut self) {
        for p in self.signals.drain(..).chain(self.sigchld.take()) {
            signal_hook::low_level::unregister(p.sig_id);
        }
    }
}

fn drain_stream(reader: &mut mio::net::UnixStream) -> bool {
    let mut buf = [0u8; 64];
    let mut any = false;
    loop {
        match reader.read(&mut buf) {
            Ok(0) => return any,
            Ok(_) => any = true,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return any,
        }
    }
}
