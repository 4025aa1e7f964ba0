//! Streaming ustar / PAX tar reader and writer for cocoon's export and import archives.
//! Bodies are streamed, never buffered whole; knows nothing about registries or layers.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};

const BLOCK: usize = 512;
/// Largest size the 11-digit octal ustar field holds; beyond it a PAX `size` record is written.
const USTAR_MAX_SIZE: u64 = 0o77777777777;
/// PAX extended headers bigger than this are refused (they only carry names and sparse maps).
const MAX_PAX_BYTES: u64 = 16 << 20;

/// One archive member as the reader saw it (PAX records already applied).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TarEntry {
    pub name: String,
    pub size: u64,
    pub mode: u32,
    /// ustar type flag: `b'0'` or `0` for regular files.
    pub typeflag: u8,
    /// PAX records other than `path` and `size` (e.g. `COCOON.sparse.map`).
    pub pax: BTreeMap<String, String>,
}

impl TarEntry {
    pub fn is_regular(&self) -> bool {
        self.typeflag == b'0' || self.typeflag == 0 || self.typeflag == b'7'
    }
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// Reads a tar stream member by member; each member body is read through [`TarReader::body`].
pub struct TarReader<R: Read> {
    inner: R,
    remaining: u64,
    padding: u64,
    finished: bool,
}

impl<R: Read> TarReader<R> {
    pub fn new(inner: R) -> Self {
        TarReader {
            inner,
            remaining: 0,
            padding: 0,
            finished: false,
        }
    }

    /// Gives the underlying reader back (e.g. to drain or close a child's stdout).
    pub fn into_inner(self) -> R {
        self.inner
    }

    /// Advances to the next member, skipping whatever of the current body was not read.
    /// `Ok(None)` at the end-of-archive marker; a stream that ends without one is an error.
    pub fn next_entry(&mut self) -> io::Result<Option<TarEntry>> {
        if self.finished {
            return Ok(None);
        }
        let skip = self.remaining + self.padding;
        if skip > 0 {
            let copied = io::copy(&mut (&mut self.inner).take(skip), &mut io::sink())?;
            if copied != skip {
                return Err(early_eof());
            }
            self.remaining = 0;
            self.padding = 0;
        }
        let mut pax: BTreeMap<String, String> = BTreeMap::new();
        let mut long_name: Option<String> = None;
        loop {
            let mut block = [0u8; BLOCK];
            read_exact_or_eof(&mut self.inner, &mut block)?;
            if block.iter().all(|&b| b == 0) {
                self.finished = true;
                return Ok(None);
            }
            verify_checksum(&block)?;
            let size = parse_numeric(&block[124..136])?;
            let typeflag = block[156];
            let padded = size.div_ceil(BLOCK as u64) * BLOCK as u64;
            match typeflag {
                b'x' | b'g' | b'L' => {
                    if size > MAX_PAX_BYTES {
                        return Err(bad(format!("tar extended header too large ({size} bytes)")));
                    }
                    let mut buf = vec![0u8; padded as usize];
                    self.inner.read_exact(&mut buf).map_err(eof_to_early)?;
                    buf.truncate(size as usize);
                    if typeflag == b'x' {
                        parse_pax(&buf, &mut pax)?;
                    } else if typeflag == b'L' {
                        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
                        long_name = Some(String::from_utf8_lossy(&buf[..end]).into_owned());
                    }
                    // Global headers ('g') carry nothing cocoon uses.
                    continue;
                }
                _ => {}
            }
            let mut name = cstr(&block[0..100]);
            if &block[257..262] == b"ustar" {
                let prefix = cstr(&block[345..500]);
                if !prefix.is_empty() {
                    name = format!("{prefix}/{name}");
                }
            }
            if let Some(n) = long_name.take() {
                name = n;
            }
            if let Some(p) = pax.remove("path") {
                name = p;
            }
            let size = match pax.remove("size") {
                Some(s) => s
                    .parse::<u64>()
                    .map_err(|_| bad(format!("bad PAX size {s:?}")))?,
                None => size,
            };
            let mode = parse_numeric(&block[100..108])? as u32;
            self.remaining = size;
            self.padding = size.div_ceil(BLOCK as u64) * BLOCK as u64 - size;
            return Ok(Some(TarEntry {
                name,
                size,
                mode,
                typeflag,
                pax,
            }));
        }
    }

