//! Watch event decoding: one line of the watch stream into a `PodEvent` in one serde pass, with
//! errors that name the pod when it can be found.

use std::fmt;

use k8s_openapi::api::core::v1::Pod;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::Deserialize;

use super::chunked::FramingError;
use super::StreamDecoder;
use crate::kube::error::ApiStatus;

/// One decoded watch event.
#[derive(Clone, Debug, PartialEq)]
pub enum PodEvent {
    Added(Box<Pod>),
    Modified(Box<Pod>),
    Deleted(Box<Pod>),
    Bookmark { resource_version: String },
    Error(ApiStatus),
}

enum Object {
    Pod(Box<Pod>),
    Bookmark(String),
    Status(ApiStatus),
    Other(serde_json::Value),
}

#[derive(Deserialize)]
struct BookmarkObject {
    #[serde(default)]
    metadata: Option<BookmarkMeta>,
}

#[derive(Deserialize)]
struct BookmarkMeta {
    #[serde(default, rename = "resourceVersion")]
    resource_version: Option<String>,
}

#[derive(Deserialize)]
struct StatusObject {
    #[serde(default)]
    code: Option<u16>,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    message: Option<String>,
}

impl From<StatusObject> for ApiStatus {
    fn from(s: StatusObject) -> ApiStatus {
        ApiStatus {
            code: s.code.unwrap_or(0),
            reason: s.reason.unwrap_or_default(),
            message: s.message.unwrap_or_default(),
        }
    }
}

/// `{"type":..,"object":..}` decoded in one pass: the object's type is chosen by `type`,
/// which the API server always writes first.
struct Envelope {
    kind: String,
    object: Option<Object>,
}

impl<'de> Deserialize<'de> for Envelope {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Envelope;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a watch event object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Envelope, A::Error> {
                let mut kind: Option<String> = None;
                let mut object = None;
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    match &*key {
                        "type" => kind = Some(map.next_value()?),
                        "object" => {
                            object = Some(match kind.as_deref() {
                                Some("ADDED" | "MODIFIED" | "DELETED") => {
                                    Object::Pod(map.next_value()?)
                                }
                                Some("BOOKMARK") => {
                                    let b: BookmarkObject = map.next_value()?;
                                    Object::Bookmark(
                                        b.metadata
                                            .and_then(|m| m.resource_version)
                                            .unwrap_or_default(),
                                    )
                                }
                                Some("ERROR") => {
                                    Object::Status(map.next_value::<StatusObject>()?.into())
                                }
                                _ => Object::Other(map.next_value()?),
                            })
                        }
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                let kind = kind.ok_or_else(|| de::Error::missing_field("type"))?;
                Ok(Envelope { kind, object })
            }
        }
        d.deserialize_map(V)
    }
}

/// Decode one watch line. Errors name what was wrong (and the pod, when it can be found).
pub fn decode_line(line: &[u8]) -> Result<PodEvent, BadEvent> {
    let env: Envelope = match serde_json::from_slice(line) {
        Ok(e) => e,
        Err(e) => return Err(describe_bad_line(line, &e.to_string())),
    };
    let object = match env.object {
        // `object` came before `type`: re-dispatch from the generic value.
        Some(Object::Other(v)) => match env.kind.as_str() {
            "ADDED" | "MODIFIED" | "DELETED" => Object::Pod(Box::new(
                Pod::deserialize(&v).map_err(|e| describe_bad_line(line, &e.to_string()))?,
            )),
            "BOOKMARK" => Object::Bookmark(
                v.pointer("/metadata/resourceVersion")
                    .and_then(|r| r.as_str())
                    .unwrap_or_default()
                    .to_string(),
            ),
            "ERROR" => Object::Status(
                StatusObject::deserialize(&v)
                    .map_err(|e| describe_bad_line(line, &e.to_string()))?
                    .into(),
            ),
            other => return Err(BadEvent::UnknownType(other.to_string())),
        },
        Some(o) => o,
        None => return Err(BadEvent::NoObject(env.kind)),
    };
    Ok(match (env.kind.as_str(), object) {
        ("ADDED", Object::Pod(p)) => PodEvent::Added(p),
        ("MODIFIED", Object::Pod(p)) => PodEvent::Modified(p),
        ("DELETED", Object::Pod(p)) => PodEvent::Deleted(p),
        ("BOOKMARK", Object::Bookmark(rv)) => PodEvent::Bookmark {
            resource_version: rv,
        },
        ("ERROR", Object::Status(s)) => PodEvent::Error(s),
        (other, _) => return Err(BadEvent::UnknownType(other.to_string())),
    })
}

