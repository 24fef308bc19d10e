//! Two-process harness of the UCX engine tests: the test binary re-runs
//! itself as a target process (`ucx_util::ucx_child`, driven by the
//! `KVB_UCX_CHILD` environment variable) that registers one host buffer and
//! answers commands on stdin, with its transports picked by `UCX_TLS`.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use kvbridge_engine::{EngineConfig, TransferEngine, UcxEngine};
use kvbridge_mem::HostBuffer;

/// The transports every two-process test runs over: TCP and shared memory.
pub const TRANSPORTS: [&str; 2] = ["tcp", "posix,cma,self"];

/// Whether UCX is usable here; when it is not, the test is skipped with a
/// message (and fails instead where `KVBRIDGE_REQUIRE_UCX=1`, as in CI).
pub fn ucx_or_skip() -> bool {
    match kvbridge_engine::ucx::available() {
        Ok(_) => true,
        Err(e) => {
            if std::env::var("KVBRIDGE_REQUIRE_UCX").is_ok_and(|v| v == "1") {
                panic!("KVBRIDGE_REQUIRE_UCX=1 but {e}");
            }
            eprintln!("skipping: {e}");
            false
        }
    }
}

/// Engine settings of the tests: loopback, short timeouts.
pub fn cfg(secret: Option<&str>) -> EngineConfig {
    EngineConfig {
        listen_host: "127.0.0.1".into(),
        connect_timeout_ms: 2_000,
        io_timeout_ms: 3_000,
        secret: secret.map(str::to_owned),
        ..EngineConfig::default()
    }
}

/// An initiator engine in this process over `tls`.
pub fn engine(tls: &str, secret: Option<&str>) -> UcxEngine {
    UcxEngine::with_ucx_config(cfg(secret), &[("TLS", tls)]).unwrap()
}

/// A target process.
pub struct Target {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pub session: String,
    pub addr: u64,
    pub len: usize,
    pub incarnation: u64,
    pub port: u16,
}

impl Target {
    /// Start a target over `tls` with a `len`-byte buffer on `port` (0: any).
    pub fn spawn(tls: &str, len: usize, port: u16, secret: Option<&str>) -> Self {
        let exe = std::env::current_exe().unwrap();
        let mut child = Command::new(exe)
            .args([
                "--exact",
                "ucx_util::ucx_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(
                "KVB_UCX_CHILD",
                format!("{len} {port} {}", secret.unwrap_or("-")),
            )
            .env("UCX_TLS", tls)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut t = Self {
            child,
            stdin,
            stdout,
            session: String::new(),
            addr: 0,
            len,
            incarnation: 0,
            port: 0,
        };
        let line = t.answer("READY");
        let f: Vec<&str> = line.split_whitespace().collect();
        t.session = f[1].to_owned();
        t.addr = f[2].parse().unwrap();
        t.incarnation = f[3].parse().unwrap();
        t.port = t.session.rsplit(':').next().unwrap().parse().unwrap();
        t
    }

    /// The next answer of ours from the child: libtest prints its own
    /// lines too, and the test's name right before our first answer.
    fn answer(&mut self, prefix: &str) -> String {
        loop {
            let mut line = String::new();
            let n = self.stdout.read_line(&mut line).unwrap();
            assert!(n > 0, "target exited before answering {prefix}");
            if let Some(i) = line.find(prefix) {
                return line[i..].trim().to_owned();
            }
        }
    }

    fn command(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        self.answer("KVB-OK")
    }

    /// The target's whole buffer, as it is now.
    pub fn dump(&mut self) -> Vec<u8> {
        let dir = std::env::temp_dir();
        let path = dir.join(format!("kvb-ucx-dump-{}-{}", std::process::id(), self.port));
        self.command(&format!("DUMP {}", path.display()));
        let bytes = std::fs::read(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        bytes
    }

    /// Set every byte of the target's buffer to `b`.
    pub fn fill(&mut self, b: u8) {
        self.command(&format!("FILL {b}"));
    }

    /// Send `signal` (`STOP`, `CONT`, ...) to the target.
    pub fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .args([format!("-{signal}"), self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    }

    /// SIGKILL the target and reap it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "QUIT");
        let _ = self.stdin.flush();
        for _ in 0..200 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill();
    }
}

/// The target side: runs only in a child started by [`Target::spawn`].
#[test]
fn ucx_child() {
    let Ok(spec) = std::env::var("KVB_UCX_CHILD") else {
        return;
    };
    let f: Vec<&str> = spec.split_whitespace().collect();
    let len: usize = f[0].parse().unwrap();
    let port: u16 = f[1].parse().unwrap();
    let secret = (f[2] != "-").then_some(f[2]);
    let engine = UcxEngine::new(EngineConfig {
        port,
        ..cfg(secret)
    })
    .unwrap();
    let mut buf = HostBuffer::new(len).unwrap();
    // SAFETY: `buf` outlives the engine's use of it (deregistered below);
    // it is only read (DUMP) or written (FILL) while the parent has no
    // batch in flight to it.
    unsafe { engine.batch_register(&[buf.region()]) }.unwrap();
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "KVB-READY {} {} {}",
        engine.session_id(),
        buf.addr(),
        engine.incarnation()
    )
    .unwrap();
    out.flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let parts: Vec<&str> = line.split_whitespace().collect();
        match parts.as_slice() {
            ["DUMP", path] => std::fs::write(path, buf.as_slice()).unwrap(),
            ["FILL", b] => buf.as_mut_slice().fill(b.parse().unwrap()),
            ["QUIT"] | [] => break,
            other => panic!("unknown command {other:?}"),
        }
        writeln!(out, "KVB-OK").unwrap();
        out.flush().unwrap();
    }
    engine.batch_deregister(&[buf.addr()]).unwrap();
}
