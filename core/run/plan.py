"""What each stage would do for a config, from the target's config.json alone (no weights, no network):

    python -m data_gen --config configs/kimi-k2.5.yaml --dry-run           # one stage (any stage takes it)
    python -m core.run.plan --config configs/kimi-k2.5.yaml --world-size 8    # all four (= make plan)

Every figure is arithmetic on the config: conversations and token caps, bytes on disk, drafter
parameters, a per-GPU memory estimate, optimizer steps. Times use the throughputs measured in
docs/PERFORMANCE.md (core/run/measured.py) for the target's shape, and say "not measured" where none was. Token
counts are caps (answers stop early), so bytes and hours are upper bounds. Nothing is written to the
run dir; an embedded alias (smollm2, tiny) has its model cache built on first use, as every stage does.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

from core.drafters.drafter_config import DrafterConfig, DraftVariant, MLAShape
from core.run.config import RunConfig, TrainConfig, TrainKernels
from core.run.errors import UserError
from core.run.measured import DP_EFFICIENCY, STAGE_SPEED, THINKING, TRAIN_SPEED, TrainSpeed
from core.target.aux_layers import resolve_aux_layers, sglang_layer_ids
from core.target.model import read_target_config, resolve_target
from core.target.size import DTYPE_BYTES, human_bytes, target_params
from core.target.vllm_extract import AUX_OVER_PP, hidden_cache_bytes, server_command, vllm_layer_ids

GIB = 1024 ** 3
_STORE_BYTES = {"bf16": 2, "fp32": 4, "fp8_e4m3": 1}


def conversations(cfg: RunConfig) -> int:
    return cfg.data_gen.num_samples * cfg.data_gen.n


def tokens_cap(cfg: RunConfig) -> int:
    """Most tokens one sample can hold: its prompt cap plus one answer (single turn), or the context
    cap plus the last answer (multi-turn), cut at train.max_len only by train itself."""
    d = cfg.data_gen
    return (d.max_prompt_tokens if d.max_turns == 1 else d.max_context_tokens) + d.max_new_tokens


def shard_bytes_per_token(hidden: int, dtype: str) -> int:
    """Bytes of one token in a hidden shard: input_ids int32 + loss_mask uint8 + aux [3H] + final [H],
    plus one fp32 scale per layer group (3 aux + 1 final) when stored as fp8 (core/storage/hidden_shards.py)."""
    scales = 4 * 4 if dtype == "fp8_e4m3" else 0
    return 4 + 1 + 4 * hidden * _STORE_BYTES[dtype] + scales


def drafter_params(dc: DrafterConfig) -> dict[str, int]:
    """Parameter counts of core.drafters.drafter.Eagle3Drafter's parts (tests/test_target_configs.py checks the
    sum against the module itself); arithmetic, so a 1B-parameter drafter costs nothing to plan."""
    h, q, kv = dc.hidden_size, dc.num_attention_heads * dc.head_dim, dc.num_key_value_heads * dc.head_dim
    attention, attention_norms = 2 * h * (q + 2 * kv) + q * h, 0
    if dc.mla:
        m, nh = dc.mla, dc.num_attention_heads
        attention = (2 * h * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim) + m.q_lora_rank * nh * dc.qk_head_dim
                     + m.kv_lora_rank * nh * (m.qk_nope_head_dim + m.v_head_dim) + nh * m.v_head_dim * h)
        attention_norms = m.q_lora_rank + m.kv_lora_rank
    return {"embed_tokens": dc.vocab_size * h, "fc": 3 * dc.target_hidden_size * h,
            "self_attn": attention, "mlp": 3 * h * dc.intermediate_size,
            "norms": 4 * h + 3 * dc.target_hidden_size * (dc.norm_before_fc + dc.fc_norm) + attention_norms,
            "lm_head": dc.draft_vocab_size * h}


def kv_bytes_per_token(tc: dict) -> tuple[int, str]:
    """The target's KV cache per token in bf16 and how it is made: MLA (DeepSeek-V3, Kimi) caches one latent of
    kv_lora_rank + qk_rope_head_dim per layer, GQA 2 x kv heads x head dim per layer."""
    layers = tc["num_hidden_layers"]
    if tc.get("kv_lora_rank"):
        return (mla_kv_bytes(tc["kv_lora_rank"], tc["qk_rope_head_dim"], layers),
                f"MLA: ({tc['kv_lora_rank']} + {tc['qk_rope_head_dim']}) x {layers} layers")
    heads = tc.get("num_key_value_heads") or tc["num_attention_heads"]
    head_dim = tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"]
    return gqa_kv_bytes(heads, head_dim, layers), f"GQA: 2 x {heads} x {head_dim} x {layers} layers"


def gqa_kv_bytes(heads: int, head_dim: int, layers: int) -> int:
    """bf16 K and V of `heads` x `head_dim` per layer, per token."""
    return 2 * 2 * heads * head_dim * layers


def mla_kv_bytes(kv_lora_rank: int, rope_dim: int, layers: int) -> int:
    """bf16 MLA cache per token: one latent plus the RoPE key all heads share, per layer."""
    return 2 * (kv_lora_rank + rope_dim) * layers


def train_memory(dc: DrafterConfig, trainable: int, batch: int, max_len: int, steps: int, bf16: bool,
                 kernels: TrainKernels | None = None) -> dict:
    """Bytes per GPU, an estimate of the step train/loop.py runs (flex attention: no [T,T] matrix; fused
    head loss in chunks). Static: fp32 weights + grads + AdamW's two moments of the trainable parameters,
    their bf16 autocast copies, the frozen embedding (bf16 under bf16) and the teacher's draft-vocab head.
    Per micro-batch of n = B x T tokens: the fp32 inputs (aux, final) and teacher probabilities [n,Vd],
    what autograd keeps per TTT step and token (20H + 3I values in the activation dtype) and one loss chunk's
    temporaries; with activation checkpointing only each step's inputs (~9H values). The per-token
    coefficients are fitted to the 8B shape measured on an H200 (docs/PERFORMANCE.md, bench_train_step:
    1.71 MiB/token, 0.65 with checkpointing, K=7); the AdamW moments are not in that benchmark. Fitted to
    per-step graphs; the K-step unroll (train.kernels.compile) measured 2.7 GiB less at 2048-8192 tokens with the
    same ~1.7-1.8 MiB/token, so for it this is an upper bound."""
    kernels = kernels or TrainKernels()
    checkpointing, loss_chunk, bf16_weights = kernels.activation_checkpointing, kernels.loss_chunk, kernels.bf16_weights
    act = 2 if bf16 else 4
    h, n, vd = dc.hidden_size, batch * max_len, dc.draft_vocab_size
    per_token_step = act * (9 * h if checkpointing else 20 * h + 3 * dc.intermediate_size)
    loss_temporaries = 0 if checkpointing else min(n * steps, loss_chunk) * vd * 10
    # fp32 weights + grads + 2 moments (+ autocast's bf16 copies); bf16_weights: 2 + 2 + fp32 masters + 2 moments
    return {"weights, grads, AdamW": 16 * trainable + (2 * trainable if bf16 and not bf16_weights else 0),
            "frozen embedding + teacher head": act * dc.vocab_size * h + act * vd * h,
            "batch inputs + teacher": n * 4 * (4 * dc.target_hidden_size + vd),
            "activations": steps * n * per_token_step + loss_temporaries}


# The user's hand-patched SGLang dump of Kimi-K2.5 (aux + final in bf16, 4 x 7168 x 2 = 57,344 B a token, no
# compaction): "924 GB" for 10,000 samples of 17.3M tokens (1,730 a sample), i.e. 924 GiB.
HAND_PATCHED_GIB, HAND_PATCHED_SAMPLES, HAND_PATCHED_TOKENS = 924, 10_000, 17_300_000


def disk_lines(hidden: int, cap: int) -> list[str]:
    """Hidden-shard bytes for 10k and 100k samples at each storage dtype: at the hand-patched run's mean sample
    length and at the token cap (spans=loss stores fewer final rows: less), beside that run's 924 GB."""
    mean = HAND_PATCHED_TOKENS // HAND_PATCHED_SAMPLES
    lines = [f"disk for the shards in GiB, at {mean:,} tokens a sample (the hand-patched Kimi-K2.5 run's mean) / at "
             f"the cap of {cap:,} (spans=loss: less); that run's dump took {HAND_PATCHED_GIB} GiB for "
             f"{HAND_PATCHED_SAMPLES:,} samples:"]
    for n in (10_000, 100_000):
        cells = [f"{dt} {n * mean * shard_bytes_per_token(hidden, dt) / GIB:,.0f} / "
                 f"{n * cap * shard_bytes_per_token(hidden, dt) / GIB:,.0f}" for dt in ("fp8_e4m3", "bf16", "fp32")]
        lines.append(f"  {n:,} samples: " + ", ".join(cells))
    return lines


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:,.1f} h" if seconds >= 3600 else f"{seconds / 60:,.1f} min"


