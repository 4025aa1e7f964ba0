//! HTTP/1.1 framing for the fake: parse one request (httparse, Content-Length or chunked body),
//! write responses and chunked stream pieces. Byte-level only; knows nothing of the API.

use std::io::{self, Read, Write};

use crate::percent::decode_lenient as percent_decode;

const MAX_HEAD: usize = 64 * 1024;
/// The real API server rejects request bodies over 3 MiB.
pub const MAX_BODY: usize = 3 * 1024 * 1024;

#[derive(Debug, Clone, Default)]
pub struct Request {
    pub method: String,
    /// Percent-decoded path without the query.
    pub path: String,
    /// Percent-decoded query pairs in order.
    pub query: Vec<(String, String)>,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn query(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// A boolean query flag as the API server reads it ("true" or "1").
    pub fn query_flag(&self, name: &str) -> bool {
        matches!(self.query(name), Some("true") | Some("1"))
    }

    pub fn wants_close(&self) -> bool {
        self.header("connection")
            .is_some_and(|v| v.eq_ignore_ascii_case("close"))
    }
}

#[derive(Debug)]
pub enum HttpError {
    /// The peer closed the connection before a new request began.
    Closed,
    Io(io::Error),
    /// Malformed request: answer 400 and close.
    Bad(String),
    /// Body over the limit: answer 413 and close.
    TooLarge,
}

impl From<io::Error> for HttpError {
    fn from(e: io::Error) -> Self {
        HttpError::Io(e)
    }
}

/// Reads one request. `buf` carries bytes read past the previous request (pipelining).
/// Answers `Expect: 100-continue` before reading the body (curl sends it for large bodies).
pub fn read_request<R: Read + Write>(r: &mut R, buf: &mut Vec<u8>) -> Result<Request, HttpError> {
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut parsed = httparse::Request::new(&mut headers);
        match parsed.parse(buf) {
            Ok(httparse::Status::Complete(head_len)) => {
                let method = parsed.method.unwrap_or("").to_string();
                let http10 = parsed.version == Some(0);
                let target = parsed.path.unwrap_or("/").to_string();
                let headers: Vec<(String, String)> = parsed
                    .headers
                    .iter()
                    .map(|h| {
                        (
                            h.name.to_string(),
                            String::from_utf8_lossy(h.value).trim().to_string(),
                        )
                    })
                    .collect();
                buf.drain(..head_len);
                let mut req = Request {
                    method,
                    headers,
                    ..Default::default()
                };
                let (path, query) = target.split_once('?').unwrap_or((&target, ""));
                req.path = percent_decode(path, false);
                req.query = parse_query(query);
                if http10 && req.header("connection").is_none() {
                    // HTTP/1.0 without keep-alive: one request per connection.
                    req.headers.push(("Connection".into(), "close".into()));
                }
                let expects_continue = req
                    .header("expect")
                    .is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
                if expects_continue && buf.is_empty() {
                    r.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
                    r.flush()?;
                }
                req.body = read_body(r, buf, &req)?;
                return Ok(req);
            }
            Ok(httparse::Status::Partial) => {
                if buf.len() > MAX_HEAD {
                    return Err(HttpError::Bad("request head too large".into()));
                }
            }
            Err(e) => return Err(HttpError::Bad(format!("bad request head: {e}"))),
        }
        let n = r.read(&mut chunk)?;
        if n == 0 {
            return if buf.is_empty() {
                Err(HttpError::Closed)
            } else {
                Err(HttpError::Bad("connection closed mid-request".into()))
            };
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn fill<R: Read>(r: &mut R, buf: &mut Vec<u8>, want: usize) -> Result<(), HttpError> {
    let mut chunk = [0u8; 16 * 1024];
    while buf.len() < want {
        let n = r.read(&mut chunk)?;
        if n == 0 {
            return Err(HttpError::Bad("connection closed mid-body".into()));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok(())
}

fn read_body<R: Read>(r: &mut R, buf: &mut Vec<u8>, req: &Request) -> Result<Vec<u8>, HttpError> {
    let chunked = req
        .header("transfer-encoding")
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    if chunked {
        return read_chunked(r, buf);
    }
    let len = match req.header("content-length") {
        None => 0,
        Some(v) => v
            .parse::<usize>()
            .map_err(|_| HttpError::Bad("bad Content-Length".into()))?,
    };
    if len > MAX_BODY {
        return Err(HttpError::TooLarge);
    }
    fill(r, buf, len)?;
    Ok(buf.drain(..len).collect())
}

fn read_line<R: Read>(r: &mut R, buf: &mut Vec<u8>) -> Result<String, HttpError> {
    loop {
        if let Some(pos) = buf.windows(2).position(|w| w == b"\r\n") {
            let line = String::from_utf8_lossy(&buf[..pos]).to_string();
            buf.drain(..pos + 2);
            return Ok(line);
        }
        if buf.len() > MAX_HEAD {
            return Err(HttpError::Bad("chunk line too long".into()));
        }
        let have = buf.len();
        fill(r, buf, have + 1)?;
    }
}

fn read_chunked<R: Read>(r: &mut R, buf: &mut Vec<u8>) -> Result<Vec<u8>, HttpError> {
    let mut body = Vec::new();
    loop {
        let line = read_line(r, buf)?;
        let size_text = line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| HttpError::Bad(format!("bad chunk size {size_text:?}")))?;
        if size == 0 {
            // Trailers end with an empty line.
            while !read_line(r, buf)?.is_empty() {}
            return Ok(body);
        }
        if body.len() + size > MAX_BODY {
            return Err(HttpError::TooLarge);
        }
        fill(r, buf, size + 2)?;
        body.extend_from_slice(&buf[..size]);
        buf.drain(..size + 2);
    }
}

pub fn parse_query(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k, true), percent_decode(v, true))
        })
        .collect()
}

