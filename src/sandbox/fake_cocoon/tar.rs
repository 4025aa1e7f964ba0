//! Minimal ustar writer and reader for snapshot archives of the fake cocoon (the ustar layout cocoon's snapshot export uses).
//! Regular files only, flat names; streams data without holding whole files in memory.

use std::io::{self, Read, Write};

const BLOCK: usize = 512;

fn octal(field: &mut [u8], value: u64) {
    let width = field.len() - 1;
    let s = format!("{value:0width$o}");
    let bytes = s.as_bytes();
    let start = bytes.len().saturating_sub(width);
    field[..width].copy_from_slice(&bytes[start..]);
    field[width] = 0;
}

/// Writes one member header for a regular file.
pub fn write_header<W: Write>(out: &mut W, name: &str, size: u64, mode: u32) -> io::Result<()> {
    write_typed_header(out, name, size, mode, b'0')
}

/// Writes a PAX extended header (`x`) carrying `records` for the member that follows.
pub fn write_pax<W: Write>(
    out: &mut W,
    name: &str,
    records: &[(String, String)],
) -> io::Result<()> {
    let mut body = Vec::new();
    for (k, v) in records {
        // "<len> <key>=<value>\n" where len counts the whole record, its own digits included.
        let rest = k.len() + v.len() + 3;
        let mut len = rest + rest.to_string().len();
        if len.to_string().len() + rest != len {
            len += 1;
        }
        body.extend_from_slice(format!("{len} {k}={v}\n").as_bytes());
    }
    let mut pax_name = format!("PaxHeaders.0/{name}");
    pax_name.truncate(100);
    write_typed_header(out, &pax_name, body.len() as u64, 0o644, b'x')?;
    out.write_all(&body)?;
    write_padding(out, body.len() as u64)
}

/// Parses PAX records (`<len> <key>=<value>\n`...); malformed input is an error.
pub fn parse_pax(body: &[u8]) -> io::Result<Vec<(String, String)>> {
    let bad = || io::Error::new(io::ErrorKind::InvalidData, "malformed PAX record");
    let mut out = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let sp = rest.iter().position(|b| *b == b' ').ok_or_else(bad)?;
        let len: usize = std::str::from_utf8(&rest[..sp])
            .ok()
            .and_then(|t| t.parse().ok())
            .filter(|l| *l > sp + 1 && *l <= rest.len())
            .ok_or_else(bad)?;
        let rec = &rest[sp + 1..len];
        let rec = rec.strip_suffix(b"\n").ok_or_else(bad)?;
        let eq = rec.iter().position(|b| *b == b'=').ok_or_else(bad)?;
        out.push((
            String::from_utf8_lossy(&rec[..eq]).into_owned(),
            String::from_utf8_lossy(&rec[eq + 1..]).into_owned(),
        ));
        rest = &rest[len..];
    }
    Ok(out)
}

fn write_typed_header<W: Write>(
    out: &mut W,
    name: &str,
    size: u64,
    mode: u32,
    kind: u8,
) -> io::Result<()> {
    if name.len() > 100 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "tar name too long",
        ));
    }
    let mut h = [0u8; BLOCK];
    h[..name.len()].copy_from_slice(name.as_bytes());
    octal(&mut h[100..108], mode as u64);
    octal(&mut h[108..116], 0);
    octal(&mut h[116..124], 0);
    octal(&mut h[124..136], size);
    octal(&mut h[136..148], 0);
    h[156] = kind;
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[148..156].copy_from_slice(b"        ");
    let sum: u32 = h.iter().map(|b| *b as u32).sum();
    let cs = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(cs.as_bytes());
    out.write_all(&h)
}

/// Pads a member of `size` bytes to the block boundary.
pub fn write_padding<W: Write>(out: &mut W, size: u64) -> io::Result<()> {
    let pad = (BLOCK - (size as usize % BLOCK)) % BLOCK;
    out.write_all(&[0u8; BLOCK][..pad])
}

/// Writes a whole in-memory member.
pub fn write_member<W: Write>(out: &mut W, name: &str, data: &[u8], mode: u32) -> io::Result<()> {
    write_header(out, name, data.len() as u64, mode)?;
    out.write_all(data)?;
    write_padding(out, data.len() as u64)
}

/// Streams a member from a reader of known size.
pub fn write_member_from<W: Write, R: Read>(
    out: &mut W,
    name: &str,
    size: u64,
    mode: u32,
    data: &mut R,
) -> io::Result<()> {
    write_header(out, name, size, mode)?;
    let copied = io::copy(&mut data.take(size), out)?;
    if copied != size {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "file shrank while exporting",
        ));
    }
    write_padding(out, size)
}

/// Ends the archive (two zero blocks).
pub fn finish<W: Write>(out: &mut W) -> io::Result<()> {
    out.write_all(&[0u8; BLOCK * 2])
}

/// One member header read from an archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    pub size: u64,
    /// `b'0'` or 0 for regular files.
    pub kind: u8,
    /// Permission bits from the header.
    pub mode: u32,
}

