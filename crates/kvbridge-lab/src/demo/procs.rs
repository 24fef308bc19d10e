//! The demo's child processes: spawn a rank from its configuration file,
//! read its JSON events, kill it, reap it.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::plan::Plan;
use crate::rank::RankFile;
use crate::rank::events::Event;

/// Index of a child in [`Children`].
pub type ChildId = usize;

struct Entry {
    name: String,
    rank: u64,
    child: Child,
    killed: bool,
}

/// The rank processes of one demo run.
pub struct Children {
    dir: PathBuf,
    /// The cluster secret handed to every child (none: open mode).
    secret: Option<kvbridge_engine::ClusterSecret>,
    entries: Vec<Entry>,
    tx: Sender<(ChildId, Option<Event>)>,
    rx: Receiver<(ChildId, Option<Event>)>,
    /// Events read while waiting for something else, delivered first.
    backlog: VecDeque<(ChildId, Option<Event>)>,
    /// Every rank that reported ready: its control port and engine session.
    ready: Vec<super::rogue::Target>,
    /// The network namespace each `(role, rank)` runs in (`--netns`).
    namespaces: HashMap<(String, u64), String>,
    /// Environment every child gets.
    env: Vec<(String, String)>,
}

impl Children {
    /// No children yet; configuration files go to `dir`.
    pub fn new(dir: PathBuf, secret: Option<kvbridge_engine::ClusterSecret>) -> Self {
        let (tx, rx) = channel();
        Self {
            dir,
            secret,
            entries: Vec::new(),
            tx,
            rx,
            backlog: VecDeque::new(),
            ready: Vec::new(),
            namespaces: HashMap::new(),
            env: Vec::new(),
        }
    }

    /// Starts `role` rank `rank` inside network namespace `ns` from now on.
    pub fn place(&mut self, role: &str, rank: u64, ns: &str) {
        self.namespaces
            .insert((role.to_owned(), rank), ns.to_owned());
    }

