//! `cargo xtask cluster [--full] [--soak-minutes N [--soak-only]] [--release]
//! [--kvbridge PATH] [--save DIR]`: a real cluster on this machine. Every scenario runs
//! `kvbridge demo --netns`:
//! the bootstrap server and every prefill and decode rank on a host of its
//! own (a network namespace with its own address on a bridge), a
//! byte-verified workload over the TCP engine or UCX (its `tcp` transport,
//! on each host's own interface), and one scripted fault. Each scenario's
//! JSON summary is checked against the outcome the scenario expects; a
//! table of the results ends the run. Needs root and iproute2.
//!
//! The short list (CI) takes a few minutes; `--full` runs bigger workloads
//! and every fault over both engines; `--soak-minutes N` adds a soak: more
//! than 1,000 rooms in flight for N minutes, random faults every few
//! seconds, a drain at the end (no room is started past N minutes; the
//! ones in flight finish), and every rank process's fds, threads and
//! memory checked for growth. `--soak-only` runs just the soak;
//! `--kvbridge PATH` runs a given binary instead of building one; `--save
//! DIR` keeps every scenario's JSON summary there.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// One scenario: the demo's flags and what its summary must show.
struct Scenario {
    name: String,
    args: Vec<String>,
    expect: fn(&Value) -> Result<()>,
}

fn num(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or(0)
}

/// What every scenario must show: no byte written where it should not
/// have been, every room concluded, every failure with a reason, and
/// bytes that crossed between hosts.
fn sound(v: &Value) -> Result<()> {
    if num(v, "mismatched_bytes") != 0 {
        bail!("{} mismatched bytes", num(v, "mismatched_bytes"));
    }
    let (ok, failed, all) = (num(v, "succeeded"), num(v, "failed"), num(v, "requests"));
    if ok + failed != all {
        bail!("{ok} succeeded + {failed} failed != {all} requests: rooms left unconcluded");
    }
    let failures = v["failures"].as_array().map_or(&[][..], Vec::as_slice);
    if let Some(f) = failures
        .iter()
        .find(|f| f["reason"].as_str().is_none_or(str::is_empty))
    {
        bail!("a failure without a reason: {f}");
    }
    // Hosts that ran a decode rank (after a role switch: either role first).
    let decode_rx: u64 = hosts(v)
        .iter()
        .filter(|h| h["host"].as_str().is_some_and(|n| n.contains("decode")))
        .map(|h| num(h, "rx_bytes"))
        .sum();
    if decode_rx < num(v, "bytes") {
        bail!(
            "decode hosts received {decode_rx} bytes, less than the {} verified: not across hosts?",
            num(v, "bytes")
        );
    }
    Ok(())
}

fn hosts(v: &Value) -> &[Value] {
    v["hosts"].as_array().map_or(&[][..], Vec::as_slice)
}

fn all_succeed(v: &Value) -> Result<()> {
    sound(v)?;
    if num(v, "failed") != 0 {
        bail!("{} rooms failed: {}", num(v, "failed"), v["failures"]);
    }
    Ok(())
}

/// A fault that must have happened, cost rooms, and been recovered from.
fn fails_then_recovers(v: &Value) -> Result<()> {
    sound(v)?;
    let f = &v["fault"];
    if f["injected"] != true {
        bail!("the fault never started: {f}");
    }
    if num(f, "failed_from_start") == 0 {
        bail!("no room failed while the fault lasted: {f}");
    }
    if num(f, "succeeded_after") == 0 {
        bail!("no room succeeded after the fault was undone: {f}");
    }
    Ok(())
}

/// A fault that must have happened and been recovered from (rooms may or
/// may not have failed meanwhile), or ridden out: a run that finished every
/// room while it lasted, none failed.
fn recovers(v: &Value) -> Result<()> {
    sound(v)?;
    let f = &v["fault"];
    if f["injected"] != true {
        bail!("the fault did not start: {f}");
    }
    if num(f, "succeeded_after") == 0 && num(v, "failed") > 0 {
        bail!("rooms failed and none succeeded after the fault: {f}");
    }
    Ok(())
}

