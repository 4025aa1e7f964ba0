//! Kubelet API authentication and authorisation as the real kubelet does it: client certificate
//! (CN/O) or bearer token (TokenReview), then SubjectAccessReview on nodes/{proxy,log,stats,metrics}.
//!
//! Pure: request attributes, decision caches, and the review JSON bodies. The blocking API calls
//! are made by the daemon, which answers `KubeletAction::Authorize` with `on_auth_answer`.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// TokenReview results are reused this long.
pub const TOKEN_CACHE_TTL: Duration = Duration::from_secs(120);
/// Rejected tokens are remembered this long.
pub const TOKEN_NEGATIVE_TTL: Duration = Duration::from_secs(30);
/// Bound on remembered rejected tokens, kept apart from the accepted ones so that a flood of
/// random tokens never pushes a legitimate caller's entry out.
pub const REJECTED_CAP: usize = 1024;
/// Allowed SubjectAccessReviews are reused this long.
pub const ALLOW_CACHE_TTL: Duration = Duration::from_secs(300);
/// Denied SubjectAccessReviews are reused this long.
pub const DENY_CACHE_TTL: Duration = Duration::from_secs(30);
/// Bound on each cache, so a flood of distinct tokens cannot grow memory without limit.
pub const CACHE_CAP: usize = 4096;

/// Who the caller is.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct UserInfo {
    pub name: String,
    pub uid: String,
    pub groups: Vec<String>,
    /// `user.extra` of the TokenReview (scopes, credential ids), passed on to the
    /// SubjectAccessReview: authorisers may decide on it.
    pub extra: BTreeMap<String, Vec<String>>,
}

/// The SubjectAccessReview resource attributes for one request (resource `nodes`, group "",
/// version v1, name = node name).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ResourceAttributes {
    pub verb: String,
    pub subresource: String,
    pub node_name: String,
}

/// Verb from the HTTP method as the kubelet maps it.
pub fn verb_for_method(method: &str) -> &'static str {
    match method {
        "POST" => "create",
        "PUT" => "update",
        "PATCH" => "patch",
        "DELETE" => "delete",
        _ => "get",
    }
}

/// Subresource from the path prefix: /stats → stats, /metrics → metrics, /logs → log, else proxy.
pub fn subresource_for_path(path: &str) -> &'static str {
    let first = path.trim_start_matches('/').split('/').next().unwrap_or("");
    match first {
        "stats" => "stats",
        "metrics" => "metrics",
        "logs" => "log",
        _ => "proxy",
    }
}

pub fn attributes(method: &str, path: &str, node_name: &str) -> ResourceAttributes {
    ResourceAttributes {
        verb: verb_for_method(method).to_string(),
        subresource: subresource_for_path(path).to_string(),
        node_name: node_name.to_string(),
    }
}

/// What the daemon must resolve for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuthRequest {
    /// Bearer token to check with a TokenReview (None when the caller presented a verified
    /// client certificate; then `user` is set).
    pub token: Option<String>,
    pub user: Option<UserInfo>,
    pub attributes: ResourceAttributes,
}

/// The daemon's answer to an `AuthRequest`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AuthAnswer {
    /// TokenReview said the token is not valid.
    Unauthenticated,
    /// The caller (from the certificate or the TokenReview) and the SubjectAccessReview verdict.
    Decided { user: UserInfo, allowed: bool },
    /// An API call failed; the request gets 500.
    Error(String),
    /// The review budget is spent (reviews in flight for this caller, or the daemon's review
    /// rate): the request gets 429 without an API call.
    Busy,
}

/// Result of a cache lookup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cached {
    Allowed,
    Denied,
    Unauthenticated,
    Miss,
}

/// The SHA-256 of a bearer token: the caches never hold a token itself.
pub type TokenHash = [u8; 32];

pub fn token_hash(token: &str) -> TokenHash {
    Sha256::digest(token.as_bytes()).into()
}

/// The token and decision caches.
#[derive(Default)]
pub struct AuthCache {
    tokens: HashMap<TokenHash, (UserInfo, Instant)>,
    rejected: HashMap<TokenHash, Instant>,
    decisions: HashMap<(UserInfo, ResourceAttributes), (bool, Instant)>,
}

/// Makes room in a bounded map: expired entries go first, then everything (a full map of live
/// entries is a flood, not a working set).
fn make_room<K, V>(
    m: &mut HashMap<K, V>,
    cap: usize,
    now: Instant,
    expiry: impl Fn(&V) -> Instant,
) {
    if m.len() >= cap {
        m.retain(|_, v| expiry(v) > now);
        if m.len() >= cap {
            m.clear();
        }
    }
}

