//! Port forwarding over SPDY/3.1: the client opens an `error` and a `data` stream per forwarded
//! connection, paired by their `requestID` header, the port in the `port` header.
//!
//! A pair is announced once both streams exist; data that arrives earlier waits with it (a
//! bounded amount). The guest's bytes go out on the data stream; a failure is text on the error
//! stream; both streams end with a FIN. Data is acknowledged once written to the guest.

use std::collections::HashMap;

use super::{parse_port, Key, PfEvent, PortError};
use crate::kubelet::streams::spdy::{header, Frame, SpdyConn, PROTOCOL_ERROR, REFUSED_STREAM};

/// Forwarded connections (complete or half-created pairs) one session keeps at most.
pub const MAX_PAIRS: usize = 256;
/// Data held for a pair whose error stream has not arrived yet.
const MAX_EARLY: usize = 256 * 1024;

#[derive(Default)]
struct Pair {
    request: String,
    error: Option<u32>,
    data: Option<u32>,
    port: Option<String>,
    opened: bool,
    early: Vec<u8>,
    early_fin: bool,
    /// The client ended its data stream.
    client_done: bool,
    /// Both our streams of the pair are ended (FIN queued).
    server_done: bool,
}

#[derive(Default)]
pub struct SpdyForward {
    conn: SpdyConn,
    by_request: HashMap<String, Key>,
    pairs: HashMap<Key, Pair>,
    /// Client stream -> its pair, and whether it is the data stream.
    streams: HashMap<u32, (Key, bool)>,
    next_key: Key,
}

impl SpdyForward {
    pub fn feed(&mut self, data: &[u8], out: &mut Vec<u8>, ev: &mut Vec<PfEvent>) {
        let mut frames = Vec::new();
        self.conn.feed(data, out, &mut frames);
        for f in frames {
            match f {
                Frame::Open { id, headers, fin } => self.open(id, &headers, fin, out, ev),
                Frame::Data { id, data, fin } => self.data(id, data, fin, out, ev),
                Frame::Reset { id } => {
                    if let Some(&(key, _)) = self.streams.get(&id) {
                        if self.pairs.get(&key).is_some_and(|p| p.opened) {
                            ev.push(PfEvent::Reset { key });
                        }
                        self.remove(key);
                    }
                }
                Frame::GoAway => ev.push(PfEvent::Closed),
                Frame::Broken(why) => ev.push(PfEvent::ProtocolError(why)),
            }
        }
    }

    fn open(
        &mut self,
        id: u32,
        headers: &[(String, String)],
        fin: bool,
        out: &mut Vec<u8>,
        ev: &mut Vec<PfEvent>,
    ) {
        let is_data = match header(headers, "streamtype") {
            Some("data") => true,
            Some("error") => false,
            _ => return self.conn.reset(id, PROTOCOL_ERROR, out),
        };
        // Clients that send no requestID pair streams by id: data is the error stream's + 2.
        let request = match header(headers, "requestid") {
            Some(r) => r.to_string(),
            None if is_data => id.saturating_sub(2).to_string(),
            None => id.to_string(),
        };
        let key = match self.by_request.get(&request) {
            Some(&k) => k,
            None if self.pairs.len() >= MAX_PAIRS => {
                return self.conn.reset(id, REFUSED_STREAM, out)
            }
            None => {
                self.next_key = self.next_key.wrapping_add(1);
                let k = self.next_key;
                self.by_request.insert(request.clone(), k);
                self.pairs.insert(
                    k,
                    Pair {
                        request,
                        ..Pair::default()
                    },
                );
                k
            }
        };
        let Some(pair) = self.pairs.get_mut(&key) else {
            return self.conn.reset(id, PROTOCOL_ERROR, out);
        };
        let slot = if is_data {
            &mut pair.data
        } else {
            &mut pair.error
        };
        if slot.is_some() {
            // A second stream of the same type for one request.
            return self.conn.reset(id, PROTOCOL_ERROR, out);
        }
        *slot = Some(id);
        if is_data || pair.port.is_none() {
            if let Some(p) = header(headers, "port") {
                pair.port = Some(p.to_string());
            }
        }
        if is_data && fin {
            pair.early_fin = true;
        }
        self.streams.insert(id, (key, is_data));
        self.conn.reply(id, out);
        if pair.error.is_some() && pair.data.is_some() && !pair.opened {
            pair.opened = true;
            let port = match &pair.port {
                Some(p) => parse_port(p),
                None => Err(PortError::NoHeader),
            };
            let request = std::mem::take(&mut pair.request);
            self.by_request.remove(&request);
            ev.push(PfEvent::Open { key, port });
            let early = std::mem::take(&mut pair.early);
            if !early.is_empty() {
                ev.push(PfEvent::Data { key, data: early });
            }
            if pair.early_fin {
                self.client_ended(key, ev);
            }
        }
    }

