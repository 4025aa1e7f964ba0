//! The kubelet API's review lane: TokenReview / SubjectAccessReview calls on threads of their
//! own, short queues and rate budgets, so callers can neither starve lifecycle work nor each
//! other.
//!
//! Certificate callers (one SubjectAccessReview each) and bearer-token callers (a TokenReview
//! first) have separate threads, queues and budgets: anyone who can open a TLS connection can
//! send random tokens, and those must never spend the reviews the API server's own certificate
//! needs. Token reviews are also budgeted per source address (an IPv6 /64 counts as one), so a
//! flood from one address leaves the rest of the token budget to others.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes as SarAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};

use super::{Daemon, Work};
use crate::kube::Client;
use crate::kubelet::{AuthAnswer, AuthId, AuthRequest, UserInfo};
use crate::metrics::admission::PeerKey;
use crate::reactor::Notifier;

/// The blocking review call (the daemon's is `authorize` against the API server).
pub(super) type Review = dyn Fn(&AuthRequest) -> AuthAnswer + Send + Sync;

/// Review threads per class: enough for a legitimate caller's cache misses, few enough that a
/// flood holds at most this many API calls open.
const LANE_THREADS: usize = 2;
/// Reviews of one class waiting for a thread; beyond it the caller gets 429.
const LANE_QUEUE: usize = 16;
/// Reviews started per second in the long run, and the burst above it, for each class. Answers
/// are cached (accepted tokens 2 min), so legitimate callers rarely need one; a flood of fresh
/// tokens costs the API server at most this rate (two calls each) out of the client's budget.
const REVIEWS_PER_SEC: f64 = 5.0;
const REVIEW_BURST: f64 = 10.0;
/// Token reviews one address may start: a flood from it takes a fifth of the token budget.
const PEER_REVIEWS_PER_SEC: f64 = 1.0;
const PEER_REVIEW_BURST: f64 = 3.0;
/// Addresses whose token budget is tracked; a full table forgets the ones back at their burst
/// (they are as new), then all.
const PEERS_TRACKED: usize = 4096;

/// A token bucket of `rate` a second up to `burst`.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    tokens: f64,
    refilled: Instant,
    rate: f64,
    burst: f64,
}

impl Bucket {
    fn full(rate: f64, burst: f64, now: Instant) -> Bucket {
        Bucket {
            tokens: burst,
            refilled: now,
            rate,
            burst,
        }
    }

    /// Refills for the time passed; whether one review may start.
    fn ready(&mut self, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        self.refilled = now;
        self.tokens >= 1.0
    }
}

struct LaneJob {
    id: AuthId,
    req: AuthRequest,
    cancelled: Arc<AtomicBool>,
}

/// One class of callers: its queue (with its threads behind it) and its budget.
struct Class {
    sender: SyncSender<LaneJob>,
    budget: Bucket,
}

impl Class {
    fn new(
        name: &str,
        review: &Arc<Review>,
        notifier: &Notifier<Work>,
        now: Instant,
    ) -> std::io::Result<Class> {
        let (sender, receiver) = sync_channel::<LaneJob>(LANE_QUEUE);
        let receiver = Arc::new(Mutex::new(receiver));
        for n in 0..LANE_THREADS {
            let (review, notifier, receiver) = (review.clone(), notifier.clone(), receiver.clone());
            std::thread::Builder::new()
                .name(format!("auth-{name}-{n}"))
                .spawn(move || review_worker(&*review, &notifier, &receiver))?;
        }
        Ok(Class {
            sender,
            budget: Bucket::full(REVIEWS_PER_SEC, REVIEW_BURST, now),
        })
    }
}

pub(super) struct AuthLane {
    /// Callers with a verified client certificate: only the access review.
    certificates: Class,
    /// Callers with a bearer token: the token review first.
    tokens: Class,
    /// Token budget per source address.
    peers: HashMap<PeerKey, Bucket>,
    /// Cancel flags of queued or running reviews.
    flags: HashMap<AuthId, Arc<AtomicBool>>,
}

impl AuthLane {
    pub(super) fn new(
        review: Arc<Review>,
        notifier: Notifier<Work>,
        now: Instant,
    ) -> std::io::Result<AuthLane> {
        Ok(AuthLane {
            certificates: Class::new("cert", &review, &notifier, now)?,
            tokens: Class::new("token", &review, &notifier, now)?,
            peers: HashMap::new(),
            flags: HashMap::new(),
        })
    }

