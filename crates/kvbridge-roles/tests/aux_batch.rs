//! Aux slots over zmq (intra-node transport): a decode rank that announced
//! kvbridge's `AUX_BATCH` in its registration gets a room's slots in one
//! message; one that did not (an sglang decode) gets sglang's `AUX_DATA`,
//! one per aux buffer. Either way ahead of the status, byte-exact. The
//! decode here is a bare socket, so the test sees the frames themselves.
// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvbridge_mem::HostBuffer;
use kvbridge_roles::{KvArgs, KvPoll};
use kvbridge_wire::{AuxBatch, AuxData, Limits, Status, ToDecode, Transfer, TransferPages};

const T: Duration = Duration::from_secs(20);
const AUX2_ITEM: usize = 32;

/// `pools`' KV and aux buffer plus a second aux buffer `aux2`.
fn with_second_aux(pools: &Pools, aux2: &HostBuffer) -> KvArgs {
    let mut args = pools.kv_args(16, 1, 0, 8);
    args.layout.aux_data_ptrs.push(aux2.addr());
    args.layout.aux_item_lens.push(AUX2_ITEM as u64);
    args.aux_data_lens.push(aux2.len() as u64);
    args
}

/// Every message the bare decode socket receives up to the room's status.
fn until_status(pull: &zmq::Socket) -> (Vec<Vec<Vec<u8>>>, Status<'static>) {
    let deadline = Instant::now() + T;
    let mut before = Vec::new();
    loop {
        assert!(Instant::now() < deadline, "no status within {T:?}");
        let Ok(frames) = pull.recv_multipart(0) else {
            continue;
        };
        if let Ok(ToDecode::Status(s)) = ToDecode::decode(&frames, &Limits::DEFAULT) {
            return (before, s.into_owned());
        }
        before.push(frames);
    }
}

#[test]
fn aux_is_batched_only_for_a_decode_that_announced_it() {
    for announced in [true, false] {
        let bs = bootstrap();
        let mut p_pools = Pools::new(1, 8, 256, 4, 64);
        let mut p_aux2 = HostBuffer::new(4 * AUX2_ITEM).unwrap();
        p_pools.fill_page(5, 1);
        p_pools.fill_page(6, 2);
        p_pools.fill_aux(9, 1);
        for (i, b) in p_aux2.as_mut_slice()[AUX2_ITEM..2 * AUX2_ITEM]
            .iter_mut()
            .enumerate()
        {
            *b = pattern(10, 98, i as u64);
        }
        let prefill = start_prefill(
            kvbridge_roles::PrefillConfig {
                nvlink_intra: true,
                ..prefill_config(bs.local_addr(), 1, 0)
            },
            with_second_aux(&p_pools, &p_aux2),
            tcp_engine(),
        );

        // The decode rank: a bare PULL socket, its registration (with or
        // without the announcement) and one room's destination.
        let d_pools = Pools::new(1, 8, 256, 4, 64);
        let d_aux2 = HostBuffer::new(4 * AUX2_ITEM).unwrap();
        let ctx = zmq::Context::new();
        let pull = ctx.socket(zmq::PULL).unwrap();
        pull.set_rcvtimeo(200).unwrap();
        pull.bind("tcp://127.0.0.1:*").unwrap();
        let bound = pull.get_last_endpoint().unwrap().unwrap();
        let port: u16 = bound.rsplit(':').next().unwrap().parse().unwrap();
        let session = "127.0.0.1:1";
        let mut reg =
            with_second_aux(&d_pools, &d_aux2).registration("127.0.0.1", port, session, 0);
        assert!(reg.aux_batch, "a kvbridge decode announces AUX_BATCH");
        reg.aux_batch = announced;
        let (_push_ctx, push) = rogue_socket(prefill.rank_port());
        push.send_multipart(reg.encode().iter().map(|f| f.as_ref()), 0)
            .unwrap();
        let room = 0xa0 + u64::from(announced);
        let mut tx = prefill.sender(room);
        tx.init(2, Some(1));
        let transfer = Transfer {
            room,
            endpoint: "127.0.0.1".into(),
            dst_port: port,
            mooncake_session_id: session.into(),
            pages: Some(TransferPages {
                dst_kv_indices: vec![3i32, 4].into(),
                dst_aux_index: 2,
                ..TransferPages::default()
            }),
            required_dst_info_num: 1,
            decode_prefix_len: None,
        };
        push.send_multipart(transfer.encode().iter().map(|f| f.as_ref()), 0)
            .unwrap();
        assert_eq!(
            wait_for(T, KvPoll::WaitingForInput, || tx.poll()),
            KvPoll::WaitingForInput
        );
        tx.send(&[1, 2], None, None).unwrap();

        let (before, status) = until_status(&pull);
        assert_eq!((status.room, status.status), (room, KvPoll::Success));
        let want_aux0 = p_pools.aux.as_slice()[64..128].to_vec();
        let want_aux1 = p_aux2.as_slice()[AUX2_ITEM..2 * AUX2_ITEM].to_vec();
        let batches: Vec<AuxBatch<'_>> = before
            .iter()
            .filter_map(|m| AuxBatch::decode(m, &Limits::DEFAULT).ok())
            .collect();
        let singles: Vec<AuxData<'_>> = before
            .iter()
            .filter_map(|m| match ToDecode::decode(m, &Limits::DEFAULT) {
                Ok(ToDecode::AuxData(a)) => Some(a),
                _ => None,
            })
            .collect();
        if announced {
            assert!(singles.is_empty(), "no AUX_DATA to an announcing decode");
            assert_eq!(batches.len(), 1, "one AUX_BATCH for the room");
            let b = &batches[0];
            assert_eq!((b.room, b.aux_index), (room, 2));
            let slots: Vec<(u32, Vec<u8>)> = b.slots().map(|(i, d)| (i, d.to_vec())).collect();
            assert_eq!(slots, vec![(0, want_aux0), (1, want_aux1)]);
        } else {
            assert!(batches.is_empty(), "no AUX_BATCH to an sglang decode");
            let got: Vec<(u64, u64, u64, Vec<u8>)> = singles
                .iter()
                .map(|a| (a.room, a.buffer_index, a.aux_index, a.data.to_vec()))
                .collect();
            assert_eq!(
                got,
                vec![(room, 0, 2, want_aux0), (room, 1, 2, want_aux1)],
                "one AUX_DATA per aux buffer"
            );
        }
        assert_eq!(wait_terminal(T, || tx.poll()), KvPoll::Success);
        tx.clear();
        prefill.teardown();
    }
}
