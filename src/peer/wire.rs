//! The peer snapshot protocol's wire shapes: the plan document, the request queries, the
//! slice checksum trailer, and the checks every name from the wire passes before it is used.
//!
//! Shared by the listener and the client so both sides agree byte for byte with the Go peers.

use serde::{Deserialize, Serialize};

use crate::percent;
pub use crate::percent::encode as percent_encode;

/// `GET /v1/snapshot-plan?name=<snapshot>`.
pub const PLAN_PATH: &str = "/v1/snapshot-plan";
/// `GET /v1/snapshot-slice?id=<snapshotId>&file=<name>&offset=<n>&length=<n>`.
pub const SLICE_PATH: &str = "/v1/snapshot-slice";
/// The query parameter of both requests naming the manifest digest of the registry tag being
/// restored (`sha256:<hex>`): this daemon serves a snapshot only to a caller naming the digest
/// it recorded when it pushed that snapshot. Go peers neither send nor check it.
pub const DIGEST_PARAM: &str = "digest";
/// The trailer carrying a slice's CRC-32C (Castagnoli), lower-case hex without padding.
pub const CRC_TRAILER: &str = "X-Slice-Crc32c";
/// A plan never has a slice longer than this (a longer data region is split).
pub const MAX_SLICE_LEN: u64 = 256 << 20;
/// Holes up to this size between data regions are sent as zeros rather than split the slice.
pub const HOLE_COALESCE: u64 = 4 << 20;
/// The snapshot envelope the client writes itself; a served file of that name is never fetched.
pub const ENVELOPE_NAME: &str = "snapshot.json";

/// What a peer holds for one snapshot: its id and every data file with the byte ranges that
/// carry data (the rest of each file is a hole).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Plan {
    pub snapshot_id: String,
    #[serde(default)]
    pub files: Vec<PlanFile>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanFile {
    pub name: String,
    pub size: u64,
    #[serde(default)]
    pub slices: Vec<Slice>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slice {
    pub offset: u64,
    pub length: u64,
}

/// A slice request's parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceQuery {
    pub id: String,
    pub file: String,
    pub offset: u64,
    pub length: u64,
}

/// Whether `s` may name one entry inside a directory: a single path component of at most 255
/// bytes, not `.` or `..`, no `/`, no NUL or other control characters, not starting with `-`
/// (it may reach cocoon's argv) or `.` (hidden staging entries are never served).
pub fn plain_component(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 255
        && !s.starts_with(['-', '.'])
        && !s.contains('/')
        && !s.chars().any(char::is_control)
}

/// Whether `s` is a snapshot name a peer may ask for: cocoon's name alphabet (letters, digits,
/// `-`, `_`, `.`, `:`), at most 128 bytes, not starting with `-` or `.`.
pub fn valid_snapshot_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && !s.starts_with(['-', '.'])
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

/// Whether `s` is a manifest digest as a registry gives it: `sha256:` and 64 lower-case hex.
pub fn valid_manifest_digest(s: &str) -> bool {
    s.strip_prefix("sha256:")
        .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
}

/// The CRC-32C trailer value of `crc`.
pub fn crc_hex(crc: u32) -> String {
    format!("{crc:x}")
}

/// Splits a request target into its path and decoded query pairs; `None` on bad escapes.
pub fn split_target(target: &str) -> Option<(&str, Vec<(String, String)>)> {
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, q),
        None => (target, ""),
    };
    let mut pairs = Vec::new();
    for part in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = part.split_once('=').unwrap_or((part, ""));
        pairs.push((percent::decode(k, true)?, percent::decode(v, true)?));
    }
    Some((path, pairs))
}

/// Why a peer request's query was refused (the text of the 400 answer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QueryError {
    Missing(String),
    Repeated(String),
    NotUnsigned { key: String, value: String },
    NotPlain,
    BadLength,
    Overflow,
}

impl std::fmt::Display for QueryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QueryError::Missing(key) => write!(f, "missing query parameter {key}"),
            QueryError::Repeated(key) => write!(f, "query parameter {key} given twice"),
            QueryError::NotUnsigned { key, value } => {
                write!(f, "{key}={value:?} is not an unsigned integer")
            }
            QueryError::NotPlain => write!(f, "id and file must each be one plain path component"),
            QueryError::BadLength => write!(f, "length must be 1..={MAX_SLICE_LEN}"),
            QueryError::Overflow => write!(f, "offset + length overflows"),
        }
    }
}

