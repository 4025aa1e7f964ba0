//! Flag parsing for the fake cocoon in the style of the real CLI framework (cobra/pflag).
//! Owns error texts for bad flags; it knows nothing about VMs or the state directory.

use std::collections::BTreeMap;

/// One accepted flag.
#[derive(Debug, Clone, Copy)]
pub struct Flag {
    pub long: &'static str,
    pub short: Option<char>,
    pub takes_value: bool,
}

pub const fn val(long: &'static str) -> Flag {
    Flag {
        long,
        short: None,
        takes_value: true,
    }
}

pub const fn val_s(long: &'static str, short: char) -> Flag {
    Flag {
        long,
        short: Some(short),
        takes_value: true,
    }
}

pub const fn flag(long: &'static str) -> Flag {
    Flag {
        long,
        short: None,
        takes_value: false,
    }
}

pub const fn flag_s(long: &'static str, short: char) -> Flag {
    Flag {
        long,
        short: Some(short),
        takes_value: false,
    }
}

/// Persistent flags every cocoon command accepts.
pub const GLOBAL: &[Flag] = &[
    val("config"),
    val("root-dir"),
    val("run-dir"),
    val("log-dir"),
    val("cni-conf-dir"),
    val("cni-bin-dir"),
    val("dns"),
    val("log-level"),
];

/// The parsed command line of one command.
#[derive(Debug, Default, Clone)]
pub struct Parsed {
    values: BTreeMap<String, Vec<String>>,
    /// Every argument that is not a flag or a flag's value, in order: those before the first
    /// `--` and everything after it (a later `--` included).
    pub positionals: Vec<String>,
}

impl Parsed {
    /// Last value of a value flag, or `"true"` for a set boolean.
    pub fn get(&self, long: &str) -> Option<&str> {
        self.values
            .get(long)
            .and_then(|v| v.last())
            .map(String::as_str)
    }

    pub fn all(&self, long: &str) -> &[String] {
        self.values.get(long).map(Vec::as_slice).unwrap_or(&[])
    }

    pub fn has(&self, long: &str) -> bool {
        self.values.contains_key(long)
    }

    /// The one positional argument a verb takes, or the framework's arity error.
    pub fn one_positional(&self) -> Result<&String, String> {
        match self.positionals.as_slice() {
            [one] => Ok(one),
            other => Err(format!("accepts 1 arg(s), received {}", other.len())),
        }
    }

    /// A numeric flag; a bad number is the framework's `invalid argument` error.
    pub fn num(&self, long: &str) -> Result<Option<u64>, String> {
        match self.get(long) {
            None => Ok(None),
            Some(v) => v.parse::<u64>().map(Some).map_err(|_| {
                format!("invalid argument \"{v}\" for \"--{long}\" flag: strconv.ParseUint: parsing \"{v}\": invalid syntax")
            }),
        }
    }
}

/// Parses `args` against `flags` (+ cocoon's global flags) as pflag does: flags and
/// positionals interleave, anything starting with `-` (but `-` itself) is a flag until the
/// first `--`, which ends the flags and is dropped; everything after it is positional.
pub fn parse(args: &[String], flags: &[Flag]) -> Result<Parsed, String> {
    parse_with(args, flags, GLOBAL)
}

