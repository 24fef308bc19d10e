//! The protocol between a bench's initiator and its target, the same for
//! `bench tcp`, `bench ucx` and `bench ipc`, over the stdin/stdout of a
//! target process the initiator spawned (`current_exe() bench <kind>
//! --serve --bytes N ...`) or over a TCP connection to a target started on
//! another machine with `--listen ADDR`.
//!
//! Lines, each way:
//!
//! - target → initiator, once: `READY <session> <addr> <len>` (its engine's
//!   session id, the address and the length of its registered buffer);
//! - initiator → target: one command per line (`VERIFY ...`, `ZERO`, as
//!   each bench defines them), answered with one line, `OK` or a reason
//!   (`BAD <where>`);
//! - initiator → target: `QUIT` (or end of input) ends the session.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// How long connecting to a `--listen` target may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The initiator's handle on its target; `QUIT`s it (and reaps a spawned
/// one) on drop.
pub(super) struct Target {
    child: Option<Child>,
    writer: Box<dyn Write + Send>,
    reader: Box<dyn BufRead + Send>,
    /// The target engine's session id.
    pub session: String,
    /// Address of the target's registered buffer.
    pub addr: u64,
    /// Length of the target's registered buffer.
    pub len: u64,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("session", &self.session)
            .field("addr", &self.addr)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl Target {
    /// Reads the `READY` line from `reader`.
    fn handshake(
        child: Option<Child>,
        writer: Box<dyn Write + Send>,
        mut reader: Box<dyn BufRead + Send>,
    ) -> Result<Self> {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (session, addr, len) = match fields.as_slice() {
            ["READY", session, addr, len] => ((*session).to_owned(), addr.parse()?, len.parse()?),
            _ => bail!("target did not start: {line:?}"),
        };
        Ok(Self {
            child,
            writer,
            reader,
            session,
            addr,
            len,
        })
    }

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
        let stdout = BufReader::new(child.stdout.take().context("target stdout")?);
        Self::handshake(Some(child), Box::new(stdin), Box::new(stdout))
    }

    /// Connects to a target serving with `--listen` at `addr` and checks
    /// that its buffer holds `bytes`.
    pub fn connect(addr: &str, bytes: u64) -> Result<Self> {
        let to = resolve(addr)?;
        let stream = TcpStream::connect_timeout(&to, CONNECT_TIMEOUT)
            .with_context(|| format!("connecting to the bench target at {addr}"))?;
        stream.set_nodelay(true)?;
        let reader = BufReader::new(stream.try_clone()?);
        let target = Self::handshake(None, Box::new(stream), Box::new(reader))
            .with_context(|| format!("bench target at {addr}"))?;
        if target.len < bytes {
            bail!(
                "the target at {addr} registered {} bytes; --bytes {bytes} needs as many \
                 (start it with --bytes {bytes} or more)",
                target.len
            );
        }
        Ok(target)
    }

    /// Sends one command; `Ok` when the target answers `OK`.
    pub fn ask(&mut self, command: &str) -> Result<()> {
        writeln!(self.writer, "{command}")?;
        self.writer.flush()?;
        let mut line = String::new();
        self.reader.read_line(&mut line)?;
        match line.trim() {
            "OK" => Ok(()),
            "" => bail!("{command:?}: the target went away"),
            other => bail!("{command:?}: {other}"),
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = writeln!(self.writer, "QUIT");
        let _ = self.writer.flush();
        if let Some(child) = &mut self.child {
            let _ = child.wait();
        }
    }
}

/// The first address `addr` (`host:port`) resolves to, IPv4 first.
pub(super) fn resolve(addr: &str) -> Result<SocketAddr> {
    crate::net::first_addr(addr).with_context(|| format!("{addr:?} is not a reachable host:port"))
}

/// Where a target takes its commands from.
pub(super) enum Control {
    /// The initiator that spawned it, on stdin and stdout.
    Stdio,
    /// Initiators that connect to this listener, one session at a time.
    Listen(TcpListener),
}

impl Control {
    /// Stdin/stdout, or a listener on `listen` (`host:port`).
    pub fn new(listen: Option<&str>) -> Result<Self> {
        let Some(addr) = listen else {
            return Ok(Self::Stdio);
        };
        let listener =
            TcpListener::bind(resolve(addr)?).with_context(|| format!("listening on {addr}"))?;
        Ok(Self::Listen(listener))
    }
}

/// The target's side: announces `READY <session> <addr> <len>`, then
/// answers every command line with what `answer` returns for its words
/// (`OK` or a reason), until `QUIT` or the end of input. On stdin/stdout
/// that is one session; a listener serves one initiator after another
/// until the process is stopped. An error from `answer` (an unknown or
/// malformed command) ends that session with the error.
pub(super) fn serve(
    control: Control,
    session: &str,
    addr: u64,
    len: u64,
    mut answer: impl FnMut(&[&str]) -> Result<String>,
) -> Result<()> {
    let listener = match control {
        Control::Stdio => {
            let (input, output) = (std::io::stdin().lock(), std::io::stdout().lock());
            return serve_on(input, output, session, addr, len, answer);
        }
        Control::Listen(l) => l,
    };
    eprintln!(
        "bench target listening on {} (engine {session}, {len} bytes registered); \
         stop it with Ctrl-C",
        listener.local_addr()?
    );
    loop {
        let (stream, peer) = listener.accept().context("accepting an initiator")?;
        eprintln!("initiator {peer} connected");
        let input = BufReader::new(stream.try_clone()?);
        match serve_on(input, &stream, session, addr, len, &mut answer) {
            Ok(()) => eprintln!("initiator {peer} done"),
            Err(e) => eprintln!("initiator {peer}: {e:#}"),
        }
    }
}

/// One session of [`serve`] on any input and output.
fn serve_on(
    input: impl BufRead,
    mut out: impl Write,
    session: &str,
    addr: u64,
    len: u64,
    mut answer: impl FnMut(&[&str]) -> Result<String>,
) -> Result<()> {
    writeln!(out, "READY {session} {addr} {len}")?;
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
        serve_on(input.as_bytes(), &mut out, "127.0.0.1:5", 4096, 64, answer).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "READY 127.0.0.1:5 4096 64\nOK\nOK\nBAD 12\n"
        );
    }

    #[test]
    fn end_of_input_ends_the_target_and_unknown_commands_fail_it() {
        let mut out = Vec::new();
        serve_on(&b"ZERO\n"[..], &mut out, "s", 1, 2, answer).unwrap();
        assert_eq!(out, b"READY s 1 2\nOK\n");
        let e = serve_on(&b"FLY\n"[..], Vec::new(), "s", 1, 2, answer).unwrap_err();
        assert!(format!("{e:#}").contains("unknown command"), "{e:#}");
    }

    #[test]
    fn a_listening_target_serves_initiators_over_tcp() {
        let control = Control::new(Some("127.0.0.1:0")).unwrap();
        let Control::Listen(listener) = &control else {
            panic!("not listening")
        };
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || serve(control, "127.0.0.1:9", 4096, 1 << 20, answer));
        for _ in 0..2 {
            let mut t = Target::connect(&addr, 1 << 20).unwrap();
            assert_eq!(
                (t.session.as_str(), t.addr, t.len),
                ("127.0.0.1:9", 4096, 1 << 20)
            );
            t.ask("ZERO").unwrap();
            assert!(t.ask("VERIFY 12").is_err());
        }
        let short = Target::connect(&addr, 2 << 20).unwrap_err();
        assert!(
            format!("{short:#}").contains("registered 1048576 bytes"),
            "{short:#}"
        );
    }
}