    /// Reads from the current member's body; 0 at its end. The underlying stream ending
    /// before the body does is an `UnexpectedEof` error ("tar stream ended early").
    pub fn read_body(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.remaining == 0 || buf.is_empty() {
            return Ok(0);
        }
        let want = buf
            .len()
            .min(self.remaining.min(usize::MAX as u64) as usize);
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(early_eof());
        }
        self.remaining -= n as u64;
        Ok(n)
    }

    /// Fills `buf` completely from the body, or returns fewer bytes only at the body's end.
    pub fn read_body_full(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut filled = 0;
        while filled < buf.len() {
            let n = self.read_body(&mut buf[filled..])?;
            if n == 0 {
                break;
            }
            filled += n;
        }
        Ok(filled)
    }

    /// The current member body as a `Read`.
    pub fn body(&mut self) -> BodyReader<'_, R> {
        BodyReader { tar: self }
    }
}

/// `Read` adapter over the current member body.
pub struct BodyReader<'a, R: Read> {
    tar: &'a mut TarReader<R>,
}

impl<R: Read> Read for BodyReader<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.tar.read_body(buf)
    }
}

fn early_eof() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "tar stream ended early")
}

fn eof_to_early(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        early_eof()
    } else {
        e
    }
}

fn read_exact_or_eof<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]) {
            Ok(0) => return Err(early_eof()),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn cstr(field: &[u8]) -> String {
    let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end]).into_owned()
}

/// Octal (space / NUL padded) or GNU base-256 numeric field.
fn parse_numeric(field: &[u8]) -> io::Result<u64> {
    if field.first().is_some_and(|&b| b & 0x80 != 0) {
        let mut v: u64 = (field[0] & 0x7f) as u64;
        for &b in &field[1..] {
            v = v
                .checked_mul(256)
                .and_then(|v| v.checked_add(b as u64))
                .ok_or_else(|| bad("tar numeric field overflows"))?;
        }
        return Ok(v);
    }
    let s: Vec<u8> = field
        .iter()
        .copied()
        .filter(|&b| b != 0 && b != b' ')
        .collect();
    if s.is_empty() {
        return Ok(0);
    }
    let text = std::str::from_utf8(&s).map_err(|_| bad("tar numeric field is not text"))?;
    u64::from_str_radix(text, 8).map_err(|_| bad(format!("bad tar numeric field {text:?}")))
}

fn verify_checksum(block: &[u8; BLOCK]) -> io::Result<()> {
    let stored = parse_numeric(&block[148..156])?;
    let mut sum: u64 = 0;
    for (i, &b) in block.iter().enumerate() {
        sum += if (148..156).contains(&i) {
            b' ' as u64
        } else {
            b as u64
        };
    }
    if sum != stored {
        return Err(bad("tar header checksum mismatch (not a tar stream?)"));
    }
    Ok(())
}

fn parse_pax(mut buf: &[u8], out: &mut BTreeMap<String, String>) -> io::Result<()> {
    while !buf.is_empty() {
        let sp = buf
            .iter()
            .position(|&b| b == b' ')
            .ok_or_else(|| bad("bad PAX record"))?;
        let len: usize = std::str::from_utf8(&buf[..sp])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad("bad PAX record length"))?;
        if len <= sp + 1 || len > buf.len() || buf[len - 1] != b'\n' {
            return Err(bad("bad PAX record length"));
        }
        let rec = &buf[sp + 1..len - 1];
        let eq = rec
            .iter()
            .position(|&b| b == b'=')
            .ok_or_else(|| bad("bad PAX record"))?;
        let key = String::from_utf8_lossy(&rec[..eq]).into_owned();
        let val = String::from_utf8_lossy(&rec[eq + 1..]).into_owned();
        out.insert(key, val);
        buf = &buf[len..];
    }
    Ok(())
}