    /// Sets `key` in the environment of every child started from now on.
    pub fn set_env(&mut self, key: &str, value: &str) {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.to_owned(), value.to_owned()));
    }

    /// The children still running: process id and name.
    pub fn running(&mut self) -> Vec<(u32, String)> {
        self.entries
            .iter_mut()
            .filter_map(|e| {
                matches!(e.child.try_wait(), Ok(None)).then(|| (e.child.id(), e.name.clone()))
            })
            .collect()
    }

    /// The process id of child `id`.
    pub fn pid(&self, id: ChildId) -> Option<u32> {
        self.entries.get(id).map(|e| e.child.id())
    }

    /// Starts `kvbridge <role> --config <file>` and a thread reading its events.
    pub fn spawn(&mut self, role: &str, rank: u64, file: &RankFile) -> Result<ChildId> {
        let id = self.entries.len();
        let path = self.dir.join(format!("{role}-{rank}-{id}.json"));
        std::fs::write(&path, serde_json::to_vec_pretty(file)?)
            .with_context(|| format!("writing {}", path.display()))?;
        let exe = std::env::current_exe().context("locating the kvbridge binary")?;
        let mut command = match self.namespaces.get(&(role.to_owned(), rank)) {
            // `ip netns exec` execs the binary: the child's pid is the rank's.
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        command.envs(self.env.iter().map(|(k, v)| (k, v)));
        command
            .arg(role)
            .arg("--config")
            .arg(&path)
            // Held open until `wait_all`: lingering ranks exit when it closes.
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if std::env::var_os("KVBRIDGE_LOG").is_none() && std::env::var_os("RUST_LOG").is_none() {
            command.env("KVBRIDGE_LOG", "error");
        }
        // The secret travels in the environment (readable only by this
        // user), never on a command line or in the rank's config file.
        command.env_remove(kvbridge_engine::secret::SECRET_FILE_ENV);
        match &self.secret {
            Some(s) => command.env(kvbridge_engine::secret::SECRET_ENV, s.to_env_value()),
            None => command.env_remove(kvbridge_engine::secret::SECRET_ENV),
        };
        let mut child = command
            .spawn()
            .with_context(|| format!("starting {role} rank {rank}"))?;
        let stdout = child.stdout.take().context("child stdout")?;
        let tx = self.tx.clone();
        let who = format!("{role} rank {rank}");
        std::thread::Builder::new()
            .name(format!("demo-{role}-{rank}"))
            .spawn(move || {
                let mut reader = BufReader::new(stdout);
                let mut raw = Vec::new();
                loop {
                    raw.clear();
                    // Bytes, not `lines()`: a stray non-UTF-8 write by a
                    // library must not end the event stream.
                    match reader.read_until(b'\n', &mut raw) {
                        Ok(0) => break,
                        Ok(_) => {}
                        Err(err) => {
                            eprintln!("reading {who}'s events: {err}");
                            break;
                        }
                    }
                    let line = String::from_utf8_lossy(&raw);
                    let line = line.trim_end_matches(['\n', '\r']);
                    match serde_json::from_str::<Event>(line) {
                        Ok(event) => {
                            if tx.send((id, Some(event))).is_err() {
                                return;
                            }
                        }
                        Err(_) => eprintln!("{line}"),
                    }
                }
                let _ = tx.send((id, None));
            })?;
        self.entries.push(Entry {
            name: format!("{role} rank {rank}"),
            rank,
            child,
            killed: false,
        });
        Ok(id)
    }

    /// The next event from any child, waiting up to `timeout`.
    pub fn next_event(&mut self, timeout: Duration) -> Option<(ChildId, Option<Event>)> {
        if let Some(e) = self.backlog.pop_front() {
            return Some(e);
        }
        self.rx.recv_timeout(timeout).ok()
    }

    /// Process ids of the rank processes started so far.
    pub fn pids(&self) -> Vec<u32> {
        self.entries.iter().map(|e| e.child.id()).collect()
    }

    /// Every rank that reported ready so far.
    pub fn ready_ranks(&self) -> Vec<super::rogue::Target> {
        self.ready.clone()
    }

    /// Waits for `Ready` from each of `ids`; returns their engine sessions
    /// in order. Other children's events are kept for later.
    pub fn wait_ready(&mut self, ids: &[ChildId], deadline: Instant) -> Result<Vec<String>> {
        let mut sessions: Vec<Option<String>> = vec![None; ids.len()];
        while sessions.iter().any(Option::is_none) {
            crate::signals::check_termination()?;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("ranks did not become ready in time");
            }
            let (id, event) = match self.rx.recv_timeout(left.min(Duration::from_millis(200))) {
                Ok(e) => e,
                Err(_) => continue,
            };
            match (ids.iter().position(|i| *i == id), event) {
                (
                    Some(k),
                    Some(Event::Ready {
                        session,
                        control_port,
                        ..
                    }),
                ) => {
                    self.ready.push(super::rogue::Target {
                        control_port,
                        engine_session: session.clone(),
                    });
                    sessions[k] = Some(session);
                }
                // A rank already ready may run its whole workload (and end)
                // while another is still starting: its later events wait.
                (Some(k), Some(Event::Error { message })) if sessions[k].is_none() => {
                    bail!("{} failed to start: {message}", self.name(id))
                }
                (Some(k), None) if sessions[k].is_none() => bail!(
                    "{} exited during start-up ({}; its log lines, if any, are above)",
                    self.name(id),
                    self.exit_status(id)
                ),
                (_, other) => self.backlog.push_back((id, other)),
            }
        }
        Ok(sessions.into_iter().flatten().collect())
    }

    /// How child `id` ended (`exit status 1`, `signal 9`), waiting up to
    /// 2 s for it; `still running` past that.
    pub fn exit_status(&mut self, id: ChildId) -> String {
        let Some(e) = self.entries.get_mut(id) else {
            return "unknown child".into();
        };
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match e.child.try_wait() {
                Ok(Some(status)) => {
                    use std::os::unix::process::ExitStatusExt;
                    return match (status.code(), status.signal()) {
                        (Some(code), _) => format!("exit status {code}"),
                        (None, Some(sig)) => format!("killed by signal {sig}"),
                        (None, None) => status.to_string(),
                    };
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Ok(None) => return "still running".into(),
                Err(err) => return format!("status unknown: {err}"),
            }
        }
    }

    /// The rank index of child `id`.
    pub fn rank(&self, id: ChildId) -> u64 {
        self.entries.get(id).map_or(0, |e| e.rank)
    }

    /// `role rank N`, for messages.
    pub fn name(&self, id: ChildId) -> String {
        self.entries
            .get(id)
            .map_or_else(|| format!("child {id}"), |e| e.name.clone())
    }

    /// Whether the demo ended child `id` on purpose (killed or released).
    pub fn was_killed(&self, id: ChildId) -> bool {
        self.entries.get(id).is_some_and(|e| e.killed)
    }

    /// SIGKILLs child `id` and reaps it.
    pub fn kill(&mut self, id: ChildId) {
        if let Some(e) = self.entries.get_mut(id) {
            e.killed = true;
            let _ = e.child.kill();
            let _ = e.child.wait();
        }
    }

    /// Writes one command line to child `id`'s stdin (see
    /// `rank::control`); a child that is gone is logged, not an error.
    pub fn tell(&mut self, id: ChildId, line: &str) {
        use std::io::Write;
        let Some(e) = self.entries.get_mut(id) else {
            return;
        };
        let sent = match e.child.stdin.as_mut() {
            Some(stdin) => writeln!(stdin, "{line}").and_then(|()| stdin.flush()),
            None => Err(std::io::ErrorKind::BrokenPipe.into()),
        };
        if let Err(err) = sent {
            tracing::info!(child = e.name, line, "could not tell a rank: {err}");
        }
    }

    /// Closes the stdin of each of `ids` (supervised ranks then exit) and
    /// waits up to `timeout` for them to exit; kills the rest.
    pub fn release(&mut self, ids: &[ChildId], timeout: Duration) {
        let deadline = Instant::now() + timeout;
        for &id in ids {
            if let Some(e) = self.entries.get_mut(id) {
                drop(e.child.stdin.take());
            }
        }
        for &id in ids {
            let Some(e) = self.entries.get_mut(id) else {
                continue;
            };
            e.killed = true;
            loop {
                match e.child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() >= deadline => {
                        let _ = e.child.kill();
                        let _ = e.child.wait();
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        }
    }

    /// SIGKILLs every child still running.
    pub fn kill_all(&mut self) {
        for id in 0..self.entries.len() {
            self.kill(id);
        }
    }

    /// Closes every child's stdin (lingering ranks then exit), waits up to
    /// `timeout` for every child to exit, then kills the rest.
    pub fn wait_all(&mut self, timeout: Duration) {
        let everyone: Vec<ChildId> = (0..self.entries.len()).collect();
        self.release(&everyone, timeout);
    }
}

/// The rank processes of a run and their engine sessions.
pub struct Ranks {
    /// Prefill rank processes.
    pub prefill: Vec<ChildId>,
    /// Their engine sessions (`ip:port`).
    pub prefill_sessions: Vec<String>,
    /// Decode rank processes.
    pub decode: Vec<ChildId>,
    /// Their engine sessions.
    pub decode_sessions: Vec<String>,
}

impl Ranks {
    /// Starts every rank of `plan` and waits until each is ready; prefill
    /// first, so its registration is in place before a decode asks.
    pub fn start(plan: &Plan, children: &mut Children, deadline: Instant) -> Result<Self> {
        let prefill: Vec<ChildId> = plan
            .prefill_files
            .iter()
            .enumerate()
            .map(|(k, f)| children.spawn("prefill", k as u64, f))
            .collect::<Result<_>>()?;
        let prefill_sessions = children.wait_ready(&prefill, deadline)?;
        let decode: Vec<ChildId> = plan
            .decode_files
            .iter()
            .enumerate()
            .map(|(k, f)| children.spawn("decode", k as u64, f))
            .collect::<Result<_>>()?;
        let decode_sessions = children.wait_ready(&decode, deadline)?;
        Ok(Self {
            prefill,
            prefill_sessions,
            decode,
            decode_sessions,
        })
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for e in &mut self.entries {
            if let Ok(None) = e.child.try_wait() {
                let _ = e.child.kill();
                let _ = e.child.wait();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready(rank: u64) -> Event {
        Event::Ready {
            role: "decode".into(),
            rank,
            session: format!("127.0.0.1:{}", 5000 + rank),
            control_port: 0,
        }
    }

    #[test]
    fn a_rank_that_finishes_while_another_starts_is_not_a_start_up_failure() {
        let mut children = Children::new(std::env::temp_dir(), None);
        let finished = Event::Finished {
            role: "decode".into(),
            rank: 0,
        };
        for event in [
            (0, Some(ready(0))),
            (0, Some(finished)),
            (0, None),
            (1, Some(ready(1))),
        ] {
            children.tx.send(event).expect("channel open");
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        let sessions = children.wait_ready(&[0, 1], deadline).expect("both ready");
        assert_eq!(sessions, ["127.0.0.1:5000", "127.0.0.1:5001"]);
        // Rank 0's later events wait, in order, for the main loop.
        assert!(matches!(
            children.backlog.pop_front(),
            Some((0, Some(Event::Finished { .. })))
        ));
        assert!(matches!(children.backlog.pop_front(), Some((0, None))));
    }

    #[test]
    fn a_rank_that_ends_before_ready_fails_the_start() {
        let mut children = Children::new(std::env::temp_dir(), None);
        children.tx.send((0, Some(ready(0)))).expect("channel open");
        children.tx.send((1, None)).expect("channel open");
        let deadline = Instant::now() + Duration::from_secs(5);
        assert!(children.wait_ready(&[0, 1], deadline).is_err());
    }
}