def _hours(tokens: int, key: tuple) -> str:
    if key in STAGE_SPEED:
        return "; ".join(f"~{_duration(tokens / rate)} at {rate:,} tok/s ({where})" for rate, where in STAGE_SPEED[key])
    shapes = sorted({f"H {k[1]} x {k[2]} layers" for k in STAGE_SPEED if k[0] == key[0]})
    return f"not measured for H {key[1]} x {key[2]} layers (measured: {', '.join(shapes)})"


@dataclass(frozen=True)
class _Shape:
    """What every stage's plan reads: the target's config, its shape, the aux layers and the drafter built on them,
    and the token budget (conversations x the longest sample data_gen can write)."""
    tc: dict
    aux: list[int]
    dc: DrafterConfig
    conversations: int
    cap: int

    @property
    def tokens(self) -> int:
        return self.conversations * self.cap


def _target_lines(cfg: RunConfig, sh: _Shape) -> list[str]:
    tc, export, weights = sh.tc, sh.dc.to_sglang(), target_params(sh.tc)
    return [
        f"{cfg.target.model}: {tc['model_type']}, {tc['num_hidden_layers']} layers, hidden {tc['hidden_size']}, vocab "
        f"{tc['vocab_size']}, {tc['num_attention_heads']}/{tc.get('num_key_value_heads') or tc['num_attention_heads']} heads",
        f"weights: {weights / 1e9:,.2f}B parameters -> {human_bytes(weights * DTYPE_BYTES[cfg.target.dtype])} in "
        f"{cfg.target.dtype}: what one process holds to run it in-process (hf engines, train.source=online)",
        f"aux layers {sh.aux} (input of layer i = hidden_states[i]); export: SGLang eagle_config ids "
        f"{export['eagle_config']['eagle_aux_hidden_state_layer_ids']}, llama.cpp top-level ids "
        f"{export['eagle_aux_hidden_state_layer_ids']}"]


