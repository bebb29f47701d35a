"""cpp_build.py: a C++ operator library that cannot be built is a warning and None (its caller goes without the
operator), never an exception; one that builds is loaded, its exported functions callable."""

import logging

from flashdraft.kernels import cpp_build as cpp_library


def test_a_library_that_does_not_compile_is_one_warning_and_none(caplog):
    with caplog.at_level(logging.WARNING, logger="flashdraft.kernels.cpp_build"):
        assert cpp_library.load("this is not C++;", "a test library") is None
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "flashdraft: a test library did not build"
    ]


def test_a_library_that_compiles_is_loaded():
    source = '#include <ATen/core/Tensor.h>\nextern "C" int flashdraft_test_answer() { return 42; }\n'
    library = cpp_library.load(source, "a test library")
    assert library is not None and library.flashdraft_test_answer() == 42
