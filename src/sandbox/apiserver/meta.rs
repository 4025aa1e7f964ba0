//! Object metadata helpers: timestamps in the API's formats, UIDs, and the Status error type.
//! Pure functions and plain data; no storage, no I/O beyond reading the clock and randomness.

use serde_json::{json, Value};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// An API error answered as a `kind: Status` body, as the real API server does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    /// `details.name` / `details.kind` / `details.group` when the error is about one object.
    pub details: Option<Box<(String, String, String)>>,
    /// Seconds for a `Retry-After` header and `details.retryAfterSeconds`.
    pub retry_after: Option<u32>,
}

impl ApiError {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason,
            message: message.into(),
            details: None,
            retry_after: None,
        }
    }

    fn with_details(mut self, name: &str, group: &str, kind: &str) -> Self {
        self.details = Some(Box::new((
            name.to_string(),
            group.to_string(),
            kind.to_string(),
        )));
        self
    }

    pub fn not_found(group: &str, plural: &str, name: &str) -> Self {
        let what = qualified(group, plural);
        ApiError::new(404, "NotFound", format!("{what} \"{name}\" not found"))
            .with_details(name, group, plural)
    }

    pub fn already_exists(group: &str, plural: &str, name: &str) -> Self {
        let what = qualified(group, plural);
        ApiError::new(
            409,
            "AlreadyExists",
            format!("{what} \"{name}\" already exists"),
        )
        .with_details(name, group, plural)
    }

    /// Optimistic-concurrency conflict: the resourceVersion sent is not the current one.
    pub fn conflict_modified(group: &str, plural: &str, name: &str) -> Self {
        let what = qualified(group, plural);
        ApiError::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {what} \"{name}\": the object has been modified; \
                 please apply your changes to the latest version and try again"
            ),
        )
        .with_details(name, group, plural)
    }

    /// UID precondition failure: the object was deleted and recreated under the same name.
    pub fn conflict_uid(group: &str, plural: &str, name: &str, want: &str, have: &str) -> Self {
        let what = qualified(group, plural);
        ApiError::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {what} \"{name}\": Precondition failed: \
                 UID in precondition: {want}, UID in object meta: {have}"
            ),
        )
        .with_details(name, group, plural)
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::new(400, "BadRequest", message)
    }

    pub fn invalid(kind: &str, name: &str, message: impl Into<String>) -> Self {
        let message = message.into();
        ApiError::new(
            422,
            "Invalid",
            format!("{kind} \"{name}\" is invalid: {message}"),
        )
        .with_details(name, "", kind)
    }

    pub fn method_not_allowed() -> Self {
        ApiError::new(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )
    }

    pub fn expired(message: impl Into<String>) -> Self {
        ApiError::new(410, "Expired", message)
    }

    pub fn unauthorized() -> Self {
        ApiError::new(401, "Unauthorized", "Unauthorized")
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError::new(500, "InternalError", message)
    }

    pub fn too_many_requests(retry_after: u32) -> Self {
        let mut e = ApiError::new(
            429,
            "TooManyRequests",
            "Too many requests, please try again later.",
        );
        e.retry_after = Some(retry_after);
        e
    }

    /// The `kind: Status` body for this error.
    pub fn status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        let mut details = serde_json::Map::new();
        if let Some(d) = &self.details {
            let (name, group, kind) = d.as_ref();
            details.insert("name".into(), json!(name));
            if !group.is_empty() {
                details.insert("group".into(), json!(group));
            }
            details.insert("kind".into(), json!(kind));
        }
        if let Some(secs) = self.retry_after {
            details.insert("retryAfterSeconds".into(), json!(secs));
        }
        if !details.is_empty() {
            status["details"] = Value::Object(details);
        }
        status
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}

impl std::error::Error for ApiError {}

fn qualified(group: &str, plural: &str) -> String {
    if group.is_empty() {
        plural.to_string()
    } else {
        format!("{plural}.{group}")
    }
}

pub use crate::rfc3339::micros as rfc3339_micros;
pub use crate::rfc3339::parse as parse_rfc3339;
pub use crate::rfc3339::seconds as rfc3339;

pub fn now_rfc3339() -> String {
    rfc3339(SystemTime::now())
}

/// A random RFC 4122 version-4 UUID, as the API server assigns to `metadata.uid`.
pub fn new_uid() -> String {
    let mut b = [0u8; 16];
    random_bytes(&mut b);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Five lowercase alphanumerics, the suffix `generateName` gets.
pub fn name_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut b = [0u8; 5];
    random_bytes(&mut b);
    b.iter()
        .map(|x| ALPHABET[*x as usize % ALPHABET.len()] as char)
        .collect()
}

fn random_bytes(out: &mut [u8]) {
    let provider = rustls::crypto::ring::default_provider();
    if provider.secure_random.fill(out).is_err() {
        // Fall back to clock-derived bytes: uniqueness, not secrecy, is what matters here.
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO)
            .as_nanos();
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = (nanos >> ((i % 16) * 8)) as u8 ^ (i as u8).wrapping_mul(151);
        }
    }
}

/// kubectl-style short age: "45s", "3m", "2h", "5d".
pub fn human_age(since: Option<SystemTime>) -> String {
    let Some(since) = since else {
        return "<unknown>".to_string();
    };
    let secs = SystemTime::now()
        .duration_since(since)
        .unwrap_or(Duration::ZERO)
        .as_secs();
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 3600 * 2 => format!("{}m", s / 60),
        s if s < 86_400 * 2 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_and_parses_times() {
        let t = UNIX_EPOCH + Duration::new(1_767_225_600, 123_456_789);
        assert_eq!(rfc3339(t), "2026-01-01T00:00:00Z");
        assert_eq!(rfc3339_micros(t), "2026-01-01T00:00:00.123456Z");
        let back = parse_rfc3339("2026-01-01T00:00:00Z");
        assert_eq!(back, Some(UNIX_EPOCH + Duration::from_secs(1_767_225_600)));
        assert_eq!(
            parse_rfc3339("2024-02-29T13:14:15.5Z").map(rfc3339),
            Some("2024-02-29T13:14:15Z".to_string())
        );
        assert_eq!(parse_rfc3339("garbage"), None);
    }

    #[test]
    fn uids_are_v4_and_distinct() {
        let a = new_uid();
        let b = new_uid();
        assert_ne!(a, b);
        assert_eq!(a.len(), 36);
        assert_eq!(&a[14..15], "4");
    }
}
