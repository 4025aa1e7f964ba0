//! The `log` backend: one line per record on stderr, level and module first.
//! Readable in journald; level from VK_LOG_LEVEL.
//!
//! Under systemd (`JOURNAL_STREAM` set) each line starts with the syslog priority prefix
//! (`<3>` for errors ...) so journald records the right priority, and carries no timestamp
//! (journald adds its own). Elsewhere lines start with a UTC timestamp.
//! Newlines inside a message are escaped so one record is always one line.

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

/// Formats one record as a single line (without the trailing newline).
pub fn format_line(
    level: Level,
    target: &str,
    message: &str,
    journald: bool,
    now: SystemTime,
) -> String {
    let mut line = String::with_capacity(64 + message.len());
    if journald {
        let prio = match level {
            Level::Error => 3,
            Level::Warn => 4,
            Level::Info => 6,
            Level::Debug | Level::Trace => 7,
        };
        line.push_str(&format!("<{prio}>"));
    } else {
        line.push_str(&crate::rfc3339::millis(now));
        line.push(' ');
    }
    line.push_str(&format!("{level:<5} {target}: "));
    for c in message.chars() {
        match c {
            '\n' => line.push_str("\\n"),
            '\r' => line.push_str("\\r"),
            c => line.push(c),
        }
    }
    line
}

impl Log for StderrLogger {
    fn enabled(&self, metadata: &Metadata) -> bool {
        metadata.level() <= self.level
    }

    fn log(&self, record: &Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let mut line = format_line(
            record.level(),
            record.target(),
            &record.args().to_string(),
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
    }
}
