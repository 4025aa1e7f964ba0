//! `/metrics/cadvisor` rendered off the loop: the text of a thousand VMs costs tens of
//! milliseconds, so a helper thread renders it and a pipe the loop polls hands the text back.
//!
//! A scrape whose sample was rendered already is answered at once; others wait on the
//! connection (phase `WaitRender`) for the render in flight, one render at a time. A text is
//! kept for the sample and pod facts it was made of, so scrapes within a sample share it.

use std::io::{ErrorKind, Read, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mio::unix::pipe::{self, Receiver, Sender};
use mio::{Interest, Token};

use super::conn::Phase;
use super::KubeletServer;
use crate::kubelet::routes;
use crate::metrics::cadvisor::{cadvisor_text, PodFactsMap};
use crate::metrics::stats::Sample;
use crate::reactor::Reactor;

/// How long a scrape waits for its render before it gets a 503 (the render itself takes
/// tens of milliseconds at a thousand VMs).
const RENDER_TIMEOUT: Duration = Duration::from_secs(10);

const TEXT: &str = "text/plain; version=0.0.4";

/// A rendered text and what it was made of.
#[derive(Clone)]
struct Rendered {
    sample: Arc<Sample>,
    /// The pod facts' generation (a new view makes a new one).
    facts_generation: u64,
    text: Arc<String>,
}

/// The render in flight, the text of the last one, and the scrapes that wait.
#[derive(Default)]
pub(super) struct CadvisorRender {
    /// The loop's end of the wake-up pipe and its token; the helper threads write to the other.
    wake: Option<(Receiver, Token, Arc<Sender>)>,
    /// Where a finished render leaves its text.
    done: Arc<Mutex<Option<Rendered>>>,
    /// When the render in flight started (a render lost for longer than the timeout is
    /// started again).
    started: Option<Instant>,
    last: Option<Rendered>,
    /// Connections waiting for a text, with whether each closes after its answer.
    waiting: Vec<(Token, bool)>,
}

impl CadvisorRender {
    pub(super) fn owns_token(&self, t: Token) -> bool {
        self.wake.as_ref().is_some_and(|(_, wt, _)| *wt == t)
    }

    /// A waiting connection closed.
    pub(super) fn forget(&mut self, token: Token) {
        self.waiting.retain(|(t, _)| *t != token);
    }

    /// The wake-up pipe, created and registered on the first render.
    fn wake_sender<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
    ) -> std::io::Result<Arc<Sender>> {
        if let Some((_, _, sender)) = &self.wake {
            return Ok(sender.clone());
        }
        let (sender, mut receiver) = pipe::new()?;
        let token = r.token_in(super::RANGE);
        r.registry()
            .register(&mut receiver, token, Interest::READABLE)?;
        let sender = Arc::new(sender);
        self.wake = Some((receiver, token, sender.clone()));
        Ok(sender)
    }
}

impl KubeletServer {
    /// `/metrics/cadvisor`: Some(response) now, or None when the connection waits for the
    /// render (it is answered from `on_render_done`).
    pub(super) fn cadvisor_response<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        token: Token,
        close: bool,
    ) -> Option<Vec<u8>> {
        let now = r.now();
        let sample = self.stats.sample(now);
        if let Some(last) = &self.render.last {
            if Arc::ptr_eq(&last.sample, &sample) && last.facts_generation == self.facts_generation
            {
                return Some(routes::response(200, TEXT, last.text.as_bytes(), false));
            }
        }
        let running = self
            .render
            .started
            .is_some_and(|at| now.saturating_duration_since(at) < RENDER_TIMEOUT);
        if !running {
            if let Err(e) = self.start_render(r, sample.clone()) {
                // No thread or no pipe: the loop renders this one itself.
                log::warn!("kubelet: /metrics/cadvisor rendered on the loop: {e}");
                let text = self.render_now(&sample);
                return Some(routes::response(200, TEXT, text.as_bytes(), false));
            }
        }
        let c = self.conns.get_mut(&token)?;
        c.phase = Phase::WaitRender;
        c.deadline = Some(now + RENDER_TIMEOUT);
        self.render.waiting.push((token, close));
        None
    }

    fn start_render<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        sample: Arc<Sample>,
    ) -> std::io::Result<()> {
        let sender = self.render.wake_sender(r)?;
        let facts: Arc<PodFactsMap> = self.facts.clone();
        let facts_generation = self.facts_generation;
        let parent = self.stats.paths().cgroup_parent.clone();
        let done = self.render.done.clone();
        std::thread::Builder::new()
            .name("cadvisor-render".into())
            .spawn(move || {
                let text = Arc::new(cadvisor_text(&sample, &facts, &parent));
                let rendered = Rendered {
                    sample,
                    facts_generation,
                    text,
                };
                *done.lock().unwrap_or_else(|e| e.into_inner()) = Some(rendered);
                // One byte per render into an empty pipe: it cannot be full. Should the loop be
                // gone, nobody waits for the text.
                let _ = (&*sender).write(&[1]);
            })?;
        self.render.started = Some(r.now());
        Ok(())
    }

    fn render_now(&mut self, sample: &Arc<Sample>) -> Arc<String> {
        let parent = self.stats.paths().cgroup_parent.clone();
        let text = Arc::new(cadvisor_text(sample, &self.facts, &parent));
        self.render.last = Some(Rendered {
            sample: sample.clone(),
            facts_generation: self.facts_generation,
            text: text.clone(),
        });
        text
    }

    /// The wake-up pipe is readable: a render finished; answer every scrape that waits.
    pub(super) fn on_render_done<M: Send + 'static>(&mut self, r: &mut Reactor<M>) {
        if let Some((receiver, _, _)) = &mut self.render.wake {
            let mut buf = [0u8; 64];
            loop {
                match receiver.read(&mut buf) {
                    Ok(0) => break,
                    Ok(_) => continue,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(_) => break,
                }
            }
        }
        let finished = self
            .render
            .done
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let Some(rendered) = finished else {
            return;
        };
        self.render.started = None;
        let text = rendered.text.clone();
        self.render.last = Some(rendered);
        // Waiters get this text even when a newer sample came meanwhile: it is at most one
        // sample (two seconds) older than what they asked for.
        for (token, close) in std::mem::take(&mut self.render.waiting) {
            let waits = self
                .conns
                .get(&token)
                .is_some_and(|c| matches!(c.phase, Phase::WaitRender));
            if waits {
                self.respond(
                    r,
                    token,
                    routes::response(200, TEXT, text.as_bytes(), false),
                    close,
                );
                self.after_input(r, token);
            }
        }
    }

    /// A scrape waited too long for its render.
    pub(super) fn render_timed_out<M: Send + 'static>(&mut self, r: &mut Reactor<M>, token: Token) {
        self.render.forget(token);
        self.respond(
            r,
            token,
            routes::text(503, "metrics rendering timed out", true),
            true,
        );
    }
}