/// A watch line that is not a watch event: skipped (and counted), the stream goes on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BadEvent {
    /// Not JSON at all: the parser's words and the line's first 120 bytes.
    NotJson {
        error: String,
        shown: String,
    },
    /// JSON whose object does not decode: what can be read of the event and its pod.
    Undecodable {
        kind: String,
        namespace: String,
        name: String,
        uid: String,
        error: String,
    },
    UnknownType(String),
    /// An event of this type without its object.
    NoObject(String),
}

impl fmt::Display for BadEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BadEvent::NotJson { error, shown } => {
                write!(f, "watch line is not JSON ({error}): {shown:?}")
            }
            BadEvent::Undecodable {
                kind,
                namespace,
                name,
                uid,
                error,
            } => write!(
                f,
                "watch {kind} event for pod {namespace}/{name} (uid {uid}) does not decode: {error}"
            ),
            BadEvent::UnknownType(kind) => write!(f, "unknown watch event type {kind:?}"),
            BadEvent::NoObject(kind) => write!(f, "watch event {kind:?} has no object"),
        }
    }
}

fn describe_bad_line(line: &[u8], err: &str) -> BadEvent {
    let v: Option<serde_json::Value> = serde_json::from_slice(line).ok();
    match v {
        None => BadEvent::NotJson {
            error: err.to_string(),
            shown: String::from_utf8_lossy(&line[..line.len().min(120)]).into_owned(),
        },
        Some(v) => {
            let get = |p: &str| {
                v.pointer(p)
                    .and_then(|x| x.as_str())
                    .unwrap_or("?")
                    .to_string()
            };
            BadEvent::Undecodable {
                kind: get("/type"),
                namespace: get("/object/metadata/namespace"),
                name: get("/object/metadata/name"),
                uid: get("/object/metadata/uid"),
                error: err.to_string(),
            }
        }
    }
}