/// A role switch under load: no room lost, and after it the bytes flowed
/// the other way: into the hosts that ran the prefill ranks before.
fn switched(v: &Value) -> Result<()> {
    all_succeed(v)?;
    let f = &v["fault"];
    if f["injected"] != true || num(f, "succeeded_after") == 0 {
        bail!("no room ran after the role switch: {f}");
    }
    // Outcomes are one per room and decode rank (half the hosts but the
    // bootstrap's); the bytes of those after the switch went the other way.
    let decode_ranks = (hosts(v).len().saturating_sub(1) / 2).max(1) as f64;
    let outcomes = (num(v, "succeeded") as f64 * decode_ranks).max(1.0);
    let after = num(f, "succeeded_after") as f64 / outcomes;
    let former_prefills = |n: &str| n.starts_with("prefill") && n.contains("then decode");
    if !hosts(v)
        .iter()
        .any(|h| h["host"].as_str().is_some_and(former_prefills))
    {
        bail!("no host reports a switch from prefill to decode");
    }
    let into_old_prefills: u64 = hosts(v)
        .iter()
        .filter(|h| h["host"].as_str().is_some_and(former_prefills))
        .map(|h| num(h, "rx_bytes"))
        .sum();
    let expected = (num(v, "bytes") as f64 * after / 2.0) as u64;
    if into_old_prefills < expected {
        bail!(
            "the former prefill hosts received {into_old_prefills} bytes, less than half \
             the {expected} expected after the switch"
        );
    }
    Ok(())
}

fn decode_restarts(v: &Value) -> Result<()> {
    sound(v)?;
    if num(v, "succeeded") <= 8 {
        bail!("the new decode incarnation completed nothing: {v}");
    }
    Ok(())
}

/// Resources of every rank after the warm-up: bounded growth.
fn bounded(v: &Value) -> Result<()> {
    sound(v)?;
    let procs = v["resources"].as_array().map_or(&[][..], Vec::as_slice);
    if procs.is_empty() {
        bail!("no resource samples");
    }
    for p in procs {
        let (s, l) = (&p["settled"], &p["last"]);
        let grew = |k: &str| num(l, k).saturating_sub(num(s, k));
        if grew("fds") > 64 || grew("threads") > 16 || grew("rss_mib") > num(s, "rss_mib") / 4 + 64
        {
            bail!("{} grew: from {s} to {l}", p["name"]);
        }
    }
    injected_then_serves(v)
}

/// Random faults (the soaks): they started, and rooms succeeded after
/// them. Whether one costs rooms depends on what was between sends when it
/// began: a 3 s partition that starts while the prefill waits for the cut
/// decode's destinations delays rooms (TCP resends what it dropped) within
/// their deadlines and fails none. The scenarios of one long fault each
/// check that a fault costs rooms.
fn injected_then_serves(v: &Value) -> Result<()> {
    sound(v)?;
    let f = &v["fault"];
    if f["injected"] != true {
        bail!("the fault never started: {f}");
    }
    if num(f, "succeeded_after") == 0 {
        bail!("no room succeeded after the faults: {f}");
    }
    Ok(())
}

/// A soak sized in time: bounded resources, and it ran until its drain
/// (not out of requests first).
fn soaked(v: &Value) -> Result<()> {
    bounded(v)?;
    if num(v, "drained") == 0 {
        bail!("the soak ran out of requests before its time: raise its --requests");
    }
    Ok(())
}

fn scenario<S: AsRef<str>>(name: &str, args: &[S], expect: fn(&Value) -> Result<()>) -> Scenario {
    Scenario {
        name: name.to_owned(),
        args: args.iter().map(|s| s.as_ref().to_owned()).collect(),
        expect,
    }
}

