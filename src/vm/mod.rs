//! The cocoon CLI contract: argv builders, JSON types, error classification, the event-stream parser.
//! Builds and parses; running the child is the reactor's job.
