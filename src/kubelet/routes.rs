//! HTTP/1.1 request heads (httparse, with size and header-count limits), query strings, the kubelet
//! kubelet route table and plain responses. No I/O: bytes in, parsed values and bytes out.
//!
//! Bodies are not accepted: the kubelet API has none on the routes we serve.

use crate::percent;

/// A request head larger than this is refused with 431.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// More header lines than this are refused with 431.
pub const MAX_HEADERS: usize = 64;

/// A parsed request head.
#[derive(Clone, Debug)]
pub struct Request {
    pub method: String,
    /// Percent-decoded path.
    pub path: String,
    /// Decoded query pairs in order.
    pub query: Vec<(String, String)>,
    /// Header names lower-cased, values as sent (non-UTF-8 values dropped).
    pub headers: Vec<(String, String)>,
    /// HTTP/1.0 (minor version 0).
    pub http10: bool,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
    /// All values of a header, each comma-split and trimmed (for repeated list headers).
    pub fn header_list(&self, name: &str) -> Vec<String> {
        self.headers
            .iter()
            .filter(|(k, _)| k == name)
            .flat_map(|(_, v)| v.split(',').map(|s| s.trim().to_string()))
            .filter(|s| !s.is_empty())
            .collect()
    }
    pub fn query_values(&self, name: &str) -> Vec<&str> {
        self.query
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }
    pub fn query_value(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
    pub fn wants_close(&self) -> bool {
        let c = self.header("connection").map(|v| v.to_ascii_lowercase());
        match c.as_deref() {
            Some(v) if v.split(',').any(|t| t.trim() == "close") => true,
            Some(v) if v.split(',').any(|t| t.trim() == "keep-alive") => false,
            _ => self.http10,
        }
    }
}

/// Why a head could not be parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeadError {
    /// 400
    Malformed(String),
    /// 431
    TooLarge,
    /// 413 / 411: the request has a body.
    Body,
}