def _data_gen_lines(cfg: RunConfig, sh: _Shape) -> list[str]:
    d = cfg.data_gen
    source = f"server {d.base_url or '(data_gen.base_url unset)'}" if d.backend == "openai" else "in-process target"
    return [f"{sh.conversations:,} conversations ({d.num_samples:,} prompts x {d.n}) from {d.prompts}, {source}, "
            f"{'all user turns' if d.max_turns == 0 else f'{d.max_turns} user turn(s)'} each",
            f"tokens: <= {sh.cap:,} per sample -> <= {sh.tokens:,} in all ({d.max_new_tokens:,} new tokens per answer "
            "at most)"]


def _extract_lines(cfg: RunConfig, sh: _Shape) -> list[str]:
    x, h, layers = cfg.extract, sh.tc["hidden_size"], sh.tc["num_hidden_layers"]
    per_tok = shard_bytes_per_token(h, x.dtype)
    all_layers = 4 + 1 + (layers + 1) * h * 2
    ids = f"; SGLang ids {sglang_layer_ids(sh.aux, sh.tc['model_type'])}" if x.engine == "sglang" else ""
    return [f"engine {x.engine}{ids}; aux 3x{h} + final {h} per token in {x.dtype}: {per_tok:,} B/token "
            f"-> <= {human_bytes(sh.tokens * per_tok)} for <= {sh.tokens:,} tokens"
            + (" (spans=loss: final rows only on loss tokens, less)" if x.spans == "loss" else ""),
            f"storing all {layers + 1} hidden states in bf16 instead: {all_layers:,} B/token "
            f"({all_layers / per_tok:.1f}x) -> {human_bytes(sh.tokens * all_layers)}",
            *disk_lines(h, sh.cap),
            f"time: {_hours(sh.tokens, ('extract', h, layers, x.dtype))}",
            *(_vllm_lines(cfg, sh) if x.engine == "vllm" else [])]


