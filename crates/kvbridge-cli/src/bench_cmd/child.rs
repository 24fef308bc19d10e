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
    mut answer: impl FnMut(&[&str]) -> Result<String>,
) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "READY {session} {addr}")?;
    out.flush()?;
    for line in std::io::stdin().lock().lines() {
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
