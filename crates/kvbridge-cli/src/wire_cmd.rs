//! `kvbridge wire decode|encode`: the wire crate's JSON form on stdin/stdout
//! (docs/cli.md). Exit 0 with a message or `{"error": …}`; exit 2
//! only when stdin is not the expected JSON.

use std::io::Read;
use std::process::ExitCode;

use clap::Subcommand;
use kvbridge_wire::Limits;
use kvbridge_wire::json::{decode_command, encode_command};

/// The two directions of the JSON bridge.
#[derive(Debug, Subcommand)]
pub enum WireCommand {
    /// Frames (hex) on stdin → the message as JSON on stdout.
    Decode,
    /// A message as JSON on stdin → its frames (hex) on stdout.
    Encode,
}

/// Runs one `wire` subcommand.
pub fn run(cmd: WireCommand) -> ExitCode {
    let mut input = String::new();
    if let Err(e) = std::io::stdin().read_to_string(&mut input) {
        eprintln!("kvbridge wire: cannot read stdin: {e}");
        return ExitCode::from(2);
    }
    let result = match cmd {
        WireCommand::Decode => decode_command(&input, &Limits::DEFAULT),
        WireCommand::Encode => encode_command(&input),
    };
    match result {
        Ok(json) => {
            println!("{json}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvbridge wire: {e}");
            ExitCode::from(2)
        }
    }
}
