//! The `log` backend: one line per record on stderr, level and module first.
//! Readable in journald; level from VK_LOG_LEVEL.
//!
//! Under systemd (`JOURNAL_STREAM` set) each line starts with the syslog priority prefix
//! (`<3>` for errors ...) so journald records the right priority, and carries no timestamp
//! (journald adds its own). Elsewhere lines start with a UTC timestamp.
//! Newlines inside a message are escaped so one record is always one line.
//! `debug` is the daemon's own debug: the libraries' debug records (ureq's request and response
//! dumps, one set per API call) are written at `trace` only.

use std::fmt;
use std::io::Write;
use std::time::SystemTime;

use log::{Level, LevelFilter, Log, Metadata, Record};

/// `VK_LOG_LEVEL` could not be used. Main prints `log setup: <this>` and exits 1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogSetupError(pub String);

impl fmt::Display for LogSetupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LogSetupError {}

/// Parses a level name, trimmed and case-insensitive; empty means `info`.
/// Go-style names are accepted too: `warning`, and `fatal`/`panic` as `error`.
pub fn parse_level(text: &str) -> Result<LevelFilter, LogSetupError> {
    match text.trim().to_ascii_lowercase().as_str() {
        "" | "info" => Ok(LevelFilter::Info),
        "trace" => Ok(LevelFilter::Trace),
        "debug" => Ok(LevelFilter::Debug),
        "warn" | "warning" => Ok(LevelFilter::Warn),
        "error" | "fatal" | "panic" => Ok(LevelFilter::Error),
        "off" | "none" => Ok(LevelFilter::Off),
        _ => Err(LogSetupError(format!(
            "invalid VK_LOG_LEVEL {text:?}: use trace, debug, info, warn, error or off"
        ))),
    }
}

struct StderrLogger {
    level: LevelFilter,
    journald: bool,
}

/// Whether a record of `level` from `target` is written at `max`: the daemon's own records up
/// to `max`; a library's up to `info` unless `max` is `trace` (at `debug`, ureq alone wrote
/// three Debug-formatted lines per API call, a third of the kube workers' CPU in the bench).
pub fn wanted(level: Level, target: &str, max: LevelFilter) -> bool {
    if level > max {
        return false;
    }
    // The library and its two binaries (`vk_cocoon::…`, `vk_cocoon_sandbox`).
    let krate = target.split("::").next().unwrap_or(target);
    let ours = krate == "vk_cocoon" || krate == "vk_cocoon_sandbox";
    ours || level <= Level::Info || max == LevelFilter::Trace
}

/// Formats one record as a single line (without the trailing newline).
pub fn format_line(
    level: Level,
    target: &str,
    message: &str,
    journald: bool,
    now: SystemTime,
) -> String {
    let mut line = String::with_capacity(64 + message.len());
    write_line(
        &mut line,
        level,
        target,
        format_args!("{message}"),
        journald,
        now,
    );
    line
}

/// Appends one record's line (without the trailing newline) to `line`: the message is
/// formatted straight into it, with newlines escaped as they come.
fn write_line(
    line: &mut String,
    level: Level,
    target: &str,
    message: fmt::Arguments<'_>,
    journald: bool,
    now: SystemTime,
) {
    use fmt::Write as _;
    if journald {
        let prio = match level {
            Level::Error => 3,
            Level::Warn => 4,
            Level::Info => 6,
            Level::Debug | Level::Trace => 7,
        };
        let _ = write!(line, "<{prio}>");
    } else {
        line.push_str(&crate::rfc3339::millis(now));
        line.push(' ');
    }
    let _ = write!(line, "{level:<5} {target}: ");
    let _ = OneLine(line).write_fmt(message);
}

/// Writes text with `\n` and `\r` escaped, so a message stays on its line.
struct OneLine<'a>(&'a mut String);

impl fmt::Write for OneLine<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for part in s.split_inclusive(['\n', '\r']) {
            match part.as_bytes().last() {
                Some(b'\n') => {
                    self.0.push_str(&part[..part.len() - 1]);
                    self.0.push_str("\\n");
                }
                Some(b'\r') => {
                    self.0.push_str(&part[..part.len() - 1]);
                    self.0.push_str("\\r");
                }
                _ => self.0.push_str(part),
            }
        }
        Ok(())
    }
}

impl Log for StderrLogger {
    fn enabled(&self, metadata: &Metadata) -> bool {
        wanted(metadata.level(), metadata.target(), self.level)
    }

    fn log(&self, record: &Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let mut line = String::with_capacity(160);
        write_line(
            &mut line,
            record.level(),
            record.target(),
            *record.args(),
            self.journald,
            crate::wall_clock::now(),
        );
        line.push('\n');
        // One write per record keeps lines whole when threads log at once.
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }

    fn flush(&self) {
        let _ = std::io::stderr().flush();
    }
}

/// Installs the logger at `level_text` (the raw VK_LOG_LEVEL value, None = info).
pub fn init(level_text: Option<&str>) -> Result<LevelFilter, LogSetupError> {
    let level = parse_level(level_text.unwrap_or(""))?;
    let logger = StderrLogger {
        level,
        journald: std::env::var_os("JOURNAL_STREAM").is_some(),
    };
    log::set_boxed_logger(Box::new(logger)).map_err(|e| LogSetupError(e.to_string()))?;
    log::set_max_level(level);
    Ok(level)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    #[test]
    fn levels() {
        assert_eq!(parse_level(""), Ok(LevelFilter::Info));
        assert_eq!(parse_level(" DEBUG "), Ok(LevelFilter::Debug));
        assert_eq!(parse_level("warning"), Ok(LevelFilter::Warn));
        assert_eq!(parse_level("fatal"), Ok(LevelFilter::Error));
        assert_eq!(parse_level("off"), Ok(LevelFilter::Off));
        let e = parse_level("loud").unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid VK_LOG_LEVEL \"loud\": use trace, debug, info, warn, error or off"
        );
    }

    #[test]
    fn one_line_per_record() {
        let line = format_line(Level::Warn, "vk_cocoon::x", "a\nb\r", false, UNIX_EPOCH);
        assert_eq!(
            line,
            "1970-01-01T00:00:00.000Z WARN  vk_cocoon::x: a\\nb\\r"
        );
        let line = format_line(Level::Error, "m", "boom", true, UNIX_EPOCH);
        assert_eq!(line, "<3>ERROR m: boom");
        let line = format_line(Level::Info, "m", "\r\n\nx\n", false, UNIX_EPOCH);
        assert_eq!(line, "1970-01-01T00:00:00.000Z INFO  m: \\r\\n\\nx\\n");
    }

    #[test]
    fn a_librarys_debug_records_are_written_at_trace_only() {
        use LevelFilter as F;
        for target in ["vk_cocoon", "vk_cocoon::kube::client", "vk_cocoon_sandbox"] {
            assert!(wanted(Level::Debug, target, F::Debug), "{target}");
            assert!(!wanted(Level::Trace, target, F::Debug), "{target}");
        }
        assert!(!wanted(Level::Debug, "ureq::run", F::Debug));
        assert!(!wanted(Level::Debug, "vk_cocoonish", F::Debug));
        assert!(wanted(Level::Debug, "ureq::run", F::Trace));
        assert!(wanted(Level::Info, "ureq::run", F::Debug));
        assert!(wanted(Level::Warn, "rustls::conn", F::Warn));
        assert!(!wanted(Level::Info, "ureq::run", F::Warn));
    }
}
