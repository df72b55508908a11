"""Compile every Triton kernel of :mod:`vlm_prune.kernels` for a GPU architecture on a machine
that has no GPU, and report what each launch costs the chip: registers, stack (spills), shared
memory, tensor-core instructions and the number of thread blocks.

    python -m vlm_prune.eval.kernel_report                  # sm_90 (H100 / H200), real sizes, bfloat16
    python -m vlm_prune.eval.kernel_report --arch 80 --dtype float32 --shapes cpu

The wrappers run on CPU tensors at the bench_kernels shapes; their launches are caught instead
of run, so the block sizes, specialisations and constexprs are exactly those a GPU run would
compile. Triton then builds each launch down to a cubin for the target (its bundled ptxas), and
its bundled cuobjdump reads the resource usage and the SASS. Needs Triton (tested with 3.8: the
launch capture uses its compiler's internals, which change between releases), and must run
without ``TRITON_INTERPRET=1`` (that mode replaces the kernels with interpreted Python).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from vlm_prune.eval.bench_kernels import SHAPES, text_table

TENSOR_CORE_OPS = re.compile(r"\b(HMMA|HGMMA|IMMA|QGMMA|DMMA)\b")
# most shared memory one thread block may use (opt-in), bytes, by compute capability x10
MAX_SHARED = {70: 98304, 75: 65536, 80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448,
              120: 101376}


@dataclass
class Launch:
    wrapper: str
    kernel: str
    grid: tuple[int, ...]
    constexprs: dict[str, object]
    num_warps: int
    num_stages: int
    registers: int
    stack_bytes: int
    shared_bytes: int
    tensor_core_ops: int
    fits: bool | None  # shared memory within the architecture's limit (None: limit unknown)

    @property
    def blocks(self) -> int:
        total = 1
        for g in self.grid:
            total *= g
        return total


@contextmanager
def _caught_launches() -> Iterator[list[tuple]]:
    """Replace ``JITFunction.run`` so ``kernel[grid](...)`` records (kernel, args, kwargs, grid)."""
    from triton.runtime.jit import JITFunction

    launches: list[tuple] = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs, tuple(grid)))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original


def wrapper_calls(shape: dict, dtype: torch.dtype) -> list[tuple[str, Callable[[], object]]]:
    """One call of every Triton wrapper (and variant the methods use) at ``shape``, on CPU."""
    from vlm_prune.kernels import attention_rows_triton as ar
    from vlm_prune.kernels import density_peaks_triton as dp
    from vlm_prune.kernels import euti_triton as eu
    from vlm_prune.kernels import merge_triton as mg

    b, h, hkv, nq, s, d = (shape[k] for k in ("b", "h", "hkv", "q", "s", "d"))
    n, feat, c = shape["n"], shape["feat"], shape["c"]

    def rnd(*size: int) -> torch.Tensor:
        return torch.randn(*size).to(dtype)

    q, k = rnd(b, h, nq, d), rnd(b, hkv, s, d)
    q_pos = torch.arange(s - nq, s).expand(b, nq)
    k_pos = torch.arange(s).expand(b, s)
    key_mask = torch.ones(b, s, dtype=torch.bool)
    x, hidden = rnd(n, feat), rnd(b, s, 4 * d)
    index = torch.arange(0, s, 2).expand(b, -1)
    scale = d**-0.5
    return [
        ("attention_to_keys", lambda: ar.attention_to_keys_triton(q, k, key_mask[:, None, :], scale)),
        ("attention_key_scores causal (FastV)",
         lambda: ar.attention_key_scores_triton(q, k, scale=scale, q_pos=q_pos, k_pos=k_pos)),
        ("attention_key_scores weighted (AdaptInfer)",
         lambda: ar.attention_key_scores_triton(q, k, scale=scale, key_mask=key_mask, row_weights=torch.rand(b, nq))),
        ("euti_scores", lambda: eu.euti_scores_triton(rnd(b, h, s, d), k, torch.rand(b, s), key_mask, scale)),
        ("cosine_distance", lambda: dp.cosine_distance_triton(x, x)),
        ("density", lambda: dp.density_triton(x)),
        ("nearest_denser", lambda: dp.nearest_denser_triton(x, torch.rand(n))),
        ("gather_rows", lambda: mg.gather_rows_triton(hidden, index, torch.ones_like(index, dtype=torch.bool))),
        ("scatter_mean", lambda: mg.scatter_mean_triton(x, torch.randint(-1, c, (n,)), c, torch.rand(n))),
    ]


def _bin_tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _resources(cubin: bytes) -> tuple[int, int, int, int]:
    """(registers, stack bytes, static shared bytes, tensor-core instructions) of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_bin_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_bin_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", usage))
    return int(fields["REG"]), int(fields["STACK"]), int(fields["SHARED"]), len(TENSOR_CORE_OPS.findall(sass))


def compile_launch(fn, args: tuple, kwargs: dict, arch: int):
    """Compile one caught launch for ``sm_<arch>`` exactly as ``JITFunction.run`` would."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = {**kwargs, "debug": False, "instrumentation_mode": knobs.compilation.instrumentation_mode}
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def report(arch: int, shape: dict, dtype: torch.dtype) -> list[Launch]:
    """Compile every launch of every wrapper call for ``sm_<arch>``; one :class:`Launch` each."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("kernel_report compiles GPU code: run it without TRITON_INTERPRET=1")
    rows = []
    for wrapper, call in tqdm(wrapper_calls(shape, dtype), desc=f"compiling for sm_{arch}", leave=False):
        with _caught_launches() as launches:
            call()
        for fn, args, kwargs, grid in launches:
            kernel = compile_launch(fn, args, kwargs, arch)
            consts = {p.name: kwargs[p.name] for p in fn.params if p.is_constexpr and p.name in kwargs}
            regs, stack, shared, mma = _resources(kernel.asm["cubin"])
            shared += kernel.metadata.shared
            fits = shared <= MAX_SHARED[arch] if arch in MAX_SHARED else None
            rows.append(Launch(wrapper, fn.__name__, grid, consts, kernel.metadata.num_warps,
                               kernel.metadata.num_stages, regs, stack, shared, mma, fits))
    return rows


def table(rows: list[Launch]) -> str:
    head = ["wrapper", "kernel", "blocks", "block sizes", "warps", "stages", "regs", "stack B", "smem KB", "fits",
            "tensor-core ops"]
    body = [[r.wrapper, r.kernel, str(r.blocks),
             " ".join(f"{k.removeprefix('BLOCK_')}{v}" for k, v in r.constexprs.items() if k.startswith("BLOCK_")),
             str(r.num_warps), str(r.num_stages), str(r.registers), str(r.stack_bytes), f"{r.shared_bytes / 1024:.0f}",
             {True: "yes", False: "NO", None: "?"}[r.fits], str(r.tensor_core_ops)] for r in rows]
    return text_table(head, body)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x10: 90 (H100/H200), 80 (A100), 89 (L4)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--shapes", default="cuda", choices=sorted(SHAPES), help="bench_kernels shape set (default: real sizes)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    rows = report(args.arch, SHAPES[args.shapes], getattr(torch, args.dtype))
    print(f"Triton kernels compiled for sm_{args.arch}, {args.dtype}, {args.shapes} shapes "
          "(stack > 0: spilled registers; fits: shared memory within the chip's per-block limit; "
          "tensor-core ops: MMA instructions in the SASS)")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**asdict(r), "blocks": r.blocks} for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
