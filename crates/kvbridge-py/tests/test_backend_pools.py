"""DeepSeek-V4 (compressed-MLA) pools, their ``kv_layout`` tag, HiSparse
decodes and decode host destinations through the kvbridge backend, with
``KVArgs`` filled by sglang's own ``PrefillBootstrapQueue._init_kv_manager``
and ``DecodePreallocQueue._init_kv_manager`` (``sgl_sched``)."""

import contextlib
import types

import numpy as np
import pytest
import sgl_sched as w

#: Four layers: an uncompressed one, C4 (layers 1, 3) and C128 (layer 2).
RATIOS = [0, 4, 128, 4]
PAGE = 64
PAGES = 16
V4_TAG = "v4,c4:v4,c128:v4"


@pytest.fixture
def world(monkeypatch):
    s = w.sglang()
    world = w.World(s, monkeypatch)
    yield world
    world.close()


def done(s, *ends):
    return [w.poll_until(e, (s.KVPoll.Success, s.KVPoll.Failed)) for e in ends]


def swa_states(pages):
    """The SWA-state index list of a V4 room (its ``_swa_payload``)."""
    return [np.asarray(pages, dtype=np.int32)]


def test_a_v4_pool_moves_with_its_layout_tag(world):
    s = world.s
    src = w.v4_pool(s, RATIOS, PAGES, PAGE, seed=3)
    dst = w.v4_pool(s, RATIOS, PAGES, PAGE)
    p = world.keep(w.prefill_manager(s, src, is_mla=True, layers=len(RATIOS)))
    d = world.keep(w.decode_manager(s, dst, is_mla=True, layers=len(RATIOS)))
    # What sglang's code put in KVArgs: the ratios and the pool's layout tag.
    assert p.kv_args.mla_compression_ratios == RATIOS and d.kv_args.kv_layout == V4_TAG
    src_pages, dst_pages = [0, 1, 2], [9, 4, 12]
    rx, tx = w.transfer(s, world, p, d, 0x5401, src_pages, dst_pages,
                        state_src=swa_states(src_pages), state_dst=swa_states(dst_pages))
    assert done(s, rx, tx) == [s.KVPoll.Success] * 2
    for b in range(len(src.kv.bufs)):
        for sp, dp in zip(src_pages, dst_pages):
            assert (dst.kv.page(b, dp) == src.kv.page(b, sp)).all(), (b, sp)
    for b in range(len(src.swa.bufs)):
        for sp, dp in zip(src_pages, dst_pages):
            assert (dst.swa.page(b, dp) == src.swa.page(b, sp)).all(), ("swa", b, sp)


def test_a_kv_layout_mismatch_fails_the_handshake_naming_both(world):
    s = world.s
    src = w.v4_pool(s, RATIOS, PAGES, PAGE, seed=3, layout=s.KVLayout.V41)
    dst = w.v4_pool(s, RATIOS, PAGES, PAGE)
    p = world.keep(w.prefill_manager(s, src, is_mla=True, layers=len(RATIOS)))
    d = world.keep(w.decode_manager(s, dst, is_mla=True, layers=len(RATIOS)))
    assert p.kv_args.kv_layout == "v41,c4:v41,c128:v41"
    rx = s.backend.KVReceiver(d, world.addr, 0x5402)
    rx.init(0)
    assert rx.poll() == s.KVPoll.Failed
    with pytest.raises(Exception) as e:
        rx.failure_exception()
    assert "kv_layout=v41,c4:v41,c128:v41" in str(e.value) and f"kv_layout={V4_TAG}" in str(e.value)
    assert not d.try_ensure_parallel_info(world.addr)


def hisparse_decode(s, world, *, draft=None, v4=True):
    """A HiSparse decode as sglang builds it: the C4 KV (or, without
    compression, all target KV) in the host pool, the rest on the device."""
    if v4:
        dst = w.v4_pool(s, RATIOS, PAGES, PAGE)
        host = w.HostPool([w.V4_ITEMS["c4"]] * RATIOS.count(4), 2 * PAGES)
    else:
        dst = w.PlainPool([128] * 2, PAGES, PAGE)
        host = w.HostPool([128] * 2, 2 * PAGES)
    d = w.decode_manager(s, dst, is_mla=True, layers=len(RATIOS), hisparse_host=host, draft=draft)
    return dst, host, world.keep(d)