pub fn reason_phrase(code: u16) -> &'static str {
    match code {
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        406 => "Not Acceptable",
        409 => "Conflict",
        410 => "Gone",
        413 => "Request Entity Too Large",
        415 => "Unsupported Media Type",
        422 => "Unprocessable Entity",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Status",
    }
}

#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn json(status: u16, body: &serde_json::Value) -> Response {
        Response {
            status,
            headers: vec![("Content-Type".into(), "application/json".into())],
            body: serde_json::to_vec(body).unwrap_or_default(),
        }
    }

    pub fn text(status: u16, body: &str) -> Response {
        Response {
            status,
            headers: vec![("Content-Type".into(), "text/plain; charset=utf-8".into())],
            body: body.as_bytes().to_vec(),
        }
    }
}

/// Writes a complete response with Content-Length in one flush.
pub fn write_response<W: Write>(w: &mut W, resp: &Response, keep_alive: bool) -> io::Result<()> {
    let mut out = Vec::with_capacity(resp.body.len() + 256);
    write!(
        out,
        "HTTP/1.1 {} {}\r\n",
        resp.status,
        reason_phrase(resp.status)
    )?;
    for (k, v) in &resp.headers {
        write!(out, "{k}: {v}\r\n")?;
    }
    write!(out, "Content-Length: {}\r\n", resp.body.len())?;
    if !keep_alive {
        out.extend_from_slice(b"Connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&resp.body);
    w.write_all(&out)?;
    w.flush()
}

/// Writes the head of a chunked streaming response (a watch).
pub fn write_stream_head<W: Write>(w: &mut W, content_type: &str) -> io::Result<()> {
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nCache-Control: no-cache, private\r\n\
         Transfer-Encoding: chunked\r\n\r\n"
    );
    w.write_all(head.as_bytes())?;
    w.flush()
}

/// Appends one chunk to `out` (callers batch several and write them at once).
pub fn encode_chunk(out: &mut Vec<u8>, data: &[u8]) {
    if data.is_empty() {
        return;
    }
    out.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// Splits a complete HTTP/1.1 response read to the end of the connection into its status and
/// body (Content-Length, chunked, or everything after the head).
pub fn parse_response(raw: &[u8]) -> Result<(u16, Vec<u8>), String> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut parsed = httparse::Response::new(&mut headers);
    let head_len = match parsed.parse(raw) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Err("truncated response head".into()),
        Err(e) => return Err(format!("bad response head: {e}")),
    };
    let status = parsed.code.unwrap_or(0);
    let header = |name: &str| {
        parsed
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .map(|h| String::from_utf8_lossy(h.value).to_ascii_lowercase())
    };
    let rest = &raw[head_len..];
    if header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        let mut body = Vec::new();
        let mut at = 0;
        loop {
            let line_end = rest[at..]
                .windows(2)
                .position(|w| w == b"\r\n")
                .ok_or("truncated chunk size")?;
            let size_text = String::from_utf8_lossy(&rest[at..at + line_end]).to_string();
            let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|_| format!("bad chunk size {size_text:?}"))?;
            at += line_end + 2;
            if size == 0 {
                return Ok((status, body));
            }
            let chunk = rest.get(at..at + size).ok_or("truncated chunk")?;
            body.extend_from_slice(chunk);
            at += size + 2;
        }
    }
    match header("content-length").and_then(|v| v.trim().parse::<usize>().ok()) {
        Some(n) => Ok((status, rest.get(..n).ok_or("truncated body")?.to_vec())),
        None => Ok((status, rest.to_vec())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_split_into_status_and_body() {
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse_response(chunked).unwrap(), (200, b"abcde".to_vec()));
        let sized = b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\nnoextra";
        assert_eq!(parse_response(sized).unwrap(), (404, b"no".to_vec()));
        assert!(
            parse_response(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n").is_err()
        );
        assert!(parse_response(b"HTTP/1.1 20").is_err());
    }

    /// A Read + Write test double: reads from a script, records what is written.
    struct Duplex<'a> {
        input: &'a [u8],
        written: Vec<u8>,
    }

    impl Read for Duplex<'_> {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            self.input.read(out)
        }
    }

    impl Write for Duplex<'_> {
        fn write(&mut self, data: &[u8]) -> io::Result<usize> {
            self.written.extend_from_slice(data);
            Ok(data.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn duplex(input: &[u8]) -> Duplex<'_> {
        Duplex {
            input,
            written: Vec::new(),
        }
    }

    #[test]
    fn answers_expect_continue_and_closes_http10() {
        let mut d =
            duplex(b"POST /x HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n");
        let mut buf = Vec::new();
        // The body arrives only after the 100 Continue, so the first read sees just the head.
        assert!(matches!(
            read_request(&mut d, &mut buf),
            Err(HttpError::Bad(_))
        ));
        assert_eq!(d.written, b"HTTP/1.1 100 Continue\r\n\r\n");
        let mut d = duplex(b"GET /version HTTP/1.0\r\n\r\n");
        let req = read_request(&mut d, &mut Vec::new()).unwrap();
        assert!(req.wants_close());
    }

    #[test]
    fn parses_pipelined_requests_with_bodies() {
        let raw = b"POST /api/v1/namespaces/default/pods?fieldSelector=spec.nodeName%3Dn1&watch=1 HTTP/1.1\r\n\
Host: x\r\nContent-Length: 2\r\n\r\n{}GET /version HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n";
        let mut src = duplex(raw);
        let mut buf = Vec::new();
        let a = read_request(&mut src, &mut buf).unwrap();
        assert_eq!(a.method, "POST");
        assert_eq!(a.query("fieldSelector"), Some("spec.nodeName=n1"));
        assert!(a.query_flag("watch"));
        assert_eq!(a.body, b"{}");
        let b = read_request(&mut src, &mut buf).unwrap();
        assert_eq!(b.path, "/version");
        assert_eq!(b.body, b"abc");
        assert!(matches!(
            read_request(&mut src, &mut buf),
            Err(HttpError::Closed)
        ));
    }

    #[test]
    fn rejects_garbage_and_oversize() {
        let mut src = duplex(b"\x00\x01 nonsense\r\n\r\n");
        assert!(matches!(
            read_request(&mut src, &mut Vec::new()),
            Err(HttpError::Bad(_))
        ));
        let mut src = duplex(b"PUT / HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n");
        assert!(matches!(
            read_request(&mut src, &mut Vec::new()),
            Err(HttpError::TooLarge)
        ));
        assert_eq!(percent_decode("a%2", false), "a%2");
        assert_eq!(percent_decode("a%zz%41", false), "a%zzA");
    }
}
