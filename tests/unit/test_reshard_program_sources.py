"""The compiled exchanges hash every outgoing piece from its source region (``program.hash_sources``
over the views of the store's own tensors), never from a copy made for a message: the checksums a
message carries are those of the source views, strided ones included, whatever the packed buffer
holds (a fault in packing must not be checked against itself: ``corrupt-pack``). Each posting
group hashes, in one call, the pieces no earlier message carried, before it is posted."""
import pytest
from test_executor_source_hash import _zero1_case

import nereus.executor.reshard.checksum as checksum_mod
import nereus.executor.reshard.program as program_mod
from nereus.executor.apply import _NewLayout, _prepare
from nereus.executor.reshard.pieces import STAGING_BYTES, round_groups
from nereus.executor.reshard.program import hash_sources, program
from nereus.executor.store import checksum
from nereus.executor.transport import BUCKET_BYTES, SEND_GROUP_BYTES


@pytest.mark.parametrize("group_bytes", [SEND_GROUP_BYTES, 1])
def test_every_outgoing_piece_is_hashed_from_a_view_of_its_source_region(monkeypatch, group_bytes):
    monkeypatch.setattr(program_mod, "SEND_GROUP_BYTES", group_bytes)  # 1: a posting group per message
    tplan, stores = _zero1_case()
    major = {(m, t): d for m, t, d in tplan.major}
    strided = groups = messages = 0
    for rank, store in enumerate(stores):
        new = _NewLayout(store, tplan, rank, major)
        _, staged = _prepare(tplan, store, new, rank, BUCKET_BYTES, major, views=False)
        src_t, dst_t, geo = new.bases
        prog = program(new.recipe, geo, round_groups(staged, STAGING_BYTES), BUCKET_BYTES, store, new, src_t, dst_t)
        views = prog.views(store, src_t, dst_t)
        sums = [None] * prog.sums
        held = {t.untyped_storage().data_ptr() for t in store.tensors()}
        for x in prog.exchanges:
            assert len(x.send_sums) == len(x.sends)
            lo = 0
            for end, first, stop, fresh in x.send_groups:
                assert len(fresh) == stop - first and all(sums[h] is None for h in range(first, stop))  # once each
                assert all(views[i].untyped_storage().data_ptr() in held for i in fresh)  # the source region itself
                hash_sources(sums, views, first, stop, fresh, checksum_mod.checksums_of)
                for j in range(lo, end):  # every piece the group carries is hashed before the group is posted
                    peer, m = x.sends[j]
                    assert [i for _, i in x.send_sums[j]] == ([m] if type(m) is int else m)  # in order
                    parts = [views[i] for _, i in x.send_sums[j]]
                    assert [sums[h] for h, _ in x.send_sums[j]] == [checksum(p.contiguous()) for p in parts]
                    strided += sum(not p.is_contiguous() for p in parts)
                lo = end
                groups += 1
            assert lo == len(x.sends)
            messages += len(x.sends)
            for peer, ids in x.peer_sums:  # each peer's checksum message: its pieces, in message order
                assert ids == [h for (p, _), carried in zip(x.sends, x.send_sums) if p == peer for h, _ in carried]
            first, stop, fresh = x.copy_sums
            assert all(sums[h] is None for h in range(first, stop))
            hash_sources(sums, views, first, stop, fresh, checksum_mod.checksums_of)
            for src, _, h, _, _ in x.copies:
                assert views[src].untyped_storage().data_ptr() in held
                assert sums[h] == checksum(views[src].contiguous())
            assert x.recv_at[-1] == sum(len(r) for r in x.recv_regions.values()) == (x.recv_peers or [(0, 0, 0)])[-1][2]
        assert None not in sums  # every source piece of the transition hashed
        used = {v for x in prog.exchanges for _, m in x.sends + x.recvs for v in ([m] if type(m) is int else m)}
        used |= {v for x in prog.exchanges for src, dst, *_ in x.copies for v in (src, dst)}
        assert used == set(range(len(views)))  # a view per piece that moves, none for pieces joined away
    assert strided  # the case holds strided sources (ZeRO shares of row-parallel moments)
    assert groups == messages if group_bytes == 1 else groups < messages
