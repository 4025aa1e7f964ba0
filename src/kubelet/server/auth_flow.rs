//! The kubelet server's auth flow: credentials of a request, the cache, reviews handed to the
//! daemon (capped per peer) and their answers turned into dispatch or 401 / 403 / 429 / 500.

use std::time::Duration;

use mio::Token;

use super::conn::Phase;
use super::{AuthId, KubeletServer};
use crate::kubelet::auth::{self, AuthAnswer, AuthRequest, Cached};
use crate::kubelet::routes::{self, Request};
use crate::metrics::admission::PeerKey;
use crate::reactor::Reactor;

impl KubeletServer {
    /// Authorisation work for the daemon: for each, resolve and call `on_auth_answer`.
    /// Each with the caller's address (an IPv6 /64 as one), which the daemon budgets by.
    pub fn take_auth_requests(&mut self) -> Vec<(AuthId, AuthRequest, PeerKey)> {
        std::mem::take(&mut self.auth_out)
    }

    /// Authorisation requests no longer wanted (the client left or timed out): drop them if
    /// they have not run.
    pub fn take_cancelled_auth(&mut self) -> Vec<AuthId> {
        std::mem::take(&mut self.auth_cancelled)
    }

    /// Forgets a pending review; `cancelled` when nobody answered it.
    pub(super) fn drop_pending(
        &mut self,
        id: AuthId,
        cancelled: bool,
    ) -> Option<(Token, AuthRequest)> {
        let (token, req, peer) = self.auth_pending.remove(&id)?;
        self.reviews.remove(peer);
        if cancelled {
            self.auth_cancelled.push(id);
        }
        Some((token, req))
    }

    pub fn on_auth_answer<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        id: AuthId,
        answer: AuthAnswer,
    ) {
        let Some((token, req)) = self.drop_pending(id, false) else {
            return;
        };
        self.cache.record(&req, &answer, r.now());
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        let Phase::WaitAuth {
            req: http,
            id: waiting,
        } = std::mem::replace(&mut c.phase, Phase::Head)
        else {
            return;
        };
        if waiting != id {
            return;
        }
        if matches!(answer, AuthAnswer::Decided { .. }) {
            self.mark_authenticated(r, token);
        }
        match answer {
            AuthAnswer::Decided { allowed: true, .. } => self.dispatch(r, token, http),
            AuthAnswer::Decided {
                allowed: false,
                user,
            } => {
                let msg = format!(
                    "Forbidden (user={}, verb={}, resource=nodes, subresource({}))",
                    user.name, req.attributes.verb, req.attributes.subresource
                );
                self.respond(r, token, routes::text(403, &msg, false), http.wants_close());
            }
            // Who failed to authenticate gets no second try on this connection.
            AuthAnswer::Unauthenticated => {
                self.respond(r, token, routes::text(401, "Unauthorized", false), true)
            }
            AuthAnswer::Busy => self.respond(r, token, too_many_reviews(), true),
            AuthAnswer::Error(e) => {
                // The API server's text may name internals: it goes to the log (once a minute,
                // callers can trigger it at will), the caller gets a generic body.
                let now = r.now();
                if self
                    .auth_error_logged
                    .is_none_or(|t| now.saturating_duration_since(t) >= Duration::from_secs(60))
                {
                    log::warn!("kubelet: authorisation failed (logged once a minute): {e}");
                    self.auth_error_logged = Some(now);
                }
                self.respond(
                    r,
                    token,
                    routes::text(
                        500,
                        "Internal Server Error: authorization check failed",
                        true,
                    ),
                    true,
                )
            }
        }
        self.after_input(r, token);
        self.rearm(r);
    }

    pub(super) fn authenticate<M: Send + 'static>(
        &mut self,
        r: &mut Reactor<M>,
        token: Token,
        req: Request,
    ) {
        if !self.cfg.auth_enabled {
            self.mark_authenticated(r, token);
            return self.dispatch(r, token, req);
        }
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        let cert_user = c.cert_user.clone().flatten();
        let bearer = req
            .header("authorization")
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty());
        let attrs = auth::attributes(&req.method, &req.path, &self.cfg.node_name);
        let (token_for_review, user) = match (cert_user, bearer) {
            (Some(u), _) => (None, Some(u)),
            (None, Some(t)) => (Some(t), None),
            // No credentials: no second try on this connection.
            (None, None) => {
                return self.respond(r, token, routes::text(401, "Unauthorized", false), true);
            }
        };
        match self
            .cache
            .lookup(token_for_review.as_deref(), user.as_ref(), &attrs, r.now())
        {
            Cached::Allowed => {
                self.mark_authenticated(r, token);
                self.dispatch(r, token, req)
            }
            Cached::Denied => {
                self.mark_authenticated(r, token);
                let close = req.wants_close();
                self.respond(r, token, routes::text(403, "Forbidden", false), close)
            }
            Cached::Unauthenticated => {
                self.respond(r, token, routes::text(401, "Unauthorized", false), true)
            }
            Cached::Miss => {
                let Some(peer) = self.conns.get(&token).map(|c| c.peer) else {
                    return;
                };
                // Each review is an API call the caller makes us pay for: a few at a time
                // per address, the rest are turned away before any call.
                if self.reviews.of(peer) >= self.cfg.max_reviews_per_peer {
                    return self.respond(r, token, too_many_reviews(), true);
                }
                let id = AuthId(self.next_auth);
                self.next_auth += 1;
                let areq = AuthRequest {
                    token: token_for_review,
                    user,
                    attributes: attrs,
                };
                self.reviews.add(peer);
                self.auth_pending.insert(id, (token, areq.clone(), peer));
                self.auth_out.push((id, areq, peer));
                let deadline = r.now() + self.cfg.auth_timeout;
                if let Some(c) = self.conns.get_mut(&token) {
                    c.phase = Phase::WaitAuth { req, id };
                    c.deadline = Some(deadline);
                }
            }
        }
    }
}

/// 429 for a caller over its review budget; the connection closes (it may retry later).
fn too_many_reviews() -> Vec<u8> {
    routes::text(
        429,
        "Too Many Requests: authentication reviews in flight",
        true,
    )
}
