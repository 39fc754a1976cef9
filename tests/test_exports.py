import inspect

import aioload


def test_all_is_sorted_and_complete():
    assert aioload.__all__ == sorted(aioload.__all__)
    assert len(set(aioload.__all__)) == len(aioload.__all__)
    for name in aioload.__all__:
        value = getattr(aioload, name)  # resolves (lazily exported names too)
        module = value.__name__ if inspect.ismodule(value) else value.__module__
        assert module.startswith("aioload."), f"aioload.{name} is {module}'s, not aioload's own"
        assert inspect.getdoc(value), f"aioload.{name} has no docstring"
    public = {n for n in dir(aioload) if not n.startswith("_")}
    modules = {"images", "integrations", "transforms"}  # subpackages, imported by name
    assert public - modules - {"annotations"} <= set(aioload.__all__) | modules


def test_import_leaves_torchvision_until_an_image_helper_is_used():
    import subprocess
    import sys

    code = (
        "import sys, aioload\n"
        "assert 'torchvision' not in sys.modules, 'import aioload imported torchvision'\n"
        "assert aioload.images.decode_image is aioload.decode_image\n"
        "from aioload import ImageFolder\n"
        "assert 'torchvision' in sys.modules and ImageFolder is aioload.images.ImageFolder\n"
        "try:\n"
        "    aioload.NoSuchThing\n"
        "except AttributeError as exc:\n"
        "    assert 'NoSuchThing' in str(exc)\n"
        "else:\n"
        "    raise SystemExit('a missing attribute did not raise')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
