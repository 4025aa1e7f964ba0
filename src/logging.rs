//! The `log` backend: one line per record on stderr, level and module first.
//! Readable in journald; level from VK_LOG_LEVEL.
