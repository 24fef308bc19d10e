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
//!
//! Over `--listen`, each connection first proves itself (`control_auth`:
//! the cluster secret with `--auth`) on a thread of its own, within 10 s
//! and with at most 16 such openings at a time, so a stranger learns
//! nothing and an idle one blocks nobody; proven initiators are served one
//! at a time. Lines longer than 4 KiB end the session.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{SyncSender, sync_channel};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use super::control_auth::{self, ControlKey, HANDSHAKE_TIMEOUT, read_line};

/// Most connections proving themselves at once on a `--listen` target.
const MAX_OPENING: usize = 16;

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
    /// Reads the `READY` line from `reader`; over `--connect` (`proven`:
    /// the key and the nonces of the opening) it must carry the target's proof.
    fn handshake(
        child: Option<Child>,
        writer: Box<dyn Write + Send>,
        mut reader: Box<dyn BufRead + Send>,
        proven: Option<(&ControlKey, &str)>,
    ) -> Result<Self> {
        let line = read_line(&mut reader)?.unwrap_or_default();
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (session, addr, len) = match (fields.as_slice(), proven) {
            (["READY", session, addr, len], None) => {
                ((*session).to_owned(), addr.parse()?, len.parse()?)
            }
            (["READY", session, addr, len, proof], Some((key, nonces))) => {
                control_auth::check_ready(key, nonces, proof)?;
                ((*session).to_owned(), addr.parse()?, len.parse()?)
            }
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
        Self::handshake(Some(child), Box::new(stdin), Box::new(stdout), None)
    }

    /// Connects to a target serving with `--listen` at `addr`, proves the
    /// cluster secret (`secret`, with `--auth`) and has the target prove it,
    /// and checks that its buffer holds `bytes`.
    pub fn connect(addr: &str, bytes: u64, secret: Option<&str>) -> Result<Self> {
        let key = ControlKey::new(secret)?;
        let to = resolve(addr)?;
        let mut stream = TcpStream::connect_timeout(&to, CONNECT_TIMEOUT)
            .with_context(|| format!("connecting to the bench target at {addr}"))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(CONNECT_TIMEOUT + HANDSHAKE_TIMEOUT))?;
        let mut reader = BufReader::new(stream.try_clone()?);
        let challenge = read_line(&mut reader)?.unwrap_or_default();
        let (hello, nonces) = control_auth::hello(&key, &challenge)
            .with_context(|| format!("bench target at {addr}"))?;
        writeln!(stream, "{hello}")?;
        stream.flush()?;
        let target = Self::handshake(
            None,
            Box::new(stream),
            Box::new(reader),
            Some((&key, &nonces)),
        )
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
        let line = read_line(&mut self.reader)?.unwrap_or_default();
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
    kvbridge_lab::net::first_addr(addr)
        .with_context(|| format!("{addr:?} is not a reachable host:port"))
}

/// Where a target takes its commands from.
pub(super) enum Control {
    /// The initiator that spawned it, on stdin and stdout.
    Stdio,
    /// Initiators that connect to this listener and prove `ControlKey`,
    /// one session at a time.
    Listen(TcpListener, ControlKey),
}

impl Control {
    /// Stdin/stdout, or a listener on `listen` (`host:port`) whose
    /// initiators must prove `secret` (with `--auth`).
    pub fn new(listen: Option<&str>, secret: Option<&str>) -> Result<Self> {
        let Some(addr) = listen else {
            return Ok(Self::Stdio);
        };
        let listener =
            TcpListener::bind(resolve(addr)?).with_context(|| format!("listening on {addr}"))?;
        Ok(Self::Listen(listener, ControlKey::new(secret)?))
    }
}

/// A proven initiator's connection, ready for its `READY` line.
struct Opened {
    peer: SocketAddr,
    stream: TcpStream,
    reader: BufReader<TcpStream>,
    /// The target's proof for the `READY` line.
    proof: String,
}

