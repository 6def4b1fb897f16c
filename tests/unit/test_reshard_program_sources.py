"""The compiled exchanges hash every outgoing piece from its source region (``program.source_sums``
over the views of the store's own tensors), never from a copy made for a message: the checksums a
message carries are those of the source views, strided ones included, whatever the packed buffer
holds (a fault in packing must not be checked against itself: ``corrupt-pack``)."""
import nereus.executor.reshard.checksum as checksum_mod
from nereus.executor.apply import _NewLayout, _prepare
from nereus.executor.reshard.pieces import STAGING_BYTES, round_groups
from nereus.executor.reshard.program import program, source_sums
from nereus.executor.store import checksum
from nereus.executor.transport import BUCKET_BYTES
from test_executor_source_hash import _zero1_case


def test_every_outgoing_piece_is_hashed_from_a_view_of_its_source_region():
    tplan, stores = _zero1_case()
    major = {(m, t): d for m, t, d in tplan.major}
    strided = 0
    for rank, store in enumerate(stores):
        new = _NewLayout(store, tplan, rank, major)
        _, staged = _prepare(tplan, store, new, rank, BUCKET_BYTES, major, views=False)
        src_t, dst_t, geo = new.bases
        prog = program(new.recipe, geo, round_groups(staged, STAGING_BYTES), BUCKET_BYTES, store, new, src_t, dst_t)
        views = prog.views(store, src_t, dst_t)
        sums = source_sums(prog, views, checksum_mod.checksums_of)
        held = {t.untyped_storage().data_ptr() for t in store.tensors()}
        for x in prog.exchanges:
            assert len(x.send_sums) == len(x.sends)
            for (peer, m), ids in zip(x.sends, x.send_sums):
                assert [i for _, i in ids] == ([m] if type(m) is int else m)  # the message's pieces, in order
                parts = [views[i] for _, i in ids]
                assert all(p.untyped_storage().data_ptr() in held for p in parts)  # the source region itself
                assert sums(ids) == [checksum(p.contiguous()) for p in parts]
                strided += sum(not p.is_contiguous() for p in parts)
            for src, _, h, _, _ in x.copies:
                assert views[src].untyped_storage().data_ptr() in held
                assert sums([(h, src)]) == [checksum(views[src].contiguous())]
    assert strided  # the case holds strided sources (ZeRO shares of row-parallel moments)