/// Decode a whole captured stream given as arbitrary pieces (testing and benchmarking helper).
pub fn decode_stream(
    pieces: &[&[u8]],
    chunked: bool,
) -> Result<Vec<Result<PodEvent, BadEvent>>, FramingError> {
    let mut dec = StreamDecoder::new(chunked);
    let mut out = Vec::new();
    for p in pieces {
        dec.feed(p, &mut |l| out.push(decode_line(l)))?;
    }
    dec.finish(&mut |l| out.push(decode_line(l)));
    Ok(out)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::kube::watch::known::rv_of;

    pub(in crate::kube::watch) fn pod_json(name: &str, uid: &str, rv: &str) -> String {
        serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ns", "uid": uid, "resourceVersion": rv,
                         "annotations": {"vm.cocoonstack.io/id": "x"}},
            "spec": {"nodeName": "n1", "containers": [{"name": "agent", "image": "img"}]},
            "status": {"phase": "Pending"}
        })
        .to_string()
    }

    fn event(kind: &str, name: &str, uid: &str, rv: &str) -> String {
        format!(
            "{{\"type\":\"{kind}\",\"object\":{}}}\n",
            pod_json(name, uid, rv)
        )
    }

    fn chunk(body: &str) -> String {
        format!("{:x}\r\n{body}\r\n", body.len())
    }

    fn sample_stream() -> (String, usize) {
        let mut s = String::new();
        s += &chunk(&event("ADDED", "a", "u1", "10"));
        // Two events in one chunk, one event across two chunks.
        s += &chunk(&(event("MODIFIED", "a", "u1", "11") + &event("ADDED", "b", "u2", "12")));
        let e = event("DELETED", "a", "u1", "13");
        let (x, y) = e.split_at(40);
        s += &chunk(x);
        s += &format!("{:x};ext=1\r\n{y}\r\n", y.len());
        s += &chunk("not json at all\n");
        s += &chunk("{\"type\":\"BOOKMARK\",\"object\":{\"kind\":\"Pod\",\"apiVersion\":\"v1\",\"metadata\":{\"resourceVersion\":\"20\"}}}\n");
        s += &chunk("{\"type\":\"ERROR\",\"object\":{\"kind\":\"Status\",\"code\":410,\"reason\":\"Expired\",\"message\":\"too old resource version: 1 (5)\"}}\n");
        s += "0\r\n\r\n";
        (s, 7)
    }

    fn summarize(evs: &[Result<PodEvent, BadEvent>]) -> Vec<String> {
        evs.iter()
            .map(|e| match e {
                Ok(PodEvent::Added(p)) => format!("A {}", rv_of(p)),
                Ok(PodEvent::Modified(p)) => format!("M {}", rv_of(p)),
                Ok(PodEvent::Deleted(p)) => format!("D {}", rv_of(p)),
                Ok(PodEvent::Bookmark { resource_version }) => format!("B {resource_version}"),
                Ok(PodEvent::Error(s)) => format!("E {} {}", s.code, s.reason),
                Err(_) => "bad".to_string(),
            })
            .collect()
    }

    #[test]
    fn every_split_point_gives_the_same_events() {
        let (stream, n) = sample_stream();
        let bytes = stream.as_bytes();
        let whole = decode_stream(&[bytes], true).unwrap();
        assert_eq!(whole.len(), n);
        let expect = vec![
            "A 10",
            "M 11",
            "A 12",
            "D 13",
            "bad",
            "B 20",
            "E 410 Expired",
        ];
        assert_eq!(summarize(&whole), expect);
        for i in 0..=bytes.len() {
            let got = decode_stream(&[&bytes[..i], &bytes[i..]], true).unwrap();
            assert_eq!(summarize(&got), expect, "split at {i}");
        }
        // Three-way splits on a coarser grid, and byte-at-a-time.
        for i in (0..bytes.len()).step_by(7) {
            for j in (i..bytes.len()).step_by(13) {
                let got = decode_stream(&[&bytes[..i], &bytes[i..j], &bytes[j..]], true).unwrap();
                assert_eq!(summarize(&got), expect, "split at {i},{j}");
            }
        }
        let singles: Vec<&[u8]> = bytes.chunks(1).collect();
        assert_eq!(summarize(&decode_stream(&singles, true).unwrap()), expect);
    }

    #[test]
    fn unchunked_stream_and_final_line_without_newline() {
        let s =
            event("ADDED", "a", "u1", "1") + "\r\n" + event("MODIFIED", "a", "u1", "2").trim_end();
        let b = s.as_bytes();
        for i in 0..=b.len() {
            let got = decode_stream(&[&b[..i], &b[i..]], false).unwrap();
            assert_eq!(summarize(&got), vec!["A 1", "M 2"], "split at {i}");
        }
    }

    #[test]
    fn undecodable_pod_is_reported_by_name_and_skipped() {
        let bad = "{\"type\":\"ADDED\",\"object\":{\"metadata\":{\"name\":\"p\",\"namespace\":\"ns\",\"uid\":\"u\"},\"spec\":{\"containers\":5}}}\n";
        let s = bad.to_string() + &event("ADDED", "q", "u9", "3");
        let got = decode_stream(&[s.as_bytes()], false).unwrap();
        let msg = got[0].as_ref().unwrap_err().to_string();
        assert!(msg.contains("ns/p") && msg.contains("uid u"), "{msg}");
        assert_eq!(summarize(&got[1..]), vec!["A 3"]);
        // `object` before `type` still decodes.
        let rev = format!(
            "{{\"object\":{},\"type\":\"MODIFIED\"}}",
            pod_json("a", "u", "7")
        );
        assert_eq!(summarize(&[decode_line(rev.as_bytes())]), vec!["M 7"]);
        assert!(decode_line(b"{\"type\":\"WEIRD\",\"object\":{}}").is_err());
        assert!(decode_line(b"{\"object\":{}}").is_err());
    }
}
