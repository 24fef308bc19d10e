//! Planner speed on the four large cases of issue 3 (sglang's Python planner
//! for comparison: 3.7 s, 1.2 s, 0.83 s and 40 ms respectively).
//!
//! Each case is built in code (`kvbridge::plan::synthetic`), registered once,
//! and timed as the worker runs it: `Planner::plan_chunk` with a reused
//! planner (buffers warm), single-threaded.
//!
//! `cargo bench --bench plan`

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvbridge::plan::synthetic::LargeCase;
use kvbridge::plan::{Planner, PreparedPeer};

fn plan_large_cases(c: &mut Criterion) {
    let mut group = c.benchmark_group("plan_chunk");
    group.sample_size(30);
    group.measurement_time(Duration::from_secs(4));
    for case in LargeCase::ALL {
        let inputs = case.scenario().inputs();
        let peer = match PreparedPeer::new(&inputs.layout, inputs.registration.clone()) {
            Ok(p) => p,
            Err(e) => panic!("{}: registration rejected: {e}", case.name()),
        };
        let mut planner = Planner::new();
        let blocks = match planner.plan_chunk(&inputs.layout, &peer, &inputs.request, &inputs.chunk)
        {
            Ok(p) => p.block_count(),
            Err(e) => panic!("{}: chunk rejected: {e}", case.name()),
        };
        group.throughput(Throughput::Elements(blocks as u64));
        group.bench_function(case.name(), |b| {
            b.iter(|| {
                let plan = planner
                    .plan_chunk(
                        black_box(&inputs.layout),
                        black_box(&peer),
                        black_box(&inputs.request),
                        black_box(&inputs.chunk),
                    )
                    .map(|p| p.block_count());
                black_box(plan)
            });
        });
    }
    group.finish();
}

criterion_group!(benches, plan_large_cases);
criterion_main!(benches);
