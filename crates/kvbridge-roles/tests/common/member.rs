//! A rogue member of a secret-mode cluster: it holds the secret (so its
//! messages pass zmq CURVE) but serves none of the rooms, and sends what it
//! likes to a rank's control socket.

use std::time::{Duration, Instant};

use kvbridge_engine::ClusterSecret;
use kvbridge_roles::control::{ControlContext, ControlSecurity, PushPool};
use kvbridge_roles::metrics::Metrics;
use kvbridge_wire::mac_frame;

/// A member of the cluster that serves no room.
pub struct Rogue {
    _ctx: ControlContext,
    pub push: PushPool,
}

impl Rogue {
    pub fn new(secret: &ClusterSecret) -> Self {
        let ctx = ControlContext::new(ControlSecurity::from_secret(Some(secret))).unwrap();
        let push = PushPool::new(&ctx, Duration::from_secs(2));
        Self { _ctx: ctx, push }
    }

    /// Sends `frames` to the rank on `port` twice: bare, and ending in a
    /// made-up MAC frame.
    pub fn send(&self, port: u16, frames: Vec<Vec<u8>>) {
        let to = format!("tcp://127.0.0.1:{port}");
        let mut with_mac = frames.clone();
        with_mac.push(mac_frame(&[0x5a; 16]));
        for f in [frames, with_mac] {
            self.push.send(&to, f.iter().map(Vec::as_slice)).unwrap();
        }
    }
}

/// A message's frames, owned.
pub fn owned(frames: kvbridge_wire::Frames<'_>) -> Vec<Vec<u8>> {
    frames.into_iter().map(|f| f.into_owned()).collect()
}

/// Waits until `metrics` counted `n` drops of `kind` (or 3 s: a build that
/// takes forgeries counts none, and must fail on what they did).
pub fn wait_dropped_as<'a>(metrics: impl Fn() -> Vec<&'a Metrics>, kind: &str, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(3);
    while metrics().iter().map(|m| m.dropped_for(kind)).sum::<u64>() < n
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(5));
    }
}
