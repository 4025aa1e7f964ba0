//! The fake's `vm exec`, `vm logs` and `vm net`: what runs inside and around a guest.
//! Commands run against the guest's fake filesystem.

use std::fs;
use std::io::{self, Read, Write};
use std::time::Duration;

use super::super::cli::{self, flag_s, val, val_s};
use super::super::store::{now_rfc3339, tap_name, Store};
use super::super::{guest_fs, CmdResult};
use super::create::nics_for;
use super::lifecycle::is_running_alive;
use super::{io_err, print_json, resolve};

pub(super) fn exec(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(
        args,
        &[
            flag_s("interactive", 'i'),
            val_s("env", 'e'),
            flag_s("tty", 't'),
        ],
    )?;
    // As cocoon: the first positional is the VM, the rest the command, less one leading `--`
    // (the first `--` already ended the flags, wherever it stood).
    let Some((vm_ref, command)) = p.positionals.split_first() else {
        return Err("exec: requires a VM argument".into());
    };
    let (vm_ref, mut command) = (vm_ref.clone(), command.to_vec());
    if command.first().map(String::as_str) == Some("--") {
        command.remove(0);
    }
    if command.is_empty() {
        return Err("exec: no command given".into());
    }
    let sv = resolve(store, &vm_ref)?;
    if !is_running_alive(&sv.vm) {
        return Err(format!("exec: vm {} is not running", sv.vm.id));
    }
    let mut env: Vec<String> = p.all("env").to_vec();
    env.sort();
    let interactive = p.has("interactive");
    let entry = serde_json::json!({
        "time": now_rfc3339(), "vm": sv.vm.id, "argv": command, "env": env, "stdin": interactive,
    });
    if let Ok(mut f) = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(store.exec_log_path())
    {
        let _ = writeln!(f, "{entry}");
    }
    if let Some(code) = guest_fs::exec(&store.run_dir(&sv.vm), &command) {
        return Ok(code);
    }
    Ok(guest_command(
        &command,
        &env,
        interactive,
        &sv.vm.config.name,
        0,
    ))
}

/// Interprets a guest command without running anything (see the module doc).
pub(super) fn guest_command(
    argv: &[String],
    env: &[String],
    interactive: bool,
    hostname: &str,
    depth: u32,
) -> i32 {
    let mut out = io::stdout().lock();
    let prog = argv.first().map(String::as_str).unwrap_or("");
    let base = prog.rsplit('/').next().unwrap_or(prog);
    let args = &argv[1.min(argv.len())..];
    let code = match base {
        "cat" if args.is_empty() => {
            if interactive {
                let _ = io::copy(&mut io::stdin().lock(), &mut out);
            }
            0
        }
        "echo" => {
            let _ = writeln!(out, "{}", args.join(" "));
            0
        }
        "true" | ":" => 0,
        "false" => 1,
        "exit" => {
            args.first()
                .and_then(|a| a.parse::<i32>().ok())
                .unwrap_or(0)
                & 0xff
        }
        "env" => {
            for e in env {
                let _ = writeln!(out, "{e}");
            }
            0
        }
        "hostname" => {
            let _ = writeln!(out, "{hostname}");
            0
        }
        "uname" => {
            let line = if args.iter().any(|a| a == "-a") {
                format!("Linux {hostname} 6.1.0-cocoon #1 SMP x86_64 GNU/Linux")
            } else {
                "Linux".to_string()
            };
            let _ = writeln!(out, "{line}");
            0
        }
        "sleep" => {
            let secs: f64 = args.first().and_then(|a| a.parse().ok()).unwrap_or(0.0);
            if secs.is_finite() && secs > 0.0 {
                std::thread::sleep(Duration::from_secs_f64(secs.min(86_400.0)));
            }
            0
        }
        "stderr" => {
            eprintln!("{}", args.join(" "));
            0
        }
        // A Windows guest's shells: their scripts (the post-clone NIC reset, `ipconfig /release`
        // before hibernate, `/renew` after wake) are taken as run.
        "powershell" | "cmd" if !args.is_empty() => 0,
        "sh" | "bash" | "ash" | "dash"
            if args.first().map(String::as_str) == Some("-c") && depth < 4 =>
        {
            let script = args.get(1).cloned().unwrap_or_default();
            let words: Vec<String> = script
                .split_whitespace()
                .map(|w| w.trim_matches(['\'', '"']).to_string())
                .collect();
            drop(out);
            return if words.is_empty() {
                0
            } else {
                guest_command(&words, env, interactive, hostname, depth + 1)
            };
        }
        // As a shell answers for a program it cannot find: what kubectl cp (tar) and other
        // tools then report is a clear failure, not an empty success.
        _ => {
            drop(out);
            eprintln!("{prog}: command not found");
            return 127;
        }
    };
    let _ = out.flush();
    code
}