def _vllm_lines(cfg: RunConfig, sh: _Shape) -> list[str]:
    """The stock vLLM server's command (scripts/launch_vllm_extract.sh runs it) and the disk its files take."""
    h, layers, x = sh.tc["hidden_size"], sh.tc["num_hidden_layers"], cfg.extract
    ids = vllm_layer_ids(sh.aux, layers)
    storage = Path(x.dump_dir or cfg.run_path / "dumps").resolve()
    port = urlparse(x.server_url).port or 8000
    per_tok = len(ids) * h * (4 if cfg.target.dtype == "fp32" else 2)
    cache, (kv, kv_kind), longest = hidden_cache_bytes(ids, h), kv_bytes_per_token(sh.tc), sh.cap + 1
    return [f"vLLM layer ids {ids}: the aux layers as they are (vLLM's id k is the input of layer k) and {layers}, the "
            "last layer's output, which the client puts through the target's final norm for `final`",
            "server: " + shlex.join(server_command(str(cfg.target.model), port, ids, storage,
                                                   cfg.target.trust_remote_code, sh.cap)),
            f"hidden-state cache on every rank, beside the KV cache: {len(ids)} x {h} x 2 B = {cache:,} B/token (bf16; "
            f"the KV cache: {kv:,} B/token, {kv_kind}) -> {human_bytes(cache * longest)} per rank for a sequence of "
            f"--max-model-len {longest:,} (the longest sample + the generated token), {human_bytes((cache + kv) * longest)} "
            "with its KV" + ("" if sh.tc["model_type"] in AUX_OVER_PP else
                             f"; pipeline parallel stays 1 for {sh.tc['model_type']} (the launcher refuses -pp > 1)"),
            f"server files: {len(ids)} x {h} x {per_tok // (len(ids) * h)} B = {per_tok:,} B/token in "
            f"{cfg.target.dtype}, at most {x.dump_budget_mb:,} MiB on disk at once (extract.dump_budget_mb: no new "
            "request above it), each deleted once packed into the shards"]


