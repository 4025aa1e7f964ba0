//! Percent-encoding of URL parts: the one encoder and decoder that the API client, the kubelet
//! and peer servers and the sandbox's fake API server share.

/// Percent-encodes everything but the unreserved characters (`A-Z a-z 0-9 - . _ ~`), so the
/// result is safe as a query value or a path segment.
pub fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Decodes `%XX` escapes, and `+` as a space when `plus_is_space` (query strings). None on an
/// escape that is not two hex digits or a result that is not UTF-8: a server refuses the request.
pub fn decode(s: &str, plus_is_space: bool) -> Option<String> {
    String::from_utf8(decode_bytes(s, plus_is_space, false)?).ok()
}

/// As `decode`, but a bad escape stays literal and bytes that are not UTF-8 are replaced. Only
/// the sandbox's fake API server is this forgiving (it serves kubectl, whatever it sends); the
/// daemon's own servers refuse what `decode` refuses.
pub fn decode_lenient(s: &str, plus_is_space: bool) -> String {
    let bytes = decode_bytes(s, plus_is_space, true).unwrap_or_default();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The decoded bytes; a bad escape is None, or a literal `%` when `lenient` (never None then).
fn decode_bytes(s: &str, plus_is_space: bool, lenient: bool) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => match escaped_byte(b, i) {
                Some(v) => {
                    out.push(v);
                    i += 3;
                }
                None if lenient => {
                    out.push(b'%');
                    i += 1;
                }
                None => return None,
            },
            b'+' if plus_is_space => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    Some(out)
}

/// The byte that the two hex digits after the `%` at `at` stand for.
fn escaped_byte(b: &[u8], at: usize) -> Option<u8> {
    let hex = std::str::from_utf8(b.get(at + 1..at + 3)?).ok()?;
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_encoding() {
        assert_eq!(encode("spec.nodeName=a b"), "spec.nodeName%3Da%20b");
    }

    #[test]
    fn strict_decoding_refuses_bad_escapes_and_non_utf8() {
        assert_eq!(decode("a%2Fb+c", false).as_deref(), Some("a/b+c"));
        assert_eq!(decode("a%2Fb+c", true).as_deref(), Some("a/b c"));
        assert_eq!(decode("a%2", false), None);
        assert_eq!(decode("a%zz", true), None);
        assert_eq!(decode("%FF", false), None);
        assert_eq!(
            decode(&encode("ns/pod é?x=1&y"), false).as_deref(),
            Some("ns/pod é?x=1&y")
        );
    }

    #[test]
    fn lenient_decoding_keeps_bad_escapes() {
        assert_eq!(decode_lenient("a%2", false), "a%2");
        assert_eq!(decode_lenient("a%zz%41", false), "a%zzA");
        assert_eq!(decode_lenient("a+b%FF", true), "a b\u{FFFD}");
    }
}
