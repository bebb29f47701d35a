"""cpp_build.py: a C++ operator library that cannot be built is a warning and None (its caller goes without the
operator), never an exception; one that builds is loaded, its exported functions callable."""

import logging

from flashdraft.kernels import cpp_build


def test_a_library_that_does_not_compile_is_one_warning_and_none(caplog):
    with caplog.at_level(logging.WARNING, logger="flashdraft.kernels.cpp_build"):
        assert cpp_build.load("this is not C++;", "a test library") is None
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "flashdraft: a test library did not build"
    ]


def test_a_library_that_compiles_is_loaded():
    source = '#include <ATen/core/Tensor.h>\nextern "C" int flashdraft_test_answer() { return 42; }\n'
    library = cpp_build.load(source, "a test library")
    assert library is not None and library.flashdraft_test_answer() == 42


def test_a_library_is_built_once_per_cpu_feature_set(monkeypatch):
    """inductor keys its cache on the source and a command line that reads `-march=native` on every x86 CPU: the
    source built carries the CPU's features, so two CPUs sharing a cache never load each other's library."""
    from torch._inductor.codecache import CppCodeCache

    built = []
    monkeypatch.setattr(CppCodeCache, "load", classmethod(lambda cls, source, **kw: built.append(source)))
    for features in ("x86_64 avx2 fma", "x86_64 amx_tile avx2 avx512f fma"):
        monkeypatch.setattr(cpp_build, "cpu_features", lambda features=features: features)
        cpp_build.load("int x;", "a test library")
    assert built == [
        "// built for: x86_64 avx2 fma\nint x;",
        "// built for: x86_64 amx_tile avx2 avx512f fma\nint x;",
    ]


def test_the_cpu_features_name_the_instruction_sets_not_the_rest():
    features = cpp_build.cpu_features().split()
    import platform

    assert features[0] == platform.machine()
    assert features[1:] == sorted(features[1:])
    assert not {"smep", "smap", "fpu", "ht", "vme"} & set(features)
    if platform.machine() == "x86_64":
        assert "sse2" in features  # every x86-64 CPU has it


def test_no_cpp_lives_in_a_python_module_and_every_source_ships():
    """The C++ (and inductor's Jinja templates of it) is in kernels/csrc/, package data; no .py holds a C++ source."""
    import re
    from pathlib import Path

    import flashdraft

    package = Path(flashdraft.__file__).parent
    csrc = sorted(p.name for p in (package / "kernels" / "csrc").iterdir())
    assert csrc == [
        "bf16_pairs_entry.cpp.jinja",
        "bf16_pairs_micro_kernel.cpp.jinja",
        "decoder_layer.cpp",
        "short_attention.cpp",
        "w8a16_linear.cpp",
    ]
    for name in csrc:
        assert cpp_build.source_file(name).strip()
    cpp = re.compile(r"#include <|TORCH_LIBRARY_IMPL\(|_mm512_\w+\(|\{\{kernel")
    holders = [str(p.relative_to(package)) for p in package.rglob("*.py") if cpp.search(p.read_text())]
    assert holders == [], holders


def test_a_failed_build_is_not_tried_again_in_the_next_process(tmp_path, monkeypatch, caplog):
    """A build that failed is remembered beside inductor's cache: the next process (here: the same call again, with
    the in-process caches of the operators' modules out of the way) goes without the library at once, with the same
    one warning, naming where it is remembered. Another source, another compiler or the note deleted builds again."""
    from torch._inductor.codecache import CppCodeCache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    tries = []

    def fail(cls, source, **kw):
        tries.append(source)
        raise RuntimeError("g++: error: no such compiler\nmore lines")

    monkeypatch.setattr(CppCodeCache, "load", classmethod(fail))
    with caplog.at_level(logging.WARNING, logger="flashdraft.kernels.cpp_build"):
        assert cpp_build.load("int x;", "a test library") is None
        assert cpp_build.load("int x;", "a test library") is None
    assert len(tries) == 1
    first, again = (r.getMessage() for r in caplog.records)
    assert first == "flashdraft: a test library did not build (g++: error: no such compiler)"
    assert again.startswith(first[:-1] + "; remembered in " + str(tmp_path))
    assert cpp_build.load("int y;", "a test library") is None and len(tries) == 2  # another source
    monkeypatch.setattr(cpp_build, "_compiler", lambda: "clang++ /usr/bin/clang++ 1")  # a compiler installed
    assert cpp_build.load("int x;", "a test library") is None and len(tries) == 3
    cpp_build.failure_note(f"// built for: {cpp_build.cpu_features()}\nint x;").unlink()
    assert cpp_build.load("int x;", "a test library") is None and len(tries) == 4