/// [`parse`] with another program's persistent flags (cocoon-macos has its own).
pub fn parse_with(args: &[String], flags: &[Flag], globals: &[Flag]) -> Result<Parsed, String> {
    let find = |pred: &dyn Fn(&Flag) -> bool| flags.iter().chain(globals.iter()).find(|f| pred(f));
    let mut p = Parsed::default();
    let mut i = 0;
    let mut flags_done = false;
    while i < args.len() {
        let a = &args[i];
        i += 1;
        if flags_done || a == "-" || !a.starts_with('-') {
            p.positionals.push(a.clone());
            continue;
        }
        if a == "--" {
            flags_done = true;
            continue;
        }
        if let Some(body) = a.strip_prefix("--") {
            let (name, inline) = match body.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (body, None),
            };
            let f = find(&|f| f.long == name).ok_or_else(|| format!("unknown flag: --{name}"))?;
            let value = if f.takes_value {
                match inline {
                    Some(v) => v,
                    None if i < args.len() => {
                        i += 1;
                        args[i - 1].clone()
                    }
                    None => return Err(format!("flag needs an argument: --{name}")),
                }
            } else {
                inline.unwrap_or_else(|| "true".into())
            };
            p.values.entry(f.long.to_string()).or_default().push(value);
        } else {
            let body = &a[1..];
            for (pos, c) in body.char_indices() {
                let f = find(&|f| f.short == Some(c))
                    .ok_or_else(|| format!("unknown shorthand flag: '{c}' in -{body}"))?;
                if f.takes_value {
                    let tail = &body[pos + c.len_utf8()..];
                    let tail = tail.strip_prefix('=').unwrap_or(tail);
                    let value = if !tail.is_empty() {
                        tail.to_string()
                    } else if i < args.len() {
                        i += 1;
                        args[i - 1].clone()
                    } else {
                        return Err(format!("flag needs an argument: '{c}' in -{body}"));
                    };
                    p.values.entry(f.long.to_string()).or_default().push(value);
                    break;
                }
                p.values
                    .entry(f.long.to_string())
                    .or_default()
                    .push("true".into());
            }
        }
    }
    Ok(p)
}

/// Splits global flags that come before the command words off the front of `args`:
/// returns (leading global-flag tokens, command words and the rest).
pub fn split_leading_globals(args: &[String]) -> (Vec<String>, Vec<String>) {
    let mut i = 0;
    while i < args.len() && args[i].starts_with("--") && args[i] != "--" {
        let name = args[i][2..].split('=').next().unwrap_or("");
        let inline = args[i].contains('=');
        let takes = GLOBAL.iter().any(|f| f.long == name && f.takes_value);
        i += 1;
        if takes && !inline {
            i += 1;
        }
    }
    let i = i.min(args.len());
    (args[..i].to_vec(), args[i..].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &str) -> Vec<String> {
        v.split(' ').map(String::from).collect()
    }

    #[test]
    fn parses_like_pflag() {
        let flags = [
            val("name"),
            flag("pull"),
            val_s("output", 'o'),
            flag_s("interactive", 'i'),
            val_s("env", 'e'),
        ];
        let p = parse(&s("--name=a --pull -o json X -ojson -e A=1 -e B=2"), &flags).unwrap();
        assert_eq!(p.get("name"), Some("a"));
        assert_eq!(p.get("pull"), Some("true"));
        assert_eq!(p.get("output"), Some("json"));
        assert_eq!(p.all("env"), &["A=1".to_string(), "B=2".to_string()]);
        assert_eq!(p.positionals, vec!["X"]);
        // `--` ends the flags and is dropped; a later one is a positional like the rest.
        let p = parse(&s("-i X -- ls -- -l"), &flags).unwrap();
        assert_eq!(p.positionals, s("X ls -- -l"));
        let p = parse(&s("-i -- --name -x"), &flags).unwrap();
        assert_eq!((&p.positionals, p.get("name")), (&s("--name -x"), None));
        // Before `--`, a value that starts with `-` is a flag, as cobra reads it.
        assert_eq!(
            parse(&s("-i --all"), &flags).unwrap_err(),
            "unknown flag: --all"
        );
        assert_eq!(
            parse(&s("--foo"), &flags).unwrap_err(),
            "unknown flag: --foo"
        );
        assert_eq!(
            parse(&s("-x"), &flags).unwrap_err(),
            "unknown shorthand flag: 'x' in -x"
        );
        assert_eq!(
            parse(&s("--name"), &flags).unwrap_err(),
            "flag needs an argument: --name"
        );
        assert_eq!(
            split_leading_globals(&s("--root-dir /r --dns=1.1.1.1 vm list")),
            (s("--root-dir /r --dns=1.1.1.1"), s("vm list"))
        );
    }
}
