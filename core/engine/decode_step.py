"""One batched decode step over static buffers, run eagerly or replayed as a CUDA graph
(core/engine/decode.py `generate`; data_gen.compile switches the graph on).

Why a CUDA graph: a decode step of a small target is hundreds of small kernels launched one by one
from Python through HF's 30-layer forward, so on a GPU it costs the launches, not the math.
A captured graph launches the very same kernels in
one call, so its logits are bitwise the eager step's, which torch.compile's fusions would not promise.
`fuse` passes the step through torch.compile first. "fused" (data_gen.compile=fused): those few hundred
kernels (RoPE, norms, casts, cache copies: most of a graph-replayed step of a small target) become a few
dozen, but fused arithmetic rounds differently, so bf16 tokens may part from the eager loop's: opt-in.
"exact" (data_gen.compile=exact) fuses only what it can round as eager does: inductor rounds every bf16
intermediate as the eager op would (its emulate_precision_casts), so the elementwise chains (RoPE,
residual adds, SiLU(gate) * up, casts, cache writes) fuse with the same bits, and the kernels whose
arithmetic inductor would do differently stay ATen's, called from the compiled step: the RMSNorms
(a reduction in another order), SiLU (x * sigmoid(x) is not ATen's x / (1 + exp(-x))) and the rotary
table (cos/sin). It is faster than the plain graphs with every row equal; the price is compiling each
layer's pieces once per data_gen run (docs/PERFORMANCE.md).
What makes one capture replayable: every input sits at a fixed address and everything that changes
between steps changes on the device. The token is copied into `token`; the positions and the static
cache's write slot (transformers' StaticLayer.cumulative_length, which its update advances in place)
move by one inside the step; the padding mask spans the whole cache from the start.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from transformers import StaticCache

from core.run.errors import UserError

FUSE_BACKEND = "inductor"  # the CPU test traces with "aot_eager": the same capture, no kernel generation
FUSE_MODES = ("", "fused", "exact")  # "": no torch.compile
EAGER_ROUNDING = ("RMSNorm", "RotaryEmbedding", "SiLUActivation", "SiLU")  # class-name suffixes "exact" leaves to ATen


class DecodeStep:
    """Feeds one token per row [B] at the cache's next slot -> next-token logits [B,V]."""

    def __init__(self, model, cache: StaticCache, mask: torch.Tensor, positions: torch.Tensor, graphs: bool,
                 fuse: str = ""):
        """mask [B, cache length]: the prompt's padding, then ones (causality hides the slots not yet
        written, so the mask never changes); positions [B,1]: the next token's, one more each step;
        fuse: one of FUSE_MODES."""
        if graphs and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the target is on {model.device}")
        if fuse not in FUSE_MODES:
            raise ValueError(f"fuse = {fuse!r}: one of {FUSE_MODES}")
        self.model, self.cache, self.mask, self.positions, self.graphs = model, cache, mask, positions, graphs
        self.token = torch.zeros_like(positions)  # [B,1]
        self.graph, self.logits, self.fuse = None, None, fuse
        self.eager_modules = eager_rounding_modules(model) if fuse == "exact" else []

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        self.token.copy_(token[:, None])
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        return self._capture() if self.graphs else self.run()

    def run(self) -> torch.Tensor:
        """One step, eagerly or fused. Not a bound method kept on self: that cycle would keep this step, and the
        static cache it holds (24 GB at batch 512 x 2,048 slots), alive past `generate` until Python's cyclic
        collector happened to run: a few batches' caches could pile up in GPU memory."""
        if not self.fuse:
            return self._forward()
        with eager_rounding(self.eager_modules):
            return _fused_forward(FUSE_BACKEND, self.fuse)(self)

    def _forward(self) -> torch.Tensor:
        out = self.model(input_ids=self.token, attention_mask=self.mask, position_ids=self.positions,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.positions.add_(1)
        return out.logits[:, -1]

    def _capture(self) -> torch.Tensor:
        """Run this step eagerly on a side stream (cuBLAS and the allocator warm up outside the capture),
        then record the next one: a capture executes nothing, so the cache and positions stay as the
        eager step left them, and every later call replays the recording."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self.run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.logits = self.run()
        except RuntimeError as e:
            raise UserError(f"CUDA graph capture of the decode step failed ({e}); this target's forward is not "
                            "capturable: decode without graphs (data_gen.compile=no)") from e
        self.graph = graph
        return logits


def eager_rounding_modules(model) -> list[torch.nn.Module]:
    """The target's EAGER_ROUNDING modules, which "exact" runs outside torch.compile. Each is a graph break
    (free inside a CUDA graph), and the decoder layer's pieces between them compile once per layer (its
    layer_idx is a constant to dynamo), so dynamo's recompile limits are raised here to fit every layer,
    twice (the second call of generate makes shapes dynamic)."""
    other_norms = sorted({type(m).__name__ for m in model.modules()
                          if "Norm" in type(m).__name__ and not type(m).__name__.endswith("RMSNorm")})
    if other_norms:  # inductor would fuse them, rounding otherwise: tokens that part silently from eager's
        raise UserError(f"data_gen.compile=exact keeps only RMSNorm layers in eager rounding; this target also has "
                        f"{', '.join(other_norms)}: use data_gen.compile=auto (CUDA graphs, the same tokens)")
    mods = [m for m in model.modules() if type(m).__name__.endswith(EAGER_ROUNDING)]
    need = 4 * getattr(model.config, "num_hidden_layers", 64) + 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, need)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 4 * need)
    return mods


@contextlib.contextmanager
def eager_rounding(mods: list[torch.nn.Module]):
    """While inside, `mods` (eager_rounding_modules) run outside torch.compile. Scoped: the model's other uses
    (and `fused`) see plain modules."""
    saved = [m.__dict__.get("forward") for m in mods]
    for m in mods:  # the same wrapper every time: dynamo guards on what `forward` is
        if "_eager_forward" not in m.__dict__:
            m._eager_forward = torch.compiler.disable(m.forward)
        m.forward = m._eager_forward
    try:
        yield
    finally:
        for m, f in zip(mods, saved, strict=True):
            if f is None:
                del m.forward
            else:
                m.forward = f


@functools.cache
def _fused_forward(backend, mode: str):
    """DecodeStep._forward through torch.compile, once per process and mode: shapes that change from call
    to call (batch, cache length) become dynamic after the second, instead of a compile per shape."""
    options = {"emulate_precision_casts": mode == "exact"} if backend == "inductor" else None
    return torch.compile(DecodeStep._forward, backend=backend, options=options)
