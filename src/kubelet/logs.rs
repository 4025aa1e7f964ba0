//! `/containerLogs`: query parsing, the `cocoon vm logs` call, and the
//! shaping of the child's stdout (limitBytes, timestamps) into the response body.
//!
//! Pure: the server feeds child output in and writes what comes out.

use std::time::SystemTime;

use super::routes::{parse_bool, OptionError, Request};
use super::stats::rfc3339_nano;
use crate::vm::{CocoonCall, Deadlines, Verb};

/// Parsed log options.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogOptions {
    pub tail_lines: Option<u64>,
    pub limit_bytes: Option<u64>,
    pub since_seconds: Option<u64>,
    pub since_time: Option<String>,
    pub follow: bool,
    pub previous: bool,
    pub timestamps: bool,
}

/// Parses the query as the kubelet does. Errors are 400 texts.
pub fn parse_options(req: &Request) -> Result<LogOptions, OptionError> {
    let mut o = LogOptions::default();
    let invalid = |name: &str, value: &str, expected: String| OptionError::Invalid {
        name: name.to_string(),
        value: value.to_string(),
        expected: Some(expected),
    };
    let int = |name: &str, min: u64| -> Result<Option<u64>, OptionError> {
        match req.query_value(name) {
            None => Ok(None),
            Some(v) => match v.parse::<u64>() {
                Ok(n) if n >= min => Ok(Some(n)),
                _ => Err(invalid(name, v, format!("must be an integer >= {min}"))),
            },
        }
    };
    let boolean = |name: &str| -> Result<bool, OptionError> {
        match req.query_value(name) {
            None => Ok(false),
            Some(v) => parse_bool(v).ok_or_else(|| invalid(name, v, "must be a boolean".into())),
        }
    };
    o.tail_lines = int("tailLines", 0)?;
    o.limit_bytes = int("limitBytes", 1)?;
    o.since_seconds = int("sinceSeconds", 1)?;
    o.since_time = req.query_value("sinceTime").map(str::to_string);
    if o.since_time.is_some() && o.since_seconds.is_some() {
        return Err(OptionError::Refused(
            "at most one of sinceTime or sinceSeconds may be specified",
        ));
    }
    o.follow = boolean("follow")?;
    o.previous = boolean("previous")?;
    o.timestamps = boolean("timestamps")?;
    Ok(o)
}

/// `cocoon vm logs [--tail N] [-f] <id>` as the vm room's typed call. A read ends at the
/// verb's deadline (a hung cocoon must not hold the request forever); a follow stream has
/// none (it runs while the client listens). sinceSeconds / sinceTime / previous have no
/// cocoon equivalent and are ignored.
pub fn logs_call(vm_id: &str, o: &LogOptions) -> CocoonCall {
    let tail = o.tail_lines.unwrap_or(0);
    let call = CocoonCall::new(
        Verb::VmLogs,
        crate::vm::argv::vm_logs(vm_id, tail, o.follow),
        &Deadlines::configured(),
    );
    if o.follow {
        call.with_deadline(None)
    } else {
        call
    }
}

/// Shapes log bytes: prefixes lines with a timestamp when asked and stops at limitBytes.
#[derive(Clone, Debug)]
pub struct LogShaper {
    timestamps: bool,
    remaining: Option<u64>,
    at_line_start: bool,
}

impl LogShaper {
    pub fn new(o: &LogOptions) -> Self {
        LogShaper {
            timestamps: o.timestamps,
            remaining: o.limit_bytes,
            at_line_start: true,
        }
    }

    /// True once limitBytes has been reached: the response is complete.
    pub fn exhausted(&self) -> bool {
        self.remaining == Some(0)
    }

    /// Transforms one chunk of child stdout. cocoon's log file carries no per-line times, so
    /// with `timestamps` each line is stamped with the time the daemon read it.
    pub fn shape(&mut self, data: &[u8], now: SystemTime) -> Vec<u8> {
        let mut out = Vec::with_capacity(data.len() + 64);
        if self.timestamps {
            let stamp = format!("{} ", rfc3339_nano(now));
            for &b in data {
                if self.at_line_start {
                    out.extend_from_slice(stamp.as_bytes());
                }
                out.push(b);
                self.at_line_start = b == b'\n';
            }
        } else {
            out.extend_from_slice(data);
        }
        if let Some(rem) = self.remaining.as_mut() {
            if out.len() as u64 > *rem {
                out.truncate(*rem as usize);
            }
            *rem -= out.len() as u64;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubelet::routes::parse_head;

    fn req(q: &str) -> Request {
        let raw = format!("GET /containerLogs/a/b/agent?{q} HTTP/1.1\r\n\r\n");
        parse_head(raw.as_bytes()).unwrap().unwrap().0
    }

    #[test]
    fn options_and_argv() {
        let o = parse_options(&req(
            "tailLines=5&follow=true&limitBytes=10&timestamps=1&stream=All",
        ))
        .unwrap();
        let follow = logs_call("vm1", &o);
        assert_eq!(
            follow.deadline, None,
            "a follow stream runs while the client listens"
        );
        assert_eq!(
            follow.argv,
            vec!["vm", "logs", "--tail", "5", "-f", "--", "vm1"]
        );
        let o = parse_options(&req("tailLines=0")).unwrap();
        let read = logs_call("v", &o);
        assert_eq!(read.argv, vec!["vm", "logs", "--", "v"]);
        assert_eq!(
            read.deadline,
            Deadlines::configured().for_verb(Verb::VmLogs),
            "a read ends at the verb's deadline"
        );
        assert!(read.deadline.is_some());
        assert!(parse_options(&req("tailLines=-1")).is_err());
        assert!(parse_options(&req("limitBytes=0")).is_err());
        assert!(parse_options(&req("follow=yes")).is_err());
        assert!(parse_options(&req("sinceSeconds=5&sinceTime=2020-01-01T00:00:00Z")).is_err());
    }

    #[test]
    fn shaping() {
        let o = LogOptions {
            limit_bytes: Some(7),
            ..Default::default()
        };
        let mut s = LogShaper::new(&o);
        assert_eq!(s.shape(b"hello\n", SystemTime::UNIX_EPOCH), b"hello\n");
        assert_eq!(s.shape(b"world\n", SystemTime::UNIX_EPOCH), b"w");
        assert!(s.exhausted());
        let o = LogOptions {
            timestamps: true,
            ..Default::default()
        };
        let mut s = LogShaper::new(&o);
        let t = SystemTime::UNIX_EPOCH;
        assert_eq!(
            s.shape(b"a\nb", t),
            b"1970-01-01T00:00:00Z a\n1970-01-01T00:00:00Z b"
        );
        assert_eq!(s.shape(b"c\n", t), b"c\n");
    }
}
