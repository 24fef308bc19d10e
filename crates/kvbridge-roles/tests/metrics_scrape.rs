//! The metrics endpoints of a prefill and a decode that moved real rooms:
//! served as OpenMetrics (content type, `# EOF`), parsed by an OpenMetrics
//! parser, and counting what happened: the decode's delivered bytes and
//! latencies as well as the prefill's.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use kvbridge_roles::KvPoll;
use kvbridge_roles::metrics::OPENMETRICS_CONTENT_TYPE;
use openmetrics_parser::{MetricNumber, OpenMetricsType, OpenMetricsValue};

const T: Duration = Duration::from_secs(20);
const ROOMS: u64 = 3;
const PAGES: usize = 5;
const ITEM: u64 = 1024;
const AUX_ITEM: u64 = 64;

/// `GET /metrics`: (content type, body).
fn scrape(addr: SocketAddr) -> (String, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let content_type = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-type")
                .then(|| v.trim().to_owned())
        })
        .unwrap();
    (content_type, body.to_owned())
}

fn number(n: &MetricNumber) -> f64 {
    n.as_f64()
}

/// The value of counter `family` (summed over its label sets).
fn counter(text: &str, family: &str) -> f64 {
    let exposition = openmetrics_parser::openmetrics::parse_openmetrics(text)
        .unwrap_or_else(|e| panic!("not OpenMetrics: {e:?}\n{text}"));
    let fam = exposition
        .families
        .get(family)
        .unwrap_or_else(|| panic!("no family {family}"));
    assert_eq!(fam.family_type, OpenMetricsType::Counter, "{family}");
    assert!(!fam.help.ends_with(".."), "HELP of {family}: {}", fam.help);
    fam.iter_samples()
        .map(|s| match &s.value {
            OpenMetricsValue::Counter(c) => number(&c.value),
            other => panic!("{family}: {other:?}"),
        })
        .sum()
}

/// (count, sum) of histogram `family`.
fn histogram(text: &str, family: &str) -> (u64, f64) {
    let exposition = openmetrics_parser::openmetrics::parse_openmetrics(text).unwrap();
    let fam = exposition.families.get(family).unwrap();
    assert_eq!(fam.family_type, OpenMetricsType::Histogram, "{family}");
    let sample = fam.iter_samples().next().unwrap();
    match &sample.value {
        OpenMetricsValue::Histogram(h) => (h.count.unwrap(), number(&h.sum.unwrap())),
        other => panic!("{family}: {other:?}"),
    }
}

#[test]
fn both_sides_serve_parseable_openmetrics_that_count_delivered_bytes() {
    let bs = bootstrap();
    let mut p_pools = Pools::new(2, 32, ITEM, 4, AUX_ITEM);
    let d_pools = Pools::new(2, 64, ITEM, 8, AUX_ITEM);
    for p in 0..PAGES {
        p_pools.fill_page(p as u64 + 1, p);
    }
    let mut p_config = prefill_config(bs.local_addr(), 1, 0);
    p_config.metrics_addr = Some("127.0.0.1:0".parse().unwrap());
    let mut d_config = decode_config(1);
    d_config.metrics_addr = Some("127.0.0.1:0".parse().unwrap());
    let prefill = start_prefill(p_config, p_pools.kv_args(16, 1, 0, 8), tcp_engine());
    let decode = start_decode(d_config, d_pools.kv_args(16, 1, 0, 8), tcp_engine());

    let src: Vec<i32> = (0..PAGES as i32).collect();
    for room in 0..ROOMS {
        let dst: Vec<i32> = src.iter().map(|p| p + 10 * room as i32).collect();
        let mut rx = decode.receiver(&bs.local_addr().to_string(), room);
        assert_eq!(rx.init(0), KvPoll::WaitingForInput);
        rx.send_metadata(&dst, room, &[], None);
        let mut tx = prefill.sender(room);
        tx.init(src.len() as u64, Some(0));
        wait_for(T, KvPoll::WaitingForInput, || tx.poll());
        tx.send(&src, None, None).unwrap();
        assert_eq!(wait_terminal(T, || tx.poll()), KvPoll::Success);
        assert_eq!(wait_terminal(T, || rx.poll()), KvPoll::Success);
        for (s, d) in src.iter().zip(&dst) {
            assert!(d_pools.page_matches(*s as u64 + 1, *d as usize));
        }
        rx.clear();
        tx.clear();
    }

    // 2 layers of K and V: 4 KV buffers of ITEM bytes a page, one aux slot.
    let kv_bytes = ROOMS * PAGES as u64 * 4 * ITEM;
    let (d_type, d_text) = scrape(decode.metrics_addr().unwrap());
    let (p_type, p_text) = scrape(prefill.metrics_addr().unwrap());
    for (ty, text) in [(&d_type, &d_text), (&p_type, &p_text)] {
        assert_eq!(ty, OPENMETRICS_CONTENT_TYPE);
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(text.contains("# TYPE kvbridge_rooms counter"), "{text}");
        assert!(text.contains("kvbridge_rooms_total{result=\"success\"} 3"));
    }
    assert_eq!(
        counter(&d_text, "kvbridge_transfer_bytes") as u64,
        kv_bytes + ROOMS * AUX_ITEM,
        "the decode counts every page and aux slot it received"
    );
    assert!(counter(&p_text, "kvbridge_transfer_bytes") as u64 >= kv_bytes);
    assert_eq!(counter(&d_text, "kvbridge_rooms") as u64, ROOMS);
    let (count, sum) = histogram(&d_text, "kvbridge_transfer_latency_seconds");
    assert_eq!(count, ROOMS, "one latency per decoded room");
    assert!(sum > 0.0 && sum < 3.0 * T.as_secs_f64(), "{sum}");
    assert_eq!(
        histogram(&p_text, "kvbridge_transfer_latency_seconds").0,
        ROOMS
    );
    // sglang's own counter keeps its name (a colon is legal in OpenMetrics).
    assert_eq!(counter(&p_text, "sglang:failed_session_recoveries"), 0.0);
    prefill.teardown();
    decode.teardown();
}
