//! The protocol between a bench's initiator and the target process it
//! spawns (`current_exe() bench <kind> --serve --bytes N ...`), the same for
//! `bench tcp`, `bench ucx` and `bench ipc`.
//!
//! Lines on the target's stdin and stdout:
//!
//! - target → initiator, once: `READY <session> <addr>` (its engine's
//!   session id and the address of its registered buffer);
//! - initiator → target: one command per line (`VERIFY ...`, `ZERO`, as
//!   each bench defines them), answered with one line, `OK` or a reason
//!   (`BAD <where>`);
//! - initiator → target: `QUIT` (or end of input) ends the target.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use anyhow::{Context, Result, bail};

/// The initiator's handle on a spawned target; `QUIT`s and reaps it on drop.
#[derive(Debug)]
pub(super) struct Target {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// The target engine's session id.
    pub session: String,
    /// Address of the target's registered buffer.
    pub addr: u64,
}

impl Target {
    /// Spawns `kvbridge bench <bench> --serve --bytes <bytes> <extra...>`,
    /// handing it `secret` (if any) through its environment together with
    /// `--auth`, and waits for its `READY` line.
    pub fn spawn(
        bench: &str,
        bytes: u64,
        extra: &[String],
        secret: Option<String>,
    ) -> Result<Self> {
        let exe = std::env::current_exe().context("locating the kvbridge binary")?;
        let mut cmd = Command::new(exe);
        cmd.args(["bench", bench, "--serve", "--bytes", &bytes.to_string()])
            .args(extra);
        if let Some(s) = secret {
            cmd.arg("--auth")
                .env(kvbridge_engine::secret::SECRET_ENV, s)
                .env_remove(kvbridge_engine::secret::SECRET_FILE_ENV);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("spawning the target process")?;
        let stdin = child.stdin.take().context("target stdin")?;
        let mut stdout = BufReader::new(child.stdout.take().context("target stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (session, addr) = match fields.as_slice() {
            ["READY", session, addr] => ((*session).to_owned(), addr.parse::<u64>()?),
            _ => bail!("target did not start: {line:?}"),
        };
        Ok(Self {
            child,
            stdin,
            stdout,
            session,
            addr,
        })
    }

    /// Sends one command; `Ok` when the target answers `OK`.
    pub fn ask(&mut self, command: &str) -> Result<()> {
        writeln!(self.stdin, "{command}")?;
        self.stdin.flush()?;
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        match line.trim() {
            "OK" => Ok(()),
            other => bail!("{command:?}: {other}"),
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "QUIT");
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

/// The target's side: prints `READY <session> <addr>`, then answers every
/// command line on stdin with what `answer` returns for its words (`OK` or
/// a reason), until `QUIT` or the end of input. An error from `answer`
/// (an unknown or malformed command) ends the target with that error.
pub(super) fn serve(
    session: &str,
    addr: u64,
    answer: impl FnMut(&[&str]) -> Result<String>,
) -> Result<()> {
    let (input, output) = (std::io::stdin().lock(), std::io::stdout().lock());
    serve_on(input, output, session, addr, answer)
}

/// [`serve`] on any input and output.
fn serve_on(
    input: impl BufRead,
    mut out: impl Write,
    session: &str,
    addr: u64,
    mut answer: impl FnMut(&[&str]) -> Result<String>,
) -> Result<()> {
    writeln!(out, "READY {session} {addr}")?;
    out.flush()?;
    for line in input.lines() {
        let line = line?;
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.as_slice() == ["QUIT"] {
            break;
        }
        let reply = answer(&words).with_context(|| format!("target: command {line:?}"))?;
        writeln!(out, "{reply}")?;
        out.flush()?;
    }
    Ok(())
}

/// The reply to a verification: `OK`, or `BAD <where>` for the first place
/// that differs.
pub(super) fn verdict(first_bad: Option<impl std::fmt::Display>) -> String {
    match first_bad {
        None => "OK".to_owned(),
        Some(at) => format!("BAD {at}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(words: &[&str]) -> Result<String> {
        match words {
            ["ZERO"] => Ok("OK".to_owned()),
            ["VERIFY", at] => Ok(verdict((*at != "0").then_some(at))),
            _ => bail!("unknown command"),
        }
    }

    #[test]
    fn target_answers_each_command_until_quit() {
        let input = "ZERO\nVERIFY 0\nVERIFY 12\nQUIT\nNEVER READ\n";
        let mut out = Vec::new();
        serve_on(input.as_bytes(), &mut out, "127.0.0.1:5", 4096, answer).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "READY 127.0.0.1:5 4096\nOK\nOK\nBAD 12\n"
        );
    }

    #[test]
    fn end_of_input_ends_the_target_and_unknown_commands_fail_it() {
        let mut out = Vec::new();
        serve_on(&b"ZERO\n"[..], &mut out, "s", 1, answer).unwrap();
        assert_eq!(out, b"READY s 1\nOK\n");
        let e = serve_on(&b"FLY\n"[..], Vec::new(), "s", 1, answer).unwrap_err();
        assert!(format!("{e:#}").contains("unknown command"), "{e:#}");
    }
}