    fn data(
        &mut self,
        id: u32,
        data: Vec<u8>,
        fin: bool,
        out: &mut Vec<u8>,
        ev: &mut Vec<PfEvent>,
    ) {
        let Some(&(key, true)) = self.streams.get(&id) else {
            // The error stream (clients write nothing on it) or a stream that is over.
            return self.conn.ack(id, data.len(), fin, out);
        };
        if fin {
            // The stream's window is not needed any more; its bytes still count for the session.
            self.conn.ack(id, 0, true, out);
        }
        let Some(pair) = self.pairs.get_mut(&key) else {
            return;
        };
        if !pair.opened {
            if pair.early.len() + data.len() > MAX_EARLY {
                for s in [pair.error, pair.data].into_iter().flatten() {
                    self.conn.reset(s, PROTOCOL_ERROR, out);
                }
                return self.remove(key);
            }
            pair.early.extend_from_slice(&data);
            pair.early_fin |= fin;
            return;
        }
        if !data.is_empty() {
            ev.push(PfEvent::Data { key, data });
        }
        if fin {
            self.client_ended(key, ev);
        }
    }

    fn client_ended(&mut self, key: Key, ev: &mut Vec<PfEvent>) {
        let Some(pair) = self.pairs.get_mut(&key) else {
            return;
        };
        if pair.client_done {
            return;
        }
        pair.client_done = true;
        ev.push(PfEvent::Eof { key });
        if pair.server_done {
            self.remove(key);
        }
    }

    fn remove(&mut self, key: Key) {
        if let Some(p) = self.pairs.remove(&key) {
            for s in [p.error, p.data].into_iter().flatten() {
                self.streams.remove(&s);
            }
            if !p.request.is_empty() {
                self.by_request.remove(&p.request);
            }
        }
    }

    pub fn send(&mut self, key: Key, data: &[u8], out: &mut Vec<u8>) {
        if let Some(p) = self.pairs.get(&key).filter(|p| p.opened && !p.server_done) {
            if let Some(id) = p.data {
                self.conn.send(id, data, false, out);
            }
        }
    }

    /// Ends both of our streams of a connection, with `message` on the error stream first.
    pub fn end(&mut self, key: Key, message: Option<&str>, out: &mut Vec<u8>) {
        let Some(p) = self.pairs.get_mut(&key).filter(|p| !p.server_done) else {
            return;
        };
        p.server_done = true;
        let (error, data, client_done) = (p.error, p.data, p.client_done);
        if let Some(id) = data {
            self.conn.send(id, &[], true, out);
        }
        if let Some(id) = error {
            self.conn
                .send(id, message.unwrap_or("").as_bytes(), true, out);
        }
        if client_done {
            self.remove(key);
        }
    }

    pub fn consumed(&mut self, key: Key, n: usize, out: &mut Vec<u8>) {
        let id = self.pairs.get(&key).and_then(|p| p.data).unwrap_or(0);
        self.conn.ack(id, n, false, out);
    }

    pub fn pending_output(&self) -> usize {
        self.conn.pending_output()
    }

    pub fn done(&self) -> bool {
        self.conn.done()
    }

