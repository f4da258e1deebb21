"""Every probe with extra buffer types segfaults (as AMX weights did); without them llama.cpp is fine."""

from tests.native_faults import run, segfault


def fault(request: dict) -> None:
    if request["call"] == "probe" and request["settings"]["extra_buffer_types"]:
        segfault()


if __name__ == "__main__":
    run(before=fault)
