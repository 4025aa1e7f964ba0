//! Kubernetes syntax rules the variables must follow: quantities, label values, DNS names.
//! Pure predicates on strings.

/// Kubernetes resource.Quantity syntax: signed decimal number with an optional
/// binary (Ki..Ei), decimal (n, u, m, k, M..E) or exponent (e3, E-2) suffix.
pub fn is_quantity(s: &str) -> bool {
    let body = s.strip_prefix(['+', '-']).unwrap_or(s);
    let digits_end = body
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(body.len());
    let (number, suffix) = body.split_at(digits_end);
    let mut parts = number.splitn(2, '.');
    let int = parts.next().unwrap_or("");
    let frac = parts.next();
    if frac.is_some_and(|f| f.contains('.')) || (int.is_empty() && frac.is_none_or(str::is_empty)) {
        return false;
    }
    match suffix {
        "" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" | "n" | "u" | "m" | "k" | "M" | "G" | "T"
        | "P" | "E" => true,
        s if s.starts_with(['e', 'E']) => {
            let exp = &s[1..];
            let exp = exp.strip_prefix(['+', '-']).unwrap_or(exp);
            !exp.is_empty() && exp.bytes().all(|b| b.is_ascii_digit())
        }
        _ => false,
    }
}

/// A Kubernetes label value: at most 63 characters, alphanumeric at both ends,
/// `-`, `_` and `.` inside. The empty string is valid.
pub fn is_label_value(s: &str) -> bool {
    let b = s.as_bytes();
    if b.is_empty() {
        return true;
    }
    b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// An RFC 1123 subdomain (what Kubernetes requires of node names).
pub fn is_dns_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            let b = label.as_bytes();
            !b.is_empty()
                && b.len() <= 63
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        })
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantity_syntax() {
        for q in [
            "1", "0", "+1.5", "-2", ".5", "5.", "500m", "64Gi", "1Ki", "2k", "3M", "1e3", "1E-2",
            "7n", "9u",
        ] {
            assert!(is_quantity(q), "{q}");
        }
        for q in [
            "", "Gi", ".", "1..2", "1.2.3", "64GB", "1e", "1e+", "1 Gi", "--1", "0x10", "1ki",
        ] {
            assert!(!is_quantity(q), "{q}");
        }
    }
}