fn pax_record(key: &str, val: &str) -> Vec<u8> {
    let body = format!(" {key}={val}\n");
    // The length prefix counts its own digits.
    let mut len = body.len() + 1;
    loop {
        let total = body.len() + len.to_string().len();
        if total == len {
            break;
        }
        len = total;
    }
    format!("{len}{body}").into_bytes()
}

/// Writes a tar stream; each member is `begin_entry`, body writes, `end_entry`.
pub struct TarWriter<W: Write> {
    inner: W,
    expected: u64,
    written: u64,
}

impl<W: Write> TarWriter<W> {
    pub fn new(inner: W) -> Self {
        TarWriter {
            inner,
            expected: 0,
            written: 0,
        }
    }

    /// Writes a member header (with a PAX header first when records are given, the name does
    /// not fit in 100 bytes, or the size exceeds the ustar octal range).
    pub fn begin_entry(
        &mut self,
        name: &str,
        size: u64,
        mode: u32,
        mtime: u64,
        pax: &[(String, String)],
    ) -> io::Result<()> {
        let mut records: Vec<u8> = Vec::new();
        for (k, v) in pax {
            records.extend_from_slice(&pax_record(k, v));
        }
        if name.len() > 100 {
            records.extend_from_slice(&pax_record("path", name));
        }
        if size > USTAR_MAX_SIZE {
            records.extend_from_slice(&pax_record("size", &size.to_string()));
        }
        if !records.is_empty() {
            let mut pax_name = format!("PaxHeaders.0/{name}");
            truncate_utf8(&mut pax_name, 100);
            let h = ustar_header(&pax_name, records.len() as u64, 0o644, mtime, b'x');
            self.inner.write_all(&h)?;
            self.inner.write_all(&records)?;
            self.pad(records.len() as u64)?;
        }
        let mut short = name.to_string();
        truncate_utf8(&mut short, 100);
        let header_size = if size > USTAR_MAX_SIZE { 0 } else { size };
        self.inner
            .write_all(&ustar_header(&short, header_size, mode, mtime, b'0'))?;
        self.expected = size;
        self.written = 0;
        Ok(())
    }

    /// Writes body bytes of the current member; writing past its declared size is an error.
    pub fn write_body(&mut self, data: &[u8]) -> io::Result<()> {
        if self.written + data.len() as u64 > self.expected {
            return Err(bad(format!(
                "tar member body exceeds its declared size {}",
                self.expected
            )));
        }
        self.inner.write_all(data)?;
        self.written += data.len() as u64;
        Ok(())
    }

    /// Closes the member: the body must have exactly its declared size.
    pub fn end_entry(&mut self) -> io::Result<()> {
        if self.written != self.expected {
            return Err(bad(format!(
                "tar member body has {} bytes, declared {}",
                self.written, self.expected
            )));
        }
        self.pad(self.expected)
    }

    /// Writes the end-of-archive marker and flushes.
    pub fn finish(mut self) -> io::Result<W> {
        self.inner.write_all(&[0u8; BLOCK * 2])?;
        self.inner.flush()?;
        Ok(self.inner)
    }

    fn pad(&mut self, size: u64) -> io::Result<()> {
        let rem = (size % BLOCK as u64) as usize;
        if rem != 0 {
            self.inner.write_all(&[0u8; BLOCK][..BLOCK - rem])?;
        }
        Ok(())
    }
}

/// `Write` adapter over the current member body of a [`TarWriter`].
impl<W: Write> Write for TarWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_body(buf)?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

fn truncate_utf8(s: &mut String, max: usize) {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
}

fn ustar_header(name: &str, size: u64, mode: u32, mtime: u64, typeflag: u8) -> [u8; BLOCK] {
    let mut h = [0u8; BLOCK];
    h[..name.len()].copy_from_slice(name.as_bytes());
    put_octal(&mut h[100..108], mode as u64 & 0o7777777);
    put_octal(&mut h[108..116], 0);
    put_octal(&mut h[116..124], 0);
    put_octal(&mut h[124..136], size);
    put_octal(&mut h[136..148], mtime.min(0o77777777777));
    h[156] = typeflag;
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[148..156].copy_from_slice(b"        ");
    let sum: u64 = h.iter().map(|&b| b as u64).sum();
    let cks = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(cks.as_bytes());
    h
}

