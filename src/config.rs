//! Every environment variable the daemon reads: defaults, validation, clear errors.
//! Owns parsing only; never touches the network, the runtime or the clock.
