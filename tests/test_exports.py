import aioload


def test_all_is_sorted_and_complete():
    assert aioload.__all__ == sorted(aioload.__all__)
    for name in aioload.__all__:
        assert getattr(aioload, name) is not None
    public = {n for n in dir(aioload) if not n.startswith("_")}
    modules = {"images", "transforms"}
    assert public - modules - {"annotations"} <= set(aioload.__all__) | modules
