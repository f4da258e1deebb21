"""The best CPU variant with extra buffer types hangs; any other setting with them segfaults."""

from tests.native_faults import best_variant, hang, run, segfault


def fault(request: dict) -> None:
    settings = request.get("settings") or {}
    if request["call"] == "probe" and settings["extra_buffer_types"]:
        hang() if settings["cpu_variant"] == best_variant() else segfault()


if __name__ == "__main__":
    run(before=fault)