def test_a_hisparse_v4_decode_takes_c4_kv_in_host_pages_and_the_rest_in_device_pages(world):
    s = world.s
    src = w.v4_pool(s, RATIOS, PAGES, PAGE, seed=5)
    p = world.keep(w.prefill_manager(s, src, is_mla=True, layers=len(RATIOS)))
    dst, host, d = hisparse_decode(s, world)
    c4 = RATIOS.count(4)
    # sglang's decode appends the device buffers after the host C4 layers.
    assert d.kv_args.kv_data_ptrs[:c4] == host.infos()[0]
    assert d.kv_args.kv_data_ptrs[c4:] == dst.kv.infos()[0][c4:]
    src_pages, host_pages, device_pages = [0, 1, 2], [25, 3, 17], [9, 4, 12]
    rx, tx = w.transfer(s, world, p, d, 0x5403, src_pages, host_pages, device_pages=device_pages,
                        state_src=swa_states(src_pages), state_dst=swa_states(device_pages))
    assert done(s, rx, tx) == [s.KVPoll.Success] * 2
    for b in range(len(src.kv.bufs)):
        for sp, hp, dp in zip(src_pages, host_pages, device_pages):
            if b < c4:
                assert (host.page(b, hp) == src.kv.page(b, sp)).all(), ("host", b, sp)
                assert not dst.kv.page(b, dp).any(), "the device C4 KV stays untouched"
            else:
                assert (dst.kv.page(b, dp) == src.kv.page(b, sp)).all(), ("device", b, sp)
    for b in range(len(src.swa.bufs)):
        for sp, dp in zip(src_pages, device_pages):
            assert (dst.swa.page(b, dp) == src.swa.page(b, sp)).all(), ("swa", b, sp)


def test_hisparse_with_a_draft_on_a_pool_without_compression_is_refused_at_start(world):
    s = world.s
    draft = w.PlainPool([128], PAGES, PAGE)
    with pytest.raises(s.backend.BackendConfigError, match="HiSparse") as e:
        hisparse_decode(s, world, draft=draft, v4=False)
    assert "draft" in str(e.value) and "enable-hisparse" in str(e.value)


def test_hisparse_without_a_draft_on_a_pool_without_compression_receives_into_the_host_pool(world):
    # sglang sends host pages only (no device_kv_indices): a plain transfer.
    s = world.s
    src = w.PlainPool([128] * 2, PAGES, PAGE, seed=9)
    p = world.keep(w.prefill_manager(s, src, is_mla=True, layers=2))
    dst, host, d = hisparse_decode(s, world, v4=False)
    rx, tx = w.transfer(s, world, p, d, 0x5404, [0, 1], [30, 2])
    assert done(s, rx, tx) == [s.KVPoll.Success] * 2
    for b in range(2):
        assert (host.page(b, 30) == src.page(b, 0)).all() and (host.page(b, 2) == src.page(b, 1)).all()
        assert not dst.bufs[b].any()


def test_device_kv_indices_on_a_pool_without_compression_fail_the_room_with_a_reason(world):
    s = world.s
    src = w.PlainPool([128] * 2, PAGES, PAGE, seed=9)
    dst = w.PlainPool([128] * 2, PAGES, PAGE)
    p = world.keep(w.prefill_manager(s, src, is_mla=True, layers=2))
    d = world.keep(w.decode_manager(s, dst, is_mla=True, layers=2))
    rx, tx = w.transfer(s, world, p, d, 0x5405, [0, 1], [3, 4], device_pages=[5, 6])
    assert rx.poll() == s.KVPoll.Failed
    with pytest.raises(Exception, match="dst_device_kv_indices"):
        rx.failure_exception()
    assert not dst.bufs[0].any()


def test_decode_host_destinations_are_refused_by_sglang_itself(world, monkeypatch):
    """With ``--disaggregation-decode-host-receive-threshold`` < 1 sglang
    fills ``host_kv_data_ptrs``, creates the manager, then refuses the
    setting itself because ``supports_host_destination`` is False."""
    s = world.s
    from sglang.srt.runtime_context import get_disagg

    dst = w.PlainPool([128] * 2, PAGES, PAGE)
    dst.size = PAGES * PAGE
    host = w.HostPool([128] * 2, 4 * PAGES)
    host.page_size, host.logical_size = PAGE, 4 * PAGES * PAGE
    group = types.SimpleNamespace(
        get_pool=lambda name: host,
        get_contiguous_buf_infos=lambda names: (dst.get_contiguous_buf_infos(), host.infos()),
    )
    made = []
    real_init = s.backend.KVManager.__init__

    def recording_init(self, *a, **k):
        made.append(self)
        real_init(self, *a, **k)

    monkeypatch.setattr(s.backend.KVManager, "__init__", recording_init)
    extra = dict(tree_cache=types.SimpleNamespace(host_pool_group=group, sidecar_pool_specs=[]),
                 req_to_token_pool=types.SimpleNamespace(max_context_len=PAGES * PAGE))
    with get_disagg().override(disaggregation_decode_host_receive_threshold=0.5):
        with pytest.raises(ValueError, match="Transfer backend does not support decode host KV destinations"):
            w.decode_manager(s, dst, is_mla=True, layers=2, **extra)
    assert len(made) == 1 and made[0].kv_args.host_kv_data_ptrs == host.infos()[0]
    assert made[0].supports_host_destination is False
    world.keep(made[0])
    assert s.backend.KVReceiver.supports_host_destination is False


def test_a_hisparse_v4_decode_with_decode_context_parallelism_is_refused_at_start(world):
    s = world.s
    from sglang.srt.runtime_context import get_parallel

    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(get_parallel().override(
                tp_size=2, attn_tp_size=2, moe_tp_size=2, attn_dcp_size=2, attn_dcp_rank=0))
        except ValueError as e:
            pytest.skip(f"sglang refuses this parallel layout here: {e}")
        with pytest.raises(s.backend.BackendConfigError, match="attn_dcp_size=2"):
            hisparse_decode(s, world)