fn put_octal(field: &mut [u8], v: u64) {
    let digits = field.len() - 1;
    let s = format!("{v:0digits$o}");
    field[..digits].copy_from_slice(&s.as_bytes()[s.len() - digits..]);
    field[digits] = 0;
}

#[cfg(test)]
mod tests {
    use super::*;

    type Member<'a> = (&'a str, &'a [u8], u32, Vec<(String, String)>);

    fn build(entries: &[Member<'_>]) -> Vec<u8> {
        let mut w = TarWriter::new(Vec::new());
        for (name, body, mode, pax) in entries {
            w.begin_entry(name, body.len() as u64, *mode, 1_700_000_000, pax)
                .unwrap();
            w.write_body(body).unwrap();
            w.end_entry().unwrap();
        }
        w.finish().unwrap()
    }

    #[test]
    fn round_trip_with_pax_and_long_names() {
        let long = "d/".repeat(80) + "file.raw";
        let sparse = vec![
            (
                "COCOON.sparse.map".to_string(),
                "[{\"o\":0,\"l\":3}]".to_string(),
            ),
            ("COCOON.sparse.size".to_string(), "4096".to_string()),
        ];
        let data = build(&[
            ("snapshot.json", b"{}\n", 0o644, vec![]),
            ("mem", b"abc", 0o600, sparse.clone()),
            (&long, &[7u8; 1000], 0o640, vec![]),
        ]);
        let mut r = TarReader::new(&data[..]);
        let e = r.next_entry().unwrap().unwrap();
        assert_eq!(
            (e.name.as_str(), e.size, e.mode),
            ("snapshot.json", 3, 0o644)
        );
        // Skipping an unread body works.
        let e = r.next_entry().unwrap().unwrap();
        assert_eq!(e.name, "mem");
        assert_eq!(
            e.pax.get("COCOON.sparse.size").map(String::as_str),
            Some("4096")
        );
        let mut body = Vec::new();
        r.body().read_to_end(&mut body).unwrap();
        assert_eq!(body, b"abc");
        let e = r.next_entry().unwrap().unwrap();
        assert_eq!(e.name, long);
        assert_eq!(e.size, 1000);
        assert!(r.next_entry().unwrap().is_none());
    }

    #[test]
    fn truncated_stream_is_an_error() {
        let data = build(&[("a", &[1u8; 2000], 0o644, vec![])]);
        let cut = &data[..512 + 700];
        let mut r = TarReader::new(cut);
        r.next_entry().unwrap().unwrap();
        let mut body = Vec::new();
        let err = r.body().read_to_end(&mut body).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        // No end-of-archive marker is also early EOF.
        let data = build(&[("a", b"x", 0o644, vec![])]);
        let mut r = TarReader::new(&data[..1024]);
        r.next_entry().unwrap().unwrap();
        assert_eq!(
            r.next_entry().unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
    }

    #[test]
    fn corrupt_header_and_body_overrun_are_refused() {
        let mut data = build(&[("a", b"x", 0o644, vec![])]);
        data[10] ^= 0xff;
        assert!(TarReader::new(&data[..]).next_entry().is_err());
        let mut w = TarWriter::new(Vec::new());
        w.begin_entry("a", 1, 0o644, 0, &[]).unwrap();
        assert!(w.write_body(b"xy").is_err());
        assert!(w.end_entry().is_err());
    }

    #[test]
    fn pax_record_length_counts_itself() {
        let r = pax_record("path", "x");
        assert_eq!(r, b"9 path=x\n");
        let r = pax_record("k", &"v".repeat(95));
        let s = String::from_utf8(r.clone()).unwrap();
        assert_eq!(
            s.split(' ').next().unwrap().parse::<usize>().unwrap(),
            r.len()
        );
    }
}