def _train_lines(cfg: RunConfig, sh: _Shape, world_size: int) -> list[str]:
    t, dc = cfg.train, sh.dc
    params = drafter_params(dc)
    frozen = params["embed_tokens"] + (params["lm_head"] if t.freeze_lm_head else 0)
    trainable = sum(params.values()) - frozen
    bf16 = t.mixed_precision != "fp32"  # auto: bf16 on the GPUs this plans for
    row = t.kernels.pack_length or t.max_len  # packed: up to batch_size rows of pack_length tokens
    mem = train_memory(dc, trainable, t.batch_size, row, t.ttt_steps, bf16, t.kernels)
    unembedded = sum(params.values()) - params["embed_tokens"]
    checkpoint = 4 * unembedded + (2 if bf16 else 4) * params["embed_tokens"] + 8 * trainable
    steps = math.ceil(sh.conversations / (t.batch_size * world_size * t.grad_accum)) * t.epochs
    train_tokens = sh.conversations * min(sh.cap, t.max_len) * t.epochs
    key = ("train", sh.tc["hidden_size"], sh.tc["num_hidden_layers"], "bf16" if bf16 else "fp32")
    speed = TRAIN_SPEED.get((sh.tc["hidden_size"], sh.tc["num_hidden_layers"], t.draft_attention)) if bf16 else None
    lines = [
        f"drafter: {trainable / 1e6:,.1f}M trainable + {frozen / 1e6:,.1f}M frozen params (hidden {dc.hidden_size}, "
        f"{_attention_shape(dc)}, MLP {dc.intermediate_size}, "
        f"draft vocab {dc.draft_vocab_size:,} of {dc.vocab_size:,})",
        _kv_line(sh.tc, dc, t),
        f"memory per GPU ~{human_bytes(sum(mem.values()))} (estimate, {'bf16' if bf16 else 'fp32'} activations, batch "
        f"{t.batch_size} x {row} tokens, K={t.ttt_steps}): " + ", ".join(f"{k} {human_bytes(v)}" for k, v in mem.items()),
        *_measured_memory(speed, row),
        f"disk: 2 checkpoints kept x ~{human_bytes(checkpoint)} (fp32 weights, the embedding, AdamW moments) + the drafter "
        f"export ~{human_bytes(2 * unembedded + dc.vocab_size + 8 * dc.draft_vocab_size)} (bf16, no embedding)",
        f"steps: ceil({sh.conversations:,} / ({t.batch_size} batch x {world_size} processes x {t.grad_accum} accum)) x "
        f"{t.epochs} epochs = {steps:,}",
        *(_measured_time(cfg, sh, speed, world_size) if speed else
          [f"time: {_hours(train_tokens, key)} for <= {train_tokens:,} tokens"])]
    if t.max_len < sh.cap:
        lines.append(f"WARNING: train.max_len {t.max_len:,} < {sh.cap:,}, the longest sample data_gen can write: "
                     "longer samples are cut in training (their tail's tokens never trained on)")
    return lines


def _measured_memory(speed: TrainSpeed | None, row: int) -> list[str]:
    """The measured peak at the longest measured length up to this row's, and whether it reaches the row."""
    if not speed:
        return []
    cells = ", ".join(f"{n:,} tokens {gib:.1f} GiB" for n, gib in sorted(speed.peak_gib.items()))
    top = max(speed.peak_gib)
    return [f"memory per GPU measured: {cells} ({speed.where})"
            + ("" if top >= row else f"; {row:,} tokens not measured: the estimate above holds there")]


def _measured_time(cfg: RunConfig, sh: _Shape, speed: TrainSpeed, world_size: int) -> list[str]:
    """Hours from the measured tokens/s by length, over the stated lengths (cut at train.max_len)."""
    t = cfg.train
    lengths = [min(n, t.max_len) for n in THINKING.quantiles()]
    per_sample = speed.seconds(lengths) / len(lengths)
    efficiency = 1.0 if world_size == 1 else DP_EFFICIENCY
    seconds = sh.conversations * t.epochs * per_sample / (world_size * efficiency)
    rates = ", ".join(f"{n:,}: {r:,.0f}" for n, r in sorted(speed.tokens_per_s.items()))
    return [f"time: ~{_duration(seconds)} on {world_size} GPU(s) for {sh.conversations:,} samples x {t.epochs} epochs "
            f"of {THINKING.what} (mean {sum(lengths) / len(lengths):,.0f} tokens, {sh.conversations * t.epochs * sum(lengths) / len(lengths):,.0f} "
            f"tokens in all)",
            f"  from one GPU's tokens/s by sequence length ({rates}; linear between them, the nearest outside, "
            "which is optimistic below the shortest (a step's fixed costs weigh more there) and above the longest; "
            f"{speed.where})" + (f" x {world_size} GPUs x {DP_EFFICIENCY:.0%} data-parallel efficiency (assumed, not "
                                 "measured)" if world_size > 1 else "")]