/// Parses a request head from the start of `buf`. Ok(None) when more bytes are needed.
/// On success returns the request and the number of bytes the head occupied.
pub fn parse_head(buf: &[u8]) -> Result<Option<(Request, usize)>, HeadError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let status = match req.parse(buf) {
        Ok(s) => s,
        Err(httparse::Error::TooManyHeaders) => return Err(HeadError::TooLarge),
        Err(e) => return Err(HeadError::Malformed(e.to_string())),
    };
    let used = match status {
        httparse::Status::Complete(n) => n,
        httparse::Status::Partial => {
            if buf.len() > MAX_HEAD_BYTES {
                return Err(HeadError::TooLarge);
            }
            return Ok(None);
        }
    };
    if used > MAX_HEAD_BYTES {
        return Err(HeadError::TooLarge);
    }
    let method = req.method.unwrap_or("").to_string();
    let target = req.path.unwrap_or("");
    if !target.starts_with('/') {
        return Err(HeadError::Malformed(
            "request target must be an absolute path".into(),
        ));
    }
    let (raw_path, raw_query) = target.split_once('?').unwrap_or((target, ""));
    let path = percent::decode(raw_path, false)
        .ok_or_else(|| HeadError::Malformed("bad percent-encoding in path".into()))?;
    let mut query = Vec::new();
    for pair in raw_query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let k = percent::decode(k, true)
            .ok_or_else(|| HeadError::Malformed("bad percent-encoding in query".into()))?;
        let v = percent::decode(v, true)
            .ok_or_else(|| HeadError::Malformed("bad percent-encoding in query".into()))?;
        query.push((k, v));
    }
    let mut hs = Vec::with_capacity(req.headers.len());
    for h in req.headers.iter() {
        if let Ok(v) = std::str::from_utf8(h.value) {
            hs.push((h.name.to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let r = Request {
        method,
        path,
        query,
        headers: hs,
        http10: req.version == Some(0),
    };
    let has_body = r.header("transfer-encoding").is_some()
        || r.header("content-length")
            .map(|v| v.trim() != "0")
            .unwrap_or(false);
    if has_body {
        return Err(HeadError::Body);
    }
    Ok(Some((r, used)))
}

/// The kubelet routes we serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    Healthz,
    Pods,
    RunningPods,
    StatsSummary,
    MetricsResource,
    /// The daemon's own families (the 9091 text).
    Metrics,
    MetricsCadvisor,
    MetricsProbes,
    ContainerLogs {
        namespace: String,
        pod: String,
        container: String,
    },
    Exec {
        namespace: String,
        pod: String,
        container: String,
    },
    Attach {
        namespace: String,
        pod: String,
        container: String,
    },
    PortForward {
        namespace: String,
        pod: String,
    },
    /// Path known, method not (405).
    MethodNotAllowed,
    NotFound,
}

/// Matches method and path to a route (exact paths; the trailing-slash twins of the stats and
/// metrics routes are served directly rather than redirected).
pub fn route(method: &str, path: &str) -> Route {
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let get = method == "GET";
    let get_or_post = method == "GET" || method == "POST";
    let only = |ok: bool, r: Route| if ok { r } else { Route::MethodNotAllowed };
    match segs.as_slice() {
        ["healthz"] => only(get, Route::Healthz),
        ["pods"] => only(get, Route::Pods),
        ["runningpods", ""] | ["runningpods"] => only(get, Route::RunningPods),
        ["stats", "summary"] | ["stats", "summary", ""] => only(get, Route::StatsSummary),
        ["metrics", "resource"] | ["metrics", "resource", ""] => only(get, Route::MetricsResource),
        ["metrics"] | ["metrics", ""] => only(get, Route::Metrics),
        ["metrics", "cadvisor"] | ["metrics", "cadvisor", ""] => only(get, Route::MetricsCadvisor),
        ["metrics", "probes"] | ["metrics", "probes", ""] => only(get, Route::MetricsProbes),
        ["containerLogs", ns, pod, c] if nonempty(&[ns, pod, c]) => only(
            get,
            Route::ContainerLogs {
                namespace: ns.to_string(),
                pod: pod.to_string(),
                container: c.to_string(),
            },
        ),
        ["exec", ns, pod, c] if nonempty(&[ns, pod, c]) => only(
            get_or_post,
            Route::Exec {
                namespace: ns.to_string(),
                pod: pod.to_string(),
                container: c.to_string(),
            },
        ),
        ["attach", ns, pod, c] if nonempty(&[ns, pod, c]) => only(
            get_or_post,
            Route::Attach {
                namespace: ns.to_string(),
                pod: pod.to_string(),
                container: c.to_string(),
            },
        ),
        ["portForward", ns, pod] if nonempty(&[ns, pod]) => only(
            get_or_post,
            Route::PortForward {
                namespace: ns.to_string(),
                pod: pod.to_string(),
            },
        ),
        _ => Route::NotFound,
    }
}

fn nonempty(s: &[&&str]) -> bool {
    s.iter().all(|x| !x.is_empty())
}

/// A query option of a logs, exec or attach request that the kubelet refuses: answered 400 with
/// its text, which says what was wrong as the Go kubelet does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OptionError {
    /// `name=value` that is not what `name` takes; `expected` says what it takes, when told.
    Invalid {
        name: String,
        value: String,
        expected: Option<String>,
    },
    /// Options that do not go together, or a needed one missing, in the kubelet's words.
    Refused(&'static str),
}

impl std::fmt::Display for OptionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OptionError::Invalid {
                name,
                value,
                expected,
            } => {
                write!(f, "invalid {name} value {value:?}")?;
                match expected {
                    Some(e) => write!(f, ": {e}"),
                    None => Ok(()),
                }
            }
            OptionError::Refused(why) => f.write_str(why),
        }
    }
}

