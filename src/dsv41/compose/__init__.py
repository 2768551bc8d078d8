"""The composition root: what a serving stack is built of, above both halves it joins. `build.py` turns serve's
engine options into a runner (runtime/: the pool, the forward, the keyed sampler) and an engine (engine/: policy,
torch-free) over it; `serial.py` is the reference engine (one request at a time over model/). engine/ and runtime/
import neither each other's internals nor this package (tests/test_package_layout.py)."""
