//! Shared facts of local snapshots and images: a successful `snapshot inspect` or `image
//! inspect` answer that later creates of the same image reuse instead of asking cocoon again.
//!
//! The invalidation rule: an answer stands only while nothing that may change its subject has
//! happened since the read was issued. Every change the core orders drops it twice, when the
//! change is issued and when it answers (so a read that ran beside it is not kept):
//! - a local snapshot (by name) changes with `snapshot rm`, `snapshot save`, a registry pull
//!   (`PullSnapshot`, the re-push of a tag reaches the node only through one) and a peer restore
//!   into that name;
//! - the image store changes with `image pull` and an image materialisation (image reads are by
//!   digest and changes by reference, so one change drops every image answer).
//!
//! While such a change is in flight its subject is not answered from here either. A failed
//! clone drops everything (`forget_all`): the snapshot or image it named may have been removed
//! behind the daemon's back. Such outside changes (an operator's own `cocoon snapshot rm`,
//! `image rm` or import) are otherwise bounded by [`FACTS_TTL`]. Only successes are kept: an
//! absent snapshot leads to a pull, which is itself a change.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::super::{Effect, Input, OpId};
use crate::vm::{Answer, CocoonCmd};

/// How long a shared answer stands at most (a bound on changes made behind the daemon's back).
pub(super) const FACTS_TTL: Duration = Duration::from_secs(30);

/// What a shared read is about, and what a change touches.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Subject {
    /// A local snapshot, by name.
    Snapshot(String),
    /// The image store.
    Images,
}

/// A kept answer and what it is about.
#[derive(Debug, Clone)]
struct Fact {
    subject: Subject,
    read_at: Instant,
    answer: Answer,
}

/// The shared answers, the reads that may become one, and the changes in flight.
#[derive(Debug, Default)]
pub(super) struct ReadFacts {
    answers: BTreeMap<Vec<String>, Fact>,
    /// Reads in flight by argv: their subject and when they were issued. A change of the
    /// subject removes the entry, so the answer is not kept.
    reading: BTreeMap<Vec<String>, (Subject, Instant)>,
    /// Changes issued and not answered yet, by op.
    changing: BTreeMap<OpId, Subject>,
}

/// The subject of a read whose answer may be shared (none for other calls).
pub(super) fn read_subject(cmd: &CocoonCmd) -> Option<Subject> {
    match cmd {
        CocoonCmd::SnapshotInspect { name } => Some(Subject::Snapshot(name.clone())),
        CocoonCmd::ImageInspect { .. } => Some(Subject::Images),
        _ => None,
    }
}

/// What an effect the core issues may change (with its op, to know when it answered).
fn change_of(effect: &Effect) -> Option<(OpId, Subject)> {
    let snapshot = |op: &OpId, name: &String| Some((*op, Subject::Snapshot(name.clone())));
    match effect {
        Effect::Cocoon { op, cmd } => match cmd {
            CocoonCmd::SnapshotRm { name } | CocoonCmd::SnapshotSave { name, .. } => {
                snapshot(op, name)
            }
            CocoonCmd::ImagePull { .. } => Some((*op, Subject::Images)),
            _ => None,
        },
        Effect::PullSnapshot { op, local_name, .. }
        | Effect::PeerRestore { op, local_name, .. } => snapshot(op, local_name),
        Effect::MaterialiseImage { op, .. } => Some((*op, Subject::Images)),
        _ => None,
    }
}

/// The op an input answers, for the inputs a change is answered by.
fn answered_op(input: &Input) -> Option<OpId> {
    match input {
        Input::CocoonDone { op, .. } | Input::TransferDone { op, .. } => Some(*op),
        _ => None,
    }
}

impl ReadFacts {
    /// A kept answer to `cmd`, when one stands at `now`; `issuing` are the effects the input
    /// being handled issued so far (a change among them counts already).
    pub(super) fn answer(
        &mut self,
        cmd: &CocoonCmd,
        now: Instant,
        issuing: &[Effect],
    ) -> Option<Answer> {
        let subject = read_subject(cmd)?;
        let changed_now = issuing
            .iter()
            .filter_map(change_of)
            .any(|(_, s)| s == subject);
        if changed_now || self.in_flux(&subject) {
            return None;
        }
        self.answers
            .get(&cmd.argv())
            .filter(|f| now.saturating_duration_since(f.read_at) < FACTS_TTL)
            .map(|f| f.answer.clone())
    }

    /// A shareable read was issued at `now`.
    pub(super) fn read_issued(&mut self, cmd: &CocoonCmd, now: Instant) {
        let Some(subject) = read_subject(cmd) else {
            return;
        };
        if !self.in_flux(&subject) {
            self.reading.insert(cmd.argv(), (subject, now));
        }
    }

    /// A shareable read answered: kept when it succeeded and nothing changed its subject since
    /// it was issued.
    pub(super) fn read_answered(&mut self, argv: &[String], answer: &Answer) {
        let Some((subject, read_at)) = self.reading.remove(argv) else {
            return;
        };
        if answer.succeeded() && !self.in_flux(&subject) {
            let fact = Fact {
                subject,
                read_at,
                answer: answer.clone(),
            };
            self.answers.insert(argv.to_vec(), fact);
        }
    }

    /// Before an input is handled at `now`: answers past their age go, and a change the input
    /// answers drops its subject's answers again.
    pub(super) fn note_input(&mut self, input: &Input, now: Instant) {
        self.answers
            .retain(|_, f| now.saturating_duration_since(f.read_at) < FACTS_TTL);
        if let Some(subject) = answered_op(input).and_then(|op| self.changing.remove(&op)) {
            self.forget(&subject);
        }
    }

    /// After an input is handled: the changes among the effects it issued drop their
    /// subjects' answers and keep them unanswered until they answer.
    pub(super) fn note_effects(&mut self, effects: &[Effect]) {
        for (op, subject) in effects.iter().filter_map(change_of) {
            self.forget(&subject);
            self.changing.insert(op, subject);
        }
    }

    /// A clone failed: whatever it relied on may be gone.
    pub(super) fn forget_all(&mut self) {
        self.answers.clear();
        self.reading.clear();
    }

    /// How many answers and reads are held (the provider's table sizes).
    pub(super) fn len(&self) -> usize {
        self.answers.len() + self.reading.len() + self.changing.len()
    }

    fn forget(&mut self, subject: &Subject) {
        self.answers.retain(|_, f| f.subject != *subject);
        self.reading.retain(|_, (s, _)| s != subject);
    }

    fn in_flux(&self, subject: &Subject) -> bool {
        self.changing.values().any(|s| s == subject)
    }
}
