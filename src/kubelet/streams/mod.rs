//! The framings the streaming routes share: SPDY/3.1 connections and RFC 6455 WebSocket
//! frames, as pure byte-level state machines (exec / attach and port-forward build on them).

pub mod spdy;
pub mod websocket;