    /// Queues a review of a request from `peer`; Err is the answer to give at once (over a
    /// budget, a full queue, or the lane is gone).
    pub(super) fn submit(
        &mut self,
        id: AuthId,
        req: AuthRequest,
        peer: PeerKey,
        now: Instant,
    ) -> Result<(), AuthAnswer> {
        let by_token = req.user.is_none();
        if by_token {
            if self.peers.len() >= PEERS_TRACKED && !self.peers.contains_key(&peer) {
                self.peers
                    .retain(|_, b| !(b.ready(now) && b.tokens >= b.burst));
                if self.peers.len() >= PEERS_TRACKED {
                    self.peers.clear();
                }
            }
            let own = self
                .peers
                .entry(peer)
                .or_insert_with(|| Bucket::full(PEER_REVIEWS_PER_SEC, PEER_REVIEW_BURST, now));
            if !own.ready(now) {
                return Err(AuthAnswer::Busy);
            }
        }
        let class = if by_token {
            &mut self.tokens
        } else {
            &mut self.certificates
        };
        if !class.budget.ready(now) {
            return Err(AuthAnswer::Busy);
        }
        let cancelled = Arc::new(AtomicBool::new(false));
        let job = LaneJob {
            id,
            req,
            cancelled: cancelled.clone(),
        };
        match class.sender.try_send(job) {
            Ok(()) => {
                class.budget.tokens -= 1.0;
                if let Some(own) = self.peers.get_mut(&peer).filter(|_| by_token) {
                    own.tokens -= 1.0;
                }
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

impl Daemon {
    /// Answers the kubelet server's pending TokenReview / SubjectAccessReview requests on the
    /// review lane (blocking API calls never run on the loop, nor on the shared pool), and
    /// drops those whose client left.
    pub(super) fn kubelet_auth(&mut self) {
        for id in self.kubelet.take_cancelled_auth() {
            self.auth_lane.cancel(id);
        }
        let now = self.reactor.now();
        for (id, req, peer) in self.kubelet.take_auth_requests() {
            if let Err(answer) = self.auth_lane.submit(id, req, peer, now) {
                self.kubelet.on_auth_answer(&mut self.reactor, id, answer);
            }
        }
    }
}

/// TokenReview then SubjectAccessReview for one kubelet API request (worker thread).
pub(super) fn authorize(kube: &Arc<Client>, req: &AuthRequest) -> AuthAnswer {
    let user = match (&req.user, &req.token) {
        (Some(user), _) => user.clone(),
        (None, Some(token)) => {
            let review = TokenReview {
                spec: TokenReviewSpec {
                    token: token.clone(),
                    ..TokenReviewSpec::default()
                },
                ..TokenReview::default()
            };
            match kube.create_token_review(&review) {
                Ok(r) => {
                    let status = r.status.unwrap_or_default();
                    if !status.authenticated.unwrap_or(false) {
                        return AuthAnswer::Unauthenticated;
                    }
                    let u = status.user.unwrap_or_default();
                    UserInfo {
                        name: u.username.unwrap_or_default(),
                        uid: u.uid.unwrap_or_default(),
                        groups: u.groups.unwrap_or_default(),
                        extra: u.extra.unwrap_or_default().into_iter().collect(),
                    }
                }
                Err(e) => return AuthAnswer::Error(format!("token review: {e}")),
            }
        }
        (None, None) => return AuthAnswer::Unauthenticated,
    };
    let review = access_review(&user, req);
    match kube.create_subject_access_review(&review) {
        Ok(r) => AuthAnswer::Decided {
            user,
            allowed: r.status.is_some_and(|s| s.allowed),
        },
        Err(e) => AuthAnswer::Error(format!("subject access review: {e}")),
    }
}

/// The SubjectAccessReview for a caller: name, uid, groups and `extra` as the TokenReview
/// gave them (authorisers may decide on extra, e.g. scopes), the request's attributes.
fn access_review(user: &UserInfo, req: &AuthRequest) -> SubjectAccessReview {
    SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.name.clone()),
            uid: Some(user.uid.clone()).filter(|u| !u.is_empty()),
            groups: Some(user.groups.clone()),
            extra: Some(user.extra.clone().into_iter().collect())
                .filter(|e: &std::collections::BTreeMap<String, Vec<String>>| !e.is_empty()),
            resource_attributes: Some(SarAttributes {
                verb: Some(req.attributes.verb.clone()),
                resource: Some("nodes".into()),
                subresource: Some(req.attributes.subresource.clone()),
                name: Some(req.attributes.node_name.clone()),
                version: Some("v1".into()),
                ..SarAttributes::default()
            }),
            ..SubjectAccessReviewSpec::default()
        },
        ..SubjectAccessReview::default()
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

    fn peer(n: u8) -> PeerKey {
        PeerKey::of(std::net::IpAddr::from([127, 0, 0, n]))
    }

    fn cert_req(user: &str) -> AuthRequest {
        AuthRequest {
            token: None,
            user: Some(crate::kubelet::UserInfo {
                name: user.into(),
                ..Default::default()
            }),
            ..req("")
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
        // Tokens from thirty addresses: the class's burst is the budget; the rest are Busy.
        let verdicts: Vec<bool> = (0..30)
            .map(|i| {
                lane.submit(AuthId(i), req("x"), peer(i as u8 + 1), t0)
                    .is_ok()
            })
            .collect();
        assert_eq!(verdicts.iter().filter(|ok| **ok).count(), 10);
        assert_eq!(
            lane.submit(AuthId(99), req("x"), peer(99), t0),
            Err(AuthAnswer::Busy)
        );
        // The budget refills with time.
        assert!(lane
            .submit(
                AuthId(100),
                req("x"),
                peer(100),
                t0 + Duration::from_secs(1)
            )
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

    /// One address flooding random tokens gets its own small budget; another address and every
    /// certificate caller keep theirs, even while the token reviews hang.
    #[test]
    fn a_token_flood_from_one_address_leaves_other_addresses_and_certificates_their_reviews() {
        let mut r: Reactor<Work> = Reactor::new(0, 0).unwrap();
        let gate = Arc::new(Mutex::new(()));
        let held = gate.lock().unwrap();
        let g = gate.clone();
        let review: Arc<Review> = Arc::new(move |req: &AuthRequest| {
            if req.user.is_none() {
                // Token reviews hang until the gate opens: the API server is slow for them.
                drop(g.lock().unwrap_or_else(|p| p.into_inner()));
                return AuthAnswer::Unauthenticated;
            }
            AuthAnswer::Decided {
                user: req.user.clone().unwrap_or_default(),
                allowed: true,
            }
        });
        let t0 = Instant::now();
        let mut lane = AuthLane::new(review, r.notifier(), t0).unwrap();
        let flood: Vec<bool> = (0..50)
            .map(|i| lane.submit(AuthId(i), req("random"), peer(2), t0).is_ok())
            .collect();
        assert_eq!(
            flood.iter().filter(|ok| **ok).count(),
            3,
            "the address's burst"
        );
        // A second later the flooding address has one more; another address has its own.
        let t1 = t0 + Duration::from_secs(1);
        assert!(lane.submit(AuthId(60), req("t"), peer(2), t1).is_ok());
        assert_eq!(
            lane.submit(AuthId(61), req("t"), peer(2), t1),
            Err(AuthAnswer::Busy)
        );
        for i in 0..3 {
            assert!(lane.submit(AuthId(70 + i), req("t"), peer(3), t1).is_ok());
        }
        // Certificates: their own budget and threads, answered while token reviews hang.
        for i in 0..10 {
            assert!(lane
                .submit(AuthId(80 + i), cert_req("c"), peer(2), t1)
                .is_ok());
        }
        let mut got = answers(&mut r, 10, Duration::from_secs(10));
        got.sort_by_key(|id| id.0);
        assert_eq!(got, (80..90).map(AuthId).collect::<Vec<_>>());
        drop(held);
    }

    #[test]
    fn the_access_review_carries_the_callers_extra() {
        let user = UserInfo {
            name: "sa".into(),
            extra: [("scopes".to_string(), vec!["read".to_string()])].into(),
            ..Default::default()
        };
        let req = AuthRequest {
            token: Some("t".into()),
            user: None,
            attributes: crate::kubelet::auth::attributes("POST", "/exec/a/b/c", "n"),
        };
        let spec = access_review(&user, &req).spec;
        assert_eq!(
            spec.extra.unwrap_or_default().get("scopes"),
            Some(&vec!["read".to_string()])
        );
        let plain = UserInfo::default();
        assert!(access_review(&plain, &req).spec.extra.is_none());
    }
}