/// Runs the opening on one connection: `CHALLENGE`, the initiator's
/// `HELLO`, within [`HANDSHAKE_TIMEOUT`].
fn open(mut stream: TcpStream, peer: SocketAddr, key: &ControlKey) -> Result<Opened> {
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let server_nonce = control_auth::nonce();
    writeln!(stream, "CHALLENGE {server_nonce}")?;
    stream.flush()?;
    let line = read_line(&mut reader)
        .context("no HELLO in time")?
        .context("closed before its HELLO")?;
    match control_auth::accept_hello(key, &server_nonce, &line) {
        Ok(proof) => {
            // From here on the initiator may idle between commands (a bench runs).
            stream.set_read_timeout(None)?;
            stream.set_write_timeout(None)?;
            Ok(Opened {
                peer,
                stream,
                reader,
                proof,
            })
        }
        Err(e) => {
            let _ = writeln!(stream, "DENIED {e}");
            Err(e)
        }
    }
}

/// Accepts connections for ever, opening each on a thread of its own (at
/// most [`MAX_OPENING`] at once) and handing proven ones to `ready`.
fn accept_loop(listener: TcpListener, key: ControlKey, ready: SyncSender<Opened>) {
    let opening = Arc::new(AtomicUsize::new(0));
    loop {
        let (stream, peer) = match listener.accept() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("bench target: accept failed: {e}; retrying");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if opening.fetch_add(1, Ordering::AcqRel) >= MAX_OPENING {
            opening.fetch_sub(1, Ordering::AcqRel);
            eprintln!("initiator {peer}: refused, {MAX_OPENING} connections are already opening");
            continue;
        }
        let (key, ready, opening) = (key.clone(), ready.clone(), opening.clone());
        std::thread::spawn(move || {
            let opened = open(stream, peer, &key);
            opening.fetch_sub(1, Ordering::AcqRel);
            match opened {
                Ok(o) => {
                    let _ = ready.send(o);
                }
                Err(e) => eprintln!("initiator {peer}: refused: {e:#}"),
            }
        });
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
    let (listener, key) = match control {
        Control::Stdio => {
            let (input, output) = (std::io::stdin().lock(), std::io::stdout().lock());
            return serve_on(input, output, (session, addr, len), None, answer);
        }
        Control::Listen(l, key) => (l, key),
    };
    eprintln!(
        "bench target listening on {} (engine {session}, {len} bytes registered, {key:?}); \
         stop it with Ctrl-C",
        listener.local_addr()?
    );
    let (tx, rx) = sync_channel(0);
    std::thread::spawn(move || accept_loop(listener, key, tx));
    for o in rx {
        eprintln!("initiator {} connected", o.peer);
        let ready = (session, addr, len);
        match serve_on(o.reader, &o.stream, ready, Some(&o.proof), &mut answer) {
            Ok(()) => eprintln!("initiator {} done", o.peer),
            Err(e) => eprintln!("initiator {}: {e:#}", o.peer),
        }
    }
    bail!("the bench target's accept loop stopped")
}

/// One session of [`serve`] on any input and output: the `READY` line
/// (with the target's proof over `--listen`), then commands.
fn serve_on(
    mut input: impl BufRead,
    mut out: impl Write,
    (session, addr, len): (&str, u64, u64),
    proof: Option<&str>,
    mut answer: impl FnMut(&[&str]) -> Result<String>,
) -> Result<()> {
    match proof {
        Some(p) => writeln!(out, "READY {session} {addr} {len} {p}")?,
        None => writeln!(out, "READY {session} {addr} {len}")?,
    }
    out.flush()?;
    while let Some(line) = read_line(&mut input)? {
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
#[allow(clippy::unwrap_used)] // tests unwrap what they construct
mod tests {
    use std::io::Read;

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
        serve_on(
            input.as_bytes(),
            &mut out,
            ("127.0.0.1:5", 4096, 64),
            None,
            answer,
        )
        .unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "READY 127.0.0.1:5 4096 64\nOK\nOK\nBAD 12\n"
        );
    }

    #[test]
    fn end_of_input_ends_the_target_and_unknown_commands_fail_it() {
        let mut out = Vec::new();
        serve_on(&b"ZERO\n"[..], &mut out, ("s", 1, 2), None, answer).unwrap();
        assert_eq!(out, b"READY s 1 2\nOK\n");
        let e = serve_on(&b"FLY\n"[..], Vec::new(), ("s", 1, 2), None, answer).unwrap_err();
        assert!(format!("{e:#}").contains("unknown command"), "{e:#}");
    }

    fn listening(secret: Option<&str>) -> String {
        let control = Control::new(Some("127.0.0.1:0"), secret).unwrap();
        let Control::Listen(listener, _) = &control else {
            panic!("not listening")
        };
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || serve(control, "127.0.0.1:9", 4096, 1 << 20, answer));
        addr
    }

    #[test]
    fn a_listening_target_serves_initiators_over_tcp() {
        for secret in [None, Some("bench-secret-0123456789")] {
            let addr = listening(secret);
            for _ in 0..2 {
                let mut t = Target::connect(&addr, 1 << 20, secret).unwrap();
                assert_eq!(
                    (t.session.as_str(), t.addr, t.len),
                    ("127.0.0.1:9", 4096, 1 << 20)
                );
                t.ask("ZERO").unwrap();
                assert!(t.ask("VERIFY 12").is_err());
            }
            let short = Target::connect(&addr, 2 << 20, secret).unwrap_err();
            assert!(
                format!("{short:#}").contains("registered 1048576 bytes"),
                "{short:#}"
            );
        }
    }

    /// A raw connection that read the target's challenge.
    fn stranger(addr: &str) -> (TcpStream, BufReader<TcpStream>) {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        let ch = read_line(&mut r).unwrap().unwrap();
        assert!(ch.starts_with("CHALLENGE "), "{ch}");
        (s, r)
    }

    #[test]
    fn with_auth_a_stranger_learns_nothing_and_blocks_nobody() {
        let secret = Some("bench-secret-0123456789");
        let addr = listening(secret);
        // Without the secret: denied before the READY line (the buffer's
        // address), whether it claims no secret or proves another one.
        for hello in [
            format!("HELLO {} -", control_auth::nonce()),
            format!("HELLO {} {}", control_auth::nonce(), "ab".repeat(32)),
        ] {
            let (mut s, mut r) = stranger(&addr);
            writeln!(s, "{hello}").unwrap();
            let reply = read_line(&mut r).unwrap().unwrap();
            assert!(reply.starts_with("DENIED"), "{reply}");
            assert_eq!(read_line(&mut r).unwrap(), None);
        }
        assert!(Target::connect(&addr, 1, None).is_err());
        assert!(Target::connect(&addr, 1, Some("another-secret-0123456789")).is_err());
        // An idle stranger holds a connection open; a proven initiator is
        // served meanwhile, and the stranger is still waiting to be judged.
        let (idle, _r) = stranger(&addr);
        let mut t = Target::connect(&addr, 1 << 20, secret).unwrap();
        t.ask("ZERO").unwrap();
        drop(t);
        idle.set_nonblocking(true).unwrap();
        let mut byte = [0u8; 1];
        let still_open = matches!(
            (&idle).read(&mut byte),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
        );
        assert!(
            still_open,
            "the idle stranger was judged before the initiator was served"
        );
        // An unterminated line is refused, not buffered.
        // An unterminated line is refused, not buffered: the connection
        // ends (closed or reset) and the target goes on serving.
        let (mut s, mut r) = stranger(&addr);
        let _ = s.write_all(&vec![b'x'; 1 << 20]);
        let mut rest = Vec::new();
        let _ = r.read_to_end(&mut rest);
        assert!(rest.is_empty(), "the target answered: {rest:?}");
        Target::connect(&addr, 1 << 20, secret).unwrap();
    }
}
