//! Pod resources to cocoon flags (behaviour 5.3): Kubernetes quantities, vCPU, memory, CPU weight/quota.
//! Pure arithmetic on strings and integers; it knows nothing about pods or argv order.

/// CPU period cocoon gets with a quota (µs).
pub const CPU_PERIOD_US: u64 = 100_000;
/// Lowest quota cocoon gets (µs).
pub const CPU_QUOTA_MIN_US: u64 = 1_000;

/// The cgroup CPU knobs for `--cpu-weight`, `--cpu-quota-us`, `--cpu-period-us`; 0 = flag omitted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuPolicy {
    pub weight: u64,
    pub quota_us: u64,
    pub period_us: u64,
}

/// The one Kubernetes quantity parser (`500m`, `2`, `1.5Gi`, `4G`, `1e3`): the exact value as
/// `numerator / denominator`. `None` when the text is not a non-negative quantity or does not
/// fit the arithmetic. Pod resources, node capacity and cocoon flags all read quantities here.
fn quantity_ratio(text: &str) -> Option<(u128, u128)> {
    let s = text.trim();
    if s.is_empty() {
        return None;
    }
    let (negative, s) = match s.as_bytes()[0] {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s),
    };
    let num_end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(num_end);
    if number.is_empty() || number == "." || number.matches('.').count() > 1 {
        return None;
    }
    let (int_part, frac_part) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number, ""),
    };
    if frac_part.len() > 30 || int_part.len() > 30 {
        return None;
    }
    let digits: u128 = format!("{int_part}{frac_part}").parse().ok()?;
    // value = digits / 10^frac × num / den
    let mut num: u128 = digits;
    let mut den: u128 = 10u128.checked_pow(frac_part.len() as u32)?;
    let pow2 = |e: u32| 1u128.checked_shl(e);
    match suffix {
        "" => {}
        "Ki" => num = num.checked_mul(pow2(10)?)?,
        "Mi" => num = num.checked_mul(pow2(20)?)?,
        "Gi" => num = num.checked_mul(pow2(30)?)?,
        "Ti" => num = num.checked_mul(pow2(40)?)?,
        "Pi" => num = num.checked_mul(pow2(50)?)?,
        "Ei" => num = num.checked_mul(pow2(60)?)?,
        "n" => den = den.checked_mul(1_000_000_000)?,
        "u" => den = den.checked_mul(1_000_000)?,
        "m" => den = den.checked_mul(1_000)?,
        "k" => num = num.checked_mul(1_000)?,
        "M" => num = num.checked_mul(1_000_000)?,
        "G" => num = num.checked_mul(1_000_000_000)?,
        "T" => num = num.checked_mul(10u128.pow(12))?,
        "P" => num = num.checked_mul(10u128.pow(15))?,
        "E" => num = num.checked_mul(10u128.pow(18))?,
        exp if exp.starts_with(['e', 'E']) => {
            let e: i32 = exp[1..].parse().ok()?;
            if e.unsigned_abs() > 30 {
                return None;
            }
            if e >= 0 {
                num = num.checked_mul(10u128.pow(e as u32))?;
            } else {
                den = den.checked_mul(10u128.pow(e.unsigned_abs()))?;
            }
        }
        _ => return None,
    }
    if negative && digits != 0 {
        return None;
    }
    Some((num, den))
}

/// `ceil(value × scale)`, where `scale` is 1 for a plain count or 1000 for milli-units; `None`
/// when the text is not a quantity or the result does not fit a `u64`.
fn quantity_scaled(text: &str, scale: u128) -> Option<u64> {
    let (num, den) = quantity_ratio(text)?;
    u64::try_from(num.checked_mul(scale)?.div_ceil(den)).ok()
}

/// A quantity as a real number (node capacity keeps fractions such as `3100m`); `None` if
/// unparsable.
pub fn parse_quantity_f64(text: &str) -> Option<f64> {
    let (num, den) = quantity_ratio(text)?;
    let v = num as f64 / den as f64;
    v.is_finite().then_some(v)
}

/// A quantity as a whole number, rounded up (`4Gi` → 4294967296, `1.5` → 2). `None` if unparsable.
pub fn parse_quantity(text: &str) -> Option<u64> {
    quantity_scaled(text, 1)
}

/// A quantity in milli-units, rounded up (`500m` → 500, `2` → 2000). `None` if unparsable.
pub fn parse_milli(text: &str) -> Option<u64> {
    quantity_scaled(text, 1000)
}

/// The `--memory`/`--storage` argument: a plain byte count, or the text verbatim when unparsable.
/// Empty input gives `None` (flag omitted).
pub fn bytes_arg(quantity: &str) -> Option<String> {
    let q = quantity.trim();
    if q.is_empty() {
        return None;
    }
    Some(match parse_quantity(q) {
        Some(b) => b.to_string(),
        None => q.to_string(),
    })
}

/// `--memory` for run: the memory request, else the limit, as a byte argument (5.3).
pub fn memory_arg(request: Option<&str>, limit: Option<&str>) -> Option<String> {
    request
        .and_then(bytes_arg)
        .or_else(|| limit.and_then(bytes_arg))
}

