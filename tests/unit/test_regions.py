"""Region maths: worked examples and hypothesis properties (intersection, containment,
difference, exact coverage, BoxIndex against brute force)."""
from hypothesis import given, settings, strategies as st

from nereus.planner.transition.regions import BoxIndex, contains, covers_exactly, difference, intersect, region_intersection, volume
from nereus.planner.transition.types import Region


def test_worked_examples():
    assert intersect((256, 0), (256, 4096), (384, 0), (256, 4096)) == ((384, 0), (128, 4096))
    assert intersect((0,), (4,), (4,), (4,)) is None  # touching intervals do not overlap
    assert difference((0,), (8,), (2,), (3,)) == (((0,), (2,)), ((5,), (3,)))
    assert covers_exactly((0,), (8,), [((0,), (4,)), ((4,), (4,))])
    assert not covers_exactly((0,), (8,), [((0,), (4,)), ((4,), (4,)), ((3,), (2,))])
    assert not covers_exactly((0,), (8,), [((0,), (4,))])
    assert contains((256, 0), (256, 8), (384, 0), (128, 8)) and not contains((256, 0), (256, 8), (200, 0), (64, 8))
    a = Region("actor", "w", "param", (0, 0), (4, 4))
    assert region_intersection(a, Region("actor", "w", "param", (2, 2), (4, 4))).lengths == (2, 2)
    assert region_intersection(a, Region("actor", "w", "master", (0, 0), (4, 4), "fp32")) is None


dims = st.integers(1, 3)


@st.composite
def box_pair(draw):
    n = draw(dims)
    shape = tuple(draw(st.integers(1, 12)) for _ in range(n))

    def box():
        off = tuple(draw(st.integers(0, s - 1)) for s in shape)
        ln = tuple(draw(st.integers(1, s - o)) for s, o in zip(shape, off))
        return off, ln
    return shape, box(), box()


def cells(box):
    off, ln = box
    out = {()}
    for o, n in zip(off, ln):
        out = {c + (i,) for c in out for i in range(o, o + n)}
    return out


@settings(max_examples=150, deadline=None)
@given(box_pair())
def test_intersection_and_difference_match_cell_sets(data):
    _, a, b = data
    cut = intersect(*a, *b)
    assert (cells(cut) if cut else set()) == cells(a) & cells(b)
    parts = difference(*a, *b)
    got = [cells(p) for p in parts]
    assert set().union(*got) == cells(a) - cells(b)
    assert sum(len(c) for c in got) == len(cells(a) - cells(b))  # disjoint
    assert covers_exactly(*a, list(parts) + ([cut] if cut else []))


@st.composite
def grid_partition(draw):
    """A TP x ZeRO style partition of a 2-D tensor: column or row blocks, then row splits."""
    rows, cols = draw(st.integers(1, 16)), draw(st.integers(1, 16))
    k = draw(st.integers(1, 4))
    dim = draw(st.integers(0, 1))
    size = (rows, cols)[dim]
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, size - 1)), max_size=k)))) if size > 1 else []
    edges = [0] + [c for c in cuts if 0 < c < size] + [size]
    boxes = []
    for lo, hi in zip(edges, edges[1:]):
        off, ln = [0, 0], [rows, cols]
        off[dim], ln[dim] = lo, hi - lo
        z = draw(st.integers(1, 3))
        for j in range(z):
            r0, r1 = off[0] + j * ln[0] // z, off[0] + (j + 1) * ln[0] // z
            if r1 > r0:
                boxes.append(((r0, off[1]), (r1 - r0, ln[1])))
    q_off = (draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1)))
    q_len = (draw(st.integers(1, rows - q_off[0])), draw(st.integers(1, cols - q_off[1])))
    return (rows, cols), boxes, (q_off, q_len)


@settings(max_examples=150, deadline=None)
@given(grid_partition())
def test_box_index_finds_exactly_the_overlapping_boxes(data):
    shape, boxes, query = data
    assert covers_exactly((0, 0), shape, boxes)
    want = sorted(b for b in boxes if intersect(*b, *query) is not None)
    assert sorted(BoxIndex(boxes).overlapping(*query)) == want
    pieces = [intersect(*b, *query) for b in want]
    assert covers_exactly(*query, pieces) and sum(volume(p[1]) for p in pieces) == volume(query[1])