    /// Forwarded connections this session keeps (for tests).
    pub fn pairs(&self) -> usize {
        self.pairs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubelet::streams::spdy::{control, data_frame, dictionary, FLAG_FIN, SYN_STREAM};
    use flate2::{Compress, Compression, FlushCompress};

    fn syn(c: &mut Compress, id: u32, headers: &[(&str, &str)], flags: u8) -> Vec<u8> {
        let mut raw = (headers.len() as u32).to_be_bytes().to_vec();
        for (k, v) in headers {
            raw.extend_from_slice(&(k.len() as u32).to_be_bytes());
            raw.extend_from_slice(k.as_bytes());
            raw.extend_from_slice(&(v.len() as u32).to_be_bytes());
            raw.extend_from_slice(v.as_bytes());
        }
        let mut block = Vec::with_capacity(1024);
        c.compress_vec(&raw, &mut block, FlushCompress::Sync)
            .unwrap();
        let mut p = id.to_be_bytes().to_vec();
        p.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
        p.extend(block);
        let mut f = Vec::new();
        control(SYN_STREAM, flags, &p, &mut f);
        f
    }

    /// (stream id, flags, payload) of every data frame in `out`.
    fn data_frames(out: &[u8]) -> Vec<(u32, u8, Vec<u8>)> {
        let mut at = 0;
        let mut v = Vec::new();
        while at + 8 <= out.len() {
            let len = u32::from_be_bytes([0, out[at + 5], out[at + 6], out[at + 7]]) as usize;
            if out[at] & 0x80 == 0 {
                let id = u32::from_be_bytes([out[at], out[at + 1], out[at + 2], out[at + 3]]);
                v.push((id, out[at + 4], out[at + 8..at + 8 + len].to_vec()));
            }
            at += 8 + len;
        }
        v
    }

    #[test]
    fn pairs_by_request_id_with_ports_and_ends() {
        let mut c = Compress::new(Compression::default(), true);
        c.set_dictionary(&dictionary()).unwrap();
        let mut s = SpdyForward::default();
        let (mut out, mut ev) = (Vec::new(), Vec::new());
        let mut b = syn(
            &mut c,
            1,
            &[("streamType", "error"), ("port", "22"), ("requestID", "0")],
            0,
        );
        b.extend(syn(
            &mut c,
            3,
            &[
                ("streamType", "error"),
                ("port", "99999"),
                ("requestID", "1"),
            ],
            0,
        ));
        b.extend(syn(
            &mut c,
            5,
            &[("streamType", "data"), ("port", "22"), ("requestID", "0")],
            0,
        ));
        data_frame(5, 0, b"ping", &mut b);
        b.extend(syn(
            &mut c,
            7,
            &[
                ("streamType", "data"),
                ("port", "99999"),
                ("requestID", "1"),
            ],
            0,
        ));
        b.extend(syn(&mut c, 9, &[("streamType", "resize")], 0));
        data_frame(5, FLAG_FIN, b"", &mut b);
        for piece in b.chunks(5) {
            s.feed(piece, &mut out, &mut ev);
        }
        assert_eq!(
            ev,
            vec![
                PfEvent::Open {
                    key: 1,
                    port: Ok(22)
                },
                PfEvent::Data {
                    key: 1,
                    data: b"ping".to_vec()
                },
                PfEvent::Open {
                    key: 2,
                    port: Err(PortError::Invalid("99999".into()))
                },
                PfEvent::Eof { key: 1 },
            ]
        );
        out.clear();
        s.fail(2, "bad port", &mut out);
        s.send(1, b"pong", &mut out);
        s.end(1, None, &mut out);
        assert_eq!(
            data_frames(&out),
            vec![
                (7, FLAG_FIN, vec![]),
                (3, FLAG_FIN, b"bad port".to_vec()),
                (5, 0, b"pong".to_vec()),
                (5, FLAG_FIN, vec![]),
                (1, FLAG_FIN, vec![]),
            ]
        );
        assert_eq!(s.pairs(), 1, "the failed pair waits for the client's end");
    }

    impl SpdyForward {
        fn fail(&mut self, key: Key, m: &str, out: &mut Vec<u8>) {
            self.end(key, Some(m), out)
        }
    }
}
