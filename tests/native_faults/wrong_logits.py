"""Kernels that run but compute the wrong thing: every probe's logits come back as noise."""

import numpy as np

from tests.native_faults import run


def noise(request: dict) -> None:
    if request["call"] == "probe":
        logits = np.load(request["out"])
        np.save(request["out"], np.random.default_rng(0).normal(size=logits.shape).astype(logits.dtype) * 10)


if __name__ == "__main__":
    run(after=noise)