/// Go's strconv.ParseBool.
pub fn parse_bool(v: &str) -> Option<bool> {
    match v {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

pub fn reason(code: u16) -> &'static str {
    match code {
        101 => "Switching Protocols",
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Payload Too Large",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

/// A complete response with a body and Content-Length.
pub fn response(code: u16, content_type: &str, body: &[u8], close: bool) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {code} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nX-Content-Type-Options: nosniff\r\n{}\r\n",
        reason(code),
        body.len(),
        if close { "Connection: close\r\n" } else { "" }
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

pub fn text(code: u16, body: &str, close: bool) -> Vec<u8> {
    response(code, "text/plain; charset=utf-8", body.as_bytes(), close)
}

/// One chunk of a chunked body (empty data is skipped: an empty chunk would end the body).
pub fn chunk(data: &[u8], out: &mut Vec<u8>) {
    if data.is_empty() {
        return;
    }
    out.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_head_and_query() {
        let raw = b"GET /exec/ns/p%20x/agent?command=echo&command=a+b&input=1 HTTP/1.1\r\nHost: x\r\nX-Stream-Protocol-Version: v4.channel.k8s.io\r\nX-Stream-Protocol-Version: v3.channel.k8s.io, v2.channel.k8s.io\r\n\r\nrest";
        let (r, used) = parse_head(raw).unwrap().unwrap();
        assert_eq!(&raw[used..], b"rest");
        assert_eq!(r.path, "/exec/ns/p x/agent");
        assert_eq!(r.query_values("command"), vec!["echo", "a b"]);
        assert_eq!(
            r.header_list("x-stream-protocol-version"),
            vec![
                "v4.channel.k8s.io",
                "v3.channel.k8s.io",
                "v2.channel.k8s.io"
            ]
        );
        assert!(!r.wants_close());
    }

    #[test]
    fn limits_and_errors() {
        assert_eq!(
            parse_head(b"GET / HTTP/1.1\r\nHost: x\r\n")
                .unwrap()
                .map(|_| ()),
            None
        );
        let mut big = b"GET / HTTP/1.1\r\nX: ".to_vec();
        big.extend(std::iter::repeat_n(b'a', MAX_HEAD_BYTES + 10));
        assert_eq!(parse_head(&big).unwrap_err(), HeadError::TooLarge);
        let mut flood = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..(MAX_HEADERS + 1) {
            flood.extend_from_slice(format!("H{i}: v\r\n").as_bytes());
        }
        flood.extend_from_slice(b"\r\n");
        assert_eq!(parse_head(&flood).unwrap_err(), HeadError::TooLarge);
        assert!(matches!(
            parse_head(b"\x00\x01garbage\r\n\r\n"),
            Err(HeadError::Malformed(_))
        ));
        assert!(matches!(
            parse_head(b"GET http://x/ HTTP/1.1\r\n\r\n"),
            Err(HeadError::Malformed(_))
        ));
        assert!(matches!(
            parse_head(b"GET /a%zz HTTP/1.1\r\n\r\n"),
            Err(HeadError::Malformed(_))
        ));
        assert_eq!(
            parse_head(b"POST /exec/a/b/c HTTP/1.1\r\nContent-Length: 5\r\n\r\n").unwrap_err(),
            HeadError::Body
        );
    }

    #[test]
    fn route_table() {
        assert_eq!(route("GET", "/healthz"), Route::Healthz);
        assert_eq!(route("GET", "/stats/summary/"), Route::StatsSummary);
        assert_eq!(route("POST", "/stats/summary"), Route::MethodNotAllowed);
        assert_eq!(route("GET", "/runningpods/"), Route::RunningPods);
        assert_eq!(
            route("GET", "/containerLogs/a/b/c"),
            Route::ContainerLogs {
                namespace: "a".into(),
                pod: "b".into(),
                container: "c".into()
            }
        );
        assert_eq!(route("GET", "/containerLogs/a//c"), Route::NotFound);
        assert_eq!(
            route("POST", "/exec/a/b/c"),
            Route::Exec {
                namespace: "a".into(),
                pod: "b".into(),
                container: "c".into()
            }
        );
        assert_eq!(
            route("GET", "/portForward/a/b"),
            Route::PortForward {
                namespace: "a".into(),
                pod: "b".into()
            }
        );
        assert_eq!(route("GET", "/configz"), Route::NotFound);
        assert_eq!(route("GET", "/metrics"), Route::Metrics);
        assert_eq!(route("GET", "/metrics/cadvisor"), Route::MetricsCadvisor);
        assert_eq!(route("GET", "/metrics/probes/"), Route::MetricsProbes);
        assert_eq!(route("POST", "/metrics/probes"), Route::MethodNotAllowed);
        assert_eq!(route("GET", "/metrics/other"), Route::NotFound);
        assert_eq!(parse_bool("True"), Some(true));
        assert_eq!(parse_bool("yes"), None);
    }
}