/// `--cpu` for run: ceil(milli(limit, or request if no limit) / 1000); 0 means "omit".
pub fn vcpu_count(request_milli: Option<u64>, limit_milli: Option<u64>) -> u64 {
    limit_milli.or(request_milli).unwrap_or(0).div_ceil(1000)
}

/// cgroup v2 weight from the CPU request (else limit): shares = clamp(milli×1024/1000, 2, 262144),
/// weight = 1 + (shares−2)×9999/262142. 2 CPU → 79, 500m → 20, best effort → 1.
pub fn cpu_weight(request_milli: Option<u64>, limit_milli: Option<u64>) -> u64 {
    let milli = request_milli.or(limit_milli).unwrap_or(0) as u128;
    let shares = (milli * 1024 / 1000).clamp(2, 262_144);
    (1 + (shares - 2) * 9_999 / 262_142) as u64
}

/// The full CPU policy of 5.3: a quota of max(limit×100, 1000) µs per 100 ms when a limit is set,
/// and always a weight.
pub fn cpu_policy(request_milli: Option<u64>, limit_milli: Option<u64>) -> CpuPolicy {
    let (quota_us, period_us) = match limit_milli {
        // Any set limit, even 0, gets a quota (the daemon's behaviour since the start).
        Some(l) => (l.saturating_mul(100).max(CPU_QUOTA_MIN_US), CPU_PERIOD_US),
        _ => (0, 0),
    };
    CpuPolicy {
        weight: cpu_weight(request_milli, limit_milli),
        quota_us,
        period_us,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        assert_eq!(parse_quantity("4Gi"), Some(4_294_967_296));
        assert_eq!(parse_quantity("512Mi"), Some(536_870_912));
        assert_eq!(parse_quantity("1G"), Some(1_000_000_000));
        assert_eq!(parse_quantity("1.5Gi"), Some(1_610_612_736));
        assert_eq!(parse_quantity("1e3"), Some(1000));
        assert_eq!(parse_quantity("100m"), Some(1));
        assert_eq!(parse_quantity("0"), Some(0));
        assert_eq!(parse_quantity("abc"), None);
        assert_eq!(parse_quantity("4GB"), None);
        assert_eq!(parse_quantity(""), None);
        assert_eq!(parse_quantity("-1"), None);
        assert_eq!(parse_quantity("99999999999Ei"), None);
        assert_eq!(parse_milli("500m"), Some(500));
        assert_eq!(parse_milli("2"), Some(2000));
        assert_eq!(parse_milli("0.25"), Some(250));
        assert_eq!(parse_milli("1500u"), Some(2));
        assert_eq!(parse_quantity_f64("3100m"), Some(3.1));
        assert_eq!(parse_quantity_f64("1Ei"), Some(1_152_921_504_606_846_976.0));
        assert_eq!(parse_quantity_f64("12 cores"), None);
    }

    #[test]
    fn a_huge_cpu_limit_saturates_the_quota_instead_of_overflowing() {
        let ten_peta_milli = parse_milli("10P");
        assert_eq!(ten_peta_milli, Some(10_000_000_000_000_000_000));
        let p = cpu_policy(None, ten_peta_milli);
        assert_eq!(p.quota_us, u64::MAX);
        assert_eq!(p.weight, 10_000);
    }

    #[test]
    fn byte_args() {
        assert_eq!(bytes_arg("4Gi").as_deref(), Some("4294967296"));
        assert_eq!(bytes_arg("20 GB").as_deref(), Some("20 GB"));
        assert_eq!(bytes_arg(""), None);
        assert_eq!(memory_arg(None, Some("1Gi")).as_deref(), Some("1073741824"));
        assert_eq!(
            memory_arg(Some("512Mi"), Some("1Gi")).as_deref(),
            Some("536870912")
        );
        assert_eq!(memory_arg(None, None), None);
    }

    #[test]
    fn spec_examples_for_weight() {
        assert_eq!(cpu_weight(Some(2000), None), 79);
        assert_eq!(cpu_weight(Some(500), None), 20);
        assert_eq!(cpu_weight(None, None), 1);
        assert_eq!(cpu_weight(None, Some(2000)), 79);
        assert_eq!(cpu_weight(Some(1_000_000), None), 10_000);
    }

    #[test]
    fn policy_and_vcpus() {
        assert_eq!(
            cpu_policy(Some(500), Some(1500)),
            CpuPolicy {
                weight: 20,
                quota_us: 150_000,
                period_us: 100_000
            }
        );
        assert_eq!(cpu_policy(Some(1), Some(1)).quota_us, 1000);
        assert_eq!(
            cpu_policy(None, None),
            CpuPolicy {
                weight: 1,
                quota_us: 0,
                period_us: 0
            }
        );
        assert_eq!(vcpu_count(Some(500), Some(1500)), 2);
        assert_eq!(vcpu_count(Some(2500), None), 3);
        assert_eq!(vcpu_count(None, None), 0);
    }
}
