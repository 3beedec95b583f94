"""A program that imports every module of the runtime package, as an image's user would: what
tests/test_image.py (a recreation, with CuPy installed) and tests/test_images.py (the CPU image) run."""

IMPORT_ALL = """
import importlib, pkgutil
import sparrowrl
names = [m.name for m in pkgutil.walk_packages(sparrowrl.__path__, "sparrowrl.")]
for name in names:
    if name.endswith("__main__"):  # a program
        continue
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name not in ("vllm", "cupy"):  # the GPU variant's engine and codec, not in the CPU image
            raise
print(len(names))
"""