impl AuthCache {
    /// Looks the request up: a known token maps to its user; a known (user, attributes) pair to
    /// its verdict.
    pub fn lookup(
        &mut self,
        token: Option<&str>,
        user: Option<&UserInfo>,
        attrs: &ResourceAttributes,
        now: Instant,
    ) -> Cached {
        let user = match (token, user) {
            (_, Some(u)) => u.clone(),
            (Some(t), None) => {
                let h = token_hash(t);
                if self.rejected.get(&h).is_some_and(|exp| *exp > now) {
                    return Cached::Unauthenticated;
                }
                match self.tokens.get(&h) {
                    Some((u, exp)) if *exp > now => u.clone(),
                    _ => return Cached::Miss,
                }
            }
            (None, None) => return Cached::Unauthenticated,
        };
        match self.decisions.get(&(user, attrs.clone())) {
            Some((allowed, exp)) if *exp > now => {
                if *allowed {
                    Cached::Allowed
                } else {
                    Cached::Denied
                }
            }
            _ => Cached::Miss,
        }
    }

    /// Records the daemon's answer.
    pub fn record(&mut self, req: &AuthRequest, answer: &AuthAnswer, now: Instant) {
        match answer {
            AuthAnswer::Unauthenticated => {
                if let Some(t) = &req.token {
                    make_room(&mut self.rejected, REJECTED_CAP, now, |e| *e);
                    self.rejected
                        .insert(token_hash(t), now + TOKEN_NEGATIVE_TTL);
                }
            }
            AuthAnswer::Decided { user, allowed } => {
                if let Some(t) = &req.token {
                    make_room(&mut self.tokens, CACHE_CAP, now, |e| e.1);
                    let h = token_hash(t);
                    self.rejected.remove(&h);
                    self.tokens.insert(h, (user.clone(), now + TOKEN_CACHE_TTL));
                }
                make_room(&mut self.decisions, CACHE_CAP, now, |e| e.1);
                let ttl = if *allowed {
                    ALLOW_CACHE_TTL
                } else {
                    DENY_CACHE_TTL
                };
                self.decisions.insert(
                    (user.clone(), req.attributes.clone()),
                    (*allowed, now + ttl),
                );
            }
            AuthAnswer::Error(_) | AuthAnswer::Busy => {}
        }
    }
}

/// `authentication.k8s.io/v1` TokenReview request body for POST /apis/authentication.k8s.io/v1/tokenreviews.
pub fn token_review_request(token: &str) -> Value {
    json!({"apiVersion":"authentication.k8s.io/v1","kind":"TokenReview","spec":{"token":token}})
}

/// The user of a TokenReview response, or None when `status.authenticated` is not true.
pub fn token_review_user(resp: &Value) -> Option<UserInfo> {
    let st = resp.get("status")?;
    if st.get("authenticated").and_then(Value::as_bool) != Some(true) {
        return None;
    }
    let u = st.get("user")?;
    Some(UserInfo {
        name: u
            .get("username")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string(),
        uid: u
            .get("uid")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string(),
        groups: u
            .get("groups")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|g| g.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default(),
        extra: u
            .get("extra")
            .and_then(Value::as_object)
            .map(|o| {
                o.iter()
                    .map(|(k, v)| {
                        let vals = v
                            .as_array()
                            .map(|a| {
                                a.iter()
                                    .filter_map(|x| x.as_str().map(str::to_string))
                                    .collect()
                            })
                            .unwrap_or_default();
                        (k.clone(), vals)
                    })
                    .collect()
            })
            .unwrap_or_default(),
    })
}

/// `authorization.k8s.io/v1` SubjectAccessReview body for POST /apis/authorization.k8s.io/v1/subjectaccessreviews.
pub fn subject_access_review_request(user: &UserInfo, attrs: &ResourceAttributes) -> Value {
    json!({
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": user.name,
            "uid": user.uid,
            "groups": user.groups,
            "extra": user.extra,
            "resourceAttributes": {
                "verb": attrs.verb,
                "group": "",
                "version": "v1",
                "resource": "nodes",
                "subresource": attrs.subresource,
                "name": attrs.node_name,
            }
        }
    })
}

/// `status.allowed` of a SubjectAccessReview response (absent or malformed = denied).
pub fn subject_access_review_allowed(resp: &Value) -> bool {
    resp.get("status")
        .and_then(|s| s.get("allowed"))
        .and_then(Value::as_bool)
        == Some(true)
}