fn parse_octal(field: &[u8]) -> io::Result<u64> {
    let s: String = field
        .iter()
        .take_while(|b| **b != 0)
        .map(|b| *b as char)
        .collect();
    let t = s.trim();
    if t.is_empty() {
        return Ok(0);
    }
    u64::from_str_radix(t, 8)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad octal field in tar header"))
}

/// What [`next_header`] found where a header block was due.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    Entry(Entry),
    /// A zero block: the end-of-archive marker.
    End,
    /// A clean EOF on a block boundary, with no end-of-archive marker.
    Eof,
}

/// Reads the next header; `None` at the end-of-archive marker or a clean EOF.
pub fn next_entry<R: Read + ?Sized>(input: &mut R) -> io::Result<Option<Entry>> {
    Ok(match next_header(input)? {
        Next::Entry(e) => Some(e),
        Next::End | Next::Eof => None,
    })
}

/// Reads the next header, telling the end-of-archive marker from a stream that just stops.
pub fn next_header<R: Read + ?Sized>(input: &mut R) -> io::Result<Next> {
    let mut h = [0u8; BLOCK];
    let mut got = 0;
    while got < BLOCK {
        let n = input.read(&mut h[got..])?;
        if n == 0 {
            if got == 0 {
                return Ok(Next::Eof);
            }
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "truncated tar header",
            ));
        }
        got += n;
    }
    if h.iter().all(|b| *b == 0) {
        return Ok(Next::End);
    }
    let stored = parse_octal(&h[148..156])?;
    let mut sum: u64 = 0;
    for (i, b) in h.iter().enumerate() {
        sum += if (148..156).contains(&i) {
            32
        } else {
            *b as u64
        };
    }
    if sum != stored {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "tar header checksum mismatch",
        ));
    }
    let name_end = h[..100].iter().position(|b| *b == 0).unwrap_or(100);
    let mut name = String::from_utf8_lossy(&h[..name_end]).into_owned();
    if &h[257..262] == b"ustar" && h[345] != 0 {
        let pend = h[345..500].iter().position(|b| *b == 0).unwrap_or(155);
        name = format!("{}/{}", String::from_utf8_lossy(&h[345..345 + pend]), name);
    }
    Ok(Next::Entry(Entry {
        name,
        size: parse_octal(&h[124..136])?,
        kind: h[156],
        mode: (parse_octal(&h[100..108])? & 0o7777) as u32,
    }))
}

/// Copies the member body to `out` (or discards it) and skips the padding.
pub fn copy_body<R: Read + ?Sized, W: Write + ?Sized>(
    input: &mut R,
    size: u64,
    out: &mut W,
) -> io::Result<()> {
    let copied = io::copy(&mut (&mut *input).take(size), out)?;
    if copied != size {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "truncated tar member",
        ));
    }
    let pad = (BLOCK as u64 - size % BLOCK as u64) % BLOCK as u64;
    let skipped = io::copy(&mut (&mut *input).take(pad), &mut io::sink())?;
    if skipped != pad {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "truncated tar padding",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let mut buf = Vec::new();
        write_member(&mut buf, "snapshot.json", b"{}\n", 0o644).unwrap();
        let big = vec![7u8; 1000];
        write_pax(
            &mut buf,
            "mem",
            &[("COCOON.sparse.size".into(), "8192".into())],
        )
        .unwrap();
        write_member_from(&mut buf, "mem", 1000, 0o600, &mut &big[..]).unwrap();
        finish(&mut buf).unwrap();
        assert_eq!(buf.len() % 512, 0);
        let mut r = &buf[..];
        let e = next_entry(&mut r).unwrap().unwrap();
        assert_eq!((e.name.as_str(), e.size), ("snapshot.json", 3));
        let mut body = Vec::new();
        copy_body(&mut r, e.size, &mut body).unwrap();
        assert_eq!(body, b"{}\n");
        let e = next_entry(&mut r).unwrap().unwrap();
        assert_eq!(e.kind, b'x');
        let mut recs = Vec::new();
        copy_body(&mut r, e.size, &mut recs).unwrap();
        assert_eq!(
            parse_pax(&recs).unwrap(),
            [("COCOON.sparse.size".to_string(), "8192".to_string())]
        );
        let e = next_entry(&mut r).unwrap().unwrap();
        assert_eq!((e.size, e.mode), (1000, 0o600));
        let mut body = Vec::new();
        copy_body(&mut r, e.size, &mut body).unwrap();
        assert_eq!(body, big);
        assert_eq!(next_entry(&mut r).unwrap(), None);
        // Corruption is an error, not a panic.
        let mut bad = buf.clone();
        bad[0] ^= 1;
        assert!(next_entry(&mut &bad[..]).is_err());
        assert!(next_entry(&mut &buf[..100]).is_err());
        // The end marker is told apart from a stream that stops on a block boundary.
        let mut r = &buf[buf.len() - 1024..];
        assert_eq!(next_header(&mut r).unwrap(), Next::End);
        assert_eq!(next_header(&mut &buf[..0]).unwrap(), Next::Eof);
    }
}