impl std::error::Error for QueryError {}

/// The one value of `key`; a repeated key is refused (two readers could pick different ones).
pub fn single<'a>(pairs: &'a [(String, String)], key: &str) -> Result<&'a str, QueryError> {
    let mut found = pairs.iter().filter(|(k, _)| k == key);
    match (found.next(), found.next()) {
        (Some((_, v)), None) => Ok(v),
        (None, _) => Err(QueryError::Missing(key.to_string())),
        (Some(_), Some(_)) => Err(QueryError::Repeated(key.to_string())),
    }
}

/// Parses a slice request's query.
pub fn slice_query(pairs: &[(String, String)]) -> Result<SliceQuery, QueryError> {
    let num = |k: &str| -> Result<u64, QueryError> {
        let v = single(pairs, k)?;
        v.parse::<u64>().map_err(|_| QueryError::NotUnsigned {
            key: k.to_string(),
            value: v.to_string(),
        })
    };
    let q = SliceQuery {
        id: single(pairs, "id")?.to_string(),
        file: single(pairs, "file")?.to_string(),
        offset: num("offset")?,
        length: num("length")?,
    };
    if !plain_component(&q.id) || !plain_component(&q.file) {
        return Err(QueryError::NotPlain);
    }
    if q.length == 0 || q.length > MAX_SLICE_LEN {
        return Err(QueryError::BadLength);
    }
    q.offset.checked_add(q.length).ok_or(QueryError::Overflow)?;
    Ok(q)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_json_uses_the_go_field_names() {
        let p = Plan {
            snapshot_id: "01J".into(),
            files: vec![PlanFile {
                name: "mem".into(),
                size: 10,
                slices: vec![Slice {
                    offset: 0,
                    length: 4,
                }],
            }],
        };
        let s = serde_json::to_string(&p).unwrap();
        assert_eq!(
            s,
            r#"{"snapshotId":"01J","files":[{"name":"mem","size":10,"slices":[{"offset":0,"length":4}]}]}"#
        );
    }

    #[test]
    fn queries_decode_and_refuse_escapes_and_repeats() {
        let (path, pairs) =
            split_target("/v1/snapshot-slice?id=a1&file=mem%2Dx&offset=0&length=5").unwrap();
        assert_eq!(path, SLICE_PATH);
        let q = slice_query(&pairs).unwrap();
        assert_eq!((q.file.as_str(), q.length), ("mem-x", 5));
        for bad in [
            "id=a1&file=..&offset=0&length=1",
            "id=a1&file=%2E%2E%2Fetc&offset=0&length=1",
            "id=..&file=mem&offset=0&length=1",
            "id=a1&file=a%2Fb&offset=0&length=1",
            "id=a1&file=mem&offset=0&length=0",
            "id=a1&file=mem&offset=18446744073709551615&length=2",
            "id=a1&file=mem&file=x&offset=0&length=1",
            "id=a1&file=mem&offset=-1&length=1",
            "id=a1&file=.hidden&offset=0&length=1",
        ] {
            let (_, pairs) = split_target(&format!("/x?{bad}")).unwrap();
            assert!(slice_query(&pairs).is_err(), "{bad}");
        }
        assert!(split_target("/x?id=%zz").is_none());
    }

    #[test]
    fn snapshot_names_keep_to_cocoons_alphabet() {
        assert!(valid_snapshot_name("vk-prod-demo-0"));
        assert!(valid_snapshot_name("repo:tag"));
        for bad in ["", "-x", ".x", "a/b", "a b", "a\0b", &"x".repeat(129)] {
            assert!(!valid_snapshot_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn manifest_digests_are_sha256_in_lower_hex() {
        let hex = "0123456789abcdef".repeat(4);
        assert!(valid_manifest_digest(&format!("sha256:{hex}")));
        for bad in [
            String::new(),
            hex.clone(),
            format!("sha256:{}", hex.to_ascii_uppercase()),
            format!("sha256:{}", &hex[1..]),
            format!("sha512:{hex}"),
            format!("sha256:{hex}0"),
        ] {
            assert!(!valid_manifest_digest(&bad), "{bad:?}");
        }
    }

    #[test]
    fn crc_trailer_is_lower_hex_without_padding() {
        assert_eq!(crc_hex(0x0abc), "abc");
        // The CRC-32C check value of "123456789".
        assert_eq!(crc_hex(crc32c::crc32c(b"123456789")), "e3069283");
    }
}
