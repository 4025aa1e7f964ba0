//! Classified Kubernetes API errors: what went wrong, with the server's Status message, so callers decide.
//! Pure data and parsing of Status bodies; it performs no I/O.

use std::fmt;
use std::time::Duration;

/// The parts of a `meta/v1 Status` body that callers act on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApiStatus {
    pub code: u16,
    pub reason: String,
    pub message: String,
}

impl ApiStatus {
    /// Parse a non-2xx body. A body that is not a Status keeps its (truncated) text as the message.
    pub fn from_body(code: u16, body: &[u8]) -> ApiStatus {
        #[derive(serde::Deserialize)]
        struct Wire {
            #[serde(default)]
            reason: Option<String>,
            #[serde(default)]
            message: Option<String>,
            #[serde(default)]
            code: Option<u16>,
        }
        match serde_json::from_slice::<Wire>(body) {
            Ok(w) => ApiStatus {
                code: w.code.filter(|c| *c != 0).unwrap_or(code),
                reason: w.reason.unwrap_or_default(),
                message: w.message.unwrap_or_default(),
            },
            Err(_) => {
                let text = String::from_utf8_lossy(&body[..body.len().min(512)]);
                ApiStatus {
                    code,
                    reason: String::new(),
                    message: text.trim().to_string(),
                }
            }
        }
    }
}

impl fmt::Display for ApiStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.reason.is_empty() {
            write!(f, "HTTP {}: {}", self.code, self.message)
        } else {
            write!(f, "HTTP {} {}: {}", self.code, self.reason, self.message)
        }
    }
}

/// Every way an API call can fail, classified by what a caller should do about it.
///
/// `provider::KubeError` is a second, narrower type on purpose: the pure core acts only on
/// "gone or another incarnation" (never retried) versus anything else (retried), and its
/// simulations produce those classes without an HTTP status or a server; the daemon maps this
/// type onto it where the answer reaches the core.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KubeError {
    /// 404: the object (or its namespace) does not exist.
    NotFound(ApiStatus),
    /// 409: resourceVersion / UID precondition conflict, or AlreadyExists on create.
    Conflict(ApiStatus),
    /// 410: resource version too old (watch / list continue): relist.
    Gone(ApiStatus),
    /// 422 (and 400): the server rejected the object.
    Invalid(ApiStatus),
    /// 429: back off; `retry_after` from the Retry-After header when present.
    TooManyRequests {
        retry_after: Option<Duration>,
        status: ApiStatus,
    },
    /// 401: credentials missing, expired or rejected.
    Unauthorized(ApiStatus),
    /// 403: authenticated but not allowed.
    Forbidden(ApiStatus),
    /// 5xx (and any other unexpected status code).
    Server(ApiStatus),
    /// Connect / TLS / timeout / I/O failure: nothing came back from the server.
    Transport(String),
    /// The server answered 2xx but the body did not decode as the expected type.
    Decode(String),
    /// Credentials could not be obtained (token file unreadable, exec plugin failed).
    Credentials(String),
}

impl KubeError {
    /// Classify an HTTP status code and body.
    pub fn from_response(code: u16, body: &[u8], retry_after: Option<Duration>) -> KubeError {
        let status = ApiStatus::from_body(code, body);
        match code {
            404 => KubeError::NotFound(status),
            409 => KubeError::Conflict(status),
            410 => KubeError::Gone(status),
            400 | 422 => KubeError::Invalid(status),
            429 => KubeError::TooManyRequests {
                retry_after,
                status,
            },
            401 => KubeError::Unauthorized(status),
            403 => KubeError::Forbidden(status),
            _ => KubeError::Server(status),
        }
    }

    /// The server's Status, when the server answered.
    pub fn status(&self) -> Option<&ApiStatus> {
        match self {
            KubeError::NotFound(s)
            | KubeError::Conflict(s)
            | KubeError::Gone(s)
            | KubeError::Invalid(s)
            | KubeError::Unauthorized(s)
            | KubeError::Forbidden(s)
            | KubeError::Server(s)
            | KubeError::TooManyRequests { status: s, .. } => Some(s),
            _ => None,
        }
    }

