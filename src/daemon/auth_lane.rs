//! The kubelet API's review lane: TokenReview / SubjectAccessReview calls on two threads of
//! their own, a short queue and a rate budget, so callers can neither starve lifecycle work.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::Work;
use crate::kubelet::{AuthAnswer, AuthId, AuthRequest};
use crate::reactor::Notifier;

/// The blocking review call (the daemon's is `effects::authorize` against the API server).
pub(super) type Review = dyn Fn(&AuthRequest) -> AuthAnswer + Send + Sync;

/// Review threads: enough for a legitimate caller's cache misses, few enough that a flood
/// holds at most this many API calls open.
const LANE_THREADS: usize = 2;
/// Reviews waiting for a thread; beyond it the caller gets 429.
const LANE_QUEUE: usize = 16;
/// Reviews started per second in the long run, and the burst above it. Answers are cached
/// (accepted tokens 2 min), so legitimate callers rarely need one; a flood of fresh tokens
/// costs the API server at most this rate (two calls each) out of the client's shared budget.
const REVIEWS_PER_SEC: f64 = 5.0;
const REVIEW_BURST: f64 = 10.0;

struct LaneJob {
    id: AuthId,
    req: AuthRequest,
    cancelled: Arc<AtomicBool>,
}

pub(super) struct AuthLane {
    sender: SyncSender<LaneJob>,
    /// Cancel flags of queued or running reviews.
    flags: HashMap<AuthId, Arc<AtomicBool>>,
    tokens: f64,
    refilled: Instant,
}

impl AuthLane {
    pub(super) fn new(
        review: Arc<Review>,
        notifier: Notifier<Work>,
        now: Instant,
    ) -> std::io::Result<AuthLane> {
        let (sender, receiver) = sync_channel::<LaneJob>(LANE_QUEUE);
        let receiver = Arc::new(Mutex::new(receiver));
        for n in 0..LANE_THREADS {
            let (review, notifier, receiver) = (review.clone(), notifier.clone(), receiver.clone());
            std::thread::Builder::new()
                .name(format!("auth-review-{n}"))
                .spawn(move || review_worker(&*review, &notifier, &receiver))?;
        }
        Ok(AuthLane {
            sender,
            flags: HashMap::new(),
            tokens: REVIEW_BURST,
            refilled: now,
        })
    }

    /// Queues a review; Err is the answer to give at once (over budget, or the lane is gone).
    pub(super) fn submit(
        &mut self,
        id: AuthId,
        req: AuthRequest,
        now: Instant,
    ) -> Result<(), AuthAnswer> {
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.tokens = (self.tokens + elapsed * REVIEWS_PER_SEC).min(REVIEW_BURST);
        self.refilled = now;
        if self.tokens < 1.0 {
            return Err(AuthAnswer::Busy);
        }
        let cancelled = Arc::new(AtomicBool::new(false));
        let job = LaneJob {
            id,
            req,
            cancelled: cancelled.clone(),
        };
        match self.sender.try_send(job) {
            Ok(()) => {
                self.tokens -= 1.0;
                self.flags.insert(id, cancelled);
                Ok(())
            }
            Err(TrySendError::Full(_)) => Err(AuthAnswer::Busy),
            Err(TrySendError::Disconnected(_)) => {
                Err(AuthAnswer::Error("authorisation lane stopped".into()))
            }
        }
    }

    /// The client left: a review not started yet is dropped unrun.
    pub(super) fn cancel(&mut self, id: AuthId) {
        if let Some(flag) = self.flags.remove(&id) {
            flag.store(true, Ordering::Relaxed);
        }
    }

    /// A review answered.
    pub(super) fn done(&mut self, id: AuthId) {
        self.flags.remove(&id);
    }
}

fn review_worker(review: &Review, notifier: &Notifier<Work>, receiver: &Mutex<Receiver<LaneJob>>) {
    loop {
        let job = {
            let rx = receiver.lock().unwrap_or_else(|p| p.into_inner());
            match rx.recv() {
                Ok(job) => job,
                // The daemon dropped the lane: it is shutting down.
                Err(_) => return,
            }
        };
        if job.cancelled.load(Ordering::Relaxed) {
            continue;
        }
        let answer = review(&job.req);
        notifier.post(Work::KubeletAuth { id: job.id, answer });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubelet::ResourceAttributes;
    use crate::reactor::{Event, Reactor};
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    fn req(token: &str) -> AuthRequest {
        AuthRequest {
            token: Some(token.into()),
            user: None,
            attributes: ResourceAttributes {
                verb: "get".into(),
                subresource: "proxy".into(),
                node_name: "n".into(),
            },
        }
    }

    /// Answers posted to the loop until `n` arrived or `wait` passed.
    fn answers(r: &mut Reactor<Work>, n: usize, wait: Duration) -> Vec<AuthId> {
        let mut got = Vec::new();
        let timer = r.timer_at(r.now() + wait, 1);
        let mut out = Vec::new();
        loop {
            out.clear();
            r.poll(&mut out).unwrap();
            for e in out.drain(..) {
                match e {
                    Event::Work(Work::KubeletAuth { id, .. }) => got.push(id),
                    Event::Timer { .. } => return got,
                    _ => {}
                }
            }
            if got.len() >= n {
                r.cancel_timer(timer);
                return got;
            }
        }
    }

    #[test]
    fn a_flood_is_turned_away_by_the_queue_and_the_rate_and_cancelled_reviews_never_run() {
        let mut r: Reactor<Work> = Reactor::new(0, 0).unwrap();
        let gate = Arc::new(Mutex::new(()));
        let ran = Arc::new(AtomicUsize::new(0));
        let held = gate.lock().unwrap();
        let (g, n) = (gate.clone(), ran.clone());
        let review: Arc<Review> = Arc::new(move |_: &AuthRequest| {
            drop(g.lock().unwrap_or_else(|p| p.into_inner()));
            n.fetch_add(1, Ordering::SeqCst);
            AuthAnswer::Unauthenticated
        });
        let t0 = Instant::now();
        let mut lane = AuthLane::new(review, r.notifier(), t0).unwrap();
        // The burst is the rate budget: ten accepted, the rest answered Busy at once.
        let verdicts: Vec<bool> = (0..30)
            .map(|i| lane.submit(AuthId(i), req("x"), t0).is_ok())
            .collect();
        assert_eq!(verdicts.iter().filter(|ok| **ok).count(), 10);
        assert_eq!(lane.submit(AuthId(99), req("x"), t0), Err(AuthAnswer::Busy));
        // The budget refills with time.
        assert!(lane
            .submit(AuthId(100), req("x"), t0 + Duration::from_secs(1))
            .is_ok());
        // Clients of 2..=100 leave: at most the two already taken by a thread still run.
        for i in (2..10).chain([100]) {
            lane.cancel(AuthId(i));
        }
        drop(held);
        let mut got = answers(&mut r, 2, Duration::from_secs(10));
        got.sort_by_key(|id| id.0);
        assert_eq!(got, vec![AuthId(0), AuthId(1)]);
        // Nothing more arrives: the cancelled ones were dropped unrun.
        assert!(answers(&mut r, 1, Duration::from_millis(300)).is_empty());
        assert_eq!(ran.load(Ordering::SeqCst), 2);
    }
}
