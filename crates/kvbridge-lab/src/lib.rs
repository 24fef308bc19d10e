//! # kvbridge-lab
//!
//! The demo lab behind `kvbridge demo`: a synthetic workload streamed
//! through real prefill and decode rank processes (the `kvbridge prefill`
//! and `kvbridge decode` commands run [`rank`]), every byte verified, with
//! the faults, network namespaces, rogue hosts, drains and soaks that
//! exercise the roles the way production does.
//!
//! * [`demo`]: the supervisor: plans the ranks, starts them (on loopback or
//!   in network namespaces), injects faults, tallies and prints the summary.
//! * [`rank`]: one rank process: its configuration file, pools, workload
//!   and the events it reports to the supervisor.
//! * [`signals`], [`gpu`], [`net`]: termination handling, the "no CUDA"
//!   check and command-line addresses, shared with the operator commands.
//!
//! **Owns:** everything synthetic (workloads, patterns, faults, soaks) and
//! the supervisor–rank protocol. **Never:** implements a transfer, a plan
//! or a role itself (the kvbridge crates do), or serves an operator command
//! (`bench`, `plan`, `wire`, `bootstrap` stay in the `kvbridge` binary).

pub mod demo;
pub mod gpu;
pub mod net;
pub mod rank;
pub mod signals;
