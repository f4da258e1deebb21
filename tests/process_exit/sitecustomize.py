"""Imported at start-up by every Python process the tests start: tests/conftest.py puts this folder on
PYTHONPATH. In a multiprocessing child (vLLM's engine core and workers), it freezes the objects still
alive at exit, so that Python's last garbage collection does not walk them.

vLLM's engine processes un-freeze their start-up objects when they shut down (``EngineCore.shutdown``
calls ``gc.unfreeze()``), and the collection at exit then took about 2 s in the worker and again in the
engine core on a 2-CPU EPYC. Closing an engine took 5.4 s, most of it waiting for that; vLLM's process
manager kills the engine core after 5 s. With this, closing took 1.9 s. vLLM freezes the same way itself
after a clean shutdown on ROCm. Exit codes and other atexit handlers are unchanged (this one is
registered first, so it runs last). Triton's nanobind module then reports its objects as leaked, on the
engine's stderr; the user's own process is left as it is, so its last line stays vLLM's or vllm-usd's.
"""

import atexit
import gc


def _freeze_in_a_child() -> None:
    import multiprocessing

    if multiprocessing.parent_process() is not None:
        gc.freeze()


atexit.register(_freeze_in_a_child)