/// The scenarios, short (CI) or `full`; each over `engines`.
fn scenarios(full: bool, engines: &[&str]) -> Vec<Scenario> {
    let requests = if full { "400" } else { "60" };
    let layers = if full { "8" } else { "4" };
    let base = ["--layers", layers, "--decode-tp", "2"];
    // Short deadlines, so a fault of a few seconds fails rooms.
    let deadlines = ["--room-timeout-s", "4", "--engine-io-timeout-ms", "2000"];
    let mut out = Vec::new();
    for engine in engines {
        // The base, the engine, `--requests` (unless `extra` sets it), `extra`.
        let with = |extra: &[&str]| -> Vec<String> {
            let count: &[&str] = if extra.contains(&"--requests") {
                &[]
            } else {
                &["--requests", requests]
            };
            base.iter()
                .chain(&["--engine", *engine])
                .chain(count)
                .chain(extra)
                .map(|a| (*a).to_owned())
                .collect()
        };
        out.push(scenario(
            &format!("{engine}: workload"),
            &with(&[]),
            all_succeed,
        ));
        // A fault for 8 s after decode rank 0's 4th room, short deadlines.
        let for_8s = |kind: &str| {
            let fault = ["--fault", kind, "--fault-after", "4", "--fault-secs", "8"];
            with(&[&fault[..], &deadlines].concat())
        };
        out.push(scenario(
            &format!("{engine}: link prefill 0 - decode 0 down 8 s"),
            &for_8s("partition"),
            fails_then_recovers,
        ));
        out.push(scenario(
            &format!("{engine}: decode host killed and restarted"),
            &with(&["--kill-decode-after", "6"]),
            decode_restarts,
        ));
        out.push(scenario(
            &format!("{engine}: decode host stopped 8 s"),
            &for_8s("stop-decode"),
            fails_then_recovers,
        ));
        out.push(scenario(
            &format!("{engine}: bootstrap host down 5 s"),
            &with(&[
                "--fault",
                "bootstrap-down",
                "--fault-after",
                "2",
                "--fault-secs",
                "5",
                // Enough rooms to outlast the fault: a run that ends while
                // the bootstrap server is away shows no recovery.
                "--requests",
                "800",
            ]),
            recovers,
        ));
        out.push(scenario(
            &format!("{engine}: prefill and decode hosts switch roles under load"),
            &with(&[
                "--prefill-tp",
                "2",
                "--fault",
                "role-switch",
                "--fault-after",
                "10",
            ]),
            switched,
        ));
        if !full {
            // The short list runs the faults over the first engine only.
            break;
        }
    }
    out
}

/// The soaks' shape: small rooms, two decode ranks, short deadlines.
const SOAK: &[&str] = &[
    "--layers",
    "1",
    "--prompt-tokens",
    "48",
    "--chunk-tokens",
    "16",
    "--decode-tp",
    "2",
    "--room-timeout-s",
    "6",
    "--engine-io-timeout-ms",
    "2000",
];

/// The soak: rooms for `minutes`, then a drain (the rooms in flight
/// finish, the rest are never started).
fn soak(minutes: u64) -> Scenario {
    let seconds = (minutes * 60).to_string();
    // The drain, the tail (rooms the faults left waiting out their
    // deadlines) and start-up, with room to spare.
    let timeout = (minutes * 60 + 900).to_string();
    scenario(
        &format!(
            "soak: {minutes} min, 1200 rooms in flight, a random fault every ~20 s, \
             resources checked"
        ),
        &[
            SOAK,
            &[
                "--concurrency",
                "600",
                "--requests",
                "2000000",
                "--drain-after-s",
                &seconds,
                "--fault",
                "random",
                "--fault-after",
                "100",
                "--fault-secs",
                "4",
                "--fault-every",
                "20",
                "--timeout-s",
                &timeout,
            ],
        ]
        .concat(),
        soaked,
    )
}

/// Runs one scenario with `kvbridge`; its summary or why it failed. With
/// `save`, the summary also goes to `save/<scenario>.json`.
fn run_one(kvbridge: &Path, s: &Scenario, save: Option<&Path>) -> Result<Value> {
    let out = Command::new(kvbridge)
        .args(["demo", "--netns", "--json"])
        .args(&s.args)
        .output()
        .with_context(|| format!("running {}", kvbridge.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(text.trim()).with_context(|| {
        format!(
            "no summary (exit {}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .rev()
                .take(5)
                .collect::<Vec<_>>()
                .join(" | ")
        )
    })?;
    if let Some(dir) = save {
        let name: String = s
            .name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join(format!("{name}.json")), text.trim())?;
    }
    (s.expect)(&v)?;
    Ok(v)
}

fn ucx_available() -> bool {
    Command::new("ldconfig")
        .arg("-p")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("libucp.so"))
        .unwrap_or(false)
}