pub(super) fn logs(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[val("tail"), flag_s("follow", 'f')])?;
    let r = p.one_positional()?;
    let sv = resolve(store, r)?;
    let path = store.console_log(&sv.vm);
    let mut file = fs::File::open(&path).map_err(|_| {
        format!(
            "open log {}: VM may not have been started yet",
            path.display()
        )
    })?;
    let mut out = io::stdout().lock();
    let tail = p.num("tail")?.unwrap_or(0);
    let mut pos;
    if tail > 0 {
        let mut text = Vec::new();
        file.read_to_end(&mut text).map_err(io_err("read log"))?;
        pos = text.len() as u64;
        let lines: Vec<&[u8]> = text.split_inclusive(|b| *b == b'\n').collect();
        let start = lines.len().saturating_sub(tail as usize);
        for l in &lines[start..] {
            let _ = out.write_all(l);
        }
    } else {
        pos = io::copy(&mut file, &mut out).map_err(io_err("read log"))?;
    }
    let _ = out.flush();
    if p.has("follow") {
        let parent = std::os::unix::process::parent_id();
        while store.vm_path(&sv.vm.id).exists() && std::os::unix::process::parent_id() == parent {
            std::thread::sleep(Duration::from_millis(100));
            let len = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
            if len > pos {
                if let Ok(mut f) = fs::File::open(&path) {
                    use std::io::Seek;
                    if f.seek(io::SeekFrom::Start(pos)).is_ok() {
                        pos += io::copy(&mut f.take(len - pos), &mut out).unwrap_or(0);
                        if out.flush().is_err() {
                            return Ok(0);
                        }
                    }
                }
            }
        }
    }
    Ok(0)
}

pub(super) fn net(store: &Store, args: &[String]) -> CmdResult {
    let p = cli::parse(args, &[val("nics"), val_s("output", 'o')])?;
    let r = p.one_positional()?;
    let want = p.num("nics")?.ok_or("--nics is required")?;
    let mut sv = resolve(store, r)?;
    if sv.vm.is_firecracker() {
        return Err("net: backend does not support net resize".into());
    }
    let before = sv.vm.network_configs.len() as u64;
    let mut added = Vec::new();
    let mut removed = Vec::new();
    {
        let _guard = store.lock().map_err(io_err("lock"))?;
        while (sv.vm.network_configs.len() as u64) > want {
            if let Some(n) = sv.vm.network_configs.pop() {
                removed.push(n.tap);
            }
        }
        while (sv.vm.network_configs.len() as u64) < want {
            let i = sv.vm.network_configs.len();
            let mut nic = nics_for(store, &sv.vm.id, 1).remove(0);
            nic.tap = tap_name(&sv.vm.id, i);
            added.push(nic.tap.clone());
            sv.vm.network_configs.push(nic);
        }
        sv.vm.updated_at = now_rfc3339();
        store.save_vm(&sv).map_err(io_err("save vm"))?;
        store.journal("MODIFIED", &sv.vm.id);
    }
    if p.get("output") == Some("json") {
        return print_json(&serde_json::json!({
            "before": before, "after": want, "added": added, "removed": removed,
            "warnings": [], "hints": [],
        }));
    }
    Ok(0)
}
