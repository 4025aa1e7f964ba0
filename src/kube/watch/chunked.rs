//! The watch body's chunked-transfer decoder and line splitter: any split of the byte stream in,
//! each complete line out exactly once; framing errors are errors, never panics.

use std::fmt;

/// Longest accepted watch line (one object).
const MAX_LINE: usize = 16 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// Reading the hex size line.
    Size,
    /// Inside chunk data with this many bytes left.
    Data(usize),
    /// After chunk data: expecting CRLF.
    DataEnd,
    /// After the zero chunk: trailer lines until an empty one.
    Trailer,
    Done,
}

/// Incremental decoder of a watch response body: de-chunks (when chunked) and splits lines.
/// Feed it any split of the byte stream; each complete line comes out exactly once.
#[derive(Debug)]
pub struct StreamDecoder {
    chunked: bool,
    state: Chunk,
    /// Partial chunk-size / trailer line.
    meta: Vec<u8>,
    /// Partial body line.
    line: Vec<u8>,
    /// Set when the current line overflowed MAX_LINE: skip until the next newline.
    skipping: bool,
}

impl StreamDecoder {
    pub fn new(chunked: bool) -> StreamDecoder {
        StreamDecoder {
            chunked,
            state: Chunk::Size,
            meta: Vec::new(),
            line: Vec::new(),
            skipping: false,
        }
    }

    /// True once the terminating zero-length chunk (and trailer) has been read.
    pub fn finished(&self) -> bool {
        self.state == Chunk::Done
    }

    /// Feed bytes; `on_line` gets every complete non-empty line (without CR/LF).
    pub fn feed(
        &mut self,
        mut data: &[u8],
        on_line: &mut dyn FnMut(&[u8]),
    ) -> Result<(), FramingError> {
        if !self.chunked {
            self.split_lines(data, on_line);
            return Ok(());
        }
        while !data.is_empty() {
            match self.state {
                Chunk::Size | Chunk::Trailer => {
                    let Some(nl) = data.iter().position(|&b| b == b'\n') else {
                        if self.meta.len() + data.len() > 4096 {
                            return Err(FramingError::SizeLineTooLong);
                        }
                        self.meta.extend_from_slice(data);
                        return Ok(());
                    };
                    self.meta.extend_from_slice(&data[..nl]);
                    data = &data[nl + 1..];
                    let meta = std::mem::take(&mut self.meta);
                    let text = trim_cr(&meta);
                    if self.state == Chunk::Trailer {
                        if text.is_empty() {
                            self.state = Chunk::Done;
                        }
                        continue;
                    }
                    let hex = text.split(|&b| b == b';').next().unwrap_or_default();
                    let hex = std::str::from_utf8(hex).map_err(|_| FramingError::SizeNotText)?;
                    let size = usize::from_str_radix(hex.trim(), 16)
                        .map_err(|_| FramingError::BadSize(hex.trim().to_string()))?;
                    self.state = if size == 0 {
                        Chunk::Trailer
                    } else {
                        Chunk::Data(size)
                    };
                }
                Chunk::Data(left) => {
                    let n = left.min(data.len());
                    self.split_lines(&data[..n], on_line);
                    data = &data[n..];
                    self.state = if n == left {
                        Chunk::DataEnd
                    } else {
                        Chunk::Data(left - n)
                    };
                }
                Chunk::DataEnd => {
                    // Accept CRLF or a bare LF after chunk data.
                    let b = data[0];
                    data = &data[1..];
                    match b {
                        b'\r' => {}
                        b'\n' => self.state = Chunk::Size,
                        other => return Err(FramingError::NoCrlfAfterData(other)),
                    }
                }
                Chunk::Done => return Ok(()),
            }
        }
        Ok(())
    }

    /// End of stream: a final line without a newline is still delivered (non-chunked bodies).
    pub fn finish(&mut self, on_line: &mut dyn FnMut(&[u8])) {
        if !self.skipping {
            let line = std::mem::take(&mut self.line);
            let t = trim_cr(&line);
            if !t.is_empty() {
                on_line(t);
            }
        }
        self.line.clear();
        self.skipping = false;
    }

    fn split_lines(&mut self, mut data: &[u8], on_line: &mut dyn FnMut(&[u8])) {
        while let Some(nl) = data.iter().position(|&b| b == b'\n') {
            if self.skipping {
                self.skipping = false;
            } else if self.line.is_empty() {
                let t = trim_cr(&data[..nl]);
                if !t.is_empty() {
                    on_line(t);
                }
            } else {
                self.line.extend_from_slice(&data[..nl]);
                let line = std::mem::take(&mut self.line);
                let t = trim_cr(&line);
                if !t.is_empty() {
                    on_line(t);
                }
                self.line = line;
                self.line.clear();
            }
            data = &data[nl + 1..];
        }
        if self.skipping {
            return;
        }
        if self.line.len() + data.len() > MAX_LINE {
            log::error!("pod watch: dropping a line longer than {MAX_LINE} bytes");
            self.line.clear();
            self.skipping = true;
            return;
        }
        self.line.extend_from_slice(data);
    }
}

/// Why a chunked body cannot be read on: the connection is dropped and the watch re-made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FramingError {
    /// A chunk-size or trailer line longer than 4 KiB.
    SizeLineTooLong,
    /// The chunk-size line is not UTF-8.
    SizeNotText,
    /// The chunk size, as sent, is not hexadecimal.
    BadSize(String),
    /// The byte found where CRLF must end chunk data.
    NoCrlfAfterData(u8),
}

impl fmt::Display for FramingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FramingError::SizeLineTooLong => f.write_str("chunk size line too long"),
            FramingError::SizeNotText => f.write_str("chunk size is not text"),
            FramingError::BadSize(size) => write!(f, "bad chunk size {size:?}"),
            FramingError::NoCrlfAfterData(b) => {
                write!(f, "expected CRLF after chunk data, got byte {b}")
            }
        }
    }
}

fn trim_cr(b: &[u8]) -> &[u8] {
    b.strip_suffix(b"\r").unwrap_or(b)
}

#[cfg(test)]
mod tests {
    use crate::kube::watch::decode_stream;

    #[test]
    fn bad_chunk_framing_is_an_error_not_a_panic() {
        assert!(decode_stream(&[b"zz\r\n"], true).is_err());
        assert!(decode_stream(&[b"3\r\nabcX"], true).is_err());
        assert!(decode_stream(&[&[b'1'; 5000]], true).is_err());
    }
}