/// Runs the scenarios (see the module doc).
pub fn cluster(root: &Path, args: &[String]) -> Result<()> {
    let full = args.iter().any(|a| a == "--full");
    let release = args.iter().any(|a| a == "--release");
    let soak_minutes = args
        .iter()
        .position(|a| a == "--soak-minutes")
        .and_then(|i| args.get(i + 1))
        .map(|m| m.parse::<u64>().context("--soak-minutes N"))
        .transpose()?;
    let given = args
        .iter()
        .position(|a| a == "--kvbridge")
        .map(|i| args.get(i + 1).context("--kvbridge PATH"))
        .transpose()?;
    let save: Option<PathBuf> = args
        .iter()
        .position(|a| a == "--save")
        .map(|i| args.get(i + 1).map(PathBuf::from).context("--save DIR"))
        .transpose()?;
    let kvbridge: PathBuf = match given {
        // A binary of its own: a long soak is not disturbed by rebuilds.
        Some(path) => PathBuf::from(path),
        None => {
            let mut build = vec!["build", "-p", "kvbridge-cli"];
            if release {
                build.push("--release");
            }
            crate::run("cargo", &build)?;
            root.join("target")
                .join(if release { "release" } else { "debug" })
                .join("kvbridge")
        }
    };
    let mut engines = vec!["tcp"];
    if ucx_available() {
        engines.push("ucx");
    } else {
        eprintln!("xtask cluster: no libucp here; UCX scenarios skipped");
    }
    let mut list = scenarios(full, &engines);
    if !full && engines.contains(&"ucx") {
        list.insert(
            1,
            scenario(
                "ucx: workload",
                &[
                    "--layers",
                    "4",
                    "--requests",
                    "60",
                    "--decode-tp",
                    "2",
                    "--engine",
                    "ucx",
                ],
                all_succeed,
            ),
        );
    }
    // A short soak: hundreds of rooms in flight and a random fault every
    // ~10 s for about a minute, resources checked (`--soak-minutes` for
    // the long one).
    list.push(scenario(
        "soak, short: 2 x 300 rooms in flight, random faults every ~10 s",
        &[
            SOAK,
            &[
                "--concurrency",
                "300",
                "--requests",
                "6000",
                "--fault",
                "random",
                "--fault-after",
                "50",
                "--fault-secs",
                "3",
                "--fault-every",
                "10",
            ],
        ]
        .concat(),
        bounded,
    ));
    if args.iter().any(|a| a == "--soak-only") {
        list.clear();
    }
    if let Some(m) = soak_minutes {
        list.push(soak(m));
    }
    let mut rows = Vec::new();
    let mut failed = 0;
    for s in &list {
        eprintln!("xtask cluster: {} ...", s.name);
        let t = Instant::now();
        let row = match run_one(&kvbridge, s, save.as_deref()) {
            Ok(v) => format!(
                "| {} | pass | {}/{} rooms, {} failed | {:.2} GB/s | p50 {:.0} ms, p99 {:.0} ms | {:.0} s |",
                s.name,
                num(&v, "succeeded"),
                num(&v, "requests"),
                num(&v, "failed"),
                v["gbps"].as_f64().unwrap_or(0.0),
                v["p50_ms"].as_f64().unwrap_or(0.0),
                v["p99_ms"].as_f64().unwrap_or(0.0),
                t.elapsed().as_secs_f64()
            ),
            Err(e) => {
                failed += 1;
                format!(
                    "| {} | FAIL | {e:#} | | | {:.0} s |",
                    s.name,
                    t.elapsed().as_secs_f64()
                )
            }
        };
        eprintln!("{row}");
        rows.push(row);
    }
    println!("| scenario | result | rooms | throughput | latency | took |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for r in &rows {
        println!("{r}");
    }
    if failed > 0 {
        bail!("{failed} of {} cluster scenarios failed", list.len());
    }
    Ok(())
}
