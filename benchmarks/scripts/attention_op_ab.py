"""Does a C++ implementation of `flashdraft::short_attention` (attention_cpp.py, registered as its library loads)
make the compiled verify faster than the Python implementation it replaced (which called the same kernel through a
Python binding)? SmolLM2-135M's verify after 256 tokens through the engine (`static_decoder`), at 1, 4 and 8 tokens;
the two implementations take turns in one process (the Python one registered over the C++ one for a round, then
removed), rounds of 5 consecutive calls of each length, median ms. The Python implementation is built from the
module as it was at commit b480f3d (`git show`). benchmarks/README.md, 2026-12-02.
Run: python benchmarks/scripts/attention_op_ab.py [bfloat16] [int8]"""

import statistics
import subprocess
import sys
import time

import torch

from flashdraft.kernels import attention_cpp
from flashdraft.engine.compiled import compile_verify
from flashdraft.engine.measure import static_decoder
from flashdraft.drafter.model import DFlashDraftModel
from flashdraft.targets.target import load_target

torch.set_num_threads(2)
dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
quantize = sys.argv[2] if len(sys.argv) > 2 else None

# The Python implementation as it was: the kernel's source and argument types of b480f3d's module.
old = subprocess.run(
    ["git", "show", "b480f3d:src/flashdraft/kernels/attention_cpp.py"], capture_output=True, text=True, check=True
).stdout
scope: dict = {"torch": torch}
exec(old[old.index("DTYPES = ") : old.index("_kernels: dict")], scope)  # DTYPES, MASK_*, _SOURCE, _ARGTYPES
from torch._inductor.codecache import CppPythonBindingsCodeCache  # noqa: E402

cpp = scope["DTYPES"][torch.bfloat16]
binding = CppPythonBindingsCodeCache.load_pybinding(
    [a.replace("T*", f"{cpp}*") for a in scope["_ARGTYPES"]],
    scope["_SOURCE"].replace("@T@", cpp),
    device_type="cpu",
    needs_vec_isa=True,
)


def python_implementation(query, key, value, mask, scale):  # b480f3d's `_short_attention`
    b, heads, n, d = query.shape
    dv = value.shape[-1]
    out = query.new_empty(b, n, heads, dv)
    q, k, v = query.stride(), key.stride(), value.stride()
    if mask is None:
        width, kind, mask, m = key.shape[2], 0, query, (0, 0, 0)
    else:
        width, kind, size = mask.shape[-1], 1 if mask.dtype == torch.bool else 2, mask.shape
        m = [0 if size[i] == 1 else mask.stride(i) for i in range(3)]
    binding(query, key, value, mask, out, b, heads, key.shape[1], n, width, d, dv, q[0], q[1], q[2], k[0], k[1],
            k[2], v[0], v[1], v[2], kind, m[0], m[1], m[2], scale)  # fmt: skip
    return out


target = load_target("smollm2-135m-instruct", dtype=dtype, device="cpu", quantize=quantize, compiled=True)
compile_verify(target)
assert attention_cpp.ready(torch.bfloat16)
draft = DFlashDraftModel.from_pretrained("drafters/smollm2-135m-instruct").eval()
ids = torch.randint(100, 20000, (1, 300), generator=torch.Generator().manual_seed(0))
engine = static_decoder(target, draft, ids[:, :256], dtype=dtype)
lengths = (1, 4, 8)


def verify(n: int) -> torch.Tensor:
    out = engine.forward_block(ids[:, 256 : 256 + n], torch.arange(256, 256 + n)[None])
    target.crop(engine.cache, 256)
    return out


times = {(kind, n): [] for kind in ("C++", "Python") for n in lengths}
with torch.no_grad():
    for n in lengths:  # compiles
        verify(n)
    for round_ in range(12):
        for kind in ("C++", "Python") if round_ % 2 == 0 else ("Python", "C++"):
            override = None
            if kind == "Python":
                override = torch.library.Library("flashdraft", "IMPL")
                override.impl("short_attention", python_implementation, "CPU")
            for n in lengths:
                for _ in range(5):
                    start = time.perf_counter()
                    verify(n)
                    times[kind, n].append(time.perf_counter() - start)
            if override is not None:
                override._destroy()
ms = {key: 1e3 * statistics.median(t) for key, t in times.items()}
for kind in ("Python", "C++"):
    print(f"{dtype} {quantize or ''} {kind:6s}", " ".join(f"t({n}) {ms[kind, n]:.2f} ms" for n in lengths))