def _attention_shape(dc: DrafterConfig) -> str:
    if dc.mla:
        m = dc.mla
        return (f"MLA {dc.num_attention_heads} heads: q_lora {m.q_lora_rank}, kv_lora {m.kv_lora_rank}, qk "
                f"{m.qk_nope_head_dim}+{m.qk_rope_head_dim}, v {m.v_head_dim}")
    return f"{dc.num_attention_heads}/{dc.num_key_value_heads} heads x {dc.head_dim}"


def _kv_line(tc: dict, dc: DrafterConfig, t: TrainConfig) -> str:
    """What serving the drafter costs a server in KV cache beside the target's own (bf16, per token), for each
    draft attention train.draft_attention offers, the run's marked."""
    target, how = kv_bytes_per_token(tc)
    heads, d, m = dc.num_key_value_heads, dc.head_dim, dc.mla or MLAShape.for_target(tc, asdict(t.mla))
    cells = []
    for name, draft, shape in (("gqa", gqa_kv_bytes(heads, d, 1), f"GQA: 2 x {heads} x {d}"),
                               ("mla", mla_kv_bytes(m.kv_lora_rank, m.qk_rope_head_dim, 1),
                                f"MLA: {m.kv_lora_rank} + {m.qk_rope_head_dim}")):
        mark = " <- this run" if name == t.draft_attention else ""
        cells.append(f"{name} {draft / 1024:,.1f} KiB ({shape}, +{100 * draft / target:.0f}%){mark}")
    return (f"draft KV cache per token in bf16 (one layer; +% of the target's while drafting): {', '.join(cells)}; "
            f"the target's {target / 1024:,.1f} KiB ({how})")


def _eval_lines(cfg: RunConfig) -> list[str]:
    e = cfg.eval
    drafting = f"tree {e.draft_tree}" if e.draft_tree else f"chain K={e.draft_steps}"
    return [f"engine {e.engine}: {e.max_prompts} prompts ({e.prompts}) x <= {e.max_new_tokens} new tokens, {drafting}, "
            f"temperature {e.temperature}; baseline and speculative: <= {2 * e.max_prompts * e.max_new_tokens:,} "
            "target tokens"]


def plan(cfg: RunConfig, world_size: int = 1) -> dict[str, list[str]]:
    """{stage: lines} for the four stages, plus "target"."""
    tc = read_target_config(resolve_target(cfg))
    aux = resolve_aux_layers(cfg.extract.aux_layers, tc["num_hidden_layers"])
    t = cfg.train
    dc = DrafterConfig.for_target(tc, aux, min(t.draft_vocab_size, tc["vocab_size"]), DraftVariant.of(tc, t))
    sh = _Shape(tc, aux, dc, conversations(cfg), tokens_cap(cfg))
    return {"target": _target_lines(cfg, sh), "data_gen": _data_gen_lines(cfg, sh), "extract": _extract_lines(cfg, sh),
            "train": _train_lines(cfg, sh, world_size), "eval": _eval_lines(cfg)}


def format_plan(cfg: RunConfig, stages: list[str] | None = None, world_size: int = 1, source: str = "") -> str:
    p = plan(cfg, world_size)
    lines = [f"dry run of {source or cfg.name} -> {cfg.run_path} (nothing loaded, nothing written)"]
    for stage in ["target", *(stages or ["data_gen", "extract", "train", "eval"])]:
        lines += [f"{stage}:"] + [f"  {line}" for line in p[stage]]
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse
    import sys

    from core.run.config import load_config

    parser = argparse.ArgumentParser(prog="core.run.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/smollm2-135m-instruct.yaml", help="run config YAML")
    parser.add_argument("--world-size", type=int, default=1, help="training processes (GPUs) to plan for")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.batch_size=2")
    args = parser.parse_intermixed_args()
    try:
        text = format_plan(load_config(args.config, args.overrides), world_size=args.world_size, source=args.config)
    except UserError as err:
        parser.exit(2, f"core.run.plan: error: {err}\n")
    sys.stdout.write(text + "\n")