/// The user a verified client certificate stands for: CN → name, O → groups.
pub fn user_from_cert(id: &super::tls::CertIdentity) -> Option<UserInfo> {
    let name = id.common_name.clone().filter(|n| !n.is_empty())?;
    Some(UserInfo {
        name,
        uid: String::new(),
        groups: id.organizations.clone(),
        extra: BTreeMap::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_follow_kubelet_mapping() {
        assert_eq!(
            attributes("GET", "/stats/summary", "n").subresource,
            "stats"
        );
        assert_eq!(
            attributes("GET", "/metrics/resource", "n").subresource,
            "metrics"
        );
        assert_eq!(attributes("GET", "/logs/", "n").subresource, "log");
        // The kubelet's own scrape paths are nodes/metrics; a path that only starts with the
        // same letters is not under /metrics (the kubelet matches whole path segments).
        for p in [
            "/metrics",
            "/metrics/cadvisor",
            "/metrics/probes",
            "/metrics/",
        ] {
            assert_eq!(attributes("GET", p, "n").subresource, "metrics", "{p}");
        }
        assert_eq!(attributes("GET", "/metricsx", "n").subresource, "proxy");
        assert_eq!(
            attributes("GET", "/containerLogs/a/b/c", "n").subresource,
            "proxy"
        );
        let a = attributes("POST", "/exec/a/b/c", "n");
        assert_eq!(
            (a.verb.as_str(), a.subresource.as_str()),
            ("create", "proxy")
        );
        assert_eq!(verb_for_method("DELETE"), "delete");
    }

    #[test]
    fn cache_ttls() {
        let mut c = AuthCache::default();
        let t0 = Instant::now();
        let attrs = attributes("GET", "/pods", "n");
        let req = AuthRequest {
            token: Some("tok".into()),
            user: None,
            attributes: attrs.clone(),
        };
        assert_eq!(c.lookup(Some("tok"), None, &attrs, t0), Cached::Miss);
        let user = UserInfo {
            name: "u".into(),
            uid: "1".into(),
            ..Default::default()
        };
        c.record(
            &req,
            &AuthAnswer::Decided {
                user: user.clone(),
                allowed: false,
            },
            t0,
        );
        assert_eq!(
            c.lookup(Some("tok"), None, &attrs, t0 + Duration::from_secs(29)),
            Cached::Denied
        );
        assert_eq!(
            c.lookup(Some("tok"), None, &attrs, t0 + Duration::from_secs(31)),
            Cached::Miss
        );
        c.record(
            &req,
            &AuthAnswer::Decided {
                user: user.clone(),
                allowed: true,
            },
            t0,
        );
        assert_eq!(
            c.lookup(Some("tok"), None, &attrs, t0 + Duration::from_secs(119)),
            Cached::Allowed
        );
        // The token entry lapses at 2 min even though the decision lives 5 min.
        assert_eq!(
            c.lookup(Some("tok"), None, &attrs, t0 + Duration::from_secs(121)),
            Cached::Miss
        );
        assert_eq!(
            c.lookup(None, Some(&user), &attrs, t0 + Duration::from_secs(299)),
            Cached::Allowed
        );
        let bad = AuthRequest {
            token: Some("bad".into()),
            user: None,
            attributes: attrs.clone(),
        };
        c.record(&bad, &AuthAnswer::Unauthenticated, t0);
        assert_eq!(
            c.lookup(Some("bad"), None, &attrs, t0),
            Cached::Unauthenticated
        );
        assert_eq!(c.lookup(None, None, &attrs, t0), Cached::Unauthenticated);
    }

    #[test]
    fn a_flood_of_rejected_tokens_never_evicts_an_accepted_one_and_no_token_is_kept() {
        let mut c = AuthCache::default();
        let t0 = Instant::now();
        let attrs = attributes("GET", "/pods", "n");
        let good = AuthRequest {
            token: Some("good-token".into()),
            user: None,
            attributes: attrs.clone(),
        };
        let user = UserInfo {
            name: "u".into(),
            ..Default::default()
        };
        c.record(
            &good,
            &AuthAnswer::Decided {
                user,
                allowed: true,
            },
            t0,
        );
        for i in 0..3 * REJECTED_CAP {
            let bad = AuthRequest {
                token: Some(format!("random-{i}")),
                user: None,
                attributes: attrs.clone(),
            };
            c.record(&bad, &AuthAnswer::Unauthenticated, t0);
        }
        assert!(c.rejected.len() <= REJECTED_CAP);
        assert_eq!(
            c.lookup(Some("good-token"), None, &attrs, t0),
            Cached::Allowed
        );
        // A recent rejection is answered from the cache.
        let last = format!("random-{}", 3 * REJECTED_CAP - 1);
        assert_eq!(
            c.lookup(Some(&last), None, &attrs, t0),
            Cached::Unauthenticated
        );
        // Keys are digests, not tokens.
        assert!(c.tokens.contains_key(&token_hash("good-token")));
        assert_eq!(token_hash("good-token").len(), 32);
    }

    #[test]
    fn review_bodies() {
        let r = token_review_user(&json!({"status":{"authenticated":true,"user":{"username":"sa","uid":"9","groups":["g1"]}}})).unwrap();
        assert_eq!(r.name, "sa");
        assert_eq!(r.groups, vec!["g1"]);
        assert!(token_review_user(&json!({"status":{"authenticated":false}})).is_none());
        assert!(token_review_user(&json!("x")).is_none());
        let body = subject_access_review_request(&r, &attributes("GET", "/stats/summary", "node1"));
        assert_eq!(body["spec"]["resourceAttributes"]["subresource"], "stats");
        assert_eq!(body["spec"]["resourceAttributes"]["name"], "node1");
        let with_extra = token_review_user(&json!({"status":{"authenticated":true,"user":{"username":"sa","extra":{"scopes":["a","b"]}}}})).unwrap();
        assert_eq!(with_extra.extra["scopes"], vec!["a", "b"]);
        let body = subject_access_review_request(&with_extra, &attributes("GET", "/", "n"));
        assert_eq!(body["spec"]["extra"]["scopes"][1], "b");
        assert!(subject_access_review_allowed(
            &json!({"status":{"allowed":true}})
        ));
        assert!(!subject_access_review_allowed(&json!({"status":{}})));
    }
}