    pub fn is_not_found(&self) -> bool {
        matches!(self, KubeError::NotFound(_))
    }

    pub fn is_conflict(&self) -> bool {
        matches!(self, KubeError::Conflict(_))
    }

    /// True for a 409 whose reason is AlreadyExists (a create raced another writer).
    pub fn is_already_exists(&self) -> bool {
        matches!(self, KubeError::Conflict(s) if s.reason == "AlreadyExists")
    }

    /// Worth retrying the same call later: transport failures, 429 and 5xx.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            KubeError::Transport(_) | KubeError::TooManyRequests { .. } | KubeError::Server(_)
        )
    }
}

impl fmt::Display for KubeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KubeError::NotFound(s) => write!(f, "not found ({s})"),
            KubeError::Conflict(s) => write!(f, "conflict ({s})"),
            KubeError::Gone(s) => write!(f, "gone ({s})"),
            KubeError::Invalid(s) => write!(f, "invalid ({s})"),
            KubeError::TooManyRequests {
                retry_after,
                status,
            } => match retry_after {
                Some(d) => write!(f, "too many requests, retry after {d:?} ({status})"),
                None => write!(f, "too many requests ({status})"),
            },
            KubeError::Unauthorized(s) => write!(f, "unauthorized ({s})"),
            KubeError::Forbidden(s) => write!(f, "forbidden ({s})"),
            KubeError::Server(s) => write!(f, "server error ({s})"),
            KubeError::Transport(m) => write!(f, "transport error: {m}"),
            KubeError::Decode(m) => write!(f, "decode error: {m}"),
            KubeError::Credentials(m) => write!(f, "credentials error: {m}"),
        }
    }
}

impl std::error::Error for KubeError {}

/// Parse a Retry-After header given in seconds (the API server never sends HTTP dates).
pub fn parse_retry_after(value: Option<&str>) -> Option<Duration> {
    let secs: u64 = value?.trim().parse().ok()?;
    Some(Duration::from_secs(secs.min(3600)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_status_codes_and_keeps_message() {
        let body = br#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"pods \"a\" not found","reason":"NotFound","code":404}"#;
        let e = KubeError::from_response(404, body, None);
        assert!(e.is_not_found());
        assert_eq!(
            e.status().map(|s| s.message.as_str()),
            Some("pods \"a\" not found")
        );
        let e = KubeError::from_response(409, br#"{"reason":"AlreadyExists","message":"x"}"#, None);
        assert!(e.is_already_exists());
        let e = KubeError::from_response(409, br#"{"reason":"Conflict","message":"x"}"#, None);
        assert!(e.is_conflict() && !e.is_already_exists());
        assert!(matches!(
            KubeError::from_response(410, b"", None),
            KubeError::Gone(_)
        ));
        assert!(matches!(
            KubeError::from_response(422, b"{}", None),
            KubeError::Invalid(_)
        ));
        assert!(
            matches!(KubeError::from_response(503, b"oops", None), KubeError::Server(s) if s.message == "oops")
        );
        let e = KubeError::from_response(429, b"{}", parse_retry_after(Some(" 3 ")));
        assert_eq!(
            e,
            KubeError::TooManyRequests {
                retry_after: Some(Duration::from_secs(3)),
                status: ApiStatus {
                    code: 429,
                    reason: String::new(),
                    message: String::new()
                }
            }
        );
        assert!(e.is_transient());
        assert!(matches!(
            KubeError::from_response(401, b"{}", None),
            KubeError::Unauthorized(_)
        ));
        assert!(matches!(
            KubeError::from_response(403, b"{}", None),
            KubeError::Forbidden(_)
        ));
        assert_eq!(parse_retry_after(Some("soon")), None);
    }
}
