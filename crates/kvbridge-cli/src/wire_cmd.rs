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
    /// Frames → message: reads `{"to": "prefill"|"decode", "frames": ["<hex>", ...]}`
    /// on stdin and prints the message as JSON (`{"kind": ..., ...}`), or
    /// `{"error": reason}` when the frames are not a valid message.
    Decode {
        /// The side that received the frames, for input without a `to`
        /// field (such as `wire encode`'s output: `wire encode | wire decode
        /// --to prefill`). A `to` in the input wins.
        #[arg(long, value_parser = ["prefill", "decode"])]
        to: Option<String>,
    },
    /// Message → frames: reads a message as JSON (`{"kind": ..., ...}`, what
    /// `wire decode` prints) on stdin and prints `{"frames": ["<hex>", ...]}`.
    Encode,
}

/// `input` with `"to": side` added when it is an object without one.
fn with_side(input: &str, side: Option<&str>) -> String {
    let Some(side) = side else {
        return input.to_owned();
    };
    match serde_json::from_str::<serde_json::Value>(input) {
        Ok(serde_json::Value::Object(mut map)) if !map.contains_key("to") => {
            map.insert("to".into(), side.into());
            serde_json::Value::Object(map).to_string()
        }
        _ => input.to_owned(),
    }
}

/// Runs one `wire` subcommand.
pub fn run(cmd: WireCommand) -> ExitCode {
    let mut input = String::new();
    if let Err(e) = std::io::stdin().read_to_string(&mut input) {
        eprintln!("kvbridge wire: cannot read stdin: {e}");
        return ExitCode::from(2);
    }
    let result = match cmd {
        WireCommand::Decode { to } => {
            decode_command(&with_side(&input, to.as_deref()), &Limits::DEFAULT)
        }
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
